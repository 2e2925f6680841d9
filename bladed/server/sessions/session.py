"""One open session: its plan, its two stores, its staging mapping and channels, and running its requests.

A session belongs to the connection that opened it and can only address its own KPUs.  A request is a
batch of token ranges on one channel: :meth:`ServedSession.execute` checks all of them first (``rules``: a bad
one refuses the whole request, nothing done), then hands each store its share, all under the channel's
lock.  Opening, binding and teardown are the manager's (``sessions.manager``).
"""

from __future__ import annotations

import mmap
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from bladed.io import Engine, ExtentDevice, StagingBuffer
from bladed.protocol import NO_HIT, ErrorCode, IORange, RangeResult, RequestError, ServedRow
from bladed.residency.extents import Extent
from bladed.residency.geometry import Geometry
from bladed.residency.planner import KVPath, Plan
from bladed.server.events import Peer
from bladed.server.metrics import WRITE_CAUSES, Stats, channel_kv_written, channel_written
from bladed.server.sessions.live import DemotionState
from bladed.server.sessions.rules import CheckedRange, check_channel, check_ranges, json_range
from bladed.server.storage import Access, ExtentKPUStore, PageCacheKPUStore
from bladed.server.storage.channel import Channel
from bladed.server.storage.integrity import Checksums


class ServedSession:
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
        #: the two stores (``bladed.server.storage``), made when the session is bound
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
        self.live = DemotionState(self)
        #: (model, dtype) of the prefix key it was opened with (``retain`` reuses them); None = none given
        self.prefix_key: tuple[str, str] | None = None
        #: the ``prefix`` object of the open_session reply (None = not asked)
        self.prefix_reply: dict[str, Any] | None = None
        self._attached: set[Any] = set()
        self._attach_lock = threading.Lock()
        #: KV bytes the general path wrote for this session, per path (the lanes count theirs in C)
        self._kv_written = {p.value: 0 for p in (KVPath.PAGECACHE, KVPath.DIRECT)}
        #: device bytes written for this session on channels not its own (prefix copies into it), by cause
        self._written_elsewhere: dict[str, int] = {}
        self._count_lock = threading.Lock()

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
        } | self.written() | self.live.to_dict()

    def written(self) -> dict[str, Any]:
        """What the session wrote: KV bytes its requests carried per path, and the bytes bladed's own commands
        wrote to the device for it (whole LBAs), by cause (``WRITE_CAUSES``)."""
        with self._count_lock:
            kv = dict(self._kv_written)
            elsewhere = dict(self._written_elsewhere)
        device = dict.fromkeys(WRITE_CAUSES, 0)
        for ch in self.channels:
            for path, n in channel_kv_written(ch).items():
                kv[path] += n
            for cause, n in channel_written(ch).items():
                device[cause] = device.get(cause, 0) + n
        for cause, n in elsewhere.items():
            device[cause] = device.get(cause, 0) + n
        return {"kv_written_bytes": kv, "direct_written_bytes": sum(device.values()),
                "direct_written_by_cause": device}

    def count_written(self, written: Mapping[str, int]) -> None:
        """Device bytes written for this session on a channel of the daemon's (a prefix copied into it)."""
        with self._count_lock:
            for cause, n in written.items():
                self._written_elsewhere[cause] = self._written_elsewhere.get(cause, 0) + n

    # -- staging and channels ---------------------------------------------------------
    def map_staging(self, fd: int, staging_bytes: int, slot_bytes: int, stride: int, channels: int,
                    device: ExtentDevice, queue_depth: int, read_window_bytes: int, stats: Stats) -> None:
        """Map the client's staging memfd ``fd`` and give every slot of it a channel (its own io_uring); a
        failure is one line (the caller releases what was set up)."""
        try:
            self.mapping = mmap.mmap(fd, staging_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise RequestError(ErrorCode.BAD_REQUEST, f"cannot map the staging memfd: {e}") from None
        self.staging_bytes, self.slot_bytes, self.slot_stride = staging_bytes, slot_bytes, stride
        view = memoryview(self.mapping)
        try:
            slots = [StagingBuffer.wrap(view[ch * stride:ch * stride + slot_bytes]) for ch in range(channels)]
        finally:
            view.release()
        for ch, slot in enumerate(slots):
            try:
                engine = Engine(device, queue_depth, [slot])
            except OSError as e:
                for s in slots[ch:]:
                    s.close()
                raise RequestError(ErrorCode.IO_ERROR, f"cannot set up io_uring for channel {ch}: {e}") from None
            self.channels.append(Channel(ch, engine, slot, read_window_bytes))
            stats.watch_lane(self.channels[-1])

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
        """A JSON ``read``/``write`` request as (channel, range) (:func:`rules.json_range`)."""
        return json_range(self.geometry, op, body)

    def channel(self, index: int) -> Channel:
        check_channel(index, len(self.channels))
        return self.channels[index]

    def execute(self, ch_index: int, ranges: Sequence[IORange], limit: int) -> list[RangeResult]:
        """Run one request (a batch of ranges) on channel ``ch_index``; one result per range, in order.

        A range that is out of bounds refuses the whole request (RequestError,
        nothing done); a range that fails while running fails alone.
        """
        ch = self.channel(ch_index)
        checked = check_ranges(self.geometry, self.slot_bytes, ranges, limit)
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
        return self._run(ch, check_ranges(self.geometry, self.slot_bytes, ranges, len(ranges)), own=False)

    def filled_tokens(self) -> int:
        """Tokens ``[0, n)`` written in every KPU (what ``retain`` may keep)."""
        live = self.live
        return min(live.filled_to(t) for t in range(2 * self.geometry.layers))

    def _run(self, ch: Channel, checked: list[CheckedRange], own: bool = True) -> list[RangeResult]:
        pagecache, extent_store = self.stores()
        live = self.live
        tids = [r.tensor_id for r, _, _, _ in checked]
        # pending live demotions of these KPUs are carried out first (bladed.server.sessions.replan)
        kpus = live.begin_all(tids, ch)
        written: list[tuple[int, int]] = []
        try:
            accesses = [Access(r.op, kpu, r.token_start, r.ntokens, off, n, so)
                        for (r, off, n, so), kpu in zip(checked, kpus, strict=True)]
            # each store runs its share of the request together (the extent store's as one batch on the ring)
            for store in (pagecache, extent_store):
                mine = [a for a in accesses if a.kpu.path is store.path]
                if mine:
                    store.run(ch, mine)
            written = self._account_for(ch, accesses, own)
        finally:
            live.end_all(tids, written)
        return [a.result for a in accesses]

    def _account_for(self, ch: Channel, accesses: list[Access], own: bool) -> list[tuple[int, int]]:
        """Checksums and statistics of the accesses that ran; the fill marks of the writes that succeeded.
        ``own``: the session's requests (a prefix copied in is not: its KV bytes are not the session's writes)."""
        written: list[tuple[int, int]] = []
        by_path: dict[str, tuple[list[bool], list[ServedRow | None]]] = {}
        for a in accesses:
            r = a.result
            if r.error is None and self.checksums is not None:
                # record (write) or verify (read) the crc32c of each token row: bladed.server.storage.integrity
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
                if own:
                    with self._count_lock:
                        self._kv_written[a.kpu.path] += a.nbytes
            rows.append((a.nbytes, r.service_ns, NO_HIT if r.hit_bytes is None else r.hit_bytes,
                         r.started_ns, r.finished_ns))
        for path, (writes, rows) in by_path.items():
            self.stats.observe_served(path, writes, rows)
        return written


__all__ = ["ServedSession"]
