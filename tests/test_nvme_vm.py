"""Real NVMe passthrough, from a host without NVMe: boots the QEMU NVMe VM
(tools/nvme-vm/run-in-nvme-vm.sh) once per device configuration and runs
``tests/vm`` inside it, with this interpreter: in the busybox-init
configurations every test but the ``systemd_vm`` ones, in the one booted with
systemd as PID 1 (``--init systemd``, cgroup v2 only) those alone.  No test may
skip, except one marked ``kernel_feature(NAME)`` in a configuration whose
kernel lacks NAME (``VMCase.missing_features``, e.g. ``io_uring_cmd`` on 5.10).

Each configuration costs one boot (about 5 s under TCG) plus Python and
pytest start-up inside the guest (10-20 s under TCG) plus the tests; see
docs/nvme-vm.md for measured times.  The configurations boot one after another
on a fixture's thread (``VMBatch``; ``BLADED_VM_PARALLEL=2`` boots two at a time,
which does not pay on a 2-core host), and all but the first leave out the
daemon-level modules that do the same on any geometry (``VMCase.leaves_out``).
Inside the guest pytest's plugin
autoloading is switched off (it alone costs 25-30 s under TCG) and only
pytest-timeout is loaded, so tests in tests/vm must not rely on other
plugins' fixtures.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from daemon_util import end_process, ended
from procguard import for_fixture

REPO = Path(__file__).resolve().parent.parent
HARNESS = REPO / "tools" / "nvme-vm" / "run-in-nvme-vm.sh"

NS_SIZE = "5G"        # sparse; over 4 GiB so that a whole-namespace discard needs several DSM ranges
FAULTY_SECTOR = 2048  # a second namespace fails every command touching byte 1 MiB (tests/vm/test_faults_in_vm.py)
# the harness kills the VM after this (times VM_PARALLEL).  A busybox case takes 134-141 s on an idle host
# (docs/nvme-vm.md) but 382-477 s at a host load of 5-6, and lba512-mdts7 ran into the former 480 s at a load of
# 7 with every test it had reached passing
VM_TIMEOUT_S = 900
# systemd's boot to basic.target and four daemon start-ups (two with --check-config) under TCG: 4-6 min
# measured here (docs/nvme-vm.md), up to twice that on a loaded host
SYSTEMD_VM_TIMEOUT_S = 900
# 5.10: the daemon tests run slower there (docs/nvme-vm.md): 764 s boot to power-off at a host load of 4-6
K510_VM_TIMEOUT_S = 1200
#: configurations booted at a time (VMBatch).  1 on this 2-core machine: a guest alone keeps one core busy on
#: average, yet two at a time took each 2.1x as long (docs/nvme-vm.md), no faster in all
VM_PARALLEL = max(1, int(os.environ.get("BLADED_VM_PARALLEL", "1")))
#: the daemon-level modules that only lba4096-mdts5 runs: above the extent layer they do the same on any
#: geometry, and they are most of a configuration's time (docs/nvme-vm.md)
FIRST_CONFIGURATION_ONLY = ("tests/vm/test_prefix_in_vm.py", "tests/vm/test_replan_in_vm.py")
#: ... and these where the engine and the LBA size are lba4096-mdts5's (io_uring_cmd, 4 KiB)
SAME_ENGINE_SKIPS = ("tests/vm/test_faults_in_vm.py",)


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

    @property
    def markers(self) -> str:
        return "nvme_vm and systemd_vm" if self.systemd else "nvme_vm and not systemd_vm"


CASES = [
    VMCase("lba4096-mdts5", ("--lba", "4096", "--mdts", "5"),
           "MDTS 128 KiB forces chunking of every multi-MiB transfer; Debian 12's default kernel (6.1)",
           missing_features=("io_uring_disabled",)),
    VMCase("lba512-mdts7", ("--lba", "512"),
           "512-byte LBA with QEMU's default MDTS (512 KiB), capped below 512 KiB by max_segments; kernel 6.1",
           missing_features=("io_uring_disabled",), leaves_out=FIRST_CONFIGURATION_ONLY),
    VMCase("lba4096-mdts5-k5.10", ("--kernel", "5.10", "--lba", "4096", "--mdts", "5"),
           "Debian 11's 5.10 kernel: no /dev/ngXnY and no io_uring_cmd, so the namespace is its block node "
           "/dev/nvme0n1 and the direct path is the portable engine's NVMe ioctl passthrough, chunked by MDTS "
           "128 KiB; no cachestat(2)",
           missing_features=("io_uring_cmd", "nvme_generic_chardev", "io_uring_disabled"),
           vm_timeout_s=K510_VM_TIMEOUT_S, leaves_out=FIRST_CONFIGURATION_ONLY),
    VMCase("lba4096-mdts8-k6.12", ("--kernel", "6.12", "--lba", "4096", "--mdts", "8"),
           "MDTS 1 MiB above the max_segments cap of 4 KiB pages (hugetlb pages reach it); Debian 12's "
           "6.12 kernel, where fixed (registered) buffers work for passthrough",
           leaves_out=FIRST_CONFIGURATION_ONLY + SAME_ENGINE_SKIPS),
    VMCase("systemd-cgroup2-k6.12", ("--init", "systemd", "--kernel", "6.12", "--lba", "4096", "--namespaces", "2"),
           "systemd 252 as PID 1 on a cgroup-v2-only 6.12 kernel: the shipped unit and udev rule "
           "(tests/vm/test_systemd_in_vm.py) and the budget against real v2 cgroups "
           "(tests/vm/test_cgroup2_in_vm.py); namespace 2 carries ext4",
           systemd=True, faulty_namespace=False, vm_timeout_s=SYSTEMD_VM_TIMEOUT_S),
]

#: a test waits for its configuration, which may be queued behind the others: at worst the whole batch
BATCH_TIMEOUT_S = sum(c.vm_timeout_s * VM_PARALLEL + 60 for c in CASES) + 120


def _guest_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST", "PYTEST_PLUGINS")
           and not k.startswith(("COV_CORE_", "PYTEST_XDIST"))}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _inner_pytest(junit: Path, case: VMCase) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "tests/vm", "-m", case.markers, "-q",
           "-p", "no:cacheprovider", f"--junitxml={junit}", *(f"--ignore={m}" for m in case.leaves_out)]
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


@dataclass
class CaseRun:
    """One configuration's run of the harness: its exit status, its output and where its report is."""
    rc: int
    lines: list[str]
    wall_s: float
    junit: Path


