"""The harness's command line: ``bladectl bench STUDY`` / ``python -m bladed_bench STUDY`` for every study of
:mod:`bladed_bench.studies`; the KV sweep's own (``sweep``, ``run`` and ``report``) are here."""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import sys
from typing import Any

from bladed_bench import trials
from bladed_bench.repo import REPO
from bladed_bench.stats import parse_size
from bladed_bench.workload import CONFIGS, WorkloadSpec

GiB = 1 << 30
MiB = 1 << 20
PIPELINES = ("adaptive", "intra", "cross", "off")
DMA_MODES = ("none", "model", "copy")


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None


def _names(choices: tuple[str, ...]) -> Any:
    def parse(text: str) -> list[str]:
        out = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in out if x not in choices]
        if bad or not out:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)} (got {text!r})")
        return out

    return parse


def _workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (default: OPT-6.7B layer shape, ~2 GiB KV set)")
    g.add_argument("--layers", type=int, default=32)
    g.add_argument("--batch", type=int, default=8)
    g.add_argument("--kv-heads", type=int, default=32)
    g.add_argument("--head-dim", type=int, default=128)
    g.add_argument("--dtype-bytes", type=int, default=2)
    g.add_argument("--prompt-len", type=int, default=512)
    g.add_argument("--gen-len", type=int, default=6, help="tokens generated (prefill + gen_len-1 decode steps)")
    g.add_argument("--channels", type=int, default=2, help="copy threads / channels")
    g.add_argument("--compute-ms", type=float, default=0.0, help="modelled compute per layer per decode step")
    g.add_argument("--prefill-compute-ms", type=float, default=0.0, help="modelled compute per layer in prefill")
    g.add_argument("--dma", choices=DMA_MODES, default="none",
                   help="slot<->GPU copies: nothing (pure KV I/O, what T_ideal models), modelled time, or a real "
                        "host memcpy")
    g.add_argument("--dma-gbps", type=float, default=25.0, help="modelled DMA rate (PCIe 5.0 x8 class)")


def _configs(text: str) -> list[str]:
    """``--configs``: names of CONFIGS, each optionally with a KV format (``dualblade-q8``, ``baseline-q8``)."""
    from bladed.kvformat import KVFormatError, kv_format

    out = [x.strip() for x in text.split(",") if x.strip()]
    for name in out:
        config, _, fmt = name.removesuffix("@sel").partition("-")
        if config not in CONFIGS:
            raise argparse.ArgumentTypeError(f"{name!r}: choose from {', '.join(CONFIGS)}, each optionally with a "
                                             "KV format (dualblade-q8)")
        if fmt:
            try:
                kv_format(fmt)
            except KVFormatError as e:
                raise argparse.ArgumentTypeError(f"{name!r}: {e}") from None
    if not out:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(CONFIGS)} (got {text!r})")
    return out


def _trace_spec(path: str) -> str:
    """The ``bladed.kvselect`` spec a selection trace was recorded with."""
    try:
        with open(path) as f:
            return str(json.load(f)["spec"])
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"--select-trace {path}: not a trace of tools/bench_kv_select.py --trace ({e})") from None


def _spec(a: argparse.Namespace, pipeline: str) -> WorkloadSpec:
    return WorkloadSpec(layers=a.layers, batch=a.batch, kv_heads=a.kv_heads, head_dim=a.head_dim,
                        dtype_bytes=a.dtype_bytes, prompt_len=a.prompt_len, gen_len=a.gen_len, channels=a.channels,
                        pipeline=pipeline, compute_ms=a.compute_ms, prefill_compute_ms=a.prefill_compute_ms,
                        dma=a.dma, dma_gbps=a.dma_gbps)


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None
    return tqdm(total=total, unit="run", dynamic_ncols=True, file=sys.stderr)


