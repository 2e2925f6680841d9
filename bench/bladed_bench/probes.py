"""The reference measurements a sweep round takes next to its runs.

* :func:`fio_seq` - fio's sequential write then read of a fresh file on the
  same filesystem as the KV store (``ioengine=io_uring``, ``direct=1``, the
  daemon's command size and queue depth): the device ceiling ``BW_dev``.
* :func:`pagecache_read_bw` - memcpy bandwidth out of a fully resident,
  already-mapped file (what a Group 1 read does once the pages are mapped):
  ``BW_pc``.
* :func:`bare_uring_writes` - one-token O_DIRECT writes with bladed's engine
  in this process, appended the way decode appends (one token per KPU, into
  blocks not written before): the reference for the decode-write latency.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import shutil
import subprocess
import time
from typing import Any

from bladed.sizes import align_up, ceil_div
from bladed_bench.stats import latency_stats

MiB = 1 << 20


def fio_path() -> str | None:
    return shutil.which("fio")


def fio_version() -> str | None:
    exe = fio_path()
    if exe is None:
        return None
    try:
        return subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _fio(args: list[str]) -> dict[str, Any]:
    exe = fio_path()
    if exe is None:
        raise FileNotFoundError("fio is not installed")
    out = subprocess.run([exe, "--output-format=json", *args], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"fio failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    text = out.stdout
    # fio may print warnings before the JSON document
    return dict(json.loads(text[text.index("{"):]))


def fio_seq(directory: str, size: int, bs: int = MiB, iodepth: int = 32) -> dict[str, Any]:
    """Sequential write of a fresh file, then sequential read of it (O_DIRECT, io_uring)."""
    path = os.path.join(directory, "fio-seq.img")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    common = [f"--filename={path}", f"--size={size}", f"--bs={bs}", f"--iodepth={iodepth}", "--ioengine=io_uring",
              "--direct=1", "--numjobs=1", "--thread", "--fixedbufs=1", "--group_reporting"]
    try:
        w = _fio(["--name=seqwrite", "--rw=write", *common, "--end_fsync=1"])
        r = _fio(["--name=seqread", "--rw=read", *common])
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    wj, rj = w["jobs"][0], r["jobs"][0]
    return {
        "size": size, "bs": bs, "iodepth": iodepth,
        "write_GBps": wj["write"]["bw_bytes"] / 1e9,
        "read_GBps": rj["read"]["bw_bytes"] / 1e9,
        "write_lat_mean_ms": wj["write"]["clat_ns"]["mean"] / 1e6,
        "read_lat_mean_ms": rj["read"]["clat_ns"]["mean"] / 1e6,
        "write_runtime_ms": wj["write"]["runtime"],
        "read_runtime_ms": rj["read"]["runtime"],
    }


def pagecache_read_bw(directory: str, size: int = 512 * MiB, chunk: int = 32 * MiB, passes: int = 3) -> dict[str, Any]:
    """memcpy bandwidth out of a resident, mapped file (median of ``passes``), and of a first pass."""
    path = os.path.join(directory, "pc-probe.bin")
    block = os.urandom(MiB)
    with open(path, "wb") as f:
        for _ in range(size // MiB):
            f.write(block)
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        dst = mmap.mmap(-1, chunk)
        base = _address_of_readonly(mm)
        dst_addr = ctypes.addressof(ctypes.c_char.from_buffer(dst))

        def one_pass() -> float:
            t = time.perf_counter()
            for off in range(0, size, chunk):
                ctypes.memmove(dst_addr, base + off, min(chunk, size - off))
            return time.perf_counter() - t

        first = one_pass()        # pages resident (just written), mapping not yet populated: minor faults
        times = [one_pass() for _ in range(passes)]
        times.sort()
        med = times[len(times) // 2]
        dst.close()
        mm.close()
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return {"size": size, "chunk": chunk, "GBps": size / med / 1e9, "first_pass_GBps": size / first / 1e9,
            "passes_GBps": [size / t / 1e9 for t in times]}


def _address_of_readonly(mm: mmap.mmap) -> int:
    """Address of a read-only mapping (ctypes' from_buffer needs a writable one)."""
    from bladed._uring import ffi

    return int(ffi.cast("uintptr_t", ffi.from_buffer(mm)))


def bare_uring_writes(directory: str, token_bytes: int, kpu_bytes: int, first_token: int, tokens: int,
                      kpus: int, queue_depth: int = 32) -> dict[str, Any]:
    """One-token O_DIRECT writes with bladed's Engine, one at a time, appended per KPU as decode does.

    Token rows are packed as the daemon's extent store packs them (docs/architecture.md): a row's write
    covers the whole LBAs it touches, one or two when the row is not a whole number of LBAs."""
    from bladed.io import Engine, StagingBuffer
    from bladed.io.file import FileDevice

    path = os.path.join(directory, "bare-write.img")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    lba = 4096
    nbytes = align_up(token_bytes, lba) + (lba if token_bytes % lba else 0)  # the most LBAs one row touches
    stride = align_up(kpu_bytes, lba)
    size = kpus * stride
    lat: list[float] = []
    dev = FileDevice(path, size, lba_size=lba)
    try:
        buf = StagingBuffer(nbytes)
        data = bytearray(os.urandom(nbytes))
        ctypes.memmove(buf.address, ctypes.addressof(ctypes.c_char.from_buffer(data)), nbytes)
        with Engine(dev, queue_depth, [buf]) as eng:
            # the daemon's extents are holes after its TRIM on teardown: start from holes too
            eng.discard(0, size // lba)
            for t in range(first_token, first_token + tokens):
                first, end = t * token_bytes // lba, ceil_div((t + 1) * token_bytes, lba)
                for k in range(kpus):
                    x = eng.write(k * stride // lba + first, buf, nbytes=(end - first) * lba)
                    lat.append(x.service_ns / 1e9)
        buf.close()
    finally:
        dev.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return {"token_bytes": token_bytes, **latency_stats(lat)}
