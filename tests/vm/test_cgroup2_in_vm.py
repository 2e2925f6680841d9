"""The page-cache budget (paper Eq. 1-2, bladed/residency/budget.py) on a real
cgroup-v2-only kernel: Linux 6.12 booted with ``cgroup_no_v1=all``, systemd as
PID 1 owning the unified hierarchy (the VM of ``run-in-nvme-vm.sh --init
systemd``).  The build machine is a v1/v2 hybrid, where tests/test_budget.py
runs the same checks against the v1 memory controller.

The child cgroups are made in the delegated subtree of the harness's unit
(nvmevm-cmd.service, Delegate=yes; this process sits in its leaf ``cmd``): a
worker process in them holds real anonymous, shmem and page-cache memory, and
every term of the breakdown is compared with the kernel's own files.  The page
cache lives on ext4 on namespace 2, so it is reclaimable file memory.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from systemdvm import disk, run, systemd_problem

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cgroup_util import ChildCgroup, Worker, read_stat

from bladed.residency.budget import Budgeter
from bladed.residency.cgroups import locate_memory_cgroup

pytestmark = pytest.mark.systemd_vm

MiB = 1 << 20
STAT_KEYS = ("anon", "shmem", "file", "kernel", "file_mapped")


@pytest.fixture(scope="module", autouse=True)
def _systemd_vm() -> None:
    problem = systemd_problem()
    assert problem is None, problem


def own_cgroup() -> str:
    (line,) = Path("/proc/self/cgroup").read_text().splitlines()
    return "/sys/fs/cgroup" + line.split(":", 2)[2]


@pytest.fixture(scope="module")
def delegated() -> str:
    """The harness unit's cgroup: ours to make children in (this process is in its leaf ``cmd``)."""
    own = own_cgroup()
    assert os.path.basename(own) == "cmd", f"run-in-nvme-vm.sh puts the command in .../cmd, not {own}"
    return os.path.dirname(own)


@pytest.fixture
def worker_cgroup(delegated: str) -> Iterator[tuple[ChildCgroup, ChildCgroup, Worker]]:
    """outer (memory.max 320 MiB) / inner (memory.max 256 MiB, memory.high 192 MiB), a worker in inner
    holding 48 MiB anon, 32 MiB shmem and 24 MiB of page cache on ext4."""
    outer = ChildCgroup(320 * MiB, base=delegated)
    inner = ChildCgroup(256 * MiB, parent=outer)
    Path(inner.path, "memory.high").write_text(str(192 * MiB))
    w = Worker(inner)
    try:
        w.call("anon", nbytes=48 * MiB)
        w.call("shmem", nbytes=32 * MiB)
        w.call("write_file", path=os.path.join(disk(), f"cache-{w.pid}"), nbytes=24 * MiB)
        yield outer, inner, w
    finally:
        w.close()
        outer.remove()
        for f in Path(disk()).glob(f"*-{w.pid}"):
            f.unlink()


def test_the_kernel_has_cgroup_v2_only() -> None:
    assert "cgroup_no_v1=all" in Path("/proc/cmdline").read_text().split()
    # one line, the unified hierarchy's: no v1 controller charges this process
    assert [ln.split(":")[0] for ln in Path("/proc/self/cgroup").read_text().splitlines()] == ["0"]
    fstypes = [ln.split(" - ")[1].split()[0] for ln in Path("/proc/self/mountinfo").read_text().splitlines()]
    assert "cgroup2" in fstypes and "cgroup" not in fstypes
    os.makedirs("/tmp/v1-memory", exist_ok=True)
    refused = run("mount", "-t", "cgroup", "-o", "memory", "cgroup", "/tmp/v1-memory", check=False)
    assert refused.returncode != 0, "the kernel mounted a v1 memory hierarchy"



def test_a_cgroup_without_the_memory_controller_is_charged_to_its_ancestor(delegated: str) -> None:
    own = own_cgroup()
    # the harness's unit gets the memory controller from systemd, its leaf "cmd" does not
    assert "memory" in Path(delegated, "cgroup.controllers").read_text().split()
    assert "memory" not in Path(own, "cgroup.controllers").read_text().split()
    info = locate_memory_cgroup()
    assert (info.version, info.path, info.root) == ("v2", delegated, "/sys/fs/cgroup")
    assert info.pressure_file == os.path.join(own, "memory.pressure")
    b = Budgeter(copy_threads=0, pinned_per_thread_bytes=0).sample()
    assert (b.cgroup, b.cgroup_version) == (delegated, "v2") and b.anon_bytes > 0


