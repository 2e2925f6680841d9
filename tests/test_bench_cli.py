"""One command for every benchmark study (issue 48): ``bladectl bench STUDY`` / ``python -m bladed_bench STUDY``
(``bench/bladed_bench/studies``), the ``tools/bench_*.py`` shims, and the one home of the studies' statistics
(``bladed_bench.stats``). No study runs here: only their ``--help`` (benchmarks are not tests)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import pytest
from bladectl_util import bladectl
from daemon_util import ROOT, env_with_repo, short_tmpdir

from bladed_bench import stats
from bladed_bench.main import main
from bladed_bench.studies import STUDIES

#: the harness of this checkout first, whatever the interpreter has installed
ENV = {"PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "bench")])}
#: the shims the docs quote, by study
SHIMS = {s.name: s.tool.split()[0] for s in STUDIES.values()}
#: what the studies import at the top that a listing must not (slow, or absent on a small install)
HEAVY = ("torch", "transformers", "matplotlib")


@pytest.fixture(scope="module")
def nowhere() -> Iterator[str]:
    with short_tmpdir() as tmp:
        yield tmp


def test_every_study_named_in_the_issue_is_registered() -> None:
    issue = ("sweep", "run", "report", "e2e", "wear", "engine", "requests", "prefix", "codec", "pagecache-write",
             "copy-limit", "accuracy", "host-faults", "pipeline-trial", "delta", "select", "select-io", "spike",
             "runner", "vllm")
    assert set(STUDIES) == set(issue)
    for s in STUDIES.values():
        assert s.description and "\n" not in s.description, s
        assert (pathlib.Path(ROOT) / s.tool.split()[0]).is_file(), s.tool
        assert importlib.util.find_spec(s.module) is not None, s.module


def test_bladectl_bench_help_lists_every_study(nowhere: str) -> None:
    r = bladectl("bench", "--help", cwd=nowhere, env=ENV)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: bladectl bench STUDY"), r.stdout
    for s in STUDIES.values():
        assert f"\n  {s.name} " in r.stdout and s.description in r.stdout, (s.name, r.stdout)


def test_the_listing_imports_no_study(nowhere: str) -> None:
    """``--help`` imports no study's module (some import torch at the top)."""
    code = ("import sys; from bladed_bench.main import main; rc = main(['--help'], prog='x'); "
            f"print(sorted(m for m in sys.modules if m.startswith('bladed_bench.studies.') or m in {HEAVY!r}))")
    e = env_with_repo()
    e.update(ENV)
    r = subprocess.run([sys.executable, "-c", code], cwd=nowhere, env=e, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "[]", r.stdout


def test_an_unknown_study_is_one_line_and_exit_2(nowhere: str) -> None:
    r = bladectl("bench", "no-such-study", "--x", cwd=nowhere, env=ENV)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "no-such-study" in lines[0] and "sweep" in lines[0] and "select-io" in lines[0], lines
    assert r.stdout == ""


@pytest.mark.parametrize("name", list(STUDIES))
def test_every_study_has_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``bladectl bench STUDY --help`` exits 0 with the study's usage (run in this process: several import torch)."""
    with pytest.raises(SystemExit) as e:
        main([name, "--help"], prog="bladectl bench")
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: bladectl bench {name} ")


@pytest.mark.parametrize("name", ["e2e", "delta", "sweep"])
def test_bladectl_and_python_m_and_the_shim_run_a_study(name: str, nowhere: str) -> None:
    r = bladectl("bench", name, "--help", cwd=nowhere, env=ENV)
    assert r.returncode == 0 and r.stdout.startswith(f"usage: bladectl bench {name} "), r.stderr
    e = env_with_repo()
    e.update(ENV)
    m = subprocess.run([sys.executable, "-m", "bladed_bench", name, "--help"], cwd=nowhere, env=e,
                       capture_output=True, text=True, timeout=120)
    assert m.returncode == 0 and m.stdout.startswith(f"usage: python -m bladed_bench {name} "), m.stderr
    shim = SHIMS[name]
    args = [name] if shim == "tools/bench_kv.py" else []
    t = subprocess.run([sys.executable, os.path.join(ROOT, shim), *args, "--help"], cwd=nowhere,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, capture_output=True, text=True,
                       timeout=120)
    assert t.returncode == 0 and t.stdout.startswith(f"usage: {shim} "), t.stderr


def test_the_docs_name_every_study() -> None:
    text = (pathlib.Path(ROOT) / "docs" / "benchmarks.md").read_text()
    for s in STUDIES.values():
        assert f"| `bladectl bench {s.name}` | `{s.tool}` |" in text, s.name


def test_every_shim_is_a_shim() -> None:
    """``tools/bench_*.py`` only run their study (no copy of a study's code is left in tools/)."""
    for shim in set(SHIMS.values()):
        text = (pathlib.Path(ROOT) / shim).read_text()
        assert len(text.splitlines()) <= 8 and "import _bench" in text, shim


# -- bladed_bench.stats --------------------------------------------------------------------------------------------

def test_summarize_skips_missing_values_unless_told() -> None:
    s = stats.summarize([3.0, None, 1.0, float("nan"), 2.0])
    assert (s["n"], s["median"], s["min"], s["max"], s["spread_pct"]) == (3, 2.0, 1.0, 3.0, 100.0)
    assert "values" not in s
    assert stats.summarize([]) == {"n": 0, "median": None, "min": None, "max": None, "spread_pct": None}
    kept = stats.summarize([100, 300, 200], keep_values=True, skip_missing=False)
    assert kept["values"] == [100, 300, 200] and kept["median"] == 200
    assert stats.summarize([], keep_values=True)["values"] == []
    assert stats.summarize([0.0, 0.0])["spread_pct"] is None


def test_median_range_and_fmt() -> None:
    assert stats.median_range([None]) is None
    m = stats.median_range([2.0, None, 1.0, 4.0])
    assert m == {"median": 2.0, "min": 1.0, "max": 4.0, "n": 3}
    assert stats.fmt(m) == "2.00 [1.00-4.00]" and stats.fmt(m, 1, 10.0, spread=False) == "20.0"
    assert stats.fmt(stats.median_range([1.5])) == "1.50" and stats.fmt(None) == "-"
    assert stats.fmt(stats.summarize([])) == "-"
    assert stats.median_range([3.0, 1.0], count=False) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert stats.median([3.0, None, 1.0]) == 2.0 and stats.median([None]) is None
    assert stats.median([], default=-1.0) == -1.0


def test_percentile_and_latency() -> None:
    assert stats.percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5) and stats.percentile([], 50) is None
    lat = stats.latency_stats([0.001, 0.003])
    assert lat["n"] == 2 and lat["avg_ms"] == pytest.approx(2.0) and lat["max_ms"] == pytest.approx(3.0)
    assert stats.latency_stats([])["avg_ms"] is None


