"""Sessions: open (plan, bind, map the client's staging memory), per-tensor
requests, and teardown (TRIM, page-cache files, journal).

A session belongs to the connection that opened it and can only address its
own KPUs.  Opening one runs the paper's Plan and Bind steps (§IV-A): the
budgeter gives ``B_pc`` (Eq. 1-2), minus what live sessions already hold in
the page cache; Algorithm 1 splits the KPUs; the direct-path KPUs get one
contiguous extent laid out back to back (Eq. 3-6).  Files and LBAs are
materialised by the first request that touches them.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bladed.config import Config
from bladed.io import BladedIOError, Engine, ExtentDevice, StagingBuffer
from bladed.io.pagecache import PageCacheStore
from bladed.protocol import ErrorCode, RequestError, get_field
from bladed.residency.budget import Budgeter
from bladed.residency.extents import Extent, ExtentAllocator, ExtentMap, RegionFullError
from bladed.residency.geometry import Geometry, align_up
from bladed.residency.planner import BudgetLedger, Mode, Plan, plan_session
from bladed.server.channel import Channel, IORequest, bounce_bytes
from bladed.server.integrity import Checksums
from bladed.server.metrics import Stats
from bladed.server.replan import LiveReplanner, LiveState
from bladed.server.state import QUARANTINED, Journal, SessionRecord

log = logging.getLogger("bladed.session")
events = logging.getLogger("bladed.events")

PAGE = 4096
SESSION_DIR_PREFIX = "session-"
GEOMETRY_FIELDS = ("layers", "batch", "kv_heads", "head_dim", "dtype_bytes", "max_tokens")
#: the open_session reply lists every KPU (2 per layer, at most 164 bytes each): 2048 layers keep the worst-case
#: reply at about 714 KB, inside MAX_FRAME_BYTES (docs/protocol.md, "Limits")
MAX_LAYERS = 2048


@dataclass(frozen=True)
class Peer:
    """Who is on the other end of a connection (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int


def event(name: str, **fields: Any) -> None:
    """One structured log line: ``event=NAME key=value ...`` (journald-friendly)."""
    parts = [f"event={name}"]
    for k, v in fields.items():
        s = str(v)
        parts.append(f"{k}={s!r}" if (" " in s or not s) else f"{k}={s}")
    events.info(" ".join(parts))


class Session:
    """One open session: plan, storage bindings, staging mapping and channels."""

    def __init__(self, sid: str, peer: Peer, geometry: Geometry, plan: Plan, budget: dict[str, Any],
                 stats: Stats) -> None:
        self.id = sid
        self.peer = peer
        self.geometry = geometry
        self.plan = plan
        self.budget = budget
        self.stats = stats
        self.opened = time.time()
        self.extent: Extent | None = None
        self.extent_map: ExtentMap
        self.pc_store: PageCacheStore | None = None
        self.pc_dir = ""
        self.pc_files: dict[int, Any] = {}
        self.mapping: mmap.mmap | None = None
        self.staging_bytes = 0
        self.slot_stride = 0
        self.slots: list[StagingBuffer] = []
        self.bounces: list[StagingBuffer] = []
        self.engines: list[Engine] = []
        self.channels: list[Channel] = []
        self.closing = False
        #: per-token-row crc32c (``checksums`` in open_session); None = off
        self.checksums: Checksums | None = None
        #: bytes Write-Zeroed at teardown (devices that do not read zeroes after a deallocate)
        self.zeroed_bytes = 0
        self.live = LiveState(self)

    @property
    def storage_bytes(self) -> int:
        """What the session holds on storage (page-cache files + extent), for quotas."""
        pc = sum(k.pagecache_bytes for k in self.plan.pagecache_kpus())
        return pc + self.plan.direct_bytes

    def layout(self) -> dict[str, Any]:
        g = self.geometry
        return {"channels": len(self.channels), "token_bytes": g.token_bytes, "kpu_bytes": g.kpu_bytes,
                "max_tokens": g.max_tokens, "slot_stride": self.slot_stride, "staging_bytes": self.staging_bytes,
                "extent": None if self.extent is None else {"start": self.extent.start,
                                                             "nblocks": self.extent.nblocks},
                "registered": [e.registered for e in self.engines]}

    def open_reply(self) -> dict[str, Any]:
        """The fields of the ``open_session`` reply: session id, plan (with the budget sample) and layout."""
        plan = self.plan.to_dict()
        plan["budget"] = self.budget
        return {"session": self.id, "plan": plan, "layout": self.layout()}

    def describe(self) -> dict[str, Any]:
        p = self.plan
        return {
            "session": self.id, "uid": self.peer.uid, "pid": self.peer.pid, "mode": p.mode.value,
            "channels": len(self.channels), "geometry": self.geometry.to_dict(), "opened": self.opened,
            "n1": p.n1, "x_bytes": p.x_bytes, "b_pc": p.budget_bytes,
            "group1": len(p.group1()), "group2": len(p.group2()),
            "pagecache_bytes": sum(k.pagecache_bytes for k in p.pagecache_kpus()),
            "direct_bytes": p.direct_bytes, "storage_bytes": self.storage_bytes,
            "extent": None if self.extent is None else {"start": self.extent.start, "nblocks": self.extent.nblocks},
            "ops": sum(c.ops for c in self.channels),
            "busy_s": sum(c.busy_ns for c in self.channels) / 1e9,
        } | self.live.to_dict()

    def request(self, req_id: Any, op: str, body: dict[str, Any], reply: Callable[[dict[str, Any]], None]) -> None:
        """Validate a write/read and queue it on its channel (replies come from the worker)."""
        if self.closing:
            raise RequestError(ErrorCode.NO_SUCH_SESSION, f"session {self.id} is closing")
        g = self.geometry
        layer = get_field(body, "layer", int)
        kind = get_field(body, "kind", str)
        ch = get_field(body, "channel", int)
        start = get_field(body, "token_start", int, default=0)
        if not 0 <= layer < g.layers:
            raise RequestError(ErrorCode.OUT_OF_RANGE, f"layer {layer} outside 0..{g.layers - 1}")
        if kind not in ("k", "v"):
            raise RequestError(ErrorCode.OUT_OF_RANGE, f"kind must be 'k' or 'v', got {kind!r}")
        if not 0 <= ch < len(self.channels):
            raise RequestError(ErrorCode.OUT_OF_RANGE, f"channel {ch} outside 0..{len(self.channels) - 1}")
        if not 0 <= start < g.max_tokens:
            raise RequestError(ErrorCode.OUT_OF_RANGE, f"token_start {start} outside 0..{g.max_tokens - 1}")
        n = get_field(body, "ntokens", int, default=g.max_tokens - start)
        if n < 1 or start + n > g.max_tokens:
            raise RequestError(ErrorCode.OUT_OF_RANGE,
                               f"tokens [{start}, {start + n}) outside the KPU's 0..{g.max_tokens} tokens")
        kpu = self.plan.kpu(2 * layer + (kind == "v"))
        self.channels[ch].submit(IORequest(req_id, op, kpu, start, n, reply))


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
        self._lock = threading.Lock()
        self.sessions: dict[str, Session] = {}
        #: register staging slots with io_uring (False where the kernel mishandles it; see the daemon's probe)

    @property
    def staging_align(self) -> int:
        return max(PAGE, self.device.lba_size)

    def budgeter(self, n_threads: int, m_pin: int) -> Budgeter:
        b = self.cfg.budget
        return Budgeter(n_threads, m_pin, override_bytes=b.override, cap_bytes=b.cap,
                        cgroup_path=b.cgroup or None)

    def uid_bytes(self, uid: int) -> int:
        with self._lock:
            return sum(s.storage_bytes for s in self.sessions.values() if s.peer.uid == uid)

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
        channels = get_field(body, "channels", int, minimum=1, maximum=cfg.io.max_channels)
        staging_bytes = get_field(body, "staging_bytes", int, minimum=1)
        stride = align_up(geometry.kpu_bytes, self.staging_align)
        if staging_bytes < channels * stride or staging_bytes % self.staging_align:
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"staging_bytes {staging_bytes} must be a multiple of {self.staging_align} and hold "
                               f"{channels} slots of {stride} bytes (one KPU each)")
        if staging_bytes > cfg.io.max_staging_bytes:
            # the daemon maps and pins (registers) this memory: bound what one request can make it hold
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"staging of {staging_bytes} bytes exceeds io.max_staging_bytes "
                               f"({cfg.io.max_staging_bytes}); use fewer channels or a smaller geometry")
        _check_memfd(fd, staging_bytes)
        lba = self.device.lba_size

        # Plan (§IV-A): Eq. 1-2 with this session's N_threads * M_pin, less what others hold
        try:
            breakdown = self.budgeter(channels, stride).sample()
            b_pc, budget = breakdown.b_pc, breakdown.to_dict()
        except (OSError, ValueError) as e:
            log.warning("budget sampling failed (%s); planning with B_pc = 0", e)
            b_pc, budget = 0, {"error": str(e), "b_pc": 0}
        grant = self.ledger.available(b_pc)
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
            self._bind(sess, fd, channels, staging_bytes, stride)
        except BaseException:
            self._release(sess, trim=False)
            raise
        with self._lock:
            self.sessions[sid] = sess
        self.ledger.admit(sid, plan)
        self.stats.add("sessions_opened")
        event("session_open", session=sid, uid=peer.uid, pid=peer.pid, mode=mode.value, channels=channels,
              layers=geometry.layers, kpu_bytes=geometry.kpu_bytes, b_pc=b_pc, x_bytes=plan.x_bytes, n1=plan.n1,
              group1=len(plan.group1()), group2=len(plan.group2()),
              extent=f"{sess.extent.start}+{sess.extent.nblocks}" if sess.extent else "none",
              registered=all(e.registered for e in sess.engines))
        return sess

    def _bind(self, sess: Session, fd: int, channels: int, staging_bytes: int, stride: int) -> None:
        """Bind (§IV-A): extent + extent map, page-cache files, staging mapping, engines."""
        plan = sess.plan
        blocks = plan.extent_blocks
        if plan.mode is Mode.DUALBLADE and self.cfg.budget.reserve_extent and plan.reserve_blocks > blocks:
            # room for every KPU, so a live demotion always fits (docs/architecture.md, re-planning)
            try:
                sess.extent = self.allocator.allocate(plan.reserve_blocks, owner=sess.id)
            except RegionFullError:
                log.info("session %s: no room to reserve %d blocks; allocating the plan's %d",
                         sess.id, plan.reserve_blocks, blocks)
        if blocks and sess.extent is None:
            try:
                sess.extent = self.allocator.allocate(blocks, owner=sess.id)
            except RegionFullError as e:
                raise RequestError(ErrorCode.NO_SPACE, str(e)) from None
        sess.extent_map = ExtentMap(plan, sess.extent)
        pc_kpus = plan.pagecache_kpus()
        if pc_kpus:
            sess.pc_dir = os.path.join(self.cfg.pagecache_dir, SESSION_DIR_PREFIX + sess.id)
        # journal before anything touches storage, so a crash from here on is reclaimed
        self.journal.add(SessionRecord(
            id=sess.id, uid=sess.peer.uid, pid=sess.peer.pid, mode=plan.mode.value,
            extents=[(sess.extent.start, sess.extent.nblocks)] if sess.extent else [], pagecache_dir=sess.pc_dir))
        if pc_kpus:
            os.makedirs(sess.pc_dir, mode=0o700, exist_ok=True)
            sess.pc_store = PageCacheStore(sess.pc_dir)
            for k in pc_kpus:
                sess.pc_files[k.tensor_id] = sess.pc_store.open(k.name, k.nbytes)
        try:
            sess.mapping = mmap.mmap(fd, staging_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise RequestError(ErrorCode.BAD_REQUEST, f"cannot map the staging memfd: {e}") from None
        sess.staging_bytes = staging_bytes
        sess.slot_stride = stride
        view = memoryview(sess.mapping)
        try:
            for ch in range(channels):
                sess.slots.append(StagingBuffer.wrap(view[ch * stride:(ch + 1) * stride]))
        finally:
            view.release()
        unaligned = not plan.aligned and plan.direct_kpus()
        for ch in range(channels):
            bufs = [sess.slots[ch]]
            bounce = None
            if unaligned:
                bounce = StagingBuffer(bounce_bytes(plan))
                sess.bounces.append(bounce)
                bufs.append(bounce)
            try:
                engine = Engine(self.device, self.cfg.io.queue_depth, bufs)
            except OSError as e:
                raise RequestError(ErrorCode.IO_ERROR, f"cannot set up io_uring for channel {ch}: {e}") from None
            sess.engines.append(engine)
            sess.channels.append(Channel(sess, ch, engine, sess.slots[ch], bounce, self.cfg.io.max_outstanding))
        for c in sess.channels:
            c.start()

    # -- teardown ------------------------------------------------------------------------
    def get(self, sid: str) -> Session | None:
        with self._lock:
            return self.sessions.get(sid)

    def close(self, sess: Session, reason: str, *, abandon: bool = False) -> None:
        """Drain (or abandon) the session's requests, TRIM its extent, remove its files."""
        with self._lock:
            if self.sessions.pop(sess.id, None) is None:
                return
        sess.closing = True
        for c in sess.channels:
            c.stop(abandon=abandon)
        for c in sess.channels:
            c.join()
        trimmed = self._release(sess, trim=True)
        self.ledger.release(sess.id)
        self.stats.add("sessions_closed")
        event("session_close", session=sess.id, uid=sess.peer.uid, pid=sess.peer.pid, reason=reason,
              ops=sum(c.ops for c in sess.channels), trimmed_bytes=trimmed, zeroed_bytes=sess.zeroed_bytes,
              files_removed=len(sess.pc_files), lived_s=f"{time.time() - sess.opened:.1f}")

    def _release(self, sess: Session, *, trim: bool) -> int:
        """Give back everything a (possibly half-opened) session holds; returns TRIMmed bytes."""
        trimmed = 0
        quarantined: tuple[int, int] | None = None
        if sess.extent is not None:
            ext, sess.extent = sess.extent, None
            if not trim:
                self.allocator.free(ext)  # a half-opened session never wrote to its extent
            else:
                # paper §IV-B: Dataset Management deallocate of the session's LBA range on teardown,
                # plus Write Zeroes where a deallocated block may still read back old data
                trimmed, zeroed, safe = scrub(self.device, ext.start, ext.nblocks,
                                              always_zero=self.cfg.device.zero_freed == "always")
                sess.zeroed_bytes = zeroed
                if safe:
                    self.allocator.free(ext)
                else:
                    # never hand out blocks that may still hold this session's bytes
                    log.error("session %s: extent %d+%d could be neither deallocated to zeroes nor zeroed; "
                              "keeping it out of use until restart", sess.id, ext.start, ext.nblocks)
                    self.stats.add("quarantined_bytes", ext.nblocks * self.device.lba_size)
                    quarantined = (ext.start, ext.nblocks)
                self.stats.add("trimmed_bytes", trimmed)
                self.stats.add("zeroed_bytes", zeroed)
        for f in sess.pc_files.values():
            try:
                f.close(unlink=True)
            except OSError as e:
                log.warning("session %s: removing a page-cache file failed: %s", sess.id, e)
        if sess.pc_store is not None:
            sess.pc_store.close()
            sess.pc_store = None
        if sess.pc_dir:
            shutil.rmtree(sess.pc_dir, ignore_errors=True)
        for eng in sess.engines:
            eng.close()
        for b in sess.slots + sess.bounces:
            b.close()
        sess.slots, sess.bounces = [], []
        if sess.mapping is not None:
            try:
                sess.mapping.close()
            except BufferError:  # a view is still referenced somewhere; freed with it
                log.debug("session %s: staging mapping still exported", sess.id)
            sess.mapping = None
        if quarantined is None:
            self.journal.remove(sess.id)
        else:
            # stays in the journal: the next start-up tries the scrub again before the blocks are reused
            self.journal.add(SessionRecord(id=sess.id, uid=sess.peer.uid, pid=sess.peer.pid, mode=QUARANTINED,
                                           extents=[quarantined]))
        return trimmed

    def close_all(self, reason: str) -> None:
        with self._lock:
            live = list(self.sessions.values())
        for s in live:
            self.close(s, reason)


def _check_memfd(fd: int, need: int) -> None:
    """The staging descriptor must be a memfd sealed against shrinking and big enough.

    A shrinkable mapping could be truncated by the client under the daemon's
    feet, and touching it would then kill the daemon with SIGBUS.
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise RequestError(ErrorCode.BAD_REQUEST, "the staging descriptor must be a memfd")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise RequestError(ErrorCode.BAD_REQUEST, "the staging descriptor must be a memfd "
                           "(memfd_create with MFD_ALLOW_SEALING)") from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise RequestError(ErrorCode.BAD_REQUEST, "the staging memfd must be sealed with F_SEAL_SHRINK")
    if st.st_size < need:
        raise RequestError(ErrorCode.BAD_REQUEST, f"the staging memfd has {st.st_size} bytes, {need} announced")


def scrub(device: ExtentDevice, start: int, nblocks: int, *, always_zero: bool = False) -> tuple[int, int, bool]:
    """Deallocate ``nblocks`` from ``start`` and make sure they read back as zeroes.

    TRIM first (paper §IV-B).  Where the device does not promise zeroes after a
    deallocate (NVMe DLFEAT, punched holes), or the deallocate failed, or
    ``always_zero``: Write Zeroes too, so a later session never reads an
    earlier one's bytes.  Returns (trimmed bytes, zeroed bytes, safe to reuse).
    """
    lba = device.lba_size
    trimmed = zeroed = 0
    with Engine(device, 4) as eng:
        try:
            eng.discard(start, nblocks)
            trimmed = nblocks * lba
        except BladedIOError as e:
            log.warning("TRIM of LBA [%d, %d) failed: %s", start, start + nblocks, e)
        if trimmed and device.zeroes_after_discard and not always_zero:
            return trimmed, 0, True
        try:
            eng.write_zeroes(start, nblocks)
            zeroed = nblocks * lba
        except BladedIOError as e:
            log.error("Write Zeroes of LBA [%d, %d) failed: %s", start, start + nblocks, e)
            return trimmed, 0, False
    return trimmed, zeroed, True


def sweep_pagecache(root: str) -> int:
    """Remove session directories a previous instance left in ``root``; returns how many."""
    n = 0
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        return 0
    for name in entries:
        if name.startswith(SESSION_DIR_PREFIX):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            n += 1
    return n


__all__ = ["Peer", "Session", "SessionManager", "event", "scrub", "sweep_pagecache"]
