"""The shared prefix tier against a real redis-server and real daemons (docs/architecture.md, "Prefix reuse").

Daemons with separate stores share one Redis (on a Unix socket of the
test): a prefix one retains is a hit on another, bit for bit; keys and
values are built exactly as documented; a corrupt or truncated block ends
the hit before it (never wrong KV); so does a value that is intact but not
signed for its key and position: two blocks swapped, a value copied to
another scope's key, one written without the fleet secret, one signed with
a secret rotated out (each counted in ``prefix_shared_rejected``); a
rotation's previous secret is still read; a dead server is a miss, the
request still served, and is not asked again for a while; without a secret
the daemon does not start.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import struct
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import crc32c
import pytest
import redis
from daemon_util import ROOT, DaemonProcess, env_with_repo, short_tmpdir, toml_text
from test_prefix import BLOCK, GEO, KPU, MODEL, TB, config, expected, key, prompt, read_kv, retain_prompt

import bladed_bench.redis_server as bench_redis
from bladed.client import Client
from bladed.config import ConfigError, config_from_dict
from bladed.residency.geometry import Geometry
from bladed.server.prefixes.keys import block_chain, seed_of
from bladed.server.prefixes.shared_tier import HEADER, BlockRef, Rejected, pack, unpack

#: one block's value payload: the block's token rows of every KPU
BLOCK_BYTES = 2 * GEO["layers"] * BLOCK * TB
SECRET = secrets.token_hex(32)
#: the Lua swap of two values from issue 27 (any Redis client can run it)
SWAP = ("local a=redis.call('GET',KEYS[1]); local b=redis.call('GET',KEYS[2]); "
        "redis.call('SET',KEYS[1],b); redis.call('SET',KEYS[2],a)")


class RedisServer(bench_redis.RedisServer):
    """The harness's redis-server on a Unix socket of the test, with a client of the test's own."""

    def __init__(self, directory: str) -> None:
        super().__init__(directory, unix=True, maxmemory="64mb")
        self.client = redis.Redis(unix_socket_path=self.socket)

    def stop(self) -> None:
        self.client.close()
        super().stop()


def write_secret(path: str, lines: Sequence[str], mode: int = 0o600) -> str:
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "w") as f:
        f.write("".join(f"{ln}\n" for ln in lines))
    os.chmod(path, mode)
    return path


class Fleet:
    """A redis-server and the daemons a test starts on it; the fixture stops every one at teardown."""

    def __init__(self, directory: str, server: RedisServer, stack: contextlib.ExitStack) -> None:
        self.dir = directory
        self.server = server
        self.stack = stack

    def daemon(self, name: str, secret_lines: Sequence[str] = (SECRET,), **prefix: Any) -> DaemonProcess:
        """A daemon of its own store on the tier, its secret file holding ``secret_lines``."""
        d = os.path.join(self.dir, name)
        os.makedirs(d)
        cfg = config(3 * KPU, "8M")
        cfg["prefix"] |= {"shared_url": self.server.url, **prefix,
                          "shared_secret_file": write_secret(os.path.join(d, "shared-secret"), secret_lines)}
        dp = self.stack.enter_context(DaemonProcess(d, cfg))   # stopped at teardown, even if its start fails
        return dp.start()


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    with short_tmpdir() as d, contextlib.ExitStack() as stack:
        server = RedisServer(d)
        stack.callback(server.stop)          # unwound last: after every daemon
        yield Fleet(d, server, stack)


@pytest.fixture
def tier(fleet: Fleet) -> tuple[RedisServer, DaemonProcess, DaemonProcess]:
    return fleet.server, fleet.daemon("a"), fleet.daemon("b")


def uid_scope() -> str:
    return f"uid:{os.getuid()}"


def refs_of(tokens: list[int], scope: str | None = None) -> list[BlockRef]:
    seed = seed_of(MODEL, "float32", Geometry(**GEO))
    return [BlockRef(scope or uid_scope(), seed, BLOCK, i, h) for i, h in enumerate(block_chain(seed, tokens, BLOCK))]


def keys_of(tokens: list[int], scope: str | None = None) -> list[str]:
    """The Redis keys of ``tokens``' whole blocks, spelt out as docs/architecture.md documents them."""
    seed = seed_of(MODEL, "float32", Geometry(**GEO)).hex()
    return [f"bladed:kv:2:{scope or uid_scope()}:{seed[:32]}:{BLOCK}:{h}"
            for h in block_chain(bytes.fromhex(seed), tokens, BLOCK)]


