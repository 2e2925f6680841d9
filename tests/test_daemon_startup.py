"""What an operator gets when start-up cannot work: one line naming the key, the problem and the fix, exit
status 2, no traceback -- from ``bladed`` and from ``bladed --check-config`` alike, and ``--check-config``
changes nothing on disk.  Real processes, real read-only mounts, a real port in use."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
from daemon_util import ROOT, documented_exit_statuses, short_tmpdir

from bladed.server.daemon.main import EXIT_STATUSES


def bladed(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bladed.server", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def write_config(path: str, body: str) -> str:
    with open(path, "w") as f:
        f.write(body)
    return path


def tree(path: str) -> list[str]:
    out = []
    for root, dirs, files in os.walk(path):
        out += [os.path.relpath(os.path.join(root, n), path) for n in dirs + files]
    return sorted(out)


def one_line(r: subprocess.CompletedProcess[str]) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout == ""
    return lines[0]


@pytest.fixture
def tmp() -> Iterator[str]:
    with short_tmpdir() as d:
        yield d


@pytest.fixture
def readonly_dir(tmp: str) -> Iterator[str]:
    """A directory on a read-only tmpfs (root or not, nothing can be created in it)."""
    if os.geteuid() != 0:
        pytest.fail("these tests mount a read-only tmpfs: run the suite as root, as CI does")
    d = os.path.join(tmp, "ro")
    os.mkdir(d)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", d], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", d], check=True)


@pytest.mark.root
@pytest.mark.parametrize("check", [False, True], ids=["start", "check-config"])
def test_a_state_dir_that_cannot_be_created_is_one_line(tmp: str, readonly_dir: str, check: bool) -> None:
    state = os.path.join(readonly_dir, "state")
    r = bladed("--state-dir", state, *(["--check-config"] if check else []))
    assert r.returncode == 2
    line = one_line(r)
    assert line.startswith(f"bladed: daemon.state_dir: cannot create {state}: {readonly_dir} is not a writable "
                           "directory"), line


@pytest.mark.root
@pytest.mark.parametrize("check", [False, True], ids=["start", "check-config"])
def test_a_socket_in_a_read_only_directory_is_one_line(tmp: str, readonly_dir: str, check: bool) -> None:
    cfg = write_config(os.path.join(tmp, "b.toml"), f'[daemon]\nstate_dir = "{tmp}/state"\n'
                                                    f'[device]\nsize = 67108864\n'
                                                    f'[socket]\npath = "{readonly_dir}/bladed.sock"\n')
    r = bladed("-c", cfg, *(["--check-config"] if check else []))
    assert r.returncode == 2
    assert one_line(r) == (f"bladed: {cfg}: socket.path: directory {readonly_dir} is not writable by uid 0 "
                           "(permissions or a read-only file system); fix it or choose another socket.path")
    assert tree(tmp) == ["b.toml", "ro"]                # nothing created, not even the state dir


@pytest.mark.parametrize("check", [False, True], ids=["start", "check-config"])
def test_a_socket_in_a_missing_directory_is_refused_not_created(tmp: str, check: bool) -> None:
    cfg = write_config(os.path.join(tmp, "b.toml"), f'[daemon]\nstate_dir = "{tmp}/state"\n'
                                                    f'[device]\nsize = 67108864\n'
                                                    f'[socket]\npath = "{tmp}/run/bladed/bladed.sock"\n')
    r = bladed("-c", cfg, *(["--check-config"] if check else []))
    assert r.returncode == 2
    assert one_line(r) == (f"bladed: {cfg}: socket.path: directory {tmp}/run/bladed does not exist; create it "
                           "(the daemon creates only its state directory) or choose another path")
    assert not os.path.exists(os.path.join(tmp, "run"))


@pytest.mark.parametrize("check", [False, True], ids=["start", "check-config"])
def test_a_metrics_port_in_use_names_metrics_listen(tmp: str, check: bool) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        cfg = write_config(os.path.join(tmp, "b.toml"), f'[daemon]\nstate_dir = "{tmp}/state"\n'
                                                        f'[device]\nsize = 67108864\n'
                                                        f'[metrics]\nenabled = true\nlisten = "127.0.0.1:{port}"\n')
        r = bladed("-c", cfg, *(["--check-config"] if check else []))
    assert r.returncode == 2
    assert one_line(r) == (f"bladed: {cfg}: metrics.listen: 127.0.0.1:{port} is already in use (another bladed or "
                           "exporter?); choose another port or set metrics.enabled = false")


def test_a_directory_given_as_the_config_file_is_one_line(tmp: str) -> None:
    for args in (["-c", tmp], ["-c", tmp, "--check-config"]):
        r = bladed(*args)
        assert r.returncode == 2
        assert one_line(r) == f"bladed: config file {tmp} is a directory; give the TOML file in it (-c DIR/bladed.toml)"


def test_check_config_changes_nothing_on_disk(tmp: str) -> None:
    cfg = write_config(os.path.join(tmp, "b.toml"), f'[daemon]\nstate_dir = "{tmp}/state"\n'
                                                    '[device]\nsize = 67108864\n'
                                                    '[metrics]\nenabled = true\nlisten = "unix:metrics.sock"\n')
    r = bladed("-c", cfg, "--check-config")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"configuration OK: file {tmp}/state/kv-store.img (created at start-up), 4096-byte "
                               "LBAs, region [0, 16384) = 64.0 MiB")
    assert tree(tmp) == ["b.toml"]                      # no state dir, no store file, no socket


def test_check_config_of_an_existing_store_opens_it_without_growing_it(tmp: str) -> None:
    os.mkdir(os.path.join(tmp, "state"))
    store = os.path.join(tmp, "state", "kv-store.img")
    with open(store, "wb") as f:
        f.truncate(32 << 20)
    cfg = write_config(os.path.join(tmp, "b.toml"), f'[daemon]\nstate_dir = "{tmp}/state"\n'
                                                    '[device]\nsize = 67108864\n')
    r = bladed("-c", cfg, "--check-config")
    assert r.returncode == 0, r.stderr
    assert "file " + store in r.stdout and "= 32.0 MiB" in r.stdout
    assert os.path.getsize(store) == 32 << 20 and tree(tmp) == ["b.toml", "state", "state/kv-store.img"]


def test_help_documents_the_exit_statuses() -> None:
    r = subprocess.run([sys.executable, "-m", "bladed.server", "--help"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    for status, meaning in EXIT_STATUSES:
        assert f"\n  {status:<4} {meaning}" in r.stdout
    assert documented_exit_statuses("bladed status") == {status for status, _ in EXIT_STATUSES}
    with open(os.path.join(ROOT, "docs", "operations.md")) as f:
        assert "bladed --check-config" in f.read()
