"""One socket rule for bladectl, the client library, the runner and ``bladed.hf``
(``bladed.config.find_socket``; docs/configuration.md, "Where clients find the socket").

The new user's complaint: the quick start used ``var/bladed.sock`` while ``bladed.hf`` looked in
``./var/bladed/bladed.sock``, and the transformers snippet of docs/transformers.md did not run as
written (tests/test_docs_snippets.py runs it).  Here a daemon is started as the quick start says
(``python -m bladed.server``, no options) and every client finds it from that directory without
``BLADED_SOCKET``; elsewhere each "no bladed socket" error says where the path came from.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
from bladectl_util import bladectl, failure, one_line, one_object
from daemon_util import DaemonProcess, ended, env_with_repo, short_tmpdir

from bladed.client import Client, DaemonLostError
from bladed.config import find_socket


@pytest.fixture(scope="module")
def quick_start() -> Iterator[DaemonProcess]:
    """``python -m bladed.server`` with no options, from an empty directory (the daemon's cwd)."""
    with short_tmpdir() as tmp, DaemonProcess(tmp, embedded=True).start() as d:
        yield d


def here(d: DaemonProcess) -> str:
    return d.cwd


def python(*args: str, cwd: str) -> tuple[subprocess.CompletedProcess[str], int]:
    """``python ARGS`` from ``cwd`` without BLADED_SOCKET: its result and its pid."""
    with ended(subprocess.Popen([sys.executable, *args], cwd=cwd, env=env_with_repo(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)) as proc:
        out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), proc.pid


def test_bladectl_finds_the_quick_start_daemon(quick_start: DaemonProcess) -> None:
    st = one_object(bladectl("status", "--json", cwd=here(quick_start)))
    assert st["pid"] == quick_start.pid and st["config"] == "embedded-default"
    assert st["socket"] == os.path.join(here(quick_start), "var", "bladed", "bladed.sock")


def test_the_runner_finds_the_quick_start_daemon(quick_start: DaemonProcess) -> None:
    before = quick_start.mark()  # the daemon is shared by the module: only what the runner causes counts
    r, pid = python("-m", "bladed.runner", "--model", "tiny-opt", "--prompt-len", "4", "--gen-len", "2", "--json",
                    cwd=here(quick_start))
    assert r.returncode == 0, r.stderr
    assert quick_start.wait_event("session_close", after=before, pid=pid)


def test_the_client_library_finds_it_and_says_where_it_looked(quick_start: DaemonProcess,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BLADED_SOCKET", raising=False)
    monkeypatch.chdir(here(quick_start))
    with Client() as c:
        assert c.status()["pid"] == quick_start.pid
    monkeypatch.setenv("BLADED_SOCKET", os.path.join(here(quick_start), "none.sock"))
    with pytest.raises(DaemonLostError, match=r"^no bladed socket at .*/none\.sock \(from \$BLADED_SOCKET; "):
        Client()


def test_every_no_socket_error_says_where_the_path_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BLADED_SOCKET", raising=False)
    with short_tmpdir() as tmp:
        # nothing given, no bladed started here: /etc/bladed/bladed.toml's socket, or the system default
        loc = find_socket(cwd=tmp)
        assert one_line(bladectl("status", cwd=tmp), 3) == f"no bladed socket at {loc} ({loc.why})"
        env_sock = os.path.join(tmp, "env.sock")
        msg = failure(bladectl("--json", "status", cwd=tmp, env={"BLADED_SOCKET": env_sock}), 3, "no_daemon")
        assert msg == (f"no bladed socket at {env_sock} (from $BLADED_SOCKET; start bladed there or point "
                       "BLADED_SOCKET at its socket)")
        cfg = os.path.join(tmp, "b.toml")
        with open(cfg, "w") as f:
            f.write(f'[daemon]\nstate_dir = "{tmp}"\n')
        msg = one_line(bladectl("status", "-c", cfg, cwd=tmp, env={"BLADED_SOCKET": env_sock}), 3)
        assert msg == (f"no bladed socket at {tmp}/bladed.sock (socket.path of {cfg}; start bladed with "
                       f"--config {cfg})")
        # a socket nobody listens on: what a killed daemon leaves
        stale = os.path.join(tmp, "stale.sock")
        s = socket.socket(socket.AF_UNIX)
        s.bind(stale)
        try:
            msg = one_line(bladectl("status", cwd=tmp, env={"BLADED_SOCKET": stale}), 3)
        finally:
            s.close()
        assert msg == (f"bladed is not running: {stale} refuses connections, the stale socket of a stopped daemon "
                       "(from $BLADED_SOCKET; start bladed there or point BLADED_SOCKET at its socket)")
