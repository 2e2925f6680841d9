"""``tools/gpu/gpu_check.py --rehearse`` (issues 32, 41): the GPU box's check runs here, so it cannot rot before a GPU
is lent.

The rehearsal runs every step of the GPU run on this machine: the carried wheels' install (or, without a carry,
the local packages), liburing, the extension built from source, io_uring, a private daemon's round trip, where
memory cgroups with a limit can be made, FlexGen installed from its wheels (the carry's, else tools/setup.sh's)
with the local tokenizer and run on the CPU under its ``cpu-shim``, the ``cuda`` tests (each must skip for want
of CUDA, and only for that), and the measurements' plumbing on the CPU (a staging slot, the runner with KV through
bladed against KV in memory, the KV sweep driver with real per-layer compute at two limits and the adaptive
choice per group, the per-layer profile's hooks, the end-to-end benchmark with FlexGen after each limit). Its JSON
is what the GPU run writes.

What it cannot prove: anything CUDA does (FlexGen's streams and pinned relay buffers, the CUDA events, the
runner's weights made on the GPU), the GPU box's cgroup layout, its disk, and whether the plan fits its budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from daemon_util import ROOT

STEPS = ["environment", "install", "liburing", "build", "uring", "daemon", "cgroups", "flexgen", "cuda_tests",
         "bandwidth", "runner", "sparse", "sweep", "profile", "e2e"]
CUDA_STEPS = ["cuda_tests", "bandwidth", "runner", "sparse", "sweep", "profile", "e2e"]


@pytest.mark.slow
def test_the_gpu_check_rehearses_every_step_on_this_machine(tmp_path: os.PathLike[str]) -> None:
    out = os.path.join(tmp_path, "out")
    r = subprocess.run([sys.executable, os.path.join("tools", "gpu", "gpu_check.py"), "--rehearse", "--out", out],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    with open(os.path.join(out, "gpu-check.json")) as f:
        doc = json.load(f)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert doc["schema"] == "bladed.gpu_check/1" and doc["mode"] == "rehearse" and doc["ok"] is True
    steps = doc["steps"]
    assert list(steps) == STEPS
    for name, res in steps.items():
        assert {"status", "reason", "seconds", "cuda_part"} <= set(res), name
        assert res["cuda_part"] == (name in CUDA_STEPS)
        if name in CUDA_STEPS:
            assert res["status"] == "not_run" and res["reason"].startswith("no CUDA"), (name, res)
        elif name == "cgroups" and os.geteuid() != 0:
            assert res["status"] == "not_run" and res["reason"].startswith("not root"), res
        else:
            assert res["status"] == "passed", (name, res)

    env = doc["environment"]
    for key in ("python", "kernel", "io_uring", "torch", "transformers", "gcc", "gpu_name", "driver", "cgroup"):
        assert key in env, key
    assert env["io_uring"]["available"] is True and env["cuda_available"] is False
    assert steps["uring"]["data"]["io_uring"] is True
    assert steps["daemon"]["data"]["mismatched"] == [] and set(steps["daemon"]["data"]["paths"]) == {"pagecache",
                                                                                                      "direct"}
    # every cuda test was collected and skipped for want of CUDA, and for nothing else
    tests = steps["cuda_tests"]["data"]["tests"]
    assert len(tests) >= 20 and {t["outcome"] for t in tests} == {"skipped"}
    assert all("torch.cuda.is_available() is false" in t["message"] for t in tests)
    # the measurements' plumbing ran
    slot = steps["bandwidth"]["data"]["staging_slot"]
    assert slot["pinned_by_client"] is False and slot["address"] > 0
    runner = steps["runner"]["data"]["summary"]["b1"]
    assert runner["tokens_equal"] is True and runner["kv_gpu_decode_tok_s"] > 0 and runner["bladed_decode_tok_s"] > 0
    sparse = steps["sparse"]["data"]["summary"]      # issue 47: the sparse reads' plumbing, tokens held
    assert sparse["tokens_equal"] is True and sparse["read_bytes_sparse_over_dense"] < 1
    sweep = steps["sweep"]["data"]["points"]
    assert [p["kv_fraction"] < 0.5 for p in sweep] == [True, False]
    for p in sweep:
        assert p["verify"]["errors"] == 0 and p["verify"]["checked"] > 0
        assert p["pipeline_report"]["decision"]   # the adaptive pipeline chose, per group
        assert set(p["compute_ms_per_layer"]) == {"decode", "prefill"}
    check_flexgen(steps["flexgen"]["data"])
    check_profile(steps["profile"]["data"], out)
    check_e2e(steps["e2e"]["data"], out)
    figures = doc["figures"]
    assert figures["io_uring"] is True and figures["runner_tokens_per_s"] and figures["kv_sweep_point"]
    assert figures["flexgen"]["patches"] == ["cpu-shim", "tokenizer"] and figures["runner_profile"]["b1"]
    assert set(figures["e2e"]["by_fraction"]) == {"0.333", "1"}
    assert all(cell["flexgen"] and cell["dualblade/flexgen decode time"]
               for cell in figures["e2e"]["by_fraction"].values())
    with open(os.path.join(out, "gpu-check.log")) as f:
        log = f.read()
    assert "summary: rehearse ok=True" in log and "----- step sweep" in log and "----- step e2e" in log


def check_flexgen(data: dict[str, Any]) -> None:
    """FlexGen from its wheels in a private directory, the local tokenizer, and a real run on the CPU."""
    assert [w.split("-")[0] for w in data["wheels"]] == ["flexgen", "attrs"]
    assert data["import"]["flexgen"].startswith(data["site"])
    tok = data["tokenizer"]
    ids = tok["prompt_ids"]
    n_pad = len(ids) - tok["prompt_tokens"]
    assert tok["pad_token_id"] == 1 and ids[:n_pad] == [1] * n_pad and ids[n_pad] == 2
    run = data["cpu_run"]
    assert run["patches"] == ["tokenizer", "cpu-shim"] and "error" not in run
    assert len(run["steps"]) == 4 and len(run["tokens"]) == 2 and all(len(t) == 4 for t in run["tokens"])
    assert run["decode_tok_s"] > 0 and run["prefill_tok_s"] > 0 and run["owner_io"] is not None
    assert run["prompt_ids"][-tok["prompt_tokens"]:] == ids[n_pad:]   # FlexGen's own prompt, our tokenizer


def check_profile(data: dict[str, Any], out: str) -> None:
    """The profile's hooks fired where the runner calls them, for both configurations; no CUDA events here."""
    layers = data["layers"]
    runs = data["runs"]
    for name, row in runs.items():
        pl = row["per_layer_ms"]
        assert pl["n_compute_per_step"] == layers and pl["n_load_cache_per_step"] == layers, (name, pl)
        assert pl["wall_ms"] > 0 and pl["compute_host_ms"] > 0 and pl["compute_gpu_ms"] is None, (name, pl)
        assert row["torch_profiler"]["by_self_cpu"], (name, row["torch_profiler"])
        if name.startswith("bladed"):   # K and V of every layer loaded and written through the copy threads
            assert pl["n_dma_per_step"] == 2 * layers and pl["n_write_dma_per_step"] == 2 * layers, (name, pl)
            assert pl["load_wait_ms"] >= 0 and pl["read_ms"] > 0, (name, pl)
        else:
            assert pl["n_dma_per_step"] == 0 and pl["n_write_dma_per_step"] == 0, (name, pl)
    for b in ("b1", "b2"):
        s = data["summary"][b]
        assert s["tokens_equal"] is True and s["overhead_ms_per_layer"] is not None
        assert set(s["delta_ms_per_layer"]) >= {"load_wait_ms", "compute_host_ms", "store_cache_ms"}
    assert os.path.exists(os.path.join(out, runs["bladed_b1"]["trace"]))


