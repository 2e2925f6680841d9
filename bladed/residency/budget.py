"""The page-cache budget of paper Eq. 1-2, from cgroup and host memory.

    M*   = min(M_avail, M_max - M_anon+shmem)                       (Eq. 1)
    B_pc = max(0, M* - N_threads * M_pin)                             (Eq. 2)

* The cgroup is the one charged for the page-cache pages: the memory cgroup
  of the process that touches them (the daemon; on v2, the nearest ancestor
  with the memory controller when its own cgroup has none).  cgroup v1, v2 and hybrid
  hosts are handled: on a hybrid host ``/proc/<pid>/cgroup`` has both a
  ``N:memory:/path`` line (the v1 memory controller, which is what charges)
  and a ``0::/path`` line; the v1 line wins whenever it exists.
* ``M_max`` is the smallest limit on the path from the cgroup up to the root
  of its hierarchy: v2 ``memory.max`` and ``memory.high``; v1
  ``hierarchical_memory_limit`` and every ancestor's ``memory.limit_in_bytes``.
  No limit means the host's MemTotal.
* ``M_anon+shmem`` comes from the cgroup's ``memory.stat``: v2 ``anon + shmem``
  (``file`` already includes ``shmem``), v1 ``total_rss + total_shmem``
  (``cache`` already includes ``shmem``; ``total_*`` covers descendants, as the
  limit does).  Where the cgroup has no ``memory.stat`` (v2 root, no memory
  controller) the host's ``AnonPages + Shmem`` is used.
* ``M_avail`` is the host's MemAvailable (psutil), which ignores cgroups.

:class:`Budgeter` samples on demand, periodically, and when the kernel
reports memory pressure: a PSI trigger on ``memory.pressure`` (the cgroup's
own on v2, the unified hierarchy's on hybrid hosts, ``/proc/pressure/memory``
otherwise, or where the cgroup's file refuses a trigger, as it does to a
systemd service's user) and, on v1, a ``memory.pressure_level`` eventfd of
the cgroup.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil
from cgroupspy.controllers import MemoryController

from bladed.logfmt import fields

log = logging.getLogger(__name__)

#: v1 reads an unlimited limit as PAGE_COUNTER_MAX pages (9223372036854771712 with 4 KiB pages).
_UNLIMITED = 1 << 62
# 200 ms of stall within any 2 s window.  Without CAP_SYS_RESOURCE the kernel only accepts
# windows that are multiples of 2 s (EINVAL otherwise), so 2 s works for every daemon.
_PSI_TRIGGER = b"some 200000 2000000\x00"
_MIN_GAP_S = 0.2                               # pressure events closer than this share one sample


# -- where the cgroup is ---------------------------------------------------------

@dataclass(frozen=True)
class CgroupInfo:
    """A memory cgroup as bladed sees it."""

    version: str                 # "v1", "v2" or "none" (no memory controller)
    path: str                    # its directory ("" for "none")
    root: str                    # the directory of its hierarchy's root (ancestors stop here)
    pressure_file: str | None    # a PSI ``memory.pressure`` file for triggers, if any

    def ancestors(self) -> list[str]:
        """The cgroup's directory and every parent up to and including the hierarchy root."""
        if not self.path:
            return []
        out = [self.path]
        p = self.path
        root = os.path.normpath(self.root)
        while os.path.normpath(p) != root:
            parent = os.path.dirname(p.rstrip("/"))
            if parent == p or not parent.startswith(root):
                break
            p = parent
            out.append(p)
        return out


@dataclass(frozen=True)
class _Mount:
    root: str
    mountpoint: str
    fstype: str
    superopts: tuple[str, ...]


