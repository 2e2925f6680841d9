"""The page-cache lane: a binary I/O request whose ranges all address plain page-cache KPUs, served in one pass.

Every one-token append and most of a decode step's reads on the page-cache
path are such requests.  :meth:`Session.execute` serves any request: it turns
each range into an ``IORange``, checks it, binds it to an ``Access``, hands each
store its share and records the results one by one.  On the request path that
generality was most of the cost of a one-token round trip (docs/benchmarks.md, "The
page-cache lane"); the lane does the same work for the common case in one
function: the ranges checked as they are unpacked, one lock for the in-flight
counts at each end (the fill marks ride on the second), the copies in C, the
reply packed as it goes.

Anything else (a request that is malformed or out of range, a KPU on the
direct path or dropped after use (CachePolicy-Only), checksums, a pending
demotion, a session that is closing) returns None before anything is done, and
the connection hands the request to :meth:`Session.execute`, which serves it
or refuses it with the exact error.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING

from bladed.protocol import (
    IO_RANGE,
    IO_REQUEST,
    MIRROR,
    NO_HIT,
    ErrorCode,
    IOOp,
    RangeResult,
    encode_io_reply,
    encode_io_served,
)
from bladed.residency.planner import KVPath, Plan

if TYPE_CHECKING:
    from bladed.server.channel import Channel
    from bladed.server.session import Session
    from bladed.server.stores.pagecache import HeldRange

_WRITE = int(IOOp.WRITE)
_READ = int(IOOp.READ)
_PAGECACHE = KVPath.PAGECACHE
_PATH_NAME = _PAGECACHE.value


class PageCacheLane:
    """The lane of one channel of a session (made when a data connection attaches to it)."""

    def __init__(self, sess: Session, ch: Channel, limit: int) -> None:
        g = sess.geometry
        self.sess = sess
        self.ch = ch
        self.limit = min(limit, 0xFFFF)
        self.token_bytes = g.token_bytes
        self.max_tokens = g.max_tokens
        self.slot_bytes = sess.slot_bytes
        self._plan: Plan | None = None
        self._lane_tids: frozenset[int] = frozenset()

    def _eligible(self) -> frozenset[int]:
        """The tensor ids of the plan's plain page-cache KPUs (a hint, before the in-flight counts are taken:
        a demotion replaces the plan; the KPUs are checked again under the counts)."""
        plan = self.sess.plan
        if plan is not self._plan:
            self._lane_tids = frozenset(k.tensor_id for k in plan.kpus
                                        if k.path is _PAGECACHE and not k.drop_after_use)
            self._plan = plan
        return self._lane_tids

    def serve(self, body: memoryview) -> bytes | None:
        """The reply frame of request ``body``, or None: nothing done, take the general path."""
        sess = self.sess
        size = len(body)
        if sess.checksums is not None or size < IO_REQUEST.size:
            return None
        req_id, n, flags = IO_REQUEST.unpack_from(body)
        if flags or not 1 <= n <= self.limit or size != IO_REQUEST.size + n * IO_RANGE.size:
            return None
        tb, max_tokens, slot_bytes = self.token_bytes, self.max_tokens, self.slot_bytes
        lane_tids = self._eligible()
        ranges: list[HeldRange] = []
        tids: list[int] = []
        for op, tid, t0, nt, so in IO_RANGE.iter_unpack(body[IO_REQUEST.size:]):
            end = t0 + nt
            nbytes = nt * tb
            if so == MIRROR:
                so = t0 * tb
            if (op != _WRITE and op != _READ) or tid not in lane_tids or nt < 1 or end > max_tokens \
                    or so + nbytes > slot_bytes:
                return None
            ranges.append((op == _WRITE, tid, t0 * tb, nbytes, so, end))
            tids.append(tid)
        if n > 1:
            if len(set(tids)) != n:
                return None
            spans = sorted((r[4], r[4] + r[3]) for r in ranges)
            if any(s2 < e1 for (_, e1), (s2, _) in itertools.pairwise(spans)):
                return None
        ch = self.ch
        with ch.lock:
            if sess.closing:
                return None
            live = sess.live
            kpus = live.begin_ready(tids)
            if kpus is None:
                return None
            written: list[tuple[int, int]] = []
            try:
                for k in kpus:
                    if k.path is not _PAGECACHE or k.drop_after_use:
                        return None
                store = sess.pagecache
                assert store is not None
                t0 = time.monotonic_ns()
                rows, failed = store.run_held(ch.slot.address, ranges, written)
                ch.busy_ns += time.monotonic_ns() - t0
                ch.ops += n
            finally:
                live.end_all(tids, written)
        sess.stats.observe_served(_PATH_NAME, [r[0] for r in ranges], rows)
        if failed is None:
            return encode_io_served(req_id, _PATH_NAME, rows)   # type: ignore[arg-type]
        results = [RangeResult(path=_PATH_NAME, nbytes=r[0], service_ns=r[1],
                               hit_bytes=None if r[2] == NO_HIT else r[2], started_ns=r[3], finished_ns=r[4])
                   if r is not None else RangeResult(ErrorCode.IO_ERROR, failed[i]) for i, r in enumerate(rows)]
        return encode_io_reply(req_id, results)


__all__ = ["PageCacheLane"]
