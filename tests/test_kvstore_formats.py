"""KV formats in the client's KV backends (issue 31, "Clients"): ``bladed.kvstore``.

``SlotTensors`` encodes K/V into a slot's token rows in the geometry's format (``bladed.kvformat``) and
decodes them back into the caller's dtype; the backends move the rows as bytes. So the rows are exactly the
format's encoding, ``MemoryKV`` and a bladed session of the same geometry hold the same bytes, and without a
format nothing changes (rows of the tensors' own elements, unnamed). A tensor that does not fit the session's
rows is refused in one line naming the range and the sizes, before the slot is touched.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from bladed.client import Client
from bladed.kvformat import KVFormatError, kv_format
from bladed.kvstore import (
    BladedKV,
    Geometry,
    MemoryKV,
    full_precision_tail,
    kv_geometry,
    prefix_key_fields,
)
from bladed.runner.main import spawned_daemon
from bladed.slots import SlotTensors

#: SmolLM2-like rows: 1 x 3 KV heads x 64 (384 bytes in fp16, 204 in q8, 120 in q4)
SHAPE = {"layers": 2, "batch": 1, "kv_heads": 3, "head_dim": 64, "max_tokens": 24}
FORMATS = ["fp16", "bf16", "fp32", "q8", "q4", "q8:16"]


def geometry(fmt: str | None, dtype: torch.dtype = torch.float32) -> Geometry:
    return kv_geometry(**SHAPE, dtype=dtype, kv_format=fmt)


def kv(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """K or V of ``n`` tokens as attention makes it: heads-first ``[batch, kv_heads, n, head_dim]``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE["batch"], SHAPE["kv_heads"], n, SHAPE["head_dim"], generator=g).to(dtype)


def tokens_first(x: torch.Tensor) -> torch.Tensor:
    return x.permute(2, 0, 1, 3)


def test_without_a_format_the_geometry_and_the_slots_are_as_always() -> None:
    g = geometry(None)
    assert g == Geometry(**SHAPE, dtype_bytes=4) and g.kv_format == "" and g.token_bytes == 3 * 64 * 4
    mem = MemoryKV(g)
    slots = SlotTensors(mem, torch.float32)
    assert mem.kv_format is None and slots.format is None
    assert slots.views[0].dtype == torch.float32 and slots.views[0].shape == (24, 1, 3, 64)
    x = kv(5)
    slots.put(0, 2, x)
    assert torch.equal(slots.views[0][2:7], tokens_first(x))          # the elements themselves
    mem.write(0, "k", 0, 2, 5)
    mem.read(0, "k", 1, 2, 5)
    back = slots.take(1, 5, token_start=2)
    assert torch.equal(back, x) and back.dtype == torch.float32
    assert back.stride() == torch.empty(5, 1, 3, 64).permute(1, 2, 0, 3).stride()   # as before


@pytest.mark.parametrize("fmt", FORMATS)
def test_slot_rows_are_the_formats_encoding_and_decode_back_into_the_callers_dtype(fmt: str) -> None:
    f = kv_format(fmt)
    g = geometry(fmt)
    assert g.kv_format == f.name and g.token_bytes == f.row_bytes(3, 64)
    slots = SlotTensors(MemoryKV(g, channels=1), torch.float32)
    x = kv(7, seed=1)
    slots.put(0, 3, x, layer=1, kind="v")
    want = f.encode(tokens_first(x))
    assert torch.equal(slots.rows[0][3:10], want)                      # exactly the format's bytes
    back = slots.take(0, 7, token_start=3)
    assert back.dtype == torch.float32 and back.shape == x.shape
    assert torch.equal(tokens_first(back), f.decode(want, torch.float32, (1, 3, 64)))
    back[:] = 0                                                        # a copy, never the slot's memory
    assert torch.equal(slots.rows[0][3:10], want)


def test_a_plain_format_of_other_elements_stores_those_and_gives_the_callers_dtype_back() -> None:
    """fp16 rows of a float32 model: 2-byte elements on storage (dtype_bytes 2), float32 tensors back."""
    g = geometry("fp16", torch.float32)
    assert (g.dtype_bytes, g.token_bytes) == (2, 3 * 64 * 2)
    slots = SlotTensors(MemoryKV(g, channels=1), torch.float32)
    x = kv(4, seed=2)
    slots.put(0, 0, x)
    assert slots.views[0].dtype == torch.float16
    back = slots.take(0, 4)
    assert back.dtype == torch.float32 and torch.equal(back, x.half().float())


