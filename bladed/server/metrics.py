"""Daemon statistics, served both by the ``stats`` request and, when enabled,
as Prometheus exposition (prometheus-client) on a TCP address or a Unix socket.

One :class:`Stats` object is updated by the channel workers; a custom
collector turns it into metric families at scrape time, so there is one
source of truth for ``bladectl stats`` and for Prometheus.
"""

from __future__ import annotations

import bisect
import contextlib
import http.server
import logging
import os
import socket
import socketserver
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import MetricsHandler

log = logging.getLogger(__name__)

#: latency buckets in seconds: 20 us .. 10 s, covering a 4 KiB append to a 100+ MiB KPU
LATENCY_BUCKETS = (2e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0)
PATHS = ("pagecache", "direct")
OPS = ("read", "write")


@dataclass
class PathStats:
    """Counters of one (path, op)."""

    ops: int = 0
    bytes: int = 0
    errors: int = 0
    latency_sum_s: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))

    def observe(self, nbytes: int, seconds: float) -> None:
        self.ops += 1
        self.bytes += nbytes
        self.latency_sum_s += seconds
        self.buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1

    def to_dict(self) -> dict[str, Any]:
        return {"ops": self.ops, "bytes": self.bytes, "errors": self.errors,
                "latency_sum_s": self.latency_sum_s,
                "latency_avg_s": self.latency_sum_s / self.ops if self.ops else 0.0}


