"""The shared prefix tier against a real redis-server and two real daemons (docs/architecture.md, "Prefix reuse").

Two daemons with separate stores share one Redis (on a Unix socket of the
test): a prefix the first retains is a hit on the second, bit for bit; a
corrupt or truncated block on the server ends the hit before it (never wrong
KV); a dead server is a miss, the request still served, and is not asked
again for a while.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import redis
from daemon_util import DaemonProcess, short_tmpdir
from test_prefix import GEO, KPU, config, expected, key, prompt, read_kv, retain_prompt

import bladed_bench.redis_server as bench_redis
from bladed.client import Client
from bladed.server.shared_tier import HEADER


class RedisServer(bench_redis.RedisServer):
    """The harness's redis-server on a Unix socket of the test, with a client of the test's own."""

    def __init__(self, directory: str) -> None:
        super().__init__(directory, unix=True, maxmemory="64mb")
        self.client = redis.Redis(unix_socket_path=self.socket)

    def stop(self) -> None:
        self.client.close()
        super().stop()


@pytest.fixture
def tier() -> Iterator[tuple[RedisServer, DaemonProcess, DaemonProcess]]:
    with short_tmpdir() as d:
        os.makedirs(os.path.join(d, "a"))
        os.makedirs(os.path.join(d, "b"))
        server = RedisServer(d)
        cfg = config(3 * KPU, "8M")
        cfg["prefix"]["shared_url"] = server.url
        try:
            with DaemonProcess(os.path.join(d, "a"), cfg).start() as a, \
                    DaemonProcess(os.path.join(d, "b"), cfg).start() as b:
                yield server, a, b
        finally:
            server.stop()


def publish_on(a: DaemonProcess, tokens: list[int], seed: str) -> None:
    with Client(a.socket_path) as c:
        retain_prompt(c, tokens, seed)
    a.wait_event("prefix_publish")


def test_a_prefix_retained_on_one_daemon_is_a_hit_on_another(tier: tuple[RedisServer, DaemonProcess,
                                                                           DaemonProcess]) -> None:
    server, a, b = tier
    tokens = prompt(40)
    publish_on(a, tokens, "box-a")
    assert len(server.client.keys("bladed:kv:1:*")) == 2        # two whole blocks of 16
    with Client(b.socket_path) as c:
        with c.open_session(GEO, channels=1, prefix=key(tokens)) as s:
            assert (s.prefix_tokens, s.prefix_source) == (32, "shared")
            assert read_kv(s, 32) == expected("box-a", 32)
        # another model's key never finds them
        with c.open_session(GEO, channels=1, prefix=key(tokens, model="other")) as s:
            assert s.prefix_tokens == 0
        assert c.stats()["prefix_shared_hits"] == 1


def test_a_corrupt_or_truncated_block_is_a_miss_never_wrong_kv(tier: tuple[RedisServer, DaemonProcess,
                                                                            DaemonProcess]) -> None:
    server, a, b = tier
    tokens = prompt(48)
    publish_on(a, tokens, "box-a")
    keys = sorted(server.client.keys("bladed:kv:1:*"))
    assert len(keys) == 3
    # find the chain order by asking b: corrupt the blocks one by one from the server's side
    values = {k: server.client.get(k) for k in keys}
    with Client(b.socket_path) as c:
        for k in keys:
            v = values[k]
            assert v is not None
            flipped = v[:HEADER.size + 5] + bytes([v[HEADER.size + 5] ^ 1]) + v[HEADER.size + 6:]
            server.client.set(k, flipped)
            with c.open_session(GEO, channels=1, prefix=key(tokens)) as s:
                # the blocks before the bad one are used, nothing from it on
                assert s.prefix_tokens % 16 == 0 and s.prefix_tokens < 48
                if s.prefix_tokens:
                    assert read_kv(s, s.prefix_tokens) == expected("box-a", s.prefix_tokens)
            server.client.set(k, v[:-100])                 # truncated
            with c.open_session(GEO, channels=1, prefix=key(tokens)) as s:
                assert s.prefix_tokens < 48
            server.client.set(k, v)
        assert c.stats()["prefix_shared_rejected"] == 6


def test_a_dead_shared_tier_is_a_miss_and_the_request_is_served(tier: tuple[RedisServer, DaemonProcess,
                                                                             DaemonProcess]) -> None:
    server, a, b = tier
    tokens = prompt(32)
    publish_on(a, tokens, "box-a")
    server.stop()
    with Client(b.socket_path) as c:
        for _ in range(3):
            with c.open_session(GEO, channels=1, prefix=key(tokens)) as s:
                assert s.prefix_tokens == 0
                s.write(0, "k", 0, 0, 4)
        # one failed call, then the tier is left alone (5 s) instead of costing a timeout per request
        assert c.stats()["prefix_shared_errors"] == 1
    b.wait_line("shared prefix tier: a lookup failed")
