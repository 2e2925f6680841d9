"""The kernel's memory events on the cgroups that bind the page-cache budget, so that a neighbour's growth is
seen in milliseconds, not at the next periodic sample (issue 46; docs/operations.md, "Memory").

Memory files (``pagecache.backing = "memory"``) cannot be reclaimed: when another process in a limited cgroup
above the daemon grows, the only way out is bladed's demotion, and it must start before the cgroup reaches its
limit, or the OOM killer takes the neighbour.  After every sample of Eq. 1-2 (:mod:`bladed.residency.budget`),
:class:`MemoryWatch` arms, for every limited cgroup of the reading:

* a **usage threshold** at the usage where that cgroup's side of Eq. 1 would take ``B_pc`` below what the live
  sessions hold (the growth ``g = (B_a - held) * (1 + k_kernel)`` from now): its usage file is read at a period
  that shrinks with the distance to the threshold (``distance / POLL_RATE``, 5 ms at the least, 250 ms at the
  most: a growth of up to ``POLL_RATE`` is seen within one period, and 5 ms of a 2 GiB/s one is 10 MiB, inside
  ``M_free``); on cgroup v1 the kernel signals the threshold itself (``cgroup.event_control`` with
  ``memory.usage_in_bytes`` and an eventfd, from the charge path: every 128 pages charged per CPU), registered
  never above the wanted one, and the usage is read every 250 ms only, after a registration at once (it waits for
  an RCU grace period, and the usage may pass the threshold meanwhile); cgroup v2 has no such event;
* **reclaim events** for a cgroup already full of page cache, whose usage stays at the limit while anonymous
  memory displaces the cache: v1 ``memory.pressure_level`` (``low``: any reclaim), v2 ``memory.events``
  (``high``/``max`` counted: ``poll`` wakes on the file's change) and a PSI trigger on the cgroup's
  ``memory.pressure`` (a 500 ms window where the daemon may, 2 s otherwise);

and the host's PSI (``/proc/pressure/memory``).  An event makes the budget's thread sample at once (reclaim
events at most every ``RECLAIM_GAP_S``, as a cgroup full of cache reclaims continually).

The watch knows cgroups and byte counts, not sessions: what to demote is the re-planner's
(:mod:`bladed.server.sessions.replan`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("bladed.residency.watch")

#: the fastest growth a v2 poll is sized to catch within one period (bytes/s); faster than any process faults
#: pages in on the machines measured (docs/operations.md, "Memory")
POLL_RATE = 8 << 30
#: the shortest poll period: during a spike (an event's sample in the last HOT_S), else where no eventfd signals
POLL_HOT_S = 0.002
POLL_MIN_S = 0.005
POLL_MAX_S = 0.25
#: after an event's sample the watch stays hot this long: polls at POLL_HOT_S, registers no eventfd threshold
HOT_S = 1.0
#: a threshold is never armed closer than this above the usage (a cgroup over its budget re-samples every step)
MIN_STEP = 2 << 20
#: a v1 eventfd threshold is registered again only when the wanted one moved by more than this
THRESHOLD_SLACK = 8 << 20
#: reclaim-type events (pressure levels, memory.events, PSI) share one sample per this gap
RECLAIM_GAP_S = 0.05
#: PSI: 10 ms of stall in 500 ms where the daemon may use short windows (CAP_SYS_RESOURCE), else 200 ms in 2 s
PSI_SHORT = b"some 10000 500000\x00"
PSI_LONG = b"some 200000 2000000\x00"


@dataclass
class Source:
    """One armed event: a file descriptor to poll, what it means, and what to close."""

    name: str
    fd: int
    events: int
    kind: str                      # "threshold" | "reclaim" | "psi"
    close_fds: list[int] = field(default_factory=list)
    eventfd: bool = False

    def close(self) -> None:
        for fd in self.close_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.close_fds = []


@dataclass
class _Polled:
    path: str
    fd: int
    threshold: int
    #: the threshold the kernel signals (v1's eventfd), or None: while it is above the usage and the watch is not
    #: hot, the usage is read at the longest period only, a safety net
    eventfd: int | None = None
    #: the usage at or past the threshold that a sample has seen (the one that armed it, or the one a crossing
    #: asked for), None while the usage is below it: past the threshold, only a further :data:`MIN_STEP` of
    #: growth is a crossing again
    seen: int | None = None


def thresholds(limits: Any, held: int, pinned_uncharged: int, kernel_overhead: float, host_available: int,
               override: bool) -> dict[str, int]:
    """The usage of each limited cgroup (``BudgetBreakdown.limits``) at which its side of Eq. 1 takes ``B_pc``
    below ``held``; none where ``budget.override`` fixes ``B_pc``."""
    if override:
        return {}
    out: dict[str, int] = {}
    for lc in limits:
        usable = min(host_available, int(lc["room_bytes"]))
        b_a = max(0.0, usable - pinned_uncharged) / (1.0 + kernel_overhead)
        growth = int((b_a - held) * (1.0 + kernel_overhead))
        usage, limit = int(lc["usage_bytes"]), int(lc["limit_bytes"])
        # and before the limit itself, in a cgroup whose page cache would hide the growth until then
        out[str(lc["path"])] = min(usage + max(growth, MIN_STEP), limit - int(lc["free_bytes"]) // 2)
    return out


class MemoryWatch:
    """Kernel memory events for the budget's thread (module docstring).

    :meth:`arm` after every sample; :meth:`sources` and :meth:`timeout_s` for the thread's ``poll``;
    :meth:`fired` for an event of a source, :meth:`poll_crossed` when the poll's timeout passed; :meth:`close`.
    """

    def __init__(self, version: str, pressure_level: str = "low", host_psi: str | None = "/proc/pressure/memory"
                 ) -> None:
        self.version = version
        self.pressure_level = pressure_level
        self.host_psi = host_psi if host_psi and os.path.exists(host_psi) else None
        self._static: dict[str, Source] = {}           # reclaim and PSI sources, by cgroup (armed once)
        self._thresholds: dict[str, tuple[int, Source]] = {}   # v1: path -> (threshold, its eventfd source)
        self._polled: dict[str, _Polled] = {}           # every limited cgroup: path -> its usage poll
        self._no_eventfd: set[str] = set()              # v1 cgroups whose event_control refused a threshold
        self._next_poll = 0.0
        self._hot_until = 0.0
        self.stats = {"threshold": 0, "reclaim": 0, "psi": 0, "poll": 0}
        self.armed: dict[str, int] = {}                 # path -> the usage threshold armed

    def heat(self, now: float) -> None:
        """An event's sample was just taken: a spike may be under way (see :data:`HOT_S`)."""
        self._hot_until = now + HOT_S

    def hot(self, now: float) -> bool:
        return now < self._hot_until

    # -- arming --------------------------------------------------------------------------------------------
    def arm(self, want: dict[str, int], usage: dict[str, int] | None = None) -> None:
        """Arm the usage thresholds ``want`` (path -> bytes, :func:`thresholds`; ``usage``: each cgroup's usage
        they were computed from) and, once per cgroup, its reclaim events; drop what no longer binds.

        Every limited cgroup's usage is polled (:meth:`poll_crossed`); on v1 an eventfd threshold is the fast path
        where one is registered below the wanted threshold (by at most :data:`THRESHOLD_SLACK`) and above the
        usage, and is registered again only outside a spike: a registration waits for an RCU grace period, tens of
        milliseconds on a busy box, while a hot watch polls every 2 ms."""
        for path in list(self._thresholds):
            if path not in want:
                self._thresholds.pop(path)[1].close()
        for path in list(self._polled):
            if path not in want:
                with contextlib.suppress(OSError):
                    os.close(self._polled.pop(path).fd)
        for path, threshold in want.items():
            if path not in self._static:
                self._arm_static(path)
            seen = (usage or {}).get(path)
            now = seen or 0
            self._arm_poll(path, threshold, seen)
            if self.version != "v1" or path in self._no_eventfd or self.hot(time.monotonic()):
                continue             # during a spike the polls do it: a registration stalls for an RCU grace period
            if now >= threshold:     # past a capped threshold already: what the kernel signals is the next step
                threshold = now + MIN_STEP
            old = self._thresholds.get(path)
            # never later than wanted and never crossed already (the kernel signals a crossing once); earlier by up to
            # the slack (an early event is one more sample, cheap)
            if old is not None and max(threshold - THRESHOLD_SLACK, now + 1) <= old[0] <= threshold:
                continue
            src = self._arm_threshold(path, threshold)
            if old is not None:
                old[1].close()
            if src is None:
                self._thresholds.pop(path, None)
                self._no_eventfd.add(path)
            else:
                self._thresholds[path] = (threshold, src)
            if path in self._polled:
                self._polled[path].eventfd = self._thresholds[path][0] if path in self._thresholds else None
        self.armed = dict(want)
        if self.host_psi is not None and "host" not in self._static:
            src = self._arm_psi(self.host_psi, "host")
            if src is not None:
                self._static["host"] = src

    @staticmethod
    def _v1_event(path: str, name: str, arg: object, what: str) -> Source:
        """A v1 ``cgroup.event_control`` registration of an eventfd on the cgroup's file ``name`` with ``arg``
        (a usage threshold, a pressure level); OSError where the kernel or the file's mode refuses it."""
        efd = ffd = -1
        try:
            efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            ffd = os.open(os.path.join(path, name), os.O_RDONLY | os.O_CLOEXEC)
            with open(os.path.join(path, "cgroup.event_control"), "w") as f:
                f.write(f"{efd} {ffd} {arg}")
        except OSError:
            for fd in (efd, ffd):
                if fd >= 0:
                    os.close(fd)
            raise
        kind = "threshold" if name == "memory.usage_in_bytes" else "reclaim"
        return Source(f"{what}:{path}", efd, select.POLLIN, kind, [efd, ffd], eventfd=True)

    def _arm_threshold(self, path: str, threshold: int) -> Source | None:
        try:
            src = self._v1_event(path, "memory.usage_in_bytes", threshold, "v1-threshold")
        except OSError as e:
            log.info("memory watch: no usage threshold on %s (%s); its usage is polled", path, e)
            return None
        log.debug("memory watch: usage threshold %d armed on %s (eventfd %d)", threshold, path, src.fd)
        return src

    def _arm_poll(self, path: str, threshold: int, usage: int | None) -> None:
        p = self._polled.get(path)
        if p is None:
            name = "memory.usage_in_bytes" if self.version == "v1" else "memory.current"
            try:
                fd = os.open(os.path.join(path, name), os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                log.info("memory watch: cannot read the usage of %s (%s)", path, e)
                return
            p = self._polled[path] = _Polled(path, fd, threshold)
        p.threshold = threshold
        # the sample that armed it measured this usage: a threshold capped below it (a cgroup that sits at its limit,
        # full of page cache) is not crossed by what that sample saw, else every poll would sample again
        p.seen = usage if usage is not None and usage >= threshold else None
        self._next_poll = 0.0             # measure at once against the new threshold (it may be crossed already)

    def _arm_static(self, path: str) -> None:
        src: Source | None = None
        if self.version == "v1":
            try:
                src = self._v1_event(path, "memory.pressure_level", self.pressure_level,
                                     f"v1-pressure-level:{self.pressure_level}")
            except OSError as e:
                log.info("memory watch: no v1 memory.pressure_level events for %s (%s)", path, e)
        else:
            try:
                fd = os.open(os.path.join(path, "memory.events"), os.O_RDONLY | os.O_CLOEXEC)
                os.read(fd, 4096)          # poll() reports a change after the first read
                src = Source(f"v2-events:{path}", fd, select.POLLPRI, "reclaim", [fd])
            except OSError as e:
                log.info("memory watch: no memory.events notifications for %s (%s)", path, e)
            psi = self._arm_psi(os.path.join(path, "memory.pressure"), path)
            if psi is not None:
                self._static[path + ":psi"] = psi
        if src is not None:
            self._static[path] = src
        else:
            self._static.setdefault(path, Source(f"none:{path}", -1, 0, "reclaim"))

    @staticmethod
    def _arm_psi(path: str, name: str) -> Source | None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            log.info("memory watch: no PSI trigger on %s (%s)", path, e)
            return None
        for trig in (PSI_SHORT, PSI_LONG):
            try:
                os.write(fd, trig)
                return Source(f"psi:{path}", fd, select.POLLPRI, "psi", [fd])
            except OSError as e:
                err = e
        os.close(fd)
        log.info("memory watch: PSI trigger refused by %s (%s)", path, err)
        return None

    # -- the thread's side ----------------------------------------------------------------------------------
    def sources(self) -> list[Source]:
        """Everything to poll now."""
        out = [s for s in self._static.values() if s.fd >= 0]
        out.extend(src for _, src in self._thresholds.values())
        return out

    def names(self) -> list[str]:
        """What is armed, for ``stats`` (``replan.sources``)."""
        out = [s.name for s in self.sources()]
        out.extend(f"poll:{p.path}" for p in self._polled.values())
        return out

    def timeout_s(self, now: float) -> float | None:
        """Seconds until the next usage poll is due (None: no poll armed)."""
        if not self._polled:
            return None
        return max(0.0, self._next_poll - now)

    def fired(self, src: Source) -> str:
        """Consume the event of ``src``; its kind (``threshold``, ``reclaim`` or ``psi``)."""
        if src.eventfd:
            with contextlib.suppress(BlockingIOError, OSError):
                os.eventfd_read(src.fd)
        elif src.kind == "reclaim":
            with contextlib.suppress(OSError):
                os.pread(src.fd, 4096, 0)          # re-arms the change notification
        self.stats[src.kind] += 1
        log.debug("memory watch: %s fired (fd %d)", src.name, src.fd)
        return src.kind

    def poll_crossed(self, now: float) -> bool:
        """Read the polled usages (when due): True if one is at or past its threshold."""
        if not self._polled or now < self._next_poll:
            return False
        crossed = False
        period = POLL_MAX_S
        hot = self.hot(now)
        for p in self._polled.values():
            try:
                usage = int(os.pread(p.fd, 64, 0))
            except (OSError, ValueError):
                continue
            distance = p.threshold - usage
            if distance > 0:
                p.seen = None
            elif p.seen is None or usage >= p.seen + MIN_STEP:
                # past it: a crossing, unless a sample saw it there and it grew less than MIN_STEP since (a cgroup
                # at its limit, whose growth shows in reclaim events, not in its usage)
                crossed, p.seen = True, usage
                continue
            if hot or p.eventfd is None or p.eventfd <= usage:
                period = min(period, max(POLL_HOT_S if hot else POLL_MIN_S, distance / POLL_RATE))
        self._next_poll = now + period
        if crossed:
            self.stats["poll"] += 1
        return crossed

    def drop(self, src: Source) -> None:
        """Forget a source whose file went away (its cgroup was removed)."""
        src.close()
        src.fd = -1
        for path, (_, t) in list(self._thresholds.items()):
            if t is src:
                del self._thresholds[path]

    def close(self) -> None:
        for src in self._static.values():
            src.close()
        for _, src in self._thresholds.values():
            src.close()
        for p in self._polled.values():
            with contextlib.suppress(OSError):
                os.close(p.fd)
        self._static.clear()
        self._thresholds.clear()
        self._polled.clear()


__all__ = ["POLL_RATE", "MemoryWatch", "Source", "thresholds"]
