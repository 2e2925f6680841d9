"""The page-cache budget of paper Eq. 1-2, from cgroup and host memory.

    M*   = min(M_avail, M_max - M_anon+shmem)                       (Eq. 1)
    B_pc = max(0, M* - N_threads * M_pin)                             (Eq. 2)

as bladed computes them (docs/architecture.md, "The page-cache budget"):

    M_mapped = max(0, M_file,mapped - M_shmem - M_kv)
    M_kernel = max(0, M_usage - M_anon - M_shmem - M_file - k_kernel * M_kv)
    M_free   = max(headroom * M_max, absorb_rate * REACTION_S)   (where a cgroup limit gives M_max; else 0)
    M*   = min(M_avail + M_kv,mem,
               min over every limited cgroup c from the daemon's up of
                   M_max(c) - (M_anon+shmem(c) - M_kv,mem) - M_kernel(c) - M_mapped(c) - M_free(c))
    M_pin,uncharged = N_threads * M_pin + max(0, M_pin,others - (M_shmem - M_kv,mem))
    B_pc = max(0, M* - M_pin,uncharged) / (1 + k_kernel)

Every limited cgroup on the path up binds, with its own usage: a limit set on a parent (a Kubernetes pod, a
systemd slice with ``MemoryMax=``, a compose project's cgroup parent) is shared with the daemon's siblings, whose
memory counts against it although none of it is charged to the daemon's cgroup.  The one with the least room is
the *binding* cgroup; the breakdown's ``M_max``, ``M_anon+shmem``, ``M_kernel``, ``M_mapped`` and ``M_free`` are
its figures.  ``M_kernel`` is the rest of what the kernel charged there (slab, page tables, stacks, sockets),
which the KV cannot take either, less the share Eq. 2's ``k_kernel`` already reserves for bladed's disk files.

``M_mapped`` is the page cache the cgroup's processes map that is neither
shmem nor bladed's own KV (``M_kv``, the page cache of the daemon's KV files):
their code and the files they work on.  The paper's Eq. 1 counts it as free
for the KV, but a cgroup that fills its limit with Group 1 evicts it (the
processes fault their code back in) and then meets Group 1's dirty pages,
which reclaim cannot free without writeback: it throttles 100 ms at a time
(``VMSCAN_THROTTLE_WRITEBACK``) and wakes the flusher, whose burst stalls the
direct path (docs/architecture.md).  ``M_free`` keeps the cgroup off its limit for the charges no
term names (the session's page tables and slab, the processes' heaps, the
kernel's per-CPU charge batches): without it, a cgroup whose Group 1 reached
its limit reclaimed on every one-token append (docs/bench/HISTORY.md, "Issue 31
evening").

``M_kv,mem`` is bladed's own KV in memory files (Dual-Blade's Group 1 with
``pagecache.backing = "memory"``): shmem, charged to the cgroup and missing
from MemAvailable, yet the very KV ``B_pc`` is for, so it is taken out of
``M_anon+shmem`` and given back to ``M_avail`` (without it, a session's own
Group 1 would shrink the budget it was planned in, and live re-planning would
demote it).

The open sessions' staging (``M_pin,others``) is shmem once the daemon has
touched it, so it is counted once; the staging of the session being planned
(``N_threads * M_pin``) is not touched yet, and other shmem of the cgroup is
not staging;
and every byte of page cache brings ``k_kernel`` bytes of kernel memory
charged to the same cgroup (buffer heads, the page-cache index: 0.028 on
ext4), without which a full budget overfills the cgroup.

The memory cgroup that is charged, ``M_max`` and ``M_anon+shmem`` come from
:mod:`bladed.residency.cgroups`; ``M_avail`` is the host's MemAvailable (psutil),
which ignores cgroups.

:class:`Budgeter` samples on demand, periodically, and at once on the kernel's memory events
(:mod:`bladed.residency.watch`: usage thresholds of the limited cgroups where the budget would fall below what
the live sessions hold, reclaim events, PSI triggers).  ``M_free`` is what a neighbour may take between such an
event and the demotion it triggers: at least ``absorb_rate`` times the reaction time measured
(:data:`REACTION_S`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import psutil

from bladed.logfmt import fields
from bladed.residency.cgroups import CgroupInfo, cgroup_from_path, locate_memory_cgroup, read_memory
from bladed.residency.watch import RECLAIM_GAP_S, MemoryWatch, thresholds

log = logging.getLogger(__name__)



# -- the breakdown -------------------------------------------------------------------

@dataclass(frozen=True)
class BudgetBreakdown:
    """Every term of Eq. 1-2 for one sample, plus what decided them.

    The fields (and the keys of :meth:`to_dict`, on the wire) are named for
    what they are; the paper's symbol of each is in its comment.
    """

    host_available_bytes: int    # M_avail: host MemAvailable
    memory_limit_bytes: int      # M_max: cgroup limit (min over ancestors), or host MemTotal if unlimited
    anon_shmem_bytes: int        # M_anon+shmem: anon + shmem charged to the cgroup
    usable_bytes: int            # M* (Eq. 1)
    copy_threads: int            # N_threads (Eq. 2)
    pinned_per_thread_bytes: int  # M_pin (Eq. 2): the staging each copy thread pins
    pagecache_budget_bytes: int  # B_pc (Eq. 2), after the operator's override / cap
    cgroup: str                  # cgroup directory ("" if none)
    cgroup_version: str          # "v1" | "v2" | "none"
    override_bytes: int | None
    cap_bytes: int | None
    sampled_at: float            # time.time()
    pagecache_budget_computed_bytes: int = 0  # B_pc (Eq. 2) before override / cap
    anon_bytes: int = 0
    shmem_bytes: int = 0
    file_bytes: int = 0          # page cache now charged (shmem excluded): what B_pc is compared with
    kernel_bytes: int | None = None  # kernel memory charged (not part of Eq. 1; for diagnosis)
    host_total_bytes: int = 0    # host MemTotal
    limited: bool = False        # True if a cgroup limit (not MemTotal) gave M_max
    memory_limit_source: str = ""  # the file that gave M_max, or "host MemTotal"
    binding: str = ""            # "host_available" or "cgroup": which side of the min() of Eq. 1 won
    reason: str = "manual"       # what triggered the sample: manual | periodic | pressure
    pinned_elsewhere_bytes: int = 0  # M_pin,others: staging of the open sessions (shmem once touched)
    pinned_uncharged_bytes: int = 0  # M_pin,uncharged: the staging not yet charged as shmem (what Eq. 2 subtracts)
    kernel_overhead: float = 0.0     # k_kernel: kernel memory charged per byte of page cache
    mapped_bytes: int = 0            # M_mapped (Eq. 1 as bladed computes it): mapped page cache kept resident
    file_mapped_bytes: int = 0       # M_file,mapped: page cache mapped into the cgroup's processes, shmem included
    own_kv_bytes: int = 0            # M_kv: page cache of bladed's own KV files on disk (Group 1, retained prefixes)
    own_kv_memory_bytes: int = 0     # M_kv,mem: bladed's own KV in memory files (shmem: Group 1 in memory)
    headroom: float = 0.0            # the fraction of a cgroup's limit kept free
    free_bytes: int = 0              # M_free (Eq. 1 as bladed computes it): headroom * M_max where a cgroup limits
    #: the limited cgroup whose side of Eq. 1 is the smallest ("" where none limits): M_max, M_anon+shmem,
    #: M_mapped and M_free above are its figures, descendants (the daemon's siblings) included
    binding_cgroup: str = ""
    #: every limited cgroup from the charged one up: path, limit_bytes, limit_source, usage_bytes,
    #: anon_shmem_bytes, kernel_bytes, mapped_bytes, free_bytes, absorb_bytes (M_free's share above the headroom) and
    #: room_bytes (its side of Eq. 1)
    limits: tuple[dict[str, Any], ...] = ()
    #: M_kernel (Eq. 1 as bladed computes it): the binding cgroup's charges that are neither anon, shmem nor page
    #: cache (slab, page tables, stacks), less the share Eq. 2's k_kernel already counts for bladed's disk files
    charged_kernel_bytes: int = 0
    #: M* with M_free at its ``headroom`` share only: what memory the daemon's own staging may take.  The absorb floor
    #: of M_free is room for a neighbour while KV in memory is demoted; staging cannot be demoted, so a reserve for
    #: a demotion's reaction time does not protect anyone from it, and refusing every session below a limit of twice
    #: the floor (the 48 MiB cgroups of small boxes) would make a valid config useless
    staging_usable_bytes: int = 0
    #: the time.monotonic() of the kernel event that triggered the sample (0: none); not on the wire
    event_at: float = field(default=0.0, compare=False)

    @property
    def pinned_bytes(self) -> int:
        """``N_threads * M_pin + M_pin,others``: all the staging memory the sample accounts for."""
        return self.copy_threads * self.pinned_per_thread_bytes + self.pinned_elsewhere_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self) | {"pinned_bytes": self.pinned_bytes}
        d.pop("event_at")
        return d

    def with_staging(self, copy_threads: int, pinned_per_thread_bytes: int,
                     pinned_elsewhere_bytes: int) -> BudgetBreakdown:
        """Eq. 2 of this same reading for other staging terms (a new session's ``N_threads`` and ``M_pin``,
        the open sessions' ``M_pin,others``): Eq. 1's figures are kept, nothing is read again."""
        uncharged, computed, b_pc = _eq2(self.usable_bytes, self.shmem_bytes - self.own_kv_memory_bytes, copy_threads,
                                         pinned_per_thread_bytes, pinned_elsewhere_bytes, self.kernel_overhead,
                                         self.override_bytes, self.cap_bytes)
        return replace(self, copy_threads=copy_threads, pinned_per_thread_bytes=pinned_per_thread_bytes,
                       pinned_elsewhere_bytes=pinned_elsewhere_bytes, pinned_uncharged_bytes=uncharged,
                       pagecache_budget_computed_bytes=computed, pagecache_budget_bytes=b_pc)

    def describe(self) -> str:
        """One line for logs and ``bladectl``."""
        mib = 1 << 20
        extra = ""
        if self.override_bytes is not None:
            extra = f" (override {self.override_bytes / mib:.0f} MiB)"
        elif self.cap_bytes is not None and self.pagecache_budget_bytes < self.pagecache_budget_computed_bytes:
            extra = f" (capped at {self.cap_bytes / mib:.0f} MiB)"
        return (f"B_pc={self.pagecache_budget_bytes / mib:.0f} MiB{extra} = max(0, M*={self.usable_bytes / mib:.0f} - "
                f"uncharged staging {self.pinned_uncharged_bytes / mib:.0f}) / {1 + self.kernel_overhead:g} ; "
                f"M* = min(M_avail={self.host_available_bytes / mib:.0f}, M_max={self.memory_limit_bytes / mib:.0f} - "
                f"M_anon+shmem={self.anon_shmem_bytes / mib:.0f} - M_kernel={self.charged_kernel_bytes / mib:.0f} - "
                f"M_mapped={self.mapped_bytes / mib:.0f} - "
                f"M_free={self.free_bytes / mib:.0f}) MiB "
                f"[{self.cgroup_version} {self.cgroup or 'host'}"
                f"{'' if self.binding_cgroup in ('', self.cgroup) else f'; bound by {self.binding_cgroup}'}]")


def _eq2(usable: int, shmem: int, copy_threads: int, pinned_per_thread: int, pinned_elsewhere: int,
         kernel_overhead: float, override: int | None, cap: int | None) -> tuple[int, int, int]:
    """Eq. 2 as bladed computes it: ``(M_pin,uncharged, B_pc computed, B_pc after override / cap)``.

    The open sessions' staging that is already shmem is in ``M_anon+shmem`` (at most all of the cgroup's
    shmem); the new session's is not touched yet.  The page cache's own kernel memory is charged with it."""
    uncharged = copy_threads * pinned_per_thread + max(0, pinned_elsewhere - shmem)
    computed = int(max(0, usable - uncharged) / (1.0 + kernel_overhead))
    if override is not None:
        return uncharged, computed, override
    return uncharged, computed, computed if cap is None else min(computed, cap)


SampleCallback = Callable[[BudgetBreakdown], object]

#: a kernel memory event -> memory coming back: the first KPU it made the daemon demote was written and freed 18-41 ms
#: (median 21) after it on the 2-vCPU build VM (12.75 MiB KPUs, a neighbour faulting pages in at up to 2 GiB/s beside
#: it), and memory comes back from that KPU's first 4 MiB piece on (docs/operations.md, "Memory"); what a neighbour
#: growing at ``absorb_rate`` takes meanwhile is what M_free must hold
REACTION_S = 0.025


class Budgeter:
    """Computes ``B_pc`` for a memory cgroup and keeps it fresh.

    ``cgroup_path`` fixes the cgroup directory; otherwise the memory cgroup of
    ``pid`` (default: this process) is located at every sample, so a process
    moved between cgroups is followed.  ``override_bytes`` replaces the computed
    budget; ``cap_bytes`` bounds it.  Both leave the other terms reported.
    ``copy_threads * pinned_per_thread_bytes`` is the staging of the session
    being planned (not yet touched), ``pinned_elsewhere_bytes`` the staging of
    the open sessions (shmem once touched), and
    ``kernel_overhead`` the kernel memory charged per byte of page cache,
    ``headroom`` the fraction of a cgroup's limit left free, and
    ``own_kv_bytes()`` the page cache of bladed's own KV files now (``M_kv``;
    none without it), ``own_kv_memory_bytes()`` its KV in memory files
    (``M_kv,mem``) (module docstring).
    """

    def __init__(self, copy_threads: int, pinned_per_thread_bytes: int, override_bytes: int | None = None,
                 cap_bytes: int | None = None, cgroup_path: str | None = None, pid: int | None = None, *,
                 proc_root: str = "/proc", mem_available: Callable[[], int] | None = None,
                 mem_total: Callable[[], int] | None = None, hysteresis_bytes: int = 32 << 20,
                 pressure_level: str = "low", pinned_elsewhere_bytes: int = 0,
                 kernel_overhead: float = 0.0, own_kv_bytes: Callable[[], int] | None = None,
                 headroom: float = 0.0, own_kv_memory_bytes: Callable[[], int] | None = None,
                 absorb_rate: int = 0) -> None:
        if copy_threads < 0 or pinned_per_thread_bytes < 0 or pinned_elsewhere_bytes < 0:
            raise ValueError(f"copy_threads, pinned_per_thread_bytes and pinned_elsewhere_bytes must be >= 0, got "
                             f"{copy_threads}, {pinned_per_thread_bytes} and {pinned_elsewhere_bytes}")
        if not 0.0 <= kernel_overhead < 1.0:
            raise ValueError(f"kernel_overhead must be in [0, 1), got {kernel_overhead}")
        if not 0.0 <= headroom < 0.5:
            raise ValueError(f"headroom must be in [0, 0.5), got {headroom}")
        for name, v in (("override_bytes", override_bytes), ("cap_bytes", cap_bytes)):
            if v is not None and v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        if pressure_level not in ("low", "medium", "critical"):
            raise ValueError(f"pressure_level must be low, medium or critical, got {pressure_level!r}")
        self.copy_threads = copy_threads                        # N_threads (Eq. 2)
        self.pinned_per_thread_bytes = pinned_per_thread_bytes  # M_pin (Eq. 2)
        self.pinned_elsewhere_bytes = pinned_elsewhere_bytes
        self.kernel_overhead = kernel_overhead
        self.own_kv_bytes = own_kv_bytes
        self.own_kv_memory_bytes = own_kv_memory_bytes
        self.headroom = headroom
        if absorb_rate < 0:
            raise ValueError(f"absorb_rate must be >= 0, got {absorb_rate}")
        self.absorb_rate = absorb_rate
        self.override_bytes = override_bytes
        self.cap_bytes = cap_bytes
        self.cgroup_path = cgroup_path
        self.pid = pid
        self.proc_root = proc_root
        self.hysteresis_bytes = hysteresis_bytes
        self.pressure_level = pressure_level
        self._mem_available = mem_available or (lambda: int(psutil.virtual_memory().available))
        self._mem_total = mem_total or (lambda: int(psutil.virtual_memory().total))
        self._lock = threading.Lock()
        self._last: BudgetBreakdown | None = None
        self._thread: threading.Thread | None = None
        self._stop_r = self._stop_w = -1
        self._wake_r = self._wake_w = -1             # another thread's sample: re-arm the watch
        self._armed = 0                               # the watch's arms so far (a reader waits for the next one)
        self._armed_cond = threading.Condition(self._lock)
        self._watch: MemoryWatch | None = None
        self._located: CgroupInfo | None = None
        self.stats = {"samples": 0, "periodic": 0, "pressure": 0, "threshold": 0, "changes": 0}
        self.locate()      # fail early on a bad path or pid

    def free_bytes(self, limit: int) -> int:
        """``M_free`` of a cgroup limited to ``limit``: the ``headroom`` fraction of it, and at least what a neighbour
        growing at ``absorb_rate`` takes while a demotion it triggers is under way (:data:`REACTION_S`); never more
        than half of the limit."""
        return min(limit // 2, max(self.headroom_bytes(limit), int(self.absorb_rate * REACTION_S)))

    def headroom_bytes(self, limit: int) -> int:
        """The ``headroom`` share of ``M_free`` alone (what a session's staging is admitted against), capped as
        :meth:`free_bytes` is."""
        return min(limit // 2, int(self.headroom * limit))

    # -- sampling --------------------------------------------------------------
    def locate(self) -> CgroupInfo:
        if self.cgroup_path is not None:
            return cgroup_from_path(self.cgroup_path, self.proc_root)
        return locate_memory_cgroup(self.pid, self.proc_root)

    def sample(self, reason: str = "manual", *, relocate: bool = True, event_at: float = 0.0) -> BudgetBreakdown:
        """Read the kernel's figures now and compute Eq. 1-2 (``relocate=False``: in the cgroup found last;
        ``event_at``: the ``time.monotonic()`` of the kernel event that asked for the sample)."""
        info = self._located if (not relocate and self._located is not None) else self.locate()
        self._located = info
        reading = read_memory(info, self.proc_root)
        # after the cgroup's figures: KV pages mapped in between count as ours, never as the processes' own
        own_kv = max(0, self.own_kv_bytes()) if self.own_kv_bytes is not None else 0
        # the KV's own memory files are shmem of the cgroup (at most all of it) and not in MemAvailable
        own_mem_now = max(0, self.own_kv_memory_bytes()) if self.own_kv_memory_bytes else 0
        own_mem = min(reading.shmem, own_mem_now)
        m_avail = self._mem_available() + own_mem
        mem_total = self._mem_total()
        # Eq. 1 for every limited cgroup from ours up: each counts its descendants (our siblings too), and the
        # smallest side binds; bladed's own KV is charged to each of them and given back to each
        limits: list[dict[str, Any]] = []
        for lc in reading.limits:
            if lc.limit >= mem_total:
                continue
            mine = min(lc.shmem, own_mem_now)
            anon_shmem = lc.anon + lc.shmem - mine
            mapped = max(0, lc.mapped - lc.shmem - own_kv)
            # the rest of what is charged (slab, page tables, stacks, sockets) is not the KV's to take either;
            # the page cache's own share of it (k_kernel of bladed's disk files) is Eq. 2's
            kernel = max(0, lc.usage - lc.anon - lc.shmem - lc.file - int(self.kernel_overhead * own_kv))
            free = self.free_bytes(lc.limit)
            absorb = free - self.headroom_bytes(lc.limit)                  # the absorb floor's own share
            limits.append({"path": lc.path, "limit_bytes": lc.limit, "limit_source": lc.limit_source,
                           "usage_bytes": lc.usage, "usage_file": lc.usage_file, "anon_shmem_bytes": anon_shmem,
                           "kernel_bytes": kernel, "mapped_bytes": mapped, "free_bytes": free,
                           "absorb_bytes": absorb, "room_bytes": lc.limit - anon_shmem - kernel - mapped - free})
        binding = min(limits, key=lambda d: int(d["room_bytes"])) if limits else None
        limited = binding is not None
        if binding is not None:
            m_max, m_anon_shmem = int(binding["limit_bytes"]), int(binding["anon_shmem_bytes"])
            m_mapped, m_free = int(binding["mapped_bytes"]), int(binding["free_bytes"])
            m_kernel = int(binding["kernel_bytes"])
            cg_side = int(binding["room_bytes"])
        else:
            m_max, m_anon_shmem = mem_total, reading.anon + reading.shmem - own_mem
            m_mapped, m_free, m_kernel = max(0, reading.mapped - reading.shmem - own_kv), 0, 0
            cg_side = m_max - m_anon_shmem - m_mapped
        m_star = min(m_avail, cg_side)                                     # Eq. 1
        staging_usable = min([m_avail] + [int(d["room_bytes"]) + int(d["absorb_bytes"]) for d in limits]) \
            if limits else m_star
        uncharged, computed, b_pc = _eq2(m_star, reading.shmem - own_mem, self.copy_threads,
                                         self.pinned_per_thread_bytes,
                                         self.pinned_elsewhere_bytes, self.kernel_overhead, self.override_bytes,
                                         self.cap_bytes)                   # Eq. 2
        b = BudgetBreakdown(
            host_available_bytes=m_avail, memory_limit_bytes=m_max, anon_shmem_bytes=m_anon_shmem,
            usable_bytes=m_star, copy_threads=self.copy_threads, pinned_per_thread_bytes=self.pinned_per_thread_bytes,
            pagecache_budget_bytes=b_pc, cgroup=info.path, cgroup_version=info.version,
            override_bytes=self.override_bytes, cap_bytes=self.cap_bytes, sampled_at=time.time(),
            pagecache_budget_computed_bytes=computed, anon_bytes=reading.anon, shmem_bytes=reading.shmem,
            file_bytes=reading.file, kernel_bytes=reading.kernel, host_total_bytes=mem_total, limited=limited,
            memory_limit_source=str(binding["limit_source"]) if binding is not None else "host MemTotal",
            binding="host_available" if m_avail <= cg_side else "cgroup", reason=reason,
            pinned_elsewhere_bytes=self.pinned_elsewhere_bytes, pinned_uncharged_bytes=uncharged,
            kernel_overhead=self.kernel_overhead, mapped_bytes=m_mapped, file_mapped_bytes=reading.mapped,
            own_kv_bytes=own_kv, own_kv_memory_bytes=own_mem, headroom=self.headroom, free_bytes=m_free,
            binding_cgroup=str(binding["path"]) if binding is not None else "", limits=tuple(limits),
            charged_kernel_bytes=m_kernel, staging_usable_bytes=staging_usable,
            event_at=event_at,
        )
        with self._lock:
            self._last = b
            self.stats["samples"] += 1
            thread, wake, seq = self._thread, self._wake_w, self._armed
        if thread is not None and wake >= 0 and threading.current_thread() is not thread:
            # a reader's sample (an open, the budget op): the watch re-arms for what it found (a new limit) before
            # the reader goes on (a sub-millisecond wait; bounded, should the thread be busy)
            with contextlib.suppress(OSError):
                os.write(wake, b"w")
            with self._armed_cond:
                self._armed_cond.wait_for(lambda: self._armed != seq or self._thread is None, timeout=0.5)
        return b

    @property
    def last(self) -> BudgetBreakdown | None:
        with self._lock:
            return self._last

    @property
    def pagecache_budget_bytes(self) -> int:
        """The current budget, ``B_pc`` (samples once if never sampled)."""
        last = self.last
        return (last if last is not None else self.sample()).pagecache_budget_bytes

    # -- the re-sampling thread ------------------------------------------------------
    def start(self, interval_s: float = 5.0, on_change: SampleCallback | None = None, *,
              on_sample: SampleCallback | None = None, held_bytes: Callable[[], int] | None = None) -> None:
        """Re-sample every ``interval_s`` and at once on the kernel's memory events (:mod:`bladed.residency.watch`:
        usage thresholds of the limited cgroups, reclaim and PSI events).

        ``on_change`` runs (in the thread) when ``B_pc`` moved by at least
        ``hysteresis_bytes`` since the last reported value, or fell below
        ``held_bytes()`` (what the live sessions hold: a shrink smaller than the
        hysteresis that leaves them over the budget is acted on too, or KV in
        memory files, which the kernel cannot reclaim, would meet the OOM killer
        first); ``on_sample`` after every sample.  The watch's thresholds sit
        where ``B_pc`` would fall below ``held_bytes()``, re-armed after each sample.
        """
        if self._thread is not None:
            raise RuntimeError("budgeter already started")
        if interval_s <= 0:
            raise ValueError(f"interval must be positive, got {interval_s}")
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        info = self.locate()
        watch = MemoryWatch(info.version, self.pressure_level, os.path.join(self.proc_root, "pressure", "memory"))
        first = self.sample("start")
        self._arm(watch, first, held_bytes)
        self._watch = watch
        self._thread = threading.Thread(target=self._run,
                                        args=(interval_s, on_change, on_sample, watch, first, held_bytes),
                                        name="bladed-budget", daemon=True)
        self._thread.start()

    @property
    def sources(self) -> list[str]:
        """The armed event sources (``psi:PATH``, ``v1-threshold:PATH``, ``poll:PATH``, ...)."""
        w = self._watch
        return w.names() if w is not None else []

    @property
    def watch_stats(self) -> dict[str, int]:
        """Events seen by kind (threshold, reclaim, psi, poll)."""
        w = self._watch
        return dict(w.stats) if w is not None else {}

    def stop(self) -> None:
        """Stop the thread (idempotent)."""
        t = self._thread
        if t is None:
            return
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        t.join()
        with self._armed_cond:
            self._thread = None
            self._armed_cond.notify_all()
        for fd in (self._stop_r, self._stop_w, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._stop_r = self._stop_w = self._wake_r = self._wake_w = -1

    def __enter__(self) -> Budgeter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _arm(self, watch: MemoryWatch, b: BudgetBreakdown, held_bytes: Callable[[], int] | None) -> None:
        held = held_bytes() if held_bytes is not None else 0
        try:
            watch.arm(thresholds(b.limits, held, b.pinned_uncharged_bytes, b.kernel_overhead, b.host_available_bytes,
                                 b.override_bytes is not None),
                      {str(d["path"]): int(d["usage_bytes"]) for d in b.limits})
        except OSError as e:
            log.warning("budget: cannot arm the memory watch: %s", e)
        with self._armed_cond:
            self._armed += 1
            self._armed_cond.notify_all()

    def _run(self, interval_s: float, on_change: SampleCallback | None, on_sample: SampleCallback | None,
             watch: MemoryWatch, first: BudgetBreakdown, held_bytes: Callable[[], int] | None) -> None:
        reported = first.pagecache_budget_bytes
        last_sample = time.monotonic()
        next_due = last_sample + interval_s
        reclaim_pending = False
        poller = select.poll()
        registered: dict[int, int] = {}
        try:
            while True:
                now = time.monotonic()
                timeout = next_due - now
                poll_in = watch.timeout_s(now)
                if poll_in is not None:
                    timeout = min(timeout, poll_in)
                if reclaim_pending:
                    timeout = min(timeout, last_sample + RECLAIM_GAP_S - now)
                by_fd = {armed.fd: armed for armed in watch.sources()}
                wanted = {self._stop_r: select.POLLIN, self._wake_r: select.POLLIN} | \
                    {fd: armed.events for fd, armed in by_fd.items()}
                if wanted != registered:        # the poller is kept while the armed set is (a v2 poll: 5 ms apart)
                    poller = select.poll()
                    for fd, mask in wanted.items():
                        poller.register(fd, mask)
                    registered = wanted
                events = poller.poll(max(0.0, timeout) * 1000)
                if any(fd == self._stop_r for fd, _ in events):
                    return
                if any(fd == self._wake_r for fd, _ in events):
                    with contextlib.suppress(OSError):
                        os.read(self._wake_r, 4096)
                    last = self.last
                    if last is not None:
                        self._arm(watch, last, held_bytes)
                now = time.monotonic()
                reason = ""
                for fd, ev in events:
                    src = by_fd.get(fd)
                    if src is None:
                        continue
                    if ev & (select.POLLERR | select.POLLNVAL | select.POLLHUP) and not ev & src.events:
                        log.info("budget: pressure source %s went away", src.name)
                        watch.drop(src)
                        continue
                    kind = watch.fired(src)
                    reason = "threshold" if kind == "threshold" or reason == "threshold" else "pressure"
                if watch.poll_crossed(now):
                    reason = "threshold"
                if reason == "pressure" or (reclaim_pending and not reason):
                    # reclaim goes on for as long as a cgroup is full of page cache: one sample per gap
                    if now - last_sample < RECLAIM_GAP_S:
                        reclaim_pending = True
                        continue
                    reason = "pressure"
                if not reason:
                    if now < next_due:
                        continue
                    reason = "periodic"
                reclaim_pending = False
                if reason == "threshold":
                    watch.heat(now)      # a usage crossed: a spike may be under way (reclaim alone is routine)
                try:
                    # a periodic sample follows the daemon into another cgroup; an event's is for the one armed
                    b = self.sample(reason, relocate=reason == "periodic", event_at=now)
                except OSError as e:
                    log.warning("budget: sampling failed: %s", e)
                    next_due = time.monotonic() + interval_s
                    continue
                self.stats[reason] += 1
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("budget sample (%s)", reason, extra=fields(
                        pagecache_budget_bytes=b.pagecache_budget_bytes,
                        held_bytes=held_bytes() if held_bytes is not None else 0,
                        usage_bytes=",".join(str(d["usage_bytes"]) for d in b.limits) or "-",
                        armed=",".join(str(v) for v in watch.armed.values()) or "-"))
                last_sample = time.monotonic()
                next_due = last_sample + interval_s
                if on_sample is not None:
                    on_sample(b)
                over = held_bytes is not None and b.pagecache_budget_bytes < held_bytes()
                moved = abs(b.pagecache_budget_bytes - reported) >= self.hysteresis_bytes
                if on_change is not None and (over or moved):
                    previous, reported = reported, b.pagecache_budget_bytes
                    self.stats["changes"] += 1
                    # routine drift of MemAvailable is a DEBUG line; a move on memory pressure is news
                    log.log(logging.DEBUG if reason == "periodic" else logging.INFO, "budget changed (%s)", reason,
                            extra=fields(pagecache_budget_bytes=b.pagecache_budget_bytes,
                                         previous_pagecache_budget_bytes=previous, usable_bytes=b.usable_bytes,
                                         host_available_bytes=b.host_available_bytes,
                                         memory_limit_bytes=b.memory_limit_bytes,
                                         anon_shmem_bytes=b.anon_shmem_bytes, pinned_bytes=b.pinned_bytes,
                                         binding=b.binding, binding_cgroup=b.binding_cgroup or "host",
                                         cgroup=f"{b.cgroup_version}:{b.cgroup or 'host'}"))
                    on_change(b)
                self._arm(watch, b, held_bytes)
        except Exception:
            log.exception("budget thread failed")
        finally:
            self._watch = None
            watch.close()


