"""Child memory cgroups for the sweep, and dropping the page cache.

A :class:`MemCgroup` is created below the memory cgroup that charges this
process (cgroup v1 on hybrid hosts, else v2), given a hard limit, and removed
afterwards.  A process is placed in it *before* it executes anything (the
launcher writes its own pid to ``cgroup.procs`` and then ``exec``s), so every
page it touches is charged there from the start.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import time
import uuid
from typing import Any

from bladed.residency.cgroups import locate_memory_cgroup
from bladed.spawn import cgroup_launcher

V1_UNLIMITED = 9223372036854771712


def write_file(path: str, value: str) -> None:
    """Write ``value`` to a cgroup (or /proc) file."""
    with open(path, "w") as f:
        f.write(value)


def read_file(path: str) -> str:
    """A cgroup (or /proc) file's text."""
    with open(path) as f:
        return f.read()


def limit_file(path: str, version: str) -> str:
    """The hard-limit file of the memory cgroup at ``path`` (cgroup ``v1`` or ``v2``)."""
    return os.path.join(path, "memory.limit_in_bytes" if version == "v1" else "memory.max")


def set_limit(path: str, version: str, nbytes: int | None) -> None:
    """Set the hard limit of the memory cgroup at ``path``; None lifts it."""
    if nbytes is None:
        write_file(limit_file(path, version), "-1" if version == "v1" else "max")
    else:
        write_file(limit_file(path, version), str(int(nbytes)))


class MemCgroup:
    """A memory cgroup below ours with a hard limit (``None``: unlimited)."""

    def __init__(self, limit_bytes: int | None, *, prefix: str = "bladed-bench") -> None:
        if os.geteuid() != 0:
            raise PermissionError(errno.EPERM, "child memory cgroups need root")
        info = locate_memory_cgroup()
        if info.version == "none":
            raise RuntimeError("this host has no memory cgroup controller")
        self.version = info.version
        self.parent = info.path
        if self.version == "v2":
            with contextlib.suppress(OSError):
                write_file(os.path.join(self.parent, "cgroup.subtree_control"), "+memory")
        self.path = os.path.join(self.parent, f"{prefix}-{uuid.uuid4().hex[:8]}")
        os.mkdir(self.path)
        self.set_limit(limit_bytes)

    @property
    def limit_file(self) -> str:
        return limit_file(self.path, self.version)

    def set_limit(self, nbytes: int | None) -> None:
        set_limit(self.path, self.version, nbytes)

    def limit(self) -> int | None:
        v = read_file(self.limit_file).strip()
        if v == "max" or int(v) >= V1_UNLIMITED:
            return None
        return int(v)

    def stat(self) -> dict[str, int]:
        out: dict[str, int] = {}
        with contextlib.suppress(OSError):
            for line in read_file(os.path.join(self.path, "memory.stat")).splitlines():
                k, _, v = line.partition(" ")
                with contextlib.suppress(ValueError):
                    out[k] = int(v)
        return out

    def usage(self) -> int:
        name = "memory.usage_in_bytes" if self.version == "v1" else "memory.current"
        try:
            return int(read_file(os.path.join(self.path, name)))
        except (OSError, ValueError):
            return 0

    def page_cache_bytes(self) -> int:
        """File-backed pages charged here (v1 ``cache`` less ``shmem``, v2 ``file`` less ``shmem``)."""
        s = self.stat()
        total = s.get("cache", s.get("file", 0))
        return max(0, total - s.get("shmem", 0))

    def peak(self) -> int | None:
        """The most memory charged here since the cgroup was made (v1 ``memory.max_usage_in_bytes``, v2
        ``memory.peak``, kernel 5.19+); None where the kernel does not say."""
        name = "memory.max_usage_in_bytes" if self.version == "v1" else "memory.peak"
        try:
            return int(read_file(os.path.join(self.path, name)))
        except (OSError, ValueError):
            return None

    def failcnt(self) -> int | None:
        if self.version != "v1":
            return None
        try:
            return int(read_file(os.path.join(self.path, "memory.failcnt")))
        except (OSError, ValueError):
            return None

    def events(self) -> dict[str, int]:
        """v2 ``memory.events``; v1: ``oom_kill`` from ``memory.oom_control``."""
        out: dict[str, int] = {}
        name = "memory.oom_control" if self.version == "v1" else "memory.events"
        with contextlib.suppress(OSError):
            for line in read_file(os.path.join(self.path, name)).splitlines():
                k, _, v = line.partition(" ")
                with contextlib.suppress(ValueError):
                    out[k] = int(v)
        return out

    def procs(self) -> list[int]:
        try:
            return [int(x) for x in read_file(os.path.join(self.path, "cgroup.procs")).split()]
        except OSError:
            return []

    def launcher(self, argv: list[str]) -> list[str]:
        """``argv`` wrapped so the process joins this cgroup before it ``exec``s."""
        return cgroup_launcher(self.path)(argv)

    def remove(self, timeout: float = 30.0) -> None:
        """Move leftover processes to the parent and remove the cgroup."""
        if not os.path.isdir(self.path):
            return
        for pid in self.procs():
            with contextlib.suppress(OSError):
                write_file(os.path.join(self.parent, "cgroup.procs"), str(pid))
        if self.version == "v1":
            # hand the charged page cache back to the parent before the directory goes
            with contextlib.suppress(OSError):
                write_file(os.path.join(self.path, "memory.force_empty"), "0")
        deadline = time.monotonic() + timeout
        while True:
            try:
                os.rmdir(self.path)
                return
            except OSError as e:
                # EBUSY while an exiting task is still listed: the kernel finishes this on its own
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def describe(self) -> dict[str, Any]:
        return {"version": self.version, "path": self.path, "limit_bytes": self.limit()}

    def __enter__(self) -> MemCgroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def drop_caches() -> float:
    """``sync`` then ``echo 3 > /proc/sys/vm/drop_caches``; returns the seconds it took."""
    t0 = time.perf_counter()
    os.sync()
    write_file("/proc/sys/vm/drop_caches", "3")
    return time.perf_counter() - t0


def can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def run_quiet(argv: list[str]) -> str | None:
    try:
        return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
