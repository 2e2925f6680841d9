"""tools/bench_engine.py (``bladectl bench engine``, bench/bladed_bench/studies/engine.py) runs end to end
against fio and writes well-formed results.

No timing assertions: speed targets are benchmarks (docs/benchmarks.md), not tests.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from bladed_bench.studies import engine as bench

TOOL = pathlib.Path(__file__).resolve().parent.parent / "tools" / "bench_engine.py"   # the shim the docs quote


def test_parse_and_format_sizes() -> None:
    assert bench.parse_size("4096") == 4096
    assert bench.parse_size("128K") == 128 << 10
    assert bench.parse_size("1m") == 1 << 20
    assert bench.parse_size("1GiB") == 1 << 30
    for bad in ("", "1X", "-1M", "0"):
        with pytest.raises(Exception):  # noqa: B017 - argparse.ArgumentTypeError
            bench.parse_size(bad)
    assert [bench.human_size(n) for n in (128 << 10, 1 << 20, 1 << 30, 1000)] == ["128K", "1M", "1G", "1000"]


def test_tool_order() -> None:
    tools = ["engine", "fio"]
    assert [bench.tool_order(tools, r, "rotate") for r in range(3)] == [
        ["engine", "fio"], ["fio", "engine"], ["engine", "fio"]]
    assert bench.tool_order(tools, 1, "fixed") == ["engine", "fio"]


def test_bad_arguments_are_refused(tmp_path: pathlib.Path) -> None:
    proc = subprocess.run([sys.executable, str(TOOL), "--target-dir", str(tmp_path), "--size", "6M",
                           "--tensor-size", "4M"], capture_output=True, text=True)
    assert proc.returncode == 2 and "multiple of --tensor-size" in proc.stderr
    proc = subprocess.run([sys.executable, str(TOOL), "--size", "8M"], capture_output=True, text=True)
    assert proc.returncode == 2


def test_end_to_end_small(store_dir: str, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--target-dir", store_dir, "--size", "8M", "--tensor-size", "4M",
         "--command-sizes", "128K,1M", "--reps", "2", "--extra", "engine-4k,fio-batch",
         "--json", str(out), "--markdown"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    # a progress line per step, the table on stdout
    steps = 2 * 2 * 2 * 4
    assert proc.stderr.count(f"/{steps}] rep ") == steps
    assert "| target | op | command | QD | engine MB/s | fio MB/s |" in proc.stdout
    assert not os.path.exists(os.path.join(store_dir, bench.FILE_NAME)), "benchmark file left behind"

    res = json.loads(out.read_text())
    assert res["schema"] == bench.SCHEMA
    assert res["date"] and res["wall_seconds"] > 0
    m = res["machine"]
    assert m["cpus"] >= 1 and m["memory_bytes"] > 0 and m["kernel"] and "cpu_model" in m
    sw = res["software"]
    assert sw["fio"].startswith("fio-") and "version" in sw["liburing"]
    cfg = res["config"]
    assert cfg["tensors"] == 2 and cfg["queue_depth"] == 32
    assert cfg["tools"] == ["engine", "fio", "engine-4k", "fio-batch"]
    (target,) = res["targets"]
    assert target["kind"] == "file" and target["prefill"]["mb_s"] > 0
    assert target["info"]["filesystem"]["fstype"]

    assert len(res["runs"]) == steps
    for r in res["runs"]:
        assert r["bytes"] == 8 << 20 and r["seconds"] > 0 and r["mb_s"] > 0
        assert r["tool"] in cfg["tools"] and r["op"] in ("write", "read")
        if r["tool"].startswith("fio"):
            assert r["fio"]["io_bytes"] == 8 << 20
            assert "--direct=1" in r["fio"]["args"] and "--fixedbufs=1" in r["fio"]["args"]
        else:
            assert r["engine"]["commands"] == (8 << 20) // r["command_bytes"]
            assert r["engine"]["registered_buffers"] is True
        if r["op"] == "read":
            assert r["cached_pages_before"] in (0, None)
    # rotation: the second repetition of a row starts with the tool the first began second with
    first = [r["tool"] for r in res["runs"] if r["rep"] == 0][:4]
    second = [r["tool"] for r in res["runs"] if r["rep"] == 1][:4]
    assert second == first[1:] + first[:1]

    assert [(r["op"], r["command_bytes"]) for r in res["rows"]] == [
        ("write", 128 << 10), ("write", 1 << 20), ("read", 128 << 10), ("read", 1 << 20)]
    for row in res["rows"]:
        assert row["queue_depth"] == 32
        for key in ("engine_mb_s", "fio_mb_s"):
            s = row[key]
            assert s["n"] == 2 and s["min"] <= s["median"] <= s["max"]
        assert row["ratio"] == pytest.approx(row["engine_mb_s"]["median"] / row["fio_mb_s"]["median"])
        assert row["paired_ratio"]["n"] == 2
        assert isinstance(row["meets_target"], bool)
        assert set(row["tools"]) == set(cfg["tools"])
        assert row["tools"]["fio"]["ratio_to_fio"] == pytest.approx(1.0)

    # --render recomputes the summary from the saved runs and prints the same Markdown
    again = subprocess.run([sys.executable, str(TOOL), "--render", str(out)], capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert again.stdout == proc.stdout
