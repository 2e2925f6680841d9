"""The page-cache budget (Eq. 1-2) against real child memory cgroups, and the
cgroup discovery against fake cgroupfs trees for the layouts this host lacks.

The live tests create a child memory cgroup under our own (v1 on this hybrid
build machine, v2 where that is what charges us), put a worker process in it
that allocates real anonymous and shmem memory, and compare every term of
the breakdown with the kernel's own files.
"""

from __future__ import annotations

import os
import pathlib
import threading
from typing import Any

import pytest
from cgroup_util import ChildCgroup, Worker, read_stat
from hypothesis import given, settings
from hypothesis import strategies as st

from bladed.residency.budget import REACTION_S, Budgeter
from bladed.residency.cgroups import cgroup_from_path, locate_memory_cgroup, parse_mountinfo, parse_proc_cgroup

MiB = 1 << 20
GiB = 1 << 30


def kernel_usage(cg: ChildCgroup) -> int:
    """Everything charged to a cgroup, as the kernel counts it."""
    return int(pathlib.Path(cg.path, "memory.usage_in_bytes" if cg.version == "v1" else "memory.current").read_text())


def kernel_anon_shmem(cg: ChildCgroup) -> tuple[int, int]:
    """(anon, shmem) of a cgroup as its memory.stat says (hierarchical totals)."""
    s = read_stat(cg.path)
    if cg.version == "v1":
        return s["total_rss"], s["total_shmem"]
    return s["anon"], s["shmem"]


@pytest.fixture
def loaded_cgroup():
    """A 256 MiB child cgroup holding a worker with 48 MiB anon and 32 MiB shmem."""
    cg = ChildCgroup(limit_bytes=256 * MiB)
    w = Worker(cg)
    try:
        w.call("anon", nbytes=48 * MiB)
        w.call("shmem", nbytes=32 * MiB)
        yield cg, w
    finally:
        w.close()
        cg.remove()


# -- live cgroups ---------------------------------------------------------------------------

def test_own_cgroup_is_found_on_this_host() -> None:
    info = locate_memory_cgroup()
    text = pathlib.Path("/proc/self/cgroup").read_text()
    v1, _ = parse_proc_cgroup(text)
    if v1 is not None:
        # hybrid or v1: the v1 memory line decides even though a 0:: line exists
        assert info.version == "v1" and info.path.endswith(v1.rstrip("/"))
        assert os.path.exists(os.path.join(info.path, "memory.limit_in_bytes"))
    else:
        assert info.version in ("v2", "none")


@pytest.mark.root
def test_terms_match_the_kernel_files(loaded_cgroup: Any) -> None:
    cg, w = loaded_cgroup
    budgeter = Budgeter(copy_threads=2, pinned_per_thread_bytes=8 * MiB, pid=w.pid)
    before = kernel_anon_shmem(cg)
    b = budgeter.sample()
    after = kernel_anon_shmem(cg)
    assert before == after, "the idle worker's charges moved during the sample"
    anon, shmem = after
    assert b.cgroup == cg.path and b.cgroup_version == cg.version
    assert b.memory_limit_bytes == 256 * MiB and b.limited and b.memory_limit_source.startswith(cg.path)
    assert (b.anon_bytes, b.shmem_bytes) == (anon, shmem)
    assert b.anon_shmem_bytes == anon + shmem
    assert shmem >= 32 * MiB and anon >= 48 * MiB          # what the worker really holds
    # Eq. 1: the rest of what the kernel charged (slab, page tables, ...) is not the KV's either
    usage = kernel_usage(cg)
    s = read_stat(cg.path)
    file = s["total_cache"] - s["total_shmem"] if cg.version == "v1" else s["file"] - s["shmem"]
    assert abs(b.charged_kernel_bytes - (usage - anon - shmem - file)) <= MiB
    assert b.usable_bytes == min(b.host_available_bytes, 256 * MiB - anon - shmem - b.charged_kernel_bytes)
    assert b.binding == "cgroup"                                                        # 24 GiB host, 256 MiB limit
    assert b.pinned_bytes == 2 * 8 * MiB                                               # N_threads * M_pin; Eq. 2 below
    # the new session's staging is not touched yet: the worker's 32 MiB of shmem is not it
    assert b.pinned_uncharged_bytes == 2 * 8 * MiB
    assert b.pagecache_budget_bytes == b.usable_bytes - 2 * 8 * MiB == b.pagecache_budget_computed_bytes
    # the open sessions' staging that is shmem already is in M_anon+shmem: Eq. 2 does not subtract it again
    o = Budgeter(copy_threads=0, pinned_per_thread_bytes=0, pid=w.pid, pinned_elsewhere_bytes=16 * MiB).sample()
    assert o.pinned_uncharged_bytes == max(0, 16 * MiB - shmem) == 0 and o.pinned_bytes == 16 * MiB
    assert o.pagecache_budget_bytes == o.usable_bytes
    # the page cache's own kernel memory: B_pc * (1 + k) fits where B_pc did
    k = Budgeter(copy_threads=2, pinned_per_thread_bytes=8 * MiB, pid=w.pid, kernel_overhead=0.03,
                 pinned_elsewhere_bytes=128 * MiB).sample()
    assert k.pinned_uncharged_bytes == 2 * 8 * MiB + 128 * MiB - shmem
    assert k.pagecache_budget_bytes == int((k.usable_bytes - k.pinned_uncharged_bytes) / 1.03)
    # page cache (file, shmem excluded) is reported, not subtracted
    s = read_stat(cg.path)
    assert b.file_bytes == (s["total_cache"] - s["total_shmem"] if cg.version == "v1" else s["file"] - s["shmem"])


