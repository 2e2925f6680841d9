"""Overlap-intra / overlap-cross scheduling and the adaptive selector (Dual-Blade §IV-C)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from runner_util import CONFIGS, ModelledPath, ThrottledKV, assert_same, hf_model, prompt, run, runner_model

from bladed.pipeline import AdaptivePipeline, CopyThreadPool, LoadJob


def _trace_load(strategy: str) -> dict[str, int]:
    pool = CopyThreadPool(2)
    pipe = AdaptivePipeline(pool, strategy)  # type: ignore[arg-type]
    t: dict[str, int] = {}
    barrier = threading.Barrier(2)
    dma_active = [0]

    def job(i: int) -> LoadJob:
        def rd() -> None:
            t[f"r{i}s"] = time.perf_counter_ns()
            if strategy == "intra":
                barrier.wait(timeout=10)  # both reads in flight at once, or this times out
            t[f"r{i}e"] = time.perf_counter_ns()

        def dma() -> int:
            dma_active[0] += 1
            assert dma_active[0] == 1, "two DMAs at once"
            t[f"d{i}s"] = time.perf_counter_ns()
            x = torch.ones(1 << 16).sum()  # some real copy-engine work
            t[f"d{i}e"] = time.perf_counter_ns()
            dma_active[0] -= 1
            return int(x)

        return LoadJob(read=rd, dma=dma, nbytes=1)

    h = pipe.load([job(0), job(1)], group=1)
    assert h.result() == [1 << 16, 1 << 16]
    pool.close()
    return t


def test_overlap_intra_reads_in_parallel_with_serial_dma() -> None:
    t = _trace_load("intra")
    assert t["r0s"] < t["r1e"] and t["r1s"] < t["r0e"]  # the reads overlapped
    assert t["d0e"] <= t["d1s"] or t["d1e"] <= t["d0s"]  # the DMAs did not


def test_overlap_cross_staggers_the_second_read_behind_the_first() -> None:
    t = _trace_load("cross")
    assert t["r1s"] >= t["r0e"]


def test_off_runs_read_dma_read_dma() -> None:
    t = _trace_load("off")
    assert t["r0e"] <= t["d0s"] and t["d0e"] <= t["r1s"] and t["r1e"] <= t["d1s"]


def test_cpu_copies_of_one_load_run_at_once_when_the_dma_is_not_exclusive() -> None:
    """A sparse layer's K and V gathers on the CPU (``exclusive_dma=False``): both copies in flight together, each
    waiting for the other inside its DMA, which one DMA at a time would never let happen (the barrier breaks)."""
    pool = CopyThreadPool(2)
    pipe = AdaptivePipeline(pool, "intra")
    inside = threading.Barrier(2)
    wait_s = [10.0]

    def job(i: int) -> LoadJob:
        def dma() -> int:
            inside.wait(timeout=wait_s[0])
            return i

        return LoadJob(read=lambda: None, dma=dma, nbytes=1)

    try:
        assert pipe.load([job(0), job(1)], group=1, exclusive_dma=False).result() == [0, 1]
        inside.reset()
        wait_s[0] = 0.5      # under the lock the other DMA cannot start however long this waits
        with pytest.raises(threading.BrokenBarrierError):
            pipe.load([job(0), job(1)], group=1).result()     # the default: one DMA at a time
    finally:
        pool.close()


def test_copy_thread_owns_its_slot_index() -> None:
    pool = CopyThreadPool(2)
    idents = [pool.submit(ch, threading.get_ident).result() for ch in (0, 1, 0, 1)]
    pool.close()
    assert idents[0] == idents[2] != idents[1] == idents[3]


@pytest.fixture(scope="module")
def llama() -> tuple:
    cfg = CONFIGS["llama-gqa"]
    hf = hf_model(cfg, torch.float32)
    model = runner_model(hf)
    ids = prompt(cfg, 2, 8)
    ref = run(model, ids, 5, cache_gpu_percent=100)  # KV never leaves memory
    return model, ids, ref


@pytest.mark.parametrize("contended", [1, 2])
def test_adaptive_picks_the_faster_strategy_per_group(llama: tuple, contended: int) -> None:
    """A saturated path (concurrent reads thrash) should go overlap-cross; a path with independent
    queues overlap-intra, for each group separately, and the output stays exact."""
    model, ids, ref = llama
    g = model.cfg
    read_bytes = 2 * g.num_kv_heads * g.head_dim * 4 * 10  # one K or V read of ~10 tokens
    ns_per_byte = 16e6 / read_bytes  # ~16 ms per read: well above the copy threads' own overhead under load
    paths = {contended: ModelledPath(ns_per_byte, shared=True, contention=4.0),
             3 - contended: ModelledPath(ns_per_byte, shared=False)}

    res = run(model, ids, 5, factory=lambda geo: ThrottledKV(geo, paths, group1_layers=2), pipeline="adaptive")
    assert res.pipeline["decision"] == {str(contended): "cross", str(3 - contended): "intra"}
    for grp in ("1", "2"):
        assert res.pipeline["intra_GBps"][grp] > 0 and res.pipeline["cross_GBps"][grp] > 0
    assert_same(res, ref)


def test_adaptive_trial_alternates_layers_and_decides_after_one_iteration() -> None:
    """Iteration 2 loads a group's layers alternately under overlap-intra and overlap-cross and fixes the
    faster one at its end; a group with one layer there is tried under overlap-cross in iteration 3."""
    pool = CopyThreadPool(2)
    pipe = AdaptivePipeline(pool, "adaptive")
    layers = [(0, 1), (1, 1), (2, 1), (3, 1), (4, 2)]       # (layer, group): four layers in Group 1, one in 2
    seen: dict[tuple[int, int], str] = {}
    decided_after: dict[int, dict[int, str]] = {}
    for it in range(1, 5):
        pipe.begin_iteration(it)
        for layer, group in layers:
            jobs = [LoadJob(read=lambda: torch.ones(1 << 14).sum(), dma=lambda: None, nbytes=1 << 16)
                    for _ in range(2)]
            h = pipe.load(jobs, group)
            h.result()
            seen[(it, layer)] = h.strategy
        pipe.end_iteration()
        decided_after[it] = dict(pipe.decision)
    pool.close()
    assert [seen[(1, layer)] for layer, _ in layers] == ["intra"] * 5               # the warm-up
    assert [seen[(2, layer)] for layer, _ in layers] == ["intra", "cross", "intra", "cross", "intra"]
    assert set(decided_after[2]) == {1}                                             # Group 2 had no cross load
    assert seen[(3, 4)] == "cross" and set(decided_after[3]) == {1, 2}
    report = pipe.report()
    for g in ("1", "2"):
        faster = "cross" if report["cross_GBps"][g] > report["intra_GBps"][g] else "intra"
        assert report["decision"][g] == faster
    assert all(seen[(it, layer)] == pipe.decision[group] for it in (3, 4) for layer, group in layers[:4])
    assert seen[(4, 4)] == pipe.decision[2]
