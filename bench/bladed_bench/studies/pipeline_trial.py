"""A/B of the adaptive pipeline's trial in the KV sweep's workload, alternated in one process.

``old``: ``bladed/pipeline.py`` as of ``--old-rev`` (by default 16a9cf8: the paper's schedule, overlap-intra in
decode iteration 2 and overlap-cross in iteration 3); ``new``: the working tree's (both strategies on alternate
layers of iteration 2).  Each repetition runs every point under both, the order flipped every repetition; each
run is one cold Dual-Blade run of ``bladed_bench.sweep`` (its own fio and page-cache probes, for T_ideal), the
storage side alone (no codec time charged).  Root: memory cgroups and drop_caches.

    sudo python3 tools/ab_pipeline_trial.py --formats q8,q4 --limits 1.0,2.0 --reps 3 --json OUT.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

import bladed_bench.workload as workload
from bladed_bench import trials
from bladed_bench.repo import REPO
from bladed_bench.report import ideal_ratio
from bladed_bench.sweep import Point, SweepPlan, run_sweep
from bladed_bench.workload import WorkloadSpec

GiB = 1 << 30


def old_pipeline(rev: str) -> Any:
    """The AdaptivePipeline class of ``bladed/pipeline.py`` at ``rev``."""
    src = subprocess.run(["git", "-C", REPO, "show", f"{rev}:bladed/pipeline.py"], check=True,
                         capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(prefix="pipeline-old-"), "pipeline_old.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("pipeline_old", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["pipeline_old"] = mod          # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod.AdaptivePipeline


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--old-rev", default="16a9cf8")
    p.add_argument("--formats", default="q8,q4", help="KV formats (fp16 for plain rows)")
    p.add_argument("--limits", default="1.0,2.0", help="GiB")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)
    variants = {"old": old_pipeline(a.old_rev), "new": workload.AdaptivePipeline}
    spec = WorkloadSpec()                  # the KV sweep's default workload: OPT-6.7B's layer shape, adaptive
    out: dict[str, Any] = {"old_rev": a.old_rev, "runs": []}
    with tempfile.TemporaryDirectory(prefix="ab-trial-") as tmp:
        for rep in range(a.reps):
            for fmt in a.formats.split(","):
                for lim in (float(x) for x in a.limits.split(",")):
                    order = trials.abba(["old", "new"], rep)
                    for name in order:
                        workload.AdaptivePipeline = variants[name]  # type: ignore[misc]
                        point = Point("sweep", "dualblade", "adaptive", int(lim * GiB),
                                      kv_format=None if fmt == "fp16" else fmt)
                        path = os.path.join(tmp, f"{name}-{fmt}-{lim}-{rep}.json")
                        run_sweep(SweepPlan(spec=spec, points=[point], reps=1, codec_charge=False,
                                            keep_series="none"), path)
                        with open(path) as f:
                            doc = json.load(f)
                        r = doc["runs"][0]
                        out["runs"].append({"variant": name, "format": fmt, "limit_gib": lim, "rep": rep,
                                            "decode_s": r.get("decode_s"), "ideal_ratio": ideal_ratio(doc, r),
                                            "step_s": r.get("step_s"), "pipeline": r.get("pipeline_report"),
                                            "sweep": doc})
    with open(a.json, "w") as f:
        json.dump(out, f)
    pairs: dict[tuple[str, float, int], dict[str, float]] = {}
    for r in out["runs"]:
        pairs.setdefault((r["format"], r["limit_gib"], r["rep"]), {})[r["variant"]] = r["decode_s"]
    ratios = [v["new"] / v["old"] for v in pairs.values() if v.get("new") and v.get("old")]
    print(f"decode new / old, {len(ratios)} pairs: median {statistics.median(ratios):.3f} "
          f"[{min(ratios):.3f}-{max(ratios):.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
