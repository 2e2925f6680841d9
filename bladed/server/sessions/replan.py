"""Live re-planning: demote whole KPUs of live sessions when ``B_pc`` shrinks.

The paper plans once, at start (§IV-A).  The re-planner keeps the daemon's
budget reading (:class:`~bladed.server.sessions.budget_reading.BudgetSampler`)
on its schedule: every ``budget.interval_s`` and on memory pressure; at once
after a SIGHUP that changes ``budget.*``.  When the
budget falls below what live sessions hold, :meth:`BudgetLedger.shrink` gives
new grants and :func:`replan` names the KPUs to demote.  They are recorded as
*pending* on the session and carried out one KPU at a time at an operation
boundary of that KPU, holding a channel of the session: before the next
request that addresses it, or by the daemon's demotion worker right away,
whichever comes first.  A demotion waits for the requests in flight on its KPU
and holds back new ones until it is done.

``dualblade``: the extent store binds the KPU after the last bound tensor of
the extent (Eq. 3-6 still hold; the extent is allocated, grown in place or
moved to a larger run if needed: ``SessionManager.extent_with_room``),
maps the channels' edge scratch it needs, and copies the KPU's filled bytes
from its page-cache file a bounded chunk at a time (the packed layout makes
the file's bytes the extent's bytes); then the file is dropped and unlinked.
If any step fails the move is refused: the KPU stays on the page-cache path
with its bytes, ``demotions_failed`` counts it, and a later re-plan tries
again.  Nothing is ever promoted back (growth goes to new sessions).
``cachepolicy``: switch the KPU to drop-after-use and drop its pages now.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from bladed.config import Config
from bladed.io import BladedIOError
from bladed.logfmt import fields
from bladed.protocol import RequestError
from bladed.residency.budget import BudgetBreakdown
from bladed.residency.extents import Extent, RegionFullError
from bladed.residency.geometry import Geometry
from bladed.residency.planner import KPU, BudgetLedger, Mode, Plan
from bladed.server.events import event
from bladed.server.sessions.budget_reading import BudgetSampler
from bladed.server.sessions.live import DemotionState, with_kpu
from bladed.server.storage import ExtentKPUStore, PageCacheKPUStore
from bladed.server.storage.channel import Channel
from bladed.server.storage.extent_store import DemotionError

log = logging.getLogger("bladed.replan")


class ReplanSession(Protocol):
    """What the re-planner uses of a session (``sessions.session.ServedSession``)."""

    id: str
    plan: Plan
    geometry: Geometry
    live: DemotionState
    closing: bool
    channels: list[Channel]

    def stores(self) -> tuple[PageCacheKPUStore, ExtentKPUStore]: ...


class ReplanHost(Protocol):
    """What the re-planner uses of the session manager (``sessions.manager.SessionManager``)."""

    cfg: Config
    ledger: BudgetLedger
    budget: BudgetSampler

    def get(self, sid: str) -> ReplanSession | None: ...


class LiveReplanner:
    """Schedules the daemon's budget sampler and turns budget shrinks into live demotions."""

    def __init__(self, manager: ReplanHost) -> None:
        self.manager = manager
        self._lock = threading.Lock()
        self.stats = {"replans": 0, "demoted_kpus": 0, "demoted_bytes": 0, "demotions_failed": 0,
                      "extents_moved": 0, "moved_bytes": 0, "reactions": 0}
        #: reaction times (a kernel event seen -> the first KPU it made the daemon demote written and freed)
        self.reaction_last_s: float | None = None
        self.reaction_max_s: float | None = None
        self._trigger: tuple[float, str] | None = None
        #: time spent carrying demotions out (demoted_bytes over it: the rate memory files are given back at)
        self.demoted_seconds = 0.0
        self._last_done = 0.0
        self._work: queue.Queue[tuple[ReplanSession, int] | None] = queue.Queue()
        self._worker: threading.Thread | None = None

    # -- the re-sampling thread -------------------------------------------------------------
    def start(self) -> None:
        """Start re-sampling (no-op unless ``budget.live_replan``); applies the first sample."""
        cfg = self.manager.cfg.budget
        if not cfg.live_replan:
            return
        try:
            first = self.manager.budget.start(self.apply, lambda: self.manager.ledger.held_bytes)
        except (OSError, ValueError) as e:
            log.warning("live re-planning disabled: cannot start budget sampling: %s", e)
            return
        if self._worker is None:
            self._worker = threading.Thread(target=self._demote_eagerly, name="bladed-demote", daemon=True)
            self._worker.start()
        self.apply(first)

    def stop(self) -> None:
        self.manager.budget.stop()
        w, self._worker = self._worker, None
        if w is not None:
            self._work.put(None)
            w.join()

    def _demote_eagerly(self) -> None:
        """Carry out pending demotions of idle sessions (a request on a KPU may do it first): what is queued
        now, a session's KPUs together (one stream of writes: the device's queue stays full from one to the
        next), on the channel of its first."""
        while (item := self._work.get()) is not None:
            batch: dict[str, tuple[ReplanSession, list[int]]] = {}
            stop = False
            while item is not None:
                sess, tid = item
                batch.setdefault(sess.id, (sess, []))[1].append(tid)
                try:
                    item = self._work.get_nowait()
                except queue.Empty:
                    break
                stop = item is None
            for sess, tids in batch.values():
                ch = sess.channels[tids[0] % len(sess.channels)]
                with ch.lock:
                    if not sess.closing:
                        sess.live.carry_out_pending(tids, ch)
            if stop:
                return

    def restart(self) -> None:
        """After a reload of ``budget.*``: new override/cap/cgroup, and apply at once."""
        self.stop()
        self.manager.budget.reconfigure()
        self.start()

    # -- shrink -> replan -> pending demotions ------------------------------------------------
    def apply(self, b: BudgetBreakdown) -> None:
        """``ledger.shrink(B_pc)`` of a daemon-wide reading, then record each affected session's demotions."""
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
            if scheduled and b.event_at and self._trigger is None:
                self._trigger = (b.event_at, b.reason)
            # every demotion of this change is pending from here on (what waits on a budget change wait for)
            event("budget_applied", pagecache_budget_bytes=b.pagecache_budget_bytes, reason=b.reason,
                  held_bytes=self.manager.ledger.held_bytes, demotions=scheduled,
                  binding_cgroup=b.binding_cgroup or "host")

    # -- carrying one out ----------------------------------------------------------------------
    def carry_out(self, sess: ReplanSession, kpus: list[KPU], channel: Channel,
                  extent_with_room: Callable[[int], Extent]) -> None:
        """Demote ``kpus`` holding ``channel`` (no request on them is in flight), in their order; each one that
        fails stays where it is, with its bytes.

        ``extent_with_room(need)`` gives the session's extent with room for ``need`` more blocks
        (``SessionManager.extent_with_room``)."""
        live = sess.live
        target = live.target or sess.plan
        t0 = time.monotonic()
        pagecache, extent_store = sess.stores()
        if sess.plan.mode is not Mode.DUALBLADE:
            # CachePolicy-Only (Table III): the KPUs stay on the page-cache path, dropped after use
            for kpu in kpus:
                try:
                    pagecache.drop(kpu.tensor_id)
                except (OSError, BladedIOError, ValueError) as e:
                    self._failed(sess, kpu, e)
                    continue
                self._done(sess, kpu, target, 0, t0)
            return

        def adopted(kpu: KPU, nbytes: int) -> None:
            # its bytes are on the extent now: the file is truncated (pages dropped unwritten) and removed
            pagecache.detach(kpu.tensor_id).close(unlink=True)
            self._done(sess, kpu, target, nbytes, t0)

        moves = [(k, pagecache.file(k.tensor_id), live.filled_to(k.tensor_id) * sess.geometry.token_bytes)
                 for k in kpus]
        try:
            extent_store.adopt_many(moves, channel, extent_with_room, adopted)
        except DemotionError as e:
            done = {k.tensor_id for k in e.adopted}
            for kpu in kpus:
                if kpu.tensor_id not in done:
                    self._failed(sess, kpu, e.cause)
        except (OSError, BladedIOError, RegionFullError, ValueError, MemoryError, RequestError) as e:
            for kpu in kpus:
                self._failed(sess, kpu, e)

    def _failed(self, sess: ReplanSession, kpu: KPU, e: BaseException) -> None:
        sess.live.gave_up(kpu)
        with self._lock:
            self.stats["demotions_failed"] += 1
        log.warning("session %s: cannot demote %s (%s); it stays on the page-cache path, over budget",
                    sess.id, kpu.name, e)
        event("kpu_demotion_failed", session=sess.id, kpu=kpu.name, error=str(e))

    def _done(self, sess: ReplanSession, kpu: KPU, target: Plan, nbytes: int, t0: float) -> None:
        """One KPU of a demotion carried out: the plan, the ledger, the counters, the event."""
        sess.plan = with_kpu(sess.plan, kpu, target)
        self.manager.ledger.admit(sess.id, sess.plan)
        sess.live.done(kpu, nbytes)
        reaction: dict[str, Any] = {}
        now = time.monotonic()
        with self._lock:
            self.stats["demoted_kpus"] += 1
            self.stats["demoted_bytes"] += nbytes
            self.demoted_seconds += now - max(t0, self._last_done)
            self._last_done = now
            if self._trigger is not None:
                # the first KPU demoted since a kernel event asked for it: how long the event waited for memory
                at, why = self._trigger
                self._trigger = None
                took = now - at
                self.stats["reactions"] += 1
                self.reaction_last_s = took
                self.reaction_max_s = took if self.reaction_max_s is None else max(self.reaction_max_s, took)
                reaction = {"reaction_s": f"{took:.4f}", "trigger": why}
        event("kpu_demoted", session=sess.id, kpu=kpu.name, path=kpu.path.value, bytes=nbytes,
              group1_bytes=sess.plan.group1_bytes, **reaction)

    def moved(self, nbytes: int) -> None:
        """A session's extent moved to make room for a demotion, copying ``nbytes``."""
        with self._lock:
            self.stats["extents_moved"] += 1
            self.stats["moved_bytes"] += nbytes

    def to_dict(self) -> dict[str, Any]:
        sampler = self.manager.budget.to_dict()
        with self._lock:
            out: dict[str, Any] = dict(self.stats)
            out["reaction_last_s"] = self.reaction_last_s
            out["reaction_max_s"] = self.reaction_max_s
            out["demoted_seconds"] = round(self.demoted_seconds, 6)
        return out | {"budget_samples": sampler["samples"], "running": sampler["running"],
                      "sources": sampler["sources"], "events": sampler["events"]}


__all__ = ["DemotionState", "LiveReplanner"]