def test_ok_runs_and_paired_within_a_round() -> None:
    doc = {"runs": [
        {"round": 0, "limit": 1, "side": "a", "t": 2.0}, {"round": 0, "limit": 1, "side": "b", "t": 4.0},
        {"round": 1, "limit": 1, "side": "a", "t": 3.0}, {"round": 1, "limit": 1, "side": "b", "t": 0.0},
        {"round": 2, "limit": 1, "side": "a", "t": None}, {"round": 2, "limit": 1, "side": "b", "t": 1.0},
        {"round": 3, "limit": 1, "side": "b", "t": 1.0}, {"round": 4, "limit": 1, "side": "a", "error": "x"},
        {"round": 5, "limit": 2, "side": "a", "t": 9.0}, {"round": 5, "limit": 2, "side": "b", "t": 3.0}]}
    assert len(stats.ok_runs(doc)) == 9 and len(stats.ok_runs(doc, limit=2)) == 2
    assert stats.ok_runs(doc, side="a", kv_format=None)[0]["t"] == 2.0
    got = stats.paired(stats.ok_runs(doc), "a", "b", name=lambda r: r["side"], group=lambda r: r["round"],
                       value=lambda r: r.get("t"))
    assert got == {0: [0.5], 5: [3.0]}       # a zero or missing denominator, a missing numerator: nothing
    by_fn = stats.paired(stats.ok_runs(doc), "a", lambda by: 10.0, name=lambda r: r["side"],
                         group=lambda r: (r["round"], r["limit"]), value=lambda r: r.get("t"))
    assert by_fn == {(0, 1): [0.2], (1, 1): [0.3], (5, 2): [0.9]}


