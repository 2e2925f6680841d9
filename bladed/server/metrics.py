"""Daemon statistics: one :class:`Stats` object, updated by the channel workers and the lanes' C counters,
read by the ``stats`` request and by the Prometheus exporter (``daemon.exporter``), so there is one source
of truth for ``bladectl stats`` and for Prometheus.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from bladed._uring import lib
from bladed.protocol import NO_HIT, ServedRow
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
#: why a retained prefix is evicted (bladed.server.prefixes.cache): known up front, so they start at 0 too
PREFIX_EVICTIONS = ("device_quota", "pagecache_quota", "live_session", "region_full", "superseded", "requested",
                    "unverified", "integrity_error", "io_error")
#: what bladed's own write commands to the device were for (``Engine.labelled``): a session's requests (the
#: lane's and the general path's, edge LBAs included), live demotions' copies, extent moves, retained prefixes'
#: copies (into an entry, and out of one into a session)
WRITE_CAUSES = ("requests", "demotion", "extent_move", "prefix")


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
        #: retained prefixes (bladed.server.prefixes.cache): opens that found one / found none, tokens copied from one,
        #: prefixes retained, prefixes evicted (by why)
        self.prefix_hits = 0
        self.prefix_misses = 0
        self.prefix_reused_tokens = 0
        self.prefix_retained = 0
        self.prefix_evictions = 0
        #: the shared tier (bladed.server.prefixes.shared_tier)
        self.prefix_shared_hits = 0
        self.prefix_shared_published = 0
        self.prefix_shared_rejected = 0
        self.prefix_shared_errors = 0
        #: block pools (bladed.server.blocks): blocks committed, evicted for new ones, refused for want of a slot
        self.blocks_stored = 0
        self.blocks_evicted = 0
        self.blocks_refused = 0
        #: bytes bladed's own write commands wrote to the device, by cause (WRITE_CAUSES), of channels done
        #: (:meth:`fold_lane`, :meth:`count_written`); :meth:`direct_written` adds the live channels'
        self._written_done = dict.fromkeys(WRITE_CAUSES, 0)
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
                _add_written(self._written_done, channel_written(channel))

    def count_written(self, written: Mapping[str, int]) -> None:
        """Add what a channel nobody watches wrote (a retained prefix's private copy channel, when it closes)."""
        with self._lock:
            _add_written(self._written_done, written)

    def direct_written(self) -> dict[str, int]:
        """Bytes bladed's own write commands wrote to the device since the daemon started, by cause."""
        with self._lock:
            out = dict(self._written_done)
            for ch in self._lanes:
                _add_written(out, channel_written(ch))
            return out

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
        written = self.direct_written()
        with self._lock:
            io, read, hit = self._totals()
            return {
                "direct_written_bytes": sum(written.values()),
                "direct_written_by_cause": written,
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
                "blocks_stored": self.blocks_stored,
                "blocks_evicted": self.blocks_evicted,
                "blocks_refused": self.blocks_refused,
            } | {f"{name}_by_{label}": dict(self.by_label[name]) for name, label in LABELLED.items()}

    def histograms(self) -> dict[tuple[str, str], tuple[list[int], float]]:
        with self._lock:
            return {k: (list(v.buckets), v.latency_sum_s) for k, v in self._totals()[0].items()}


def channel_written(channel: Any) -> dict[str, int]:
    """What a channel wrote to the device by cause: its engine's write commands (``Engine.written``) and the
    lane's direct-path writes (whole LBAs: the lane serves only KPUs of whole-LBA rows), as ``requests``."""
    out = dict(channel.engine.written)
    out["requests"] = out.get("requests", 0) + int(channel.counters.bytes[lib.BD_PATH_DIRECT][1])
    return out


def channel_kv_written(channel: Any) -> dict[str, int]:
    """KV bytes the lane of a channel wrote, per path (the general path's are the session's to count)."""
    c = channel.counters
    return {_PAGECACHE: int(c.bytes[lib.BD_PATH_PAGECACHE][1]), _DIRECT: int(c.bytes[lib.BD_PATH_DIRECT][1])}


def _add_written(into: dict[str, int], written: Mapping[str, int]) -> None:
    for cause, n in written.items():
        into[cause] = into.get(cause, 0) + n


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


__all__ = ["LABELLED", "LATENCY_BOUNDS_NS", "LATENCY_BUCKETS", "OPS", "PATHS", "WRITE_CAUSES", "PathCounters", "Stats",
           "channel_kv_written", "channel_written"]
