"""The page-cache write path alone (issue 28): fresh 32 MiB KPUs written through bladed's page-cache store
against plain ``pwrite(2)`` and stores through a shared mapping (the FlexLLMGen-style Baseline), from one
writer each, in the same memory cgroup settings, alternated.

Each run starts equally cold, as a KV sweep run does: ``drop_caches``, the disk idle, free page reporting
quiet, a fresh memory cgroup with ``--limit``.  Then:

* ``daemon``: a private bladed in the cgroup, every KPU on the page-cache path (``budget.override`` = the
  whole set); this process (outside the cgroup, like a client) writes each KPU from its staging slot, one
  request per KPU on one channel;
* ``pwrite``: a worker process in the cgroup creates each KPU's file as bladed does (``fallocate``d to its
  size) and ``pwrite``s it from a buffer; ``pwrite_sparse`` the same into a sparse file;
* ``mmap``: a worker process in the cgroup creates each file sparse (as the Baseline's ``open_memmap``
  does), maps it shared and copies into the mapping.

Files go to ``--dir``.  The timed part is
the writes only.  With ``--perf DIR`` the writer (the daemon, or the worker) is sampled by ``perf record -e
cpu-clock -g`` during its writes and the report's top symbols are kept; ``--trace`` counts, with bpftrace on
tracepoints, the orders of the writer's new page-cache folios and page allocations, its page faults and the
dirty throttle's pauses.  Every run records its /proc/vmstat and memory.stat figures.
One JSON record per run; the summary compares medians, paired by repetition.  Root only.

    tools/bench_pagecache_write.py [--total 2G] [--kpu 32M] [--reps 5] [--limit 3G] [--dir /var/tmp]
                                   [--configs daemon,pwrite,pwrite_sparse,mmap] [--perf DIR] [--trace]
                                   [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as dt
import functools
import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from bladed_bench import stats, trials
from bladed_bench.cgroup import MemCgroup, drop_caches
from bladed_bench.environment import git_info, machine_info
from bladed_bench.metrics import block_device_of, wait_device_idle, wait_free_pages_reported
from bladed_bench.repo import REPO as ROOT
from bladed_bench.repo import repo_env

CONFIGS = ("daemon", "pwrite", "pwrite_sparse", "mmap")
VMSTAT_KEYS = ("nr_dirtied", "nr_written", "pgfault", "pgmajfault", "pgalloc_normal", "pgalloc_dma32",
               "pgfree", "pgsteal_kswapd", "pgsteal_direct", "pgscan_direct", "allocstall_normal",
               "allocstall_movable", "nr_throttled_written", "thp_fault_alloc", "workingset_refault_file",
               "nr_vmscan_write")
MEMSTAT_KEYS = ("cache", "file", "dirty", "file_dirty", "writeback", "file_writeback", "shmem", "rss", "anon",
                "kernel", "pgfault", "pgmajfault")


def vmstat() -> dict[str, int]:
    out = {}
    with open("/proc/vmstat") as f:
        for line in f:
            k, _, v = line.partition(" ")
            if k in VMSTAT_KEYS:
                out[k] = int(v)
    return out


def delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b[k] - a.get(k, 0) for k in b}


# -- the worker (runs in the cgroup) -----------------------------------------------------------------------

def worker(how: str, directory: str, kpu: int, count: int) -> None:  # pragma: no cover - child process
    """Create ``count`` fresh KPU files and write each whole; print the seconds of the writes."""
    src = mmap.mmap(-1, kpu)
    ctypes.memset((ctypes.c_char * kpu).from_buffer(src), 0x5A, kpu)   # touched before the clock
    print(json.dumps({"ready": os.getpid()}), flush=True)
    sys.stdin.readline()                                                 # "go": perf (if any) is attached
    t0 = time.perf_counter()
    for i in range(count):
        fd = os.open(os.path.join(directory, f"w{i}.kv"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if how == "pwrite":
                os.posix_fallocate(fd, 0, kpu)     # as bladed's page-cache store does
            else:
                os.ftruncate(fd, kpu)              # sparse, as the Baseline's open_memmap(mode="w+") does
            if how in ("pwrite", "pwrite_sparse"):
                done = 0
                view = memoryview(src)
                while done < kpu:
                    done += os.pwrite(fd, view[done:], done)
            else:
                m = mmap.mmap(fd, kpu, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                m[:] = src
                m.close()
        finally:
            os.close(fd)
    print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)


# -- perf ------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def perf_record(pid: int, path: str | None) -> Iterator[None]:
    """``perf record -e cpu-clock -g -p PID`` for the block (nothing without ``path`` or perf)."""
    if path is None or shutil.which("perf") is None:
        yield
        return
    proc = subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-F", "999", "-g", "-p", str(pid),
                             "-o", path], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(0.3)   # perf attaches to the threads before it samples: no sample is lost at the start
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def perf_top(path: str, limit: float = 1.0) -> list[dict[str, Any]]:
    """The report's symbols over ``limit`` percent (self time), with the DSO."""
    out = subprocess.run(["perf", "report", "-i", path, "--stdio", "--no-children", "--sort", "dso,sym",
                          "-g", "none", "--percent-limit", str(limit)], capture_output=True, text=True)
    rows = []
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0].endswith("%"):
            rows.append({"percent": float(parts[0][:-1]), "dso": parts[1], "symbol": " ".join(parts[3:])})
    return rows


