"""``tools/gpu_check.py --rehearse`` (issue 32): the GPU box's check runs here, so it cannot rot before a GPU is lent.

The rehearsal runs every step of the GPU run on this machine: the carried wheels' install (or, without a carry,
the local packages), liburing, the extension built from source, io_uring, a private daemon's round trip, the
``cuda`` tests (each must skip for want of CUDA, and only for that), and the measurements' plumbing on the CPU
(a staging slot, the runner with KV through bladed against KV in memory, the KV sweep driver with real
per-layer compute at two limits and the adaptive choice per group). Its JSON is what the GPU run writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from daemon_util import ROOT

STEPS = ["environment", "install", "liburing", "build", "uring", "daemon", "cuda_tests", "bandwidth", "runner",
         "sweep"]
CUDA_STEPS = ["cuda_tests", "bandwidth", "runner", "sweep"]


@pytest.mark.slow
def test_the_gpu_check_rehearses_every_step_on_this_machine(tmp_path: os.PathLike[str]) -> None:
    out = os.path.join(tmp_path, "out")
    r = subprocess.run([sys.executable, os.path.join("tools", "gpu_check.py"), "--rehearse", "--out", out],
                       cwd=ROOT, capture_output=True, text=True, timeout=400)
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
    sweep = steps["sweep"]["data"]["points"]
    assert [p["kv_fraction"] < 0.5 for p in sweep] == [True, False]
    for p in sweep:
        assert p["verify"]["errors"] == 0 and p["verify"]["checked"] > 0
        assert p["pipeline_report"]["decision"]   # the adaptive pipeline chose, per group
        assert set(p["compute_ms_per_layer"]) == {"decode", "prefill"}
    figures = doc["figures"]
    assert figures["io_uring"] is True and figures["runner_tokens_per_s"] and figures["kv_sweep_point"]
    with open(os.path.join(out, "gpu-check.log")) as f:
        log = f.read()
    assert "summary: rehearse ok=True" in log and "----- step sweep" in log
