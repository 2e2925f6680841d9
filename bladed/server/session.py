"""Sessions: open (plan, bind, map the client's staging memory), batched requests, teardown.

A session belongs to the connection that opened it and can only address its
own KPUs.  Opening one runs the paper's Plan and Bind steps (§IV-A): the
budgeter gives ``B_pc`` (Eq. 1-2), minus what live sessions already hold in
the page cache; Algorithm 1 splits the KPUs between a page-cache store and an
extent store (``bladed.server.stores``); the direct-path KPUs get one
contiguous extent laid out back to back (Eq. 3-6).  Files and LBAs are
materialised by the first request that touches them.

A request is a batch of token ranges on one channel: :meth:`Session.execute`
checks all of them first (a bad one refuses the whole request, nothing done),
then hands each store its share, all under the channel's lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import mmap
import os
import secrets
import stat
import threading
import time
from collections.abc import Sequence
from typing import Any

from bladed.config import Config
from bladed.io import Engine, ExtentDevice, StagingBuffer
from bladed.protocol import MIRROR, NO_HIT, ErrorCode, IOOp, IORange, RangeResult, RequestError, ServedRow, get_field
from bladed.residency.budget import BudgetBreakdown, Budgeter
from bladed.residency.extents import Extent, ExtentAllocator, RegionFullError
from bladed.residency.geometry import GEOMETRY_FIELDS, Geometry, tensor_id, tensor_of
from bladed.residency.planner import BudgetLedger, Mode, Plan, plan_session
from bladed.server.channel import Channel
from bladed.server.events import Peer, event
from bladed.server.integrity import Checksums
from bladed.server.lifecycle import scrub_and_free
from bladed.server.metrics import Stats
from bladed.server.prefix import PrefixCache
from bladed.server.replan import LiveReplanner, LiveState
from bladed.server.state import QUARANTINED, Journal, SessionRecord
from bladed.server.stores import Access, ChannelIO, ExtentKPUStore, PageCacheKPUStore
from bladed.server.stores.extent import BOUNCE_BYTES
from bladed.sizes import PAGE_SIZE, align_up

log = logging.getLogger("bladed.session")

#: room for the daemon's own heap growth while it serves sessions (``working_reserve_bytes``)
HEAP_RESERVE_BYTES = 4 << 20

#: the open_session reply lists every KPU (2 per layer, at most 164 bytes each): 2048 layers keep the worst-case
#: reply at about 698 KB, 67% of MAX_FRAME_BYTES (docs/protocol.md, "Limits")
MAX_LAYERS = 2048


class Session:
    """One open session: plan, stores, staging mapping and channels."""

    def __init__(self, sid: str, peer: Peer, geometry: Geometry, plan: Plan, budget: dict[str, Any],
                 stats: Stats) -> None:
        self.id = sid
        self.peer = peer
        self.geometry = geometry
        self.plan = plan
        self.budget = budget
        self.stats = stats
        self.opened = time.time()
        #: what a data connection presents to attach to one of this session's channels
        self.attach_token = secrets.token_hex(16)
        #: the two stores (``bladed.server.stores``), made when the session is bound
        self.pagecache: PageCacheKPUStore | None = None
        self.extent_store: ExtentKPUStore | None = None
        self.mapping: mmap.mmap | None = None
        self.staging_bytes = 0
        self.slot_bytes = 0
        self.slot_stride = 0
        self.channels: list[Channel] = []
        self.closing = False
        #: per-token-row crc32c (``checksums`` in open_session); None = off
        self.checksums: Checksums | None = None
        #: bytes Write-Zeroed at teardown (devices that do not read zeroes after a deallocate)
        self.zeroed_bytes = 0
        #: page-cache files removed at teardown
        self.files_removed = 0
        self.live = LiveState(self)
        #: (model, dtype) of the prefix key it was opened with (``retain`` reuses them); None = none given
        self.prefix_key: tuple[str, str] | None = None
        #: the ``prefix`` object of the open_session reply (None = not asked)
        self.prefix_reply: dict[str, Any] | None = None
        self._attached: set[Any] = set()
        self._attach_lock = threading.Lock()

    @property
    def extent(self) -> Extent | None:
        return None if self.extent_store is None else self.extent_store.extent

    def stores(self) -> tuple[PageCacheKPUStore, ExtentKPUStore]:
        """The page-cache and extent stores (a session that is not bound has none)."""
        if self.pagecache is None or self.extent_store is None:
            raise RequestError(ErrorCode.NO_SUCH_SESSION, f"session {self.id} is not open")
        return self.pagecache, self.extent_store

    @property
    def storage_bytes(self) -> int:
        """What the session holds on storage (page-cache files + extent), for quotas."""
        pc = sum(k.pagecache_bytes for k in self.plan.pagecache_kpus())
        return pc + self.plan.direct_bytes

    def layout(self) -> dict[str, Any]:
        g = self.geometry
        ext = self.extent
        return {"channels": len(self.channels), "token_bytes": g.token_bytes, "kpu_bytes": g.kpu_bytes,
                "max_tokens": g.max_tokens, "slot_bytes": self.slot_bytes, "slot_stride": self.slot_stride,
                "staging_bytes": self.staging_bytes, "attach_token": self.attach_token,
                "extent": None if ext is None else {"start": ext.start, "nblocks": ext.nblocks},
                "registered": [c.engine.registered for c in self.channels]}

    def open_reply(self) -> dict[str, Any]:
        """The fields of the ``open_session`` reply: session id, plan (with the budget sample) and layout."""
        plan = self.plan.to_dict()
        plan["budget"] = self.budget
        out = {"session": self.id, "plan": plan, "layout": self.layout()}
        if self.prefix_reply is not None:
            out["prefix"] = self.prefix_reply
        return out

    def describe(self) -> dict[str, Any]:
        p = self.plan
        ext = self.extent
        return {
            "session": self.id, "uid": self.peer.uid, "pid": self.peer.pid, "mode": p.mode.value,
            "channels": len(self.channels), "geometry": self.geometry.to_dict(), "opened": self.opened,
            "group1_layers": p.group1_layers, "group1_limit_bytes": p.group1_limit_bytes,
            "budget_bytes": p.budget_bytes, "group1_kpus": len(p.group1()), "group2_kpus": len(p.group2()),
            "pagecache_bytes": sum(k.pagecache_bytes for k in p.pagecache_kpus()),
            "direct_bytes": p.direct_bytes, "storage_bytes": self.storage_bytes,
            "extent": None if ext is None else {"start": ext.start, "nblocks": ext.nblocks},
            "ops": sum(c.ops for c in self.channels),
            "busy_s": sum(c.busy_ns for c in self.channels) / 1e9,
            "lane_requests": sum(c.lane_requests for c in self.channels),
            "attached": len(self._attached),
        } | self.live.to_dict()

    # -- data connections -------------------------------------------------------------
    def attach(self, conn: Any) -> None:
        """Register a data connection (torn down with the session)."""
        with self._attach_lock:
            if self.closing:
                raise RequestError(ErrorCode.NO_SUCH_SESSION, f"session {self.id} is closing")
            self._attached.add(conn)

    def detach(self, conn: Any) -> None:
        with self._attach_lock:
            self._attached.discard(conn)

    # -- requests -------------------------------------------------------------------------
    def json_range(self, op: str, body: dict[str, Any]) -> tuple[int, IORange]:
        """A JSON ``read``/``write`` request as (channel, range)."""
        g = self.geometry
        layer = get_field(body, "layer", int)
        kind = get_field(body, "kind", str)
        ch = get_field(body, "channel", int)
        start = get_field(body, "token_start", int, default=0)
        if not 0 <= layer < g.layers:
            raise RequestError(ErrorCode.OUT_OF_RANGE, f"layer {layer} outside 0..{g.layers - 1}")
        if kind not in ("k", "v"):
            raise RequestError(ErrorCode.OUT_OF_RANGE, f"kind must be 'k' or 'v', got {kind!r}")
        if not 0 <= start < g.max_tokens:
            raise RequestError(ErrorCode.OUT_OF_RANGE, f"token_start {start} outside 0..{g.max_tokens - 1}")
        n = get_field(body, "ntokens", int, default=g.max_tokens - start)
        return ch, IORange(IOOp.WRITE if op == "write" else IOOp.READ, tensor_id(layer, kind), start, n)

    def channel(self, index: int) -> Channel:
        if not 0 <= index < len(self.channels):
            raise RequestError(ErrorCode.OUT_OF_RANGE, f"channel {index} outside 0..{len(self.channels) - 1}")
        return self.channels[index]

    def _check(self, ranges: Sequence[IORange], limit: int) -> list[tuple[IORange, int, int, int]]:
        """Every range checked before anything runs: ``(range, kpu offset, bytes, slot offset)`` each."""
        g = self.geometry
        tb, ntensors, max_tokens, slot_bytes = g.token_bytes, 2 * g.layers, g.max_tokens, self.slot_bytes
        n = len(ranges)
        if n > limit:
            raise RequestError(ErrorCode.BAD_REQUEST, f"a request of {n} ranges exceeds "
                                                      f"io.max_outstanding ({limit}); split it")
        out = []
        seen: set[int] = set()
        for i, r in enumerate(ranges):
            tid, t0, nt = r.tensor_id, r.token_start, r.ntokens
            nbytes = nt * tb
            so = t0 * tb if r.slot_offset == MIRROR else r.slot_offset
            if not 0 <= tid < ntensors or tid in seen or nt < 1 or t0 + nt > max_tokens or so + nbytes > slot_bytes:
                self._refuse_range(i, n, r, so, nbytes, seen)
            seen.add(tid)
            out.append((r, t0 * tb, nbytes, so))
        if n > 1:
            spans = sorted((so, so + nb, i) for i, (_, _, nb, so) in enumerate(out))
            for (_, e1, i1), (s2, _, i2) in itertools.pairwise(spans):
                if s2 < e1:
                    raise RequestError(ErrorCode.BAD_REQUEST, f"ranges {min(i1, i2)} and {max(i1, i2)} overlap in the "
                                                              "staging slot; give them disjoint slot offsets")
        return out

    def _refuse_range(self, i: int, n: int, r: IORange, so: int, nbytes: int, seen: set[int]) -> None:
        """The RequestError for range ``i`` of ``n`` that :meth:`_check` found bad, naming it."""
        g = self.geometry
        where = f"range {i}" if n > 1 else "the range"
        layer, kind = tensor_of(r.tensor_id)
        if not 0 <= r.tensor_id < 2 * g.layers:
            raise RequestError(ErrorCode.OUT_OF_RANGE, f"{where}: layer {layer} {kind.upper()} (tensor "
                                                       f"{r.tensor_id}) outside the session's layers "
                                                       f"0..{g.layers - 1}")
        if r.tensor_id in seen:
            raise RequestError(ErrorCode.BAD_REQUEST, f"{where}: layer {layer} {kind.upper()} appears twice in "
                                                      "one request; send the second range in another request")
        end = r.token_start + r.ntokens
        if r.ntokens < 1 or end > g.max_tokens:
            raise RequestError(ErrorCode.OUT_OF_RANGE, f"{where}: tokens [{r.token_start}, {end}) outside the "
                                                       f"KPU's 0..{g.max_tokens} tokens")
        raise RequestError(ErrorCode.OUT_OF_RANGE, f"{where}: slot bytes [{so}, {so + nbytes}) outside the "
                                                   f"channel's {self.slot_bytes}-byte slot")

    def execute(self, ch_index: int, ranges: Sequence[IORange], limit: int) -> list[RangeResult]:
        """Run one request (a batch of ranges) on channel ``ch_index``; one result per range, in order.

        A range that is out of bounds refuses the whole request (RequestError,
        nothing done); a range that fails while running fails alone.
        """
        ch = self.channel(ch_index)
        checked = self._check(ranges, limit)
        with ch.lock:
            if self.closing:
                raise RequestError(ErrorCode.NO_SUCH_SESSION, f"session {self.id} is closing")
            t0 = time.monotonic_ns()
            results = self._run(ch, checked)
            ch.account(time.monotonic_ns() - t0, len(results))
        return results

    def transfer(self, ch: Channel, ranges: Sequence[IORange]) -> list[RangeResult]:
        """Run ``ranges`` on a channel of the daemon's own (a retained prefix's copy), not one of the session's.

        The caller keeps the session's channels from serving meanwhile (a session not yet opened, or
        every channel lock held), so the stores' per-channel buffers of channel 0 are free.
        """
        return self._run(ch, self._check(ranges, len(ranges)))

    def filled_tokens(self) -> int:
        """Tokens ``[0, n)`` written in every KPU (what ``retain`` may keep)."""
        live = self.live
        return min(live.filled_to(t) for t in range(2 * self.geometry.layers))

    def _run(self, ch: Channel, checked: list[tuple[IORange, int, int, int]]) -> list[RangeResult]:
        pagecache, extent_store = self.stores()
        live = self.live
        tids = [r.tensor_id for r, _, _, _ in checked]
        # pending live demotions of these KPUs are carried out first (bladed.server.replan)
        kpus = live.begin_all(tids, ch)
        written: list[tuple[int, int]] = []
        try:
            accesses = [Access(r.op, kpu, r.token_start, r.ntokens, off, n, so)
                        for (r, off, n, so), kpu in zip(checked, kpus, strict=True)]
            pc: list[Access] = []
            direct: list[Access] = []
            for a in accesses:
                (direct if a.direct else pc).append(a)
            if pc:
                pagecache.run(ch, pc)
            if direct:
                extent_store.run(ch, direct)
            written = self._after(ch, accesses)
        finally:
            live.end_all(tids, written)
        return [a.result for a in accesses]

    def _after(self, ch: Channel, accesses: list[Access]) -> list[tuple[int, int]]:
        """Checksums and statistics of the accesses that ran; the fill marks of the writes that succeeded."""
        written: list[tuple[int, int]] = []
        by_path: dict[str, tuple[list[bool], list[ServedRow | None]]] = {}
        for a in accesses:
            r = a.result
            if r.error is None and self.checksums is not None:
                # record (write) or verify (read) the crc32c of each token row: bladed.server.integrity
                try:
                    self.checksums.after(a.write, a.kpu.tensor_id, f"layer {a.kpu.layer} {a.kpu.kind.upper()}",
                                         ch.slot.view(), a.slot_offset, a.token_start, a.ntokens)
                except RequestError as e:
                    self.stats.add("integrity_errors")
                    a.fail(e.code, e.message)
            writes, rows = by_path.setdefault(a.kpu.path, ([], []))   # a StrEnum: the path's name as the key
            writes.append(a.write)
            if r.error is not None:
                rows.append(None)
                continue
            if a.write:
                written.append((a.kpu.tensor_id, a.token_start + a.ntokens))
            rows.append((a.nbytes, r.service_ns, NO_HIT if r.hit_bytes is None else r.hit_bytes,
                         r.started_ns, r.finished_ns))
        for path, (writes, rows) in by_path.items():
            self.stats.observe_served(path, writes, rows)
        return written


class SessionManager:
    """Opens and tears down sessions; owns the allocator, the ledger and the journal."""

    def __init__(self, cfg: Config, device: ExtentDevice, allocator: ExtentAllocator, journal: Journal,
                 stats: Stats) -> None:
        self.cfg = cfg
        self.device = device
        self.allocator = allocator
        self.journal = journal
        self.stats = stats
        self.ledger = BudgetLedger()
        self.replanner = LiveReplanner(self)
        self.prefixes = PrefixCache(cfg, device, allocator, journal, stats)
        self.prefixes.pagecache_room = self._pagecache_room
        self._last_budget = 0
        self._lock = threading.Lock()
        self.sessions: dict[str, Session] = {}

    @property
    def staging_align(self) -> int:
        return max(PAGE_SIZE, self.device.lba_size)

    def budgeter(self, copy_threads: int, pinned_per_thread_bytes: int, pinned_elsewhere_bytes: int = 0) -> Budgeter:
        """Eq. 1-2 for a new session's ``copy_threads`` slots of ``pinned_per_thread_bytes``, besides
        ``pinned_elsewhere_bytes`` of the open sessions' staging."""
        b = self.cfg.budget
        return Budgeter(copy_threads, pinned_per_thread_bytes, override_bytes=b.override, cap_bytes=b.cap,
                        cgroup_path=b.cgroup or None, pinned_elsewhere_bytes=pinned_elsewhere_bytes,
                        kernel_overhead=b.kernel_overhead)

    def daemon_budgeter(self) -> Budgeter:
        """Eq. 1-2 for the daemon as a whole: no session being planned, every open session's staging as
        ``M_pin,others``."""
        return self.budgeter(0, 0, self.staging_bytes())

    def staging_bytes(self) -> int:
        """The staging of every open session (shmem of the daemon's once it is touched)."""
        return sum(s.staging_bytes for s in self.live_sessions())

    def _pagecache_room(self) -> int:
        """Page-cache bytes neither live sessions nor retained prefixes hold, of the last sampled ``B_pc``."""
        try:
            self._last_budget = self.daemon_budgeter().sample().pagecache_budget_bytes
        except (OSError, ValueError) as e:
            log.warning("budget sampling failed (%s); retaining on the device only", e)
            return 0
        return max(0, self.ledger.available(self._last_budget) - self.prefixes.pagecache_bytes)

    def live_sessions(self) -> list[Session]:
        with self._lock:
            return list(self.sessions.values())

    def uid_bytes(self, uid: int) -> int:
        return sum(s.storage_bytes for s in self.live_sessions() if s.peer.uid == uid)

    # -- open --------------------------------------------------------------------------
    def open(self, peer: Peer, body: dict[str, Any], fds: list[int]) -> Session:
        """Plan, bind and start a session from an ``open_session`` request (takes ownership of ``fds``)."""
        try:
            if len(fds) != 1:
                raise RequestError(ErrorCode.BAD_REQUEST,
                                   f"open_session needs exactly one staging memfd passed with SCM_RIGHTS, got "
                                   f"{len(fds)} descriptors")
            return self._open(peer, body, fds[0])
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _open(self, peer: Peer, body: dict[str, Any], fd: int) -> Session:
        cfg = self.cfg
        raw = get_field(body, "geometry", dict)
        dims = {k: get_field(raw, k, int, minimum=1, maximum=MAX_LAYERS if k == "layers" else None,
                             prefix="geometry.") for k in GEOMETRY_FIELDS}
        try:
            geometry = Geometry(**dims)
        except (TypeError, ValueError) as e:
            raise RequestError(ErrorCode.BAD_REQUEST, f"bad geometry: {e}") from None
        try:
            mode = Mode.parse(get_field(body, "mode", str, default="dualblade"))
        except ValueError as e:
            raise RequestError(ErrorCode.BAD_REQUEST, f"field 'mode': {e}") from None
        # the prefix first: the entry it finds is held (not evicted) until it is copied into the session
        found = self.prefixes.lookup(geometry, peer, body["prefix"]) if "prefix" in body else None
        try:
            channels = get_field(body, "channels", int, minimum=1, maximum=cfg.io.max_channels)
            slot_bytes = get_field(body, "slot_bytes", int, default=geometry.kpu_bytes, minimum=geometry.kpu_bytes)
            stride = align_up(slot_bytes, self.staging_align)
            staging_bytes = get_field(body, "staging_bytes", int, default=channels * stride, minimum=1)
            if staging_bytes < channels * stride or staging_bytes % self.staging_align:
                raise RequestError(ErrorCode.BAD_REQUEST,
                                   f"staging_bytes {staging_bytes} must be a multiple of {self.staging_align} and hold "
                                   f"{channels} slots of {stride} bytes (slot_bytes {slot_bytes})")
            if staging_bytes > cfg.io.max_staging_bytes:
                # the daemon maps and pins (registers) this memory: bound what one request can make it hold
                raise RequestError(ErrorCode.BAD_REQUEST,
                                   f"staging of {staging_bytes} bytes exceeds io.max_staging_bytes "
                                   f"({cfg.io.max_staging_bytes}); use fewer channels or a smaller geometry")
            _prepare_memfd(fd, staging_bytes)
            lba = self.device.lba_size

            # Plan (§IV-A): Eq. 1-2 with this session's N_threads * M_pin, less what others hold
            try:
                breakdown = self.budgeter(channels, stride, self.staging_bytes()).sample()
                b_pc, budget = breakdown.pagecache_budget_bytes, breakdown.to_dict()
            except (OSError, ValueError) as e:
                log.warning("budget sampling failed (%s); planning with B_pc = 0", e)
                b_pc, budget = 0, {"error": str(e), "pagecache_budget_bytes": 0}
            else:
                _check_staging_fits(breakdown, channels, stride)
            # live sessions come first: retained prefixes leave the page cache for this one's whole KV set
            free = self.ledger.available(b_pc)
            self.prefixes.make_room_pagecache(free - min(free, geometry.kv_bytes))
            grant = max(0, free - self.prefixes.pagecache_bytes)
            budget["granted_bytes"] = grant
            budget["held_by_others_bytes"] = self.ledger.held_bytes
            try:
                plan = plan_session(geometry, mode, grant, lba)
            except ValueError as e:
                raise RequestError(ErrorCode.BAD_REQUEST, f"cannot plan this session: {e}") from None

            sid = secrets.token_hex(4)
            with self._lock:
                while sid in self.sessions:
                    sid = secrets.token_hex(4)
            sess = Session(sid, peer, geometry, plan, budget, self.stats)
            if get_field(body, "checksums", bool, default=cfg.io.checksums):
                sess.checksums = Checksums(geometry)
            sess.live.replanner = self.replanner
            quota = cfg.access.quota_bytes_per_uid.get(peer.uid, cfg.access.quota_bytes)
            if quota and self.uid_bytes(peer.uid) + sess.storage_bytes > quota:
                raise RequestError(ErrorCode.QUOTA_EXCEEDED,
                                   f"uid {peer.uid} would hold {self.uid_bytes(peer.uid) + sess.storage_bytes} bytes, "
                                   f"over its quota of {quota} (access.quota_bytes)")
            try:
                self._bind(sess, fd, channels, staging_bytes, slot_bytes, stride)
            except BaseException:
                self._release(sess, trim=False)
                raise
            if found is not None:
                try:
                    sess.prefix_reply = self.prefixes.fill(sess, found)
                except BaseException:
                    self._release(sess, trim=True)
                    raise
            with self._lock:
                self.sessions[sid] = sess
            self.ledger.admit(sid, plan)
            self.stats.add("sessions_opened")
            ext = sess.extent
            event("session_open", session=sid, uid=peer.uid, pid=peer.pid, mode=mode.value, channels=channels,
                  layers=geometry.layers, kpu_bytes=geometry.kpu_bytes, pagecache_budget_bytes=b_pc,
                  group1_limit_bytes=plan.group1_limit_bytes, group1_layers=plan.group1_layers,
                  group1_kpus=len(plan.group1()), group2_kpus=len(plan.group2()),
                  extent=f"{ext.start}+{ext.nblocks}" if ext else "none",
                  registered=all(c.engine.registered for c in sess.channels))
            return sess
        finally:
            if found is not None:
                self.prefixes.cancel(found)

    def _bind(self, sess: Session, fd: int, channels: int, staging_bytes: int, slot_bytes: int,
              stride: int) -> None:
        """Bind (§IV-A): extent + stores, staging mapping, one ring per channel."""
        plan = sess.plan
        blocks = plan.extent_blocks
        extent: Extent | None = None
        sess.pagecache = pagecache = PageCacheKPUStore(self.cfg.pagecache_dir, sess.id, plan.pagecache_kpus())
        if plan.mode is Mode.DUALBLADE and self.cfg.budget.reserve_extent and plan.reserve_blocks > blocks:
            # room for every KPU, so a live demotion always fits (docs/architecture.md, re-planning)
            try:
                extent = self.allocator.allocate(plan.reserve_blocks, owner=sess.id)
            except RegionFullError:
                log.info("session %s: no room to reserve %d blocks; allocating the plan's %d",
                         sess.id, plan.reserve_blocks, blocks)
        while blocks and extent is None:
            try:
                extent = self.allocator.allocate(blocks, owner=sess.id)
            except RegionFullError as e:
                # live sessions come first: retained prefixes give their blocks back, least recently used first
                if not self.prefixes.make_room_device():
                    raise RequestError(ErrorCode.NO_SPACE, str(e)) from None
        sess.extent_store = extent_store = ExtentKPUStore(plan, extent, channels)
        # journal before anything touches storage, so a crash from here on is reclaimed
        self.journal_session(sess)
        pagecache.create()
        try:
            sess.mapping = mmap.mmap(fd, staging_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise RequestError(ErrorCode.BAD_REQUEST, f"cannot map the staging memfd: {e}") from None
        sess.staging_bytes, sess.slot_bytes, sess.slot_stride = staging_bytes, slot_bytes, stride
        view = memoryview(sess.mapping)
        try:
            slots = [StagingBuffer.wrap(view[ch * stride:ch * stride + slot_bytes]) for ch in range(channels)]
        finally:
            view.release()
        for ch, slot in enumerate(slots):
            try:
                engine = Engine(self.device, self.cfg.io.queue_depth, [slot])
            except OSError as e:
                for s in slots[ch:]:
                    s.close()
                raise RequestError(ErrorCode.IO_ERROR, f"cannot set up io_uring for channel {ch}: {e}") from None
            sess.channels.append(Channel(ch, engine, slot, self.cfg.io.read_window_bytes))
            self.stats.watch_lane(sess.channels[-1])
        if plan.mode in (Mode.DIRECT, Mode.DUALBLADE):
            # the edge scratch of rows that are not whole LBAs: here before any KPU is on (or moves to) the extent
            extent_store.prepare()

    def journal_session(self, sess: Session, also: Sequence[Extent] = ()) -> None:
        """Record what the session holds (again after its extent grew or moved; ``also`` the run it moves to
        meanwhile), so crash recovery reclaims all of it."""
        held = [e for e in (sess.extent, *also) if e is not None]
        self.journal.add(SessionRecord(id=sess.id, uid=sess.peer.uid, pid=sess.peer.pid, mode=sess.plan.mode.value,
                                       extents=[(e.start, e.nblocks) for e in held],
                                       pagecache_dir=sess.pagecache.directory if sess.pagecache else ""))

    def room(self, sess: Session, need: int, ch: ChannelIO) -> Extent:
        """Give the session's extent map room for ``need`` more blocks after its last bound KPU (a live
        demotion, on channel ``ch``): allocate the session's extent, grow it in place, or move it.

        Room is taken for every demotion still to come in the session's re-plan at once (its target plan's
        direct KPUs not bound yet), so that sessions demoting in the same pass each get one run instead of
        interleaving one-KPU runs that none of them can grow; where the region has no such run, just
        ``need``.  An extent that cannot grow in place (another session's run follows it) moves to a run
        that holds it and the room: its KPUs are held idle, copied, rebound and the old run scrubbed.
        Retained prefixes give their blocks back first, as at open.  RegionFullError if there is no room.
        """
        store = sess.stores()[1]
        short = store.map.blocks_short(need)
        old = store.extent
        if not short:
            assert old is not None
            return old
        target = sess.live.target or sess.plan
        ahead = sum(k.padded_bytes for k in target.direct_kpus() if k.tensor_id not in store.map) // store.lba
        wants = sorted({store.map.blocks_short(max(need, ahead)), short}, reverse=True)
        try:
            ext = self._take_room(sess.id, old, wants)
        except RegionFullError:
            if old is None:
                raise
            used = store.map.end_lba - old.start
            ext = self._take_room(sess.id, None, [used + w for w in wants])
            self._move_extent(sess, store, old, ext, ch)
            return ext
        store.map.place(ext)
        self.journal_session(sess)
        return ext

    def _take_room(self, sid: str, ext: Extent | None, wants: list[int]) -> Extent:
        """A new extent of ``wants[i]`` blocks, or ``ext`` grown in place by them, the first that fits;
        retained prefixes give their blocks back while none does (live sessions come first)."""
        while True:
            for blocks in wants:
                try:
                    if ext is None:
                        return self.allocator.allocate(blocks, owner=sid)
                    return self.allocator.grow(ext, blocks)
                except RegionFullError as e:
                    err = e
            if not self.prefixes.make_room_device():
                raise err

    def _move_extent(self, sess: Session, store: ExtentKPUStore, old: Extent, new: Extent, ch: ChannelIO) -> None:
        """Move the session's KPUs from ``old`` to ``new`` (which holds them and more), then scrub and free
        ``old``.  The journal holds both runs meanwhile, so a crash mid-move reclaims both."""
        self.journal_session(sess, also=(new,))
        token_bytes = sess.geometry.token_bytes
        try:
            with sess.live.holding(store.served()):
                moved = store.move(new, ch, lambda t: sess.live.filled_to(t) * token_bytes)
        except BaseException:
            self._scrub_and_free(sess, new)   # part of the copy may be there
            self.journal_session(sess)
            raise
        self._scrub_and_free(sess, old)
        self.journal_session(sess)
        self.replanner.moved(moved)
        event("extent_moved", session=sess.id, old=f"{old.start}+{old.nblocks}", new=f"{new.start}+{new.nblocks}",
              bytes=moved, kpus=len(store.served()))

    def _scrub_and_free(self, sess: Session, ext: Extent) -> tuple[int, int, bool]:
        """Paper §IV-B: deallocate a run a session wrote to, plus Write Zeroes where a deallocated block may
        still read back old data, then give it back to the allocator -- unless it could be neither: then it
        stays out of use (quarantined, journalled) until a restart scrubs it.  (trimmed, zeroed, freed)."""
        trimmed, zeroed, safe = scrub_and_free(self.device, self.allocator, self.stats, ext, owner=f"session {sess.id}",
                                               always_zero=self.cfg.device.zero_freed == "always")
        if not safe:
            # the next start-up tries the scrub again before the blocks are reused
            self.journal.add(SessionRecord(id=f"{sess.id}@{ext.start}", uid=sess.peer.uid, pid=sess.peer.pid,
                                           mode=QUARANTINED, extents=[(ext.start, ext.nblocks)]))
        return trimmed, zeroed, safe

    # -- teardown ------------------------------------------------------------------------
    def get(self, sid: str) -> Session | None:
        with self._lock:
            return self.sessions.get(sid)

    def close(self, sess: Session, reason: str) -> None:
        """Stop the session's data connections, wait for the requests in flight, TRIM its extent, remove its files."""
        with self._lock:
            if self.sessions.pop(sess.id, None) is None:
                return
        with sess._attach_lock:
            sess.closing = True
            attached = list(sess._attached)
        for conn in attached:
            conn.kill()
        for c in sess.channels:
            c.lock.acquire()   # the request in flight on it (if any) completes first
        try:
            sess.live.gates.seal()
            trimmed = self._release(sess, trim=True)
        finally:
            for c in sess.channels:
                c.lock.release()
        self.ledger.release(sess.id)
        self.stats.count("sessions_closed", reason)
        event("session_close", session=sess.id, uid=sess.peer.uid, pid=sess.peer.pid, reason=reason,
              ops=sum(c.ops for c in sess.channels), trimmed_bytes=trimmed, zeroed_bytes=sess.zeroed_bytes,
              files_removed=sess.files_removed, lived_s=f"{time.time() - sess.opened:.1f}")

    def _release(self, sess: Session, *, trim: bool) -> int:
        """Give back everything a (possibly half-opened) session holds; returns TRIMmed bytes."""
        trimmed = 0
        ext = sess.extent_store.close() if sess.extent_store is not None else None
        if ext is not None:
            if not trim:
                self.allocator.free(ext)  # a half-opened session never wrote to its extent
            else:
                # paper §IV-B: Dataset Management deallocate of the session's LBA range on teardown
                trimmed, sess.zeroed_bytes, _ = self._scrub_and_free(sess, ext)
        sess.files_removed = sess.pagecache.close() if sess.pagecache is not None else 0
        for c in sess.channels:
            self.stats.fold_lane(c)
            c.close()
        if sess.mapping is not None:
            try:
                sess.mapping.close()
            except BufferError:  # a view is still referenced somewhere; freed with it
                log.debug("session %s: staging mapping still exported", sess.id)
            sess.mapping = None
        self.journal.remove(sess.id)
        return trimmed

    def retain(self, sess: Session, body: dict[str, Any]) -> dict[str, Any]:
        """``retain``: keep the KV of the session's first whole token blocks as a retained prefix.

        Every channel is held meanwhile, so the copy reads what the session's requests finished writing.
        With ``close``, the session's page-cache budget is the entry's to take, and the session is closed
        once the entry is made (a failed retain leaves it open, as it was).
        """
        close = get_field(body, "close", bool, default=False)
        locked = []
        try:
            for c in sess.channels:
                c.lock.acquire()
                locked.append(c)
            if sess.closing:
                raise RequestError(ErrorCode.NO_SUCH_SESSION, f"session {sess.id} is closing")
            if close:
                self.ledger.release(sess.id)
            try:
                out = self.prefixes.retain(sess, sess.peer, body)
            except BaseException:
                if close:
                    self.ledger.admit(sess.id, sess.plan)
                raise
            if close:
                sess.live.gates.seal()     # the entry has its bytes: the lane serves none of them again
        finally:
            for c in locked:
                c.lock.release()
        if close:
            self.close(sess, "retained")
        return out

    def close_all(self, reason: str) -> None:
        for s in self.live_sessions():
            self.close(s, reason)


def working_reserve_bytes(channels: int) -> int:
    """Memory the daemon may need beside a new session's staging while it serves it, none of which the
    kernel can reclaim: a bounce buffer per channel, a demotion's and an extent move's copy buffers, and
    room for its own heap (:func:`_check_staging_fits`)."""
    return (channels + 2) * BOUNCE_BYTES + HEAP_RESERVE_BYTES


def _check_staging_fits(b: BudgetBreakdown, channels: int, stride: int) -> None:
    """Refuse a session whose staging does not fit the daemon's memory (Eq. 1's ``M*``, with the staging of
    the open sessions not charged yet, and :func:`working_reserve_bytes` beside it): the daemon touches that
    memory when it serves the session, and a memory cgroup answers with the OOM killer, which would end
    every session, not with an error."""
    need = b.pinned_uncharged_bytes + working_reserve_bytes(channels)
    if b.usable_bytes >= need:
        return
    raise RequestError(ErrorCode.NO_MEMORY,
                       f"the session's staging ({channels} x {stride} bytes) does not fit in the daemon's memory: "
                       f"{max(0, b.usable_bytes)} bytes usable (M*: limit {b.memory_limit_bytes} of "
                       f"{b.memory_limit_source} less {b.anon_shmem_bytes} anon+shmem), {need} needed with the "
                       f"open sessions' staging and the daemon's working reserve; open it with fewer channels or "
                       f"a smaller slot, or raise the daemon's memory limit (MemoryMax=)")


def _prepare_memfd(fd: int, need: int) -> None:
    """The staging descriptor must be a memfd sealed against shrinking and big enough.

    An empty memfd that may still grow is sized here to ``need`` bytes and
    sealed (what :class:`bladed.client.Client` sends: the daemon owns the
    layout).  A shrinkable mapping could be truncated by the client under the
    daemon's feet, and touching it would then kill the daemon with SIGBUS;
    the size is checked after the seal, so a client racing to shrink it loses.
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise RequestError(ErrorCode.BAD_REQUEST, "the staging descriptor must be a memfd")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise RequestError(ErrorCode.BAD_REQUEST, "the staging descriptor must be a memfd "
                           "(memfd_create with MFD_ALLOW_SEALING)") from None
    if st.st_size == 0 and not seals & (fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL):
        try:
            os.ftruncate(fd, need)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        except OSError as e:
            raise RequestError(ErrorCode.BAD_REQUEST, f"cannot size and seal the empty staging memfd to {need} "
                               f"bytes: {e.strerror or e}") from None
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        st = os.fstat(fd)
    if not seals & fcntl.F_SEAL_SHRINK:
        raise RequestError(ErrorCode.BAD_REQUEST, "the staging memfd must be sealed with F_SEAL_SHRINK, or be "
                           "empty and not sealed (the daemon then sizes and seals it)")
    if st.st_size < need:
        raise RequestError(ErrorCode.BAD_REQUEST, f"the staging memfd has {st.st_size} bytes, {need} announced")


__all__ = ["MAX_LAYERS", "Session", "SessionManager"]
