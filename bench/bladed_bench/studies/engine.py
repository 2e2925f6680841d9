"""Engine vs fio: sequential write and read of 128 MiB tensors, measured in one
run on the same target.

For every (target, op, command size) row the tool runs bladed's engine (one
ring, the tensors submitted back to back so the queue stays full across them)
and fio (``ioengine=io_uring``, ``direct=1``, same block size and queue depth,
``fixedbufs=1``) over the same byte range of the same file or device,
alternating the two, and reports the medians, their spread and the ratio
engine/fio of the medians.  Every single measurement, the machine, kernel,
fio and liburing versions and the target's filesystem go to the JSON output.

Targets: a preallocated file in ``--target-dir`` (O_DIRECT on both sides), and
optionally a block device (``--block /dev/loopN``) or an NVMe generic char
device (``--nvme /dev/ng0n1``, fio ``ioengine=io_uring_cmd``).  Block and NVMe
targets are overwritten.  (NVMe passthrough from a registered staging buffer of
more pages than the queue's ``max_segments`` needs kernel 6.12: 6.1 answers
EINVAL for every command, see ``tests/vm``.)

Before the first measurement the whole range is written once, so that reads
hit written blocks (a read of a never-written ext4 extent, a hole of a loop
device's backing file or a deallocated NVMe LBA returns zeroes without
touching the medium) and writes overwrite allocated blocks.

Example::

    python tools/bench_engine.py --target-dir var/bench --size 1G --reps 5 --extra engine-4k \\
        --json docs/bench/engine-$(date -u +%F).json --markdown
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import mmap
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bladed_bench import cgroup, stats, trials
from bladed_bench.environment import (
    disk_info,
    filesystem_of,
    git_info,
    machine_info,
    read_text,
    run_text,
)
from bladed_bench.repo import REPO
from bladed_bench.stats import human_size, parse_size

SCHEMA = "bladed.bench_engine/1"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_TARGET_RATIO = 0.95
FILE_NAME = "bench-engine.img"


# ----------------------------------------------------------- environment --

def liburing_info() -> dict[str, Any]:
    """The liburing the engine extension is linked against, and the distro package version."""
    import bladed._uring  # noqa: F401  (maps liburing into this process)

    lib_path = None
    for line in (read_text("/proc/self/maps") or "").splitlines():
        if "liburing.so" in line:
            lib_path = line.split()[-1]
            break
    real = os.path.realpath(lib_path) if lib_path else None
    m = re.search(r"liburing\.so\.(\d+(?:\.\d+)+)$", real or "")
    return {
        "library": real,
        "version": m.group(1) if m else None,
        "package": run_text(["dpkg-query", "-W", "-f=${Package} ${Version}", "liburing2"]),
    }


def fio_version(fio: str) -> str | None:
    return run_text([fio, "--version"])


def block_stat_dir(devno: int) -> str | None:
    """``/sys/dev/block/M:m`` of a block device number, or None."""
    p = f"/sys/dev/block/{os.major(devno)}:{os.minor(devno)}"
    return os.path.realpath(p) if os.path.exists(p) else None


def disk_counters(sysdir: str | None) -> tuple[int, int, int, int, int] | None:
    """(read requests, bytes read, write requests, bytes written, busy ms) so far by the block
    device, from its ``stat`` (requests as the device saw them: after splits and merges; busy =
    ``io_ticks``, the time it had at least one request in flight)."""
    if not sysdir:
        return None
    text = read_text(os.path.join(sysdir, "stat"))
    if not text:
        return None
    f = text.split()
    return int(f[0]), int(f[2]) * 512, int(f[4]), int(f[6]) * 512, int(f[9])


def cpu_times() -> list[int]:
    """The aggregate ``cpu`` line of /proc/stat (user nice system idle iowait irq softirq steal)."""
    first = (read_text("/proc/stat") or "cpu 0 0 0 0 0 0 0 0").splitlines()[0]
    return [int(x) for x in first.split()[1:9]]


def cpu_shares(before: list[int], after: list[int]) -> dict[str, float]:
    d = [a - b for a, b in zip(after, before, strict=True)]
    total = sum(d) or 1
    user, nice, system, idle, iowait, irq, softirq, steal = d
    return {
        "busy": (user + nice + system + irq + softirq) / total,
        "iowait": iowait / total,
        "steal": steal / total,
        "idle": idle / total,
    }


def cached_pages(path: str) -> int | None:
    """Pages of ``path`` resident in the page cache (cachestat(2)), or None where unsupported."""
    from bladed._uring import ffi, lib

    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        out = ffi.new("uint64_t[5]")
        if lib.bd_cachestat(fd, 0, 0, out) < 0:     # len 0: to the end of the file
            return None
        return int(out[0])
    finally:
        os.close(fd)


# --------------------------------------------------------------- targets --

@dataclass
class Target:
    """Something both the engine and fio can be pointed at."""

    kind: str                  # file | block | nvme
    path: str
    size: int                  # bytes the benchmark covers, from offset 0
    created: bool = False      # a file this tool created (removed unless --keep)
    info: dict[str, Any] = field(default_factory=dict)

    def open(self, command_bytes: int) -> Any:
        """The bladed device, its per-command payload set to ``command_bytes``."""
        from bladed.io import open_device

        if self.kind == "file":
            return open_device("file", self.path, size_bytes=self.size, lba_size=4096,
                               max_command_bytes=command_bytes, create=False)
        if self.kind == "block":
            return open_device("block", self.path, max_command_bytes=command_bytes)
        dev = open_device("nvme", self.path)
        limit = min(dev.max_transfer_bytes, dev.max_transfer_bytes_huge)
        if command_bytes > limit:
            dev.close()
            raise ValueError(f"{self.path}: {human_size(command_bytes)} commands exceed the device "
                             f"limit of {limit} bytes")
        dev.max_transfer_bytes = dev.max_transfer_bytes_huge = command_bytes
        return dev

    def fio_args(self) -> list[str]:
        if self.kind == "nvme":
            return ["--ioengine=io_uring_cmd", "--cmd_type=nvme"]
        return ["--ioengine=io_uring", "--direct=1"]

    def stat_dir(self) -> str | None:
        st = os.stat(self.path)
        if self.kind == "file":
            return block_stat_dir(st.st_dev)
        if self.kind == "block":
            return block_stat_dir(st.st_rdev)
        return None


def make_file_target(directory: str, size: int) -> Target:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(os.path.abspath(directory), FILE_NAME)
    existed = os.path.exists(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)         # exactly the benchmarked range: fio sees the same file
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    t = Target("file", path, size, created=not existed)
    t.info = {"filesystem": filesystem_of(path), "disk": disk_info(t.stat_dir())}
    return t


def make_device_target(kind: str, path: str, size: int) -> Target:
    t = Target(kind, os.path.realpath(path), size)
    dev = t.open(128 * KiB if kind != "nvme" else 4096)
    try:
        if dev.capacity_bytes < size:
            raise SystemExit(f"{path}: {dev.capacity_bytes} bytes, smaller than --size {size}")
        t.info = {"device": dev.describe(), "disk": disk_info(t.stat_dir())}
        backing = read_text(os.path.join(t.stat_dir() or "/nonexistent", "loop", "backing_file"))
        if backing:                    # a loop device: what it really stores into
            t.info["loop_backing_file"] = backing
            t.info["loop_direct_io"] = read_text(os.path.join(t.stat_dir() or "", "loop", "dio"))
            t.info["filesystem"] = filesystem_of(backing) if os.path.exists(backing) else None
    finally:
        dev.close()
    return t


# ----------------------------------------------------------- measurements --

#: what is measured; "engine" and "fio" always, the others with --extra
TOOLS = {
    "engine": "bladed engine; staging = StagingBuffer (2 MiB aligned, transparent huge pages advised)",
    "fio": "fio, ioengine io_uring, fixedbufs=1, otherwise fio's defaults (one submission per I/O)",
    "engine-4k": "bladed engine; staging on plain 4 KiB pages, huge pages refused (like fio's buffers)",
    "fio-batch": "fio as above plus iodepth_batch_submit=QD, iodepth_batch_complete_max=QD "
                 "(fio's batched submission and reaping)",
    "engine-portable": "bladed's portable engine (io.engine = portable: preadv2/pwritev2 on min(QD, 8) threads, "
                       "what runs where io_uring is refused); staging as for engine",
    "fio-psync": "fio, ioengine psync, direct=1: one synchronous pread/pwrite at a time, the plain path a box "
                 "without io_uring has (file and block targets)",
}
EXTRA_TOOLS = ("engine-4k", "fio-batch", "engine-portable", "fio-psync")


@dataclass
class Config:
    size: int
    tensor_bytes: int
    queue_depth: int
    fio: str
    fio_registerfiles: bool
    drop_caches: bool


def make_staging(kind: str, nbytes: int) -> Any:
    """The engine's staging buffer: ``thp`` is what bladed allocates (2 MiB aligned, huge pages
    advised); ``4k`` is plain 4 KiB pages with huge pages refused, like fio's malloc'd buffers."""
    from bladed.io import StagingBuffer

    if kind == "thp":
        return StagingBuffer(nbytes)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_NOHUGEPAGE)
    return StagingBuffer.wrap(mm)     # its cffi view keeps the mapping alive


def staging_backing(buf: Any) -> dict[str, Any]:
    """How a staging buffer is really backed: bytes of it on transparent huge pages."""
    start, end = buf.address, buf.address + buf.nbytes
    huge = 0
    inside = False
    for line in (read_text("/proc/self/smaps") or "").splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and hi > start
        elif inside and head == "AnonHugePages:":
            huge += int(line.split()[1]) * KiB
    return {"bytes": buf.nbytes, "anon_huge_bytes": huge, "allocator_says": buf.huge.name}


def run_engine(target: Target, op_name: str, command_bytes: int, cfg: Config, staging: Any,
               engine: str = "uring") -> dict[str, Any]:
    """One measurement: all tensors of the range, back to back, on a fresh ring of ``engine``."""
    from bladed.io import Engine, Op

    op = Op.WRITE if op_name == "write" else Op.READ
    dev = target.open(command_bytes)
    dev.engine = engine
    try:
        with Engine(dev, cfg.queue_depth, [staging]) as eng:
            blocks = cfg.tensor_bytes // dev.lba_size
            n = cfg.size // cfg.tensor_bytes
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            xs = [eng.transfer(op, i * blocks, staging, nbytes=cfg.tensor_bytes) for i in range(n)]
            eng.run(xs)
            seconds = time.perf_counter() - t0
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            stats = eng.ring.stats()
            registered = eng.registered
            chunk = eng.max_chunk_bytes
    finally:
        dev.close()
    usr = ru1.ru_utime - ru0.ru_utime
    sys_ = ru1.ru_stime - ru0.ru_stime
    return {
        "bytes": cfg.size,
        "seconds": seconds,
        "mb_s": cfg.size / seconds / 1e6,
        "cpu_pct": 100.0 * (usr + sys_) / seconds,
        "usr_cpu_pct": 100.0 * usr / seconds,
        "sys_cpu_pct": 100.0 * sys_ / seconds,
        "engine": {
            "tensors": len(xs),
            "command_bytes": chunk,
            "commands": stats["submitted"],
            "max_inflight": stats["max_inflight"],
            "waits": stats["waits"],
            "registered_buffers": registered,
        },
    }


def fio_command(target: Target, op_name: str, command_bytes: int, cfg: Config, output: str,
                batch: bool = False, psync: bool = False) -> list[str]:
    engine = ["--ioengine=psync", "--direct=1"] if psync else [
        *target.fio_args(), "--fixedbufs=1", f"--registerfiles={1 if cfg.fio_registerfiles else 0}"]
    cmd = [
        cfg.fio, "--name=bladed-bench", f"--filename={target.path}", *engine,
        f"--rw={op_name}", f"--bs={command_bytes}", f"--iodepth={cfg.queue_depth}",
        f"--size={cfg.size}", "--offset=0", "--numjobs=1",
        # the engine never touches the payload: neither does fio (by default it
        # re-scrambles part of every buffer before each write)
        "--scramble_buffers=0",
        # never create, extend or preallocate: the target is laid out already
        "--allow_file_create=0", "--fallocate=none",
    ]
    if batch:
        cmd += [f"--iodepth_batch_submit={cfg.queue_depth}", "--iodepth_batch_complete_min=1",
                f"--iodepth_batch_complete_max={cfg.queue_depth}"]
    return [*cmd, "--output-format=json", f"--output={output}"]


def run_fio(target: Target, op_name: str, command_bytes: int, cfg: Config, workdir: str,
            batch: bool = False, psync: bool = False) -> dict[str, Any]:
    output = os.path.join(workdir, "fio.json")
    cmd = fio_command(target, op_name, command_bytes, cfg, output, batch, psync)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    with open(output) as f:
        text = f.read()
    report = json.loads(text[text.index("{"):])     # fio may print notes before the JSON
    job = report["jobs"][0]
    if job.get("error"):
        raise RuntimeError(f"fio job error {job['error']}: {' '.join(cmd)}")
    side = job[op_name]
    io_bytes = int(side["io_bytes"])
    if io_bytes != cfg.size:
        raise RuntimeError(f"fio moved {io_bytes} bytes, expected {cfg.size}: {' '.join(cmd)}")
    clat = side.get("clat_ns") or {}
    pct = clat.get("percentile") or {}
    return {
        "bytes": io_bytes,
        "seconds": int(side["runtime"]) / 1e3,
        "mb_s": float(side["bw_bytes"]) / 1e6,
        "cpu_pct": float(job["usr_cpu"]) + float(job["sys_cpu"]),
        "usr_cpu_pct": float(job["usr_cpu"]),
        "sys_cpu_pct": float(job["sys_cpu"]),
        "fio": {
            "bw_bytes": side["bw_bytes"],
            "io_bytes": io_bytes,
            "runtime_ms": side["runtime"],
            "iops": side["iops"],
            "clat_mean_ns": clat.get("mean"),
            "clat_p50_ns": pct.get("50.000000"),
            "clat_p99_ns": pct.get("99.000000"),
            "ctx": job.get("ctx"),
            "iodepth_level": job.get("iodepth_level"),
            "version": report.get("fio version"),
            "args": cmd[1:-2],       # without the binary and the output options
        },
    }


def measure(fn: Callable[[], dict[str, Any]], target: Target, op_name: str, cfg: Config) -> dict[str, Any]:
    """Run one measurement with the context that tells noise from signal: what else the
    disk did meanwhile, how many requests it saw, the host's CPU, the page cache."""
    cache_before = None
    if op_name == "read":
        if cfg.drop_caches:
            with contextlib.suppress(OSError):     # not root: the read is as warm as it is
                cgroup.drop_caches()
        cache_before = cached_pages(target.path) if target.kind != "nvme" else None
    sysdir = target.stat_dir()
    d0 = disk_counters(sysdir)
    c0 = cpu_times()
    result = fn()
    c1 = cpu_times()
    d1 = disk_counters(sysdir)
    result["cached_pages_before"] = cache_before
    result["host_cpu"] = cpu_shares(c0, c1)
    result["disk"] = None
    if d0 and d1:
        rio, rd, wio, wr, busy_ms = (b - a for a, b in zip(d0, d1, strict=True))
        ours = result["bytes"]
        moved = rd if op_name == "read" else wr
        result["disk"] = {
            "read_bytes": rd, "written_bytes": wr, "read_requests": rio, "write_requests": wio,
            # requests for our direction: a command split by the block layer counts twice,
            # adjacent commands merged by the I/O scheduler count once
            "requests": rio if op_name == "read" else wio,
            "other_read_bytes": rd - (ours if op_name == "read" else 0),
            "other_written_bytes": wr - (ours if op_name == "write" else 0),
            # False means the bytes did not come from (or go to) the medium: a cache or a hole
            "reached_device": moved >= 0.9 * ours,
            # the same yardstick for every tool: bytes over the time the disk was busy
            "busy_ms": busy_ms,
            "busy_mb_s": moved / (busy_ms / 1e3) / 1e6 if busy_ms else None,
        }
    return result


