"""The Prometheus exporter (prometheus-client): :class:`Collector` turns :class:`Stats` and the daemon's
gauges into metric families at scrape time; :class:`MetricsServer` serves them on a TCP address or a Unix
socket (docs/operations.md, "Metrics")."""

from __future__ import annotations

import contextlib
import http.server
import math
import os
import socket
import socketserver
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import MetricsHandler

from bladed import __version__
from bladed.protocol import PROTOCOL_VERSION
from bladed.server.metrics import LABELLED, LATENCY_BUCKETS, OPS, PATHS, WRITE_CAUSES, Stats
from bladed.server.wear import SPILLS

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
    ("bladed_memory_usable_bytes", "usable_bytes",
     "M* (Eq. 1) = min(M_avail, M_max - M_anon+shmem - M_kernel - M_mapped - M_free) of the binding cgroup"),
    ("bladed_memory_available_bytes", "host_available_bytes", "M_avail (Eq. 1): the host's MemAvailable"),
    ("bladed_memory_limit_bytes", "memory_limit_bytes",
     "M_max (Eq. 1): the limit of the binding cgroup (the limited one, from the daemon's up, with the least room; "
     "bladed_memory_binding_info names it), or MemTotal if none limits"),
    ("bladed_memory_anon_shmem_bytes", "anon_shmem_bytes",
     "M_anon+shmem (Eq. 1): anonymous and shared memory charged to the binding cgroup, descendants included, "
     "bladed's own KV in memory files excluded"),
    ("bladed_memory_kernel_bytes", "charged_kernel_bytes",
     "M_kernel (Eq. 1): the binding cgroup's other charges (slab, page tables, stacks)"),
    ("bladed_memory_free_bytes", "free_bytes",
     "M_free (Eq. 1): kept free for a neighbour's growth while a demotion gets going (budget.headroom, "
     "budget.absorb_rate)"),
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
    ("bladed_memory_reactions", "reactions",
     "Kernel memory events that made the daemon demote: each timed to its first KPU written and freed "
     "(bladed_memory_reaction_seconds)"),
)

#: retained prefixes now: (metric, key of PrefixCache.gauges(), help)
_PREFIX_GAUGES = (
    ("bladed_prefix_entries", "entries", "Retained prefixes"),
    ("bladed_prefix_retained_tokens", "tokens", "Tokens of KV the retained prefixes hold"),
    ("bladed_prefix_retained_pagecache_bytes", "pagecache_bytes", "Page-cache bytes the retained prefixes hold"),
    ("bladed_prefix_retained_device_bytes", "device_bytes", "Device bytes the retained prefixes hold"),
)

#: the drive's SMART / Health log (nvme backend): (metric, key of SmartLog.to_dict(), counter?, scale, help)
_SMART = (
    ("bladed_nvme_critical_warning", "critical_warning", False, 1,
     "The drive's critical warning bits (0 spare, 1 temperature, 2 reliability, 3 read-only, 4 backup)"),
    ("bladed_nvme_temperature_celsius", "temperature_celsius", False, 1, "The drive's composite temperature"),
    ("bladed_nvme_available_spare", "available_spare", False, 1, "The drive's available spare, percent"),
    ("bladed_nvme_available_spare_threshold", "available_spare_threshold", False, 1,
     "The available spare below which the drive warns, percent"),
    ("bladed_nvme_percentage_used", "percentage_used", False, 1,
     "The drive's estimate of its rated life used, percent (may pass 100)"),
    ("bladed_nvme_data_written_bytes", "data_written_bytes", True, 1,
     "Bytes written to the drive by every host writer (data units written x 512000)"),
    ("bladed_nvme_data_read_bytes", "data_read_bytes", True, 1, "Bytes read from the drive (data units x 512000)"),
    ("bladed_nvme_host_write_commands", "host_write_commands", True, 1, "Write commands the drive completed"),
    ("bladed_nvme_host_read_commands", "host_read_commands", True, 1, "Read commands the drive completed"),
    ("bladed_nvme_media_errors", "media_errors", True, 1, "Unrecovered data integrity errors the drive counted"),
    ("bladed_nvme_power_on_seconds", "power_on_hours", True, 3600, "The drive's power-on time (whole hours)"),
)


