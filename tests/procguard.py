"""No process the suite starts outlives it: a pytest plugin (tests/conftest.py loads it; ``-p procguard`` elsewhere).

Every process the suite starts carries two environment variables: ``BLADED_TEST_SESSION``, a token of this
pytest session (after the tokens of any pytest run this one runs inside), and ``BLADED_TEST_NODEID``, the
test that was running when it started (absent for what a module- or session-scoped fixture starts). They
are set in this process's environment, which children inherit, and added to the ``env`` a test hands to
``subprocess.Popen``. A daemon keeps them through a double fork, a new session or a new process group, and
they cannot mark an unrelated process: the token is new each session.

* After each test (after its function-scoped fixtures are torn down): a process of this session started
  during the test and still running is ended (SIGTERM, SIGKILL after :data:`GRACE_S`) and the test errors,
  naming each one.
* At the end of the session (after every fixture): a process of this session still running, or a live
  descendant of this pytest process, is ended the same way and the session fails, one line per process.

Processes are found by reading ``/proc`` (environment, parent, state); a pidfd taken before any signal
makes sure a recycled pid is never signalled.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

SESSION_VAR = "BLADED_TEST_SESSION"
TEST_VAR = "BLADED_TEST_NODEID"
#: how long a leftover process has between SIGTERM and SIGKILL
GRACE_S = 10.0
#: how long a SIGKILLed process has to be gone before it is reported as unkillable
KILL_WAIT_S = 10.0

_token = ""
_leftovers: list[str] = []


@dataclass(frozen=True)
class Proc:
    """One process as /proc shows it."""

    pid: int
    ppid: int
    state: str
    start: int                 # start time in clock ticks since boot: tells a recycled pid apart
    cmdline: str
    session: tuple[str, ...]   # the BLADED_TEST_SESSION tokens in its environment
    test: str                  # its BLADED_TEST_NODEID, or ""

    def describe(self) -> str:
        cmd = self.cmdline if len(self.cmdline) <= 160 else self.cmdline[:157] + "..."
        return f"pid {self.pid} ({cmd}; started by {self.test or 'no test: a fixture, a plugin or collection'})"


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, start time) of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces and parentheses
    return int(fields[1]), fields[0], int(fields[19])


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def processes() -> Iterator[Proc]:
    """Every live process but zombies (and but this one)."""
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        pid = int(name)
        st = _stat(pid)
        if st is None or st[1] in ("Z", "X", "x"):
            continue
        session: tuple[str, ...] = ()
        test = ""
        for entry in _read(f"/proc/{pid}/environ").split(b"\0"):
            if entry.startswith(SESSION_VAR.encode() + b"="):
                session = tuple(entry.split(b"=", 1)[1].decode(errors="replace").split())
            elif entry.startswith(TEST_VAR.encode() + b"="):
                test = entry.split(b"=", 1)[1].decode(errors="replace")
        cmdline = _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace").strip()
        yield Proc(pid, st[0], st[1], st[2], cmdline or f"[{_read(f'/proc/{pid}/comm').decode().strip()}]",
                   session, test)


def descendants(procs: list[Proc], root: int) -> list[Proc]:
    children: dict[int, list[Proc]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p)
    out: list[Proc] = []
    todo = [root]
    while todo:
        for p in children.get(todo.pop(), []):
            out.append(p)
            todo.append(p.pid)
    return out


def of_session(token: str, test: str | None = None) -> list[Proc]:
    """The live processes of session ``token`` (started by ``test`` only, if given)."""
    return [p for p in processes() if token in p.session and (test is None or p.test == test)]


def leftovers(token: str) -> list[Proc]:
    """What the session ``token`` left: its processes and this process's live descendants."""
    procs = list(processes())
    found = {p.pid: p for p in procs if token in p.session}
    found.update((p.pid, p) for p in descendants(procs, os.getpid()))
    return sorted(found.values(), key=lambda p: p.pid)


