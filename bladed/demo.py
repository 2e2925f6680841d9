"""Main-job demo of the storage engine: write and read back a set of
KV-shaped tensors (one K and one V per layer) through the embedded default
store, a preallocated file driven with O_DIRECT io_uring, and print the
throughput.  ``python -m bladed.demo --help``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import numpy as np

from bladed.io import Engine, Op, StagingBuffer
from bladed.io.file import FileDevice
from bladed.residency.geometry import Geometry
from bladed.sizes import align_up


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-dir", default="var/demo", help="where the store file lives (default: %(default)s)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=256, help="sequence length held per KPU")
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--command-kib", type=int, default=1024, help="per-command payload (KiB)")
    args = p.parse_args(argv)

    geo = Geometry(layers=args.layers, batch=args.batch, kv_heads=args.heads, head_dim=args.head_dim,
                   dtype_bytes=2, max_tokens=args.tokens)                # fp16
    kpu_bytes = geo.kpu_bytes
    n_kpus = 2 * args.layers
    total = geo.kv_bytes
    os.makedirs(args.state_dir, exist_ok=True)
    path = os.path.join(args.state_dir, "kv-store.img")
    store_bytes = align_up(total, 1 << 20)
    print(f"bladed demo: {args.layers} layers x (K, V), KPU {kpu_bytes / 2**20:.1f} MiB "
          f"(B={args.batch} H={args.heads} D={args.head_dim} fp16, {args.tokens} tokens), "
          f"{total / 2**20:.0f} MiB in all")
    rng = np.random.default_rng(1234)
    with FileDevice(path, store_bytes, max_command_bytes=args.command_kib << 10) as dev, \
            StagingBuffer(total) as staging:
        host = np.frombuffer(staging.view(), dtype=np.float16)
        host[:] = rng.standard_normal(host.size, dtype=np.float32).astype(np.float16)
        digest = hashlib.sha256(staging.view()).hexdigest()
        blocks = kpu_bytes // dev.lba_size
        print(f"store: {path} ({dev.kind} backend, {dev.lba_size}-byte blocks, O_DIRECT io_uring, "
              f"QD {args.queue_depth}, {args.command_kib} KiB commands)")
        with Engine(dev, args.queue_depth, [staging]) as eng:
            def run(op: Op) -> float:
                xs = [eng.transfer(op, i * blocks, staging, offset=i * kpu_bytes, nbytes=kpu_bytes)
                      for i in range(n_kpus)]
                t0 = time.perf_counter()
                eng.run(xs)
                return time.perf_counter() - t0

            t_write = run(Op.WRITE)
            host[:] = 0
            t_read = run(Op.READ)
            ok = hashlib.sha256(staging.view()).hexdigest() == digest
            eng.discard(0, n_kpus * blocks)
        print(f"prefill-style write: {total / t_write / 1e6:8.1f} MB/s  ({t_write * 1e3:.1f} ms, "
              f"registered buffers: {eng.registered})")
        print(f"decode-style read:   {total / t_read / 1e6:8.1f} MB/s  ({t_read * 1e3:.1f} ms)")
        print(f"read-back check: {'all bytes match' if ok else 'MISMATCH'}; extents TRIMmed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
