"""The memory cgroup that charges bladed's page cache, and the kernel's figures for it: the
inputs of the page-cache budget (:mod:`bladed.residency.budget`, paper Eq. 1-2).

* The cgroup is the one charged for the page-cache pages: the memory cgroup
  of the process that touches them (the daemon; on v2, the nearest ancestor
  with the memory controller when its own cgroup has none).  cgroup v1, v2 and hybrid
  hosts are handled: on a hybrid host ``/proc/<pid>/cgroup`` has both a
  ``N:memory:/path`` line (the v1 memory controller, which is what charges)
  and a ``0::/path`` line; the v1 line wins whenever it exists.
* Every *limited* cgroup on the path from the cgroup up to the root of its
  hierarchy binds (:class:`LimitedCgroup`): its limit (v2 the lower of
  ``memory.max`` and ``memory.high``; v1 ``memory.limit_in_bytes``) against its
  own usage, which counts every descendant's (the daemon's siblings too: a
  Kubernetes pod's other containers, a systemd slice's other units).  Eq. 1 is
  applied to each (:mod:`bladed.residency.budget`).  A v1
  ``hierarchical_memory_limit`` below every visible limit is an ancestor the
  cgroup namespace hides; the topmost visible cgroup stands in for its usage.
  No limit means the host's MemTotal.
* ``M_anon+shmem`` comes from a cgroup's ``memory.stat``: v2 ``anon + shmem``
  (``file`` already includes ``shmem``), v1 ``total_rss + total_shmem``
  (``cache`` already includes ``shmem``; ``total_*`` covers descendants, as the
  limit does).  Where the cgroup has no ``memory.stat`` (v2 root, no memory
  controller) the host's ``AnonPages + Shmem`` is used.
"""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass

from cgroupspy.controllers import MemoryController

#: v1 reads an unlimited limit as PAGE_COUNTER_MAX pages (9223372036854771712 with 4 KiB pages).
_UNLIMITED = 1 << 62


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
class LimitedCgroup:
    """One cgroup with a memory limit on the path up from the charged cgroup: its limit and what is charged to
    it, descendants included (the figures Eq. 1 needs for it)."""

    path: str
    limit: int
    limit_source: str            # the file that set the limit
    usage: int                   # everything charged (v1 memory.usage_in_bytes, v2 memory.current)
    anon: int
    shmem: int
    mapped: int                  # page cache mapped into processes, shmem included
    file: int                    # page cache, shmem excluded
    usage_file: str              # the file ``usage`` comes from (the watch's thresholds and polls)


@dataclass(frozen=True)
class MemoryReading:
    """Raw figures of one cgroup, as read from the kernel's files."""

    limit: int | None            # smallest limit over the ancestors, None if none
    limit_source: str            # the file that set it
    anon: int
    shmem: int
    file: int                    # page cache, shmem excluded
    kernel: int | None           # kernel memory charged to the cgroup, where reported
    mapped: int = 0              # page cache mapped into processes, shmem included (as the kernel counts it)
    #: every limited cgroup from the charged one up (the charged one first where it has a limit of its own)
    limits: tuple[LimitedCgroup, ...] = ()


def _int_file(path: str) -> int | None:
    text = _read(path)
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None


def _v1_figures(stat: dict[str, int]) -> tuple[int, int, int, int]:
    """(anon, shmem, mapped, file) of a v1 ``memory.stat`` (hierarchical totals where present)."""
    shmem = stat.get("total_shmem", stat.get("shmem", 0))
    return (stat.get("total_rss", stat.get("rss", 0)), shmem,
            stat.get("total_mapped_file", stat.get("mapped_file", 0)),
            max(0, stat.get("total_cache", stat.get("cache", 0)) - shmem))


def _limited(d: str, limit: int, source: str, usage_name: str, own: tuple[int, int, int, int],
             figures: tuple[int, int, int, int] | None) -> LimitedCgroup:
    """A limited cgroup's figures; where its files cannot be read (a mount that hides them), the charged
    cgroup's stand in, so its limit still binds."""
    anon, shmem, mapped, file = figures if figures is not None else own
    usage_file = os.path.join(d, usage_name)
    usage = _int_file(usage_file)
    return LimitedCgroup(path=d, limit=limit, limit_source=source,
                         usage=usage if usage is not None else anon + shmem + file,
                         anon=anon, shmem=shmem, mapped=mapped, file=file, usage_file=usage_file)