def publish_on(dp: DaemonProcess, tokens: list[int], seed: str) -> None:
    """Retain ``tokens`` on ``dp`` and wait for the publish this retain starts (not an earlier one)."""
    def is_publish(f: dict[str, str]) -> bool:
        return f.get("event") == "prefix_publish"

    before = len(dp.events("prefix_publish"))
    with Client(dp.socket_path) as c:
        retain_prompt(c, tokens, seed)
    dp.wait_fields(is_publish, count=before + 1)


def opened(dp: DaemonProcess, tokens: list[int]) -> tuple[int, str | None, dict[tuple[int, str], bytes],
                                                          dict[str, Any]]:
    """Open a session with ``tokens``' prefix key on ``dp``: the prefix tokens, their source, their KV, the stats."""
    with Client(dp.socket_path) as c:
        with c.open_session(GEO, channels=1, prefix=key(tokens)) as s:
            got = (s.prefix_tokens, s.prefix_source, read_kv(s, s.prefix_tokens) if s.prefix_tokens else {})
        return (*got, c.stats())


def test_a_prefix_retained_on_one_daemon_is_a_hit_on_another(tier: tuple[RedisServer, DaemonProcess,
                                                                           DaemonProcess]) -> None:
    server, a, b = tier
    tokens = prompt(40)
    publish_on(a, tokens, "box-a")
    assert sorted(server.client.keys("bladed:kv:*")) == sorted(k.encode() for k in keys_of(tokens))  # 2 blocks
    with Client(b.socket_path) as c:
        with c.open_session(GEO, channels=1, prefix=key(tokens)) as s:
            assert (s.prefix_tokens, s.prefix_source) == (32, "shared")
            assert read_kv(s, 32) == expected("box-a", 32)
        # another model's key never finds them
        with c.open_session(GEO, channels=1, prefix=key(tokens, model="other")) as s:
            assert s.prefix_tokens == 0
        stats = c.stats()
        assert (stats["prefix_shared_hits"], stats["prefix_shared_rejected"]) == (1, 0)


def documented_tag(secret: str, k: str, scope: str, seed: bytes, index: int, chain_hash: str, payload: bytes) -> bytes:
    """The tag as docs/architecture.md spells it, written independently of bladed.server.prefixes.shared_tier.mac."""
    def lp(b: bytes) -> bytes:
        return struct.pack("<I", len(b)) + b

    msg = (b"bladed-shared-kv\0" + struct.pack("<I", 2) + lp(k.encode()) + lp(scope.encode()) + lp(seed)
           + struct.pack("<I", index) + lp(chain_hash.encode()) + struct.pack("<Q", len(payload)) + payload)
    return hmac.new(secret.encode(), msg, hashlib.sha256).digest()


def test_values_are_built_as_documented(tier: tuple[RedisServer, DaemonProcess, DaemonProcess]) -> None:
    server, a, _ = tier
    tokens = prompt(48)
    publish_on(a, tokens, "box-a")
    for i, (k, ref) in enumerate(zip(keys_of(tokens), refs_of(tokens), strict=True)):
        v = server.client.get(k)
        assert v is not None and len(v) == 56 + BLOCK_BYTES
        magic, fmt, n, crc, tag = struct.unpack_from("<8sIQI32s", v)
        payload = v[56:]
        assert (magic, fmt, n, crc) == (b"bladedkv", 2, BLOCK_BYTES, crc32c.crc32c(payload))
        assert tag == documented_tag(SECRET, k, uid_scope(), ref.seed, i, ref.chain_hash, payload)
        # the payload: the block's token rows of every KPU (layer 0 K, layer 0 V, layer 1 K, ...)
        span = BLOCK * TB
        want = expected("box-a", 48)
        for layer in range(GEO["layers"]):
            for j, kind in enumerate("kv"):
                tid = 2 * layer + j
                assert payload[tid * span:(tid + 1) * span] == want[(layer, kind)][i * span:(i + 1) * span]


