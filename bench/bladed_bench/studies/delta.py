"""Before/after table of issue 13's sweep rows: two KV-sweep JSONs (tools/bench_kv.py sweep), same workload.

Config against config: the ratio of the medians at each limit (as issue 13 reads a sweep); against the two-tier
ideal T_ideal: runs of the same round (repetition and limit), median over the repetitions; appends: the median
over runs of the per-run average latency, against the sweep's bare in-process io_uring write.

    python3 tools/kv_sweep_delta.py BEFORE.json AFTER.json     # prints a Markdown table
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from bladed_bench import stats

GiB = 1 << 30


def load(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def sweep_runs(d: dict[str, Any]) -> dict[tuple[str, int, int], dict[str, Any]]:
    out = {}
    for r in d["runs"]:
        if r.get("study") == "sweep" and r.get("error") is None and "decode_s" in r:
            out[(r["config"], r["limit_bytes"], r["rep"])] = r
    return out


def paired_at(runs: dict, a: str, b: Any, limit: int, field: str) -> list[float]:
    """At ``limit``: ratios a/b per repetition; b may be a config name or a callable(rep) -> value."""
    den = (lambda by: b(by[a]["rep"])) if callable(b) else b
    by_rep = stats.paired([r for (_, lim, _), r in runs.items() if lim == limit], a, den, name=lambda r: r["config"],
                          group=lambda r: r["rep"], value=lambda r: r[field])
    return [x for xs in by_rep.values() for x in xs]


def ratio_of_medians(runs: dict, a: str, b: str, limit: int, field: str) -> str:
    """median(a) / median(b) over the repetitions at one limit (the issue's way of reading the sweep)."""
    xa = [r[field] for (c, lim, _), r in runs.items() if c == a and lim == limit]
    xb = [r[field] for (c, lim, _), r in runs.items() if c == b and lim == limit]
    return f"{statistics.median(xa) / statistics.median(xb):.2f}" if xa and xb else "-"


def ideal(d: dict[str, Any], runs: dict, limit: int, rep: int) -> float | None:
    """T_ideal = sum over steps of g1/BW_pc + g2/BW_dev, with the same round's fio read and page-cache probe."""
    r = runs.get(("dualblade", limit, rep))
    if r is None:
        return None
    rnd = next((x for x in d["rounds"] if x["rep"] == rep and x["key"][0] == "limit" and x["key"][1] == limit), None)
    if rnd is None or "fio" not in rnd:
        return None
    bw_dev = rnd["fio"]["read_GBps"] * 1e9
    bw_pc = rnd["pagecache"]["GBps"] * 1e9
    t = 0.0
    for step in r["bytes"]["decode_read_per_step"].values():
        t += step["g1"] / bw_pc + step["g2"] / bw_dev
    return t


def table(d: dict[str, Any]) -> dict[str, str]:
    runs = sweep_runs(d)
    limits = sorted({lim for (_, lim, _) in runs})
    row: dict[str, str] = {}
    row["prefill DB/Baseline"] = " / ".join(
        f"{lim / GiB:.1f}: {ratio_of_medians(runs, 'dualblade', 'baseline', lim, 'prefill_s')}" for lim in limits)
    row["decode DB/Baseline"] = " / ".join(
        f"{lim / GiB:.1f}: {ratio_of_medians(runs, 'dualblade', 'baseline', lim, 'decode_s')}" for lim in limits)
    top = limits[-1]
    row[f"decode DB/best single path at {top / GiB:.1f}"] = str(max(
        float(ratio_of_medians(runs, "dualblade", c, top, "decode_s")) for c in ("cachepolicy", "direct")))
    parts = []
    for lim in limits:
        def t_ideal(rep: int, lim: int = lim) -> float | None:
            return ideal(d, runs, lim, rep)
        over_ideal = stats.median_range(paired_at(runs, "dualblade", t_ideal, lim, "decode_s"))
        parts.append(f"{lim / GiB:.1f}: {stats.fmt(over_ideal, spread=False)}")
    row["decode DB/T_ideal"] = " / ".join(parts)
    bare = d.get("reference", {}).get("bare_uring_write", {}).get("avg_ms")
    for path in ("direct",):
        for cond in ("alone", "contended"):
            vals = []
            for (cfg, _lim, _rep), r in runs.items():
                if cfg in ("direct", "dualblade"):
                    lat = r["latency"].get(f"decode_write_{cond}[{path}]")
                    if lat and lat.get("n") and lat.get("avg_ms"):
                        vals.append(lat["avg_ms"])
            row[f"one-token append, {path} path, {cond}: avg ms (x bare io_uring write)"] = (
                f"{statistics.median(vals):.3f} ({statistics.median(vals) / bare:.1f}x of {bare:.3f})"
                if vals and bare else "-")
    return row


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("before", help="KV-sweep JSON (tools/bench_kv.py sweep)")
    p.add_argument("after", help="KV-sweep JSON of the same workload")
    args = p.parse_args(argv)
    old, new = load(args.before), load(args.after)
    a, b = table(old), table(new)
    print(f"| measure | before ({args.before.split('/')[-1]}) | after ({args.after.split('/')[-1]}) |")
    print("| --- | --- | --- |")
    for k in a:
        print(f"| {k} | {a[k]} | {b.get(k, '-')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
