"""Opening and closing sessions: Plan and Bind (§IV-A), quotas, the budget ledger, room on the region for
live demotions, teardown (TRIM, files, journal) and retaining a session's prefix.

Opening one runs the paper's Plan and Bind steps: the daemon's budget reading (``budget_reading``) gives
``B_pc`` (Eq. 1-2) for the session's staging, minus what live sessions already hold in the page cache;
Algorithm 1 splits the KPUs between a page-cache store and an extent store (``bladed.server.storage``); the
direct-path KPUs get one contiguous extent laid out back to back (Eq. 3-6). Files and LBAs are materialised
by the first request that touches them.
"""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

from bladed.config import Config
from bladed.io import ExtentDevice
from bladed.protocol import ErrorCode, RequestError, get_field
from bladed.residency.extents import Extent, ExtentAllocator, RegionFullError
from bladed.residency.geometry import Geometry
from bladed.residency.planner import KPU, BudgetLedger, Mode, Plan, plan_session
from bladed.server.events import Peer, event
from bladed.server.metrics import Stats
from bladed.server.prefixes.cache import PrefixCache
from bladed.server.sessions.budget_reading import OPEN_MAX_AGE_S, BudgetSampler
from bladed.server.sessions.replan import LiveReplanner
from bladed.server.sessions.rules import open_geometry, open_staging
from bladed.server.sessions.session import ServedSession
from bladed.server.sessions.staging import check_staging_fits, passed_memfd, prepare_memfd
from bladed.server.storage import ChannelIO, ExtentKPUStore, PageCacheKPUStore
from bladed.server.storage.channel import Channel
from bladed.server.storage.integrity import Checksums
from bladed.server.storage.journal import QUARANTINED, Journal, SessionRecord
from bladed.server.storage.release import scrub_and_free
from bladed.server.wear import WearLedger
from bladed.sizes import PAGE_SIZE

log = logging.getLogger("bladed.session")