def kernel_mapped(cg: ChildCgroup) -> int:
    s = read_stat(cg.path)
    return s["total_mapped_file"] if cg.version == "v1" else s["file_mapped"]


@pytest.mark.root
def test_mapped_files_stay_resident_and_bladed_kv_does_not(loaded_cgroup: Any, tmp_path: pathlib.Path) -> None:
    """A file the cgroup's processes map (their code, weights they mmap) is kept out of the budget: Group 1
    would evict it and they would fault it back in.  bladed's own KV pages, mapped too, are not kept."""
    cg, w = loaded_cgroup
    w.call("map_file", path=str(tmp_path / "weights"), nbytes=24 * MiB)
    plain = Budgeter(copy_threads=0, pinned_per_thread_bytes=0, pid=w.pid).sample()
    mapped, (anon, shmem) = kernel_mapped(cg), kernel_anon_shmem(cg)
    assert mapped >= 24 * MiB + 32 * MiB          # the file and the worker's shmem, which the kernel counts too
    assert plain.file_mapped_bytes == mapped and plain.own_kv_bytes == 0
    assert plain.mapped_bytes == mapped - shmem >= 24 * MiB
    assert plain.usable_bytes == 256 * MiB - anon - shmem - plain.charged_kernel_bytes - plain.mapped_bytes
    # the same pages taken for bladed's KV (what the daemon measures of its own files): nothing is kept
    ours = Budgeter(copy_threads=0, pinned_per_thread_bytes=0, pid=w.pid, own_kv_bytes=lambda: 24 * MiB).sample()
    assert ours.own_kv_bytes == 24 * MiB and ours.mapped_bytes == max(0, mapped - shmem - 24 * MiB) < 4 * MiB
    assert ours.pagecache_budget_bytes - plain.pagecache_budget_bytes == plain.mapped_bytes - ours.mapped_bytes