def prefill(target: Target, cfg: Config, staging: Any) -> dict[str, Any]:
    """Write the whole range once with 1 MiB commands (engine), so later reads hit written blocks."""
    cmd = MiB
    if target.kind == "nvme":
        dev = target.open(4096)
        cmd = min(MiB, dev.max_transfer_bytes, dev.max_transfer_bytes_huge)
        cmd -= cmd % 4096
        dev.close()
    r = run_engine(target, "write", cmd, cfg, staging)
    return {"command_bytes": cmd, "seconds": r["seconds"], "mb_s": r["mb_s"]}


def tool_order(tools: list[str], rep: int, order: str) -> list[str]:
    """``rotate``: repetition r starts with tool r mod n (E F, F E, ... for two tools),
    so no tool always runs right after another; ``fixed``: always the same order."""
    return list(tools) if order == "fixed" else trials.rotated(tools, rep)


# --------------------------------------------------------------- results --

def build_rows(runs: list[dict[str, Any]], targets: list[dict[str, Any]], ops: list[str], commands: list[int],
               tools: list[str], queue_depth: int, target_ratio: float) -> list[dict[str, Any]]:
    """Per (target, op, command size): summaries of every tool and the engine/fio ratio."""
    rows = []
    for t in targets:
        for op in ops:
            for c in commands:
                mine = [r for r in runs if (r["target"], r["op"], r["command_bytes"]) == (t["kind"], op, c)]
                per_tool: dict[str, dict[str, Any]] = {}
                for tool in tools:
                    rs = [r for r in mine if r["tool"] == tool]
                    per_tool[tool] = {
                        # the MB/s as measured, the values kept
                        "mb_s": stats.summarize([r["mb_s"] for r in rs], keep_values=True, skip_missing=False),
                        "cpu_pct_median": stats.median([r["cpu_pct"] for r in rs]),
                        # CPU of the submitting process per command (I/O worker threads included)
                        "cpu_us_per_command_median": stats.median(
                            [r["cpu_pct"] / 100 * r["seconds"] / (r["bytes"] // c) * 1e6 for r in rs]),
                        "device_requests_median": stats.median([r["disk"]["requests"] for r in rs if r["disk"]]),
                        "device_busy_mb_s_median": stats.median([r["disk"]["busy_mb_s"] for r in rs
                                                                 if r["disk"] and r["disk"].get("busy_mb_s")]),
                        "runs_not_reaching_device": sum(1 for r in rs if r["disk"] and not r["disk"]["reached_device"]),
                    }
                fio_med = per_tool["fio"]["mb_s"]["median"]
                for tool in tools:
                    med = per_tool[tool]["mb_s"]["median"]
                    per_tool[tool]["ratio_to_fio"] = med / fio_med if med and fio_med else None
                by_rep = stats.paired(mine, "engine", "fio", name=lambda r: r["tool"], group=lambda r: r["rep"],
                                      value=lambda r: r["mb_s"])
                paired = [x for xs in by_rep.values() for x in xs]
                ratio = per_tool["engine"]["ratio_to_fio"]
                rows.append({
                    "target": t["kind"],
                    "path": t["path"],
                    "op": op,
                    "command_bytes": c,
                    "queue_depth": queue_depth,
                    "engine_mb_s": per_tool["engine"]["mb_s"],
                    "fio_mb_s": per_tool["fio"]["mb_s"],
                    "ratio": ratio,                               # engine median / fio median
                    # engine/fio within each repetition
                    "paired_ratio": stats.summarize(paired, keep_values=True, skip_missing=False),
                    "meets_target": ratio is not None and ratio >= target_ratio,
                    "tools": per_tool,
                })
    return rows


def summarize_result(result: dict[str, Any]) -> None:
    """(Re)compute ``result["rows"]`` from its runs."""
    cfg = result["config"]
    result["rows"] = build_rows(result["runs"], result["targets"], cfg["ops"], cfg["command_sizes"],
                                cfg["tools"], cfg["queue_depth"], cfg["target_ratio"])


def _fmt(x: float | None, digits: int = 0) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def noise_line(result: dict[str, Any]) -> str:
    """How quiet the machine was: CPU busy share and foreign disk traffic during the measurements."""
    runs = result["runs"]
    busy = [r["host_cpu"]["busy"] for r in runs]
    parts = [f"Noise: host CPU busy during the measurements (all CPUs, this tool and fio included) "
             f"median {100 * statistics.median(busy):.0f}%, max {100 * max(busy):.0f}%"]
    m = result["machine"]
    parts.append(f"load average {m.get('loadavg_start', '?').split()[0]} at the start, "
                 f"{(m.get('loadavg_end') or '?').split()[0]} at the end")
    for t in result["targets"]:
        disk = [r["disk"] for r in runs if r["target"] == t["kind"] and r["disk"]]
        if disk:
            rd = sum(d["other_read_bytes"] for d in disk) / MiB
            wr = sum(d["other_written_bytes"] for d in disk) / MiB
            parts.append(f"other traffic on `{t['info']['disk']['name']}` during `{t['kind']}` measurements "
                         f"{rd:.0f} MiB read, {wr:.0f} MiB written in all")
    return "; ".join(parts) + "."


def render_markdown(result: dict[str, Any]) -> str:
    m, sw, cfg = result["machine"], result["software"], result["config"]
    mem = (m["memory_bytes"] or 0) / GiB
    lines = [
        f"Measured {result['date']} on {m['cpu_model']} ({m['cpus']} CPUs, {mem:.1f} GiB"
        f"{', virtual machine' if m.get('hypervisor') else ''}), {m.get('os')}, kernel {m['kernel']}, "
        f"{sw['fio']}, liburing {sw['liburing']['version']}, bladed {str(sw['bladed']['commit'])[:12]}"
        f"{' (uncommitted changes)' if sw['bladed']['dirty'] else ''}; wall time {result['wall_seconds']:.0f} s.",
        "",
    ]
    for t in result["targets"]:
        fs = t["info"].get("filesystem") or {}
        disk = t["info"].get("disk") or {}
        where = "raw"
        if fs:
            where = fs["fstype"] if fs["source"] == fs["fstype"] else f"{fs['fstype']} on {fs['source']}"
        if t["info"].get("loop_backing_file"):
            where = (f"loop device over `{t['info']['loop_backing_file']}` on {where}, "
                     f"loop direct I/O {t['info'].get('loop_direct_io')}")
        lines.append(f"Target `{t['kind']}`: `{t['path']}` ({where}; disk `{disk.get('name')}`, "
                     f"scheduler `{disk.get('scheduler')}`, max_sectors_kb {disk.get('max_sectors_kb')}).")
    cached = [r["cached_pages_before"] for r in result["runs"] if r["cached_pages_before"] is not None]
    lines += [
        "",
        f"{human_size(cfg['size'])} per measurement ({cfg['tensors']} tensors of {human_size(cfg['tensor_bytes'])}"
        f" back to back for the engine, one {human_size(cfg['size'])} sequential job for fio), QD "
        f"{cfg['queue_depth']}, {cfg['reps']} repetitions, order `{cfg['order']}`, O_DIRECT on both sides"
        + (f" (page-cache pages of the file before any read: at most {max(cached)})" if cached else "")
        + ". MB/s = 10^6 bytes/s, median [min-max]; spread = (max-min)/median; "
        "ratio = engine median / fio median.",
        "",
        f"| target | op | command | QD | engine MB/s | fio MB/s | engine spread | fio spread | ratio "
        f"| >= {cfg['target_ratio']} |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        e, f = r["engine_mb_s"], r["fio_mb_s"]
        lines.append(
            f"| {r['target']} | {r['op']} | {human_size(r['command_bytes'])} | {r['queue_depth']} "
            f"| {_fmt(e['median'])} [{_fmt(e['min'])}-{_fmt(e['max'])}] "
            f"| {_fmt(f['median'])} [{_fmt(f['min'])}-{_fmt(f['max'])}] "
            f"| {_fmt(e['spread_pct'])}% | {_fmt(f['spread_pct'])}% | {_fmt(r['ratio'], 3)} "
            f"| {'yes' if r['meets_target'] else 'no'} |")
    lines += ["", noise_line(result)]
    tools = cfg["tools"]
    lines += [
        "",
        "Every tool of the same run: median MB/s by its own clock and its ratio to fio's median; MB/s by the "
        "disk's clock (bytes over the time the disk had a request in flight, `io_ticks` of its `stat`: one "
        "yardstick for all tools); requests the disk completed per measurement (a split command counts twice, "
        "merged commands once); CPU time of the submitting process per command (user + system, io_uring "
        "worker threads included). All medians.",
        "",
        "| target | op | command | tool | MB/s | ratio to fio | disk-clock MB/s | requests | CPU us/command |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        for tool in tools:
            p = r["tools"][tool]
            lines.append(
                f"| {r['target']} | {r['op']} | {human_size(r['command_bytes'])} | {tool} "
                f"| {_fmt(p['mb_s']['median'])} | {_fmt(p['ratio_to_fio'], 2)} "
                f"| {_fmt(p.get('device_busy_mb_s_median'))} | {_fmt(p['device_requests_median'])} "
                f"| {_fmt(p['cpu_us_per_command_median'], 1)} |")
    lines += ["", *[f"* `{tool}`: {TOOLS[tool]}" for tool in tools]]
    bad = sum(p["runs_not_reaching_device"] for r in result["rows"] for p in r["tools"].values())
    if bad:
        lines += ["", f"**Warning**: {bad} measurements moved less than 90% of their bytes to or from the disk."]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ main --

def progress_line(r: dict[str, Any]) -> str:
    d = r["disk"] or {}
    other = f"{d.get('other_read_bytes', 0) / MiB:.0f}/{d.get('other_written_bytes', 0) / MiB:.0f} MiB"
    return (f"{r['target']} {r['op']:5s} {human_size(r['command_bytes']):>4s} {r['tool']:9s} "
            f"{r['mb_s']:8.1f} MB/s {r['seconds']:6.3f} s  cpu {r['cpu_pct']:5.1f}%  "
            f"disk {d.get('requests', '?')} requests, other r/w {other}"
            + ("" if d.get("reached_device", True) else "  NOT FROM/TO THE DISK"))


def parse_args(argv: list[str] | None, prog: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target-dir", help="directory for the preallocated benchmark file (O_DIRECT capable)")
    p.add_argument("--block", help="also benchmark this block device (e.g. /dev/loop0); ITS DATA IS OVERWRITTEN")
    p.add_argument("--nvme", help="also benchmark this NVMe generic char device (e.g. /dev/ng0n1); "
                                   "ITS DATA IS OVERWRITTEN")
    p.add_argument("--size", type=parse_size, default=GiB, help="bytes per measurement (default 1G)")
    p.add_argument("--tensor-size", type=parse_size, default=128 * MiB, help="bytes per tensor (default 128M)")
    p.add_argument("--command-sizes", default="128K,1M", help="comma-separated command sizes (default 128K,1M)")
    p.add_argument("--ops", default="write,read", help="comma-separated, from write,read (default write,read)")
    p.add_argument("--queue-depth", type=int, default=32, help="engine queue depth and fio iodepth (default 32)")
    p.add_argument("--reps", type=int, default=5, help="repetitions of each engine/fio pair (default 5)")
    p.add_argument("--order", choices=("rotate", "fixed"), default="rotate",
                   help="rotate: repetition r starts with tool r mod n (engine,fio then fio,engine, ...), so "
                        "neither always runs second; fixed: engine,fio every time (default rotate)")
    p.add_argument("--extra", default="",
                   help=f"comma-separated diagnostic variants measured in the same rotation: {', '.join(EXTRA_TOOLS)}"
                        " (engine on 4 KiB-page staging; fio submitting and reaping in batches)")
    p.add_argument("--fio", default="fio", help="fio binary (default: fio on PATH)")
    p.add_argument("--fio-registerfiles", action="store_true",
                   help="give fio registerfiles=1 (the engine does not register files; default off)")
    p.add_argument("--drop-caches", action="store_true",
                   help="drop the page cache before every read (root; O_DIRECT makes it unnecessary, "
                        "the JSON records the file's resident pages before each read either way)")
    p.add_argument("--target-ratio", type=float, default=DEFAULT_TARGET_RATIO,
                   help="engine/fio ratio a row must reach (default 0.95)")
    p.add_argument("--json", dest="json_out", help="write the full results here")
    p.add_argument("--markdown", nargs="?", const="-", default=None,
                   help="print the Markdown tables (to stdout, or to the given file)")
    p.add_argument("--keep", action="store_true", help="keep the benchmark file afterwards")
    p.add_argument("--render", metavar="JSON",
                   help="measure nothing: recompute the summary of a saved run and print its Markdown")
    args = p.parse_args(argv)
    if args.render:
        return args
    if not (args.target_dir or args.block or args.nvme):
        p.error("give at least one of --target-dir, --block, --nvme")
    try:
        args.command_sizes = [parse_size(s) for s in args.command_sizes.split(",") if s.strip()]
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    args.ops = [s.strip() for s in args.ops.split(",") if s.strip()]
    if not args.ops or any(o not in ("write", "read") for o in args.ops):
        p.error("--ops takes write and/or read")
    args.extra = [s.strip() for s in args.extra.split(",") if s.strip()]
    if any(x not in EXTRA_TOOLS for x in args.extra):
        p.error(f"--extra takes {', '.join(EXTRA_TOOLS)}")
    if not args.command_sizes or args.size % args.tensor_size:
        p.error("--size must be a multiple of --tensor-size")
    if any(c % 4096 for c in args.command_sizes) or args.tensor_size % 4096:
        p.error("command and tensor sizes must be multiples of 4096")
    if any(args.tensor_size % c for c in args.command_sizes):
        p.error("--tensor-size must be a multiple of every command size (fio issues only whole blocks)")
    if args.reps < 1 or not 1 <= args.queue_depth <= 4096:
        p.error("--reps must be >= 1 and --queue-depth within 1..4096")
    if shutil.which(args.fio) is None:
        p.error(f"fio not found ({args.fio})")
    return args


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    if args.render:
        with open(args.render) as f:
            saved = json.load(f)
        summarize_result(saved)
        sys.stdout.write(render_markdown(saved))
        return 0
    repo = REPO
    wall0 = time.perf_counter()
    started = dt.datetime.now(dt.UTC)
    machine = machine_info()
    cfg = Config(size=args.size, tensor_bytes=args.tensor_size, queue_depth=args.queue_depth, fio=args.fio,
                 fio_registerfiles=args.fio_registerfiles, drop_caches=args.drop_caches)
    tools = ["engine", "fio", *[x for x in EXTRA_TOOLS if x in args.extra]]

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - wall0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    targets: list[Target] = []
    if args.target_dir:
        targets.append(make_file_target(args.target_dir, args.size))
    if args.block:
        targets.append(make_device_target("block", args.block, args.size))
    if args.nvme:
        targets.append(make_device_target("nvme", args.nvme, args.size))

    stagings = {"engine": make_staging("thp", args.tensor_size)}
    if "engine-4k" in tools:
        stagings["engine-4k"] = make_staging("4k", args.tensor_size)
    for buf in stagings.values():
        buf.view()[:] = os.urandom(buf.nbytes)      # incompressible, like fio's buffers
    backing = {name: staging_backing(buf) for name, buf in stagings.items()}

    def one(tool: str, t: Target, op: str, c: int, workdir: str) -> dict[str, Any]:
        if tool == "engine-portable":
            return measure(lambda: run_engine(t, op, c, cfg, stagings["engine"], "portable"), t, op, cfg)
        if tool.startswith("engine"):
            return measure(lambda: run_engine(t, op, c, cfg, stagings[tool]), t, op, cfg)
        return measure(lambda: run_fio(t, op, c, cfg, workdir, batch=tool == "fio-batch",
                                       psync=tool == "fio-psync"), t, op, cfg)

    runs: list[dict[str, Any]] = []
    prefills = {}
    steps = len(targets) * len(args.ops) * len(args.command_sizes) * args.reps * len(tools)
    step = 0
    try:
        with tempfile.TemporaryDirectory(prefix="bench-engine-") as workdir:
            for t in targets:
                say(f"prefill {t.kind} {t.path}: writing {human_size(args.size)} once")
                prefills[t.kind] = prefill(t, cfg, stagings["engine"])
                say(f"prefill {t.kind}: {prefills[t.kind]['mb_s']:.0f} MB/s")
            for rep in range(args.reps):
                for t in targets:
                    for op in args.ops:
                        for c in args.command_sizes:
                            for tool in tool_order(tools, rep, args.order):
                                step += 1
                                r = one(tool, t, op, c, workdir)
                                r.update({"seq": step, "rep": rep, "target": t.kind, "op": op, "tool": tool,
                                          "command_bytes": c,
                                          "time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")})
                                runs.append(r)
                                say(f"[{step:3d}/{steps}] rep {rep + 1}/{args.reps} {progress_line(r)}")
    finally:
        for buf in stagings.values():
            buf.close()
        for t in targets:
            if t.kind == "file" and t.created and not args.keep:
                os.unlink(t.path)

    trials.loadavg_end(machine)
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "date": started.isoformat(timespec="seconds"),
        "wall_seconds": time.perf_counter() - wall0,
        "command": [os.path.basename(sys.executable), *sys.argv],
        "machine": machine,
        "software": {
            "python": platform.python_version(),
            "fio": fio_version(args.fio),
            "liburing": liburing_info(),
            "bladed": git_info(repo),
        },
        "config": {
            "size": args.size,
            "tensor_bytes": args.tensor_size,
            "tensors": args.size // args.tensor_size,
            "queue_depth": args.queue_depth,
            "command_sizes": args.command_sizes,
            "ops": args.ops,
            "reps": args.reps,
            "order": args.order,
            "tools": tools,
            "tool_descriptions": {tool: TOOLS[tool] for tool in tools},
            "drop_caches": args.drop_caches,
            "fio_registerfiles": args.fio_registerfiles,
            "target_ratio": args.target_ratio,
            "staging_backing": backing,
            "engine_timing": "wall clock (perf_counter) around building, submitting and completing all "
                             "tensors of one measurement; ring setup and buffer registration excluded",
            "fio_timing": "fio's own bw_bytes (io_bytes / runtime, runtime in whole ms)",
        },
        "targets": [{"kind": t.kind, "path": t.path, "size": t.size, "info": t.info,
                     "prefill": prefills.get(t.kind)} for t in targets],
        "rows": [],
        "runs": runs,
    }
    summarize_result(result)
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        trials.write_json(args.json_out, result, newline=True)
        say(f"wrote {args.json_out}")
    if args.markdown is not None:
        md = render_markdown(result)
        if args.markdown == "-":
            sys.stdout.write(md)
        else:
            with open(args.markdown, "w") as f:
                f.write(md)
            say(f"wrote {args.markdown}")
    for r in result["rows"]:
        say(f"{r['target']} {r['op']:5s} {human_size(r['command_bytes']):>4s}: engine "
            f"{_fmt(r['engine_mb_s']['median'])} MB/s, fio {_fmt(r['fio_mb_s']['median'])} MB/s, "
            f"ratio {_fmt(r['ratio'], 3)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
