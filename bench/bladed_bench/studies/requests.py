"""Request overhead of the data path, against the yardsticks, alternated in one run (docs/benchmarks.md).

Measures, round after round (each measure once per round, in turn):

* ``pingpong``: a bare framed request/reply between two processes over a Unix
  socket (the 8-byte bladed header and a 36-byte body each way): the floor
  for any daemon round trip;
* one-token ``write``/``read`` round trips through a spawned daemon on a data
  connection, on the page-cache path and on the direct path (file store);
* a decode step's appends for all layers: one batched request per channel
  against one request per KPU (the per-KPU cost of each);
* one-token appends on the direct path, alone and while another channel
  reads 8 MiB at a time from the same device, against a bare in-process
  io_uring write of the same size into fresh blocks of the same file system,
  alone and under the same reads; and that 8 MiB read alone.

Prints a table of medians and writes the raw per-round figures as JSON.
Usage: tools/bench_requests.py [--rounds 7] [--ops 400] [--out FILE] [--dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from bladed.client import Client
from bladed.io import Engine, StagingBuffer
from bladed.io.file import FileDevice
from bladed.protocol import HEADER, IO_FORMAT, MAGIC
from bladed_bench import trials
from bladed_bench.environment import filesystem_of, git_info, machine_info
from bladed_bench.repo import REPO as ROOT
from bladed_bench.workload import BenchDaemon

#: one token row of 4 KiB (a whole LBA): 8 KV heads x 128 x fp16 x batch 2
GEO = {"layers": 16, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 256}
BULK = 8 << 20


# -- the yardstick: a framed ping-pong between two processes ------------------------------------------
def _echo(sock: socket.socket) -> None:
    head = bytearray(HEADER.size)
    body = bytearray(64 * 1024)
    while True:
        n = sock.recv_into(head, HEADER.size, socket.MSG_WAITALL)
        if n == 0:
            return
        length = HEADER.unpack(head)[3]
        sock.recv_into(body, length, socket.MSG_WAITALL)
        sock.sendall(bytes(head) + bytes(body[:length]))


class PingPong:
    def __init__(self) -> None:
        self.a, b = socket.socketpair()
        self.proc = multiprocessing.get_context("fork").Process(target=_echo, args=(b,), daemon=True)
        self.proc.start()
        b.close()
        self.msg = HEADER.pack(MAGIC, IO_FORMAT, 0, 36) + bytes(36)
        self.buf = bytearray(len(self.msg))

    def once(self) -> None:
        self.a.sendall(self.msg)
        self.a.recv_into(self.buf, len(self.msg), socket.MSG_WAITALL)

    def close(self) -> None:
        self.a.close()
        self.proc.join(5)


def per_op_us(fn: Callable[[], object], ops: int) -> float:
    """Median microseconds of ``ops`` calls of ``fn`` (each timed alone)."""
    times = []
    for _ in range(ops):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


class BulkReader:
    """Another channel reading 8 MiB of a KPU-sized region again and again (the contention of a decode read)."""

    def __init__(self, read: Callable[[], None]) -> None:
        self.read = read
        self.stop = threading.Event()
        self.reads = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.read()
            self.reads += 1

    def __enter__(self) -> BulkReader:
        self.thread.start()
        while self.reads == 0:          # the device is busy with reads before anything is measured
            time.sleep(0.001)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--ops", type=int, default=400, help="operations per measure and round")
    p.add_argument("--dir", default=None, help="where the daemon's store goes (default: a temp dir in /var/tmp)")
    p.add_argument("--out", default=None, help="JSON output (default: docs/bench/requests-<UTC time>.json)")
    p.add_argument("--portable", action="store_true",
                   help="also a daemon on io.engine = portable (issue 29): its one-token direct write and read "
                        "round trips, alternated with the others in every round")
    args = p.parse_args(argv)
    base = args.dir or tempfile.mkdtemp(prefix="bladed-bench-req-", dir="/var/tmp")
    out = args.out or os.path.join(ROOT, "docs", "bench", time.strftime("requests-%Y-%m-%dT%H%MZ.json", time.gmtime()))
    kpu = GEO["batch"] * GEO["kv_heads"] * GEO["head_dim"] * GEO["dtype_bytes"] * GEO["max_tokens"]
    tb = kpu // GEO["max_tokens"]
    L = GEO["layers"]
    rounds: list[dict[str, float]] = []
    daemon = BenchDaemon(os.path.join(base, "state"), store_bytes=256 << 20, extra={"budget": {"override": 1 << 30}})
    portable = (BenchDaemon(os.path.join(base, "state-portable"), store_bytes=256 << 20,
                            extra={"budget": {"override": 1 << 30}, "io": {"engine": "portable"}})
                if args.portable else None)
    pp = PingPong()
    bare_dev = FileDevice(os.path.join(base, "bare.img"), 256 << 20, lba_size=4096)
    bare_buf = StagingBuffer(max(BULK, 1 << 20))
    bare = Engine(bare_dev, 32, [bare_buf])
    try:
        with Client(daemon.socket_path) as c, contextlib.ExitStack() as more:
            pc = c.open_session(GEO, mode="baseline", channels=2, slot_bytes=2 * L * tb + kpu)
            direct = c.open_session(GEO, mode="direct", channels=2, slot_bytes=2 * L * tb + kpu)
            big = dict(GEO, layers=1, max_tokens=8 * GEO["max_tokens"])   # 8 MiB KPUs for the bulk reads
            bulk = c.open_session(big, mode="direct", channels=1)
            for s in (pc, direct):
                s.slot(0)[:] = os.urandom(len(s.slot(0)))
                for layer in range(L):
                    for kind in "kv":
                        s.write(layer, kind, 0)                           # fill every KPU once
            bulk.write(0, "k", 0)
            ch = {name: s.channel(0) for name, s in (("pc", pc), ("direct", direct))}
            one = {name: {op: [s.range(op, 3, "k", 100, 1)] for op in ("write", "read")}
                   for name, s in (("pc", pc), ("direct", direct))}
            # a decode step's appends: K of every layer at token 200, each at its own slot offset
            step = {name: [s.range("write", layer, "k", 200, 1, slot_offset=layer * tb) for layer in range(L)]
                    for name, s in (("pc", pc), ("direct", direct))}
            fresh = [0]

            def bare_append() -> None:
                fresh[0] = (fresh[0] + 1) % 60000                       # fresh blocks each time
                bare.write(1024 + fresh[0], bare_buf, nbytes=tb)

            def bulk_read() -> None:
                bulk.read(0, "k", 0)

            def batch(name: str) -> Callable[[], object]:
                return lambda: ch[name].submit(step[name])

            def singles(name: str) -> Callable[[], object]:
                return lambda: [ch[name].submit([r]) for r in step[name]] and None

            measures: dict[str, Callable[[], object]] = {
                "pingpong_us": pp.once,
                "pc_write_us": lambda: ch["pc"].submit(one["pc"]["write"]) and None,
                "pc_read_us": lambda: ch["pc"].submit(one["pc"]["read"]) and None,
                "direct_write_us": lambda: ch["direct"].submit(one["direct"]["write"]) and None,
                "direct_read_us": lambda: ch["direct"].submit(one["direct"]["read"]) and None,
                "bare_write_us": bare_append,
                "pc_step_batched_us": batch("pc"),
                "pc_step_singles_us": singles("pc"),
                "direct_step_batched_us": batch("direct"),
                "direct_step_singles_us": singles("direct"),
                "bulk_read_us": bulk_read,                                # the 8 MiB read alone (its throughput)
            }
            if portable is not None:
                pc_client = more.enter_context(Client(portable.socket_path))
                pdirect = pc_client.open_session(GEO, mode="direct", channels=2, slot_bytes=2 * L * tb + kpu)
                pdirect.slot(0)[:] = os.urandom(len(pdirect.slot(0)))
                for layer in range(L):
                    for kind in "kv":
                        pdirect.write(layer, kind, 0)
                pch = pdirect.channel(0)
                pone = {op: [pdirect.range(op, 3, "k", 100, 1)] for op in ("write", "read")}
                measures["portable_direct_write_us"] = lambda: pch.submit(pone["write"]) and None
                measures["portable_direct_read_us"] = lambda: pch.submit(pone["read"]) and None
            for _ in range(10):                                           # warm up
                for fn in measures.values():
                    fn()
            for r in range(args.rounds):
                row: dict[str, float] = {}
                for name, fn in measures.items():
                    ops = args.ops // L if "step" in name else args.ops // 8 if name == "bulk_read_us" else args.ops
                    row[name] = per_op_us(fn, ops)
                with BulkReader(bulk_read):
                    row["direct_write_contended_us"] = per_op_us(measures["direct_write_us"], args.ops // 4)
                    row["pc_write_contended_us"] = per_op_us(measures["pc_write_us"], args.ops // 4)
                    row["bare_write_contended_us"] = per_op_us(bare_append, args.ops // 4)
                rounds.append(row)
                print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k}={v:.1f}" for k, v in row.items()),
                      file=sys.stderr)
            for s in (pc, direct, bulk):
                s.close()
    finally:
        pp.close()
        bare.close()
        bare_buf.close()
        bare_dev.close()
        daemon.stop()
        if portable is not None:
            portable.stop()

    def ratio(a: str, b: str) -> float:
        return statistics.median(row[a] / row[b] for row in rounds)

    medians = {k: statistics.median(row[k] for row in rounds) for k in rounds[0]}
    ratios = {
        "pc_write / pingpong": ratio("pc_write_us", "pingpong_us"),
        "pc_read / pingpong": ratio("pc_read_us", "pingpong_us"),
        "direct_write / pingpong": ratio("direct_write_us", "pingpong_us"),
        "direct_write / bare_write (alone)": ratio("direct_write_us", "bare_write_us"),
        "direct_write_contended / bare_write (alone)": ratio("direct_write_contended_us", "bare_write_us"),
        "direct_write_contended / bare_write_contended": ratio("direct_write_contended_us",
                                                               "bare_write_contended_us"),
        "pc_write_contended / pingpong": ratio("pc_write_contended_us", "pingpong_us"),
        "pc step per KPU: batched / singles": ratio("pc_step_batched_us", "pc_step_singles_us"),
        "direct step per KPU: batched / singles": ratio("direct_step_batched_us", "direct_step_singles_us"),
    }
    if "portable_direct_write_us" in rounds[0]:
        ratios["portable direct_write / uring direct_write"] = ratio("portable_direct_write_us", "direct_write_us")
        ratios["portable direct_read / uring direct_read"] = ratio("portable_direct_read_us", "direct_read_us")
    result = {"what": "request overhead (tools/bench_requests.py)", "geometry": GEO, "token_bytes": tb,
              "layers_per_step": L, "bulk_read_bytes": BULK, "rounds": rounds, "medians": medians,
              "per_kpu_step_us": {k: medians[k] / L for k in medians if "step" in k},
              "ratios": ratios, "machine": machine_info(), "filesystem": filesystem_of(base), "git": git_info(ROOT)}
    os.makedirs(os.path.dirname(out), exist_ok=True)
    trials.write_json(out, result)
    print(f"{'measure':45s} {'median':>10s}")
    for k, v in medians.items():
        print(f"{k:45s} {v:10.1f}")
    for k, v in ratios.items():
        print(f"{k:45s} {v:10.2f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