class Stats:
    """Everything the daemon counts; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.io = {(p, o): PathStats() for p in PATHS for o in OPS}
        self.pagecache_read_bytes = 0
        self.pagecache_hit_bytes = 0.0
        self.trimmed_bytes = 0
        #: Write Zeroes on teardown (devices without zeroes after deallocate, or device.zero_freed = "always")
        self.zeroed_bytes = 0
        #: whole-region scrubs at start-up (no usable journal: first start, wiped or unreadable)
        self.region_scrubbed_bytes = 0
        #: extents kept out of use because they could be neither deallocated to zeroes nor zeroed
        self.quarantined_bytes = 0
        #: reads whose crc32c did not match what was written (sessions with checksums on)
        self.integrity_errors = 0
        self.sessions_opened = 0
        self.sessions_closed = 0
        self.sessions_reclaimed = 0
        self.connections_refused = 0
        self.bad_requests = 0

    def observe_io(self, path: str, op: str, nbytes: int, seconds: float, hit_ratio: float | None = None) -> None:
        with self._lock:
            self.io[(path, op)].observe(nbytes, seconds)
            if hit_ratio is not None:
                self.pagecache_read_bytes += nbytes
                self.pagecache_hit_bytes += hit_ratio * nbytes

    def io_error(self, path: str, op: str) -> None:
        with self._lock:
            self.io[(path, op)].errors += 1

    def add(self, name: str, value: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + value)

    @property
    def hit_ratio(self) -> float | None:
        """Byte-weighted page-cache hit ratio of all page-cache reads so far."""
        with self._lock:
            return self.pagecache_hit_bytes / self.pagecache_read_bytes if self.pagecache_read_bytes else None

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "io": {p: {o: self.io[(p, o)].to_dict() for o in OPS} for p in PATHS},
                "pagecache": {"read_bytes": self.pagecache_read_bytes,
                              "hit_bytes": int(self.pagecache_hit_bytes),
                              "hit_ratio": (self.pagecache_hit_bytes / self.pagecache_read_bytes
                                            if self.pagecache_read_bytes else None)},
                "trimmed_bytes": self.trimmed_bytes,
                "zeroed_bytes": self.zeroed_bytes,
                "quarantined_bytes": self.quarantined_bytes,
                "region_scrubbed_bytes": self.region_scrubbed_bytes,
                "integrity_errors": self.integrity_errors,
                "sessions_opened": self.sessions_opened,
                "sessions_closed": self.sessions_closed,
                "sessions_reclaimed": self.sessions_reclaimed,
                "connections_refused": self.connections_refused,
                "bad_requests": self.bad_requests,
            }

    def histograms(self) -> dict[tuple[str, str], tuple[list[int], float]]:
        with self._lock:
            return {k: (list(v.buckets), v.latency_sum_s) for k, v in self.io.items()}


class Collector:
    """Prometheus view of the daemon: ``gauges()`` supplies the live values
    (sessions, extents, budget terms) that are not counters."""

    def __init__(self, stats: Stats, gauges: Callable[[], dict[str, Any]]) -> None:
        self.stats = stats
        self.gauges = gauges

    def collect(self) -> Iterator[Metric]:
        snap = self.stats.snapshot()
        by = CounterMetricFamily("bladed_io_bytes", "Bytes moved by completed requests", labels=["path", "op"])
        ops = CounterMetricFamily("bladed_io_ops", "Completed requests", labels=["path", "op"])
        errs = CounterMetricFamily("bladed_io_errors", "Failed requests", labels=["path", "op"])
        for p in PATHS:
            for o in OPS:
                d = snap["io"][p][o]
                by.add_metric([p, o], d["bytes"])
                ops.add_metric([p, o], d["ops"])
                errs.add_metric([p, o], d["errors"])
        yield by
        yield ops
        yield errs
        hist = HistogramMetricFamily("bladed_io_latency_seconds", "Service time of one request (daemon side)",
                                     labels=["path", "op"])
        for (p, o), (buckets, total) in self.stats.histograms().items():
            cum, acc = [], 0
            for bound, n in zip((*map(str, LATENCY_BUCKETS), "+Inf"), buckets, strict=True):
                acc += n
                cum.append((bound, acc))
            hist.add_metric([p, o], cum, total)
        yield hist
        pc = snap["pagecache"]
        yield CounterMetricFamily("bladed_pagecache_read_bytes", "Bytes read on the page-cache path",
                                  value=pc["read_bytes"])
        yield CounterMetricFamily("bladed_pagecache_hit_bytes", "Page-cache read bytes that were resident",
                                  value=pc["hit_bytes"])
        yield GaugeMetricFamily("bladed_pagecache_hit_ratio", "Byte-weighted page-cache hit ratio since start",
                                value=pc["hit_ratio"] if pc["hit_ratio"] is not None else 0.0)
        yield CounterMetricFamily("bladed_trimmed_bytes", "Bytes deallocated (TRIM) on teardown and reclaim",
                                  value=snap["trimmed_bytes"])
        for name, doc in (("zeroed_bytes", "Bytes Write-Zeroed on teardown and reclaim (no zeroes after TRIM)"),
                          ("quarantined_bytes", "Bytes kept out of use: could be neither deallocated to zeroes "
                                                "nor zeroed"),
                          ("region_scrubbed_bytes", "Bytes scrubbed at start-up for want of a usable journal"),
                          ("integrity_errors", "Reads whose crc32c did not match what was written")):
            yield CounterMetricFamily(f"bladed_{name}", doc, value=snap[name])
        yield CounterMetricFamily("bladed_sessions_opened", "Sessions opened", value=snap["sessions_opened"])
        yield CounterMetricFamily("bladed_sessions_reclaimed", "Sessions of a crashed instance reclaimed at start",
                                  value=snap["sessions_reclaimed"])
        live = self.gauges()
        yield GaugeMetricFamily("bladed_sessions", "Open sessions", value=live["sessions"])
        ext = GaugeMetricFamily("bladed_extent_blocks", "Blocks of the KV region", labels=["state"])
        ext.add_metric(["used"], live["extents"]["used_blocks"])
        ext.add_metric(["free"], live["extents"]["free_blocks"])
        yield ext
        replan = live.get("replan", {})
        yield CounterMetricFamily("bladed_replans", "Budget shrinks that re-planned live sessions",
                                  value=replan.get("replans", 0))
        yield CounterMetricFamily("bladed_demoted_kpus", "KPUs moved live from the page-cache path to the "
                                                         "NVMe-direct path", value=replan.get("demoted_kpus", 0))
        yield CounterMetricFamily("bladed_demoted_bytes", "Bytes of those KPUs", value=replan.get("demoted_bytes", 0))
        yield CounterMetricFamily("bladed_demotions_failed",
                                  "Demotions refused (no space, memory or I/O error; the KPU stays where it was)",
                                  value=replan.get("demotions_failed", 0))
        yield GaugeMetricFamily("bladed_lba_size_bytes", "LBA size of the KV region", value=live["lba_size"])
        budget = GaugeMetricFamily("bladed_budget_bytes", "Terms of Eq. 1-2 (bytes)", labels=["term"])
        for term, value in live["budget"].items():
            if isinstance(value, int | float) and not isinstance(value, bool) and value is not None:
                budget.add_metric([term], float(value))
        yield budget


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, _ = super().get_request()
        # http.server wants a (host, port) client address for its log lines
        return sock, ("unix", 0)


class _HTTPServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


class MetricsServer:
    """Prometheus exposition on ``("tcp", (host, port))`` or ``("unix", path)``."""

    def __init__(self, target: tuple[str, Any], collector: Collector, socket_mode: int = 0o660) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        handler: Any = MetricsHandler.factory(self.registry)
        handler.log_message = lambda *a, **k: None
        kind, where = target
        self.server: socketserver.BaseServer
        if kind == "unix":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(where)
            self.server = _UnixHTTPServer(where, handler)
            os.chmod(where, socket_mode)
            self.address = f"unix:{where}"
        else:
            self.server = _HTTPServer(where, handler)
            host, port = self.server.server_address[:2]
            self.address = f"{host!s}:{port}"
        self._path = where if kind == "unix" else None
        self._thread = threading.Thread(target=self.server.serve_forever, name="bladed-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        if self._path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
