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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import MetricsHandler

from bladed import __version__
from bladed._uring import lib
from bladed.protocol import NO_HIT, PROTOCOL_VERSION, ServedRow
from bladed.residency.planner import KVPath

log = logging.getLogger(__name__)

#: latency buckets in seconds: 20 us .. 10 s, covering a 4 KiB append to a 100+ MiB KPU
LATENCY_BUCKETS = (2e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0)
#: the same bounds in ns, for the lane's C counters (``bd_lane_counters``)
LATENCY_BOUNDS_NS = tuple(round(b * 1e9) for b in LATENCY_BUCKETS)
PATHS = tuple(p.value for p in KVPath)
_PAGECACHE = KVPath.PAGECACHE.value
_DIRECT = KVPath.DIRECT.value
OPS = ("read", "write")


@dataclass
class PathCounters:
    """Counters of one (path, op) in the daemon."""

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


#: counters kept per label value as well as in total: stat name -> label name (``bladectl stats``
#: reports them as ``<name>_by_<label>``, Prometheus as ``bladed_<name>_total{<label>=...}``)
LABELLED = {"sessions_closed": "reason", "connections_refused": "reason", "bad_requests": "code",
            "prefix_evictions": "reason"}
#: why a connection is refused (before its hello): the label values of bladed_connections_refused_total
REFUSALS = ("not_allowed", "too_many")
#: why a retained prefix is evicted (bladed.server.prefix): known up front, so they start at 0 too
PREFIX_EVICTIONS = ("device_quota", "pagecache_quota", "live_session", "region_full", "superseded", "requested",
                    "unverified", "integrity_error", "io_error")