def cmd_sweep(a: argparse.Namespace) -> int:
    from bladed_bench.report import load, write_report
    from bladed_bench.sweep import SweepPlan, default_points, run_sweep

    if a.gen_len < 2:
        raise SystemExit("--gen-len must be at least 2 (one decode step)")
    spec = _spec(a, a.pipelines[0])
    limits = [int(x * GiB) for x in a.limits]
    pts = default_points(a.configs, limits, a.pipelines, pp_limits=[int(x * GiB) for x in a.pp_limits],
                         alphas=a.alphas, kv_bytes=spec.kv_bytes, kpu_bytes=spec.kpu_bytes,
                         headroom_limits=[int(x * GiB) for x in a.headroom_limits], headroom_frac=a.headroom_frac,
                         alpha_dma=a.alpha_dma, noreplan_limits=[int(x * GiB) for x in a.noreplan_limits],
                         portable_limits=[int(x * GiB) for x in a.portable_limits],
                         select_traces=[(_trace_spec(t), t) for t in a.select_trace or []])
    plan = SweepPlan(spec=spec, points=pts, reps=a.reps, workdir=a.workdir, fio_size=a.fio_size,
                     pc_probe_size=a.pc_probe_size, drop=not a.no_drop, keep_series=a.keep_series,
                     settle=not a.no_settle, memory_settle=not a.no_memory_settle,
                     codec_charge=a.codec_charge == "measured", notes={"argv": sys.argv[1:]})
    if any(c.endswith("@sel") for c in a.configs) != bool(a.select_trace):
        raise SystemExit("--select-trace goes with configurations named <config>@sel (and they with it)")
    if os.geteuid() != 0:
        print("warning: not root: no memory cgroups (the limits are not applied) and caches are not dropped",
              file=sys.stderr)
    out = a.json or os.path.join(REPO, "docs", "bench", f"kv-sweep-{dt.datetime.now(dt.UTC):%Y-%m-%dT%H%MZ}.json")
    print(f"KV set {spec.kv_bytes / GiB:.2f} GiB, {len(pts)} points x {a.reps} reps = {plan.total_runs} runs "
          f"-> {out}", file=sys.stderr)
    bar = _progress(plan.total_runs)
    try:
        doc = run_sweep(plan, out, bar=bar)
    finally:
        if bar is not None:
            bar.close()
    if any(p.select for p in pts):            # issue 47: the sparse points against their dense ones
        from bladed_bench.sweep import select_summary

        doc["select_summary"] = select_summary(doc)
        trials.write_json(out, doc, newline=True)
        for row in doc["select_summary"]:
            m = row["decode_time_over_dense"]
            print(f"{row['limit_bytes'] / GiB:.2f} GiB {row['point']}: decode ÷ dense {m['median']:.3f} "
                  f"[{m['min']:.3f}-{m['max']:.3f}], read {row['read_bytes_per_step'] / MiB:.1f} of "
                  f"{row['dense_read_bytes_per_step'] / MiB:.1f} MiB a step", file=sys.stderr)
    if a.report:
        for f in write_report(load([out]), a.report):
            print(f, file=sys.stderr)
    return 0


def cmd_run(a: argparse.Namespace) -> int:
    from bladed_bench.sweep import Point, SweepPlan, SweepRunner

    spec = _spec(a, a.pipeline)
    limit = int(a.limit * GiB) if a.limit else None
    p = Point("sweep", a.config, a.pipeline, limit,
              budget_override=int(a.budget_override) if a.budget_override is not None else None)
    runner = SweepRunner(SweepPlan(spec=spec, points=[p], reps=1, workdir=a.workdir, drop=not a.no_drop))
    rec = runner.run_point(p, 0, keep_series=False)
    keys = ("config", "pipeline", "limit_bytes", "prefill_s", "decode_s", "step_s", "hit_ratio", "hit_by_group",
            "throughput", "busy", "cpu", "pipeline_report", "verify", "cgroup")
    out = {k: rec.get(k) for k in keys}
    out["plan"] = {k: v for k, v in (rec.get("target", {}).get("plan") or {}).items()
                   if k in ("budget_bytes", "group1_layers", "group1_bytes", "direct_bytes", "paths")}
    out["latency_ms"] = {k: {kk: v.get(kk) for kk in ("n", "avg_ms", "p99_ms")}
                         for k, v in rec.get("latency", {}).items() if v.get("n")}
    text = json.dumps(out, indent=1, default=str)
    if a.json:
        trials.write_json(a.json, rec, default=str)
    print(text)
    return 0


def cmd_report(a: argparse.Namespace) -> int:
    from bladed_bench.report import load, write_report

    doc = load(a.inputs)
    for f in write_report(doc, a.out, png_prefix=a.png_prefix):
        print(f)
    return 0