# -- bpftrace: where the writer's time goes, per kernel function ---------------------------------------------

def bpftrace_program(pid: int) -> str:
    """Tracepoints only (kernels without kprobes, as this VM's, still have them), for the threads of ``pid``:
    the order of every folio added to the page cache and of every page allocation, user and kernel page
    faults, and the dirty throttle's pauses (writeback:balance_dirty_pages)."""
    return "\n".join([
        f"tracepoint:filemap:mm_filemap_add_to_page_cache /pid == {pid}/ {{ @folio_order[args->order] = count(); }}",
        f"tracepoint:kmem:mm_page_alloc /pid == {pid}/ {{ @page_alloc_order[args->order] = count(); }}",
        f"tracepoint:exceptions:page_fault_user /pid == {pid}/ {{ @faults[\"user\"] = count(); }}",
        f"tracepoint:exceptions:page_fault_kernel /pid == {pid}/ {{ @faults[\"kernel\"] = count(); }}",
        f"tracepoint:writeback:balance_dirty_pages /pid == {pid}/ {{ @dirty_throttle_pause_ms = sum(args->pause); "
        f"@dirty_throttle_events = count(); }}",
    ])


@contextlib.contextmanager
def bpftrace(pid: int, out: dict[str, Any] | None) -> Iterator[None]:
    """Run :func:`bpftrace_program` for the block; its maps land in ``out`` (nothing without it or bpftrace)."""
    if out is None or shutil.which("bpftrace") is None:
        yield
        return
    proc = subprocess.Popen(["bpftrace", "-f", "json", "-e", bpftrace_program(pid)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    attached = proc.stdout.readline()      # {"type": "attached_probes", ...} once every probe is in place
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        text, err = proc.communicate(timeout=120)
        out["attached"] = attached.strip()
        for line in text.splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if rec.get("type") == "map":
                    out.update(rec["data"])
        if proc.returncode not in (0, -signal.SIGINT) and not out:
            out["error"] = err.strip()[-500:]


# -- one run -----------------------------------------------------------------------------------------------

def run_daemon(cg: MemCgroup, work: str, total: int, kpu: int, perf_path: str | None,
               trace: dict[str, Any] | None) -> dict[str, Any]:
    from bladed.client import Client
    from bladed_bench.workload import BenchDaemon

    token = 64 << 10                                     # OPT-6.7B: batch 8 x 32 heads x 128 x 2 bytes
    geometry = {"layers": total // (2 * kpu), "batch": 8, "kv_heads": 32, "head_dim": 128, "dtype_bytes": 2,
                "max_tokens": kpu // token}
    d = BenchDaemon(os.path.join(work, "daemon"), 64 << 20, cg.launcher,
                    {"budget": {"override": total * 2}, "pagecache": {"directory": os.path.join(work, "pc")}})
    try:
        with Client(d.socket_path, timeout=600) as c:
            s = c.open_session(geometry, channels=1)
            assert {k["path"] for k in s.plan["kpus"]} == {"pagecache"}, s.plan
            ctypes.memset((ctypes.c_char * kpu).from_buffer(s.slot(0)), 0x5A, kpu)
            with perf_record(d.pid, perf_path), bpftrace(d.pid, trace):
                t0 = time.perf_counter()
                for layer in range(geometry["layers"]):
                    for kind in "kv":
                        r = s.write(layer, kind, 0)
                        assert r.path == "pagecache"
                seconds = time.perf_counter() - t0
            t1 = time.perf_counter()
            s.close()
            close_s = time.perf_counter() - t1
        return {"seconds": seconds, "writer_pid": d.pid, "close_s": close_s}
    finally:
        d.stop()


def run_worker(how: str, cg: MemCgroup, work: str, total: int, kpu: int, perf_path: str | None,
               trace: dict[str, Any] | None) -> dict[str, Any]:
    directory = os.path.join(work, how)
    os.makedirs(directory, exist_ok=True)
    argv = cg.launcher([sys.executable, "-m", "bladed_bench.studies.pagecache_write",
                        "--worker", how, directory, str(kpu), str(total // kpu)])
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=repo_env()) as p:
        assert p.stdin is not None and p.stdout is not None
        pid = json.loads(p.stdout.readline())["ready"]
        with perf_record(pid, perf_path), bpftrace(pid, trace):
            p.stdin.write("go\n")
            p.stdin.flush()
            line = p.stdout.readline()
        p.stdin.close()
        if p.wait(60) != 0 or not line:
            raise RuntimeError(f"{how} worker failed ({p.returncode})")
    return {"seconds": json.loads(line)["seconds"], "writer_pid": pid}


def one_run(config: str, rep: int, a: argparse.Namespace, sysdir: str | None) -> dict[str, Any]:
    rec: dict[str, Any] = {"config": config, "rep": rep,
                           "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
    rec["drop_caches_s"] = drop_caches()
    if sysdir is not None:
        rec["settle_s"] = wait_device_idle(sysdir)[0]
    rec["memory_settle_s"] = wait_free_pages_reported()[0]
    work = tempfile.mkdtemp(prefix="pcw-", dir=a.dir)
    perf_path = os.path.join(a.perf, f"{config}-{rep}.data") if a.perf else None
    try:
        with MemCgroup(a.limit) as cg:
            v0 = vmstat()
            trace: dict[str, Any] | None = {} if a.trace else None
            if config == "daemon":
                rec.update(run_daemon(cg, work, a.total, a.kpu, perf_path, trace))
            else:
                rec.update(run_worker(config, cg, work, a.total, a.kpu, perf_path, trace))
            if trace is not None:
                rec["trace"] = trace
            rec["vmstat"] = delta(v0, vmstat())
            rec["memory_stat_end"] = {k: v for k, v in cg.stat().items() if k in MEMSTAT_KEYS}
            rec["cgroup"] = cg.describe()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rec["GBps"] = a.total / rec["seconds"] / 1e9
    if perf_path and os.path.exists(perf_path):
        rec["perf_top"] = perf_top(perf_path)
    return rec


def config_summary(runs: list[dict[str, Any]], configs: list[str]) -> dict[str, Any]:
    """The JSON's ``summary``: per configuration the median [min-max] seconds and the median GB/s; the daemon's
    time over each other configuration's, paired by repetition."""
    by = {c: [r for r in runs if r["config"] == c] for c in configs}
    out: dict[str, Any] = {}
    for c, rs in by.items():
        if rs:
            s = stats.median_range(r["seconds"] for r in rs)
            assert s is not None
            out[c] = {"median_s": s["median"], "min_s": s["min"], "max_s": s["max"],
                      "median_GBps": stats.median(r["GBps"] for r in rs)}
    if "daemon" in by:
        for other in configs:
            if other == "daemon" or not by.get(other):
                continue
            # the daemon's time over the other's, run against run in the same repetition
            by_rep = stats.paired(by["daemon"] + by[other], "daemon", other, name=lambda r: r["config"],
                                  group=lambda r: r["rep"], value=lambda r: r["seconds"])
            pairs = [x for xs in by_rep.values() for x in xs]
            out[f"daemon_over_{other}"] = stats.median_range(pairs, count=False)
        faster = min((c for c in configs if c != "daemon" and c in out), key=lambda c: out[c]["median_s"],
                     default=None)
        if faster is not None:
            out["daemon_over_faster"] = out[f"daemon_over_{faster}"] | {"faster": faster}
    return out


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--total", type=stats.parse_size, default=2 << 30)
    p.add_argument("--kpu", type=stats.parse_size, default=32 << 20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--limit", type=functools.partial(stats.parse_size, zero=True), default=3 << 30,
                   help="the memory cgroup's limit (0: none)")
    p.add_argument("--dir", default="/var/tmp")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--perf", default=None, help="keep perf.data files here and the top symbols in the JSON")
    p.add_argument("--trace", action="store_true", help="bpftrace the writer's folio orders, faults, throttling")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", nargs=4, metavar=("HOW", "DIR", "KPU", "COUNT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a.worker[0], a.worker[1], int(a.worker[2]), int(a.worker[3]))
        return 0
    if os.geteuid() != 0:
        p.error("needs root (drop_caches, memory cgroups)")
    a.limit = a.limit or None
    configs = [c for c in a.configs.split(",") if c]
    if unknown := set(configs) - set(CONFIGS):
        p.error(f"--configs: unknown {sorted(unknown)}; choose from {', '.join(CONFIGS)}")
    if a.perf:
        os.makedirs(a.perf, exist_ok=True)
    sysdir = block_device_of(a.dir)
    doc: dict[str, Any] = {"schema": "bladed.bench_pagecache_write/1", "args": {k: v for k, v in vars(a).items()
                                                                                if k != "worker"},
                           "machine": machine_info(), "git": git_info(ROOT), "runs": []}
    t0 = time.perf_counter()
    for rep in range(a.reps):
        order = trials.rotated(configs, rep)
        for config in order:
            rec = one_run(config, rep, a, sysdir)
            doc["runs"].append(rec)
            print(f"rep {rep} {config:6s} {rec['seconds']:.3f} s  {rec['GBps']:.2f} GB/s", file=sys.stderr, flush=True)
    doc["wall_s"] = time.perf_counter() - t0
    doc["summary"] = config_summary(doc["runs"], configs)
    text = json.dumps(doc, indent=1, default=str)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(json.dumps(doc["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