def test_a_corrupt_or_truncated_block_is_a_miss_never_wrong_kv(tier: tuple[RedisServer, DaemonProcess,
                                                                            DaemonProcess]) -> None:
    server, a, b = tier
    tokens = prompt(48)
    publish_on(a, tokens, "box-a")
    keys = keys_of(tokens)
    values = {k: server.client.get(k) for k in keys}
    with Client(b.socket_path) as c:
        for i, k in enumerate(keys):
            v = values[k]
            assert v is not None
            flipped = v[:HEADER.size + 5] + bytes([v[HEADER.size + 5] ^ 1]) + v[HEADER.size + 6:]
            server.client.set(k, flipped)
            with c.open_session(GEO, channels=1, prefix=key(tokens)) as s:
                # the blocks before the bad one are used, nothing from it on
                assert s.prefix_tokens == 16 * i
                if s.prefix_tokens:
                    assert read_kv(s, s.prefix_tokens) == expected("box-a", s.prefix_tokens)
            server.client.set(k, v[:-100])                 # truncated
            with c.open_session(GEO, channels=1, prefix=key(tokens)) as s:
                assert s.prefix_tokens == 16 * i
            server.client.set(k, v)
        assert c.stats()["prefix_shared_rejected"] == 6
    b.wait_line("is refused (corrupt:")


def test_two_swapped_blocks_are_a_miss_never_the_other_blocks_kv(tier: tuple[RedisServer, DaemonProcess,
                                                                                DaemonProcess]) -> None:
    server, a, b = tier
    tokens = prompt(64)
    publish_on(a, tokens, "box-a")
    keys = keys_of(tokens)
    assert server.client.exists(*keys) == 4
    server.client.eval(SWAP, 2, keys[1], keys[2])         # blocks 1 and 2 trade places, both values intact
    n, source, kv, stats = opened(b, tokens)
    # block 0 is used; block 1's key holds block 2's value: the hit ends before it
    assert (n, source) == (16, "shared")
    assert kv == expected("box-a", 16)
    assert (stats["prefix_shared_rejected"], stats["prefix_shared_hits"]) == (1, 1)
    b.wait_line("block 1 (" + keys[1] + ") is refused (unauthenticated:")
    server.client.eval(SWAP, 2, keys[1], keys[2])         # back in place: the whole prefix is a hit again
    n, source, kv, stats = opened(b, tokens)
    assert (n, source) == (64, "shared") and kv == expected("box-a", 64)
    assert (stats["prefix_shared_rejected"], stats["prefix_shared_hits"]) == (1, 2)


def test_a_value_copied_to_another_scopes_key_is_a_miss(fleet: Fleet) -> None:
    # a publishes under its group's scope, b and c look up under the peer's uid and group
    a = fleet.daemon("a", scope="group")
    b = fleet.daemon("b")
    tokens = prompt(32)
    publish_on(a, tokens, "group-kv")
    group_keys = keys_of(tokens, scope=f"gid:{os.getgid()}")
    for src, dst in zip(group_keys, keys_of(tokens), strict=True):
        assert fleet.server.client.copy(src, dst)          # same secret, same tokens; only the scope differs
    n, _, _, stats = opened(b, tokens)
    assert n == 0
    assert (stats["prefix_shared_rejected"], stats["prefix_shared_hits"]) == (1, 0)
    # the same values under their own scope's keys are a hit on a third daemon of that scope
    c = fleet.daemon("c", scope="group")
    n, source, kv, stats = opened(c, tokens)
    assert (n, source) == (32, "shared") and kv == expected("group-kv", 32)
    assert stats["prefix_shared_rejected"] == 0