class VMBatch:
    """The configurations, booted :data:`VM_PARALLEL` at a time on background threads from the first test that
    asks for one, longest first; each test waits for its own configuration's run (a future, not a poll).
    Closing the batch ends every harness still running (its trap stops QEMU) and drops the configurations not
    yet started."""

    def __init__(self, cases: list[VMCase], root: Path, parallel: int) -> None:
        self._root = root
        self._procs: set[subprocess.Popen[str]] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="nvme-vm")
        order = sorted(cases, key=lambda c: -c.vm_timeout_s)           # the slowest kernel first
        self.runs: dict[str, Future[CaseRun]] = {c.name: self._pool.submit(self._run, c) for c in order}

    def _run(self, case: VMCase) -> CaseRun:
        tmp = self._root / case.name
        tmp.mkdir(parents=True, exist_ok=True)
        junit = tmp / "junit.xml"
        faulty = ("--faulty-sector", str(FAULTY_SECTOR)) if case.faulty_namespace else ()
        cmd = [str(HARNESS), *case.harness_args, "--size", NS_SIZE, *faulty, "--timeout",
               str(case.vm_timeout_s * VM_PARALLEL), "--rw", str(tmp), "--", *_inner_pytest(junit, case)]
        lines = [f"[{case.name}] {case.shows}\n", f"$ {' '.join(cmd)}\n"]
        t0 = time.monotonic()
        rc = 125
        # A guest kernel that panics while booting under TCG (seen once, in sched_init_debug, on a loaded host)
        # never runs the command: boot again once.  A failure after the command started is never retried.
        for _attempt in range(2):
            # ended(): however the run ends, the harness gets SIGTERM (its trap stops QEMU), then it and
            # everything below it SIGKILL
            with self._lock:
                if self._closed:
                    break
                proc = subprocess.Popen(cmd, cwd=REPO, env=for_fixture(_guest_env()), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                self._procs.add(proc)
            with proc, ended(proc, 60):
                assert proc.stdout is not None
                out = list(proc.stdout)
                rc = proc.wait()
            with self._lock:
                self._procs.discard(proc)
            lines += out
            booted = junit.exists() or any("starting command" in ln or "passed" in ln for ln in out)
            if rc != 125 or booted:
                break
            lines.append(f"[{case.name}] the guest did not boot (status 125, no test output); booting again\n")
        return CaseRun(rc, lines, time.monotonic() - t0, junit)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            procs = list(self._procs)
        for f in self.runs.values():
            f.cancel()
        for proc in procs:
            end_process(proc, 60)
        self._pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def vm_batch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VMBatch]:
    assert HARNESS.is_file(), f"{HARNESS} is missing"
    assert list((REPO / "bladed").glob("_uring*.so")), (
        "bladed/_uring*.so is not built in place; the VM imports bladed from the checkout "
        "(pip install -e . --no-build-isolation)")
    # the kernels and initramfs images first, once (3 s when tools/setup.sh made them): the parallel runs then
    # only read the harness's cache
    setup = subprocess.run([str(HARNESS), "--setup"], cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=900)
    assert setup.returncode == 0, f"{HARNESS.relative_to(REPO)} --setup failed:\n{setup.stderr[-4000:]}"
    # only the configurations this run selected (-k lba512 boots one VM)
    chosen = {item.callspec.params["case"].name for item in request.session.items
              if isinstance(item, pytest.Function) and item.originalname == "test_vm_suite_passes"}
    batch = VMBatch([c for c in CASES if c.name in chosen], tmp_path_factory.mktemp("nvme-vm"), VM_PARALLEL)
    try:
        yield batch
    finally:
        batch.close()


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=pytest.mark.timeout(BATCH_TIMEOUT_S))
                                  for c in CASES])
def test_vm_suite_passes(case: VMCase, vm_batch: VMBatch) -> None:
    run = vm_batch.runs[case.name].result()
    print("".join(run.lines), end="")
    rc, lines, junit = run.rc, run.lines, run.junit
    print(f"[{case.name}] VM wall time {run.wall_s:.1f} s, exit status {rc}", flush=True)

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
