"""Smoke test of the KV benchmark harness (``tools/bench_kv.py``, ``bench/bladed_bench``).

One tiny geometry, one memory limit, every configuration once, the pipeline
on/off and alpha studies once each: the harness must run end to end against a
real daemon and a real TorchDisk child, read back what it wrote, and produce
well-formed JSON, Markdown and PNGs.  No timing is asserted, and caches are
never dropped here.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from bladed_bench import metrics
from bladed_bench.main import main
from bladed_bench.metrics import union_seconds, wait_free_pages_reported
from bladed_bench.stats import percentile, summarize
from bladed_bench.workload import CONFIGS

TINY = ["--layers", "4", "--batch", "1", "--kv-heads", "4", "--head-dim", "512", "--prompt-len", "32",
        "--gen-len", "5"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_statistics_helpers() -> None:
    assert union_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == pytest.approx(3.0)
    assert union_seconds([]) == 0.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([5.0], 99) == 5.0
    s = summarize([2.0, 1.0, 4.0, None])
    assert s["n"] == 3 and s["median"] == 2.0 and s["min"] == 1.0 and s["max"] == 4.0
    assert s["spread_pct"] == pytest.approx(150.0)


def test_memory_settle_waits_for_a_quiet_reporting_counter(tmp_path: pathlib.Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    counter = tmp_path / "reported_kib"
    monkeypatch.setattr(metrics, "PAGE_REPORTING_COUNTER", str(counter))
    # a host without free page reporting: nothing to wait for, and the run record says so
    assert wait_free_pages_reported(quiet_s=0.05) == (None, None, None)
    counter.write_text("1024\n")
    waited, quiet, kib = wait_free_pages_reported(quiet_s=0.2, poll_s=0.05)
    assert quiet is True and kib == 0 and waited is not None and waited >= 0.2


def test_sweep_end_to_end(store_dir: str, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    js, md = str(out / "kv-sweep-test.json"), str(out / "kv-report.md")
    rc = main(["sweep", *TINY, "--limits", "0.25", "--pp-limits", "0.25", "--alphas", "0.5", "--reps", "1",
               "--headroom-limits", "0.25", "--noreplan-limits", "0.25", "--no-drop", "--no-settle",
               "--fio-size", "8M", "--pc-probe-size", "8M",
               "--keep-series", "all",
               "--workdir", os.path.join(store_dir, "w"), "--json", js, "--report", md])
    assert rc == 0

    with open(js) as f:
        doc = json.load(f)
    assert doc["schema"] == "bladed.bench_kv/1"
    assert doc["machine"]["kernel"] and doc["date"]
    assert doc["workload"]["kv_bytes"] == 2 * 4 * (1 * 4 * 512 * 2) * (32 + 5)
    runs = doc["runs"]
    # 4 configs in the sweep, 4 with the pipeline off, 1 with budget headroom, 1 without live re-planning,
    # 2 (on/off) for alpha
    assert len(runs) == 12
    assert [r for r in runs if "error" in r] == []
    assert sorted(r["config"] for r in runs if r["study"] == "sweep") == sorted(CONFIGS)
    assert {r["pipeline"] for r in runs if r["study"] == "pipeline"} == {"off"}
    assert {(r["study"], r["alpha"]) for r in runs if r["study"] == "alpha"} == {("alpha", 0.5)}
    for r in runs:
        assert r["prefill_s"] > 0 and r["decode_s"] > 0
        assert len(r["step_s"]) == 5
        assert r["verify"]["errors"] == 0 and r["verify"]["checked"] > 0
        assert 0.0 <= r["hit_ratio"] <= 1.0
        assert r["bytes"]["decode_read"] == 2 * 4 * sum(32 + i - 1 for i in range(1, 5)) * 4096
        assert r["latency"]["prefill_write"]["n"] == 8
        assert r["latency"]["decode_read"]["n"] == 8 * 4
        assert r["latency"]["decode_write"]["n"] == 8 * 4
        assert "series" in r and len(r["series"]["t"]) == len(r["series"]["read_GBps"])
    by_cfg = {r["config"]: r for r in runs if r["study"] == "sweep"}
    assert by_cfg["dualblade"]["target_end"]["replan"] is not None
    assert next(r for r in runs if r["study"] == "noreplan")["live_replan"] is False
    assert by_cfg["direct"]["hit_ratio"] == 0.0
    assert by_cfg["direct"]["target"]["plan"]["paths"] == {"pagecache": 0, "direct": 8}
    assert by_cfg["baseline"]["target"]["target"] == "torchdisk"
    assert {r["pipeline_report"]["mode"] for r in runs} <= {"adaptive", "off"}
    alpha_on = next(r for r in runs if r["study"] == "alpha" and r["pipeline"] == "adaptive")
    assert alpha_on["target"]["plan"]["budget_bytes"] == int(0.5 * doc["workload"]["kv_bytes"])
    assert set(alpha_on["pipeline_report"]["decision"]) <= {"1", "2"}
    limit_rounds = [rnd for rnd in doc["rounds"] if rnd["key"][0] == "limit"]
    assert limit_rounds and all("pagecache" in rnd and "fio" in rnd for rnd in limit_rounds)
    assert {r["dma"] for r in runs if r["study"] == "alpha"} == {"model"}
    assert {r["dma"] for r in runs if r["study"] != "alpha"} == {"none"}
    assert doc["reference"]["bare_uring_write"]["n"] > 0

    text = pathlib.Path(md).read_text()
    for heading in ("Fig. 10", "Fig. 11", "Targets", "Table IV", "Fig. 12", "Table V", "Pipeline parallelism",
                    "budget headroom", "live re-planning off"):
        assert heading in text
    for name in ("fig3", "fig10", "fig11", "fig12", "table5"):
        png = out / f"kv-{name}.png"
        assert f"kv-{name}.png" in text
        assert png.read_bytes()[:8] == PNG_MAGIC

    # regenerating keeps a hand-written analysis
    marked = "<!-- analysis:begin -->\nhand-written words\n<!-- analysis:end -->"
    pathlib.Path(md).write_text(text.replace("<!-- analysis:begin -->\n(to be written)\n<!-- analysis:end -->",
                                             marked))
    assert main(["report", js, "--out", md]) == 0
    assert "hand-written words" in pathlib.Path(md).read_text()


def test_sweep_with_kv_formats(store_dir: str, tmp_path: pathlib.Path) -> None:
    """Issue 31's configurations: Dual-Blade and Baseline on q8 rows beside plain Dual-Blade, in one round; the
    q8 runs move the format's bytes (a token row of 4 x 512 values: 64 blocks of 34 bytes, not 4096), are charged
    the codec rates measured on this CPU, and the report has their ratios."""
    js, md = str(tmp_path / "kv-sweep-formats.json"), str(tmp_path / "kv-report.md")
    rc = main(["sweep", *TINY, "--configs", "dualblade,dualblade-q8,baseline-q8", "--limits", "0.25",
               "--pp-limits", "", "--alphas", "", "--noreplan-limits", "", "--reps", "1", "--no-drop",
               "--no-settle", "--fio-size", "8M", "--pc-probe-size", "8M",
               "--workdir", os.path.join(store_dir, "w"), "--json", js, "--report", md])
    assert rc == 0
    with open(js) as f:
        doc = json.load(f)
    runs = {(r["config"], r["kv_format"]): r for r in doc["runs"]}
    assert set(runs) == {("dualblade", None), ("dualblade", "q8"), ("baseline", "q8")}
    assert [r for r in runs.values() if "error" in r] == []
    q8_row = 64 * 34
    for (_cfg, fmt), r in runs.items():
        row = q8_row if fmt else 4096
        assert r["bytes"]["decode_read"] == 2 * 4 * sum(32 + i - 1 for i in range(1, 5)) * row
        assert r["verify"]["errors"] == 0
    assert runs[("dualblade", "q8")]["label"] == "Dual-Blade q8"
    assert doc["codec"]["q8"]["quantize_gbps"] > 0 and doc["codec"]["q8"]["dequantize_gbps"] > 0
    text = pathlib.Path(md).read_text()
    assert "## KV formats (issue 31)" in text and "decode dualblade-q8 / baseline-q8" in text


def test_sweep_with_sparse_reads(store_dir: str, tmp_path: pathlib.Path) -> None:
    """Issue 47's sparse decode reads: the @sel run reads, per selecting layer and step, the trace's pages that
    the reuse buffer lacks (the page not yet whole every step), as runs of consecutive pages; the dense layers
    and the dense configuration read everything; what is read back carries what was written."""
    page, prompt_len, gen = 8, 64, 5
    pages = {"2": [[0, 3, 4, 7], [0, 3, 5, 7], [0, 1, 2, 7, 8], [0, 1, 2, 7, 8]],
             "3": [[0, 6, 7], [0, 6, 7], [0, 6, 7, 8], [0, 5, 7, 8]]}
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"schema": "bladed.kvselect_trace/1", "spec": f"keys:0.5,page={page}",
                                 "page": page, "dense_layers": 2,
                                 "first_position": prompt_len, "steps": gen - 1, "pages": pages}))
    js = str(tmp_path / "kv-sweep-select.json")
    geometry = ["--layers", "4", "--batch", "1", "--kv-heads", "4", "--head-dim", "512", "--prompt-len",
                str(prompt_len), "--gen-len", str(gen)]
    rc = main(["sweep", *geometry, "--configs", "dualblade,dualblade@sel", "--select-trace", str(trace),
               "--limits", "0.25", "--pp-limits", "", "--alphas", "",
               "--noreplan-limits", "", "--reps", "1", "--no-drop", "--no-settle", "--fio-size", "8M",
               "--pc-probe-size", "8M", "--workdir", os.path.join(store_dir, "w"), "--json", js])
    assert rc == 0
    with open(js) as f:
        runs = {r["name"]: r for r in json.load(f)["runs"]}
    assert [r for r in runs.values() if "error" in r] == []
    row = 4096
    dense = [prompt_len + i - 1 for i in range(1, gen)]                  # the past of each decode step
    assert runs["dualblade"]["bytes"]["decode_read"] == 2 * 4 * sum(dense) * row
    read_tokens, read_pages, held = 0, 0, {"2": set(), "3": set()}
    nruns, kpu_reads = 0, 0
    for step, ntok in enumerate(dense):
        for layer in ("2", "3"):
            sel = pages[layer][step]
            miss = [p for p in sel if p not in held[layer] or p >= ntok // page]
            held[layer] = {p for p in sel if p < ntok // page}
            read_pages += len(miss)
            read_tokens += sum(min(page, ntok - p * page) for p in miss)
            nruns += 2 * sum(1 for i, p in enumerate(miss) if i == 0 or miss[i - 1] != p - 1)   # K and V
            kpu_reads += 2 if miss else 0
    sel_run = runs[f"dualblade@keys:0.5,page={page}"]
    assert sel_run["bytes"]["decode_read"] == 2 * (2 * sum(dense) + read_tokens) * row
    assert sel_run["select"]["pages_read"] == read_pages
    # the runs of one KPU go in one request (protocol 6), as the runner's BladedKV.read_runs sends them
    assert (sel_run["select"]["runs"], sel_run["select"]["requests"]) == (nruns, kpu_reads)
    assert sel_run["select"]["pages"] == sum(len(p) for layer in pages.values() for p in layer)
    assert sel_run["verify"]["errors"] == 0 and sel_run["verify"]["checked"] > 0
