"""Shared fixtures: real files, real loop devices (as root), staging memory."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import tempfile
from collections.abc import Iterator

import daemon_util
import pytest

from bladed.io import ExtentDevice, StagingBuffer
from bladed.io.engines import PORTABLE, URING, EngineChoice
from bladed.io.file import supports_o_direct

# tests/vm runs inside the QEMU NVMe VM (driven by tests/test_nvme_vm.py)
collect_ignore = ["vm"]


def pytest_configure(config: pytest.Config) -> None:
    """Default stop-signal dispositions, however the suite was launched.

    The tests send SIGINT, SIGHUP and SIGTERM to the programs they start and expect what a program
    started from a terminal does. A launcher that ignores them (``nohup``, a background job of a
    non-interactive shell, some CI runners) would pass SIG_IGN on to every child, and bladed and the
    runner keep a signal ignored on entry ignored, as ``nohup`` users expect."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # no process the suite starts outlives its test, nor the suite (tests/procguard.py, docs/reliability.md)
    config.pluginmanager.import_plugin("procguard")


@pytest.fixture
def store_dir(tmp_path: pathlib.Path) -> str:
    """A fresh directory on a filesystem that supports O_DIRECT (tmpfs does not:
    then fall back to ``var/test`` inside the checkout)."""
    if supports_o_direct(str(tmp_path)):
        return str(tmp_path)
    base = pathlib.Path(__file__).resolve().parent.parent / "var" / "test"
    base.mkdir(parents=True, exist_ok=True)
    return tempfile.mkdtemp(dir=base)


@pytest.fixture(params=[URING, PORTABLE])
def io_engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test on each engine (issue 29: everything above the engine behaves the same on both): every
    device the test opens without naming an engine, and every daemon it starts without ``io.engine``, runs
    on it.  The engine, backend, daemon and reliability suites take it with ``pytestmark``."""
    monkeypatch.setattr(ExtentDevice, "_engine", EngineChoice(request.param, "the test's io_engine"))
    monkeypatch.setattr(daemon_util, "IO_ENGINE", request.param)
    return str(request.param)


@pytest.fixture
def staging() -> Iterator[StagingBuffer]:
    buf = StagingBuffer(8 << 20)
    yield buf
    buf.close()


@pytest.fixture
def loop_device(store_dir: str) -> Iterator[str]:
    """A real loop device over a 64 MiB sparse file, detached afterwards."""
    if os.geteuid() != 0:
        pytest.fail("loop-device tests need root (run the suite as root, as CI does)")
    backing = os.path.join(store_dir, "loop.img")
    with open(backing, "wb") as f:
        f.truncate(64 << 20)
    dev = subprocess.run(["losetup", "--find", "--show", "--direct-io=on", backing],
                         check=True, capture_output=True, text=True).stdout.strip()
    try:
        yield dev
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)


@pytest.fixture
def tmp() -> Iterator[str]:
    """A fresh state directory with a short path (Unix socket paths are limited to 107 bytes)."""
    from daemon_util import short_tmpdir
    with short_tmpdir() as d:
        yield d


@pytest.fixture(params=["file", "block"])
def device(request: pytest.FixtureRequest, tmp: str) -> tuple[dict[str, object], str]:
    """A daemon's ``[device]`` section on each local backend, and the file its LBAs live in (the store file,
    or the loop device's backing file)."""
    if request.param == "file":
        return {}, os.path.join(tmp, "kv-store.img")
    if os.geteuid() != 0:
        pytest.fail("loop-device tests need root (run the suite as root, as CI does)")
    dev = request.getfixturevalue("loop_device")
    backing = subprocess.run(["losetup", "-n", "-O", "BACK-FILE", dev], check=True, capture_output=True,
                             text=True).stdout.strip()
    return {"backend": "block", "path": dev}, backing
