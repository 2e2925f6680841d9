"""Live re-planning: demote whole KPUs of live sessions when ``B_pc`` shrinks.

The paper plans once, at start (§IV-A).  The daemon keeps re-sampling Eq. 1-2
for its own cgroup (:meth:`Budgeter.start`: every ``budget.interval_s`` and on
memory pressure; at once after a SIGHUP that changes ``budget.*``).  When the
budget falls below what live sessions hold, :meth:`BudgetLedger.shrink` gives
new grants and :func:`replan` names the KPUs to demote.  They are recorded as
*pending* on the session and carried out one KPU at a time at an operation
boundary of that KPU, on a channel worker: before the next request that
addresses it, or by a task queued on the session's channels right away,
whichever comes first.  A demotion waits for the requests in flight on its KPU
and holds back new ones until it is done.

``dualblade``: where token rows are padded on the extent, first give every
channel the bounce buffer the direct path needs (a session that opened with
every KPU in the page cache has none); bind the KPU after the last bound tensor
of the extent (Eq. 3-6 still hold); copy its filled token rows from the
page-cache file to the extent a bounded chunk at a time (through the bounce
buffer, or one buffer of the same size for whole-LBA rows); drop and unlink the
file.  If any step fails the move is refused: the KPU stays on the page-cache
path with its bytes, ``demotions_failed`` counts it, and a later re-plan tries
again.  Nothing is ever promoted back (growth goes to new sessions).
``cachepolicy``: switch the KPU to drop-after-use and drop its pages now.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from bladed.io import BladedIOError, StagingBuffer
from bladed.residency.budget import BudgetBreakdown, Budgeter
from bladed.residency.extents import ExtentMap, RegionFullError
from bladed.residency.planner import KPU, Mode, Path, Plan, replan
from bladed.server.channel import bounce_bytes
from bladed.server.state import SessionRecord

if TYPE_CHECKING:
    from bladed.server.channel import Channel
    from bladed.server.session import Session, SessionManager

log = logging.getLogger("bladed.replan")


def _with_kpu(plan: Plan, kpu: KPU, target: Plan) -> Plan:
    """``plan`` with one KPU replaced (a demotion carried out), sized like ``target``."""
    kpus = tuple(kpu if k.tensor_id == kpu.tensor_id else k for k in plan.kpus)
    g1 = {k.tensor_id for k in kpus if k.group == 1}
    n1 = sum(1 for i in range(plan.geometry.layers) if 2 * i in g1 and 2 * i + 1 in g1)
    padding = sum(k.padded_bytes - k.nbytes for k in kpus if k.path is Path.DIRECT)
    return replace(plan, kpus=kpus, n1=n1, padding_bytes=padding, x_bytes=target.x_bytes,
                   budget_bytes=target.budget_bytes)


class LiveState:
    """Per-session demotion state: pending KPUs, requests in flight per KPU, counters."""

    def __init__(self, sess: Session) -> None:
        self.sess = sess
        self.replanner: LiveReplanner | None = None
        self._cond = threading.Condition()
        self._room = threading.Lock()
        self.pending: dict[int, KPU] = {}
        self.target: Plan | None = None           # the plan once every pending demotion is done
        self._moving: set[int] = set()
        self._inflight: collections.Counter[int] = collections.Counter()
        #: tokens ``[0, filled[t])`` of tensor ``t`` were written (what a demotion copies)
        self.filled: dict[int, int] = {}
        self.demoted_kpus = 0
        self.demoted_bytes = 0
        self.failed = 0

    def wrote(self, tensor_id: int, end_token: int) -> None:
        """Record a write up to ``end_token`` (called by the channel after the write)."""
        with self._cond:
            if end_token > self.filled.get(tensor_id, 0):
                self.filled[tensor_id] = end_token

    def to_dict(self) -> dict[str, Any]:
        with self._cond:
            return {"demoted_kpus": self.demoted_kpus, "demoted_bytes": self.demoted_bytes,
                    "pending_demotions": len(self.pending) + len(self._moving), "demotions_failed": self.failed}

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
            return r.demoted

    # -- the operation boundary ----------------------------------------------------------
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
                    self._inflight[tensor_id] += 1
                return self.sess.plan.kpu(tensor_id)
            self._moving.add(tensor_id)
            while self._inflight[tensor_id]:
                self._cond.wait()
        try:
            if self.replanner is not None and not self.sess.closing:
                self.replanner.carry_out(self.sess, new, channel)
        finally:
            with self._cond:
                self._moving.discard(tensor_id)
                if serve:
                    self._inflight[tensor_id] += 1
                self._cond.notify_all()
        return self.sess.plan.kpu(tensor_id)

    def run_pending(self, tensor_id: int, channel: Channel) -> None:
        """The eager path: a task on a channel worker demotes the KPU if no request did it first."""
        self.begin(tensor_id, channel, serve=False)

    def end(self, tensor_id: int) -> None:
        with self._cond:
            self._inflight[tensor_id] -= 1
            if not self._inflight[tensor_id]:
                del self._inflight[tensor_id]
                self._cond.notify_all()

    def done(self, kpu: KPU, nbytes: int) -> None:
        with self._cond:
            self.demoted_kpus += 1
            self.demoted_bytes += nbytes
            if not self.pending and not (self._moving - {kpu.tensor_id}):
                self.target = None

    def gave_up(self, kpu: KPU) -> None:
        """The demotion could not be carried out: the KPU stays where it is."""
        with self._cond:
            self.failed += 1
            self.target = None if not self.pending else self.target


class LiveReplanner:
    """Runs the daemon's Budgeter and turns budget shrinks into live demotions."""

    def __init__(self, manager: SessionManager) -> None:
        self.manager = manager
        self._budgeter: Budgeter | None = None
        self._lock = threading.Lock()
        self.stats = {"replans": 0, "demoted_kpus": 0, "demoted_bytes": 0, "demotions_failed": 0}

    # -- the re-sampling thread -------------------------------------------------------------
    def _pinned(self) -> tuple[int, int]:
        """N_threads * M_pin for the daemon as a whole: every open session's staging."""
        with self.manager._lock:
            pinned = sum(s.staging_bytes for s in self.manager.sessions.values())
        return (1 if pinned else 0), pinned

    def start(self) -> None:
        """Start re-sampling (no-op unless ``budget.live_replan``); applies the first sample."""
        cfg = self.manager.cfg.budget
        if not cfg.live_replan:
            return
        n, pin = self._pinned()
        try:
            b = self.manager.budgeter(n, pin)
            b.start(cfg.interval_s, self._on_change)
        except (OSError, ValueError) as e:
            log.warning("live re-planning disabled: cannot start budget sampling: %s", e)
            return
        self._budgeter = b
        if b.last is not None:
            self.apply(b.last)

    def stop(self) -> None:
        b, self._budgeter = self._budgeter, None
        if b is not None:
            b.stop()

    def restart(self) -> None:
        """After a reload of ``budget.*``: new override/cap/cgroup, and apply at once."""
        self.stop()
        self.start()

    def _on_change(self, b: BudgetBreakdown) -> None:
        budgeter = self._budgeter
        n, pin = self._pinned()
        if budgeter is not None and (budgeter.n_threads, budgeter.m_pin) != (n, pin):
            budgeter.n_threads, budgeter.m_pin = n, pin
            try:
                b = budgeter.sample(b.reason)
            except OSError as e:
                log.warning("budget re-sample failed: %s", e)
        self.apply(b)

    # -- shrink -> replan -> pending demotions ------------------------------------------------
    def apply(self, b: BudgetBreakdown) -> None:
        """``ledger.shrink(B_pc)``, then record each affected session's demotions."""
        from bladed.server.session import event

        with self._lock:
            grants = self.manager.ledger.shrink(b.b_pc)
            for sid, grant in grants.items():
                sess = self.manager.get(str(sid))
                if sess is None or sess.closing:
                    continue
                demoted = sess.live.schedule(grant)
                if not demoted:
                    continue
                self.stats["replans"] += 1
                event("replan", session=sess.id, mode=sess.plan.mode.value, b_pc=b.b_pc, grant=grant,
                      reason=b.reason, demoted=",".join(k.name for k in demoted))
                # eager: a task per KPU on the session's channels, so an idle session moves too
                for i, k in enumerate(demoted):
                    ch = sess.channels[i % len(sess.channels)]
                    ch.post(functools.partial(sess.live.run_pending, k.tensor_id))

    # -- carrying one out ----------------------------------------------------------------------
    def carry_out(self, sess: Session, kpu: KPU, channel: Channel) -> None:
        """Demote one KPU on ``channel``'s worker (no request on it is in flight); on failure it stays where it is."""
        from bladed.server.session import event

        live = sess.live
        target = live.target or sess.plan
        nbytes = 0
        try:
            if sess.plan.mode is Mode.DUALBLADE:
                self._ready_channels(sess)
                nbytes = self._move(sess, kpu, channel)
            else:
                # CachePolicy-Only (Table III): the KPU stays on the page-cache path, dropped after use
                sess.pc_files[kpu.tensor_id].drop()
        except (OSError, BladedIOError, RegionFullError, ValueError, MemoryError) as e:
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

    @staticmethod
    def _ready_channels(sess: Session) -> None:
        """Give every channel what the direct path needs before a KPU moves there (MemoryError: refuse the move).

        Padded rows (§IV-B precondition fails) go through a per-channel bounce buffer;
        a session that opened with every KPU in the page cache has none yet.  Any
        channel may serve the KPU next, so all of them get one, before anything
        is written to the extent.
        """
        if not sess.plan.aligned:
            for ch in sess.channels:
                ch.ensure_bounce()

    def _room(self, sess: Session, kpu: KPU) -> tuple[int, int]:
        """Bind ``kpu`` on the session's extent: reserved room, else grow in place, else a first extent."""
        mgr = self.manager
        need = kpu.padded_bytes // sess.plan.lba_size
        with sess.live._room:
            if kpu.tensor_id in sess.extent_map:
                # bound by an earlier try whose copy failed: the same LBAs again
                return sess.extent_map.lookup(kpu.tensor_id)
            ext = sess.extent
            if ext is None:
                ext = mgr.allocator.allocate(need, owner=sess.id)
                sess.extent = ext
                sess.extent_map = ExtentMap(sess.plan, ext)
                self._journal(sess)
            elif sess.extent_map.end_lba + need > ext.end:
                ext = mgr.allocator.grow(ext, sess.extent_map.end_lba + need - ext.end)
                sess.extent = sess.extent_map.extent = ext
                self._journal(sess)
            return sess.extent_map.add(kpu)

    def _journal(self, sess: Session) -> None:
        """Record the (new or grown) extent, so crash recovery TRIMs all of it."""
        assert sess.extent is not None
        self.manager.journal.add(SessionRecord(
            id=sess.id, uid=sess.peer.uid, pid=sess.peer.pid, mode=sess.plan.mode.value,
            extents=[(sess.extent.start, sess.extent.nblocks)], pagecache_dir=sess.pc_dir))

    def _move(self, sess: Session, kpu: KPU, ch: Channel) -> int:
        """Copy the filled rows file -> extent a bounded chunk at a time, then drop and unlink the file.

        Demotions run when memory is short, so the move's own memory does not grow
        with the KPU: padded rows go through the channel's bounce buffer (free: its
        worker is busy with this move) plus a dense chunk of at most the same rows,
        whole-LBA rows through one buffer of the same size (``bounce_bytes``).
        """
        plan = sess.plan
        tid = kpu.tensor_id
        f = sess.pc_files[tid]
        t = sess.live.filled.get(tid, 0)
        tb, stride = plan.geometry.token_bytes, plan.token_stride
        with contextlib.ExitStack() as stack:
            if not t:
                buf = None
            elif plan.aligned:
                buf = stack.enter_context(StagingBuffer(min(t * tb, bounce_bytes(plan))))
            else:
                buf = ch.ensure_bounce()
            slba, _ = self._room(sess, kpu)
            if buf is not None:
                rows = buf.nbytes // stride
                padded = np.frombuffer(buf.view(), np.uint8)
                dense = None if plan.aligned else np.empty(min(rows, t) * tb, np.uint8)
                for r in range(0, t, rows):
                    k = min(rows, t - r)
                    if dense is None:
                        f.read_into(buf, r * tb, k * tb)
                    else:
                        # rows are padded to the LBA on the extent (§IV-B precondition fails): one strided copy
                        f.read_into(dense, r * tb, k * tb)
                        padded[:k * stride].reshape(k, stride)[:, :tb] = dense[:k * tb].reshape(k, tb)
                    ch.engine.write(slba + r * stride // plan.lba_size, buf, nbytes=k * stride)
        f.close(unlink=True)   # drops its clean pages; dirty ones go with the inode, never written back
        del sess.pc_files[tid]
        return t * tb

    def to_dict(self) -> dict[str, Any]:
        b = self._budgeter
        with self._lock:
            out: dict[str, Any] = dict(self.stats)
        out["running"] = b is not None
        out["sources"] = list(b.sources) if b is not None else []
        return out


__all__ = ["LiveReplanner", "LiveState"]
