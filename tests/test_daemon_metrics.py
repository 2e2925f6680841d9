"""Prometheus exposition of a running daemon, on a Unix socket and on TCP: names by the Prometheus
conventions (units in names, ``_total`` counters, one quantity per metric), counted by reason where
an operator needs the why, and the documented list in docs/operations.md equal to a real scrape."""

from __future__ import annotations

import http.client
import os
import re
from collections.abc import Iterator

import psutil
import pytest
from daemon_util import (
    ROOT,
    ClientProcess,
    DaemonProcess,
    UnixHTTPConnection,
    run_as,
    scrape,
    short_tmpdir,
    wait_connections,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from bladed import __version__
from bladed.client import Client
from bladed.protocol import PROTOCOL_VERSION, BadRequestError, BusyError

GEOMETRY = {"layers": 2, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 8}
KPU = 8 * 4096
REGION = 64 << 20
NOBODY = 65534


@pytest.fixture
def tmp() -> Iterator[str]:
    with short_tmpdir() as d:
        yield d


def families(conn: http.client.HTTPConnection) -> dict[str, Metric]:
    """GET /metrics: {exposition name: family}; a counter's exposition name ends in ``_total``."""
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    assert resp.status == 200
    text = resp.read().decode()
    conn.close()
    return {f"{f.name}_total" if f.type == "counter" else f.name: f for f in text_string_to_metric_families(text)}


def _metric_rows() -> list[tuple[str, str, set[str], str]]:
    """docs/operations.md, "### Metrics": (metric, type, label names, meaning) of every row of the table."""
    with open(os.path.join(ROOT, "docs", "operations.md")) as f:
        doc = f.read()
    section = doc.split("\n### Metrics\n", 1)[1].split("\n#", 1)[0]
    out = []
    for line in section.splitlines():
        m = re.match(r"\| `(\w+)` \| (\w+) \|([^|]*)\|([^|]*)\|", line)
        if m:
            labels = set(re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", m.group(3))))
            out.append((m.group(1), m.group(2), labels, m.group(4)))
    return out


def documented() -> dict[str, tuple[str, set[str]]]:
    """docs/operations.md, "### Metrics": {metric: (type, label names)} of every row of the table."""
    out = {}
    for name, kind, labels, _ in _metric_rows():
        assert name not in out, f"{name} is documented twice"
        out[name] = (kind, labels)
    return out


def conditional() -> set[str]:
    """The documented metrics whose row says when they are "exposed only" (the drive's SMART figures: nvme)."""
    return {name for name, _, _, meaning in _metric_rows() if "exposed only" in meaning}


def test_metrics_on_a_unix_socket_follow_the_traffic(tmp: str) -> None:
    cfg = {"metrics": {"enabled": True, "listen": "unix:metrics.sock"}, "budget": {"override": 2 * KPU}}
    with DaemonProcess(tmp, cfg).start() as d, Client(d.socket_path) as c:
        path = f"{tmp}/metrics.sock"
        assert c.status()["metrics"] == f"unix:{path}"
        with c.open_session(GEOMETRY, channels=2) as s:
            for layer in range(2):
                for kind in "kv":
                    s.write(layer, kind, 0)
            s.read(0, "k", 1)
            s.read(1, "v", 1, token_start=2, ntokens=3)
            sample = c.budget()["sample"]            # a budget sample with the session's staging pinned
            m = scrape(UnixHTTPConnection(path))
            assert m[("bladed_build_info", (("protocol", str(PROTOCOL_VERSION)), ("version", __version__)))] == 1
            assert m[("bladed_io_bytes_total", (("op", "write"), ("path", "direct")))] == 2 * KPU
            assert m[("bladed_io_ops_total", (("op", "write"), ("path", "pagecache")))] == 2
            assert m[("bladed_io_bytes_total", (("op", "read"), ("path", "direct")))] == 3 * 4096
            assert m[("bladed_io_latency_seconds_count", (("op", "write"), ("path", "direct")))] == 2
            assert m[("bladed_io_latency_seconds_bucket", (("le", "+Inf"), ("op", "read"), ("path", "pagecache")))] == 1
            # the hit ratio comes from two counters (rate() of each in PromQL), not from a gauge since start
            assert m[("bladed_pagecache_read_bytes_total", ())] == m[("bladed_pagecache_hit_bytes_total", ())] == KPU
            assert not any(name == "bladed_pagecache_hit_ratio" for name, _ in m)
            assert m[("bladed_sessions", ())] == 1
            assert m[("bladed_connections", ())] == 3              # control + one data connection per channel
            assert m[("bladed_region_size_bytes", ())] == REGION
            assert m[("bladed_extent_used_bytes", ())] == 2 * KPU
            assert m[("bladed_extent_free_bytes", ())] == REGION - 2 * KPU
            assert m[("bladed_extent_largest_free_bytes", ())] == REGION - 2 * KPU
            # one gauge per term of Eq. 1-2, in bytes
            assert m[("bladed_pagecache_budget_bytes", ())] == 2 * KPU          # B_pc (the override)
            assert m[("bladed_pagecache_held_bytes", ())] == 2 * KPU            # Group 1: layer 0's K and V
            assert m[("bladed_pagecache_budget_computed_bytes", ())] == sample["pagecache_budget_computed_bytes"]
            assert m[("bladed_memory_available_bytes", ())] == sample["host_available_bytes"] > 0
            assert m[("bladed_memory_limit_bytes", ())] == sample["memory_limit_bytes"]
            assert m[("bladed_memory_anon_shmem_bytes", ())] == sample["anon_shmem_bytes"]
            assert m[("bladed_memory_usable_bytes", ())] == sample["usable_bytes"]
            assert m[("bladed_staging_pinned_bytes", ())] == sample["pinned_bytes"] >= 2 * KPU
            assert sample["pinned_bytes"] == sample["pinned_elsewhere_bytes"] and sample["copy_threads"] == 0
            assert not any(name in ("bladed_budget_bytes", "bladed_extent_blocks") for name, _ in m)
            # the process collector: the daemon's process, not this test's
            assert m[("process_resident_memory_bytes", ())] > 0 and m[("process_open_fds", ())] > 0
            assert m[("process_start_time_seconds", ())] == pytest.approx(psutil.Process(d.pid).create_time(), abs=1)
        after = scrape(UnixHTTPConnection(path))
        assert after[("bladed_sessions_closed_total", (("reason", "closed"),))] == 1
        assert after[("bladed_trimmed_bytes_total", ())] == 2 * KPU
        # a first start has no journal: the whole 64 MiB region was scrubbed before serving
        assert after[("bladed_region_scrubbed_bytes_total", ())] == REGION
        assert after[("bladed_zeroed_bytes_total", ())] == 0 and after[("bladed_quarantined_bytes_total", ())] == 0
        assert after[("bladed_sessions", ())] == 0
        assert after[("bladed_extent_free_bytes", ())] == REGION and after[("bladed_extent_used_bytes", ())] == 0


def test_metrics_on_tcp_and_off_by_default(tmp: str) -> None:
    with DaemonProcess(tmp, {"metrics": {"enabled": True, "listen": "127.0.0.1:0"}}).start() as d, \
            Client(d.socket_path) as c:
        host, port = c.status()["metrics"].rsplit(":", 1)
        m = scrape(http.client.HTTPConnection(host, int(port), timeout=10))
        assert m[("bladed_sessions", ())] == 0 and m[("bladed_lba_size_bytes", ())] == 4096
    with DaemonProcess(tmp).start() as d, Client(d.socket_path) as c:
        assert c.status()["metrics"] is None


@pytest.mark.root
def test_sessions_closed_connections_and_requests_refused_are_counted_by_reason(tmp: str) -> None:
    """The reasons an operator needs: why sessions ended, why connections and requests were refused;
    ``bladectl stats`` (the ``stats`` op) has the same counts."""
    cfg = {"metrics": {"enabled": True, "listen": "unix:metrics.sock"}, "socket": {"mode": 0o666, "max_connections": 3}}
    with DaemonProcess(tmp, cfg).start() as d:
        metrics = os.path.join(tmp, "metrics.sock")
        before = scrape(UnixHTTPConnection(metrics))
        # the refusal reasons are known up front: both series exist at 0 for rate()
        assert before[("bladed_connections_refused_total", (("reason", "not_allowed"),))] == 0
        assert before[("bladed_connections_refused_total", (("reason", "too_many"),))] == 0
        with Client(d.socket_path) as c:
            with c.open_session(GEOMETRY, channels=1) as s:
                s.write(0, "k", 0)                                     # a data connection too
            s.close()                                                  # reason=closed
            wait_connections(c, 1)
            with ClientProcess(d.socket_path) as gone:
                gone.call("connect")
                sid = gone.call("open", geometry=GEOMETRY, channels=1)["session"]
                gone.kill()                                            # reason=client_gone
            d.wait_event("session_close", session=sid, reason="client_gone")   # a fresh session id
            with pytest.raises(BadRequestError, match="unknown op"):
                c.call("frobnicate")
            wait_connections(c, 1)
            refusals = d.mark()
            assert run_as(NOBODY, d.socket_path, lambda cl, out: None)["exception"] == "PermissionDeniedError"
            with Client(d.socket_path), Client(d.socket_path), \
                    pytest.raises(BusyError, match=r"socket\.max_connections"):
                Client(d.socket_path)
            st = c.stats()
        m = scrape(UnixHTTPConnection(metrics))
        assert m[("bladed_sessions_closed_total", (("reason", "closed"),))] == 1
        assert m[("bladed_sessions_closed_total", (("reason", "client_gone"),))] == 1
        assert m[("bladed_connections_refused_total", (("reason", "not_allowed"),))] == 1
        assert m[("bladed_connections_refused_total", (("reason", "too_many"),))] == 1
        assert m[("bladed_requests_refused_total", (("code", "unknown_op"),))] == 1
        assert (st["sessions_closed"], st["sessions_closed_by_reason"]) == (2, {"closed": 1, "client_gone": 1})
        assert (st["connections_refused"], st["connections_refused_by_reason"]) == \
            (2, {"not_allowed": 1, "too_many": 1})
        assert (st["bad_requests"], st["bad_requests_by_code"]) == (1, {"unknown_op": 1})
        d.wait_event("connection_refused", after=refusals, reason="too_many")
        assert d.wait_event("connection_refused", after=refusals, reason="not_allowed")["uid"] == str(NOBODY)


def test_every_metric_is_documented_and_every_documented_metric_is_exposed(tmp: str) -> None:
    """docs/operations.md's table against a real scrape, both ways: names, types and label names."""
    cfg = {"metrics": {"enabled": True, "listen": "unix:metrics.sock"}}
    with DaemonProcess(tmp, cfg).start() as d, Client(d.socket_path) as c:
        with c.open_session(GEOMETRY, channels=1) as s:
            s.write(0, "k", 0)
        with pytest.raises(BadRequestError, match="unknown op"):
            c.call("frobnicate")        # so that every labelled family has a sample to show its labels
        exposed = families(UnixHTTPConnection(os.path.join(tmp, "metrics.sock")))
    doc = documented()
    assert not exposed.keys() - doc.keys(), f"exposed, not in docs/operations.md: {sorted(exposed.keys() - doc.keys())}"
    missing = doc.keys() - exposed.keys() - conditional()
    assert not missing, f"in docs/operations.md, not exposed: {sorted(missing)}"
    for name, fam in exposed.items():
        assert fam.samples, f"{name} has no sample"
        labels = {k for s in fam.samples for k in s.labels} - {"le"}
        assert (fam.type, labels) == doc[name], f"{name}: exposed {fam.type} {labels}, documented {doc[name]}"
        if fam.type == "counter":
            assert all(s.name == name for s in fam.samples), name
        unit = name.removesuffix("_total")
        assert not unit.endswith(("_blocks", "_ratio")), f"{name}: bytes and rates, not blocks and ratios"
