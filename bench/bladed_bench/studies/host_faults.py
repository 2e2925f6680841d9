"""Prefill's slow mode outside bladed: fresh page-cache writes on memory the host took back or still backs.

In a virtual machine whose kernel reports free pages to the host (free page
reporting, ``/sys/module/page_reporting``), memory freed by ``drop_caches``
goes back to the host within seconds, and the guest's next write to it faults
in the host.  This writes 2 GiB to a fresh file in 32 MiB pieces, by
``pwrite`` (bladed's page-cache path) and by stores through a shared mapping
(the Baseline's path), after three histories of the guest's free memory,
alternated, and prints the median per piece:

* ``dropped``: ``drop_caches`` and 6 s (what a cold sweep run sees when the
  host was quick);
* ``just_freed``: right after the previous measure's file was deleted;
* ``backed``: ``drop_caches`` and 6 s, then as much anonymous memory as the
  file touched and freed just before.

Root only (``drop_caches``).  Usage: tools/bench_host_faults.py [--reps 3] [--dir /var/tmp] [--out FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import json
import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from bladed_bench import trials
from bladed_bench.cgroup import drop_caches
from bladed_bench.environment import git_info, machine_info
from bladed_bench.repo import REPO as ROOT

PIECE, TOTAL = 32 << 20, 2 << 30
REPORTED = "/sys/module/page_reporting/parameters/reported_kib"


def reported_kib() -> int | None:
    try:
        with open(REPORTED) as f:
            return int(f.read())
    except OSError:
        return None


def touch_anonymous(nbytes: int) -> None:
    m = mmap.mmap(-1, nbytes)
    try:
        buf = (ctypes.c_char * nbytes).from_buffer(m)
        ctypes.memset(buf, 1, nbytes)
        del buf
    finally:
        m.close()


def write_pieces(path: str, how: str, piece: bytes) -> list[float]:
    """Seconds per 32 MiB piece of a fresh 2 GiB file, written by ``pwrite`` or through a mapping."""
    fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_RDWR, 0o600)
    times = []
    try:
        if how == "mmap":
            os.ftruncate(fd, TOTAL)
            m = mmap.mmap(fd, TOTAL, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                for i in range(TOTAL // PIECE):
                    t0 = time.perf_counter()
                    m[i * PIECE:(i + 1) * PIECE] = piece
                    times.append(time.perf_counter() - t0)
            finally:
                m.close()
        else:
            for i in range(TOTAL // PIECE):
                t0 = time.perf_counter()
                os.pwrite(fd, piece, i * PIECE)
                times.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)
    return times


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_host_faults: needs root (drop_caches); run it with sudo", file=sys.stderr)
        return 2
    path = os.path.join(a.dir, f"bladed-host-faults-{os.getpid()}.bin")
    piece = os.urandom(PIECE)
    def dropped() -> None:
        drop_caches()
        time.sleep(6)      # part of the history measured: the host's time to take the freed pages

    def backed() -> None:
        dropped()
        touch_anonymous(TOTAL)

    histories: dict[str, Callable[[], None]] = {"dropped": dropped, "just_freed": lambda: None, "backed": backed}
    rows: list[dict[str, Any]] = []
    for rep in range(a.reps):
        for how in ("pwrite", "mmap"):
            for history, prepare in histories.items():
                prepare()
                r0 = reported_kib()
                times = write_pieces(path, how, piece)
                r1 = reported_kib()
                row = {"rep": rep, "write": how, "history": history, "total_s": sum(times),
                       "piece_median_ms": statistics.median(times) * 1e3,
                       "reported_during_mib": None if r0 is None or r1 is None else (r1 - r0) >> 10}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"{'write':8s} {'history':12s} median ms per 32 MiB [range over reps]")
    for how in ("pwrite", "mmap"):
        for history in histories:
            ms = [r["piece_median_ms"] for r in rows if r["write"] == how and r["history"] == history]
            print(f"{how:8s} {history:12s} {statistics.median(ms):7.1f} [{min(ms):.1f}-{max(ms):.1f}]")
    out = a.out or os.path.join(ROOT, "docs", "bench",
                                f"host-faults-{dt.datetime.now(dt.UTC).strftime('%Y-%m-%dT%H%MZ')}.json")
    doc = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "machine": machine_info(),
           "git": git_info(ROOT), "page_reporting": reported_kib() is not None, "piece_bytes": PIECE,
           "total_bytes": TOTAL, "rows": rows}
    trials.write_json(out, doc)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
