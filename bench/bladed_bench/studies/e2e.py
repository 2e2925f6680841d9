"""Tokens per second of a real model whose KV cache does not fit in memory: bladed against what a user would
run instead (FlexLLMGen's mmap offload, the KV in RAM), under real memory limits (docs/benchmarks.md).

::

    sudo tools/bench_e2e.py run                                   # SmolLM2-135M on the CPU, 5 limits, 3 reps
    sudo tools/bench_e2e.py run --workload opt-6.7b               # OPT-6.7B's shape, random fp16, on CUDA
    tools/bench_e2e.py report docs/bench/e2e-smollm2-*.json       # the tables (and --plot) again from a JSON

Each run is one ``bladed-runner`` process on one side: ``memory`` (the in-RAM ideal), ``mmap`` (FlexLLMGen's
``TorchDisk``: a ``.npy`` memmap per KPU), bladed's ``baseline``, ``cachepolicy``, ``direct``, ``dualblade``
modes and ``dualblade-q8``. The process that owns the KV's page cache (bladed's daemon, the mmap owner) runs
in a fresh memory cgroup whose hard limit is a fraction of the run's KV set (``--limits``); the runner, with
the model's weights and activations, stays outside it. Runs are cold (caches dropped), sides alternate in a
rotating order, every limit is repeated ``--reps`` times; medians with their spread. The harness is
``bench/bladed_bench/e2e.py`` (its docstring says exactly what is measured and how). Needs root for the
cgroups and for dropping caches (without root: no limits, warm runs, and the JSON says so).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from bladed_bench.e2e import (
    SELECT_SUFFIX,
    SIDES,
    WORKLOADS,
    E2EPlan,
    markdown,
    parse_side,
    plot,
    run_e2e,
)
from bladed_bench.repo import REPO as ROOT


def _fractions(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None
    if not out or any(x <= 0 for x in out):
        raise argparse.ArgumentTypeError(f"give positive fractions of the KV set, e.g. 0.25,0.5,1,1.25 (got {text!r})")
    return out


def _sides(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    try:
        for s in out:
            parse_side(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not out or "memory" not in out:
        raise argparse.ArgumentTypeError("the sides must include memory (the reference tokens and the ideal)")
    return out


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog or "tools/bench_e2e.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the sweep, write its JSON, print its tables")
    r.add_argument("--workload", choices=sorted(WORKLOADS), default="smollm2",
                   help="smollm2: SmolLM2-135M on the CPU, float32, batch 12, prompt 1024, 16 tokens (KV 0.54 GiB); "
                        "opt-6.7b: OPT-6.7B's shape with random fp16 weights on CUDA, batch 8, prompt 1024, 32 "
                        "tokens (KV 4.1 GiB); tiny: a tiny random LLaMA, for the test (default: smollm2)")
    for flag, what in (("--model", "the runner's --model"), ("--device", "cpu or cuda"),
                       ("--dtype", "float32, float16 or bfloat16")):
        r.add_argument(flag, default=None, help=f"{what}, instead of the workload's")
    for flag in ("--batch", "--prompt-len", "--gen-len", "--prefetch"):
        r.add_argument(flag, type=int, default=None, help="instead of the workload's")
    r.add_argument("--sides", type=_sides, default=list(SIDES),
                   help=f"comma-separated (default: {','.join(SIDES)}); a side may carry a KV format (dualblade-q4)")
    r.add_argument("--limits", type=_fractions, default=[0.25, 0.5, 0.75, 1.0, 1.25],
                   help="the KV owner's memory limits, as fractions of the run's KV set (default: "
                        "0.25,0.5,0.75,1,1.25)")
    r.add_argument("--owner-allowance", type=float, default=None, metavar="MIB",
                   help="the KV owner's own memory added to every limit, in MiB (default: 48 MiB for its interpreter "
                        "and libraries plus one staging slot per copy thread)")
    r.add_argument("--reps", type=int, default=3, help="repetitions of every side at every limit (default: 3)")
    r.add_argument("--select", default=None, metavar="SPEC[;SPEC...]",
                   help="the runner's --kv-select for the sides named <side>@sel (the first), <side>@sel2 (the "
                        "second), ... (docs/kv-select.md), e.g. --sides memory,dualblade,dualblade@sel --select "
                        "keys:0.25")
    r.add_argument("--workdir", default="/var/tmp/bladed-e2e",
                   help="the stores, the .npy files and the converted model (default: /var/tmp/bladed-e2e: on the "
                        "disk under test)")
    r.add_argument("--no-drop", action="store_true", help="do not drop the page cache before each run (warm runs)")
    r.add_argument("--no-settle", action="store_true",
                   help="do not wait for the device and free page reporting to go quiet before each run")
    r.add_argument("--timeout", type=float, default=1800.0, help="seconds one runner process may take")
    r.add_argument("--json", default=None, metavar="FILE",
                   help="the JSON (default: docs/bench/e2e-<workload>-<UTC time>.json)")
    r.add_argument("--plot", default=None, metavar="PNG", help="the plot (default: beside the JSON, .png)")
    r.add_argument("--note", action="append", default=[], metavar="KEY=VALUE", help="a note kept in the JSON")
    rp = sub.add_parser("report", help="the tables (and a plot) from a JSON")
    rp.add_argument("json")
    rp.add_argument("--plot", default=None, metavar="PNG")
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = build_parser(prog)
    a = p.parse_args(argv)
    if a.cmd == "report":
        with open(a.json) as f:
            doc = json.load(f)
        print(markdown(doc))
        if a.plot:
            plot(doc, a.plot)
            print(a.plot)
        return 0
    w = WORKLOADS[a.workload]
    over = {k: v for k, v in (("model", a.model), ("device", a.device), ("dtype", a.dtype), ("batch", a.batch),
                              ("prompt_len", a.prompt_len), ("gen_len", a.gen_len), ("prefetch", a.prefetch))
            if v is not None}
    w = dataclasses.replace(w, **over)
    if a.reps < 1:
        print(f"{p.prog}: error: --reps must be at least 1", file=sys.stderr)
        return 2
    selects = [x.strip() for x in (a.select or "").split(";") if x.strip()]
    if any(SELECT_SUFFIX in s for s in a.sides) != bool(selects):
        print(f"{p.prog}: error: --select goes with sides named <side>{SELECT_SUFFIX} (and they with it)",
              file=sys.stderr)
        return 2
    from bladed.kvselect import SelectError, parse_select

    for spec in selects:
        try:
            parse_select(spec, "--select")
        except SelectError as e:
            print(f"{p.prog}: error: {e}", file=sys.stderr)
            return 2
    notes = dict(n.partition("=")[::2] for n in a.note)
    plan = E2EPlan(workload=w, sides=a.sides, fractions=a.limits, reps=a.reps, workdir=a.workdir,
                   drop=not a.no_drop, settle=not a.no_settle, timeout_s=a.timeout, notes=notes, select=selects,
                   allowance=None if a.owner_allowance is None else int(a.owner_allowance * (1 << 20)))
    out = a.json or os.path.join(ROOT, "docs", "bench",
                                 time.strftime(f"e2e-{w.name}-%Y-%m-%dT%H%MZ.json", time.gmtime()))
    png = a.plot or os.path.splitext(out)[0] + ".png"
    doc = run_e2e(plan, out, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(markdown(doc))
    plot(doc, png)
    print(f"{out}\n{png}")
    return 0 if doc["summary"]["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