@pytest.mark.parametrize("fmt", ["q8", "fp16"])
def test_bfloat16_kv_is_encoded_and_decoded_to_bfloat16(fmt: str) -> None:
    g = geometry(fmt, torch.bfloat16)
    slots = SlotTensors(MemoryKV(g, channels=1), torch.bfloat16)
    x = kv(3, seed=3, dtype=torch.bfloat16)
    slots.put(0, 0, x)
    assert torch.equal(slots.rows[0][:3], kv_format(fmt).encode(tokens_first(x)))
    back = slots.take(0, 3)
    assert back.dtype == torch.bfloat16
    assert float((back.float() - x.float()).abs().max()) < 0.05


def test_encoded_rows_go_in_as_they_are() -> None:
    g = geometry("q4")
    slots = SlotTensors(MemoryKV(g, channels=1), torch.float32)
    rows = kv_format("q4").encode(tokens_first(kv(2, seed=4)))
    slots.put(0, 5, rows)
    assert torch.equal(slots.rows[0][5:7], rows)


@pytest.mark.parametrize(("fmt", "bad", "message"), [
    ("q8", lambda: kv_format("q4").encode(tokens_first(kv(2))),
     "layer 1 V tokens [4, 6): encoded rows of 120 bytes, the session stores rows of batch x kv_heads x head_dim "
     "= 1 x 3 x 64 values (q8: 204 bytes a row); encode them with bladed.kvformat.kv_format('q8') or pass the "
     "K/V tensor"),
    ("q8", lambda: torch.randn(1, 2, 2, 64),
     "layer 1 V tokens [4, 6): torch.float32 of shape (1, 2, 2, 64) is not [batch, kv_heads, tokens, head_dim] K/V "
     "of the session's rows of batch x kv_heads x head_dim = 1 x 3 x 64 values (q8: 204 bytes a row)"),
    (None, lambda: torch.randn(1, 3, 2, 32),
     "layer 1 V tokens [4, 6): torch.float32 of shape (1, 3, 2, 32) is not [batch, kv_heads, tokens, head_dim] K/V "
     "of the session's rows of batch x kv_heads x head_dim = 1 x 3 x 64 values (float32: 768 bytes a row)"),
    ("q4", lambda: torch.zeros(1, 3, 2, 64, dtype=torch.int32),
     "layer 1 V tokens [4, 6): torch.int32 of shape (1, 3, 2, 64) is not [batch, kv_heads, tokens, head_dim] K/V "
     "of the session's rows of batch x kv_heads x head_dim = 1 x 3 x 64 values (q4: 120 bytes a row)"),
    ("q8", lambda: kv(21), "layer 1 V tokens [4, 25): outside the session's 24 tokens"),
], ids=["rows-of-another-format", "other-heads", "plain-other-head-dim", "integers", "past-max-tokens"])
def test_kv_that_does_not_fit_the_sessions_rows_is_refused_in_one_line_naming_the_range(
        fmt: str | None, bad: object, message: str) -> None:
    g = geometry(fmt)
    slots = SlotTensors(MemoryKV(g, channels=1), torch.float32)
    before = bytes(slots.rows[0].numpy().tobytes())
    with pytest.raises(ValueError) as e:
        slots.put(0, 4, bad(), layer=1, kind="v")  # type: ignore[operator]
    assert str(e.value) == message
    assert bytes(slots.rows[0].numpy().tobytes()) == before          # refused before the slot was touched


def test_a_format_the_head_dim_does_not_fit_is_refused_naming_it() -> None:
    with pytest.raises(KVFormatError, match="head_dim 48"):
        kv_geometry(**{**SHAPE, "head_dim": 48}, dtype=torch.float32, kv_format="q8")
    with pytest.raises(KVFormatError, match="unknown KV format 'q3'"):
        geometry("q3")


def test_prefix_keys_keep_the_element_size_of_the_rows_and_tell_computing_dtypes_apart() -> None:
    assert prefix_key_fields("m", torch.float32) == ("m", "float32")                  # as always
    assert prefix_key_fields("m", torch.float32, "q8") == ("m", "float32")            # bladed keys by format too
    assert prefix_key_fields("m", torch.float16, "fp16") == ("m", "float16")
    assert prefix_key_fields("m", torch.float32, "fp16") == ("m+float32", "float16")  # fp16 rows of float32 KV


def test_bladed_kv_refuses_a_session_whose_rows_are_not_the_geometrys() -> None:
    """A daemon that ignored kv_format (its rows the plain size) would read the q8 rows wrong: refused."""
    g = geometry("q8")
    plain = SimpleNamespace(plan={}, channels=1, slot_bytes=g.kpu_bytes, token_bytes=3 * 64 * 4)
    with pytest.raises(ValueError, match="the bladed session has token rows of 768 bytes, the geometry's q8 rows "
                                         "are 204 bytes"):
        BladedKV(plain, g)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with spawned_daemon(str(tmp_path_factory.mktemp("bladed-kvformats"))) as sock:
        yield sock


