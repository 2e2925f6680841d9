"""Feature detection on the guest's own kernel (5.10, 6.1, 6.12), and kernel.io_uring_disabled set for real.

The host's tests (tests/test_features.py) can only emulate a missing feature with seccomp; here the
kernels really lack them: 5.10 has no /dev/ngXnY and no io_uring_cmd, 6.1 no cachestat(2).  The VM is
throw-away, so the io_uring sysctls may be changed here (and are restored all the same).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nvmevm import GENERIC_NODES, NG_PATH

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from daemon_util import forked_as

from bladed.cli.checks import run_checks
from bladed.io import features

pytestmark = pytest.mark.nvme_vm

NOBODY = 65534
ROOT = Path(__file__).resolve().parents[2]


def test_probes_match_what_the_guest_kernel_has() -> None:
    kernel = features.kernel_version()
    assert features.io_uring().available                 # root, no seccomp filter, no sysctl set
    generic = features.nvme_generic_chardev()
    assert generic.available == GENERIC_NODES == (kernel >= (5, 13))
    if not generic.available:
        assert generic.detail == "nvme driver loaded, no nvme-generic class: kernel < 5.13"
    cmd = features.io_uring_cmd()
    assert cmd.available == (kernel >= (5, 19))
    if not cmd.available:
        assert cmd.detail == "IORING_OP_URING_CMD not supported: kernel < 5.19"
    cachestat = features.cachestat()
    assert cachestat.available == (kernel >= (6, 5))
    if not cachestat.available:
        assert cachestat.detail == "ENOSYS: kernel < 6.5"
    assert features.io_uring_discard().available == (kernel >= (6, 12))


def check() -> dict[str, dict[str, str]]:
    """``bladectl ns check NG_PATH --json`` in a child process (features probed afresh)."""
    r = subprocess.run([sys.executable, "-m", "bladed.cli.bladectl", "ns", "check", NG_PATH, "--json"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and "Traceback" not in r.stderr, (r.stdout, r.stderr)
    return {c["check"]: c for c in json.loads(r.stdout)["checks"]}


def io_uring_as(uid: int) -> dict[str, Any]:
    """features.io_uring() probed afresh in a forked child running as ``uid`` (nobody: no capabilities)."""
    def body(out: dict[str, Any]) -> None:
        features.io_uring.cache_clear()
        f = features.io_uring()
        out.update(available=f.available, detail=f.detail)
    return forked_as(uid, body)


def test_check_of_the_namespace_names_each_fallback() -> None:
    """The checks of `bladectl ns check` for the nvme backend (run here directly: on 5.10 the command
    takes the block node /dev/nvmeXnY as the block backend)."""
    by = {c.name: c.to_dict() for c in run_checks(NG_PATH, "nvme")}
    assert all(c["status"] != "fail" for c in by.values()), by
    for f in (features.io_uring_cmd(), features.nvme_generic_chardev(), features.cachestat()):
        assert by[f.name]["status"] == ("ok" if f.available else "warn"), by[f.name]
        assert by[f.name]["detail"] == f.describe()
    engine = "uring" if features.io_uring_cmd().available else "portable"
    assert f"nvme backend on the {engine} engine" in by["kernel"]["detail"]
    assert by["read"]["status"] == "ok" and f"on the {engine} engine" in by["read"]["detail"]
    if not features.io_uring_cmd().available:              # 5.10: ioctl passthrough on the block node
        assert by["io_uring_cmd"]["detail"] == (
            "unavailable (IORING_OP_URING_CMD not supported: kernel < 5.19) → "
            "NVMe passthrough by ioctl (NVME_IOCTL_IO64_CMD) on the portable engine")
        assert by["nvme generic char devices"]["detail"].endswith(
            "→ passthrough ioctls on the namespace's block node /dev/nvmeXnY")
        assert by["fixed buffers"]["detail"] == "portable engine: staging buffers are passed by address"


@pytest.fixture
def io_uring_sysctls() -> Iterator[None]:
    """kernel.io_uring_disabled and kernel.io_uring_group as they were, whatever the test does."""
    saved = {name: Path(f"/proc/sys/kernel/{name}").read_text() for name in ("io_uring_disabled", "io_uring_group")}
    try:
        yield
    finally:
        for name, value in saved.items():
            Path(f"/proc/sys/kernel/{name}").write_text(value)


def set_sysctl(name: str, value: int) -> None:
    Path(f"/proc/sys/kernel/{name}").write_text(f"{value}\n")


@pytest.mark.kernel_feature("io_uring_disabled")
def test_io_uring_disabled_sysctl_is_named_and_the_portable_engine_serves(io_uring_sysctls: None) -> None:
    set_sysctl("io_uring_disabled", 2)
    by = check()
    assert by["io_uring"]["status"] == "warn"
    assert by["io_uring"]["detail"] == ("unavailable (EPERM: kernel.io_uring_disabled = 2) → "
                                        "portable engine (preadv2/pwritev2 threads)")
    assert "nvme backend on the portable engine" in by["kernel"]["detail"]
    assert by["read"]["status"] == "ok" and "on the portable engine" in by["read"]["detail"]

    # 1: root (CAP_SYS_ADMIN) and kernel.io_uring_group only; a user outside it is refused
    set_sysctl("io_uring_disabled", 1)
    assert io_uring_as(0) == {"available": True, "detail": "io_uring_setup works"}
    set_sysctl("io_uring_group", -1)
    assert io_uring_as(NOBODY) == {"available": False, "detail": "EPERM: kernel.io_uring_disabled = 1 and not in "
                                                                  "kernel.io_uring_group (unset)"}
    set_sysctl("io_uring_group", NOBODY)
    assert io_uring_as(NOBODY) == {"available": True, "detail": "io_uring_setup works"}