def _unescape(s: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    if "\\" not in s:
        return s
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 4 <= len(s) and s[i + 1:i + 4].isdigit():
            out.append(chr(int(s[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[_Mount]:
    """The cgroup and cgroup2 mounts of a ``/proc/<pid>/mountinfo`` text."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields = left.split()
        tail = right.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        mounts.append(_Mount(root=_unescape(fields[3]), mountpoint=_unescape(fields[4]), fstype=tail[0],
                             superopts=tuple(tail[2].split(","))))
    return mounts


def parse_proc_cgroup(text: str) -> tuple[str | None, str | None]:
    """``(v1 memory path, v2 path)`` from a ``/proc/<pid>/cgroup`` text (either may be None)."""
    v1 = v2 = None
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hier, ctrls, path = parts
        if "memory" in ctrls.split(","):
            v1 = path
        elif hier == "0" and ctrls == "":
            v2 = path
    return v1, v2


def _join(mount: _Mount, cgpath: str) -> str:
    rel = cgpath
    root = mount.root.rstrip("/")
    if root and root != "/" and (rel == root or rel.startswith(root + "/")):
        rel = rel[len(root):]
    return os.path.normpath(os.path.join(mount.mountpoint, rel.lstrip("/")))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None


def locate_memory_cgroup(pid: int | None = None, proc_root: str = "/proc") -> CgroupInfo:
    """The memory cgroup that charges ``pid``'s page-cache pages (default: this process)."""
    who = "self" if pid is None else str(pid)
    cg_text = _read(os.path.join(proc_root, who, "cgroup"))
    if cg_text is None:
        raise ProcessLookupError(errno.ESRCH, f"no such process: {who}")
    mi_text = _read(os.path.join(proc_root, who, "mountinfo")) or _read(
        os.path.join(proc_root, "self", "mountinfo")) or ""
    v1_path, v2_path = parse_proc_cgroup(cg_text)
    mounts = parse_mountinfo(mi_text)
    v1_mount = next((m for m in mounts if m.fstype == "cgroup" and "memory" in m.superopts), None)
    v2_mount = next((m for m in mounts if m.fstype == "cgroup2"), None)
    v2_dir = _join(v2_mount, v2_path) if (v2_mount is not None and v2_path is not None) else None
    psi = None
    if v2_dir is not None and os.path.exists(os.path.join(v2_dir, "memory.pressure")):
        psi = os.path.join(v2_dir, "memory.pressure")
    elif os.path.exists(os.path.join(proc_root, "pressure", "memory")):
        psi = os.path.join(proc_root, "pressure", "memory")
    if v1_path is not None and v1_mount is not None:
        return CgroupInfo("v1", _join(v1_mount, v1_path), v1_mount.mountpoint, psi)
    if v2_dir is not None and v2_mount is not None:
        # a v2 cgroup whose parent does not enable the memory controller for it is charged to its
        # nearest ancestor that has it (a leaf of a delegated subtree, a unit without MemoryAccounting=)
        top = os.path.normpath(v2_mount.mountpoint)
        d = os.path.normpath(v2_dir)
        while d.startswith(top):
            ctrls = (_read(os.path.join(d, "cgroup.controllers")) or "").split()
            if "memory" in ctrls or os.path.exists(os.path.join(d, "memory.max")):
                return CgroupInfo("v2", d, v2_mount.mountpoint, psi)
            if d == top:
                break
            d = os.path.dirname(d)
    return CgroupInfo("none", "", "", psi)


def cgroup_from_path(path: str, proc_root: str = "/proc") -> CgroupInfo:
    """A :class:`CgroupInfo` for a cgroup directory given by the operator (or a test)."""
    path = os.path.normpath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(errno.ENOENT, "no such cgroup directory", path)
    if os.path.exists(os.path.join(path, "memory.limit_in_bytes")):
        version = "v1"
    elif os.path.exists(os.path.join(path, "memory.max")) or os.path.exists(os.path.join(path, "memory.stat")):
        version = "v2"
    else:
        raise ValueError(f"{path} is not a memory cgroup (no memory.limit_in_bytes, memory.max or memory.stat)")
    root = path
    while True:
        parent = os.path.dirname(root)
        if parent == root or not os.path.exists(os.path.join(parent, "cgroup.procs")):
            break
        root = parent
    psi = os.path.join(path, "memory.pressure") if version == "v2" else None
    if psi is None or not os.path.exists(psi):
        host = os.path.join(proc_root, "pressure", "memory")
        psi = host if os.path.exists(host) else None
    return CgroupInfo(version, path, root, psi)


# -- reading the numbers -----------------------------------------------------------

def _parse_stat(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            with contextlib.suppress(ValueError):
                out[parts[0]] = int(parts[1])
    return out


def _parse_limit(text: str | None) -> int | None:
    """A v2 ``memory.max``/``memory.high`` value: bytes, or None for ``max``/absent."""
    if text is None:
        return None
    v = text.strip()
    if v in ("", "max"):
        return None
    n = int(v)
    return None if n >= _UNLIMITED else n


class _Node:
    """The one attribute cgroupspy's controllers need of a tree node."""

    def __init__(self, path: str) -> None:
        self.full_path = os.fsencode(path)


@dataclass(frozen=True)
class MemoryReading:
    """Raw figures of one cgroup, as read from the kernel's files."""

    limit: int | None            # smallest limit over the ancestors, None if none
    limit_source: str            # the file that set it
    anon: int
    shmem: int
    file: int                    # page cache, shmem excluded
    kernel: int | None           # kernel memory charged to the cgroup, where reported


def read_v1(info: CgroupInfo) -> MemoryReading:
    """v1 figures through cgroupspy's memory controller."""
    ctl = MemoryController(_Node(info.path))
    stat: dict[str, int] = ctl.stat
    limit: int | None = None
    source = ""
    hier = stat.get("hierarchical_memory_limit")
    if hier is not None and hier < _UNLIMITED:
        limit, source = hier, os.path.join(info.path, "memory.stat:hierarchical_memory_limit")
    for d in info.ancestors():
        try:
            v = MemoryController(_Node(d)).limit_in_bytes
        except OSError:
            continue
        if v is not None and 0 <= v < _UNLIMITED and (limit is None or v < limit):
            limit, source = v, os.path.join(d, "memory.limit_in_bytes")
    kernel = None
    kmem = _read(os.path.join(info.path, "memory.kmem.usage_in_bytes"))
    if kmem is not None:
        with contextlib.suppress(ValueError):
            kernel = int(kmem)
    anon = stat.get("total_rss", stat.get("rss", 0))
    shmem = stat.get("total_shmem", stat.get("shmem", 0))
    cache = stat.get("total_cache", stat.get("cache", 0))
    return MemoryReading(limit=limit, limit_source=source, anon=anon, shmem=shmem,
                         file=max(0, cache - shmem), kernel=kernel)


def read_v2(info: CgroupInfo) -> MemoryReading | None:
    """v2 figures, read directly; None where the cgroup has no ``memory.stat`` (the root)."""
    limit: int | None = None
    source = ""
    for d in info.ancestors():
        for name in ("memory.max", "memory.high"):
            v = _parse_limit(_read(os.path.join(d, name)))
            if v is not None and (limit is None or v < limit):
                limit, source = v, os.path.join(d, name)
    text = _read(os.path.join(info.path, "memory.stat"))
    if text is None:
        return None
    stat = _parse_stat(text)
    shmem = stat.get("shmem", 0)
    return MemoryReading(limit=limit, limit_source=source, anon=stat.get("anon", 0), shmem=shmem,
                         file=max(0, stat.get("file", 0) - shmem), kernel=stat.get("kernel"))


def read_host(proc_root: str = "/proc") -> MemoryReading:
    """Host-wide figures (for hosts without a memory cgroup)."""
    info = {}
    for line in (_read(os.path.join(proc_root, "meminfo")) or "").splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            info[key] = int(parts[0]) * 1024
    shmem = info.get("Shmem", 0)
    return MemoryReading(limit=None, limit_source="", anon=info.get("AnonPages", 0), shmem=shmem,
                         file=max(0, info.get("Cached", 0) - shmem), kernel=None)


# -- the breakdown -------------------------------------------------------------------

@dataclass(frozen=True)
class BudgetBreakdown:
    """Every term of Eq. 1-2 for one sample, plus what decided them."""

    m_avail: int                 # host MemAvailable
    m_max: int                   # cgroup limit (min over ancestors), or host MemTotal if unlimited
    m_anon_shmem: int            # anon + shmem charged to the cgroup
    m_star: int                  # Eq. 1
    n_threads: int
    m_pin: int
    b_pc: int                    # Eq. 2, after the operator's override / cap
    cgroup: str                  # cgroup directory ("" if none)
    cgroup_version: str          # "v1" | "v2" | "none"
    override_bytes: int | None
    cap_bytes: int | None
    sampled_at: float            # time.time()
    b_pc_computed: int = 0       # Eq. 2 before override / cap
    m_anon: int = 0
    m_shmem: int = 0
    m_file: int = 0              # page cache now charged (shmem excluded): what B_pc is compared with
    m_kernel: int | None = None  # kernel memory charged (not part of Eq. 1; for diagnosis)
    mem_total: int = 0
    limited: bool = False        # True if a cgroup limit (not MemTotal) gave M_max
    m_max_source: str = ""
    binding: str = ""            # "m_avail" or "cgroup": which side of the min() of Eq. 1 won
    reason: str = "manual"       # what triggered the sample: manual | periodic | pressure

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One line for logs and ``bladectl``."""
        mib = 1 << 20
        extra = ""
        if self.override_bytes is not None:
            extra = f" (override {self.override_bytes / mib:.0f} MiB)"
        elif self.cap_bytes is not None and self.b_pc < self.b_pc_computed:
            extra = f" (capped at {self.cap_bytes / mib:.0f} MiB)"
        return (f"B_pc={self.b_pc / mib:.0f} MiB{extra} = max(0, M*={self.m_star / mib:.0f} - "
                f"{self.n_threads}x{self.m_pin / mib:.0f}) ; M* = min(M_avail={self.m_avail / mib:.0f}, "
                f"M_max={self.m_max / mib:.0f} - M_anon+shmem={self.m_anon_shmem / mib:.0f}) MiB "
                f"[{self.cgroup_version} {self.cgroup or 'host'}]")


SampleCallback = Callable[[BudgetBreakdown], object]


@dataclass
class _Source:
    name: str
    fd: int
    events: int
    close_fds: list[int] = field(default_factory=list)


class Budgeter:
    """Computes ``B_pc`` for a memory cgroup and keeps it fresh.

    ``cgroup_path`` fixes the cgroup directory; otherwise the memory cgroup of
    ``pid`` (default: this process) is located at every sample, so a process
    moved between cgroups is followed.  ``override_bytes`` replaces the computed
    budget; ``cap_bytes`` bounds it.  Both leave the other terms reported.
    """

    def __init__(self, n_threads: int, m_pin: int, override_bytes: int | None = None,
                 cap_bytes: int | None = None, cgroup_path: str | None = None, pid: int | None = None, *,
                 proc_root: str = "/proc", mem_available: Callable[[], int] | None = None,
                 mem_total: Callable[[], int] | None = None, hysteresis_bytes: int = 32 << 20,
                 pressure_level: str = "medium") -> None:
        if n_threads < 0 or m_pin < 0:
            raise ValueError(f"n_threads and m_pin must be >= 0, got {n_threads} and {m_pin}")
        for name, v in (("override_bytes", override_bytes), ("cap_bytes", cap_bytes)):
            if v is not None and v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        if pressure_level not in ("low", "medium", "critical"):
            raise ValueError(f"pressure_level must be low, medium or critical, got {pressure_level!r}")
        self.n_threads = n_threads
        self.m_pin = m_pin
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
        self.sources: list[str] = []
        self.stats = {"samples": 0, "periodic": 0, "pressure": 0, "changes": 0}
        self.locate()      # fail early on a bad path or pid

    # -- sampling --------------------------------------------------------------
    def locate(self) -> CgroupInfo:
        if self.cgroup_path is not None:
            return cgroup_from_path(self.cgroup_path, self.proc_root)
        return locate_memory_cgroup(self.pid, self.proc_root)

    def sample(self, reason: str = "manual") -> BudgetBreakdown:
        """Read the kernel's figures now and compute Eq. 1-2."""
        info = self.locate()
        reading: MemoryReading | None
        if info.version == "v1":
            reading = read_v1(info)
        elif info.version == "v2":
            reading = read_v2(info)
        else:
            reading = None
        if reading is None:
            reading = read_host(self.proc_root)
        m_avail = self._mem_available()
        mem_total = self._mem_total()
        limited = reading.limit is not None and reading.limit < mem_total
        m_max = reading.limit if (reading.limit is not None and limited) else mem_total
        m_anon_shmem = reading.anon + reading.shmem
        cg_side = m_max - m_anon_shmem
        m_star = min(m_avail, cg_side)                                     # Eq. 1
        computed = max(0, m_star - self.n_threads * self.m_pin)            # Eq. 2
        b_pc = computed
        if self.override_bytes is not None:
            b_pc = self.override_bytes
        elif self.cap_bytes is not None:
            b_pc = min(b_pc, self.cap_bytes)
        b = BudgetBreakdown(
            m_avail=m_avail, m_max=m_max, m_anon_shmem=m_anon_shmem, m_star=m_star,
            n_threads=self.n_threads, m_pin=self.m_pin, b_pc=b_pc, cgroup=info.path,
            cgroup_version=info.version, override_bytes=self.override_bytes, cap_bytes=self.cap_bytes,
            sampled_at=time.time(), b_pc_computed=computed, m_anon=reading.anon, m_shmem=reading.shmem,
            m_file=reading.file, m_kernel=reading.kernel, mem_total=mem_total, limited=limited,
            m_max_source=reading.limit_source if limited else "host MemTotal",
            binding="m_avail" if m_avail <= cg_side else "cgroup", reason=reason,
        )
        with self._lock:
            self._last = b
            self.stats["samples"] += 1
        return b

    @property
    def last(self) -> BudgetBreakdown | None:
        with self._lock:
            return self._last

    @property
    def b_pc(self) -> int:
        """The current budget (samples once if never sampled)."""
        last = self.last
        return (last if last is not None else self.sample()).b_pc

    # -- the re-sampling thread ------------------------------------------------------
    def start(self, interval_s: float = 5.0, on_change: SampleCallback | None = None, *,
              on_sample: SampleCallback | None = None) -> None:
        """Re-sample every ``interval_s`` and at once on memory pressure.

        ``on_change`` runs (in the thread) when ``B_pc`` moved by at least
        ``hysteresis_bytes`` since the last reported value; ``on_sample``
        after every sample.
        """
        if self._thread is not None:
            raise RuntimeError("budgeter already started")
        if interval_s <= 0:
            raise ValueError(f"interval must be positive, got {interval_s}")
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        srcs = self._arm_sources()
        self.sources = [s.name for s in srcs]
        first = self.sample("start")
        self._thread = threading.Thread(target=self._run, args=(interval_s, on_change, on_sample, srcs, first),
                                        name="bladed-budget", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (idempotent)."""
        t = self._thread
        if t is None:
            return
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        t.join()
        self._thread = None
        for fd in (self._stop_r, self._stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._stop_r = self._stop_w = -1

    def __enter__(self) -> Budgeter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _arm_sources(self) -> list[_Source]:
        out: list[_Source] = []
        try:
            info = self.locate()
        except OSError as e:
            log.warning("budget: cannot locate the memory cgroup for pressure events: %s", e)
            return out
        psi_files = [info.pressure_file] if info.pressure_file else []
        host_psi = os.path.join(self.proc_root, "pressure", "memory")
        if psi_files and psi_files[0] != host_psi and os.path.exists(host_psi):
            # a service user cannot write a trigger to its unit's cgroup file (root's, and read-only
            # under ProtectControlGroups=): the host's memory pressure includes the cgroup's
            psi_files.append(host_psi)
        for path in psi_files:
            src = self._arm_psi(path)
            if src is not None:
                out.append(src)
                break
        else:
            if psi_files:
                log.info("budget: no PSI trigger could be armed; periodic sampling only")
        if info.version == "v1":
            efd = pfd = -1
            try:
                efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
                pfd = os.open(os.path.join(info.path, "memory.pressure_level"), os.O_RDONLY | os.O_CLOEXEC)
                with open(os.path.join(info.path, "cgroup.event_control"), "w") as f:
                    f.write(f"{efd} {pfd} {self.pressure_level}")
                out.append(_Source(f"v1-pressure-level:{self.pressure_level}:{info.path}", efd, select.POLLIN,
                                   [efd, pfd]))
            except OSError as e:
                for fd in (efd, pfd):
                    if fd >= 0:
                        os.close(fd)
                log.info("budget: no v1 memory.pressure_level events for %s (%s)", info.path, e)
        return out

    @staticmethod
    def _arm_psi(path: str) -> _Source | None:
        """A PSI trigger on ``path``, or None (logged) where the kernel or the file's mode refuses one."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            log.info("budget: no PSI trigger on %s (%s)", path, e)
            return None
        try:
            os.write(fd, _PSI_TRIGGER)
        except OSError as e:
            os.close(fd)
            log.info("budget: PSI trigger refused by %s (%s)", path, e)
            return None
        return _Source(f"psi:{path}", fd, select.POLLPRI, [fd])

    def _run(self, interval_s: float, on_change: SampleCallback | None, on_sample: SampleCallback | None,
             srcs: list[_Source], first: BudgetBreakdown) -> None:
        poller = select.poll()
        poller.register(self._stop_r, select.POLLIN)
        by_fd = {}
        for s in srcs:
            poller.register(s.fd, s.events)
            by_fd[s.fd] = s
        reported = first.b_pc
        last_sample = time.monotonic()
        next_due = last_sample + interval_s
        try:
            while True:
                timeout = max(0.0, next_due - time.monotonic())
                events = poller.poll(timeout * 1000)
                if any(fd == self._stop_r for fd, _ in events):
                    return
                reason = "periodic"
                for fd, ev in events:
                    src = by_fd.get(fd)
                    if src is None:
                        continue
                    if ev & (select.POLLERR | select.POLLNVAL | select.POLLHUP):
                        log.info("budget: pressure source %s went away", src.name)
                        poller.unregister(fd)
                        continue
                    if src.events == select.POLLIN:
                        with contextlib.suppress(BlockingIOError):
                            os.eventfd_read(fd)
                    reason = "pressure"
                now = time.monotonic()
                if reason == "periodic" and now < next_due:
                    continue
                if reason == "pressure" and now - last_sample < _MIN_GAP_S:
                    continue
                try:
                    b = self.sample(reason)
                except OSError as e:
                    log.warning("budget: sampling failed: %s", e)
                    next_due = time.monotonic() + interval_s
                    continue
                self.stats[reason] += 1
                last_sample = time.monotonic()
                next_due = last_sample + interval_s
                if on_sample is not None:
                    on_sample(b)
                if on_change is not None and abs(b.b_pc - reported) >= self.hysteresis_bytes:
                    previous, reported = reported, b.b_pc
                    self.stats["changes"] += 1
                    # routine drift of MemAvailable is a DEBUG line; a move on memory pressure is news
                    log.log(logging.DEBUG if reason == "periodic" else logging.INFO, "budget changed (%s)", reason,
                            extra=fields(b_pc=b.b_pc, previous_b_pc=previous, m_star=b.m_star, m_avail=b.m_avail,
                                         m_max=b.m_max, m_anon_shmem=b.m_anon_shmem,
                                         pinned=b.n_threads * b.m_pin, binding=b.binding,
                                         cgroup=f"{b.cgroup_version}:{b.cgroup or 'host'}"))
                    on_change(b)
        except Exception:
            log.exception("budget thread failed")
        finally:
            for s in srcs:
                for fd in s.close_fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