def test_parse_size_both_ways() -> None:
    assert stats.parse_size("4096") == 4096 and stats.parse_size("128K") == 128 << 10
    assert stats.parse_size("1GiB") == 1 << 30 and stats.parse_size("2T") == 2 << 40
    for bad in ("", "1X", "-1M", "0", "1.5G"):
        with pytest.raises(Exception):  # noqa: B017 - argparse.ArgumentTypeError
            stats.parse_size(bad)
    assert stats.parse_size("1.5G", fractions=True) == 3 << 29 and stats.parse_size("0", fractions=True) == 0
    assert stats.parse_size("512MiB", fractions=True) == 512 << 20
    with pytest.raises(Exception):  # noqa: B017
        stats.parse_size("1T", fractions=True)
    # the copy-limit study's --size: a bare number in GiB; a memory limit of 0: none
    assert stats.parse_size("1.5", fractions=True, unit=stats.GiB) == 3 << 29
    assert stats.parse_size("512M", fractions=True, unit=stats.GiB) == 512 << 20
    assert stats.parse_size("0", zero=True) == 0 and stats.parse_size("3G", zero=True) == 3 << 30
    assert [stats.human_size(n) for n in (128 << 10, 1 << 20, 1 << 30, 1000)] == ["128K", "1M", "1G", "1000"]


# -- bladed_bench.trials -------------------------------------------------------------------------------------------

def test_williams_rows_put_every_point_in_every_position_and_after_every_other() -> None:
    from bladed_bench import trials

    for n in (2, 4, 6):
        rows = [trials.williams(n, rep) for rep in range(n)]
        assert all(sorted(r) == list(range(n)) for r in rows)
        assert all(sorted(r[i] for r in rows) == list(range(n)) for i in range(n))     # every position once
        follows = {(r[i], r[i + 1]) for r in rows for i in range(n - 1)}
        assert len(follows) == n * (n - 1)                                            # every successor once
    assert trials.williams(1, 3) == [0] and trials.williams(0, 0) == []


def test_abba_and_rotation() -> None:
    from bladed_bench import trials

    assert [trials.abba(("a", "b"), rep) for rep in range(3)] == [["a", "b"], ["b", "a"], ["a", "b"]]
    assert [trials.rotated(["a", "b", "c"], rep) for rep in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert trials.rotated([], 1) == []


def test_the_envelope(tmp_path: pathlib.Path) -> None:
    import json

    from bladed_bench import trials

    m = trials.machine(str(tmp_path), ("bench",))
    assert {"cpu_model", "kernel", "loadavg_start", "disk", "filesystem", "git_commit", "git_dirty",
            "free_page_reporting"} <= set(m)
    bare = trials.machine(None, ("bench",))
    assert "git_commit" in bare and not {"disk", "filesystem", "free_page_reporting"} & set(bare)
    trials.loadavg_end(m)
    assert m["loadavg_end"]
    out = tmp_path / "doc.json"
    trials.write_json(str(out), {"machine": m}, newline=True)
    assert out.read_text().endswith("}\n") and json.loads(out.read_text())["machine"] == m
    assert not (tmp_path / "doc.json.tmp").exists()


# -- the bench daemon's config -------------------------------------------------------------------------------------

def test_a_bench_daemon_setting_bladed_refuses_fails_before_a_daemon_starts(tmp_path: pathlib.Path) -> None:
    from bladed.config import ConfigError
    from bladed_bench.workload import BenchDaemon

    with pytest.raises(ConfigError, match=r"unknown key budget\.absorb_rat"):      # the daemon's own message
        BenchDaemon(str(tmp_path), 64 << 20, extra={"budget": {"absorb_rat": 0}})
    assert not (tmp_path / "bladed.toml").exists() and not (tmp_path / "bladed.sock").exists()