@pytest.mark.root
def test_headroom_keeps_part_of_the_limit_free(loaded_cgroup: Any) -> None:
    _, w = loaded_cgroup
    full = Budgeter(copy_threads=1, pinned_per_thread_bytes=4 * MiB, pid=w.pid).sample()
    kept = Budgeter(copy_threads=1, pinned_per_thread_bytes=4 * MiB, pid=w.pid, headroom=0.05).sample()
    assert (full.free_bytes, full.headroom) == (0, 0.0)
    assert kept.free_bytes == int(0.05 * 256 * MiB) and kept.headroom == 0.05
    assert full.pagecache_budget_bytes - kept.pagecache_budget_bytes == kept.free_bytes + \
        (kept.anon_shmem_bytes - full.anon_shmem_bytes) + (kept.mapped_bytes - full.mapped_bytes) + \
        (kept.charged_kernel_bytes - full.charged_kernel_bytes)
    assert "M_free=13)" in kept.describe()          # 12.8 MiB
    # a rate: what a neighbour growing at 1 GiB/s takes while a demotion gets going, more than 2% of 256 MiB here
    fast = Budgeter(copy_threads=1, pinned_per_thread_bytes=4 * MiB, pid=w.pid, headroom=0.02,
                    absorb_rate=GiB).sample()
    assert fast.free_bytes == int(GiB * REACTION_S) > int(0.02 * 256 * MiB)
    assert full.pagecache_budget_bytes - fast.pagecache_budget_bytes >= fast.free_bytes - MiB
    # the floor is the KV's: staging (never demoted) is admitted against M* with the headroom alone
    assert fast.staging_usable_bytes - fast.usable_bytes == fast.free_bytes - int(0.02 * 256 * MiB)
    assert full.staging_usable_bytes == full.usable_bytes


@pytest.mark.root
def test_budget_follows_a_changed_limit(loaded_cgroup: Any) -> None:
    cg, _ = loaded_cgroup
    # 48 MiB of open sessions' staging, of which the worker's 32 MiB of shmem is charged already: 16 MiB
    # more is to come
    budgeter = Budgeter(copy_threads=0, pinned_per_thread_bytes=0, cgroup_path=cg.path,
                        pinned_elsewhere_bytes=48 * MiB)
    first = budgeter.sample()
    cg.set_limit(192 * MiB)
    second = budgeter.sample()
    anon, shmem = kernel_anon_shmem(cg)
    assert second.memory_limit_bytes == 192 * MiB
    assert second.pinned_uncharged_bytes == 48 * MiB - shmem
    assert second.pagecache_budget_bytes == \
        192 * MiB - anon - shmem - second.charged_kernel_bytes - (48 * MiB - shmem)
    assert first.pagecache_budget_bytes - second.pagecache_budget_bytes == \
        64 * MiB + (second.anon_shmem_bytes - first.anon_shmem_bytes) \
        + (second.charged_kernel_bytes - first.charged_kernel_bytes) \
        + (second.pinned_uncharged_bytes - first.pinned_uncharged_bytes)
    cg.set_limit(80 * MiB + 16 * MiB)          # at or below anon+shmem+staging: nothing left for the cache
    assert budgeter.sample().pagecache_budget_bytes == 0


@pytest.mark.root
def test_the_cgroup_with_the_least_room_binds(loaded_cgroup: Any) -> None:
    cg, w = loaded_cgroup                      # 256 MiB, the worker's 80 MiB charged there
    if cg.version == "v2":
        cg.release(w.pid)                      # v2 lets no process live in a cgroup that gives children memory
    inner = ChildCgroup(parent=cg)             # no limit of its own
    inner.add(w.pid)                           # its charges stay with the parent (the kernel does not move them)
    b = Budgeter(copy_threads=1, pinned_per_thread_bytes=0, pid=w.pid).sample()
    assert b.cgroup == inner.path and b.binding_cgroup == cg.path
    assert b.memory_limit_bytes == 256 * MiB and b.memory_limit_source.startswith(cg.path)
    inner.set_limit(512 * MiB)                 # looser than the parent: still the parent's
    b = Budgeter(copy_threads=1, pinned_per_thread_bytes=0, pid=w.pid).sample()
    assert (b.binding_cgroup, b.memory_limit_bytes) == (cg.path, 256 * MiB)
    assert [d["path"] for d in b.limits] == [inner.path, cg.path]
    # a smaller limit, but more room than the parent leaves: the parent still binds
    inner.set_limit(200 * MiB)
    b = Budgeter(copy_threads=1, pinned_per_thread_bytes=0, pid=w.pid).sample()
    assert b.binding_cgroup == cg.path and b.memory_limit_bytes == 256 * MiB
    inner.set_limit(150 * MiB)                 # 150 MiB with nothing charged against the parent's 256 - 80
    b = Budgeter(copy_threads=1, pinned_per_thread_bytes=0, pid=w.pid).sample()
    assert (b.binding_cgroup, b.memory_limit_bytes) == (inner.path, 150 * MiB)
    assert b.usable_bytes == min(d["room_bytes"] for d in b.limits)