class Stats:
    """Everything the daemon counts; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.io = {(p, o): PathCounters() for p in PATHS for o in OPS}
        self.pagecache_read_bytes = 0
        self.pagecache_hit_bytes = 0.0
        #: the live channels, whose lanes' C counters (``bd_lane_counters``) are added when read
        self._lanes: set[Any] = set()
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
        #: requests answered with an error the client caused (a bad frame, bad JSON, an unknown op, a refusal)
        self.bad_requests = 0
        #: retained prefixes (bladed.server.prefix): opens that found one / found none, tokens copied from one,
        #: prefixes retained, prefixes evicted (by why)
        self.prefix_hits = 0
        self.prefix_misses = 0
        self.prefix_reused_tokens = 0
        self.prefix_retained = 0
        self.prefix_evictions = 0
        #: the shared tier (bladed.server.shared_tier)
        self.prefix_shared_hits = 0
        self.prefix_shared_published = 0
        self.prefix_shared_rejected = 0
        self.prefix_shared_errors = 0
        #: the LABELLED counters by label value; the refusal reasons are known up front, so they start at 0
        self.by_label: dict[str, dict[str, int]] = {name: {} for name in LABELLED}
        self.by_label["connections_refused"] = dict.fromkeys(REFUSALS, 0)
        self.by_label["prefix_evictions"] = dict.fromkeys(PREFIX_EVICTIONS, 0)

    def observe_served(self, path: str, writes: Sequence[bool],
                       rows: Sequence[ServedRow | None]) -> None:
        """Count the ranges of one request that ran on ``path``, under one lock: ``writes[i]`` tells range ``i``'s
        op, ``rows[i]`` its :data:`~bladed.protocol.ServedRow`, None where it failed."""
        with self._lock:
            for write, row in zip(writes, rows, strict=True):
                counters = self.io[(path, "write" if write else "read")]
                if row is None:
                    counters.errors += 1
                    continue
                nbytes, service_ns, hit = row[0], row[1], row[2]
                counters.observe(nbytes, service_ns / 1e9)
                if hit != NO_HIT:
                    self.pagecache_read_bytes += nbytes
                    self.pagecache_hit_bytes += hit

    def watch_lane(self, channel: Any) -> None:
        """Count what a channel's lane serves (``channel.counters``, C memory the channel owns: read
        when asked) until :meth:`fold_lane`.  From the channel's making, so a fold always comes after."""
        with self._lock:
            self._lanes.add(channel)

    def fold_lane(self, channel: Any) -> None:
        """The channel is done: what its lane served joins the totals for good."""
        with self._lock:
            if channel in self._lanes:
                self._lanes.discard(channel)
                self.pagecache_read_bytes, self.pagecache_hit_bytes = _add_lane(
                    self.io, channel.counters, self.pagecache_read_bytes, self.pagecache_hit_bytes)

    def _totals(self) -> tuple[dict[tuple[str, str], PathCounters], int, float]:
        """The io counters and page-cache read/hit bytes with the live lanes' added (the caller holds the lock)."""
        if not self._lanes:
            return self.io, self.pagecache_read_bytes, self.pagecache_hit_bytes
        io = {k: replace(v, buckets=list(v.buckets)) for k, v in self.io.items()}
        read, hit = self.pagecache_read_bytes, self.pagecache_hit_bytes
        for ch in self._lanes:
            read, hit = _add_lane(io, ch.counters, read, hit)
        return io, read, hit

    def add(self, name: str, value: int = 1) -> None:
        """Add to an unlabelled counter (the LABELLED ones go through :meth:`count`)."""
        if name in LABELLED:
            raise ValueError(f"{name} is counted by {LABELLED[name]}: use Stats.count")
        with self._lock:
            setattr(self, name, getattr(self, name) + value)

    def count(self, name: str, label: str, value: int = 1) -> None:
        """Add to a LABELLED counter: its total and its ``label`` value."""
        with self._lock:
            setattr(self, name, getattr(self, name) + value)
            by = self.by_label[name]
            by[label] = by.get(label, 0) + value

    @property
    def hit_ratio(self) -> float | None:
        """Byte-weighted page-cache hit ratio of all page-cache reads so far."""
        with self._lock:
            _, read, hit = self._totals()
            return hit / read if read else None

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            io, read, hit = self._totals()
            return {
                "io": {p: {o: io[(p, o)].to_dict() for o in OPS} for p in PATHS},
                "pagecache": {"read_bytes": read, "hit_bytes": int(hit), "hit_ratio": hit / read if read else None},
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
                "prefix_hits": self.prefix_hits,
                "prefix_misses": self.prefix_misses,
                "prefix_reused_tokens": self.prefix_reused_tokens,
                "prefix_retained": self.prefix_retained,
                "prefix_evictions": self.prefix_evictions,
                "prefix_shared_hits": self.prefix_shared_hits,
                "prefix_shared_published": self.prefix_shared_published,
                "prefix_shared_rejected": self.prefix_shared_rejected,
                "prefix_shared_errors": self.prefix_shared_errors,
            } | {f"{name}_by_{label}": dict(self.by_label[name]) for name, label in LABELLED.items()}

    def histograms(self) -> dict[tuple[str, str], tuple[list[int], float]]:
        with self._lock:
            return {k: (list(v.buckets), v.latency_sum_s) for k, v in self._totals()[0].items()}


def _add_lane(io: dict[tuple[str, str], PathCounters], c: Any, read: int, hit: float) -> tuple[int, float]:
    """Add a lane's C counters (per path, ``enum bd_gate_path``; per op, index 0 read, 1 write) to ``io``;
    returns the page-cache read/hit bytes plus its."""
    for p, path in ((lib.BD_PATH_PAGECACHE, _PAGECACHE), (lib.BD_PATH_DIRECT, _DIRECT)):
        for i, op in enumerate(OPS):
            pc = io[(path, op)]
            pc.ops += c.ops[p][i]
            pc.bytes += c.bytes[p][i]
            pc.errors += c.errors[p][i]
            pc.latency_sum_s += c.latency_ns[p][i] / 1e9
            row = c.buckets[p][i]
            for b in range(len(pc.buckets)):
                pc.buckets[b] += row[b]
    return read + c.pagecache_read_bytes, hit + c.pagecache_hit_bytes