def check_e2e(data: dict[str, Any], out: str) -> None:
    """The end-to-end plumbing: every side at both limits with memory's tokens, FlexGen after each limit in the
    same kind of cgroup (its own memory measured by a probe), the ratios paired by round, the budget kept."""
    summary = data["summary"]
    assert summary["errors"] == 0 and summary["tokens_equal_memory"] is True
    assert [row["fraction"] for row in summary["by_limit"]] == [0.333, 1.0]
    for row in summary["by_limit"]:
        assert set(row["sides"]) == {"mmap", "baseline", "dualblade"}
    assert data["budget"]["stopped"] is False and data["drop_scope"] == "workdir"
    fg = data["flexgen"]
    assert fg["status"] == "passed" and "error" not in fg["probe"], fg
    runs = fg["runs"]
    assert [(r["rep"], r["fraction"]) for r in runs] == [(0, 0.333), (0, 1.0)]
    root = os.geteuid() == 0
    for r in runs:
        assert r["decode_tok_s"] > 0 and r["patches"] == ["tokenizer", "cpu-shim"] and r["owner_io"] is not None
        if root:   # its whole process in a memory cgroup: its own memory (the probe's) plus the share of its KV
            want = fg["allowance_bytes"] + r["fraction"] * fg["kv_bytes"]
            assert want - 1 <= r["cgroup"]["limit_bytes"] < want + 4096, (r["cgroup"], want)   # page-aligned
    for frac in ("0.333", "1"):
        row = fg["by_fraction"][frac]
        assert row["runs"] == 1 and row["dualblade/flexgen_decode_time"]["n"] == 1 and row["mmap/flexgen_ttft_time"]
    with open(os.path.join(out, data["json"])) as f:
        doc = json.load(f)
    assert doc["schema"] == "bladed.bench_e2e/1" and doc["plan"]["drop_scope"] == "workdir"
    assert len(doc["runs"]) == 6 and len(doc["flexgen"]["runs"]) == 2 and doc["flexgen"]["runs"][0]["tokens"]
