"""Measurements: block-layer counters, CPU time, samplers (their statistics: :mod:`bladed_bench.stats`).

* Device throughput and busy ratio come from the block layer's own counters
  in ``/sys/block/<dev>/stat`` (sectors read/written, ``io_ticks``: the
  milliseconds during which the device had at least one request in flight).
  They count every process on the machine, not only the benchmark.
* CPU time of a process (all its threads, including io_uring workers) comes
  from ``/proc/<pid>/stat``; kernel threads (writeback flushers, kswapd) are
  not charged to it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

SECTOR = 512
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- block device --------------------------------------------------------------------

def block_device_of(path: str) -> str | None:
    """``/sys/dev/block/M:m`` (resolved) of the device holding ``path``; None for tmpfs & co."""
    st = os.stat(path)
    sysdir = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    if not os.path.exists(os.path.join(sysdir, "stat")):
        return None
    return os.path.realpath(sysdir)


@dataclass(frozen=True)
class DiskStat:
    """One reading of a block device's ``stat`` file."""

    t: float                 # time.perf_counter() of the reading
    read_ios: int
    read_sectors: int
    write_ios: int
    write_sectors: int
    io_ticks_ms: int
    in_flight: int

    @classmethod
    def read(cls, sysdir: str) -> DiskStat:
        with open(os.path.join(sysdir, "stat")) as f:
            v = [int(x) for x in f.read().split()]
        return cls(t=time.perf_counter(), read_ios=v[0], read_sectors=v[2], write_ios=v[4], write_sectors=v[6],
                   in_flight=v[8], io_ticks_ms=v[9])

    def delta(self, before: DiskStat) -> dict[str, float | None]:
        dt = self.t - before.t
        rb = (self.read_sectors - before.read_sectors) * SECTOR
        wb = (self.write_sectors - before.write_sectors) * SECTOR
        ticks = self.io_ticks_ms - before.io_ticks_ms
        return {
            "seconds": dt,
            "read_bytes": rb,
            "write_bytes": wb,
            "read_ios": self.read_ios - before.read_ios,
            "write_ios": self.write_ios - before.write_ios,
            "io_ticks_ms": ticks,
            "busy": min(1.0, ticks / 1000.0 / dt) if dt > 0 else None,
            "read_GBps": rb / dt / 1e9 if dt > 0 else None,
            "write_GBps": wb / dt / 1e9 if dt > 0 else None,
        }


class NullDisk:
    """Stands in for a device whose counters cannot be read."""

    sysdir = None


class DiskSampler:
    """Reads a device's counters every ``interval`` seconds in a thread (Fig. 12's time series)."""

    def __init__(self, sysdir: str, interval: float = 0.1, extra: Callable[[], dict[str, float]] | None = None,
                 extra_every: int = 5) -> None:
        self.sysdir = sysdir
        self.interval = interval
        self.samples: list[DiskStat] = []
        self.extra_samples: list[tuple[float, dict[str, float]]] = []
        self._extra = extra
        self._extra_every = extra_every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-disk-sampler", daemon=True)

    def start(self) -> DiskSampler:
        self.samples.append(DiskStat.read(self.sysdir))
        self._thread.start()
        return self

    def _run(self) -> None:
        i = 0
        while not self._stop.wait(self.interval):
            self.samples.append(DiskStat.read(self.sysdir))
            if self._extra is not None and i % self._extra_every == 0:
                with contextlib.suppress(OSError, ValueError):
                    self.extra_samples.append((time.perf_counter(), self._extra()))
            i += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(DiskStat.read(self.sysdir))

    def series(self, t0: float) -> dict[str, list[float]]:
        """Per-interval throughput (GB/s) and busy ratio, times relative to ``t0``."""
        out: dict[str, list[float]] = {"t": [], "read_GBps": [], "write_GBps": [], "busy": []}
        for a, b in zip(self.samples, self.samples[1:], strict=False):
            d = b.delta(a)
            if not d["seconds"] or d["seconds"] <= 0:
                continue
            out["t"].append(round(b.t - t0, 3))
            out["read_GBps"].append(round(d["read_GBps"] or 0.0, 4))
            out["write_GBps"].append(round(d["write_GBps"] or 0.0, 4))
            out["busy"].append(round(d["busy"] or 0.0, 3))
        return out


