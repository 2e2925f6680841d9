"""bladed on arm64 under emulation (issue 29): tools/vm/arm64/run-arm64.sh builds the C shim and the daemon for
aarch64 in a cached Debian 12 arm64 root and runs the smoke (tools/vm/arm64/smoke.py) there.

* In the VM (qemu-system-aarch64, Debian's arm64 kernel): the daemon on its embedded default (a file-backed
  store) picks io_uring, a session per path writes, reads back and verifies its KV, and each close TRIMs:
  the store's blocks over the extent are freed (``st_blocks``, ``SEEK_DATA``). Then a daemon on the VM's
  QEMU NVMe namespace does the same through NVMe passthrough (io_uring_cmd).
* Under qemu-user (the host's kernel through QEMU's syscall translation, which has no io_uring_setup): the
  same smoke on the portable engine, which ``io.engine = "auto"`` falls back to.

The first run builds the root (debootstrap, Debian's arm64 kernel, the pip packages: several minutes, once
per machine; docs/arm64.md has the times), later runs find it in the cache.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest
from daemon_util import ROOT, ended

RUN = os.path.join(ROOT, "tools", "vm", "arm64", "run-arm64.sh")
SETUP_TIMEOUT_S = 1800.0   # a fresh root: debootstrap, the kernel, pip, all emulated where they run code
SMOKE_TIMEOUT_S = 600.0
EM_AARCH64 = 183

# the first test sets the root up (pytest-timeout counts fixture setup): the suite's 600 s is too short for that
pytestmark = [pytest.mark.arm64, pytest.mark.slow, pytest.mark.timeout(SETUP_TIMEOUT_S + SMOKE_TIMEOUT_S)]


def harness(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """run-arm64.sh ARGS, ended with everything below it (QEMU included) however this is left."""
    proc = subprocess.Popen([RUN, *args], cwd=ROOT, env=dict(os.environ), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with ended(proc):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"run-arm64.sh {' '.join(args)} did not finish within {timeout:g} s")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def arm64_root() -> str:
    """The cached arm64 root (made first if needed): its path."""
    if os.geteuid() != 0:
        pytest.fail("the arm64 harness needs root (chroot, mounts, binfmt_misc): run the suite as root, as CI does")
    r = harness(["--setup", "--print-root"], SETUP_TIMEOUT_S)
    assert r.returncode == 0, f"run-arm64.sh --setup failed ({r.returncode}):\n{r.stderr[-6000:]}"
    root = r.stdout.strip().splitlines()[-1]
    assert os.path.isfile(os.path.join(root, ".bladed-ready")), r.stdout
    return root


def smoke(mode: list[str], args: tuple[str, ...] = ()) -> dict[str, Any]:
    r = harness([*mode, "--", "python", "tools/vm/arm64/smoke.py", *args], SMOKE_TIMEOUT_S)
    try:
        out = dict(json.loads(r.stdout))
    except ValueError:
        pytest.fail(f"the smoke printed no JSON (exit status {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    print(json.dumps({k: v for k, v in out.items() if k != "daemon_log_tail"}, indent=1))
    assert out["failures"] == [], f"{out['failures']}\ndaemon log:\n{out.get('daemon_log_tail')}\n{r.stderr[-3000:]}"
    assert r.returncode == 0, r.stderr[-6000:]
    return out


def check_smoke(out: dict[str, Any], engine: str) -> None:
    assert out["machine"] == "aarch64"
    assert (out["config"], out["backend"], out["engine"]) == ("embedded-default", "file", engine)
    assert out["daemon_rc"] == 0
    s = out["sessions"]
    assert s["direct-aligned"]["paths"] == ["direct"] and s["direct-packed"]["paths"] == ["direct"]
    assert s["dualblade"]["paths"] == ["pagecache"]
    for name, res in s.items():
        assert res["mismatched"] == [] and res["range_read_ok"], (name, res)
    for name in ("direct-aligned", "direct-packed"):
        res = s[name]
        extent_bytes = res["extent"]["nblocks"] * 4096
        # written: the extent holds data; closed: TRIMmed (punched), its blocks freed
        assert res["extent_data_bytes_before_close"] > 0, (name, res)
        assert res["trimmed_bytes"] == extent_bytes, (name, res)
        assert res["extent_data_bytes_after_close"] == 0, (name, res)
        assert res["store_blocks_after_close"] <= out["store_blocks_at_start"] < res["store_blocks_before_close"], \
            (name, res)
    assert out["stats"]["sessions"] == 0 and out["stats"]["used_blocks"] == 0
    assert out["pagecache_files_left"] == []


def test_c_shim_is_built_for_aarch64(arm64_root: str) -> None:
    r = harness(["--user", "--", "python", "-c", "import bladed._uring as u, platform; print(platform.machine(), "
                 "u.__file__)"], SMOKE_TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-6000:]
    machine, so = r.stdout.split()
    assert machine == "aarch64"
    with open(arm64_root + so, "rb") as f:
        head = f.read(20)
    assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == EM_AARCH64, head
    # the host's x86-64 build is untouched
    with open(os.path.join(ROOT, "bladed", "_uring.abi3.so"), "rb") as f:
        assert int.from_bytes(f.read(20)[18:20], "little") != EM_AARCH64


def test_smoke_in_arm64_vm_on_io_uring(arm64_root: str) -> None:
    # the VM has QEMU's NVMe controller too: the smoke then runs a second daemon on its namespace
    out = smoke(["--nvme", "256M"], ("--nvme", "/dev/ng0n1"))
    check_smoke(out, "uring")
    assert out["emulation"] == "vm" and out["kernel"].endswith("-arm64")
    # NVMe passthrough (io_uring_cmd) on arm64: written, read back, deallocated at the close
    nvme = out["nvme"]
    assert (nvme["backend"], nvme["engine"], nvme["daemon_rc"]) == ("nvme", "uring", 0)
    res = nvme["sessions"]["nvme-direct"]
    assert res["paths"] == ["direct"] and res["mismatched"] == [] and res["range_read_ok"], res
    assert res["trimmed_bytes"] == res["extent"]["nblocks"] * 4096 > 0, res


def test_smoke_under_qemu_user_on_the_portable_engine(arm64_root: str) -> None:
    out = smoke(["--user"])
    # qemu-user has no io_uring_setup (ENOSYS): io.engine = "auto" falls back to the portable engine
    check_smoke(out, "portable")
    assert out["emulation"] == "user"


def test_the_kv_codec_passes_its_tests_on_aarch64(arm64_root: str) -> None:
    """Issue 40: the q8 / q4 codec (``bladed._codec``) built for aarch64 (its NEON-vectorised loops, the portable
    build) writes the rows of the layout's reference, bit for bit (tests/test_kvformat_codec_numpy.py needs no
    torch). Under qemu-user: the codec makes no system call that matters, and no VM need boot for it."""
    r = harness(["--user", "--", "python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                 "tests/test_kvformat_codec_numpy.py"], SMOKE_TIMEOUT_S)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    assert " passed" in r.stdout and " failed" not in r.stdout, r.stdout[-3000:]
