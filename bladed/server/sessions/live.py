"""A live session's demotion state: pending KPUs, requests in flight per KPU, fill marks, the lane's gates.

The operation boundary of live re-planning (``sessions.replan``): a pending demotion of a KPU is carried
out before the next request that addresses it, and a demotion waits for the requests in flight on its KPU
and holds back new ones until it is done.  Knows the session only through :class:`LiveSession`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any, Protocol

from bladed.residency.geometry import Geometry
from bladed.residency.planner import KPU, KVPath, Plan, replan, whole_layers
from bladed.server.storage import ExtentKPUStore, PageCacheKPUStore
from bladed.server.storage.channel import Channel
from bladed.server.storage.gates import KPUGates
from bladed.server.storage.integrity import Checksums


class LiveSession(Protocol):
    """What the demotion state reads of its session (``sessions.session.ServedSession``)."""

    geometry: Geometry
    plan: Plan
    pagecache: PageCacheKPUStore | None
    extent_store: ExtentKPUStore | None
    closing: bool
    checksums: Checksums | None


def with_kpu(plan: Plan, kpu: KPU, target: Plan) -> Plan:
    """``plan`` with one KPU replaced (a demotion carried out), sized like ``target``."""
    kpus = tuple(kpu if k.tensor_id == kpu.tensor_id else k for k in plan.kpus)
    n1 = whole_layers((k.tensor_id for k in kpus if k.group == 1), plan.geometry.layers)
    padding = sum(k.padded_bytes - k.nbytes for k in kpus if k.path is KVPath.DIRECT)
    return replace(plan, kpus=kpus, group1_layers=n1, padding_bytes=padding,
                   group1_limit_bytes=target.group1_limit_bytes, budget_bytes=target.budget_bytes)


class DemotionState:
    """Per-session demotion state: pending KPUs, requests in flight per KPU, counters."""

    def __init__(self, sess: LiveSession) -> None:
        self.sess = sess
        #: carries demotions out together, holding the channel (``LiveReplanner.carry_out`` for this session): the
        #: KPUs, in order; None until the session is open
        self.carry_out: Callable[[list[KPU], Channel], None] | None = None
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self.pending: dict[int, KPU] = {}
        self.target: Plan | None = None           # the plan once every pending demotion is done
        self._moving: set[int] = set()
        self._inflight: dict[int, int] = {}       # tensor id -> requests in flight on it (absent: none)
        #: tokens ``[0, filled[t])`` of tensor ``t`` were written by the general path (:meth:`filled_to`
        #: adds the lane's)
        self.filled: dict[int, int] = {}
        #: the lane's gates (``bladed.server.storage.gates``)
        self.gates = KPUGates(2 * sess.geometry.layers)
        #: demotions carried out so far: a lane offers every KPU to :meth:`open_lane_gates` again when it changes
        self.lane_epoch = 0
        self.demoted_kpus = 0
        self.demoted_bytes = 0
        self.failed = 0

    def to_dict(self) -> dict[str, Any]:
        with self._cond:
            return {"demoted_kpus": self.demoted_kpus, "demoted_bytes": self.demoted_bytes,
                    "pending_demotions": len(self.pending) + len(self._moving), "demotions_failed": self.failed}

    def filled_to(self, tensor_id: int) -> int:
        """Tokens ``[0, n)`` of the KPU written by either path.  Exact once no lane request is on it (its
        gate drained, or every channel lock held)."""
        return max(self.filled.get(tensor_id, 0), self.gates.filled(tensor_id))

    def open_lane_gates(self, candidates: set[int]) -> None:
        """Open the gates of those of ``candidates`` the lane may serve now, and drop from the set every tensor
        id that needs no more tries (its gate is open, or the KPU can never be served by the lane).

        The lane may serve KPUs of a session without checksums that is not closing, with no demotion pending
        or under way on them, that their store offers (:meth:`KPUStore.offer_gate`: plain page-cache KPUs
        whose files exist; direct KPUs of whole-LBA rows once bound and used).  A demotion done bumps
        :attr:`lane_epoch`: the
        lanes offer every KPU again (the demoted one may open on the direct path).  The caller holds a
        channel lock, so :meth:`KPUGates.seal` (which holds them all) cannot be under way.
        """
        sess = self.sess
        pagecache, extent = sess.pagecache, sess.extent_store
        gates = self.gates
        with self._lock:
            if sess.closing or sess.checksums is not None or gates.sealed or pagecache is None or extent is None:
                candidates.clear()
                return
            plan = sess.plan
            for t in list(candidates):
                if gates.is_open(t):
                    candidates.discard(t)
                elif t not in self.pending and t not in self._moving:
                    # each store answers for its own KPUs (KPUStore.offer_gate)
                    k = plan.kpu(t)
                    if (extent if k.path is KVPath.DIRECT else pagecache).offer_gate(k, gates):
                        candidates.discard(t)

    # -- recording ----------------------------------------------------------------------
    def schedule(self, grant: int) -> tuple[KPU, ...]:
        """Re-plan for a smaller grant; record the demotions; returns the newly demoted KPUs."""
        with self._cond:
            base = self.target if self.target is not None else self.sess.plan
            r = replan(base, grant)
            if not r.changed:
                return ()
            self.target = r.new
            for k in r.demoted:
                self.pending[k.tensor_id] = k
                self.gates.close(k.tensor_id)    # the lane's requests on it go where the demotion is carried out
            return r.demoted

    # -- the operation boundary ----------------------------------------------------------
    def begin_all(self, tensor_ids: list[int], channel: Channel) -> list[KPU]:
        """Count one op in flight on each KPU of a request, after carrying out their pending demotions.

        The counts are taken together, once none of the KPUs is pending or moving: a
        request never holds a count while it waits, so two requests and a demotion
        cannot wait on each other.  Returns the KPUs as the session's plan now has them.
        """
        while (kpus := self.begin_ready(tensor_ids)) is None:
            with self._lock:
                blocked = [t for t in tensor_ids if t in self._moving or t in self.pending]
            for t in blocked:
                self.begin(t, channel)
        return kpus

    def begin_ready(self, tensor_ids: list[int]) -> list[KPU] | None:
        """:meth:`begin_all` when none of the KPUs has a demotion pending or in progress; else None, counting
        nothing (the caller takes the general path, which carries the demotions out)."""
        with self._lock:
            if self.pending or self._moving:
                for t in tensor_ids:
                    if t in self.pending or t in self._moving:
                        return None
            inflight = self._inflight
            for t in tensor_ids:
                inflight[t] = inflight.get(t, 0) + 1
            plan = self.sess.plan
            return [plan.kpu(t) for t in tensor_ids]

    def end_all(self, tensor_ids: list[int], written: Sequence[tuple[int, int]] = ()) -> None:
        """Uncount the ops of :meth:`begin_all`, and record the writes among them: ``written`` holds
        ``(tensor id, end token)`` of each (what :attr:`filled` keeps)."""
        with self._lock:
            filled = self.filled
            for t, end in written:
                if end > filled.get(t, 0):
                    filled[t] = end
            inflight = self._inflight
            for t in tensor_ids:
                left = inflight[t] - 1
                if left:
                    inflight[t] = left
                else:
                    del inflight[t]
            if self._moving:
                self._cond.notify_all()

    def begin(self, tensor_id: int, channel: Channel) -> KPU:
        """Carry out a pending demotion of ``tensor_id`` first, on ``channel`` (the calling worker), counting
        no op in flight (:meth:`begin_all` counts).  Returns the KPU as the session's plan now has it."""
        self.carry_out_pending([tensor_id], channel)
        return self.sess.plan.kpu(tensor_id)

    def carry_out_pending(self, tensor_ids: Sequence[int], channel: Channel) -> None:
        """Carry out the pending demotions among ``tensor_ids`` together, in their order, on ``channel``: one
        stream of writes for all of them (the demotion worker hands every KPU of a re-plan at once).

        Each waits for the requests in flight on it, and holds back new ones until it is done: a KPU is
        released as soon as its own move is (:meth:`done`), not when the last one's is."""
        with self._cond:
            for t in tensor_ids:
                while t in self._moving:
                    self._cond.wait()
            moves = [k for t in tensor_ids if (k := self.pending.pop(t, None)) is not None]
            if not moves:
                return
            ids = [k.tensor_id for k in moves]
            self._moving.update(ids)
            while any(t in self._inflight for t in ids):
                self._cond.wait()
        for t in ids:
            self.gates.drain(t)      # and the lane's (closed when it was scheduled)
        try:
            if self.carry_out is not None and not self.sess.closing:
                self.carry_out(moves, channel)
        finally:
            with self._cond:
                self._moving.difference_update(ids)
                self._cond.notify_all()

    @contextlib.contextmanager
    def holding(self, tensor_ids: Iterable[int]) -> Iterator[None]:
        """No request on any of the KPUs while the block runs (the session's extent moves under them).

        As for a demotion: new requests on them wait (the general path) or go to Python (the lane's gates
        close), and those in flight finish first.  Ids already moving are another demotion's, left to it.
        On leaving, a new :attr:`lane_epoch` lets the lanes open the gates again on the KPUs' new LBAs.
        """
        with self._cond:
            mine = [t for t in tensor_ids if t not in self._moving]
            self._moving.update(mine)
            for t in mine:
                self.gates.close(t)
            while any(t in self._inflight for t in mine):
                self._cond.wait()
        try:
            for t in mine:
                self.gates.drain(t)
            yield
        finally:
            with self._cond:
                self._moving.difference_update(mine)
                self.lane_epoch += 1
                self._cond.notify_all()


    def done(self, kpu: KPU, nbytes: int) -> None:
        """The demotion was carried out (the plan has the KPU on its new path): no longer pending, so that
        whoever sees its event and asks for the session's ``pending_demotions`` finds it gone."""
        with self._cond:
            self.demoted_kpus += 1
            self.demoted_bytes += nbytes
            self.lane_epoch += 1
            self._moving.discard(kpu.tensor_id)
            if not self.pending and not self._moving:
                self.target = None
            self._cond.notify_all()

    def gave_up(self, kpu: KPU) -> None:
        """The demotion could not be carried out: the KPU stays where it is (no longer pending, as in
        :meth:`done`)."""
        with self._cond:
            self.failed += 1
            self._moving.discard(kpu.tensor_id)
            self.target = None if not self.pending else self.target
            self._cond.notify_all()


__all__ = ["DemotionState", "LiveSession", "with_kpu"]
