"""The page-cache path: mmap'd KPU files, cachestat hit ratios, proactive drops,
and the thrashing collapse that Dual-Blade avoids (paper §III-A, §V-C).

The collapse test runs a real prefill + decode loop in a worker process inside
a child memory cgroup whose limit is smaller than the KV set: ``baseline``
puts every KPU on the page-cache path, ``dualblade`` only the Group 1 that its
budget (measured by the Budgeter on that very cgroup) admits, with Group 2 on
an O_DIRECT extent through the real engine.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Any

import numpy as np
import pytest
from cgroup_util import ChildCgroup, Worker

from bladed.io import Engine, StagingBuffer, TargetRangeError
from bladed.io.errors import BladedIOError
from bladed.io.file import FileDevice
from bladed.io.pagecache import PageCacheStore, cachestat
from bladed.residency import Budgeter, ExtentAllocator, ExtentMap, Geometry, KVPath, Mode, plan_session
from bladed.sizes import PAGE_SIZE

MiB = 1 << 20


@pytest.fixture
def store(store_dir: str):
    s = PageCacheStore(os.path.join(store_dir, "pc"))
    yield s
    s.close()


def _pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


# -- the file, its copies and its measurements -------------------------------------------

def test_file_is_materialized_on_first_access_and_round_trips(store: PageCacheStore) -> None:
    f = store.open("s1-k0", 3 * MiB + 100)
    assert not f.materialized and not os.path.exists(f.path)
    assert f.residency() == 0.0                      # a bound file holds nothing yet
    src = _pattern(f.nbytes, 1)
    f.write_from(src, 0, f.nbytes)
    assert f.materialized and os.path.getsize(f.path) == f.nbytes
    dst = StagingBuffer(4 * MiB)
    ratio = f.read_into(dst, 0, f.nbytes)
    assert ratio == 1.0                               # just written: every page is cached
    assert np.array_equal(np.frombuffer(dst.view(0, f.nbytes), np.uint8), src)
    dst.close()


def test_offsets_inside_a_file_and_into_a_buffer(store: PageCacheStore) -> None:
    f = store.open("v3", 1 * MiB)
    token = 4096
    for t in range(256):                              # one-token appends, as in decode
        f.write_from(bytes([t]) * token, t * token, token)
    out = bytearray(3 * token + 10)
    f.read_into(out, 100 * token, 3 * token, dst_offset=10)
    assert out[10:] == bytes([100]) * token + bytes([101]) * token + bytes([102]) * token
    with pytest.raises(TargetRangeError):
        f.read_into(out, MiB - token, 2 * token)
    with pytest.raises(ValueError, match="outside"):
        f.read_into(out, 0, len(out) + 1)


def test_copy_is_one_memmove_not_a_python_loop(store: PageCacheStore, monkeypatch: pytest.MonkeyPatch) -> None:
    # a read is one memmove out of the mapping, whatever its size (no per-page Python loop)
    f = store.open("big", 32 * MiB)
    data = _pattern(32 * MiB, 2)
    f.write_from(data, 0, 32 * MiB)
    dst = StagingBuffer(32 * MiB)
    calls: list[int] = []
    real = ctypes.memmove

    def counted(d: Any, s: Any, n: int) -> Any:
        calls.append(n)
        return real(d, s, n)

    monkeypatch.setattr(ctypes, "memmove", counted)
    f.read_into(dst, 0, 32 * MiB)
    monkeypatch.undo()
    assert calls == [32 * MiB]
    assert np.array_equal(np.frombuffer(dst.view(0, 32 * MiB), np.uint8), data)
    dst.close()


def _write_syscalls() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("syscw:"))


def test_writes_go_to_the_page_cache_in_64_kib_pieces(store: PageCacheStore) -> None:
    """A KPU written whole is many pwrites of at most BD_PAGECACHE_WRITE_CHUNK, each ending on a multiple of it,
    so the kernel makes small page-cache folios (docs/benchmarks.md: in a VM whose free memory goes back to the
    host, fresh 2 MiB folios cost 1.4x to first touch); the bytes are the same."""
    from bladed._uring import lib

    chunk = lib.BD_PAGECACHE_WRITE_CHUNK
    assert chunk == 64 << 10
    f = store.open("chunked", 4 * MiB)
    data = _pattern(4 * MiB, 7)
    before = _write_syscalls()
    f.write_from(data, 0, 4 * MiB)
    assert _write_syscalls() - before == 4 * MiB // chunk
    before = _write_syscalls()
    f.write_from(data[100:chunk + 200], 100, chunk + 100)      # [100, 64 KiB + 200): to the boundary, then past it
    assert _write_syscalls() - before == 2
    out = bytearray(4 * MiB)
    f.read_into(out, 0, 4 * MiB)
    assert bytes(out) == data.tobytes()


def test_hit_ratio_is_measured_on_the_exact_range_before_the_copy(store: PageCacheStore) -> None:
    f = store.open("k1", 8 * MiB)
    f.write_from(_pattern(8 * MiB, 3), 0, 8 * MiB)
    f.drop(0, 4 * MiB)                               # evict the first half only
    assert f.residency(0, 4 * MiB) == 0.0
    assert f.residency(4 * MiB, 4 * MiB) == 1.0
    buf = StagingBuffer(8 * MiB)
    assert f.read_into(buf, 2 * MiB, 4 * MiB) == pytest.approx(0.5)   # half cold, half warm
    assert f.read_into(buf, 2 * MiB, 4 * MiB) == 1.0                  # the copy brought it in
    st = store.stats()
    assert st["bytes_read"] == 8 * MiB and st["bytes_hit"] == 6 * MiB
    assert store.hit_fraction == pytest.approx(0.75)
    buf.close()


def test_cachestat_agrees_with_mincore(store: PageCacheStore, monkeypatch: pytest.MonkeyPatch) -> None:
    f = store.open("k2", 8 * MiB)
    f.write_from(_pattern(8 * MiB, 4), 0, 8 * MiB)
    # buffered writes may make large folios (up to 2 MiB with 4 KiB pages): drop a whole, aligned 2 MiB so
    # that exactly that range goes
    f.drop(2 * MiB, 2 * MiB)
    cs = cachestat(f.fd, 0, 8 * MiB)
    assert cs is not None, "kernel 6.5+ expected on the build machine"
    assert cs.cache == 6 * MiB // PAGE_SIZE          # 6 of 8 MiB, in the kernel's pages
    assert f._mincore(0, 8 * MiB) == cs.cache       # the fallback counts the same pages
    # on a kernel without cachestat(2) the reads are measured with mincore(2)
    import bladed.io.pagecache as pc

    monkeypatch.setattr(pc, "_cachestat_ok", False)
    assert cachestat(f.fd, 0, 8 * MiB) is None
    assert f.residency(0, 8 * MiB) == 0.75
    buf = bytearray(4 * MiB)
    assert f.read_into(buf, MiB, 4 * MiB) == 0.5


def test_cached_bytes_counts_what_the_kv_files_hold_now(store: PageCacheStore,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """What the budget subtracts from the cgroup's mapped page cache as bladed's own (Eq. 1's M_kv)."""
    a, b = store.open("held-a", 8 * MiB), store.open("held-b", 8 * MiB)
    assert store.cached_bytes() == 0                  # neither is materialized: no page of them is ours yet
    a.write_from(_pattern(4 * MiB, 6), 0, 4 * MiB)
    b.write_from(_pattern(8 * MiB, 7), 0, 8 * MiB)
    b.drop(0, 2 * MiB)                                # a whole, aligned 2 MiB (large folios)
    assert (a.cached_bytes(), b.cached_bytes()) == (4 * MiB, 6 * MiB)
    assert store.cached_bytes() == 10 * MiB
    import bladed.io.pagecache as pc

    monkeypatch.setattr(pc, "_cachestat_ok", False)   # kernels before 6.5: mincore(2) of the mapping
    assert store.cached_bytes() == 10 * MiB
    b.close()
    assert b.cached_bytes() == 0 and store.cached_bytes() == 4 * MiB


def test_drop_evicts_dirty_and_mapped_pages(store: PageCacheStore) -> None:
    # pages just written are dirty, and once read they are mapped too: plain fadvise would keep them
    f = store.open("dirty", 16 * MiB)
    data = _pattern(16 * MiB, 5)
    f.write_from(data, 0, 16 * MiB)
    assert f.read_into(bytearray(16 * MiB), 0, 16 * MiB) == 1.0
    cs = cachestat(f.fd, 0, 16 * MiB)
    assert cs is not None and cs.cache == cs.dirty == 16 * MiB // PAGE_SIZE
    f.drop()
    cs = cachestat(f.fd, 0, 16 * MiB)
    assert cs is not None and cs.cache == 0 and cs.dirty == 0
    buf = StagingBuffer(16 * MiB)
    assert f.read_into(buf, 0, 16 * MiB) == 0.0
    assert np.array_equal(np.frombuffer(buf.view(), np.uint8), data)   # written back before eviction
    buf.close()


def test_parallel_copies_from_threads(store: PageCacheStore) -> None:
    files = [store.open(f"t{i}", 4 * MiB) for i in range(4)]
    for i, f in enumerate(files):
        f.write_from(bytes([i + 1]) * (4 * MiB), 0, 4 * MiB)
    errors: list[BaseException] = []

    def reader(f: Any, want: int) -> None:
        try:
            buf = bytearray(4 * MiB)
            for _ in range(10):
                f.read_into(buf, 0, 4 * MiB)
                assert buf == bytes([want]) * (4 * MiB)
        except BaseException as e:
            errors.append(e)

    ts = [threading.Thread(target=reader, args=(f, i + 1)) for i, f in enumerate(files)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    assert store.stats()["reads"] == 40 and store.stats()["bytes_read"] == 40 * 4 * MiB


def test_close_waits_for_copies_in_other_threads(store: PageCacheStore) -> None:
    f = store.open("busy", 8 * MiB)
    f.write_from(bytes(8 * MiB), 0, 8 * MiB)
    started = [threading.Event() for _ in range(3)]
    outcome: list[BaseException | None] = [None] * 3

    def reader(i: int) -> None:
        buf = bytearray(8 * MiB)
        try:
            while True:
                f.read_into(buf, 0, 8 * MiB)
                started[i].set()
        except BaseException as e:
            outcome[i] = e
            started[i].set()

    ts = [threading.Thread(target=reader, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for i, e in enumerate(started):
        assert e.wait(60), f"reader {i} neither read nor failed within 60 s"
    f.close()                                    # must not unmap under a running memmove (that would segfault)
    for t in ts:
        t.join()
    assert all(isinstance(e, BladedIOError) and "closed" in str(e) for e in outcome), outcome
    with pytest.raises(BladedIOError, match="closed"):
        f.write_from(b"x", 0, 1)


def _io(field: str) -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def test_closing_a_written_file_drops_its_kv_without_writing_it_to_disk(store: PageCacheStore) -> None:
    """The KV of a closed session (or of a KPU moved to the extent) goes with its file: the kernel cancels its
    dirty pages (``cancelled_write_bytes``: fadvise(DONTNEED), used before, wrote them all back first)."""
    f = store.open("gone", 64 * MiB)
    f.write_from(_pattern(64 * MiB, 5), 0, 64 * MiB)
    cs = cachestat(f.fd, 0, 64 * MiB)
    assert cs is None or cs.dirty > 0                 # dirty KV in the page cache, as right after a prefill
    cancelled = _io("cancelled_write_bytes")
    f.close()
    assert not os.path.exists(f.path)
    assert _io("cancelled_write_bytes") - cancelled >= 56 * MiB


def test_store_lock_cleanup_and_close(store_dir: str) -> None:
    d = os.path.join(store_dir, "pc2")
    s = PageCacheStore(d)
    f = s.open("s9-v1", MiB)
    f.write_from(b"x" * 4096, 0, 4096)
    with pytest.raises(BladedIOError, match="in use"):
        PageCacheStore(d)                             # one daemon per directory
    with pytest.raises(FileExistsError):
        s.open("s9-v1", MiB)
    with pytest.raises(ValueError, match="invalid"):
        s.open("../etc/passwd", MiB)
    f.close(unlink=False)                              # as if the daemon had crashed
    s.close()
    assert os.path.exists(os.path.join(d, "s9-v1.kv"))
    s2 = PageCacheStore(d)                             # the next run removes the stale file
    assert s2.stale_removed == 1 and not os.path.exists(os.path.join(d, "s9-v1.kv"))
    g = s2.open("a", MiB)
    g.write_from(b"y" * 10, 0, 10)
    s2.close()                                         # closes and removes its files
    assert not os.path.exists(g.path)


# -- the collapse (paper Fig. 3 / Fig. 11) ---------------------------------------------------

GEOMETRY = {"layers": 12, "batch": 1, "kv_heads": 16, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 2048}
PROMPT = 2000
STEPS = 6


def warm_up() -> int:
    """Import what the workload needs, so its memory is charged before the budget is sampled."""
    import bladed.io.pagecache
    import bladed.residency  # noqa: F401

    return os.getpid()


def decode_workload(directory: str, store_path: str, mode: str, budget: int, prompt: int, steps: int,
                    geometry: dict[str, int], ranker: str = "layer-order") -> dict[str, Any]:
    """Prefill ``prompt`` tokens into every KPU, then ``steps`` decode steps (read all, append one).

    Runs inside the worker (in the limited cgroup).  Returns the page-cache
    hit fractions of the decode reads, per group.
    """
    geo = Geometry(**geometry)
    plan = plan_session(geo, mode, budget, 4096, ranker)
    tb = geo.token_bytes
    rows = (geo.batch * geo.kv_heads, geo.head_dim)
    store = PageCacheStore(directory)
    files = {k.tensor_id: store.open(k.name, k.nbytes) for k in plan.pagecache_kpus()}
    staging = StagingBuffer(geo.kpu_bytes)               # M_pin: one KPU
    dev = engine = emap = None
    if plan.direct_kpus():
        dev = FileDevice(store_path, (2048 + plan.extent_blocks) * 4096)
        alloc = ExtentAllocator(2048, plan.extent_blocks)
        emap = ExtentMap(plan, alloc.allocate(plan.extent_blocks, owner="s1"))
        engine = Engine(dev, 32, [staging])
    view = np.frombuffer(staging.view(), np.uint8)
    read = {1: 0, 2: 0}
    hit = {1: 0.0, 2: 0.0}
    direct_read = 0
    ok = True

    def write(k: Any, t0: int, n: int) -> None:
        for t in range(n):
            view[t * tb:(t + 1) * tb] = (k.tensor_id * 31 + t0 + t) & 0xFF
        if k.path is KVPath.PAGECACHE:
            files[k.tensor_id].write_from(staging, t0 * tb, n * tb)
            if k.drop_after_use:
                files[k.tensor_id].drop(t0 * tb, n * tb)
        else:
            assert emap is not None and engine is not None
            slba, req = emap.translate(k.tensor_id, geo.shape, (t0, 0, 0), (n, *rows), geo.dtype_bytes)
            engine.write(slba, staging, nbytes=req)

    for k in plan.kpus:                                   # prefill: the whole prompt
        write(k, 0, prompt)
    t_decode = time.perf_counter()
    for step in range(steps):                             # decode
        t = prompt + step
        for k in plan.kpus:
            if k.path is KVPath.PAGECACHE:
                f = files[k.tensor_id]
                hit[k.group] += f.read_into(staging, 0, t * tb) * t * tb
                read[k.group] += t * tb
                if k.drop_after_use:
                    f.drop(0, t * tb)
            else:
                assert emap is not None and engine is not None
                slba, req = emap.translate(k.tensor_id, geo.shape, (0, 0, 0), (t, *rows), geo.dtype_bytes)
                engine.read(slba, staging, nbytes=req)
                direct_read += t * tb
            ok = ok and int(view[(t - 1) * tb]) == (k.tensor_id * 31 + t - 1) & 0xFF
            write(k, t, 1)
    t_decode = time.perf_counter() - t_decode
    if engine is not None:
        engine.close()
    if dev is not None:
        dev.close()
    store.close()
    staging.close()
    return {
        "group1_layers": plan.group1_layers,
        "resident_kpus": len(plan.group1()),
        "group1_bytes": plan.group1_bytes,
        "group1": hit[1] / read[1] if read[1] else None,
        "group2_pagecache": hit[2] / read[2] if read[2] else None,
        # the paper's figure: read bytes served from the page cache over all read bytes
        "overall": (hit[1] + hit[2]) / (read[1] + read[2] + direct_read),
        "decode_s": t_decode,
        "data_ok": ok,
    }


@pytest.fixture
def limited_worker():
    geo = Geometry(**GEOMETRY)
    cg = ChildCgroup(limit_bytes=geo.kv_bytes * 2 // 3)     # 128 MiB for a 192 MiB KV set
    w = Worker(cg)
    try:
        w.call("call", target="test_pagecache:warm_up", kwargs={})
        yield cg, w, geo
    finally:
        w.close()
        cg.remove()


@pytest.mark.root
@pytest.mark.slow
def test_dualblade_keeps_group1_resident_where_baseline_collapses(limited_worker: Any, store_dir: str) -> None:
    cg, w, geo = limited_worker
    s = geo.kpu_bytes
    # Set the limit so that B_pc comes out at 11.5 KPUs: 5 whole layers for Algorithm 1,
    # half a pair of remainder for the kpu-fill ranker.  KV set 192 MiB, limit about 125 MiB.
    stat = cg.stat()
    anon_shmem = stat["total_rss"] + stat["total_shmem"] if cg.version == "v1" else stat["anon"] + stat["shmem"]
    cg.set_limit(anon_shmem + 2 * s + 11 * s + s // 2)
    # the budget of the worker's cgroup, exactly as the daemon computes its own
    b = Budgeter(copy_threads=2, pinned_per_thread_bytes=s, pid=w.pid).sample()
    assert b.cgroup == cg.path and b.limited and b.memory_limit_bytes == cg.limit()
    assert 0 < b.pagecache_budget_bytes < geo.kv_bytes
    args = {"prompt": PROMPT, "steps": STEPS, "geometry": GEOMETRY, "budget": b.pagecache_budget_bytes}
    runs = {"baseline": (Mode.BASELINE, "layer-order"), "dualblade": (Mode.DUALBLADE, "layer-order"),
            "cachepolicy": (Mode.CACHEPOLICY, "layer-order"), "dualblade+kpu-fill": (Mode.DUALBLADE, "kpu-fill")}
    results = {}
    for i, (label, (mode, ranker)) in enumerate(runs.items()):
        results[label] = w.call("call", target="test_pagecache:decode_workload",
                                kwargs={**args, "mode": mode.value, "ranker": ranker,
                                        "directory": os.path.join(store_dir, f"pc{i}"),
                                        "store_path": os.path.join(store_dir, f"direct{i}.img")})
    print(f"\npage-cache hit fraction of decode reads (limit {cg.limit() // MiB} MiB, "
          f"KV {geo.kv_bytes // MiB} MiB, B_pc {b.pagecache_budget_bytes // MiB} MiB):")
    for label, r in results.items():
        print(f"  {label:20s} group1_layers={r['group1_layers']:2d} kpus={r['resident_kpus']:2d} group1={r['group1']} "
              f"group2(pc)={r['group2_pagecache']} overall={r['overall']:.3f} decode={r['decode_s']:.2f}s")
    base, dual, cpol = results["baseline"], results["dualblade"], results["cachepolicy"]
    fill = results["dualblade+kpu-fill"]
    assert all(r["data_ok"] for r in results.values())
    # Dual-Blade: Group 1 fits the budget and stays resident through decode
    assert dual["group1_layers"] >= 2 and dual["group1"] >= 0.97
    assert dual["overall"] == pytest.approx(dual["group1_layers"] / geo.layers, abs=0.03)
    # Baseline: the cyclic re-read of a working set larger than the cache thrashes
    assert base["overall"] <= 0.2
    assert dual["overall"] > base["overall"] + 0.2
    # CachePolicy-Only: Group 1 resident too; Group 2 dropped after each use, so it never hits
    assert cpol["group1"] >= 0.97 and cpol["group2_pagecache"] <= 0.05
    # the kpu-fill ranker spends the remainder of X on one more KPU, which stays resident as well
    assert dual["resident_kpus"] == 10 and fill["resident_kpus"] == 11
    assert fill["group1"] >= 0.97 and fill["overall"] > dual["overall"] + 0.03
