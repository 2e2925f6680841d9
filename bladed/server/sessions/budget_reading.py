"""The daemon's one reading of the page-cache budget (Eq. 1-2): :class:`BudgetSampler` owns it.

It measures the daemon's memory cgroup and the host on the re-planner's schedule (``budget.interval_s`` and
memory pressure, with ``budget.live_replan``) and on demand, when a reader finds the reading older than the
freshness bound it asks for.  The gauges, the ``status`` and ``budget`` ops, session open and the prefix
cache's room all read it; a session's own staging terms (Eq. 2's ``N_threads`` and ``M_pin``) and the open
sessions' (``M_pin,others``) are applied to the shared figures, never by reading /proc and cgroups again.
Must not touch sessions, storage or the ledger.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from bladed.config import Config
from bladed.residency.budget import BudgetBreakdown, Budgeter, SampleCallback

log = logging.getLogger("bladed.budget")

#: a session's open measures anew: its staging check is what keeps the daemon from the OOM killer, and the
#: operator may have cut the memory limit a moment ago
OPEN_MAX_AGE_S = 0.0
#: the ``budget`` op measures anew: it is the operator's (and the tests') "what is B_pc now"
REQUEST_MAX_AGE_S = 0.0


class BudgetSampler:
    """Samples Eq. 1-2 for the daemon as a whole and hands the latest reading to every reader.

    ``staging_bytes()`` is the staging of the open sessions (``M_pin,others``), asked at every read, so a
    reading stays exact for the sessions opened or closed since it was measured; ``own_kv_bytes()`` the page
    cache of the daemon's KV files on disk (``M_kv``) and ``own_kv_memory_bytes()`` its KV in memory files
    (``M_kv,mem``), asked at every measurement.
    """

    def __init__(self, cfg: Config, staging_bytes: Callable[[], int],
                 own_kv_bytes: Callable[[], int] | None = None,
                 own_kv_memory_bytes: Callable[[], int] | None = None) -> None:
        self.cfg = cfg
        self.staging_bytes = staging_bytes
        self.own_kv_bytes = own_kv_bytes
        self.own_kv_memory_bytes = own_kv_memory_bytes
        self._lock = threading.Lock()
        self._budgeter: Budgeter | None = None
        self._last: BudgetBreakdown | None = None
        self._last_at = 0.0                  # time.monotonic() of _last's measurement
        self._running = False
        self._demand = 0
        #: Budgeter.stats of the budgeters a reload replaced (so the samples counters never go back)
        self._past: dict[str, int] = {}

    # -- the readers ---------------------------------------------------------------------------------
    def reading(self, max_age_s: float) -> BudgetBreakdown:
        """The daemon-wide reading, measured now if the shared one is older than ``max_age_s`` (OSError or
        ValueError if it cannot be measured)."""
        with self._lock:
            last, age = self._last, time.monotonic() - self._last_at
        if last is None or age > max_age_s:
            b = self._budgeter_now().sample("demand")
            with self._lock:
                self._demand += 1
            last = self._keep(b)
        return last.with_staging(0, 0, self.staging_bytes())

    def for_session(self, copy_threads: int, pinned_per_thread_bytes: int,
                    max_age_s: float = OPEN_MAX_AGE_S) -> BudgetBreakdown:
        """Eq. 1-2 for a session being planned: ``copy_threads`` slots of ``pinned_per_thread_bytes``, besides
        the open sessions' staging, on the shared reading."""
        return self.reading(max_age_s).with_staging(copy_threads, pinned_per_thread_bytes, self.staging_bytes())

    def report(self, max_age_s: float | None = None) -> dict[str, Any]:
        """The reading's terms for a report (gauges, ``status``, ``budget``): at most ``max_age_s`` old
        (default ``budget.interval_s``); the last one, or nothing, if it cannot be measured now."""
        try:
            return self.reading(self.cfg.budget.interval_s if max_age_s is None else max_age_s).to_dict()
        except (OSError, ValueError) as e:
            log.warning("budget sampling failed: %s", e)
            with self._lock:
                last = self._last
            return last.to_dict() if last is not None else {}

    # -- the schedule ---------------------------------------------------------------------------------
    def start(self, on_change: SampleCallback, held_bytes: Callable[[], int] | None = None) -> BudgetBreakdown:
        """Re-sample every ``budget.interval_s`` and on memory pressure; ``on_change(reading)`` when ``B_pc``
        moved past the hysteresis or fell below ``held_bytes()`` (``Budgeter.start``).  Returns the first
        reading; OSError or ValueError if sampling cannot start."""
        b = self._budgeter_now()

        def changed(sample: BudgetBreakdown) -> None:
            b.pinned_elsewhere_bytes = self.staging_bytes()   # the sessions opened or closed since
            on_change(self._keep(sample).with_staging(0, 0, b.pinned_elsewhere_bytes))

        b.start(self.cfg.budget.interval_s, changed, on_sample=self._keep, held_bytes=held_bytes)
        with self._lock:
            self._running = True
        first = b.last
        assert first is not None            # Budgeter.start samples once before its thread runs
        return self._keep(first).with_staging(0, 0, self.staging_bytes())

    def stop(self) -> None:
        with self._lock:
            b, self._running = self._budgeter, False
        if b is not None:
            b.stop()

    def reconfigure(self) -> None:
        """After a reload of ``budget.*`` (stopped): the next reading uses the new override, cap and cgroup."""
        with self._lock:
            b, self._budgeter, self._last = self._budgeter, None, None
            if b is not None:
                self._past = {k: self._past.get(k, 0) + v for k, v in b.stats.items()}

    @property
    def last(self) -> BudgetBreakdown | None:
        with self._lock:
            return self._last

    def to_dict(self) -> dict[str, Any]:
        """``samples`` (every measurement), ``periodic``, ``pressure`` and ``threshold`` (the schedule's),
        ``demand`` (a reader found the reading too old), ``changes`` (moves of ``B_pc`` past the hysteresis);
        ``running``, ``sources`` (the memory watch's armed sources) and ``events`` (what they fired, by kind)."""
        with self._lock:
            b = self._budgeter
            out: dict[str, Any] = self._counts(b)
            running = self._running
        return {"samples": out, "running": running, "sources": list(b.sources) if b is not None and running else [],
                "events": b.watch_stats if b is not None and running else {}}

    # -- inside -----------------------------------------------------------------------------------------
    def _budgeter_now(self) -> Budgeter:
        with self._lock:
            if self._budgeter is None:
                c = self.cfg.budget
                self._budgeter = Budgeter(0, 0, override_bytes=c.override, cap_bytes=c.cap,
                                          cgroup_path=c.cgroup or None, pinned_elsewhere_bytes=self.staging_bytes(),
                                          kernel_overhead=c.kernel_overhead, own_kv_bytes=self.own_kv_bytes,
                                          headroom=c.headroom, own_kv_memory_bytes=self.own_kv_memory_bytes,
                                          # memory files are what the kernel cannot reclaim: the floor is theirs
                                          absorb_rate=c.absorb_rate if self.cfg.group1_backing == "memory" else 0)
            return self._budgeter

    def _keep(self, b: BudgetBreakdown) -> BudgetBreakdown:
        with self._lock:
            if self._last is None or b.sampled_at >= self._last.sampled_at:
                self._last, self._last_at = b, time.monotonic()
        return b

    def _counts(self, b: Budgeter | None) -> dict[str, int]:
        """Samples by reason and applied changes since the daemon started (hold ``_lock``)."""
        now = dict(b.stats) if b is not None else {}
        out = {k: self._past.get(k, 0) + now.get(k, 0) for k in self._past.keys() | now.keys()}
        return out | {"demand": self._demand}


__all__ = ["OPEN_MAX_AGE_S", "REQUEST_MAX_AGE_S", "BudgetSampler"]