@pytest.mark.root
def test_a_siblings_memory_counts_against_the_limit_they_share() -> None:
    """The limit is on the parent (a pod, a slice); the daemon's cgroup and a neighbour's are its children. What
    the neighbour takes comes off the daemon's budget, although none of it is charged to the daemon's cgroup."""
    with ChildCgroup(256 * MiB) as parent:
        mine, theirs = ChildCgroup(parent=parent), ChildCgroup(parent=parent)
        with Worker(mine) as me, Worker(theirs) as neighbour:
            before = Budgeter(copy_threads=0, pinned_per_thread_bytes=0, pid=me.pid).sample()
            neighbour.call("anon", nbytes=96 * MiB)
            after = Budgeter(copy_threads=0, pinned_per_thread_bytes=0, pid=me.pid).sample()
        assert (after.cgroup, after.binding_cgroup) == (mine.path, parent.path)
        assert after.memory_limit_bytes == 256 * MiB and after.limited
        # the parent's figures count the sibling: 96 MiB less for the KV
        assert after.anon_shmem_bytes - before.anon_shmem_bytes >= 96 * MiB
        assert before.pagecache_budget_bytes - after.pagecache_budget_bytes >= 96 * MiB
        # the daemon's own cgroup does not (what the budget ignored before issue 46)
        assert after.anon_bytes - before.anon_bytes < 8 * MiB
        assert "bound by " + parent.path in after.describe()


@pytest.mark.root
def test_override_and_cap(loaded_cgroup: Any) -> None:
    cg, _ = loaded_cgroup
    free = Budgeter(2, 8 * MiB, cgroup_path=cg.path).sample()
    fixed = Budgeter(2, 8 * MiB, override_bytes=1 * GiB, cgroup_path=cg.path).sample()
    assert fixed.pagecache_budget_bytes == GiB and fixed.override_bytes == GiB
    assert fixed.pagecache_budget_computed_bytes == free.pagecache_budget_computed_bytes
    capped = Budgeter(2, 8 * MiB, cap_bytes=10 * MiB, cgroup_path=cg.path).sample()
    assert capped.pagecache_budget_bytes == 10 * MiB and capped.cap_bytes == 10 * MiB
    loose = Budgeter(2, 8 * MiB, cap_bytes=10 * GiB, cgroup_path=cg.path).sample()
    assert loose.pagecache_budget_bytes == loose.pagecache_budget_computed_bytes
    assert "capped" in capped.describe() and "override" in fixed.describe()
    d = capped.to_dict()
    for key in ("host_available_bytes", "memory_limit_bytes", "anon_shmem_bytes", "usable_bytes", "copy_threads",
                "pinned_per_thread_bytes", "pinned_bytes", "pagecache_budget_bytes", "cgroup", "cgroup_version",
                "override_bytes", "cap_bytes", "sampled_at"):
        assert key in d


@pytest.mark.root
def test_thread_reports_a_limit_change(loaded_cgroup: Any) -> None:
    cg, _ = loaded_cgroup
    got: list[Any] = []
    changed = threading.Event()

    def on_change(b: Any) -> None:
        got.append(b)
        changed.set()

    budgeter = Budgeter(2, 8 * MiB, cgroup_path=cg.path, hysteresis_bytes=16 * MiB)
    budgeter.start(interval_s=0.05, on_change=on_change)
    try:
        start = budgeter.last
        assert start is not None
        cg.set_limit(160 * MiB)
        assert changed.wait(30), "the periodic sample did not report the new limit"
    finally:
        budgeter.stop()
    assert got[0].memory_limit_bytes == 160 * MiB
    assert got[0].pagecache_budget_bytes < start.pagecache_budget_bytes - 64 * MiB
    assert budgeter.stats["changes"] >= 1


