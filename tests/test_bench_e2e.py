"""Smoke test of the end-to-end benchmark (``tools/bench_e2e.py``, ``bench/bladed_bench/e2e.py``).

A tiny random LLaMA at two limits, every side once: real runner processes, a real daemon and a real mmap owner
in real memory cgroups (as root, as CI runs). It checks that the JSON carries every figure the report needs,
that every side's generated tokens equal the in-memory KV's (the KV path is exact), that the KV's owner and
not the runner sat in the limited cgroup, and that the report and the plot are made from the file. No timing
is asserted, and caches are never dropped here.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from bladed_bench.e2e import SIDES, owner_allowance, parse_side, reference_side

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "bench_e2e.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_sides_and_the_owner_allowance() -> None:
    assert parse_side("dualblade-q8") == ("dualblade", "q8") and parse_side("mmap") == ("mmap", None)
    assert parse_side("dualblade-q8@sel") == ("dualblade", "q8") and reference_side("dualblade-q8@sel") == \
        "memory-q8@sel" and reference_side("dualblade+disk") == "memory"
    assert reference_side("dualblade@sel2") == "memory@sel2"
    assert parse_side("dualblade+disk@sel3") == ("dualblade", None)
    with pytest.raises(ValueError, match="unknown side 'flexgen'"):
        parse_side("flexgen")
    # the owner's own memory: 48 MiB and one KPU-sized staging slot per copy thread
    assert owner_allowance(30 * 2 * (1 << 20), 30) == (48 + 2) << 20


def test_help_documents_the_tool() -> None:
    out = subprocess.run([sys.executable, str(TOOL), "run", "--help"], capture_output=True, text=True, check=True)
    for flag in ("--workload", "--sides", "--limits", "--reps", "--owner-allowance", "--no-drop"):
        assert flag in out.stdout


@pytest.mark.slow
def test_a_tiny_sweep_end_to_end(tmp_path: pathlib.Path) -> None:
    js, png = tmp_path / "e2e.json", tmp_path / "e2e.png"
    r = subprocess.run([sys.executable, str(TOOL), "run", "--workload", "tiny", "--limits", "0.5,1.25", "--reps", "1",
                        "--no-drop", "--no-settle", "--workdir", str(tmp_path / "w"), "--json", str(js),
                        "--plot", str(png)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(js.read_text())
    assert doc["schema"] == "bladed.bench_e2e/1" and doc["plan"]["sides"] == list(SIDES)
    assert len(doc["limits"]) == 2 and doc["kv_bytes"] > 0 and doc["owner_allowance_bytes"] > 0
    runs = doc["runs"]
    assert len(runs) == 2 * len(SIDES) and not [x for x in runs if "error" in x]
    root = os.geteuid() == 0
    for run in runs:
        for key in ("ttft_s", "prefill_tok_s", "decode_tok_s", "owner_io", "hit", "steps", "tokens", "device"):
            assert key in run, (run["side"], key)
        assert run["tokens_equal_memory"], run["side"]
        assert run["decode_tok_s"] > 0 and len(run["steps"]) == doc["workload"]["gen_len"]
        if run["side"] == "memory":
            assert "cgroup" not in run
            continue
        assert run["owner_io"] is not None and run["owner_io"]["read_bytes"] >= 0
        if root:
            cg = run["cgroup"]
            assert cg["limit_bytes"] == run["limit_bytes"]
            assert cg["peak_bytes"] is None or cg["peak_bytes"] > 0
            assert cg["version"] != "v1" or cg["failcnt"] is not None
            # the KV's owner sat in the limited cgroup; the runner (weights, activations) did not
            assert run["runner_cgroup"] is not None and os.path.basename(cg["path"]) not in run["runner_cgroup"]
            assert cg["peak_stat"].get("usage", 0) > 0
    summary = doc["summary"]
    assert summary["tokens_equal_memory"] and summary["errors"] == 0
    row = summary["by_limit"][0]
    assert set(row["sides"]) == set(SIDES) and "dualblade/mmap" in row["ratios"]
    assert png.read_bytes()[:8] == PNG_MAGIC
    again = subprocess.run([sys.executable, str(TOOL), "report", str(js)], capture_output=True, text=True,
                           check=True).stdout
    assert "Decode tokens/s" in again and "decode time DB ÷ mmap" in again and "Where the time goes" in again