def _wait_quiet(active: Callable[[], bool], quiet_s: float, timeout_s: float,
                poll_s: float) -> tuple[float, bool]:
    """Poll ``active`` (was there activity since its last call?) until it has said no for ``quiet_s``.
    Returns (seconds waited, whether that happened before ``timeout_s``)."""
    t0 = time.monotonic()
    quiet_since = t0
    while True:
        time.sleep(poll_s)
        now = time.monotonic()
        if active():
            quiet_since = now
        elif now - quiet_since >= quiet_s:
            return now - t0, True
        if now - t0 >= timeout_s:
            return now - t0, False


def wait_device_idle(sysdir: str, quiet_s: float = 0.5, timeout_s: float = 20.0,
                     poll_s: float = 0.1) -> tuple[float, bool]:
    """Wait until the device has had no request in flight for ``quiet_s`` (io_ticks and the in-flight
    count unchanged), e.g. for the discards that ext4's ``discard`` option sends after a teardown freed
    blocks.  Returns (seconds waited, whether it became idle before ``timeout_s``)."""
    last = DiskStat.read(sysdir)

    def active() -> bool:
        nonlocal last
        cur = DiskStat.read(sysdir)
        busy = cur.io_ticks_ms != last.io_ticks_ms or bool(cur.in_flight)
        last = cur
        return busy

    return _wait_quiet(active, quiet_s, timeout_s, poll_s)


# Free page reporting (virtio-balloon VIRTIO_BALLOON_F_REPORTING) hands free guest pages back to the
# host a few seconds after they are freed; the next writer that touches one pays a host fault and
# the host's zero-fill (on the test VM a fresh 32 MiB page-cache write takes ~80 ms instead of ~5).
# Without waiting, how much of a run's memory is still host-backed depends on what the previous run
# freed and how long ago, so "cold" differs from run to run.
PAGE_REPORTING_COUNTER = "/sys/module/page_reporting/parameters/reported_kib"


def reported_kib() -> int | None:
    """KiB of free memory the guest has reported to the host so far, or None without page reporting."""
    try:
        with open(PAGE_REPORTING_COUNTER) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def wait_free_pages_reported(quiet_s: float = 4.0, timeout_s: float = 60.0,
                             poll_s: float = 0.25) -> tuple[float | None, bool | None, int | None]:
    """Wait until free page reporting has been quiet for ``quiet_s`` (it reports in passes every 2 s
    while freed pages wait), so every run starts with its free memory handed back to the host.
    Returns (seconds waited, whether it went quiet before ``timeout_s``, KiB reported meanwhile);
    all None on a host without page reporting."""
    first = reported_kib()
    if first is None:
        return None, None, None
    last = first

    def active() -> bool:
        nonlocal last
        cur = reported_kib() or 0
        moved, last = cur != last, cur
        return moved

    waited, quiet = _wait_quiet(active, quiet_s, timeout_s, poll_s)
    return waited, quiet, last - first


# -- processes -----------------------------------------------------------------------

def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process (all threads), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# -- intervals -----------------------------------------------------------------------

def union_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of ``[start, end]`` intervals."""
    total = 0.0
    cur_s: float | None = None
    cur_e = 0.0
    for s, e in sorted(intervals):
        if cur_s is None or s > cur_e:
            if cur_s is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_s is not None:
        total += cur_e - cur_s
    return total


__all__ = ["DiskSampler", "DiskStat", "NullDisk", "block_device_of", "cpu_seconds", "reported_kib", "rss_bytes",
           "union_seconds", "wait_device_idle", "wait_free_pages_reported"]