def _v1_stat_of(d: str) -> tuple[int, int, int, int] | None:
    text = _read(os.path.join(d, "memory.stat"))
    return _v1_figures(_parse_stat(text)) if text is not None else None


def _v2_figures(stat: dict[str, int]) -> tuple[int, int, int, int]:
    """(anon, shmem, mapped, file) of a v2 ``memory.stat`` (``file`` there includes shmem)."""
    shmem = stat.get("shmem", 0)
    return stat.get("anon", 0), shmem, stat.get("file_mapped", 0), max(0, stat.get("file", 0) - shmem)


def read_v1(info: CgroupInfo) -> MemoryReading:
    """v1 figures through cgroupspy's memory controller, and every limited ancestor's."""
    ctl = MemoryController(_Node(info.path))
    stat: dict[str, int] = ctl.stat
    limit: int | None = None
    source = ""
    limits: list[LimitedCgroup] = []
    own = _v1_figures(stat)
    ancestors = info.ancestors()
    for d in ancestors:
        try:
            v = MemoryController(_Node(d)).limit_in_bytes
        except OSError:
            continue
        if v is None or not 0 <= v < _UNLIMITED:
            continue
        limits.append(_limited(d, v, os.path.join(d, "memory.limit_in_bytes"), "memory.usage_in_bytes", own,
                               own if d == info.path else _v1_stat_of(d)))
        if limit is None or v < limit:
            limit, source = v, os.path.join(d, "memory.limit_in_bytes")
    hier = stat.get("hierarchical_memory_limit")
    if hier is not None and hier < _UNLIMITED and (limit is None or hier < limit):
        # a limit above what this mount shows (a container's cgroup namespace): its usage is at least the topmost
        # visible cgroup's, which stands in for it
        limit, source = hier, os.path.join(info.path, "memory.stat:hierarchical_memory_limit")
        top = ancestors[-1] if ancestors else info.path
        limits.append(_limited(top, hier, source, "memory.usage_in_bytes", own,
                               own if top == info.path else _v1_stat_of(top)))
    kernel = None
    kmem = _read(os.path.join(info.path, "memory.kmem.usage_in_bytes"))
    if kmem is not None:
        with contextlib.suppress(ValueError):
            kernel = int(kmem)
    anon = stat.get("total_rss", stat.get("rss", 0))
    shmem = stat.get("total_shmem", stat.get("shmem", 0))
    cache = stat.get("total_cache", stat.get("cache", 0))
    return MemoryReading(limit=limit, limit_source=source, anon=anon, shmem=shmem,
                         file=max(0, cache - shmem), kernel=kernel,
                         mapped=stat.get("total_mapped_file", stat.get("mapped_file", 0)), limits=tuple(limits))


def read_v2(info: CgroupInfo) -> MemoryReading | None:
    """v2 figures, read directly, and every limited ancestor's; None where the cgroup has no ``memory.stat``
    (the root)."""
    text = _read(os.path.join(info.path, "memory.stat"))
    if text is None:
        return None
    stat = _parse_stat(text)
    mine = _v2_figures(stat)
    limit: int | None = None
    source = ""
    limits: list[LimitedCgroup] = []
    for d in info.ancestors():
        own: int | None = None
        own_source = ""
        for name in ("memory.max", "memory.high"):
            v = _parse_limit(_read(os.path.join(d, name)))
            if v is not None and (own is None or v < own):
                own, own_source = v, os.path.join(d, name)
        if own is None:
            continue
        if limit is None or own < limit:
            limit, source = own, own_source
        text = None if d == info.path else _read(os.path.join(d, "memory.stat"))
        limits.append(_limited(d, own, own_source, "memory.current", mine,
                               mine if d == info.path else (_v2_figures(_parse_stat(text)) if text else None)))
    shmem = stat.get("shmem", 0)
    return MemoryReading(limit=limit, limit_source=source, anon=stat.get("anon", 0), shmem=shmem,
                         file=max(0, stat.get("file", 0) - shmem), kernel=stat.get("kernel"),
                         mapped=stat.get("file_mapped", 0), limits=tuple(limits))


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
                         file=max(0, info.get("Cached", 0) - shmem), kernel=None, mapped=info.get("Mapped", 0))



def read_memory(info: CgroupInfo, proc_root: str = "/proc") -> MemoryReading:
    """The figures of ``info``: its own where it has them, else the host's."""
    reading: MemoryReading | None
    if info.version == "v1":
        reading = read_v1(info)
    elif info.version == "v2":
        reading = read_v2(info)
    else:
        reading = None
    return reading if reading is not None else read_host(proc_root)