@pytest.mark.root
def test_memory_pressure_wakes_the_sampler(loaded_cgroup: Any, tmp_path: pathlib.Path) -> None:
    cg, w = loaded_cgroup
    woke = threading.Event()
    budgeter = Budgeter(2, 8 * MiB, cgroup_path=cg.path, pressure_level="low")

    def on_sample(b: Any) -> None:
        if b.reason == "pressure":
            woke.set()

    budgeter.start(interval_s=600, on_sample=on_sample)     # the period alone would not fire
    try:
        assert any(s.startswith("v1-pressure-level") or s.startswith("psi:") for s in budgeter.sources)
        # push twice the limit through the page cache: reclaim in the cgroup
        w.call("write_file", path=str(tmp_path / "big"), nbytes=512 * MiB)
        assert woke.wait(30), f"no pressure event (sources: {budgeter.sources})"
    finally:
        budgeter.stop()
    assert budgeter.stats["pressure"] >= 1


@pytest.mark.root
def test_stop_is_idempotent_and_start_twice_fails(loaded_cgroup: Any) -> None:
    cg, _ = loaded_cgroup
    b = Budgeter(1, 0, cgroup_path=cg.path)
    b.stop()
    b.start(interval_s=10)
    if os.path.exists("/proc/pressure/memory"):
        # PSI triggers are armed (the kernel rejects windows that are not 2 s multiples without CAP_SYS_RESOURCE)
        assert any(s.startswith("psi:") for s in b.sources), b.sources
    if cg.version == "v1":
        assert any(s.startswith("v1-pressure-level:") for s in b.sources), b.sources
    with pytest.raises(RuntimeError):
        b.start(interval_s=10)
    b.stop()
    b.stop()


def test_bad_inputs() -> None:
    with pytest.raises(ProcessLookupError):
        Budgeter(1, 0, pid=2**22 + 12345)
    with pytest.raises(FileNotFoundError):
        Budgeter(1, 0, cgroup_path="/nonexistent/cgroup")
    with pytest.raises(ValueError):
        Budgeter(-1, 0)
    with pytest.raises(ValueError):
        Budgeter(1, 0, cap_bytes=-5)


# -- fake cgroupfs trees -----------------------------------------------------------------------

def _fake_tree(root: pathlib.Path, *, cgroup: str, mountinfo: str, files: dict[str, str],
               meminfo: str = "MemTotal: 16777216 kB\nAnonPages: 1048576 kB\nShmem: 65536 kB\n"
                              "Cached: 2097152 kB\n") -> pathlib.Path:
    proc = root / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "pressure").mkdir()
    (proc / "pressure" / "memory").write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "mountinfo").write_text(mountinfo)
    (proc / "meminfo").write_text(meminfo)
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return proc


def _v2_tree(root: pathlib.Path, *, leaf_max: str = "max", leaf_high: str = "max", parent_max: str = "max",
             parent_high: str = "max", anon: int = 100 * MiB, shmem: int = 20 * MiB,
             file: int = 300 * MiB) -> pathlib.Path:
    cg = root / "cg2"
    files = {
        "cg2/cgroup.procs": "", "cg2/cgroup.controllers": "cpu io memory pids\n",
        "cg2/system.slice/cgroup.procs": "", "cg2/system.slice/memory.max": parent_max + "\n",
        "cg2/system.slice/memory.high": parent_high + "\n",
        "cg2/system.slice/bladed.service/cgroup.procs": "1234\n",
        "cg2/system.slice/bladed.service/cgroup.controllers": "memory\n",
        "cg2/system.slice/bladed.service/memory.max": leaf_max + "\n",
        "cg2/system.slice/bladed.service/memory.high": leaf_high + "\n",
        "cg2/system.slice/bladed.service/memory.pressure": "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
        "cg2/system.slice/bladed.service/memory.stat":
            f"anon {anon}\nfile {file}\nkernel 4096000\nshmem {shmem}\nfile_mapped 0\n",
    }
    return _fake_tree(root, cgroup="0::/system.slice/bladed.service\n",
                      mountinfo=f"30 1 0:26 / {cg} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n", files=files)


