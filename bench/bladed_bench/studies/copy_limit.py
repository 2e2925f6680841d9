"""The machine's page-cache copy limit: how fast a resident file's pages reach process memory, alternated.

The physical yardstick of a decode step whose KV set is all in the page cache (the KV sweep at the
limits where everything fits): there the step is a copy out of the page cache, by ``pread`` (bladed's
page-cache path, one call per range) or by loads from a shared mapping (the FlexLLMGen-style Baseline).
Measures, round after round on one resident file: ``pread`` into anonymous memory with 1 and with 2
threads (each half the file), and ``memcpy`` out of a shared read-only mapping, one thread.

Usage: tools/bench_copy_limit.py [--size 1G] [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import mmap
import os
import platform
import statistics
import sys
import tempfile
import threading
import time

from bladed_bench import environment, stats, trials
from bladed_bench.repo import REPO as ROOT

CHUNK = 32 << 20   # one pread per 32 MiB (a KPU-sized range)


def _pread_all(fd: int, dst: memoryview, start: int, end: int) -> None:
    off = start
    while off < end:
        n = min(CHUNK, end - off)
        os.preadv(fd, [dst[off:off + n]], off)
        off += n


def pread_gbps(fd: int, dst: memoryview, size: int, threads: int) -> float:
    part = size // threads
    ts = [threading.Thread(target=_pread_all, args=(fd, dst, i * part, size if i == threads - 1 else (i + 1) * part))
          for i in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return size / (time.perf_counter() - t0) / 1e9


def mmap_gbps(src: memoryview, dst: memoryview, size: int) -> float:
    t0 = time.perf_counter()
    dst[:size] = src[:size]
    return size / (time.perf_counter() - t0) / 1e9


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--size", type=functools.partial(stats.parse_size, fractions=True, unit=stats.GiB), default=1 << 30,
                   help="file size in GiB (default 1G)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default="/var/tmp", help="where the file goes (a disk file system)")
    p.add_argument("--out", default=None, help="JSON output (default: docs/bench/copy-limit-<UTC time>.json)")
    args = p.parse_args(argv)
    out = args.out or os.path.join(ROOT, "docs", "bench",
                                   time.strftime("copy-limit-%Y-%m-%dT%H%MZ.json", time.gmtime()))
    size = args.size
    with tempfile.NamedTemporaryFile(dir=args.dir, prefix="bladed-copy-limit-") as f:
        block = os.urandom(1 << 20)
        for _ in range(size >> 20):
            f.write(block)
        f.flush()
        fd = f.fileno()
        dst_map = mmap.mmap(-1, size)
        dst = memoryview(dst_map)
        src_map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        src = memoryview(src_map)
        pread_gbps(fd, dst, size, 1)          # resident, and the destination touched once
        rounds = []
        for r in range(args.rounds):
            row = {"pread_1_thread_gbps": pread_gbps(fd, dst, size, 1),
                   "pread_2_threads_gbps": pread_gbps(fd, dst, size, 2),
                   "mmap_memcpy_1_thread_gbps": mmap_gbps(src, dst, size)}
            rounds.append(row)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k}={v:.2f}" for k, v in row.items()),
                  file=sys.stderr)
        src.release()
        src_map.close()
        dst.release()
        dst_map.close()
    medians = {k: statistics.median(row[k] for row in rounds) for k in rounds[0]}
    doc = {"schema": "bladed-copy-limit-1", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": {"cpu_model": environment.cpu_model() or platform.processor(),
                       "cpus": os.cpu_count(), "kernel": platform.release(),
                       "loadavg_end": environment.read_text("/proc/loadavg")},
           "size_bytes": size, "chunk_bytes": CHUNK, "rounds": rounds, "medians": medians}
    trials.write_json(out, doc)
    for k, v in medians.items():
        print(f"{k}: {v:.2f} GB/s")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
