"""Prometheus exposition of a running daemon, on a Unix socket and on TCP."""

from __future__ import annotations

import http.client
import os
import re
from collections.abc import Iterator

import pytest
from daemon_util import ROOT, DaemonProcess, UnixHTTPConnection, scrape, short_tmpdir

from bladed.client import Client

GEOMETRY = {"layers": 2, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 8}
KPU = 8 * 4096


@pytest.fixture
def tmp() -> Iterator[str]:
    with short_tmpdir() as d:
        yield d


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
            m = scrape(UnixHTTPConnection(path))
            assert m[("bladed_io_bytes_total", (("op", "write"), ("path", "direct")))] == 2 * KPU
            assert m[("bladed_io_ops_total", (("op", "write"), ("path", "pagecache")))] == 2
            assert m[("bladed_io_bytes_total", (("op", "read"), ("path", "direct")))] == 3 * 4096
            assert m[("bladed_io_latency_seconds_count", (("op", "write"), ("path", "direct")))] == 2
            assert m[("bladed_io_latency_seconds_bucket", (("le", "+Inf"), ("op", "read"), ("path", "pagecache")))] == 1
            assert m[("bladed_pagecache_hit_ratio", ())] == 1.0
            assert m[("bladed_sessions", ())] == 1
            assert m[("bladed_extent_blocks", (("state", "used"),))] == 2 * KPU // 4096
            assert m[("bladed_budget_bytes", (("term", "b_pc"),))] == 2 * KPU
            assert m[("bladed_budget_bytes", (("term", "held"),))] == 2 * KPU
            assert ("bladed_budget_bytes", (("term", "m_avail"),)) in m
        after = scrape(UnixHTTPConnection(path))
        with open(os.path.join(ROOT, "docs", "operations.md")) as f:
            doc = f.read()
        for name in {n for n, _ in after}:
            family = re.sub(r"_(bucket|count|sum|created)$", "", name)
            assert f"`{family}`" in doc or f"`{name}`" in doc, f"{name} is not documented in docs/operations.md"
        assert after[("bladed_trimmed_bytes_total", ())] == 2 * KPU
        # a first start has no journal: the whole 64 MiB region was scrubbed before serving
        assert after[("bladed_region_scrubbed_bytes_total", ())] == 64 << 20
        assert after[("bladed_zeroed_bytes_total", ())] == 0 and after[("bladed_quarantined_bytes_total", ())] == 0
        assert after[("bladed_sessions", ())] == 0
        assert after[("bladed_extent_blocks", (("state", "free"),))] == 16384


def test_metrics_on_tcp_and_off_by_default(tmp: str) -> None:
    with DaemonProcess(tmp, {"metrics": {"enabled": True, "listen": "127.0.0.1:0"}}).start() as d, \
            Client(d.socket_path) as c:
        host, port = c.status()["metrics"].rsplit(":", 1)
        m = scrape(http.client.HTTPConnection(host, int(port), timeout=10))
        assert m[("bladed_sessions", ())] == 0 and m[("bladed_lba_size_bytes", ())] == 4096
    with DaemonProcess(tmp).start() as d, Client(d.socket_path) as c:
        assert c.status()["metrics"] is None