def test_v2_parser_on_a_fake_tree(tmp_path: pathlib.Path) -> None:
    proc = _v2_tree(tmp_path, leaf_max="2147483648", parent_high="1610612736")
    info = locate_memory_cgroup(proc_root=str(proc))
    assert info.version == "v2" and info.path == str(tmp_path / "cg2/system.slice/bladed.service")
    assert info.pressure_file == os.path.join(info.path, "memory.pressure")
    b = Budgeter(2, 64 * MiB, proc_root=str(proc), mem_available=lambda: 8 * GiB,
                 mem_total=lambda: 16 * GiB).sample()
    assert b.cgroup_version == "v2"
    assert b.memory_limit_bytes == 1536 * MiB                              # parent's memory.high is the tightest
    assert b.memory_limit_source.endswith("system.slice/memory.high")
    assert b.anon_shmem_bytes == 120 * MiB                        # anon + shmem; file (which holds shmem) is not added
    assert b.file_bytes == 280 * MiB and b.kernel_bytes == 4096000
    assert b.usable_bytes == 1536 * MiB - 120 * MiB and b.binding == "cgroup"
    assert b.pagecache_budget_bytes == b.usable_bytes - 128 * MiB        # the new session's staging, untouched


def test_v2_unlimited_uses_host_memory(tmp_path: pathlib.Path) -> None:
    proc = _v2_tree(tmp_path)
    b = Budgeter(2, 64 * MiB, proc_root=str(proc), mem_available=lambda: 3 * GiB,
                 mem_total=lambda: 16 * GiB, headroom=0.02).sample()
    assert not b.limited and b.memory_limit_bytes == 16 * GiB and b.memory_limit_source == "host MemTotal"
    assert b.usable_bytes == 3 * GiB and b.binding == "host_available"
    assert b.free_bytes == 0          # no cgroup limit to stay off: MemAvailable already leaves the watermarks


def test_hybrid_fake_prefers_the_v1_memory_controller(tmp_path: pathlib.Path) -> None:
    v1 = tmp_path / "v1mem"
    files = {
        "v1mem/cgroup.procs": "", "v1mem/memory.limit_in_bytes": "9223372036854771712\n",
        "v1mem/app/cgroup.procs": "1\n", "v1mem/app/memory.limit_in_bytes": "1073741824\n",
        "v1mem/app/memory.stat": ("cache 209715200\nrss 104857600\nshmem 10485760\n"
                                  "hierarchical_memory_limit 1073741824\ntotal_cache 209715200\n"
                                  "total_rss 104857600\ntotal_shmem 10485760\n"),
        "unified/cgroup.procs": "", "unified/memory.pressure": "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
    }
    mountinfo = (f"25 20 0:22 / {tmp_path / 'unified'} rw - cgroup2 cgroup2 rw\n"
                 f"31 20 0:28 / {v1} rw - cgroup cgroup rw,memory\n"
                 f"32 20 0:29 / {tmp_path / 'cpu'} rw - cgroup cgroup rw,cpu,cpuacct\n")
    proc = _fake_tree(tmp_path, cgroup="5:cpu,cpuacct:/\n4:memory:/app\n0::/\n", mountinfo=mountinfo, files=files)
    info = locate_memory_cgroup(proc_root=str(proc))
    assert info.version == "v1" and info.path == str(v1 / "app")
    assert info.pressure_file == str(tmp_path / "unified" / "memory.pressure")   # PSI from the v2 hierarchy
    b = Budgeter(1, 0, proc_root=str(proc), mem_available=lambda: 8 * GiB, mem_total=lambda: 16 * GiB).sample()
    assert b.memory_limit_bytes == GiB and b.anon_shmem_bytes == 110 * MiB
    assert b.file_bytes == 190 * MiB                                     # cache holds shmem
    assert b.pagecache_budget_bytes == GiB - 110 * MiB


def test_host_without_memory_controller(tmp_path: pathlib.Path) -> None:
    files = {"cg2/cgroup.procs": "", "cg2/cgroup.controllers": "cpu io\n"}
    proc = _fake_tree(tmp_path, cgroup="0::/\n",
                      mountinfo=f"30 1 0:26 / {tmp_path / 'cg2'} rw - cgroup2 cgroup2 rw\n", files=files)
    b = Budgeter(1, 0, proc_root=str(proc), mem_available=lambda: 6 * GiB, mem_total=lambda: 16 * GiB).sample()
    assert b.cgroup_version == "none" and b.cgroup == ""
    assert b.anon_shmem_bytes == (1024 + 64) * MiB                # host AnonPages + Shmem
    assert b.pagecache_budget_bytes == 6 * GiB