@pytest.mark.parametrize("defer", [False, True], ids=["", "deferred-writes"])
@pytest.mark.parametrize("mode", ["direct", "baseline"])
@pytest.mark.parametrize("fmt", ["q8", "q4", "fp16"])
def test_a_bladed_session_holds_the_same_bytes_as_memory_kv_of_the_same_format(
        daemon: str, fmt: str, mode: str, defer: bool) -> None:
    g = geometry(fmt)
    mem = MemoryKV(g)
    with Client(daemon) as client:
        kvb = BladedKV.open(g, mode=mode, channels=2, client=client, defer_writes=defer)
        try:
            assert kvb.session.token_bytes == g.token_bytes and kvb.kv_format == kv_format(fmt)
            backends = [(mem, SlotTensors(mem, torch.float32)), (kvb, SlotTensors(kvb, torch.float32))]
            for layer in range(SHAPE["layers"]):
                for i, kind in enumerate("kv"):
                    x = kv(9, seed=10 * layer + i)
                    for backend, slots in backends:          # a prefill, then two one-token appends
                        slots.put(i, 0, x[:, :, :7], layer=layer, kind=kind)
                        backend.write(layer, kind, i, 0, 7)
                        for t in (7, 8):
                            slots.put(i, t, x[:, :, t:t + 1], layer=layer, kind=kind)
                            backend.write(layer, kind, i, t, 1)
            for layer in range(SHAPE["layers"]):
                for i, kind in enumerate("kv"):
                    got = []
                    for backend, slots in backends:
                        slots.rows[i].zero_()
                        backend.read(layer, kind, i, 0, 9)
                        got.append((slots.rows[i][:9].clone(), slots.take(i, 9)))
                    (mem_rows, mem_kv), (bladed_rows, bladed_kv) = got
                    assert torch.equal(bladed_rows, mem_rows), (layer, kind)
                    assert torch.equal(bladed_kv, mem_kv)
                    x = kv(9, seed=10 * layer + i)
                    assert torch.equal(mem_rows, kv_format(fmt).encode(tokens_first(x)))
            for slots in (s for _, s in backends):
                slots.close()
        finally:
            kvb.close()
        assert all(r["session"] != kvb.session.id for r in client.sessions())     # closed


# -- the full-precision tail (KVFormat.full_precision_tail: 128 for q4) -------------------------------------

def test_the_tail_is_the_formats_unless_the_backend_or_the_caller_says_otherwise() -> None:
    assert kv_format("q4").full_precision_tail == 128
    assert SlotTensors(MemoryKV(geometry("q4")), torch.float32).tail == 128
    for fmt in ("q8", "fp16", None):
        assert SlotTensors(MemoryKV(geometry(fmt)), torch.float32).tail == 0
    assert full_precision_tail("q4") == 128 and full_precision_tail("q4", 0) == 0 and full_precision_tail("") == 0
    assert SlotTensors(MemoryKV(geometry("q4"), kv_tail=0), torch.float32).tail == 0       # off, for measuring
    assert SlotTensors(MemoryKV(geometry("q4"), kv_tail=0), torch.float32, tail=3).tail == 3
    g = geometry("q4")
    session = SimpleNamespace(plan={}, channels=1, slot_bytes=g.kpu_bytes, token_bytes=g.token_bytes)
    assert BladedKV(session, g).kv_tail == 128 and BladedKV(session, g, kv_tail=7).kv_tail == 7
    message = ("kv_tail=-1: the full-precision tail is a number of tokens, 0 or more (0 turns it off; leave it out "
               "for the format's own)")
    for make in (lambda: MemoryKV(g, kv_tail=-1), lambda: BladedKV(session, g, kv_tail=-1),
                 lambda: SlotTensors(MemoryKV(g), torch.float32, tail=-1)):
        with pytest.raises(ValueError) as e:
            make()
        assert str(e.value) == message


