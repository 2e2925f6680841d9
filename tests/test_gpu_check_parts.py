"""The parts of ``tools/gpu/gpu_check.py``'s issue-41 steps that a CPU can check on their own, quickly.

FlexGen's command line and KV size, the local tokenizer that stands in for OPT's, where memory cgroups may be
made on a cgroup v2 host, the profile's per-layer figures, the end-to-end benchmark's budget and its hook for
another system after each limit (with a stand-in for the runner processes), the eviction of the work
directory's files, and the plan's bounds. The steps themselves run in ``tests/test_gpu_check.py``'s rehearsal.
"""

from __future__ import annotations

import os
import pathlib
import sys
from typing import Any

import pytest
from daemon_util import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools", "gpu"))

import gpu_check
import gpu_check_steps
import gpu_flexgen

GiB = 1 << 30


def test_flexgen_runs_with_the_issues_flags_and_a_kv_set_the_size_of_the_runners() -> None:
    from bladed.runner.models import kv_bytes, opt_config

    plan = gpu_flexgen.FlexGenPlan(model="facebook/opt-6.7b", batch=8, prompt_len=512, gen_len=32, site="s",
                                   tokenizer="t", workdir="w")
    args = " ".join(plan.flexgen_args("/d/offload", "/d/log"))
    for want in ("--model facebook/opt-6.7b", "--path _DUMMY_", "--offload-dir /d/offload",
                 "--percent 100 0 0 0 100 0", "--gpu-batch-size 8", "--prompt-len 512", "--gen-len 32"):
        assert want in args, want
    assert gpu_flexgen.kv_bytes("facebook/opt-6.7b", 8, 544) == kv_bytes(opt_config("facebook/opt-6.7b"), 8, 544, 2)
    assert gpu_flexgen.kv_bytes("facebook/opt-6.7b", 8, 544) == int(2.125 * GiB)


def test_the_local_tokenizer_encodes_flexgens_prompt_as_opts_would(tmp_path: pathlib.Path) -> None:
    out = gpu_flexgen.build_tokenizer(str(tmp_path / "tok"))
    ids = out["prompt_ids"]
    n_pad = len(ids) - out["prompt_tokens"]
    assert out["pad_token_id"] == 1 and ids[:n_pad] == [1] * n_pad and ids[n_pad] == 2 and out["bos_first"]
    assert out["prompt_tokens"] == 1 + len(gpu_flexgen.FLEXGEN_PROMPT.encode())   # </s>, then a byte per id
    assert out["decoded"] == gpu_flexgen.FLEXGEN_PROMPT and max(ids) < 50272      # within OPT's embedding
    # a tokenizer that pads with another id is refused (FlexGen masks OPT's pad id, 1)
    cfg = tmp_path / "tok" / "tokenizer_config.json"
    cfg.write_text(cfg.read_text().replace('"pad_token": "<pad>"', '"pad_token": "<unk>"'))
    with pytest.raises(ValueError, match="does not encode FlexGen's prompt as OPT's would"):
        gpu_flexgen.check_tokenizer(str(tmp_path / "tok"))


def test_the_flexgen_wheels_are_found_only_when_all_are_there(tmp_path: pathlib.Path) -> None:
    assert gpu_flexgen.wheels_in(str(tmp_path)) == []
    (tmp_path / "flexgen-0.1.8-py3-none-any.whl").write_bytes(b"")
    assert gpu_flexgen.wheels_in(str(tmp_path)) == []            # attrs missing
    (tmp_path / "attrs-26.1.0-py3-none-any.whl").write_bytes(b"")
    assert [os.path.basename(w) for w in gpu_flexgen.wheels_in(str(tmp_path))] == [
        "flexgen-0.1.8-py3-none-any.whl", "attrs-26.1.0-py3-none-any.whl"]


def _cg(path: pathlib.Path, subtree: str = "", procs: str = "") -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "cgroup.subtree_control").write_text(subtree)
    (path / "cgroup.procs").write_text(procs)


def test_memory_cgroups_go_below_an_ancestor_without_processes_on_cgroup_v2(tmp_path: pathlib.Path) -> None:
    from bladed.residency.cgroups import CgroupInfo

    top = tmp_path / "cgroup"
    _cg(top, "cpu memory", "1\n")
    _cg(top / "api", "memory io")                  # hands memory down, holds no process: a candidate
    _cg(top / "api" / "run", "", "42\n43\n")       # the check's own: processes, so it cannot hand memory down
    _cg(top / "busy", "memory", "7\n")
    _cg(top / "busy" / "run", "", "42\n")
    own = CgroupInfo("v2", str(top / "api" / "run"), str(top), None)
    assert gpu_check_steps._cgroup_candidates(own) == [own.path, str(top / "api"), str(top)]
    busy = CgroupInfo("v2", str(top / "busy" / "run"), str(top), None)
    assert gpu_check_steps._cgroup_candidates(busy) == [busy.path, str(top)]   # busy/ has a process of its own
    assert gpu_check_steps._cgroup_candidates(CgroupInfo("v1", own.path, str(top), None)) == [own.path]