def v1_value(payload: bytes) -> bytes:
    """A value of the unauthenticated format 1: magic, length, crc32c of the payload."""
    return struct.pack("<8sQI", b"bladedkv", len(payload), crc32c.crc32c(payload)) + payload


def test_a_value_written_without_the_secret_is_a_miss(tier: tuple[RedisServer, DaemonProcess, DaemonProcess]) -> None:
    server, a, b = tier
    evil = os.urandom(BLOCK_BYTES)
    # blocks nobody published, forged whole by a client that can write the keyspace but has no secret
    fresh = prompt(32, seed=7)
    for ref in refs_of(fresh):
        server.client.set(ref.key, pack(secrets.token_bytes(32), ref, evil))
    n, _, _, stats = opened(b, fresh)
    assert n == 0 and stats["prefix_shared_rejected"] == 1
    # a published block replaced: the bladed code with a guessed secret, the old format, the payload changed
    # under the genuine header (its crc fixed), the tag zeroed
    tokens = prompt(32)
    publish_on(a, tokens, "box-a")
    ref = refs_of(tokens)[0]
    genuine = server.client.get(ref.key)
    assert genuine is not None
    head = genuine[:HEADER.size]
    tampered = head[:20] + struct.pack("<I", crc32c.crc32c(evil)) + head[24:] + evil
    forged = [pack(b"guess" * 8, ref, evil), v1_value(evil), tampered, head[:24] + bytes(32) + genuine[HEADER.size:]]
    for i, value in enumerate(forged, start=2):
        server.client.set(ref.key, value)
        n, _, _, stats = opened(b, tokens)
        assert n == 0 and stats["prefix_shared_rejected"] == i
    # the genuine value is still a hit
    server.client.set(ref.key, genuine)
    n, source, kv, stats = opened(b, tokens)
    assert (n, source) == (32, "shared") and kv == expected("box-a", 32)
    assert (stats["prefix_shared_rejected"], stats["prefix_shared_hits"]) == (5, 1)


def test_a_rotated_secret(fleet: Fleet) -> None:
    old, new = secrets.token_hex(32), secrets.token_hex(32)
    a = fleet.daemon("a", [old])                    # not rotated yet
    b = fleet.daemon("b", [new, old])               # rolling out: signs with new, still reads old
    first, second = prompt(32), prompt(32, seed=3)
    publish_on(a, first, "signed-old")
    n, source, kv, _ = opened(b, first)
    assert (n, source) == (32, "shared") and kv == expected("signed-old", 32)
    publish_on(b, second, "signed-new")
    n, _, _, stats = opened(a, second)              # a does not hold the new secret yet: a miss
    assert n == 0 and stats["prefix_shared_rejected"] == 1
    c = fleet.daemon("c", [new])                    # rotated: the old secret is gone from the file
    n, _, _, stats = opened(c, first)
    assert n == 0 and stats["prefix_shared_rejected"] == 1
    n, source, kv, stats = opened(c, second)
    assert (n, source) == (32, "shared") and kv == expected("signed-new", 32)
    # an old value's miss is prefilled and retained again: republished under the new secret
    publish_on(c, first, "signed-old")
    n, source, kv, stats = opened(b, first)
    assert (n, source) == (32, "shared") and kv == expected("signed-old", 32)
    assert stats["prefix_shared_rejected"] == 0
    ref = refs_of(first)[0]
    value = fleet.server.client.get(ref.key)
    assert value is not None and unpack(value, ref, BLOCK_BYTES, [new.encode()])