@pytest.mark.parametrize("tail", [5, 128], ids=["ring-of-5", "q4s-own-128"])
def test_the_newest_tail_tokens_come_back_as_written_and_the_older_ones_as_their_decoded_rows(tail: int) -> None:
    g = geometry("q4")                                   # max_tokens 24
    f = kv_format("q4")
    mem = MemoryKV(g, kv_tail=tail)
    slots = SlotTensors(mem, torch.float32)
    x = {kind: kv(16, seed=20 + i) for i, kind in enumerate("kv")}
    for i, kind in enumerate("kv"):                      # a prefill of 10 tokens, then six one-token appends
        slots.put(i, 0, x[kind][:, :, :10], layer=1, kind=kind)
        mem.write(1, kind, i, 0, 10)
        for t in range(10, 16):
            slots.put(i, t, x[kind][:, :, t:t + 1], layer=1, kind=kind)
            mem.write(1, kind, i, t, 1)
    ring = min(tail, g.max_tokens)
    assert slots.tail_bytes() == 2 * ring * 3 * 64 * 4   # K and V of the one layer written, float32
    for n in (16, 3):
        for i, kind in enumerate("kv"):
            slots.rows[i].zero_()
            mem.read(1, kind, i, 0, n)
            back = slots.take(i, n, layer=1, kind=kind)
            fp = max(0, n - tail) if n == 16 else max(0, 16 - tail)     # the ring holds the last tail written
            decoded = f.decode(f.encode(tokens_first(x[kind][:, :, :n])), torch.float32, (1, 3, 64))
            assert torch.equal(back[:, :, fp:], x[kind][:, :, fp:n])               # exactly the K/V written
            assert torch.equal(tokens_first(back)[:fp], decoded[:fp])             # the q4 rows, decoded
            assert not torch.equal(back, x[kind][:, :, :n]) or fp == 0
            # the same slot read without naming the KPU: the rows alone, as before
            assert torch.equal(tokens_first(slots.take(i, n)), decoded)


def test_tokens_the_client_never_wrote_in_full_precision_come_from_their_rows() -> None:
    """A retained prefix (or rows put already encoded) has no full-precision copy: decoded rows. The ring
    holds one run of tokens: rows put encoded into it end the run there."""
    f = kv_format("q4")
    slots = SlotTensors(MemoryKV(geometry("q4"), channels=1), torch.float32)
    x = kv(8, seed=30)
    decoded = f.decode(f.encode(tokens_first(x)), torch.float32, (1, 3, 64))
    slots.put(0, 0, f.encode(tokens_first(x[:, :, :3])), layer=0, kind="k")   # tokens 0..2: a prefix's rows
    slots.put(0, 3, x[:, :, 3:], layer=0, kind="k")
    back = slots.take(0, 8, layer=0, kind="k")
    assert torch.equal(tokens_first(back)[:3], decoded[:3]) and torch.equal(back[:, :, 3:], x[:, :, 3:])
    slots.put(0, 5, f.encode(tokens_first(x[:, :, 5:6])), layer=0, kind="k")
    back = slots.take(0, 8, layer=0, kind="k")
    assert torch.equal(back[:, :, 3:5], x[:, :, 3:5]) and torch.equal(tokens_first(back)[5:], decoded[5:])


@pytest.mark.parametrize("fmt", ["q8", "fp16", None])
def test_formats_without_a_tail_read_back_their_rows_as_before(fmt: str | None) -> None:
    slots = SlotTensors(MemoryKV(geometry(fmt), channels=1), torch.float32)
    x = kv(6, seed=31)
    slots.put(0, 0, x, layer=0, kind="v")
    assert slots.tail == 0 and slots.tail_bytes() == 0
    assert torch.equal(slots.take(0, 6, layer=0, kind="v"), slots.take(0, 6))


def test_q4_with_its_tail_over_a_bladed_session_equals_memory_kv_bit_for_bit(daemon: str) -> None:
    g = geometry("q4")
    mem = MemoryKV(g, kv_tail=4)
    with Client(daemon) as client:
        kvb = BladedKV.open(g, mode="direct", channels=2, client=client, defer_writes=True, kv_tail=4)
        try:
            backends = [(mem, SlotTensors(mem, torch.float32)), (kvb, SlotTensors(kvb, torch.float32))]
            assert [s.tail for _, s in backends] == [4, 4]
            for layer in range(SHAPE["layers"]):
                for i, kind in enumerate("kv"):
                    x = kv(11, seed=40 + 10 * layer + i)
                    for backend, slots in backends:
                        slots.put(i, 0, x[:, :, :8], layer=layer, kind=kind)
                        backend.write(layer, kind, i, 0, 8)
                        for t in (8, 9, 10):
                            slots.put(i, t, x[:, :, t:t + 1], layer=layer, kind=kind)
                            backend.write(layer, kind, i, t, 1)
                    got = []
                    for backend, slots in backends:
                        slots.rows[i].zero_()
                        backend.read(layer, kind, i, 0, 11)
                        got.append(slots.take(i, 11, layer=layer, kind=kind))
                    assert torch.equal(got[0], got[1]), (layer, kind)
                    assert torch.equal(got[0][:, :, 7:], x[:, :, 7:])
                    assert not torch.equal(got[0][:, :, :7], x[:, :, :7])
            for _, slots in backends:
                slots.close()
        finally:
            kvb.close()