def test_explicit_path_detection(tmp_path: pathlib.Path) -> None:
    proc = _v2_tree(tmp_path)
    info = cgroup_from_path(str(tmp_path / "cg2/system.slice/bladed.service"), proc_root=str(proc))
    assert info.version == "v2" and info.root == str(tmp_path / "cg2")
    assert info.ancestors() == [str(tmp_path / p) for p in
                                ("cg2/system.slice/bladed.service", "cg2/system.slice", "cg2")]
    with pytest.raises(ValueError, match="not a memory cgroup"):
        cgroup_from_path(str(tmp_path / "proc"))


def test_mountinfo_escapes_and_cgroup_lines() -> None:
    mounts = parse_mountinfo(
        "40 1 0:30 / /sys/fs/cgroup/my\\040mem rw - cgroup cgroup rw,memory\n"
        "41 1 0:31 / /proc rw - proc proc rw\n")
    assert len(mounts) == 1 and mounts[0].mountpoint == "/sys/fs/cgroup/my mem"
    assert parse_proc_cgroup("12:memory:/a/b\n0::/c\n") == ("/a/b", "/c")
    assert parse_proc_cgroup("0::/only/v2\n") == (None, "/only/v2")


@settings(max_examples=60, deadline=None)
@given(limit=st.integers(64 * MiB, 64 * GiB), anon=st.integers(0, 8 * GiB), shmem=st.integers(0, 2 * GiB),
       avail=st.integers(0, 32 * GiB), n=st.integers(0, 4), pin=st.integers(0, 512 * MiB),
       others=st.integers(0, 1 * GiB))
def test_formula_on_fake_v2(limit: int, anon: int, shmem: int, avail: int, n: int, pin: int, others: int) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        proc = _v2_tree(pathlib.Path(d), leaf_max=str(limit), anon=anon, shmem=shmem, file=shmem)
        b = Budgeter(n, pin, proc_root=str(proc), mem_available=lambda: avail,
                     mem_total=lambda: 128 * GiB, pinned_elsewhere_bytes=others).sample()
    m_star = min(avail, limit - anon - shmem)
    assert (b.memory_limit_bytes, b.anon_shmem_bytes, b.usable_bytes) == (limit, anon + shmem, m_star)
    # the new session's staging always counts; the open sessions' only beyond the shmem charged
    assert b.pagecache_budget_bytes == max(0, m_star - n * pin - max(0, others - shmem)) >= 0


def test_a_usage_that_sits_past_its_threshold_is_one_crossing_not_one_per_poll(tmp_path: pathlib.Path) -> None:
    """A cgroup at its limit, full of page cache, keeps its usage past the capped threshold: the watch reports that
    once (the sample that armed it saw it), then only a further MIN_STEP of growth, or a fall below and a rise
    again. Found on the build VM: a Dual-Blade session at its limit kept the budget's thread sampling every 2 ms,
    0.8 of a core."""
    from bladed.residency.watch import MIN_STEP, MemoryWatch

    usage = tmp_path / "memory.current"
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 0\n")
    path = str(tmp_path)

    def poll(at: int) -> bool:
        usage.write_text(f"{at}\n")
        return w.poll_crossed(float("inf"))          # always due

    limit_cap = 100 * MiB
    usage.write_text(f"{limit_cap + MiB}\n")
    w = MemoryWatch("v2", host_psi=None)
    try:
        w.arm({path: limit_cap}, {path: limit_cap + MiB})    # armed by a sample that saw the usage past it
        assert not poll(limit_cap + MiB) and not poll(limit_cap + MiB + MIN_STEP - 1)
        assert poll(limit_cap + MiB + MIN_STEP)              # it grew on
        assert not poll(limit_cap + MiB + MIN_STEP)
        assert not poll(limit_cap - MiB)                     # below, then past again: a crossing
        assert poll(limit_cap)
        w.arm({path: 120 * MiB}, {path: 110 * MiB})          # an ordinary threshold above the usage
        assert not poll(110 * MiB) and poll(120 * MiB)
    finally:
        w.close()