def test_the_tag_binds_the_key_scope_seed_position_and_payload() -> None:
    secret = secrets.token_hex(32).encode()
    ref = refs_of(prompt(32))[1]
    payload = os.urandom(BLOCK_BYTES)
    value = pack(secret, ref, payload)
    assert unpack(value, ref, BLOCK_BYTES, [secret]) == payload
    assert unpack(value, ref, BLOCK_BYTES, [b"p" * 32, secret]) == payload     # a rotation's previous secret
    others = [BlockRef("uid:12345", ref.seed, ref.block_tokens, ref.index, ref.chain_hash),
              BlockRef(ref.scope, hashlib.sha256(b"another model").digest(), ref.block_tokens, ref.index,
                       ref.chain_hash),
              BlockRef(ref.scope, ref.seed, 32, ref.index, ref.chain_hash),
              BlockRef(ref.scope, ref.seed, ref.block_tokens, 0, ref.chain_hash),
              BlockRef(ref.scope, ref.seed, ref.block_tokens, ref.index, refs_of(prompt(32))[0].chain_hash)]
    for other in others:
        with pytest.raises(Rejected) as e:
            unpack(value, other, BLOCK_BYTES, [secret])
        assert e.value.reason == "unauthenticated", other
    with pytest.raises(Rejected) as e:
        unpack(value, ref, BLOCK_BYTES, [b"q" * 32])
    assert e.value.reason == "unauthenticated"
    for bad in (value[:-1], value + b"x", v1_value(payload), value[:-1] + bytes([value[-1] ^ 1]), None, "text"):
        with pytest.raises(Rejected) as e:
            unpack(bad, ref, BLOCK_BYTES, [secret])
        assert e.value.reason == "corrupt"


def start_daemon(directory: str, prefix: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """Start the daemon itself (not --check-config) and wait for it to exit; killed if it serves instead."""
    path = os.path.join(directory, "bladed.toml")
    with open(path, "w") as f:
        f.write(toml_text({"device": {"size": "16M"}, "prefix": {"shared_url": "unix:///nonexistent.sock", **prefix}}))
    return subprocess.run([sys.executable, "-m", "bladed.server", "--config", path, "--state-dir", directory],
                          cwd=ROOT, env=env_with_repo(), capture_output=True, text=True, timeout=60)


def test_without_a_usable_secret_the_daemon_does_not_start() -> None:
    with short_tmpdir() as d:
        check_secret_refusals(d)


def check_secret_refusals(d: str) -> None:
    r = start_daemon(d, {})
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert "prefix.shared_secret_file: the shared tier (prefix.shared_url) needs the fleet secret" in r.stderr
    assert "openssl rand -hex 32" in r.stderr
    open_to_all = write_secret(os.path.join(d, "open"), [SECRET], 0o644)
    r = start_daemon(d, {"shared_secret_file": open_to_all})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"{open_to_all} is open to every user (mode 0o644); chmod 600 it" in r.stderr
    # each problem of the file: one line naming the key, the cause and the fix
    cases = {write_secret(os.path.join(d, "empty"), []): "holds no secret; put one on its first line",
             write_secret(os.path.join(d, "short"), ["too-short"]): "line 1 is shorter than 32 characters",
             write_secret(os.path.join(d, "old-short"), [SECRET, "x"]): "line 2 is shorter than 32 characters",
             write_secret(os.path.join(d, "three"), [SECRET] * 3): "has 3 lines; it holds the current secret",
             os.path.join(d, "missing"): "No such file or directory; create it (openssl rand -hex 32 > FILE"}
    for path, why in cases.items():
        with pytest.raises(ConfigError) as e:
            config_from_dict({"prefix": {"shared_url": "redis://127.0.0.1:6379/0", "shared_secret_file": path}})
        assert str(e.value).startswith("prefix.shared_secret_file: ") and why in str(e.value), str(e.value)
        assert "\n" not in str(e.value)
    ok = write_secret(os.path.join(d, "ok"), [SECRET, secrets.token_hex(32)], 0o640)
    cfg = config_from_dict({"prefix": {"shared_url": "redis://127.0.0.1:6379/0", "shared_secret_file": ok}})
    assert cfg.prefix.shared_secret_file == ok


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
