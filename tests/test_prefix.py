"""Retained prefixes against a real daemon (docs/architecture.md, "Prefix reuse").

A session opened with a prefix key finds the KV a retained session left and
starts with it: the bytes of the matched whole blocks are there, bit for bit,
on both paths and for token rows that are not whole LBAs.  Entries never
change under a session, are scoped to the peer, survive a clean stop and a
SIGKILL (and are dropped when they no longer verify), are evicted least
recently used first beyond the quota or when a live session needs the room,
and bad keys are refused with the field named.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
from daemon_util import DaemonProcess, pattern, run_as, short_tmpdir

from bladed.client import Client, PrefixKey, Session
from bladed.protocol import BadRequestError, QuotaExceededError

#: SmolLM2-like rows: 3 KV heads x 64 x fp32 = 768 bytes, not a whole 4 KiB LBA (the packed layout)
GEO = {"layers": 4, "batch": 1, "kv_heads": 3, "head_dim": 64, "dtype_bytes": 4, "max_tokens": 96}
TB = 768
KPU = GEO["max_tokens"] * TB
BLOCK = 16
MODEL = "smollm2-135m-test"


def key(tokens: list[int], model: str = MODEL, dtype: str = "float32") -> PrefixKey:
    return PrefixKey(model, dtype, tokens)


def prompt(n: int, seed: int = 1) -> list[int]:
    return [(seed * 7919 + i * 104729) % 49152 for i in range(n)]


def write_kv(sess: Session, start: int, n: int, seed: str) -> None:
    """Write tokens [start, start + n) of every KPU with ``seed``'s pattern (token rows of the KPU's pattern)."""
    for layer in range(GEO["layers"]):
        for kind in "kv":
            data = pattern(seed, layer, kind, KPU)
            sess.slot(0)[start * TB:(start + n) * TB] = data[start * TB:(start + n) * TB]
            sess.write(layer, kind, 0, start, n)


def read_kv(sess: Session, n: int) -> dict[tuple[int, str], bytes]:
    out = {}
    for layer in range(GEO["layers"]):
        for kind in "kv":
            sess.read(layer, kind, 0, 0, n)
            out[(layer, kind)] = bytes(sess.slot(0)[:n * TB])
    return out


def expected(seed: str, n: int) -> dict[tuple[int, str], bytes]:
    return {(layer, kind): pattern(seed, layer, kind, KPU)[:n * TB] for layer in range(GEO["layers"]) for kind in "kv"}


def retain_prompt(c: Client, tokens: list[int], seed: str) -> dict[str, Any]:
    s = c.open_session(GEO, channels=1, prefix=key(tokens))
    write_kv(s, 0, len(tokens), seed)
    return s.retain(tokens, close=True)


def assert_session_reads_zeroes(c: Client, ntokens: int) -> None:
    """A new session of ``ntokens`` tokens (over what an evicted entry held) reads zeroes in every KPU."""
    with c.open_session(GEO | {"max_tokens": ntokens}, channels=1) as s:
        for layer in range(GEO["layers"]):
            for kind in "kv":
                s.read(layer, kind, 0, 0, ntokens)
                assert bytes(s.slot(0)[:ntokens * TB]) == bytes(ntokens * TB)


def evictions(c: Client) -> dict[str, int]:
    """The eviction reasons counted so far (the others are 0)."""
    return {k: v for k, v in c.stats()["prefix_evictions_by_reason"].items() if v}


def config(pagecache: int | str, device: int | str, budget: int = 8 * KPU) -> dict[str, dict[str, Any]]:
    return {"budget": {"override": budget},
            "prefix": {"block_tokens": BLOCK, "pagecache_bytes": pagecache, "device_bytes": device}}


@pytest.fixture(params=["pagecache", "device", "both"])
def daemon(request: pytest.FixtureRequest) -> Iterator[DaemonProcess]:
    # where the entries go: all page cache, all on the extent, or split by Algorithm 1
    sizes = {"pagecache": ("8M", 0), "device": (0, "8M"), "both": (3 * KPU, "8M")}[request.param]
    with short_tmpdir() as d, DaemonProcess(d, config(*sizes)).start() as dp:
        yield dp


def test_a_retained_prefix_is_found_again_bit_for_bit(daemon: DaemonProcess) -> None:
    tokens = prompt(40)                       # 2 whole blocks of 16 and 8 tokens more
    with Client(daemon.socket_path) as c:
        r = retain_prompt(c, tokens, "first")
        assert r["tokens"] == 32 and r["new"]
        # the same prompt and more: the two whole blocks come back, the rest is the client's to prefill
        longer = tokens + prompt(20, seed=9)
        with c.open_session(GEO, channels=1, prefix=key(longer)) as s:
            assert (s.prefix_tokens, s.prefix_entry) == (32, r["entry"])
            assert read_kv(s, 32) == expected("first", 32)
            # the session's own tokens go to its own storage; the entry is untouched
            write_kv(s, 0, 32, "overwritten")
        with c.open_session(GEO, channels=1, prefix=key(longer)) as s:
            assert s.prefix_tokens == 32
            assert read_kv(s, 32) == expected("first", 32)
        stats = c.stats()
        assert (stats["prefix_hits"], stats["prefix_misses"], stats["prefix_reused_tokens"]) == (2, 1, 64)


def test_two_sessions_start_from_one_prefix_at_once() -> None:
    with short_tmpdir() as d, DaemonProcess(d, config(3 * KPU, "8M")).start() as dp, Client(dp.socket_path) as c:
        tokens = prompt(32)
        retain_prompt(c, tokens, "shared")
        with c.open_session(GEO, channels=1, prefix=key(tokens)) as a, \
                c.open_session(GEO, channels=1, prefix=key(tokens)) as b:
            assert a.prefix_tokens == b.prefix_tokens == 32
            write_kv(a, 16, 16, "a-own")
            assert read_kv(b, 32) == expected("shared", 32)


def test_sessions_opened_at_the_same_time_from_one_prefix_each_get_it_whole() -> None:
    # all on the extent, 768-byte rows: every copy assembles edge LBAs; eight opens race for the entry
    with short_tmpdir() as d, DaemonProcess(d, config(0, "8M")).start() as dp:
        tokens = prompt(80)
        with Client(dp.socket_path) as c:
            retain_prompt(c, tokens, "raced")

        def open_and_read(_: int) -> tuple[int, bool]:
            with Client(dp.socket_path) as c, c.open_session(GEO, channels=1, prefix=key(tokens)) as s:
                return s.prefix_tokens, read_kv(s, 80) == expected("raced", 80)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert list(pool.map(open_and_read, range(8))) == [(80, True)] * 8


def test_a_different_model_dtype_or_token_is_a_miss() -> None:
    with short_tmpdir() as d, DaemonProcess(d, config(0, "8M")).start() as dp, Client(dp.socket_path) as c:
        tokens = prompt(48)
        retain_prompt(c, tokens, "m")
        for other in (key(tokens, model="another-model"), key(tokens, dtype="fp32"), key([tokens[0] + 1, *tokens[1:]])):
            with c.open_session(GEO, channels=1, prefix=other) as s:
                assert s.prefix_tokens == 0
        # a token changed in the second block: the first block still matches
        changed = [*tokens[:20], tokens[20] + 1, *tokens[21:]]
        with c.open_session(GEO, channels=1, prefix=key(changed)) as s:
            assert s.prefix_tokens == 16
            assert read_kv(s, 16) == expected("m", 16)
        # the same tensor bytes but another geometry (dtype) never match
        geo16 = GEO | {"dtype_bytes": 2, "head_dim": 128}
        with c.open_session(geo16, channels=1, prefix=PrefixKey(MODEL, "float16", tokens)) as s:
            assert s.prefix_tokens == 0


def test_bad_prefix_keys_are_refused_naming_the_field() -> None:
    with short_tmpdir() as d, DaemonProcess(d, config(0, "8M")).start() as dp, Client(dp.socket_path) as c:
        with pytest.raises(BadRequestError, match=r"prefix.dtype.*float16 has 2-byte elements"):
            c.open_session(GEO, channels=1, prefix=PrefixKey(MODEL, "float16", [1, 2]))
        with pytest.raises(BadRequestError, match=r"prefix reuse needs a geometry of batch 1"):
            c.open_session(GEO | {"batch": 2}, channels=1, prefix=key([1, 2]))
        with pytest.raises(BadRequestError, match=r"prefix.tokens.*within 0\.\."):
            c.open_session(GEO, channels=1, prefix=key([-1]))
        with pytest.raises(BadRequestError, match=r"more than the session's max_tokens"):
            c.open_session(GEO, channels=1, prefix=key(prompt(97)))
        with c.open_session(GEO, channels=1, prefix=key(prompt(40))) as s:
            write_kv(s, 0, 20, "short")
            with pytest.raises(BadRequestError, match=r"at least one whole block of 16"):
                s.retain(prompt(10))
            with pytest.raises(BadRequestError, match=r"written only the first 20"):
                s.retain(prompt(40))
        assert c.sessions() == []


def test_retention_off_is_a_clear_refusal_and_the_session_lives_on() -> None:
    with short_tmpdir() as d, DaemonProcess(d, config(0, 0)).start() as dp, Client(dp.socket_path) as c, \
            c.open_session(GEO, channels=1, prefix=key(prompt(32))) as s:
        write_kv(s, 0, 32, "x")
        with pytest.raises(QuotaExceededError, match=r"retention is off.*prefix.device_bytes"):
            s.retain(prompt(32))
        assert read_kv(s, 32) == expected("x", 32)


def test_beyond_the_quota_the_least_recently_used_prefix_is_evicted() -> None:
    # 32 tokens x 8 KPUs x 768 bytes = 6 LBAs per KPU: 48 blocks, 196608 bytes; room for two
    with short_tmpdir() as d, DaemonProcess(d, config(0, 2 * 196608)).start() as dp, Client(dp.socket_path) as c:
        a, b, third = prompt(32, 1), prompt(32, 2), prompt(32, 3)
        ea = retain_prompt(c, a, "a")["entry"]
        retain_prompt(c, b, "b")
        with c.open_session(GEO, channels=1, prefix=key(a)) as s:   # a is now the more recent
            assert s.prefix_tokens == 32
        ec = retain_prompt(c, third, "c")["entry"]
        ids = {p["entry"] for p in c.prefixes()["prefixes"]}
        assert ids == {ea, ec}, "b, the least recently used, goes"
        with c.open_session(GEO, channels=1, prefix=key(b)) as s:
            assert s.prefix_tokens == 0
        assert evictions(c) == {"device_quota": 1}
        with c.open_session(GEO | {"max_tokens": 96 * 4}, channels=1, prefix=key(prompt(384))) as s:
            for layer in range(GEO["layers"]):
                for kind in "kv":
                    s.write(layer, kind, 0, 0, 96 * 4)
            with pytest.raises(QuotaExceededError, match=r"more than prefix.device_bytes"):
                s.retain(prompt(384))


def test_a_live_session_takes_the_room_of_retained_prefixes() -> None:
    # a region of 256 blocks of 4 KiB: the entry's 96 and the new session's 240 do not fit together
    cfg = config(0, "8M", budget=0) | {"device": {"size": "1M"}}
    with short_tmpdir() as d, DaemonProcess(d, cfg).start() as dp, Client(dp.socket_path) as c:
        retain_prompt(c, prompt(64), "old")
        assert len(c.prefixes()["prefixes"]) == 1
        big = GEO | {"max_tokens": 160}            # 160 x 768 = 30 LBAs per KPU, 240 of the region's 256
        with c.open_session(big, channels=1) as s:
            assert s.plan["extent_blocks"] == 240
        assert c.prefixes()["prefixes"] == []
        assert evictions(c) == {"live_session": 1}


def test_prefixes_are_scoped_to_the_uid() -> None:
    with short_tmpdir() as d, DaemonProcess(d, config(0, "8M") | {"access": {"allowed_uids": [65534]}}) as dp:
        os.chmod(d, 0o755)
        dp.config["socket"] = {"mode": 0o666}
        dp.start()
        tokens = prompt(32)
        with Client(dp.socket_path) as c:
            entry = retain_prompt(c, tokens, "root's")["entry"]

        def probe(client: Client, out: dict[str, Any]) -> None:
            with client.open_session(GEO, channels=1, prefix=key(tokens)) as s:
                out["tokens"] = s.prefix_tokens
            out["listed"] = client.prefixes()["prefixes"]
            try:
                client.evict_prefixes(entry)
            except BadRequestError as e:
                out["evict"] = str(e)

        out = run_as(65534, dp.socket_path, probe)
        assert out.get("exception") is None, out
        assert out["tokens"] == 0 and out["listed"] == []
        assert "no retained prefix" in out["evict"]
        with Client(dp.socket_path) as c:
            assert [p["entry"] for p in c.prefixes()["prefixes"]] == [entry]


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_prefix_survives_a_restart(how: str) -> None:
    with short_tmpdir() as d, DaemonProcess(d, config(3 * KPU, "8M")) as dp:
        dp.start()
        tokens = prompt(48)
        with Client(dp.socket_path) as c:
            entry = retain_prompt(c, tokens, "kept")["entry"]
        if how == "stop":
            assert dp.stop() == 0
        else:
            dp.kill()
        with dp.start(), Client(dp.socket_path) as c:
            dp.wait_event("prefix_restore", kept="1")        # what the start itself does, once
            with c.open_session(GEO, channels=1, prefix=key(tokens)) as s:
                assert (s.prefix_tokens, s.prefix_entry) == (48, entry)
                assert read_kv(s, 48) == expected("kept", 48)


def test_a_prefix_that_no_longer_verifies_is_dropped_at_start_up() -> None:
    with short_tmpdir() as d, DaemonProcess(d, config(0, "8M")) as dp:
        dp.start()
        tokens = prompt(32)
        with Client(dp.socket_path) as c:
            retain_prompt(c, tokens, "to-corrupt")
        assert dp.stop() == 0
        with open(os.path.join(d, "journal.json")) as f:
            (rec,) = json.load(f)["retained"]
        start, _ = rec["extents"][0]
        with open(os.path.join(d, "kv-store.img"), "r+b") as f:
            f.seek(start * 4096 + 100)
            f.write(b"\xff" * 8)
        with dp.start(), Client(dp.socket_path) as c:
            dp.wait_event("prefix_restore", kept="0", dropped="1")
            with c.open_session(GEO, channels=1, prefix=key(tokens)) as s:
                assert s.prefix_tokens == 0
            assert evictions(c) == {"unverified": 1}


def test_a_half_written_prefix_is_reclaimed_never_served() -> None:
    with short_tmpdir() as d, DaemonProcess(d, config(0, "8M")) as dp:
        dp.start()
        tokens = prompt(32)
        with Client(dp.socket_path) as c:
            retain_prompt(c, tokens, "half")
        dp.kill()
        path = os.path.join(d, "journal.json")
        with open(path) as f:
            data = json.load(f)
        data["retained"][0]["state"] = "writing"      # as if the daemon died in the middle of the copy
        with open(path, "w") as f:
            json.dump(data, f)
        with dp.start(), Client(dp.socket_path) as c:
            with c.open_session(GEO, channels=1, prefix=key(tokens)) as s:
                assert s.prefix_tokens == 0
            assert c.prefixes()["prefixes"] == []
        assert not os.listdir(os.path.join(d, "prefixes")), "its checksum file went with it"


def test_evicted_prefix_blocks_read_back_as_zeroes() -> None:
    with short_tmpdir() as d, DaemonProcess(d, config(0, "8M", budget=0) | {"device": {"size": "1M"}}).start() as dp, \
            Client(dp.socket_path) as c:
        retain_prompt(c, prompt(64), "secret")      # 96 of the region's 256 blocks, beside the session's 144
        assert len(c.evict_prefixes()) == 1
        # one session over the whole region: what the entry held must read as zeroes
        assert_session_reads_zeroes(c, 160)


def test_killed_daemon_while_retaining_leaves_nothing_leaked() -> None:
    with short_tmpdir() as d, DaemonProcess(d, config(0, "8M")) as dp:
        dp.start()
        with Client(dp.socket_path) as c:
            for i in range(3):
                retain_prompt(c, prompt(32, i + 1), f"s{i}")
        os.kill(dp.pid, signal.SIGKILL)
        dp.kill()
        with dp.start(), Client(dp.socket_path) as c:
            dp.wait_event("prefix_restore", kept="3")
            assert c.evict_prefixes() and c.prefixes()["prefixes"] == []
            assert not [n for n in os.listdir(os.path.join(d, "prefixes")) if n.endswith(".crc")]