#: the unlabelled counters of :class:`Stats`: (stat, help)
_COUNTERS = (
    ("pagecache_read_bytes", "Bytes read on the page-cache path (the hit ratio's denominator)"),
    ("pagecache_hit_bytes", "Page-cache read bytes that were resident (the hit ratio's numerator)"),
    ("trimmed_bytes", "Bytes deallocated (TRIM) on teardown, reclaim and trim"),
    ("zeroed_bytes", "Bytes Write-Zeroed on teardown and reclaim (no zeroes after TRIM)"),
    ("quarantined_bytes", "Bytes kept out of use: could be neither deallocated to zeroes nor zeroed"),
    ("region_scrubbed_bytes", "Bytes scrubbed at start-up for want of a usable journal"),
    ("integrity_errors", "Reads whose crc32c did not match what was written"),
    ("sessions_opened", "Sessions opened"),
    ("sessions_reclaimed", "Sessions of a crashed instance reclaimed at start-up"),
    ("prefix_hits", "Sessions opened with a prefix key that found a retained prefix"),
    ("prefix_misses", "Sessions opened with a prefix key that found none"),
    ("prefix_reused_tokens", "Tokens of KV copied from retained prefixes into new sessions (prefill skipped)"),
    ("prefix_retained", "Prefixes retained"),
    ("prefix_shared_hits", "Sessions that found their prefix on the shared tier (Redis)"),
    ("prefix_shared_published", "Retained prefix blocks published to the shared tier"),
    ("prefix_shared_rejected", "Shared-tier blocks refused: corrupt, truncated, or not signed for their key "
                               "and position (swapped, copied, forged, old secret): misses"),
    ("prefix_shared_errors", "Shared-tier calls that failed or timed out: misses"),
)
#: the LABELLED counters: stat -> (metric, help)
_LABELLED_COUNTERS = {
    "sessions_closed": ("bladed_sessions_closed", "Sessions closed, by why"),
    "connections_refused": ("bladed_connections_refused", "Connections refused before their hello, by why"),
    "bad_requests": ("bladed_requests_refused", "Requests answered with an error the client caused, by its code"),
    "prefix_evictions": ("bladed_prefix_evictions", "Retained prefixes evicted, by why"),
}
#: Eq. 1-2 and the ledger, one gauge each: (metric, key of Daemon.gauges()["budget"], help with the paper's symbol)
_BUDGET_GAUGES = (
    ("bladed_pagecache_budget_bytes", "pagecache_budget_bytes",
     "B_pc (Eq. 2): the page-cache budget, after budget.override / budget.cap"),
    ("bladed_pagecache_budget_computed_bytes", "pagecache_budget_computed_bytes",
     "B_pc as Eq. 2 computes it, before budget.override / budget.cap"),
    ("bladed_pagecache_held_bytes", "held_bytes", "Page-cache bytes live sessions' plans hold (Group 1), out of B_pc"),
    ("bladed_memory_usable_bytes", "usable_bytes", "M* (Eq. 1) = min(M_avail, M_max - M_anon+shmem)"),
    ("bladed_memory_available_bytes", "host_available_bytes", "M_avail (Eq. 1): the host's MemAvailable"),
    ("bladed_memory_limit_bytes", "memory_limit_bytes",
     "M_max (Eq. 1): the memory cgroup's limit (smallest over its ancestors), or MemTotal if it has none"),
    ("bladed_memory_anon_shmem_bytes", "anon_shmem_bytes",
     "M_anon+shmem (Eq. 1): anonymous and shared memory charged to the memory cgroup"),
    ("bladed_memory_file_bytes", "file_bytes", "Page cache charged to the memory cgroup now (shmem excluded)"),
    ("bladed_memory_total_bytes", "host_total_bytes", "The host's MemTotal"),
    ("bladed_staging_pinned_bytes", "pinned_bytes", "M_pin,others (Eq. 2): staging memory of the open sessions"),
)
#: live re-planning counters: (metric, key of LiveReplanner.to_dict(), help)
_REPLAN_COUNTERS = (
    ("bladed_replans", "replans", "Budget shrinks that re-planned a live session"),
    ("bladed_demoted_kpus", "demoted_kpus", "KPUs moved live from the page-cache path to the NVMe-direct path"),
    ("bladed_demoted_bytes", "demoted_bytes", "Bytes of those KPUs"),
    ("bladed_demotions_failed", "demotions_failed",
     "Demotions refused (no space, memory or I/O error; the KPU stays where it was)"),
    ("bladed_extents_moved", "extents_moved",
     "Session extents moved to a larger run because a demotion could not grow them in place"),
    ("bladed_extent_moved_bytes", "moved_bytes", "Bytes copied by those moves"),
)

