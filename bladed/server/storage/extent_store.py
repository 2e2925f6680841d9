"""The NVMe-direct path: the session's contiguous LBA extent, driven through the channel's io_uring.

Layout (Eq. 3-6): the direct-path KPUs are bound back to back from the
extent's first LBA, each taking ``ceil(max_tokens * token_bytes / LBA)``
blocks.  Inside a KPU the token rows are *packed*: token ``t`` is bytes
``[t * token_bytes, (t + 1) * token_bytes)`` of the KPU, whatever the LBA
size.  When a token row is a whole number of LBAs (the §IV-B precondition)
every token range is whole LBAs and Algorithm 2 maps it straight to
``(slba, bytes)``.  Otherwise a range starts and/or ends inside an LBA (an
*edge*): the store assembles the edge LBAs in a per-channel scratch buffer
from the new bytes plus what the LBA already holds, and writes whole LBAs.

What an edge LBA already holds comes, in order of preference, from

* the KPU's *tail*: the daemon keeps a copy of each KPU's last, partly
  filled LBA, so a decode-step append (the common case) and the last LBA of a
  read never touch the device for it;
* nothing: bytes at or past the KPU's fill mark were never written and are
  zero on the device (blocks are scrubbed before they are handed out, and the
  store writes zeroes past the new bytes of a fresh LBA);
* a read of that LBA (read-modify-write; only for writes inside data already
  written, never for appends).

A session's store defers the last LBA of an append (``defer_tail``): the
tail copy keeps it until the appends after it fill it, and only then is it
written, once (``edges.Tail``: a decode step's one-token append of a row
smaller than an LBA writes no LBA at all until the LBA is full; without this,
768-byte rows on 4 KiB LBAs wrote 5.3 times their bytes). Reads of that LBA
take the copy, whether it is an edge of the read or in its middle. A retained
prefix's store writes everything at once: the prefix must survive a restart.

(The edges and tails themselves are ``edges``'s bookkeeping; this module does the I/O.)

The middle of a range (its whole LBAs) moves by DMA straight between the
device and the client's staging slot (Co-DMA, §IV-B) when the slot offset has
the same alignment as the KPU offset (always true for the default, mirrored
slot layout); otherwise it goes through a bounce buffer.  All commands of a
request are submitted to the channel's ring together.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from bladed.io import BladedIOError, Op, StagingBuffer, Transfer
from bladed.io.pagecache import PageCacheFile
from bladed.protocol import ErrorCode
from bladed.residency.extents import Extent, ExtentMap
from bladed.residency.planner import KPU, KVPath, Plan
from bladed.server.storage.base import Access, ChannelIO, KPUStore
from bladed.server.storage.edges import Edge, Tail, edges_of
from bladed.server.storage.gates import KPUGates
from bladed.sizes import PAGE_SIZE, align_up, ceil_div

log = logging.getLogger("bladed.storage")

#: bounce buffer for ranges whose slot offset is not aligned like their KPU offset, and for extent moves
BOUNCE_BYTES = 1 << 20
#: a live demotion writes its KPU in pieces of this size, this many in flight, freeing each written piece's pages
DEMOTION_PIECE = 4 << 20
DEMOTION_DEPTH = 4
#: edge LBAs one channel's scratch holds before it grows (two per range of a request)
EDGE_LBAS = 16


class DemotionError(BladedIOError):
    """A live demotion failed part-way: ``adopted`` are the KPUs moved before it (theirs is done), the rest stay
    where they were with every byte; ``cause`` is the error."""

    def __init__(self, message: str, adopted: tuple[KPU, ...], cause: BaseException) -> None:
        super().__init__(getattr(cause, "errno", None) or errno.EIO, message)
        self.adopted = adopted
        self.cause = cause


class _Job:
    """One KPU of a demotion: its file, where it goes, and how much of it is written and freed."""

    def __init__(self, kpu: KPU, source: PageCacheFile, slba: int, filled: int, lba: int) -> None:
        self.kpu, self.source, self.slba, self.filled, self.lba = kpu, source, slba, filled, lba
        # past the fill the file holds zeroes, as a fresh LBA does: whole LBAs go as they are
        self.nbytes = align_up(filled, lba)
        self.tail = Tail(fill=filled)
        self.mem: Any = None
        self.landed: set[int] = set()        # offsets of the pieces written
        self.written_to = 0                  # [0, written_to) is on the device
        self.freed = 0                       # [0, freed) is gone from the file
        self.finished = self.nbytes == 0
        self._stack: contextlib.ExitStack | None = None

    def open(self, outer: contextlib.ExitStack) -> None:
        """Map the file (kept mapped until :meth:`finish`) and take the tail copy: the LBA the fill ends in,
        before any of its pages goes."""
        if not self.nbytes:
            return
        self._stack = outer.enter_context(contextlib.ExitStack())
        self.mem = self._stack.enter_context(self.source.mapped())
        L = self.lba
        last = memoryview(bytes(self.mem[(self.filled - 1) // L * L:][:L])) if self.filled % L else None
        self.tail.filled_to(self.filled, L, last)

    def landed_piece(self, off: int) -> None:
        """The piece at ``off`` is written: free the whole pages of the written prefix that grew (the last,
        partial one goes with the file)."""
        self.landed.add(off)
        while self.written_to in self.landed:
            self.written_to = min(self.nbytes, self.written_to + DEMOTION_PIECE)
        self.finished = self.written_to >= self.nbytes
        end = self.written_to
        if end < self.source.nbytes:
            end -= end % PAGE_SIZE
        if end > self.freed:
            self.source.punch(self.freed, end - self.freed)
            self.freed = end

    def finish(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def restore(self, ch: ChannelIO) -> None:
        """Read the freed prefix back from the device into the file (a failed demotion)."""
        try:
            if self.freed:
                ch.engine.read(self.slba, self.mem, nbytes=self.freed)
                log.warning("demotion of %s failed after %d bytes of it were written and freed; read back %d bytes "
                            "into its file", self.kpu.name, self.freed, self.freed)
        except (OSError, BladedIOError) as e:
            self.source.lose(f"its bytes [0, {self.freed}) were freed after they reached the device, and reading "
                             f"them back failed: {e}")
            raise
        finally:
            self.finish()


def _waves(accesses: list[Access]) -> list[list[Access]]:
    """The accesses as batches run one after another: one batch unless a KPU named more than once has a write
    among its ranges; then its ``k``-th range goes in batch ``k`` (the others' ranges in the first)."""
    count: dict[int, int] = {}
    writes: set[int] = set()
    for a in accesses:
        count[a.kpu.tensor_id] = count.get(a.kpu.tensor_id, 0) + 1
        if a.write:
            writes.add(a.kpu.tensor_id)
    if all(count[t] == 1 for t in writes):
        return [accesses]
    waves: list[list[Access]] = []
    seen: dict[int, int] = {}
    for a in accesses:
        t = a.kpu.tensor_id
        k = seen[t] = seen.get(t, -1) + 1 if t in writes else 0
        while len(waves) <= k:
            waves.append([])
        waves[k].append(a)
    return waves


class ExtentKPUStore(KPUStore):
    """The direct-path KPUs of one session on its extent (the packed layout above)."""

    path: ClassVar[KVPath] = KVPath.DIRECT

    def __init__(self, plan: Plan, extent: Extent | None, channels: int, *, defer_tail: bool = False) -> None:
        self.lba = plan.lba_size
        #: keep an append's last, partly filled LBA in its tail copy until it is full (module docstring)
        self.defer_tail = defer_tail
        self.token_bytes = plan.geometry.token_bytes
        self.map = ExtentMap(plan, extent)
        self._kpus = {k.tensor_id: k for k in plan.direct_kpus()}
        self._tails = {t: Tail() for t in self._kpus}
        self._scratch: list[StagingBuffer | None] = [None] * channels
        self._bounce: list[StagingBuffer | None] = [None] * channels
        self._lock = threading.Lock()
        #: held by a demotion from binding its KPU to the end of its copy (:meth:`adopt`)
        self._moving = threading.Lock()
        self.rmw_reads = 0      # edge LBAs read back before a write (writes inside written data)
        self.tail_hits = 0      # edge LBAs served from the tail copy
        self.deferred_lbas = 0  # appends' last LBAs kept in the tail copy instead of written

    @property
    def extent(self) -> Extent | None:
        return self.map.extent

    def holds(self, tensor_id: int) -> bool:
        return tensor_id in self._kpus

    def offer_gate(self, kpu: KPU, gates: KPUGates) -> bool:
        """A direct KPU may be served by the lane if its token rows are whole LBAs (packed rows never: their
        edges are this store's), once it is bound and used on the extent; the gate holds its first LBA."""
        t = kpu.tensor_id
        if not self.map.plan.aligned:
            return True
        return self.holds(t) and self.map.is_materialized(t) and gates.open_direct(t, self.map.lookup(t)[0],
                                                                                   kpu.nbytes)

    # -- per-channel buffers ----------------------------------------------------------
    def prepare(self) -> None:
        """Map every channel's edge scratch now (before a KPU is moved here: MemoryError refuses the move)."""
        if not self.map.plan.aligned:
            for ch in range(len(self._scratch)):
                self._scratch_for(ch, 2)

    def _scratch_for(self, ch: int, lbas: int) -> StagingBuffer:
        buf = self._scratch[ch]
        need = lbas * self.lba
        if buf is None or buf.nbytes < need:
            buf = StagingBuffer(align_up(max(need, EDGE_LBAS * self.lba), PAGE_SIZE))
            old, self._scratch[ch] = self._scratch[ch], buf
            if old is not None:
                old.close()
        return buf

    def _bounce_for(self, ch: int) -> StagingBuffer:
        buf = self._bounce[ch]
        if buf is None:
            buf = self._bounce[ch] = StagingBuffer(max(BOUNCE_BYTES, 2 * self.lba))
        return buf

    # -- serving -------------------------------------------------------------------------
    def run(self, ch: ChannelIO, accesses: list[Access]) -> None:
        """Serve the accesses with all their commands submitted together (a KPU's reads too: a sparse read's
        runs). A KPU named more than once with a write among its ranges runs in waves, one of its ranges a
        wave: its edge LBAs and its tail copy are one range's at a time (two ranges may share an edge LBA)."""
        tids = sorted({a.kpu.tensor_id for a in accesses})              # lock order
        tails = [self._tails[t] for t in tids]
        for t in tails:
            t.lock.acquire()
        try:
            for wave in _waves(accesses):
                fast: list[Access] = []
                slow: list[Access] = []
                for a in sorted(wave, key=lambda a: a.kpu.tensor_id):
                    aligned_slot = (a.slot_offset - a.offset) % self.lba == 0
                    (fast if aligned_slot else slow).append(a)
                if fast:
                    self._run_fast(ch, fast)
                for a in slow:
                    self._run_bounced(ch, a)
        finally:
            for t in tails:
                t.lock.release()

    def _run_fast(self, ch: ChannelIO, accesses: list[Access]) -> None:
        L = self.lba
        eng, slot = ch.engine, ch.slot
        started = time.monotonic_ns()
        # two edges per range, and a dirty tail a write must send first
        nedges = sum(2 for a in accesses if a.offset % L or (a.offset + a.nbytes) % L) + \
            sum(1 for a in accesses if a.write and self._tails[a.kpu.tensor_id].dirty)
        try:
            scratch = self._scratch_for(ch.index, nedges) if nedges else None
        except MemoryError as no_memory:
            for a in accesses:
                a.fail(ErrorCode.IO_ERROR, f"direct {a.op.name.lower()} of {a.kpu.name}: no memory for the edge "
                                           f"LBAs of {len(accesses)} ranges ({no_memory}); send fewer ranges per "
                                           "request")
            return
        plans: list[tuple[Access, int, list[Edge]]] = []
        rmw: list[tuple[int, Transfer]] = []           # (access index, read of an edge to complete)
        deferred: set[int] = set()                     # accesses whose last edge LBA stays in the tail copy
        flushes: list[tuple[int, Edge]] = []           # dirty tails a write leaves behind: written first
        used = 0
        for i, a in enumerate(accesses):
            base = self.map.lookup(a.kpu.tensor_id)[0]
            tail = self._tails[a.kpu.tensor_id]
            edges = edges_of(a.offset, a.nbytes, L, used)
            used += len(edges) * L
            plans.append((a, base, edges))
            o1 = a.offset + a.nbytes
            if a.write and tail.dirty and a.offset // L > tail.block and o1 >= tail.fill:
                # the write starts past the dirty tail's LBA and moves the fill mark: the copy is replaced, so
                # its LBA goes to the device now (the rest of it is zero, as on a fresh LBA)
                assert scratch is not None
                flushes.append((i, Edge(tail.block, used, 0, L)))
                scratch.view()[used:used + L] = tail.data
                used += L
            if a.write and self.defer_tail and o1 % L and o1 >= tail.fill and edges:
                deferred.add(i)
                self.deferred_lbas += 1
            if not edges:
                continue
            assert scratch is not None
            sv = scratch.view()
            for e in edges:
                if not a.write:
                    if e.block == tail.block:
                        sv[e.scratch:e.scratch + L] = tail.data
                        e.from_tail = True
                        self.tail_hits += 1
                    continue
                # a write: what the LBA holds outside [lo, hi) must be kept
                if e.lo == 0 and e.hi == L:
                    continue
                if e.block == tail.block:
                    sv[e.scratch:e.scratch + L] = tail.data
                    self.tail_hits += 1
                elif e.block * L >= tail.fill:
                    ctypes.memset(scratch.address + e.scratch, 0, L)   # never written: zero on the device
                else:
                    self.rmw_reads += 1
                    rmw.append((i, eng.transfer(Op.READ, base + e.block, scratch, offset=e.scratch, nbytes=L)))
        failed: dict[int, BladedIOError] = {}
        if rmw:
            eng.run([x for _, x in rmw], check=False)
            for i, x in rmw:
                err = x.error()
                if err is not None:
                    failed.setdefault(i, err)
        # every command of the request in one go: the device sees the whole batch
        xfers: list[tuple[int, Transfer]] = []
        for i, e in flushes:
            assert scratch is not None
            xfers.append((i, eng.transfer(Op.WRITE, plans[i][1] + e.block, scratch, offset=e.scratch, nbytes=L)))
        for i, (a, base, edges) in enumerate(plans):
            if i in failed:
                continue
            op = Op.WRITE if a.write else Op.READ
            if scratch is not None and a.write:
                sv = scratch.view()
                for e in edges:
                    src = a.slot_offset + (e.block * L + e.lo - a.offset)
                    sv[e.scratch + e.lo:e.scratch + e.hi] = slot.view(src, e.hi - e.lo)
            for j, e in enumerate(edges):
                if e.from_tail or (i in deferred and j == len(edges) - 1):
                    continue                   # served from the tail copy, or kept there (deferred)
                assert scratch is not None
                xfers.append((i, eng.transfer(op, base + e.block, scratch, offset=e.scratch, nbytes=L)))
            m0, m1 = ceil_div(a.offset, L), (a.offset + a.nbytes) // L
            if m1 > m0:
                # Algorithm 2 for a box of whole token rows: slba = start + offset / LBA (line 5)
                xfers.append((i, eng.transfer(op, base + m0, slot, offset=a.slot_offset + m0 * L - a.offset,
                                              nbytes=(m1 - m0) * L)))
        if xfers:
            # writes first: the ring issues transfers in order, and an append must not wait for a bulk read's
            # last piece to be issued (a KPU's ranges in one batch are reads, or one write: their order is free)
            xfers.sort(key=lambda ix: ix[1].op is not Op.WRITE)
            eng.run([x for _, x in xfers], check=False)
            for i, x in xfers:
                err = x.error()
                if err is not None:
                    failed.setdefault(i, err)
        for i, (a, _base, edges) in enumerate(plans):
            tail = self._tails[a.kpu.tensor_id]
            if i in failed:
                if a.write:
                    tail.write_failed(a.offset + a.nbytes)
                a.fail(ErrorCode.IO_ERROR, f"direct {a.op.name.lower()} of {a.kpu.name}: {failed[i]}")
                continue
            if a.write:
                tail.after_write(a.offset + a.nbytes, L, edges, scratch, deferred=i in deferred)
            else:
                if edges:
                    assert scratch is not None
                    sv = scratch.view()
                    for e in edges:
                        dst = a.slot_offset + (e.block * L + e.lo - a.offset)
                        slot.view(dst, e.hi - e.lo)[:] = sv[e.scratch + e.lo:e.scratch + e.hi]
                m0, m1 = ceil_div(a.offset, L), (a.offset + a.nbytes) // L
                if tail.dirty and m0 <= tail.block < m1:
                    # a whole LBA of the read that the device does not hold yet: the copy's bytes
                    slot.view(a.slot_offset + tail.block * L - a.offset, L)[:] = tail.data
            a.served(KVPath.DIRECT, started)

    def _run_bounced(self, ch: ChannelIO, a: Access) -> None:
        """A range whose slot offset is not aligned like its KPU offset: whole LBAs through the bounce buffer."""
        L = self.lba
        started = time.monotonic_ns()
        eng, slot = ch.engine, ch.slot
        tail = self._tails[a.kpu.tensor_id]
        base = self.map.lookup(a.kpu.tensor_id)[0]
        try:
            bounce = self._bounce_for(ch.index)
        except MemoryError as e:
            a.fail(ErrorCode.IO_ERROR, f"direct {a.op.name.lower()} of {a.kpu.name}: no memory for a bounce "
                                       f"buffer ({e}); use a slot offset aligned like the token offset")
            return
        bv = bounce.view()
        o0, o1 = a.offset, a.offset + a.nbytes
        per = bounce.nbytes // L
        b = o0 // L
        try:
            if a.write and tail.dirty and b > tail.block and o1 >= tail.fill:
                # the write moves the fill mark past the dirty tail's LBA: that LBA goes to the device first
                bv[:L] = tail.data
                eng.write(base + tail.block, bounce, nbytes=L)
                tail.dirty = False
            while b * L < o1:
                k = min(per, ceil_div(o1 - b * L, L))              # whole LBAs [b, b + k) in this piece
                lo, hi = max(o0, b * L), min(o1, (b + k) * L)      # the access's KPU bytes among them
                rel, src = lo - b * L, a.slot_offset + lo - o0
                dirty_here = tail.dirty and b <= tail.block < b + k   # the device does not hold that LBA yet
                if not a.write:
                    eng.read(base + b, bounce, nbytes=k * L)
                    if dirty_here:
                        bv[(tail.block - b) * L:(tail.block - b + 1) * L] = tail.data
                    slot.view(src, hi - lo)[:] = bv[rel:rel + hi - lo]
                else:
                    if lo > b * L or hi < (b + k) * L:             # partly covered: keep what else is there
                        if b * L >= tail.fill:
                            ctypes.memset(bounce.address, 0, k * L)
                        else:
                            self.rmw_reads += 1
                            eng.read(base + b, bounce, nbytes=k * L)
                        if dirty_here:
                            bv[(tail.block - b) * L:(tail.block - b + 1) * L] = tail.data
                    bv[rel:rel + hi - lo] = slot.view(src, hi - lo)
                    eng.write(base + b, bounce, nbytes=k * L)
                    if b <= tail.block < b + k:
                        tail.data[:] = bv[(tail.block - b) * L:(tail.block - b + 1) * L]
                        tail.dirty = False
                    if hi == o1 and o1 >= tail.fill:
                        last = (o1 - 1) // L - b
                        tail.filled_to(o1, L, bv[last * L:(last + 1) * L])
                b += k
        except BladedIOError as e:
            if a.write:
                tail.write_failed(o1)
            a.fail(ErrorCode.IO_ERROR, f"direct {a.op.name.lower()} of {a.kpu.name}: {e}")
            return
        a.served(KVPath.DIRECT, started)

    # -- live demotion -----------------------------------------------------------------------
    def adopt_many(self, moves: Sequence[tuple[KPU, PageCacheFile, int]], ch: ChannelIO,
                   extent_with_room: Callable[[int], object], adopted: Callable[[KPU, int], None]) -> None:
        """Move KPUs here from their page-cache files: bind each after the last KPU, copy its filled bytes.

        ``moves`` are ``(kpu, its file, its filled bytes)``, in the order they go.  ``extent_with_room(nblocks)``
        gives the map (:meth:`ExtentMap.place`) an extent with room for ``nblocks`` more blocks after the last
        bound KPU (allocating or growing it), once for all of them.  An earlier try that bound a KPU but failed
        to copy reuses its LBAs.  The bytes go to the device straight from the files' mappings, one stream of
        pieces across the KPUs (:meth:`_write_out`: the queue stays full from one KPU to the next), and each
        piece's pages are freed once it is written: a memory file gives its memory back at the device's write
        speed, from the first piece on.  ``adopted(kpu, nbytes)`` runs as each KPU's last piece is written (the
        caller drops its file then).  Raises (OSError, BladedIOError, MemoryError, RegionFullError)
        :class:`DemotionError` on failure, naming the KPUs adopted before it; the others are not served from
        here and their files hold their bytes again.
        """
        L = self.lba
        self.prepare()
        # one move at a time, bind and copy together: extent_with_room() may move the extent, never under a copy
        with self._moving:
            unbound = [k for k, _, _ in moves if k.tensor_id not in self.map]
            if unbound:
                extent_with_room(sum(k.padded_bytes for k in unbound) // L)
            jobs = []
            for kpu, source, filled in moves:
                slba = self.map.lookup(kpu.tensor_id)[0] if kpu.tensor_id in self.map else self.map.add(kpu)[0]
                jobs.append(_Job(kpu, source, slba, filled, L))
            done: list[KPU] = []

            def written(job: _Job) -> None:
                with self._lock:
                    self._kpus[job.kpu.tensor_id] = job.kpu
                    self._tails[job.kpu.tensor_id] = job.tail
                done.append(job.kpu)
                adopted(job.kpu, job.filled)

            try:
                self._write_out(jobs, ch, written)
            except DemotionError:
                raise
            except (OSError, BladedIOError, MemoryError, ValueError) as e:
                raise DemotionError(str(e), tuple(done), e) from e

    def _write_out(self, jobs: list[_Job], ch: ChannelIO, written: Callable[[_Job], None]) -> None:
        """Write each job's ``[0, nbytes)`` from its file's mapping to its ``slba`` on, :data:`DEMOTION_DEPTH`
        pieces of :data:`DEMOTION_PIECE` in flight across the jobs, freeing each file's written prefix as it grows;
        ``written(job)`` once a job's every piece is written (its mapping let go first).

        On a failure nothing more is submitted; each job not yet written whole has its freed pages read back from
        the device into its file, so it holds every byte again, and the write's error is raised (if that read
        fails too, the file's bytes are gone: the file is marked lost, its reads fail, and the read's error is
        raised)."""
        L = self.lba
        with contextlib.ExitStack() as stack:
            for job in jobs:
                job.open(stack)
            pieces = [(job, off, min(DEMOTION_PIECE, job.nbytes - off)) for job in jobs
                      for off in range(0, job.nbytes, DEMOTION_PIECE)]
            for job in jobs:
                if not job.nbytes:
                    job.finish()
                    written(job)
            inflight: dict[int, Transfer] = {}
            nxt = 0
            error: BaseException | None = None
            while (nxt < len(pieces) and error is None) or inflight:
                while error is None and nxt < len(pieces) and len(inflight) < DEMOTION_DEPTH:
                    job, off, n = pieces[nxt]
                    try:
                        inflight[nxt] = ch.engine.submit(Op.WRITE, job.slba + off // L, job.mem, offset=off, nbytes=n,
                                                         tag=nxt)
                    except (OSError, BladedIOError, ValueError) as e:
                        error = e
                        break
                    nxt += 1
                if not inflight:
                    break
                for x in ch.engine.wait(1):
                    inflight.pop(x.tag, None)
                    job, off, _ = pieces[x.tag]
                    if not x.ok:
                        error = error or x.error()
                        continue
                    if error is not None:
                        continue
                    try:
                        job.landed_piece(off)
                        if job.finished:
                            job.finish()
                            written(job)
                    except (OSError, BladedIOError) as e:
                        error = e
            if error is None:
                return
            for job in jobs:
                if not job.finished:
                    job.restore(ch)
            raise error

    def served(self) -> list[int]:
        """Tensor ids served from the extent now (bound at open, or moved here and copied)."""
        return list(self._kpus)

    def move(self, extent: Extent, ch: ChannelIO, filled: Callable[[int], int]) -> int:
        """Copy the written bytes of every KPU served here to the same offset in ``extent``, then rebind the
        map there (:meth:`ExtentMap.relocate`); returns the bytes copied.

        For a demotion whose room cannot grow in place: :meth:`adopt`'s ``extent_with_room`` calls this, so no
        other move runs; the caller holds every served KPU idle (``DemotionState.holding``).  ``filled(t)`` is how
        many bytes of KPU ``t`` either path has written; past them the new run reads zero, as a fresh one does.
        On failure the map stays on its old extent and the new one may hold part of the copy.
        """
        L = self.lba
        copied = 0
        with StagingBuffer(BOUNCE_BYTES) as buf:
            for t in self.served():
                old, n = self.map.lookup(t)
                new = extent.start + old - self.map.extent_start
                nbytes = min(align_up(max(filled(t), self._tails[t].fill), L), n * L)
                for off in range(0, nbytes, buf.nbytes):
                    k = min(buf.nbytes, nbytes - off)
                    ch.engine.read(old + off // L, buf, nbytes=k)
                    ch.engine.write(new + off // L, buf, nbytes=k)
                copied += nbytes
        self.map.relocate(extent)
        return copied

    def assume_written(self, nbytes: int) -> None:
        """Every KPU holds ``nbytes`` written bytes already (a retained prefix rebuilt after a restart): edge LBAs
        below that are read from the device, not taken as never written."""
        with self._lock:
            for tail in self._tails.values():
                tail.fill = max(tail.fill, nbytes)
                tail.forget()

    def close(self) -> Extent | None:
        """Free the buffers; return the extent for the caller to scrub and free."""
        for bufs in (self._scratch, self._bounce):
            for i, b in enumerate(bufs):
                if b is not None:
                    b.close()
                    bufs[i] = None
        return self.map.release()


__all__ = ["BOUNCE_BYTES", "ExtentKPUStore"]
