"""KV storage formats through a real daemon (issue 31).

The daemon knows formats, not arithmetic: a session's geometry names its
``kv_format``, and the row size, the plan, the extent layout, the listing and
the metrics follow from it; the rows are the client's bytes, stored and read
back bit for bit on both paths.  A retained prefix of one format is a miss for
a session of another, and a format the daemon cannot store is refused at
``open_session`` naming the value.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from daemon_util import DaemonProcess, pattern, short_tmpdir

from bladed.client import Client, PrefixKey, Session
from bladed.kvformat import kv_format
from bladed.protocol import BadRequestError

#: SmolLM2-like: 3 KV heads x 64, decoded to fp16 (rows of 384 bytes in fp16, 204 in q8, 120 in q4)
GEO = {"layers": 2, "batch": 1, "kv_heads": 3, "head_dim": 64, "dtype_bytes": 2, "max_tokens": 64}
ROW_BYTES = {"fp16": 384, "q8": 204, "q4": 120}
BLOCK = 16


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    cfg = {"budget": {"override": 4 << 20}, "prefix": {"block_tokens": BLOCK, "pagecache_bytes": "4M",
                                                       "device_bytes": "4M"}}
    with short_tmpdir() as d, DaemonProcess(d, cfg).start() as dp:
        yield dp


def fill_and_read_back(s: Session, fmt: str, ntokens: int) -> None:
    kpu = GEO["max_tokens"] * s.token_bytes
    for layer in range(GEO["layers"]):
        for kind in "kv":
            s.slot(0)[:ntokens * s.token_bytes] = pattern(f"{fmt}-{layer}", layer, kind, kpu)[:ntokens * s.token_bytes]
            s.write(layer, kind, 0, 0, ntokens)
    for layer in range(GEO["layers"]):
        for kind in "kv":
            s.slot(0)[:kpu] = bytes(kpu)
            s.read(layer, kind, 0, 0, ntokens)
            want = pattern(f"{fmt}-{layer}", layer, kind, kpu)[:ntokens * s.token_bytes]
            assert bytes(s.slot(0)[:ntokens * s.token_bytes]) == want, (fmt, layer, kind)


@pytest.mark.parametrize("mode", ["direct", "baseline"])
@pytest.mark.parametrize("fmt", ["fp16", "q8", "q4"])
def test_rows_of_each_format_are_stored_bit_for_bit_on_both_paths(daemon: DaemonProcess, fmt: str,
                                                                  mode: str) -> None:
    with Client(daemon.socket_path) as c, c.open_session(GEO | {"kv_format": fmt}, mode=mode, channels=1) as s:
        assert s.token_bytes == ROW_BYTES[fmt] == kv_format(fmt).row_bytes(3, 64)
        fill_and_read_back(s, fmt, 37)
        (row,) = [r for r in c.sessions() if r["session"] == s.id]
        assert row["geometry"]["kv_format"] == fmt
        assert row["geometry"]["kpu_bytes"] == GEO["max_tokens"] * ROW_BYTES[fmt]
        assert c.stats()["sessions_by_kv_format"] == {fmt: 1}


def test_the_plan_sizes_group1_by_the_stored_bytes(daemon: DaemonProcess) -> None:
    """Algorithm 1 with a budget of 1.5 fp16 KPU pairs: one layer fits in fp16, both in q4 (3.2x smaller rows)."""
    budget = {"override": int(1.5 * 2 * GEO["max_tokens"] * ROW_BYTES["fp16"])}
    with short_tmpdir() as d, DaemonProcess(d, {"budget": budget}).start() as dp, Client(dp.socket_path) as c:
        layers = {}
        for fmt in ("fp16", "q4"):
            with c.open_session(GEO | {"kv_format": fmt}, mode="dualblade", channels=1) as s:
                layers[fmt] = s.plan["group1_layers"]
        assert layers == {"fp16": 1, "q4": 2}


def test_a_prefix_of_one_format_is_a_miss_for_another(daemon: DaemonProcess) -> None:
    tokens = [(i * 7919) % 49152 for i in range(40)]
    with Client(daemon.socket_path) as c:
        for fmt in ("q8", "fp16"):
            key = PrefixKey("formats-test", "float16", tokens)
            with c.open_session(GEO | {"kv_format": fmt}, channels=1, prefix=key) as s:
                assert s.prefix_tokens == 0          # the other format's entry never serves this one
                fill_and_read_back(s, fmt, len(tokens))
                s.retain(tokens)
        for fmt in ("q8", "fp16", "q4"):
            with c.open_session(GEO | {"kv_format": fmt}, channels=1,
                                prefix=PrefixKey("formats-test", "float16", tokens)) as s:
                assert s.prefix_tokens == (0 if fmt == "q4" else 32), fmt
                if s.prefix_tokens:
                    n = 32 * s.token_bytes
                    s.read(1, "v", 0, 0, 32)
                    assert bytes(s.slot(0)[:n]) == pattern(f"{fmt}-1", 1, "v", GEO["max_tokens"] * s.token_bytes)[:n]


@pytest.mark.parametrize(("fields", "named"), [
    ({"kv_format": "q3"}, "unknown KV format 'q3'"),
    ({"kv_format": "q8", "head_dim": 48}, "head_dim 48"),
    ({"kv_format": "q4", "head_dim": 63}, "head_dim 63"),
    ({"kv_format": "fp32"}, "dtype_bytes is 2"),
    ({"kv_format": 8}, "geometry.kv_format"),
], ids=["unknown", "q8-block", "q4-odd", "fp32-vs-dtype", "not-a-string"])
def test_a_format_the_daemon_cannot_store_is_refused_naming_the_value(daemon: DaemonProcess,
                                                                      fields: dict[str, object],
                                                                      named: str) -> None:
    with Client(daemon.socket_path) as c:
        with pytest.raises(BadRequestError) as e:
            c.open_session(GEO | fields, channels=1)
        assert named in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert c.stats()["sessions"] == 0