def test_per_layer_means_the_decode_steps_and_keeps_what_was_not_measured_unknown() -> None:
    from gpu_profile import per_layer

    def step(i: int, wall: float, gpu: float | None) -> dict[str, Any]:
        return {"step": i, "wall_s": wall, "load_wait_s": wall / 4, "read_s": 0.0, "dma_s": 0.0, "write_s": 0.0,
                "load_cache_ms": 2.0, "compute_host_ms": 4.0, "store_cache_ms": 1.0, "compute_gpu_ms": gpu,
                "dma_gpu_ms": 0.0, "write_dma_gpu_ms": 0.0, "n_compute": 2, "n_load_cache": 2, "n_dma": 4,
                "n_store_cache": 2, "n_write_dma": 4}

    out = per_layer([step(0, 9.0, 1.0), step(1, 0.010, 3.0), step(2, 0.030, 5.0)], layers=2)
    assert out["decode_steps"] == 2 and out["wall_ms"] == 10.0 and out["load_wait_ms"] == 2.5
    assert out["compute_gpu_ms"] == 2.0 and out["compute_host_ms"] == 2.0 and out["n_dma_per_step"] == 4
    assert per_layer([step(0, 1.0, None), step(1, 0.01, None)], layers=2)["compute_gpu_ms"] is None


def _fake_run(clock: list[float]) -> Any:
    """``E2ERunner.run`` without a process: 10 s of the fake clock and a record with what the summary reads."""
    def run(self: Any, side: str, limit: int | None, *, cold: bool = True) -> dict[str, Any]:
        clock[0] += 10.0
        return {"side": side, "limit_bytes": limit, "tokens": [[5, 6]], "kv_bytes": 64 << 20, "tiers": "disk:4",
                "weight_bytes": 1, "process_s": 10.0, "ttft_s": 1.0, "prefill_s": 1.0, "decode_s": 2.0,
                "decode_tok_s": 3.0, "prefill_tok_s": 4.0, "hit": {"pagecache_hit_ratio": None,
                                                                   "served_from_memory": None},
                "steps": [{"step": 0, "wall_s": 1.0}], "plan": None}
    return run


def test_the_e2e_sweep_keeps_its_budget_and_calls_back_after_each_limit(tmp_path: pathlib.Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from bladed_bench import e2e

    clock = [0.0]
    monkeypatch.setattr(e2e.E2ERunner, "run", _fake_run(clock))
    monkeypatch.setattr(e2e.time, "perf_counter", lambda: clock[0])
    calls: list[tuple[int, float, int]] = []
    plan = e2e.E2EPlan(workload=e2e.WORKLOADS["tiny"], sides=["mmap", "dualblade"], fractions=[0.5, 1.0], reps=1,
                       workdir=str(tmp_path), budget_s=45.0, drop_scope="workdir",
                       after_limit=lambda rep, frac, limit, doc: calls.append((rep, frac, limit)))
    doc = e2e.run_e2e(plan, str(tmp_path / "e2e.json"), None)
    # the warm-up took 10 s: runs start at 10, 20, 30; the one at 40 would end past 45
    assert doc["budget"] == {"budget_s": 45.0, "stopped": True, "runs_done": 3, "runs_planned": 4}
    assert calls == [(0, 0.5, doc["limits"][0])]     # after the limit all of whose sides ran, not the cut one
    assert doc["plan"]["drop_scope"] == "workdir" and doc["plan"]["budget_s"] == 45.0
    unlimited = e2e.run_e2e(e2e.E2EPlan(workload=e2e.WORKLOADS["tiny"], sides=["mmap"], fractions=[0.5, 1.0],
                                        reps=2, workdir=str(tmp_path)), None, None)
    assert unlimited["budget"]["stopped"] is False and unlimited["budget"]["runs_done"] == 4
    with pytest.raises(ValueError, match="drop_scope 'kv'"):
        e2e.E2ERunner(e2e.E2EPlan(workload=e2e.WORKLOADS["tiny"], workdir=str(tmp_path), drop_scope="kv"))


def test_evicting_the_work_directory_drops_its_files_pages(tmp_path: pathlib.Path) -> None:
    from bladed.io.pagecache import cachestat
    from bladed_bench.e2e import evict_files

    f = tmp_path / "kv" / "store.img"
    f.parent.mkdir()
    f.write_bytes(os.urandom(1 << 20))
    assert evict_files(str(tmp_path)) >= 0
    fd = os.open(f, os.O_RDONLY)
    try:
        st = cachestat(fd, 0, 1 << 20)
    finally:
        os.close(fd)
    if st is None:
        pytest.skip("no cachestat(2) here to see the pages")
    assert st.cache == 0 and st.dirty == 0


def test_the_plan_is_held_to_the_issues_bounds() -> None:
    ok = gpu_check.E2EOptions()
    assert gpu_check.e2e_problem(ok) is None and ok.args()[:2] == ["--e2e-prompt-len", "512"]
    for bad, flag in ((gpu_check.E2EOptions(prompt_len=256), "--e2e-prompt-len 256"),
                      (gpu_check.E2EOptions(batch=4), "--e2e-batch 4"),
                      (gpu_check.E2EOptions(limits="1,0.5"), "ascending"),
                      (gpu_check.E2EOptions(limits="a,b"), "not a comma-separated list"),
                      (gpu_check.E2EOptions(reps=0), "--e2e-reps 0")):
        problem = gpu_check.e2e_problem(bad)
        assert problem is not None and flag in problem, (bad, problem)
    with pytest.raises(SystemExit):
        gpu_check.main(["--rehearse", "--skip", "install"])     # only the measurements may be skipped
