"""The suite's own guarantee (tests/procguard.py): a process a test leaves running is ended and fails that
test; one left at the end of the session (by a fixture, whatever its scope) is ended and fails the session;
a process the session did not start is left alone.

Each case runs pytest on a small test file of its own, in a subprocess with the guard loaded (``-p
procguard``), and checks its exit status, its one-line reports and that every leaked process is gone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import procguard
from daemon_util import ROOT

TESTS = os.path.dirname(os.path.abspath(__file__))

LEAKY = '''
import os
import subprocess
import sys

import procguard
import pytest
from daemon_util import DaemonProcess

OUT = {out!r}


def record(name: str, pid: int) -> None:
    """The pid and its start time (a recycled pid is told apart)."""
    start = next(p.start for p in procguard.processes() if p.pid == pid)
    with open(os.path.join(OUT, name), "w") as f:
        f.write(f"{{pid}} {{start}}")


@pytest.fixture(scope="session")
def forgotten() -> int:
    """A session-scoped fixture that never ends its process."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    record("fixture", proc.pid)
    return proc.pid


def test_a_daemon_left_running(tmp_path) -> None:
    d = DaemonProcess(str(tmp_path)).start()
    record("daemon", d.pid)


def test_a_double_forked_process_in_a_session_of_its_own() -> None:
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        pid = os.fork()
        if pid == 0:
            os.execvp("sleep", ["sleep", "600"])
        os.write(w, str(pid).encode())
        os._exit(0)
    os.close(w)
    record("orphan", int(os.read(r, 32)))


def test_uses_the_forgotten_fixture(forgotten: int) -> None:
    assert forgotten > 0


def test_clean(tmp_path) -> None:
    with DaemonProcess(str(tmp_path)).start() as d:
        assert d.proc is not None and d.proc.poll() is None
'''

CLEAN = '''
import subprocess
import sys


def test_ends_what_it_starts() -> None:
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) as p:
        p.kill()
'''


def inner_pytest(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, ROOT]))
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "procguard", "-p", "no:cacheprovider", "-q",
                           "-o", "addopts=", "test_inner.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def alive(pid: int, start: int) -> bool:
    """Whether ``pid`` still runs the process that had it at ``start`` (a zombie has ended)."""
    return any(p.pid == pid and p.start == start for p in procguard.processes())


def start_time(pid: int) -> int:
    return next(p.start for p in procguard.processes() if p.pid == pid)


def test_leaked_processes_are_ended_and_fail_their_test_and_the_session(tmp_path: Path) -> None:
    out = tmp_path / "pids"
    out.mkdir()
    # a process of the outer session: the inner one must not touch it
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        born = start_time(bystander.pid)
        r = inner_pytest(tmp_path, LEAKY.format(out=str(out)))
        report = r.stdout + r.stderr
        assert r.returncode == 1, report
        assert "4 passed, 2 errors" in report, report
        started = {p.name: tuple(map(int, p.read_text().split())) for p in out.iterdir()}
        pids = {name: pid for name, (pid, _) in started.items()}
        assert pids.keys() == {"daemon", "orphan", "fixture"}, pids
        lines = report.splitlines()
        # each leak of a test: one line, in that test's error, naming the process and the test
        for test, name, cmd in (("test_a_daemon_left_running", "daemon", "bladed.server"),
                                ("test_a_double_forked_process_in_a_session_of_its_own", "orphan", "sleep 600")):
            # (the short summary repeats it after "ERROR ... - Failed: ", untruncated where $CI is set)
            hit = [ln for ln in lines if f"pid {pids[name]} (" in ln and "left 1 process(es) running" in ln
                   and not ln.startswith("ERROR ")]
            assert len(hit) == 1 and cmd in hit[0] and f"started by test_inner.py::{test}" in hit[0], report
        # the fixture's: at the end of the session, one line
        hit = [ln for ln in lines if ln.startswith(f"LEFTOVER PROCESS pid {pids['fixture']} (")]
        assert len(hit) == 1 and hit[0].endswith("SIGTERMed"), report
        assert "started by no test" in hit[0], hit[0]
        assert not [ln for ln in lines if "LEFTOVER PROCESS" in ln and f"pid {pids['fixture']} " not in ln], report
        for name, (pid, start) in started.items():
            assert not alive(pid, start), f"the {name} process (pid {pid}) is still running"
        assert alive(bystander.pid, born), "the inner session ended a process it did not start"
    finally:
        bystander.kill()
        bystander.wait(30)


def test_a_session_that_ends_what_it_starts_passes(tmp_path: Path) -> None:
    r = inner_pytest(tmp_path, CLEAN)
    assert r.returncode == 0 and "LEFTOVER" not in r.stdout + r.stderr, r.stdout + r.stderr