def _wait_gone(fds: dict[int, int], timeout: float) -> set[int]:
    """The pids of ``fds`` (pid -> pidfd) still alive after ``timeout`` s (a pidfd polls readable at exit)."""
    left = set(fds)
    deadline = time.monotonic() + timeout
    poller = select.poll()
    for pid in left:
        poller.register(fds[pid], select.POLLIN)
    while left:
        wait_ms = (deadline - time.monotonic()) * 1000
        if wait_ms <= 0:
            break
        for fd, _ in poller.poll(wait_ms):
            pid = next(p for p, f in fds.items() if f == fd)
            poller.unregister(fd)
            left.discard(pid)
    return left


def end(procs: list[Proc], grace: float = GRACE_S) -> list[str]:
    """End ``procs``: SIGTERM, SIGKILL after ``grace`` s. One description per process that was still there."""
    fds: dict[int, int] = {}
    for p in procs:
        try:
            fd = os.pidfd_open(p.pid)
        except ProcessLookupError:
            continue
        st = _stat(p.pid)
        if st is None or st[2] != p.start or st[1] in ("Z", "X", "x"):  # gone, or the pid is someone else's now
            os.close(fd)
            continue
        fds[p.pid] = fd
    try:
        for fd in fds.values():
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGTERM)
        stubborn = _wait_gone(fds, grace)
        for pid in stubborn:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fds[pid], signal.SIGKILL)
        undying = _wait_gone({pid: fds[pid] for pid in stubborn}, KILL_WAIT_S)
    finally:
        for fd in fds.values():
            os.close(fd)
    how = {pid: "still there after SIGKILL" if pid in undying else "SIGKILLed" if pid in stubborn else "SIGTERMed"
           for pid in fds}
    return [f"{p.describe()}: {how[p.pid]}" for p in procs if p.pid in fds]


def tagged(env: Any) -> Any:
    """``env`` with this session's tags (those of this process's environment), for a child's environment."""
    env = dict(env)
    for var in (SESSION_VAR, TEST_VAR):
        if var in os.environ:
            env[var] = os.environ[var]
        else:
            env.pop(var, None)
    return env


_popen_init = subprocess.Popen.__init__


def _tagging_popen_init(self: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> None:
    if kwargs.get("env") is not None:
        kwargs["env"] = tagged(kwargs["env"])
    _popen_init(self, *args, **kwargs)


# -- the plugin ------------------------------------------------------------------------------------------
def pytest_configure(config: pytest.Config) -> None:
    global _token
    if _token:
        return
    _token = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    outer = os.environ.get(SESSION_VAR, "").split()
    os.environ[SESSION_VAR] = " ".join([*outer, _token])
    # what a pytest run inside a test starts outside its own tests belongs to no test of either session (the
    # outer session's end still finds it by its token)
    os.environ.pop(TEST_VAR, None)
    subprocess.Popen.__init__ = _tagging_popen_init  # type: ignore[method-assign]


def pytest_unconfigure(config: pytest.Config) -> None:
    subprocess.Popen.__init__ = _popen_init  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tags what the test starts (set up after wider-scoped fixtures, torn down after every fixture of the
    test), then ends what it left and fails the test, naming each process."""
    test = request.node.nodeid
    os.environ[TEST_VAR] = test
    try:
        yield
    finally:
        os.environ.pop(TEST_VAR, None)
    left = of_session(_token, test)
    if left:
        ended = end(left)
        pytest.fail(f"{test} left {len(ended)} process(es) running (ended now): " + "; ".join(ended), pytrace=False)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """After every fixture: end whatever this session left and make it fail."""
    left = leftovers(_token)
    if not left:
        return
    _leftovers.extend(end(left))
    if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if session.config.pluginmanager.get_plugin("terminalreporter") is None:
        for line in _leftovers:
            print(f"LEFTOVER PROCESS {line}", flush=True)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _leftovers:
        terminalreporter.section("processes the suite left running", sep="=", red=True, bold=True)
        for line in _leftovers:
            terminalreporter.line(f"LEFTOVER PROCESS {line}", red=True)
