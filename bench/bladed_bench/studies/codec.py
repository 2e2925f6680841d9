"""The q8 / q4 codec's rates on this CPU: the C codec against the torch ops, alternated in one process (issue 40).

For each format, tensor and thread count, every repetition times the C path and the torch path (the order
swapped each repetition) on the same tensor: quantize is ``encode(x, out=rows)`` (into preallocated rows, as
``SlotTensors.put`` does) and dequantize ``decode(rows, out=dst)`` (into a preallocated tensor, as
``SlotTensors.take`` does). A timing is a batch of calls lasting at least ``--min-time`` seconds. Rates are GB/s
of fp16-equivalent bytes (2 bytes per value: the fp16 input of quantize, the fp16 output of dequantize,
whatever ``--dtype``), as the issue's targets are stated; medians and min-max over ``--reps`` repetitions after
one warm-up. Threads: the C codec's ``threads=`` and torch's intra-op threads alike. Prints a table (with the
targets, for the C codec on one thread) and writes the runs as JSON (docs/bench/codec-<UTC time>.json).
Usage: tools/bench_codec.py [--formats q8,q4] [--tensors 8192x3x64,2048x32x128] [--dtype float16] [--reps 7]
                           [--threads 1,2] [--min-time 0.2] [--out FILE|-]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from bladed.kvformat import QuantFormat, codec_info, kv_format
from bladed_bench import stats, trials
from bladed_bench.environment import git_info, machine_info
from bladed_bench.repo import REPO as ROOT

#: the issue's targets for the C codec on one thread, GB/s of fp16: (quantize, dequantize)
TARGETS = {"q8": (3.0, 6.0), "q4": (2.0, 4.0)}
PATHS = ("c", "torch")


def positive_ints(text: str) -> list[int]:
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not out or any(v < 1 for v in out):
        raise argparse.ArgumentTypeError(f"give positive integers, e.g. 1,2 (got {text!r})")
    return out


def tensors(text: str) -> list[tuple[int, int, int]]:
    """``TOKENSxHEADSxHEAD_DIM,...`` (heads: batch x KV heads)."""
    out = []
    for item in text.split(","):
        try:
            n, h, d = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"a tensor is TOKENSxHEADSxHEAD_DIM, e.g. 2048x32x128; got {item!r}") \
                from None
        out.append((n, h, d))
    return out


def timed(call: Callable[[], object], min_time: float) -> tuple[float, int]:
    """Seconds per call of a batch lasting at least ``min_time``, and the batch's size."""
    inner = 1
    while True:
        t = time.perf_counter()
        for _ in range(inner):
            call()
        took = time.perf_counter() - t
        if took >= min_time or inner >= 1 << 20:
            return took / inner, inner
        inner = max(inner * 2, int(inner * min_time / max(took, 1e-9) * 1.2))


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of timings there always are (:func:`bladed_bench.stats.median_range` without the
    count, as the codec JSONs have them)."""
    s = stats.median_range(values, count=False)
    assert s is not None, "no timings"
    return s


def codec_ops(f: QuantFormat, x: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor, path: str,
              threads: int) -> dict[str, Callable[[], object]]:
    """quantize and dequantize of ``f`` on ``path`` into preallocated memory."""
    return {"quantize": lambda: f.encode(x, out=rows, codec=path, threads=threads),
            "dequantize": lambda: f.decode(rows, out=dst, codec=path, threads=threads)}


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--formats", default="q8,q4", help="comma-separated quantized formats (q8, q4, q8:64, ...)")
    p.add_argument("--tensors", type=tensors, default=tensors("8192x3x64,2048x32x128"),
                   help="TOKENSxHEADSxHEAD_DIM,... (default: a SmolLM2-135M layer's K at 8192 tokens, 3 MiB of fp16, "
                        "and an OPT-6.7B layer's K at 2048 tokens, 16 MiB)")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"),
                   help="the K/V tensors' dtype (rates stay in fp16-equivalent bytes)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions after the warm-up (default 7)")
    p.add_argument("--threads", type=positive_ints, default=sorted({1, os.cpu_count() or 1}),
                   help="thread counts, comma-separated (default: 1 and this machine's CPUs)")
    p.add_argument("--min-time", type=float, default=0.2, help="seconds one timed batch of calls lasts at least")
    p.add_argument("--out", default=None, help="JSON output, - for stdout (default: docs/bench/codec-<UTC time>.json)")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be at least 1")
    fmts = [kv_format(name.strip()) for name in args.formats.split(",") if name.strip()]
    if not all(isinstance(f, QuantFormat) for f in fmts):
        p.error("--formats takes quantized formats (q8, q4, q8:<block>, q4:<block>)")
    info = codec_info()
    if not info["built"]:
        p.error(f"the C codec is not built ({info['error']}): run tools/setup.sh or pip install -e .")
    dtype = getattr(torch, args.dtype)
    threads_before = torch.get_num_threads()
    doc: dict[str, Any] = {
        "schema": "bladed.codec_bench/1", "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
        "machine": machine_info(), "git": git_info(ROOT, ["bladed", "cffi_build"]), "codec": info,
        "torch": {"version": torch.__version__, "threads_default": threads_before},
        "args": {"formats": [f.name for f in fmts], "tensors": args.tensors, "dtype": args.dtype, "reps": args.reps,
                 "threads": args.threads, "min_time_s": args.min_time},
        "method": "per repetition, the C path and the torch path alternately (order swapped each repetition); "
                  "quantize = encode(x, out=rows), dequantize = decode(rows, out=dst), both into preallocated "
                  "memory; GB/s of fp16-equivalent bytes (2 per value); one warm-up repetition not counted",
        "results": [],
    }
    rows_out = []
    for f in fmts:
        assert isinstance(f, QuantFormat)
        for n, h, d in args.tensors:
            x = torch.randn(n, h, d, generator=torch.Generator().manual_seed(0)).mul_(2).to(dtype)
            rows = {path: f.encode(x, codec=path) for path in PATHS}
            identical = bool(torch.equal(rows["c"], rows["torch"]))
            dst = {path: torch.empty(n, h, d, dtype=dtype) for path in PATHS}
            fp16_bytes = x.numel() * 2
            for threads in args.threads:
                torch.set_num_threads(threads)
                ops = {(path, op): call for path in PATHS
                       for op, call in codec_ops(f, x, rows[path], dst[path], path, threads).items()}
                runs: dict[tuple[str, str], list[float]] = {k: [] for k in ops}
                batch: dict[tuple[str, str], int] = {}
                for rep in range(args.reps + 1):
                    for op in ("quantize", "dequantize"):
                        for path in trials.abba(PATHS, rep):
                            s, inner = timed(ops[(path, op)], args.min_time)
                            if rep:                  # the first is the warm-up
                                runs[(path, op)].append(fp16_bytes / s / 1e9)
                                batch[(path, op)] = inner
                for (path, op), gbps in runs.items():
                    rec = {"format": f.name, "tensor": [n, h, d], "dtype": args.dtype, "threads": threads,
                           "path": path, "op": op, "fp16_bytes": fp16_bytes, "stored_bytes": rows[path].numel(),
                           "calls_per_timing": batch[(path, op)], "gbps": spread(gbps), "runs_gbps": gbps,
                           "rows_identical": identical}
                    doc["results"].append(rec)
                for op in ("quantize", "dequantize"):
                    c, t = runs[("c", op)], runs[("torch", op)]
                    ratios = [a / b for a, b in zip(c, t, strict=True)]
                    target = TARGETS.get(f.kind, (0.0, 0.0))[op == "dequantize"] if threads == 1 else None
                    rows_out.append((f.name, f"{n}x{h}x{d}", threads, op, spread(c), spread(t), spread(ratios), target))
            torch.set_num_threads(threads_before)
    doc["summary"] = [{"format": r[0], "tensor": r[1], "threads": r[2], "op": r[3], "c_gbps": r[4],
                       "torch_gbps": r[5], "c_over_torch": r[6], "target_gbps": r[7],
                       "target_met": None if r[7] is None else r[4]["median"] >= r[7]} for r in rows_out]
    doc["loadavg_end"] = os.getloadavg()
    print(f"{'format':8} {'tensor':14} {'thr':>3} {'op':10} {'C GB/s (min-max)':>22} {'torch GB/s (min-max)':>22} "
          f"{'C/torch':>8} {'target':>8}")
    for name, tensor, thr, op, cs, ts, ratio, target in rows_out:
        met = "" if target is None else f"{target:g} {'met' if cs['median'] >= target else 'MISSED'}"
        print(f"{name:8} {tensor:14} {thr:3} {op:10} {cs['median']:7.2f} ({cs['min']:.2f}-{cs['max']:.2f}){'':3} "
              f"{ts['median']:7.2f} ({ts['min']:.2f}-{ts['max']:.2f}){'':3} {ratio['median']:8.1f} {met:>8}")
    if not all(r["rows_identical"] for r in doc["results"]):
        print("warning: C and torch rows differ for a tensor (see rows_identical)", file=sys.stderr)
    text = json.dumps(doc, indent=1)
    if args.out == "-":
        print(text)
        return 0
    out = args.out or os.path.join(ROOT, "docs", "bench", time.strftime("codec-%Y-%m-%dT%H%MZ.json", time.gmtime()))
    with open(out, "w") as fh:
        fh.write(text + "\n")
    print(f"wrote {os.path.relpath(out, ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
