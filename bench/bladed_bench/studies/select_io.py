"""What a sparse decode step's reads cost in requests (issue 47): the pages of one KPU as one request per run,
pipelined (what ``bladed.kvstore.BladedKV.read_runs`` sent before protocol 6: requests of one connection run one
at a time), against the same runs in one request (protocol 6's, what ``read_runs`` sends now: a direct KPU's runs
go to the device together), against the dense read of the whole past.

::

    flock /tmp/bladed-bench.lock .venv/bin/python tools/bench_select_io.py --trace var/select/trace-keys-0.25-4096.json

OPT-6.7B's layer shape at batch 1 (token rows of 8 KiB, fp16; ``--shape smollm2``: SmolLM2-135M's at batch 2 in
float32, 1.5 KiB), the trace's context (a 4096-token past: 256
pages of 16), a daemon on a file store, every KPU on one path (``--path pagecache``: a page-cache budget that
holds them all, warm; ``direct``: none, the file store read with O_DIRECT). A step reads, for each of
``--kpus`` KPUs, the pages the trace's layers selected at one position. The three measures alternate, round
after round (``--rounds``); medians with their spread, seconds per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from bladed.client import Client
from bladed.protocol import IOOp, IORange
from bladed.residency.geometry import tensor_id
from bladed_bench import stats, trials
from bladed_bench.environment import machine_info
from bladed_bench.workload import BenchDaemon, page_runs

MiB = 1 << 20
#: the token rows measured: (batch, KV heads, head_dim, dtype bytes)
SHAPES = {"opt-6.7b": (1, 32, 128, 2), "smollm2": (2, 3, 64, 4)}


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True, help="tools/bench_kv_select.py --trace's JSON")
    p.add_argument("--path", choices=("pagecache", "direct"), default="pagecache")
    p.add_argument("--kpus", type=int, default=56, help="KPUs read per step (K and V of 28 layers)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--step", type=int, default=8, help="the trace's decode position (steps after its prompt)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="opt-6.7b",
                   help="the token rows: OPT-6.7B's layer at batch 1 in fp16 (8 KiB, whole LBAs), or SmolLM2-135M's "
                        "at batch 2 in float32 (1.5 KiB)")
    p.add_argument("--workdir", default="/var/tmp/bladed-select-io")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    with open(a.trace) as f:
        trace = json.load(f)
    page, ntok = int(trace["page"]), int(trace["first_position"]) + a.step
    layers = [trace["pages"][k][a.step] for k in sorted(trace["pages"], key=int)]
    per_kpu = [page_runs(layers[i % len(layers)], page, ntok) for i in range(a.kpus)]
    nlayers = a.kpus
    batch, kv_heads, head_dim, dtype_bytes = SHAPES[a.shape]
    geometry = {"layers": nlayers, "batch": batch, "kv_heads": kv_heads, "head_dim": head_dim,
                "dtype_bytes": dtype_bytes, "max_tokens": ntok + 16}
    tb = batch * kv_heads * head_dim * dtype_bytes
    kpu = geometry["max_tokens"] * tb
    os.makedirs(a.workdir, exist_ok=True)
    budget = 4 * a.kpus * kpu if a.path == "pagecache" else 0
    results: dict[str, list[float]] = {"pipelined": [], "one_request": [], "dense": []}
    with tempfile.TemporaryDirectory(dir=a.workdir) as d:
        daemon = BenchDaemon(d, 2 * nlayers * kpu + 256 * MiB, None, {"budget": {"override": 4 * nlayers * kpu
                                                                                   if budget else 0}})
        try:
            with Client(daemon.socket_path, timeout=600) as c, \
                    c.open_session(geometry, mode="dualblade", channels=1, slot_bytes=kpu) as s:
                assert {k["path"] for k in s.plan["kpus"]} == {a.path}, s.plan["kpus"][:2]
                s.slot(0)[:] = os.urandom(len(s.slot(0)))
                for layer in range(nlayers):         # K of every layer written: the KPUs read (V unused)
                    s.write(layer, "k", 0, 0, ntok)
                dc = s.channel(0)

                def pipelined() -> int:
                    n = 0
                    for layer, runs in enumerate(per_kpu):
                        reqs = [[IORange(IOOp.READ, tensor_id(layer, "k"), t0, m)] for t0, m in runs]
                        n += sum(r[0].nbytes for r in dc.submit_many(reqs))
                    return n

                def one_request() -> int:
                    return sum(r.nbytes for layer, runs in enumerate(per_kpu)
                               for r in dc.submit([IORange(IOOp.READ, tensor_id(layer, "k"), t0, m) for t0, m in runs]))

                def dense() -> int:
                    return sum(dc.submit([IORange(IOOp.READ, tensor_id(layer, "k"), 0, ntok)])[0].nbytes
                               for layer in range(a.kpus))

                measures = {"pipelined": pipelined, "one_request": one_request, "dense": dense}
                moved = {name: fn() for name, fn in measures.items()}     # warm-up, and the bytes
                for r in range(a.rounds):
                    names = trials.abba(measures, r)
                    for name in names:
                        t0 = time.perf_counter()
                        measures[name]()
                        results[name].append(time.perf_counter() - t0)
        finally:
            daemon.stop()
    requests = {"pipelined": sum(len(r) for r in per_kpu), "one_request": a.kpus, "dense": a.kpus}

    pairs = {"pipelined/one_request": [x / y for x, y in zip(results["pipelined"], results["one_request"],
                                                              strict=True)],
             "pipelined/dense": [x / y for x, y in zip(results["pipelined"], results["dense"], strict=True)],
             "one_request/dense": [x / y for x, y in zip(results["one_request"], results["dense"], strict=True)]}
    doc: dict[str, Any] = {
        "schema": "bladed.bench_select_io/1", "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
        "machine": machine_info(), "path": a.path, "shape": a.shape, "geometry": geometry, "kpus": a.kpus, "page": page,
        "past_tokens": ntok, "trace": {k: trace.get(k) for k in ("spec", "model", "text")},
        "bytes_per_step": moved, "requests_per_step": requests, "rounds": a.rounds, "order": "ABC, CBA, ...",
        "seconds_per_step": {k: stats.median_range(v) for k, v in results.items()},
        "ratios": {k: stats.median_range(v) for k, v in pairs.items()},
        "per_request_overhead_s": (statistics.median(results["pipelined"]) - statistics.median(
            results["one_request"])) / max(1, requests["pipelined"] - requests["one_request"]),
        "raw": results,
    }
    body = json.dumps(doc, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(body + "\n")
    for k, v in doc["seconds_per_step"].items():
        print(f"{k:12s} {v['median'] * 1e3:8.2f} ms [{v['min'] * 1e3:.2f}-{v['max'] * 1e3:.2f}]  "
              f"{requests[k]} requests, {moved[k] / MiB:.1f} MiB")
    for k, v in doc["ratios"].items():
        print(f"{k:22s} {v['median']:.3f} [{v['min']:.3f}-{v['max']:.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
