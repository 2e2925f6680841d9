"""tools/bench_wear.py on a tiny chat workload (seconds, not minutes): every side's KV is counted per path, the
device's written bytes are read from each side's own loop device, and the figures the issue asks for are in
the summary: bladed's direct path writes its KV bytes once (whole LBAs of 768-byte rows: no amplification of
its own beyond one LBA per KPU), its page-cache path in memory files leaves the device next to unwritten."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from bladed_bench.wear import ChatSpec, markdown, run_wear  # noqa: E402


@pytest.mark.root
@pytest.mark.slow
def test_a_tiny_chat_workload_reports_wear_per_path(tmp_path) -> None:
    # a page-cache budget of one and a half sessions' KV: the second session spills to the direct path
    kv_session = 2 * 30 * 2 * (40 + 10) * 768
    spec = ChatSpec(sessions=2, turns=2, gap_s=1.0, stagger_s=0.5, prompt_tokens=40, reply_tokens=10,
                    tokens_per_s=50.0, pagecache_budget=kv_session * 3 // 2)
    doc = run_wear(spec, ["bladed", "mmap"], str(tmp_path), str(tmp_path / "wear.json"))
    assert (tmp_path / "wear.json").is_file()
    runs = {r["side"]: r for r in doc["runs"]}
    assert set(runs) == {"bladed", "mmap"} and all("error" not in r and not r["errors"] for r in runs.values())
    kv = 2 * spec.turns * (spec.prompt_tokens + spec.reply_tokens) * spec.layers * 768 * spec.sessions
    assert runs["bladed"]["kv_bytes"] == runs["mmap"]["kv_bytes"] == kv
    s = doc["summary"]["bladed"]
    assert s["kv_direct_bytes"] > 0 and s["kv_pagecache_bytes"] > 0
    # each LBA written once: within one LBA per direct KPU of the KV bytes sent there (a KPU's last, partly
    # filled LBA is held in memory until full, and a closed session's is never written)
    direct_kpus = s["kv_direct_bytes"] // (spec.turns * (spec.prompt_tokens + spec.reply_tokens) * 768)
    slack = direct_kpus * 4096 / s["kv_direct_bytes"]
    assert 1.0 - slack <= s["direct_device_per_kv"] <= 1.0 + slack
    assert runs["bladed"]["device_written_bytes"] >= s["bladed_direct_written_bytes"]
    assert "| bladed |" in markdown(doc) and "| mmap |" in markdown(doc)
