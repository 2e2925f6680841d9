"""Test helpers: child memory cgroups with real limits, and a worker process to put in them.

A :class:`ChildCgroup` is created under this process's own memory cgroup
(cgroup v1 or v2, whichever charges us), given a limit, and removed
afterwards (its processes are moved back to the parent first).  A
:class:`Worker` is a Python subprocess that obeys one JSON command per line on
stdin and answers one JSON line on stdout: synchronisation is by that
request/response, never by sleeping.

Run as ``python cgroup_util.py --worker`` (what :class:`Worker` does).
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import json
import mmap
import os
import pathlib
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
TESTS = pathlib.Path(__file__).resolve().parent


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def read_stat(path: str) -> dict[str, int]:
    """A cgroup's ``memory.stat`` as the kernel prints it."""
    out = {}
    with open(os.path.join(path, "memory.stat")) as f:
        for line in f:
            k, v = line.split()
            out[k] = int(v)
    return out


class ChildCgroup:
    """A memory cgroup below ours (or below ``parent``), removed on :meth:`remove`."""

    def __init__(self, limit_bytes: int | None = None, *, parent: ChildCgroup | None = None,
                 name: str | None = None, base: str | None = None) -> None:
        """``base``: a v2 cgroup directory with no process of its own (a delegated subtree) to create it in."""
        if os.geteuid() != 0:
            raise PermissionError(errno.EPERM, "child memory cgroups need root (run the suite as root, as CI does)")
        from bladed.residency.cgroups import locate_memory_cgroup

        self.version: str
        self.path: str
        if parent is not None:
            self.version, base = parent.version, parent.path
        elif base is not None:
            self.version = "v2"
        else:
            info = locate_memory_cgroup()
            if info.version == "none":
                raise RuntimeError("this host has no memory cgroup controller")
            self.version, base = info.version, info.path
        if self.version == "v2":
            # let the child have the memory controller (fails if our cgroup holds processes and is not the root)
            try:
                _write(os.path.join(base, "cgroup.subtree_control"), "+memory")
            except OSError as e:
                raise RuntimeError(f"cannot enable the memory controller below {base}: {e}") from e
        self.parent_path = base
        self.path = os.path.join(base, name or f"bladed-test-{uuid.uuid4().hex[:10]}")
        os.mkdir(self.path)
        self.children: list[ChildCgroup] = []
        if parent is not None:
            parent.children.append(self)
        if limit_bytes is not None:
            self.set_limit(limit_bytes)

    @property
    def limit_file(self) -> str:
        from bladed_bench.cgroup import limit_file

        return limit_file(self.path, self.version)

    def set_limit(self, nbytes: int | None) -> None:
        """Set (or, with None, lift) the hard limit."""
        from bladed_bench.cgroup import set_limit

        set_limit(self.path, self.version, nbytes)

    def limit(self) -> int:
        with open(self.limit_file) as f:
            v = f.read().strip()
        return -1 if v == "max" else int(v)

    def stat(self) -> dict[str, int]:
        return read_stat(self.path)

    def add(self, pid: int) -> None:
        _write(os.path.join(self.path, "cgroup.procs"), str(pid))

    def release(self, pid: int) -> None:
        """Move ``pid`` back to the parent cgroup."""
        _write(os.path.join(self.parent_path, "cgroup.procs"), str(pid))

    def procs(self) -> list[int]:
        with open(os.path.join(self.path, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]

    def remove(self) -> None:
        """Move any process back to the parent and remove the cgroup (children first)."""
        for c in list(self.children):
            c.remove()
        if not os.path.isdir(self.path):
            return
        for pid in self.procs():
            with contextlib.suppress(ProcessLookupError, OSError):
                self.release(pid)
        # a v1 cgroup may still hold page-cache charges; rmdir reparents them
        os.rmdir(self.path)

    def __enter__(self) -> ChildCgroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class WorkerError(RuntimeError):
    pass


class Worker:
    """A subprocess running :func:`_serve`: ``call(cmd, **args)`` returns its JSON answer, within a deadline."""

    def __init__(self, cgroup: ChildCgroup | None = None, timeout: float = 120.0) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), env.get("PYTHONPATH", "")])
        self.timeout = timeout
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=str(REPO), env=env)
        self.pid = self.proc.pid
        self._replies: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            self.call("ping")           # the interpreter is up and idle
            if cgroup is not None:
                cgroup.add(self.pid)
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._replies.put(line)
        self._replies.put("")           # EOF: the worker is gone

    def call(self, cmd: str, timeout: float | None = None, **args: Any) -> Any:
        """The worker's answer to one command (it answers in order); ``timeout``: the instance's by default."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, "args": args}) + "\n")
        self.proc.stdin.flush()
        limit = self.timeout if timeout is None else timeout
        try:
            line = self._replies.get(timeout=limit)
        except queue.Empty:
            raise WorkerError(f"worker {self.pid} did not answer {cmd!r} within {limit:g} s") from None
        if not line:
            raise WorkerError(f"worker {self.pid} died (exit status {self.proc.wait()}) during {cmd!r}")
        reply = json.loads(line)
        if "error" in reply:
            raise WorkerError(f"worker {cmd!r} failed: {reply['error']}")
        return reply["result"]

    def close(self) -> None:
        """Close its stdin (it exits); SIGKILL if it has not within 30 s."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(30)           # at EOF once the worker is gone
        if self.proc.stdout is not None and not self._reader.is_alive():
            self.proc.stdout.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the worker side -------------------------------------------------------------------

