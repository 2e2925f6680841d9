"""Live re-planning: demote whole KPUs of live sessions when ``B_pc`` shrinks.

The paper plans once, at start (§IV-A).  The daemon keeps re-sampling Eq. 1-2
for its own cgroup (:meth:`Budgeter.start`: every ``budget.interval_s`` and on
memory pressure; at once after a SIGHUP that changes ``budget.*``).  When the
budget falls below what live sessions hold, :meth:`BudgetLedger.shrink` gives
new grants and :func:`replan` names the KPUs to demote.  They are recorded as
*pending* on the session and carried out one KPU at a time at an operation
boundary of that KPU, holding a channel of the session: before the next
request that addresses it, or by the daemon's demotion worker right away,
whichever comes first.  A demotion waits for the requests in flight on its KPU
and holds back new ones until it is done.

``dualblade``: the extent store binds the KPU after the last bound tensor of
the extent (Eq. 3-6 still hold; the extent is allocated, grown in place or
moved to a larger run if needed: ``SessionManager.room``),
maps the channels' edge scratch it needs, and copies the KPU's filled bytes
from its page-cache file a bounded chunk at a time (the packed layout makes
the file's bytes the extent's bytes); then the file is dropped and unlinked.
If any step fails the move is refused: the KPU stays on the page-cache path
with its bytes, ``demotions_failed`` counts it, and a later re-plan tries
again.  Nothing is ever promoted back (growth goes to new sessions).
``cachepolicy``: switch the KPU to drop-after-use and drop its pages now.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from bladed.io import BladedIOError
from bladed.logfmt import fields
from bladed.protocol import RequestError
from bladed.residency.budget import BudgetBreakdown, Budgeter
from bladed.residency.extents import RegionFullError
from bladed.residency.planner import KPU, KVPath, Mode, Plan, replan, whole_layers
from bladed.server.events import event
from bladed.server.gates import KPUGates

if TYPE_CHECKING:
    from bladed.server.channel import Channel
    from bladed.server.session import Session, SessionManager

log = logging.getLogger("bladed.replan")


def _with_kpu(plan: Plan, kpu: KPU, target: Plan) -> Plan:
    """``plan`` with one KPU replaced (a demotion carried out), sized like ``target``."""
    kpus = tuple(kpu if k.tensor_id == kpu.tensor_id else k for k in plan.kpus)
    n1 = whole_layers((k.tensor_id for k in kpus if k.group == 1), plan.geometry.layers)
    padding = sum(k.padded_bytes - k.nbytes for k in kpus if k.path is KVPath.DIRECT)
    return replace(plan, kpus=kpus, group1_layers=n1, padding_bytes=padding,
                   group1_limit_bytes=target.group1_limit_bytes, budget_bytes=target.budget_bytes)


class LiveState:
    """Per-session demotion state: pending KPUs, requests in flight per KPU, counters."""

    def __init__(self, sess: Session) -> None:
        self.sess = sess
        self.replanner: LiveReplanner | None = None
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self.pending: dict[int, KPU] = {}
        self.target: Plan | None = None           # the plan once every pending demotion is done
        self._moving: set[int] = set()
        self._inflight: dict[int, int] = {}       # tensor id -> requests in flight on it (absent: none)
        #: tokens ``[0, filled[t])`` of tensor ``t`` were written by the general path (:meth:`filled_to`
        #: adds the lane's)
        self.filled: dict[int, int] = {}
        #: the lane's gates (``bladed.server.gates``)
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

        The lane may serve, of a session without checksums that is not closing, plain page-cache KPUs (not
        dropped after use) whose files exist, with no demotion pending or under way; and direct KPUs of token
        rows of whole LBAs once bound and used on the extent.  A demotion done bumps :attr:`lane_epoch`: the
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
                k = plan.kpu(t)
                if gates.is_open(t):
                    candidates.discard(t)
                elif k.path is KVPath.DIRECT:
                    # packed rows never (their edges are the extent store's); whole-LBA rows once bound and used
                    if not plan.aligned or (extent.holds(t) and extent.map.is_materialized(t)
                                            and gates.open_direct(t, extent.map.lookup(t)[0], k.nbytes)):
                        candidates.discard(t)
                elif k.drop_after_use or not pagecache.holds(t):
                    candidates.discard(t)
                elif t not in self.pending and t not in self._moving:
                    f = pagecache.file(t)
                    if f.materialized and gates.open(t, f.fd, f.address, f.nbytes):
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
                self.begin(t, channel, serve=False)
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

    def begin(self, tensor_id: int, channel: Channel, *, serve: bool = True) -> KPU:
        """Carry out a pending demotion of ``tensor_id`` first, on ``channel`` (the calling worker).

        With ``serve``, count an op in flight.  Returns the KPU as the session's plan now has it.
        """
        with self._cond:
            while tensor_id in self._moving:
                self._cond.wait()
            new = self.pending.pop(tensor_id, None)
            if new is None:
                if serve:
                    self._inflight[tensor_id] = self._inflight.get(tensor_id, 0) + 1
                return self.sess.plan.kpu(tensor_id)
            self._moving.add(tensor_id)
            while tensor_id in self._inflight:
                self._cond.wait()
        self.gates.drain(tensor_id)      # and the lane's (closed when it was scheduled)
        try:
            if self.replanner is not None and not self.sess.closing:
                self.replanner.carry_out(self.sess, new, channel)
        finally:
            with self._cond:
                self._moving.discard(tensor_id)
                if serve:
                    self._inflight[tensor_id] = self._inflight.get(tensor_id, 0) + 1
                self._cond.notify_all()
        return self.sess.plan.kpu(tensor_id)

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

    def run_pending(self, tensor_id: int, channel: Channel) -> None:
        """The eager path: the demotion worker, holding ``channel``, demotes the KPU if no request did it first."""
        self.begin(tensor_id, channel, serve=False)

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


class LiveReplanner:
    """Runs the daemon's Budgeter and turns budget shrinks into live demotions."""

    def __init__(self, manager: SessionManager) -> None:
        self.manager = manager
        self._budgeter: Budgeter | None = None
        self._lock = threading.Lock()
        self.stats = {"replans": 0, "demoted_kpus": 0, "demoted_bytes": 0, "demotions_failed": 0,
                      "extents_moved": 0, "moved_bytes": 0}
        self._work: queue.Queue[tuple[Session, int] | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        #: Budgeter.stats of the budgeters a reload replaced (so the samples counters never go back)
        self._past_samples: dict[str, int] = {}

    # -- the re-sampling thread -------------------------------------------------------------
    def start(self) -> None:
        """Start re-sampling (no-op unless ``budget.live_replan``); applies the first sample."""
        cfg = self.manager.cfg.budget
        if not cfg.live_replan:
            return
        try:
            b = self.manager.daemon_budgeter()
            b.start(cfg.interval_s, self._on_change)
        except (OSError, ValueError) as e:
            log.warning("live re-planning disabled: cannot start budget sampling: %s", e)
            return
        self._budgeter = b
        if self._worker is None:
            self._worker = threading.Thread(target=self._demote_eagerly, name="bladed-demote", daemon=True)
            self._worker.start()
        if b.last is not None:
            self.apply(b.last)

    def stop(self) -> None:
        b, self._budgeter = self._budgeter, None
        if b is not None:
            b.stop()
            with self._lock:
                self._past_samples = self._samples(b)
        w, self._worker = self._worker, None
        if w is not None:
            self._work.put(None)
            w.join()

    def _demote_eagerly(self) -> None:
        """Carry out pending demotions of idle sessions (a request on the KPU may do it first)."""
        while (item := self._work.get()) is not None:
            sess, tid = item
            ch = sess.channels[tid % len(sess.channels)]
            with ch.lock:
                if not sess.closing:
                    sess.live.run_pending(tid, ch)

    def restart(self) -> None:
        """After a reload of ``budget.*``: new override/cap/cgroup, and apply at once."""
        self.stop()
        self.start()

    def _on_change(self, b: BudgetBreakdown) -> None:
        budgeter = self._budgeter
        pinned = self.manager.staging_bytes()     # M_pin,others: the sessions opened or closed since
        if budgeter is not None and budgeter.pinned_elsewhere_bytes != pinned:
            budgeter.pinned_elsewhere_bytes = pinned
            try:
                b = budgeter.sample(b.reason)
            except OSError as e:
                log.warning("budget re-sample failed: %s", e)
        self.apply(b)

    # -- shrink -> replan -> pending demotions ------------------------------------------------
    def apply(self, b: BudgetBreakdown) -> None:
        """``ledger.shrink(B_pc)``, then record each affected session's demotions."""
        with self._lock:
            grants = self.manager.ledger.shrink(b.pagecache_budget_bytes)
            scheduled = 0
            log.debug("budget applied to live sessions", extra=fields(
                pagecache_budget_bytes=b.pagecache_budget_bytes, reason=b.reason,
                held_bytes=self.manager.ledger.held_bytes,
                grants=",".join(f"{sid}:{g}" for sid, g in grants.items()) or "none"))
            for sid, grant in grants.items():
                sess = self.manager.get(str(sid))
                if sess is None or sess.closing:
                    continue
                demoted = sess.live.schedule(grant)
                if not demoted:
                    continue
                self.stats["replans"] += 1
                event("replan", session=sess.id, mode=sess.plan.mode.value,
                      pagecache_budget_bytes=b.pagecache_budget_bytes, grant=grant,
                      reason=b.reason, demoted=",".join(k.name for k in demoted))
                # eager: the demotion worker moves an idle session's KPUs too
                for k in demoted:
                    self._work.put((sess, k.tensor_id))
                scheduled += len(demoted)
            # every demotion of this change is pending from here on (what waits on a budget change wait for)
            event("budget_applied", pagecache_budget_bytes=b.pagecache_budget_bytes, reason=b.reason,
                  held_bytes=self.manager.ledger.held_bytes, demotions=scheduled)

    # -- carrying one out ----------------------------------------------------------------------
    def carry_out(self, sess: Session, kpu: KPU, channel: Channel) -> None:
        """Demote one KPU holding ``channel`` (no request on it is in flight); on failure it stays where it is."""
        live = sess.live
        target = live.target or sess.plan
        nbytes = 0
        tid = kpu.tensor_id
        try:
            pagecache, extent_store = sess.stores()
            if sess.plan.mode is Mode.DUALBLADE:
                filled = live.filled_to(tid) * sess.geometry.token_bytes
                nbytes = extent_store.adopt(kpu, pagecache.file(tid), filled, channel,
                                            lambda need: self.manager.room(sess, need, channel))
                # its bytes are on the extent now: the file is truncated (pages dropped unwritten) and removed
                pagecache.detach(tid).close(unlink=True)
            else:
                # CachePolicy-Only (Table III): the KPU stays on the page-cache path, dropped after use
                pagecache.drop(tid)
        except (OSError, BladedIOError, RegionFullError, ValueError, MemoryError, RequestError) as e:
            live.gave_up(kpu)
            with self._lock:
                self.stats["demotions_failed"] += 1
            log.warning("session %s: cannot demote %s (%s); it stays on the page-cache path, over budget",
                        sess.id, kpu.name, e)
            event("kpu_demotion_failed", session=sess.id, kpu=kpu.name, error=str(e))
            return
        sess.plan = _with_kpu(sess.plan, kpu, target)
        self.manager.ledger.admit(sess.id, sess.plan)
        live.done(kpu, nbytes)
        with self._lock:
            self.stats["demoted_kpus"] += 1
            self.stats["demoted_bytes"] += nbytes
        event("kpu_demoted", session=sess.id, kpu=kpu.name, path=kpu.path.value, bytes=nbytes,
              group1_bytes=sess.plan.group1_bytes)

    def moved(self, nbytes: int) -> None:
        """A session's extent moved to make room for a demotion, copying ``nbytes``."""
        with self._lock:
            self.stats["extents_moved"] += 1
            self.stats["moved_bytes"] += nbytes

    def _samples(self, b: Budgeter | None) -> dict[str, int]:
        """Samples (periodic, pressure) and applied changes of B_pc since the daemon started."""
        now = dict(b.stats) if b is not None else {}
        return {k: self._past_samples.get(k, 0) + now.get(k, 0) for k in self._past_samples.keys() | now.keys()}

    def to_dict(self) -> dict[str, Any]:
        b = self._budgeter
        with self._lock:
            out: dict[str, Any] = dict(self.stats)
            out["budget_samples"] = self._samples(b)
        out["running"] = b is not None
        out["sources"] = list(b.sources) if b is not None else []
        return out


__all__ = ["LiveReplanner", "LiveState"]