#: retained prefixes now: (metric, key of PrefixCache.gauges(), help)
_PREFIX_GAUGES = (
    ("bladed_prefix_entries", "entries", "Retained prefixes"),
    ("bladed_prefix_retained_tokens", "tokens", "Tokens of KV the retained prefixes hold"),
    ("bladed_prefix_retained_pagecache_bytes", "pagecache_bytes", "Page-cache bytes the retained prefixes hold"),
    ("bladed_prefix_retained_device_bytes", "device_bytes", "Device bytes the retained prefixes hold"),
)

class Collector:
    """Prometheus view of the daemon (docs/operations.md, "Metrics"): counters from :class:`Stats`,
    and ``gauges()`` for the live values (sessions, extents, budget terms)."""

    def __init__(self, stats: Stats, gauges: Callable[[], dict[str, Any]]) -> None:
        self.stats = stats
        self.gauges = gauges

    def collect(self) -> Iterator[Metric]:
        build = GaugeMetricFamily("bladed_build_info", "The running bladed: its version and the newest protocol "
                                  "it speaks (value 1)", labels=["version", "protocol"])
        build.add_metric([__version__, str(PROTOCOL_VERSION)], 1)
        yield build
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
        # no hit-ratio gauge: a ratio since start says nothing about now; rate() of these two does
        pc = snap["pagecache"]
        flat = snap | {"pagecache_read_bytes": pc["read_bytes"], "pagecache_hit_bytes": pc["hit_bytes"]}
        for name, doc in _COUNTERS:
            yield CounterMetricFamily(f"bladed_{name}", doc, value=flat[name])
        for name, (metric, doc) in _LABELLED_COUNTERS.items():
            fam = CounterMetricFamily(metric, doc, labels=[LABELLED[name]])
            for label, n in sorted(snap[f"{name}_by_{LABELLED[name]}"].items()):
                fam.add_metric([label], n)
            yield fam

        live = self.gauges()
        engine = GaugeMetricFamily("bladed_io_engine_info", "The engine that moves the store's bytes (value 1): "
                                   "uring, or portable (threads; no io_uring here)", labels=["engine"])
        engine.add_metric([live["engine"]], 1)
        yield engine
        yield GaugeMetricFamily("bladed_sessions", "Open sessions", value=live["sessions"])
        yield GaugeMetricFamily("bladed_connections", "Open client connections (control and data)",
                                value=live["connections"])
        lba = live["lba_size"]
        ext = live["extents"]
        yield GaugeMetricFamily("bladed_lba_size_bytes", "LBA size of the KV region", value=lba)
        yield GaugeMetricFamily("bladed_region_size_bytes", "Size of the KV region", value=ext["region_blocks"] * lba)
        yield GaugeMetricFamily("bladed_extent_used_bytes", "Bytes of the KV region held by sessions' extents "
                                "(or quarantined)", value=ext["used_blocks"] * lba)
        yield GaugeMetricFamily("bladed_extent_free_bytes", "Free bytes of the KV region",
                                value=ext["free_blocks"] * lba)
        yield GaugeMetricFamily("bladed_extent_largest_free_bytes", "The largest free extent of the KV region "
                                "(the largest direct-path footprint a new session can get)",
                                value=ext["largest_free"] * lba)
        budget = live["budget"]
        for metric, key, doc in _BUDGET_GAUGES:
            value = budget.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                yield GaugeMetricFamily(metric, doc, value=value)
        prefixes = live.get("prefixes", {})
        for metric, key, doc in _PREFIX_GAUGES:
            yield GaugeMetricFamily(metric, doc, value=prefixes.get(key, 0))
        replan = live.get("replan", {})
        for metric, key, doc in _REPLAN_COUNTERS:
            yield CounterMetricFamily(metric, doc, value=replan.get(key, 0))
        samples = CounterMetricFamily("bladed_budget_samples", "Samples of Eq. 1-2 taken by live re-planning, by "
                                      "what triggered them", labels=["reason"])
        for reason in ("periodic", "pressure"):
            samples.add_metric([reason], replan.get("budget_samples", {}).get(reason, 0))
        yield samples
        yield CounterMetricFamily("bladed_pagecache_budget_changes", "Moves of B_pc past the hysteresis that live "
                                  "re-planning applied", value=replan.get("budget_samples", {}).get("changes", 0))


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
        # process_* (CPU, memory, descriptors, start time) and python_info, as every Python exporter has
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
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