class SessionManager:
    """Opens and tears down sessions; owns the allocator, the ledger and the journal."""

    def __init__(self, cfg: Config, device: ExtentDevice, allocator: ExtentAllocator, journal: Journal,
                 stats: Stats, wear: WearLedger | None = None) -> None:
        self.cfg = cfg
        self.device = device
        self.allocator = allocator
        self.journal = journal
        self.stats = stats
        #: the wear ledger (``bladed.server.wear``): io.write_budget refuses new direct-path spills once spent
        self.wear = wear
        self.ledger = BudgetLedger()
        #: the daemon's one budget reading: the re-planner schedules it, opens, prefixes and reports read it
        self.budget = BudgetSampler(cfg, self.staging_bytes, self.own_kv_bytes, self.own_kv_memory_bytes)
        self.replanner = LiveReplanner(self)
        self.prefixes = PrefixCache(cfg, device, allocator, journal, stats, wear)
        self.prefixes.pagecache_room = self._pagecache_room
        self._lock = threading.Lock()
        #: one open plans at a time (``_plan`` and the ledger's admission together)
        self._admission = threading.Lock()
        self.sessions: dict[str, ServedSession] = {}

    @property
    def staging_align(self) -> int:
        return max(PAGE_SIZE, self.device.lba_size)

    def staging_bytes(self) -> int:
        """The staging of every open session (shmem of the daemon's once it is touched)."""
        return sum(s.staging_bytes for s in self.live_sessions())

    def own_kv_bytes(self) -> int:
        """Page cache the daemon's KV files on disk hold now (the open sessions' and the retained prefixes'): Eq.
        1's ``M_kv``, the part of the cgroup's mapped page cache that is not its processes' own."""
        live = sum(s.pagecache.cached_bytes() for s in self.live_sessions()
                   if s.pagecache is not None and not s.pagecache.memory)
        return live + self.prefixes.cached_bytes()

    def own_kv_memory_bytes(self) -> int:
        """Memory the daemon's memory KV files hold now (the open sessions' Group 1 with ``pagecache.backing =
        "memory"``): Eq. 1's ``M_kv,mem``, the part of the cgroup's shmem that is the KV the budget plans."""
        return sum(s.pagecache.cached_bytes() for s in self.live_sessions()
                   if s.pagecache is not None and s.pagecache.memory)

    def _pagecache_room(self) -> int:
        """Page-cache bytes neither live sessions nor retained prefixes hold, of the daemon's ``B_pc`` (a reading
        at most ``budget.interval_s`` old: where a retained prefix goes is placement, not admission)."""
        try:
            b_pc = self.budget.reading(self.cfg.budget.interval_s).pagecache_budget_bytes
        except (OSError, ValueError) as e:
            log.warning("budget sampling failed (%s); retaining on the device only", e)
            return 0
        return max(0, self.ledger.available(b_pc) - self.prefixes.pagecache_bytes)

    def live_sessions(self) -> list[ServedSession]:
        with self._lock:
            return list(self.sessions.values())

    def uid_bytes(self, uid: int) -> int:
        return sum(s.storage_bytes for s in self.live_sessions() if s.peer.uid == uid)

    # -- open --------------------------------------------------------------------------
    def open(self, peer: Peer, body: dict[str, Any], fds: list[int]) -> ServedSession:
        """Plan, bind and start a session from an ``open_session`` request (takes ownership of ``fds``)."""
        with passed_memfd("open_session", fds) as fd:
            return self._open(peer, body, fd)

    def _open(self, peer: Peer, body: dict[str, Any], fd: int) -> ServedSession:
        cfg = self.cfg
        geometry, mode = open_geometry(body)
        # the prefix first: the entry it finds is held (not evicted) until it is copied into the session
        found = self.prefixes.lookup(geometry, peer, body["prefix"]) if "prefix" in body else None
        admitted = False            # held in the ledger for a session not yet open: released if the open fails
        try:
            channels, slot_bytes, stride, staging_bytes = open_staging(body, geometry, cfg.io.max_channels,
                                                                       cfg.io.max_staging_bytes, self.staging_align)
            prepare_memfd(fd, staging_bytes)
            lba = self.device.lba_size

            with self._lock:
                sid = secrets.token_hex(4)
                while sid in self.sessions:
                    sid = secrets.token_hex(4)
            # Plan (§IV-A): Eq. 1-2 with this session's N_threads * M_pin, less what others hold.  One open plans at a
            # time, and its Group 1 is held in the ledger from its plan on: two opens never grant the same bytes
            with self._admission:
                plan, budget, b_pc = self._plan(geometry, mode, channels, stride, lba)
                self.ledger.admit(sid, plan)
            admitted = True
            direct = plan.direct_kpus()
            if direct and self.wear is not None:
                # io.write_budget: planned as ever, but a plan that spills to the device is refused once it is spent
                self.wear.check_spill("session", f"a {mode.value} session with {len(direct)} KPUs "
                                                 f"({plan.direct_bytes} bytes) on the direct path",
                                      cfg.io.write_budget)
            sess = ServedSession(sid, peer, geometry, plan, budget, self.stats)
            if get_field(body, "checksums", bool, default=cfg.io.checksums):
                sess.checksums = Checksums(geometry)
            sess.live.carry_out = functools.partial(self._carry_out, sess)
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
            admitted = False        # the session's now: closing it releases the ledger
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
            if admitted:
                self.ledger.release(sid)
            if found is not None:
                self.prefixes.cancel(found)

    def _plan(self, geometry: Geometry, mode: Mode, channels: int, stride: int,
              lba: int) -> tuple[Plan, dict[str, Any], int]:
        """Algorithm 1 for a session being opened: ``(plan, budget terms for its reply, B_pc)`` (hold
        ``_admission``)."""
        try:
            breakdown = self.budget.for_session(channels, stride, OPEN_MAX_AGE_S)
            b_pc, budget = breakdown.pagecache_budget_bytes, breakdown.to_dict()
        except (OSError, ValueError) as e:
            log.warning("budget sampling failed (%s); planning with B_pc = 0", e)
            b_pc, budget = 0, {"error": str(e), "pagecache_budget_bytes": 0}
        else:
            check_staging_fits(breakdown, channels, stride)
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
        return plan, budget, b_pc

    def _bind(self, sess: ServedSession, fd: int, channels: int, staging_bytes: int, slot_bytes: int,
              stride: int) -> None:
        """Bind (§IV-A): extent + stores, staging mapping, one ring per channel."""
        plan = sess.plan
        blocks = plan.extent_blocks
        extent: Extent | None = None
        # Dual-Blade's Group 1 is planned to stay in memory: in memory files the kernel never writes back, with
        # live demotion as their eviction (docs/architecture.md, "Page-cache KV off the drive"); the other
        # modes' page cache is the kernel's to evict (Table III), so it stays on disk
        memory = plan.mode is Mode.DUALBLADE and self.cfg.group1_backing == "memory"
        sess.pagecache = pagecache = PageCacheKPUStore(self.cfg.pagecache_dir, sess.id, plan.pagecache_kpus(),
                                                       memory=memory)
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
        # a session's KV lives as long as the session: an append's last, partly filled LBA waits in memory until
        # it is full (no write amplification of bladed's own; retained prefixes write everything at once)
        sess.extent_store = extent_store = ExtentKPUStore(plan, extent, channels, defer_tail=True)
        # journal before anything touches storage, so a crash from here on is reclaimed
        self.journal_session(sess)
        pagecache.create()
        sess.map_staging(fd, staging_bytes, slot_bytes, stride, channels, self.device, self.cfg.io.queue_depth,
                         self.cfg.io.read_window_bytes, self.stats)
        if plan.mode in (Mode.DIRECT, Mode.DUALBLADE):
            # the edge scratch of rows that are not whole LBAs: here before any KPU is on (or moves to) the extent
            extent_store.prepare()

    def _carry_out(self, sess: ServedSession, kpus: list[KPU], ch: Channel) -> None:
        """``sess``'s pending demotions of ``kpus``, together, holding ``ch`` (``DemotionState.carry_out_pending``);
        their writes count as ``demotion``."""

        def room(need: int) -> Extent:
            # binding the KPUs on the extent is where a copy to the device begins: io.write_budget refuses it once
            # spent (RequestError: the re-planner leaves them on the page-cache path, kpu_demotion_failed)
            if self.wear is not None:
                names = ",".join(k.name for k in kpus)
                self.wear.check_spill("demotion", f"a live demotion of {names} of session {sess.id} "
                                                  f"({sum(k.nbytes for k in kpus)} bytes)", self.cfg.io.write_budget,
                                      count=len(kpus))
            return self.extent_with_room(sess, need, ch)

        with ch.engine.labelled("demotion"):
            self.replanner.carry_out(sess, kpus, ch, room)

    def journal_session(self, sess: ServedSession, also: Sequence[Extent] = ()) -> None:
        """Record what the session holds (again after its extent grew or moved; ``also`` the run it moves to
        meanwhile), so crash recovery reclaims all of it."""
        held = [e for e in (sess.extent, *also) if e is not None]
        self.journal.add(SessionRecord(id=sess.id, uid=sess.peer.uid, pid=sess.peer.pid, mode=sess.plan.mode.value,
                                       extents=[(e.start, e.nblocks) for e in held],
                                       pagecache_dir=sess.pagecache.directory if sess.pagecache else ""))

    def extent_with_room(self, sess: ServedSession, need: int, ch: ChannelIO) -> Extent:
        """The session's extent with room for ``need`` more blocks after its last bound KPU (a live
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
            ext = self._allocate_or_grow(sess.id, old, wants)
        except RegionFullError:
            if old is None:
                raise
            used = store.map.end_lba - old.start
            ext = self._allocate_or_grow(sess.id, None, [used + w for w in wants])
            self._move_extent(sess, store, old, ext, ch)
            return ext
        store.map.place(ext)
        self.journal_session(sess)
        return ext

    def _allocate_or_grow(self, sid: str, ext: Extent | None, wants: list[int]) -> Extent:
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

    def _move_extent(self, sess: ServedSession, store: ExtentKPUStore, old: Extent, new: Extent, ch: ChannelIO) -> None:
        """Move the session's KPUs from ``old`` to ``new`` (which holds them and more), then scrub and free
        ``old``.  The journal holds both runs meanwhile, so a crash mid-move reclaims both."""
        self.journal_session(sess, also=(new,))
        token_bytes = sess.geometry.token_bytes
        try:
            with sess.live.holding(store.served()), ch.engine.labelled("extent_move"):
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

    def _scrub_and_free(self, sess: ServedSession, ext: Extent) -> tuple[int, int, bool]:
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
    def get(self, sid: str) -> ServedSession | None:
        with self._lock:
            return self.sessions.get(sid)

    def close(self, sess: ServedSession, reason: str) -> None:
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

    def _release(self, sess: ServedSession, *, trim: bool) -> int:
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

    def retain(self, sess: ServedSession, body: dict[str, Any]) -> dict[str, Any]:
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


__all__ = ["SessionManager"]