def build_parser(prog: str = "bench_kv") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description="Reproduce the Dual-Blade evaluation (memory-limit "
                                 "sweeps, thrashing cliff, per-tensor latency, device utilisation, pipeline).")
    sub = ap.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("sweep", help="the full sweep (root: cgroups and drop_caches)")
    _workload_args(s)
    s.add_argument("--limits", type=_floats, default=[0.5, 1.0, 1.5, 2.0, 2.5, 3.0], help="GiB, comma-separated")
    s.add_argument("--codec-charge", choices=("measured", "none"), default="measured",
                   help="KV formats: charge this CPU's measured quantize/dequantize time to each run, or none "
                        "(the storage side alone, as where a GPU quantizes)")
    s.add_argument("--configs", type=_configs, default=list(CONFIGS),
                   help="comma-separated; each may name a KV format: dualblade-q8, dualblade-q4, baseline-q8 "
                        "(issue 31; the runs are charged this CPU's measured quantize/dequantize time, unless "
                        "--codec-charge none), and end in @sel for --select's sparse reads: dualblade@sel")
    s.add_argument("--select-trace", default=None, type=lambda t: [x for x in t.split(",") if x],
                   metavar="FILE[,FILE...]",
                   help="sparse decode reads (issue 47, docs/kv-select.md) of the configurations named <config>@sel: "
                        "one point per file, each the pages a model selected per layer and position with its spec "
                        "(tools/bench_kv_select.py --trace SPEC --trace-prompt PROMPT_LEN --out FILE); the spec's "
                        "page, dense layers and reuse apply")
    s.add_argument("--pipelines", type=_names(PIPELINES), default=["adaptive", "off"],
                   help="first: the main sweep's; the others for the on/off and alpha studies")
    s.add_argument("--pp-limits", type=_floats, default=[1.0], help="limits (GiB) of the P·P on/off study")
    s.add_argument("--headroom-limits", type=_floats, default=[],
                   help="limits (GiB) where Dual-Blade also runs with a budget below Eq. 1-2's ('' for none)")
    s.add_argument("--portable-limits", type=_floats, default=[],
                   help="limits (GiB) of the portable-engine study: Dual-Blade on io.engine = portable (issue 29)")
    s.add_argument("--noreplan-limits", type=_floats, default=[0.5, 1.0, 2.0],
                   help="limits (GiB) where Dual-Blade also runs with budget.live_replan = false ('' for none)")
    s.add_argument("--headroom-frac", type=float, default=0.05, help="that budget: this fraction of the limit less")
    s.add_argument("--alphas", type=_floats, default=[0.3, 0.5, 0.7], help="Table V tiering ratios ('' for none)")
    s.add_argument("--alpha-dma", choices=DMA_MODES, default="model",
                   help="DMA of the alpha study (the pipeline overlaps storage reads with it)")
    s.add_argument("--reps", type=int, default=5)
    s.add_argument("--workdir", default="/var/tmp/bladed-bench", help="KV store, page-cache files, fio files")
    s.add_argument("--fio-size", type=functools.partial(parse_size, fractions=True), default=GiB)
    s.add_argument("--pc-probe-size", type=functools.partial(parse_size, fractions=True), default=512 * MiB)
    s.add_argument("--keep-series", choices=("all", "lowest", "none"), default="lowest")
    s.add_argument("--no-drop", action="store_true", help="do not drop caches between runs")
    s.add_argument("--no-settle", action="store_true",
                   help="do not wait for the disk to go idle (writeback, discards), nor for free page "
                        "reporting to hand freed memory back to the host, before every run")
    s.add_argument("--no-memory-settle", action="store_true",
                   help="wait for the disk only, not for free page reporting (the sweeps before 2026-11-24T0457Z)")
    s.add_argument("--json", help="output JSON (default docs/bench/kv-sweep-<UTC date>.json)")
    s.add_argument("--report", help="also write the Markdown report (and PNGs next to it) here")
    s.set_defaults(fn=cmd_sweep)

    r = sub.add_parser("run", help="one configuration at one limit, summary to stdout")
    _workload_args(r)
    r.add_argument("--config", choices=CONFIGS, default="dualblade")
    r.add_argument("--pipeline", choices=PIPELINES, default="adaptive")
    r.add_argument("--limit", type=float, default=0.0, help="GiB (0: no limit)")
    r.add_argument("--budget-override", type=functools.partial(parse_size, fractions=True), default=None)
    r.add_argument("--workdir", default="/var/tmp/bladed-bench")
    r.add_argument("--no-drop", action="store_true")
    r.add_argument("--json", help="write the full run record here")
    r.set_defaults(fn=cmd_run)

    p = sub.add_parser("report", help="Markdown tables and PNG figures from sweep JSON(s)")
    p.add_argument("inputs", nargs="+")
    p.add_argument("--out", default=os.path.join(REPO, "docs", "bench", "kv-report.md"))
    p.add_argument("--png-prefix", default="kv")
    p.set_defaults(fn=cmd_report)
    return ap


def kv_main(argv: list[str] | None = None, prog: str = "bench_kv") -> int:
    """The KV sweep's subcommands: ``sweep``, ``run`` and ``report``."""
    a = build_parser(prog).parse_args(argv)
    return int(a.fn(a))


def usage(prog: str) -> str:
    """``--help``: every study, one line each."""
    from bladed_bench.studies import STUDIES

    width = max(len(n) for n in STUDIES)
    lines = [f"usage: {prog} STUDY [ARGS ...]", "",
             "Reproduce the Dual-Blade evaluation and bladed's other measurements (docs/benchmarks.md).", "",
             "studies:"]
    lines += [f"  {s.name:<{width}}  {s.description}" for s in STUDIES.values()]
    lines += ["", f"`{prog} STUDY --help`: the options of one study."]
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "bench_kv") -> int:
    """``STUDY [ARGS ...]``: run one study of :mod:`bladed_bench.studies` (its module imported only then)."""
    from bladed_bench.studies import STUDIES, run

    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] in (["-h"], ["--help"]):
        print(usage(prog))
        return 0
    if not args:
        print(usage(prog), file=sys.stderr)
        return 2
    name = args[0]
    if name not in STUDIES:
        print(f"{prog}: unknown study {name!r} (choose from {', '.join(STUDIES)})", file=sys.stderr)
        return 2
    # the KV sweep's subcommands keep their parser's prog (`bladectl bench sweep`); the others get theirs
    return run(name, args[1:], prog=prog if STUDIES[name].subcommand else f"{prog} {name}")


if __name__ == "__main__":
    sys.exit(main())