def test_every_budget_term_matches_the_kernel_files(worker_cgroup: Any) -> None:
    _outer, inner, w = worker_cgroup
    budgeter = Budgeter(copy_threads=2, pinned_per_thread_bytes=8 * MiB, pid=w.pid)
    # v2 folds per-CPU counter updates into memory.stat lazily (at most 2 s late): take a sample
    # between two reads of the kernel's file that agree
    for _ in range(5):
        before = read_stat(inner.path)
        b = budgeter.sample()
        s = read_stat(inner.path)
        if all(before[k] == s[k] for k in STAT_KEYS):
            break
    else:
        pytest.fail(f"memory.stat of the idle worker's cgroup kept changing: {before} -> {s}")
    assert (b.cgroup, b.cgroup_version) == (inner.path, "v2")
    # M_max: the smallest of memory.max and memory.high over the cgroup and its ancestors
    assert b.memory_limit_bytes == 192 * MiB and b.limited
    assert b.memory_limit_source == os.path.join(inner.path, "memory.high")
    assert (b.anon_bytes, b.shmem_bytes) == (s["anon"], s["shmem"]) and b.anon_shmem_bytes == s["anon"] + s["shmem"]
    assert s["anon"] >= 48 * MiB and s["shmem"] >= 32 * MiB
    # v2's "file" includes shmem; the page cache bladed compares with B_pc excludes it
    assert b.file_bytes == s["file"] - s["shmem"] and b.file_bytes >= 20 * MiB
    assert b.kernel_bytes == s["kernel"]
    meminfo = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()}
    assert b.host_total_bytes == meminfo["MemTotal"]
    # the page cache the worker maps (v2's file_mapped counts its shmem too) stays out of the budget
    assert b.file_mapped_bytes == s["file_mapped"] and b.mapped_bytes == max(0, s["file_mapped"] - s["shmem"])
    assert b.free_bytes == 0                                                            # no headroom asked
    # the kernel's other charges (slab, page tables, ...): what memory.current has beyond anon and file
    current = int(Path(inner.path, "memory.current").read_text())
    assert abs(b.charged_kernel_bytes - (current - s["anon"] - s["file"])) <= MiB
    assert b.usable_bytes == min(b.host_available_bytes, 192 * MiB - b.anon_shmem_bytes - b.charged_kernel_bytes
                                 - b.mapped_bytes)                                      # Eq. 1
    assert b.binding_cgroup == inner.path and [d["path"] for d in b.limits] == [inner.path, _outer.path]
    assert b.binding == "cgroup"                                                        # 2 GiB guest
    assert b.pagecache_budget_bytes == max(0, b.usable_bytes - 2 * 8 * MiB) == b.pagecache_budget_computed_bytes


def test_the_smallest_limit_wins_and_changes_are_followed(worker_cgroup: Any) -> None:
    outer, inner, w = worker_cgroup
    budgeter = Budgeter(copy_threads=1, pinned_per_thread_bytes=0, pid=w.pid)
    Path(inner.path, "memory.high").write_text("max")
    b = budgeter.sample()
    assert b.memory_limit_bytes == 256 * MiB and b.memory_limit_source == os.path.join(inner.path, "memory.max")
    inner.set_limit(None)
    b = budgeter.sample()
    assert b.memory_limit_bytes == 320 * MiB and b.memory_limit_source == os.path.join(outer.path, "memory.max")
    Path(outer.path, "memory.high").write_text(str(160 * MiB))
    b = budgeter.sample()
    assert b.memory_limit_bytes == 160 * MiB and b.memory_limit_source == os.path.join(outer.path, "memory.high")
    outer.set_limit(None)
    Path(outer.path, "memory.high").write_text("max")
    b = budgeter.sample()
    # no limit on the way up to the delegated unit: the guest's memory (the unit sets none either)
    assert not b.limited and b.memory_limit_bytes == b.host_total_bytes and b.memory_limit_source == "host MemTotal"


def test_a_psi_event_wakes_the_sampler(worker_cgroup: Any) -> None:
    _outer, inner, w = worker_cgroup
    woke = threading.Event()

    def on_sample(b: Any) -> None:
        if b.reason == "pressure":
            woke.set()

    budgeter = Budgeter(2, 8 * MiB, cgroup_path=inner.path)
    budgeter.start(interval_s=3600, on_sample=on_sample)      # the period alone would never fire
    grower = threading.Thread(target=w.call, args=("anon",), kwargs={"nbytes": 64 * MiB})
    try:
        # the cgroup's own PSI trigger (and the host's), its memory.events and its usage, and no v1 source
        sources = budgeter.sources
        assert f"psi:{inner.path}/memory.pressure" in sources and f"v2-events:{inner.path}" in sources, sources
        assert f"poll:{inner.path}" in sources and not any(x.startswith("v1-") for x in sources), sources
        # memory.high below what the worker is about to hold: with no swap, reclaim cannot bring it
        # back, and the kernel throttles the worker (memory stall) until memory.high is lifted
        Path(inner.path, "memory.high").write_text(str(128 * MiB))
        grower.start()
        assert woke.wait(120), "no PSI event woke the sampler"
    finally:
        Path(inner.path, "memory.high").write_text("max")
        if grower.is_alive():
            grower.join(120)
        budgeter.stop()
    assert budgeter.stats["pressure"] >= 1
    some = Path(inner.path, "memory.pressure").read_text().split("\n")[0]
    assert some.startswith("some ") and int(some.rsplit("total=", 1)[1]) > 0
