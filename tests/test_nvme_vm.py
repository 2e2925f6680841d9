"""Real NVMe passthrough, from a host without NVMe: boots the QEMU NVMe VM
(tools/vm/nvme/run-in-nvme-vm.sh) once per device configuration and runs
``tests/vm`` inside it, with this interpreter: in the busybox-init
configurations every test but the ``systemd_vm`` ones, in the one booted with
systemd as PID 1 (``--init systemd``, cgroup v2 only) those alone.  No test may
skip, except one marked ``kernel_feature(NAME)`` in a configuration whose
kernel lacks NAME (``VMCase.missing_features``, e.g. ``io_uring_cmd`` on 5.10).

Each configuration costs one boot (about 5 s under TCG) plus Python and
pytest start-up inside the guest (10-20 s under TCG) plus the tests; see
docs/nvme-vm.md for measured times.  All configurations but the first leave
out the daemon-level modules that do the same on any geometry
(``VMCase.leaves_out``).  The checkout is not shared read-write
(``--ro-cwd``): the guest reads it, its ``.venv`` included, through its page
cache, and only ``tmp_path`` (the JUnit report) is written back.  Inside the
guest pytest's plugin
autoloading is switched off (it alone costs 25-30 s under TCG) and only
pytest-timeout is loaded, so tests in tests/vm must not rely on other
plugins' fixtures.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest
from daemon_util import ended

REPO = Path(__file__).resolve().parent.parent
HARNESS = REPO / "tools" / "vm" / "nvme" / "run-in-nvme-vm.sh"

NS_SIZE = "5G"        # sparse; over 4 GiB so that a whole-namespace discard needs several DSM ranges
FAULTY_SECTOR = 2048  # a second namespace fails every command touching byte 1 MiB (tests/vm/test_faults_in_vm.py)
# the harness kills the VM after this (each case's pytest timeout is 60 s more).  A busybox case takes
# 134-141 s on an idle host (docs/nvme-vm.md) but 382-477 s at a host load of 5-6, and lba512-mdts7 ran
# into the former 480 s at a load of 7 with every test it had reached passing
VM_TIMEOUT_S = 900
# systemd's boot to basic.target and four daemon start-ups (two with --check-config) under TCG: 4-6 min
# measured here (docs/nvme-vm.md), up to twice that on a loaded host
SYSTEMD_VM_TIMEOUT_S = 900
# 5.10: the daemon tests run slower there (docs/nvme-vm.md): 764 s boot to power-off at a host load of 4-6
K510_VM_TIMEOUT_S = 1200
#: the daemon-level modules that only lba4096-mdts5 runs: above the extent layer they do the same on any
#: geometry, and they are most of a configuration's time (docs/nvme-vm.md)
FIRST_CONFIGURATION_ONLY = ("tests/vm/test_prefix_in_vm.py", "tests/vm/test_replan_in_vm.py")
#: ... and these where the engine and the LBA size are lba4096-mdts5's (io_uring_cmd, 4 KiB)
SAME_ENGINE_SKIPS = ("tests/vm/test_faults_in_vm.py",)
#: a start-up refused under seccomp: what it shows depends on the engines the kernel offers (io_uring_cmd on 6.1
#: and 6.12, the ioctls alone on 5.10), not on the LBA size or MDTS: lba4096-mdts5 and 5.10 run it
SECCOMP_REFUSAL = ("tests/vm/test_daemon_in_vm.py::"
                   "test_a_daemon_allowed_neither_io_uring_nor_the_nvme_ioctls_refuses_to_start")
#: remanence above the extent layer (a new session reads zeroes where an earlier one wrote): the same on every
#: engine once Dataset Management and Write Zeroes read back as zeroes, which test_nvme_backend.py shows on each
#: configuration's own engine (5.10: the ioctls); lba4096-mdts5 and lba512-mdts7 run it
REMANENCE = "tests/vm/test_faults_in_vm.py::test_new_session_never_reads_an_earlier_sessions_blocks"


@dataclass(frozen=True)
class VMCase:
    name: str
    harness_args: tuple[str, ...]
    shows: str
    systemd: bool = False         # booted with --init systemd: runs the systemd_vm tests (and only those)
    faulty_namespace: bool = True  # --faulty-sector (tests/vm/test_faults_in_vm.py)
    vm_timeout_s: int = VM_TIMEOUT_S
    #: features this kernel lacks (tests/vm's kernel_feature marker): the tests that need one skip, saying
    #: "needs NAME: ...", and must (the probe found it missing); any other skip fails the case
    missing_features: tuple[str, ...] = ()
    #: modules of tests/vm this configuration leaves out (another one runs them)
    leaves_out: tuple[str, ...] = ()
    #: tests of the modules it runs that it leaves out (node ids; another configuration runs them)
    deselects: tuple[str, ...] = ()

    @property
    def markers(self) -> str:
        return "nvme_vm and systemd_vm" if self.systemd else "nvme_vm and not systemd_vm"


CASES = [
    VMCase("lba4096-mdts5", ("--lba", "4096", "--mdts", "5"),
           "MDTS 128 KiB forces chunking of every multi-MiB transfer; Debian 12's default kernel (6.1)",
           missing_features=("io_uring_disabled",)),
    VMCase("lba512-mdts7", ("--lba", "512"),
           "512-byte LBA with QEMU's default MDTS (512 KiB), capped below 512 KiB by max_segments; kernel 6.1",
           missing_features=("io_uring_disabled",), leaves_out=FIRST_CONFIGURATION_ONLY,
           deselects=(SECCOMP_REFUSAL,)),
    VMCase("lba4096-mdts5-k5.10", ("--kernel", "5.10", "--lba", "4096", "--mdts", "5"),
           "Debian 11's 5.10 kernel: no /dev/ngXnY and no io_uring_cmd, so the namespace is its block node "
           "/dev/nvme0n1 and the direct path is the portable engine's NVMe ioctl passthrough, chunked by MDTS "
           "128 KiB; no cachestat(2)",
           missing_features=("io_uring_cmd", "nvme_generic_chardev", "io_uring_disabled"),
           vm_timeout_s=K510_VM_TIMEOUT_S, leaves_out=FIRST_CONFIGURATION_ONLY, deselects=(REMANENCE,)),
    VMCase("lba4096-mdts8-k6.12", ("--kernel", "6.12", "--lba", "4096", "--mdts", "8"),
           "MDTS 1 MiB above the max_segments cap of 4 KiB pages (hugetlb pages reach it); Debian 12's "
           "6.12 kernel, where fixed (registered) buffers work for passthrough",
           leaves_out=FIRST_CONFIGURATION_ONLY + SAME_ENGINE_SKIPS, deselects=(SECCOMP_REFUSAL,)),
    VMCase("systemd-cgroup2-k6.12", ("--init", "systemd", "--kernel", "6.12", "--lba", "4096", "--namespaces", "2"),
           "systemd 252 as PID 1 on a cgroup-v2-only 6.12 kernel: the shipped unit and udev rule "
           "(tests/vm/test_systemd_in_vm.py) and the budget against real v2 cgroups "
           "(tests/vm/test_cgroup2_in_vm.py); namespace 2 carries ext4",
           systemd=True, faulty_namespace=False, vm_timeout_s=SYSTEMD_VM_TIMEOUT_S),
]


def _guest_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST", "PYTEST_PLUGINS")
           and not k.startswith(("COV_CORE_", "PYTEST_XDIST"))}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _inner_pytest(junit: Path, case: VMCase) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "tests/vm", "-m", case.markers, "-q",
           "-p", "no:cacheprovider", "--durations=20", f"--junitxml={junit}",
           *(f"--ignore={m}" for m in case.leaves_out),
           *(f"--deselect={t}" for t in case.deselects)]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd[3:3] = ["-p", "pytest_timeout"]
    return cmd


@dataclass(frozen=True)
class Outcome:
    tests: int
    failed: list[str]
    skipped: list[str]
    xfailed: list[str]


def _read_junit(path: Path) -> Outcome:
    root = ET.parse(path).getroot()
    tests = 0
    failed: list[str] = []
    skipped: list[str] = []
    xfailed: list[str] = []
    for case in root.iter("testcase"):
        tests += 1
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
        for s in case.findall("skipped"):
            (xfailed if s.get("type") == "pytest.xfail" else skipped).append(f"{name}: {s.get('message')}")
    return Outcome(tests, failed, skipped, xfailed)


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=pytest.mark.timeout(c.vm_timeout_s + 60))
                                  for c in CASES])
def test_vm_suite_passes(case: VMCase, tmp_path: Path) -> None:
    assert HARNESS.is_file(), f"{HARNESS} is missing"
    assert list((REPO / "bladed").glob("_uring*.so")), (
        "bladed/_uring*.so is not built in place; the VM imports bladed from the checkout "
        "(pip install -e . --no-build-isolation)")
    junit = tmp_path / "junit.xml"
    faulty = ("--faulty-sector", str(FAULTY_SECTOR)) if case.faulty_namespace else ()
    # --ro-cwd: the checkout and its .venv through the guest's page cache (a Python start with the daemon's and the
    # tests' imports: 24.6 s read-write over 9p, 6.4 s so: docs/nvme-vm.md); only tmp_path comes back to the host
    cmd = [str(HARNESS), *case.harness_args, "--size", NS_SIZE, *faulty, "--timeout", str(case.vm_timeout_s),
           "--ro-cwd", "--rw", str(tmp_path), "--", *_inner_pytest(junit, case)]
    print(f"[{case.name}] {case.shows}\n$ {' '.join(cmd)}", flush=True)

    t0 = time.monotonic()
    # A guest kernel that panics while booting under TCG (seen once, in
    # sched_init_debug, on a loaded host) never runs the command: boot again
    # once.  A failure after the command started is never retried.
    for _attempt in range(2):
        lines: list[str] = []
        # ended(): however the test ends (pytest-timeout too), the harness gets SIGTERM (its trap stops QEMU),
        # then it and everything below it SIGKILL
        with subprocess.Popen(cmd, cwd=REPO, env=_guest_env(), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc, ended(proc, 60):
            assert proc.stdout is not None
            for line in proc.stdout:          # streamed: visible live with -s, kept for the report
                print(line, end="", flush=True)
                lines.append(line)
            rc = proc.wait()
        booted = junit.exists() or any("starting command" in ln or "passed" in ln for ln in lines)
        if rc != 125 or booted:
            break
        print(f"[{case.name}] the guest did not boot (status 125, no test output); booting again", flush=True)
    wall = time.monotonic() - t0
    print(f"[{case.name}] VM wall time {wall:.1f} s, exit status {rc}", flush=True)

    tail = "".join(lines[-80:])
    if rc in (124, 125):
        pytest.fail(f"[{case.name}] the VM failed (status {rc}: 124 timeout, 125 VM/harness failure; "
                    f"`{HARNESS.relative_to(REPO)} --setup` prepares it):\n{tail}")
    assert junit.is_file(), f"[{case.name}] the inner pytest wrote no report (status {rc}):\n{tail}"
    out = _read_junit(junit)
    assert out.tests > 0, f"[{case.name}] no test ran inside the VM:\n{tail}"
    assert not out.failed, f"[{case.name}] failed inside the VM: {out.failed}\n{tail}"
    allowed = tuple(f"needs {f}: " for f in case.missing_features)
    unexpected = [s for s in out.skipped if not s.split(": ", 1)[1].startswith(allowed)]
    assert not unexpected, f"[{case.name}] tests/vm must not skip but for {case.missing_features}: {unexpected}"
    for feature in case.missing_features:
        assert any(f": needs {feature}: " in s for s in out.skipped), (
            f"[{case.name}] no test skipped for lack of {feature}: the guest kernel has it after all?")
    assert rc == 0, f"[{case.name}] inner pytest exited with {rc}:\n{tail}"
    for x in out.xfailed:
        print(f"[{case.name}] known failure: {x}")