_held: list[Any] = []


def _touch(buf: Any, n: int) -> None:
    mv = memoryview(buf)
    page = mmap.PAGESIZE
    ones = b"\x01" * page
    for off in range(0, n - n % page, page):
        mv[off:off + page] = ones
    mv.release()


def _cmd_ping() -> int:
    return os.getpid()


def _cmd_anon(nbytes: int, rate: float = 0.0) -> int:
    """Allocate and touch ``nbytes`` of anonymous memory, kept until exit; with ``rate`` (bytes/s), 1 MiB at a time
    at that pace (a neighbour growing steadily, not a synchronisation)."""
    m = mmap.mmap(-1, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if rate <= 0:
        _touch(m, nbytes)
    else:
        step, t0, mv = 1 << 20, time.perf_counter(), memoryview(m)
        for off in range(0, nbytes, step):
            n = min(step, nbytes - off)
            _touch(mv[off:off + n], n)
            ahead = t0 + (off + n) / rate - time.perf_counter()
            if ahead > 0:
                time.sleep(ahead)
        mv.release()
    _held.append(m)
    return nbytes


def _cmd_shmem(nbytes: int) -> int:
    """Fill ``nbytes`` of a memfd (shmem), kept until exit."""
    fd = os.memfd_create("bladed-test-shmem")
    os.ftruncate(fd, nbytes)
    m = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
    _touch(m, nbytes)
    _held.append((fd, m))
    return nbytes


def _cmd_write_file(path: str, nbytes: int) -> int:
    """Write ``nbytes`` through the page cache (buffered)."""
    chunk = b"\x5a" * (1 << 20)
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(chunk[:min(left, len(chunk))])
    return nbytes


def _cmd_map_file(path: str, nbytes: int) -> int:
    """Write ``nbytes`` through the page cache, map them and read every page (kept mapped until exit)."""
    _cmd_write_file(path, nbytes)
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
    total = sum(m[off] for off in range(0, nbytes, mmap.PAGESIZE))
    _held.append((fd, m))
    return total


def _cmd_call(target: str, kwargs: dict[str, Any]) -> Any:
    """Run ``module:function(**kwargs)`` (modules from tests/ or the repository)."""
    mod, _, fn = target.partition(":")
    return getattr(importlib.import_module(mod), fn)(**kwargs)


_COMMANDS: dict[str, Callable[..., Any]] = {
    "ping": _cmd_ping, "anon": _cmd_anon, "shmem": _cmd_shmem, "write_file": _cmd_write_file,
    "map_file": _cmd_map_file, "call": _cmd_call,
}


def _serve() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        try:
            result = _COMMANDS[req["cmd"]](**req["args"])
            reply = {"result": result}
        except Exception as e:  # reported to the test, which raises
            reply = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _serve()