def _wear_families(wear: dict[str, Any]) -> Iterator[Metric]:
    """What bladed wrote today and since install, the write budget, the kernel's counts, the drive's figures."""
    for metric, key, doc in (
            ("bladed_wear_written_today_bytes", "today",
             "Bytes bladed's own commands wrote to the store device today (UTC), by cause (the wear ledger)"),
            ("bladed_wear_written_since_install_bytes", "since_install",
             "Bytes bladed's own commands wrote to the store device since the wear ledger began, by cause")):
        fam = GaugeMetricFamily(metric, doc, labels=["cause"])
        for cause in WRITE_CAUSES:
            fam.add_metric([cause], wear[key].get(cause, 0))
        yield fam
    yield GaugeMetricFamily("bladed_write_budget_bytes", "io.write_budget: bytes a UTC day bladed may write to the "
                            "device before new direct-path spills are refused (0: no budget)",
                            value=wear["write_budget_bytes"])
    refused = CounterMetricFamily("bladed_write_budget_refusals", "New direct-path spills refused because "
                                  "io.write_budget was spent, by what they were", labels=["what"])
    for what in SPILLS:
        refused.add_metric([what], wear["refusals"].get(what, 0))
    yield refused
    kernel = CounterMetricFamily("bladed_device_written_bytes", "Bytes the kernel says the block device holding "
                                 "the store / the page-cache directory wrote since the daemon started, all writers "
                                 "(/sys/block/DEV/stat; no NVMe passthrough unless queue/iostats_passthrough)",
                                 labels=["role", "device"])
    for role, k in sorted(wear["kernel"].items()):
        if k.get("device") and k.get("written_bytes") is not None:
            kernel.add_metric([role, k["device"]], k["written_bytes"])
    if kernel.samples:
        yield kernel
    smart = wear.get("smart")
    if smart is not None:
        for metric, key, counter, scale, doc in _SMART:
            family = CounterMetricFamily if counter else GaugeMetricFamily
            yield family(metric, doc, value=smart[key] * scale)
    if wear.get("endurance_bytes") is not None:
        yield GaugeMetricFamily("bladed_endurance_bytes", "The drive's rated bytes written (device.endurance_tbw, "
                                "or the drive's endurance estimate)", value=wear["endurance_bytes"])
    if wear.get("days_left") is not None:
        yield GaugeMetricFamily("bladed_wear_days_left", "Days until the drive's rated bytes written are reached "
                                "at the current rate", value=wear["days_left"])


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
        written = CounterMetricFamily("bladed_direct_written_bytes", "Bytes bladed's own write commands wrote to "
                                      "the store device (whole LBAs, edges included), by cause", labels=["cause"])
        for cause in WRITE_CAUSES:
            written.add_metric([cause], snap["direct_written_by_cause"].get(cause, 0))
        yield written

        live = self.gauges()
        engine = GaugeMetricFamily("bladed_io_engine_info", "The engine that moves the store's bytes (value 1): "
                                   "uring, or portable (threads; no io_uring here)", labels=["engine"])
        engine.add_metric([live["engine"]], 1)
        yield engine
        yield GaugeMetricFamily("bladed_sessions", "Open sessions", value=live["sessions"])
        by_format = GaugeMetricFamily("bladed_sessions_by_kv_format", "Open sessions by the KV storage format of "
                                      "their rows (plain: rows of the geometry's dtype, unnamed)", labels=["kv_format"])
        for fmt, n in sorted((live["sessions_by_kv_format"] or {"plain": 0}).items()):  # never an empty family
            by_format.add_metric([fmt], n)
        yield by_format
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
        samples = CounterMetricFamily("bladed_budget_samples", "Measurements of Eq. 1-2 by the daemon's one budget "
                                      "sampler, by what triggered them: periodic and pressure (live re-planning's "
                                      "schedule), demand (a reader found the shared reading older than it accepts: "
                                      "a session open, the budget op, a scrape, a prefix retain)", labels=["reason"])
        for reason in ("periodic", "pressure", "threshold", "demand"):
            samples.add_metric([reason], replan.get("budget_samples", {}).get(reason, 0))
        yield samples
        events = CounterMetricFamily("bladed_memory_events", "The memory watch's kernel events, by kind: threshold "
                                     "(a limited cgroup's usage reached where B_pc falls below what sessions hold; "
                                     "v1 eventfd), poll (the same, seen by reading the usage), reclaim (v1 pressure "
                                     "levels, v2 memory.events), psi", labels=["kind"])
        for kind in ("threshold", "poll", "reclaim", "psi"):
            events.add_metric([kind], replan.get("events", {}).get(kind, 0))
        yield events
        for name, key in (("last", "reaction_last_s"), ("max", "reaction_max_s")):
            value = replan.get(key)
            yield GaugeMetricFamily(f"bladed_memory_reaction_{name}_seconds", f"The {name} reaction: a kernel "
                                    f"memory event to the first KPU it made the daemon demote, written and freed "
                                    f"(NaN before the first)", value=math.nan if value is None else value)
        binding = budget.get("binding_cgroup")
        info = GaugeMetricFamily("bladed_memory_binding_info", "The cgroup whose limit binds Eq. 1 (1 for it)",
                                 labels=["cgroup", "limit_source"])
        info.add_metric([binding or "host", budget.get("memory_limit_source") or ""], 1)
        yield info
        yield CounterMetricFamily("bladed_pagecache_budget_changes", "Moves of B_pc past the hysteresis that live "
                                  "re-planning applied", value=replan.get("budget_samples", {}).get("changes", 0))
        if "wear" in live:
            yield from _wear_families(live["wear"])


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
