"""The C codec of q8 / q4 rows (``bladed._codec``) against the torch encoder and decoder, bit for bit.

``bladed.kvformat`` codes CPU tensors of float32 / float16 / bfloat16 in C and everything else with torch, the
reference (``codec="torch"``). The rows must be the torch encoder's bytes and decode to the torch decoder's
values, for any shape, block size, scale, strides and input dtype, on every build of the C loops this CPU runs
(portable; AVX2 + F16C), on one thread or several; docs/kv-formats.md names the only differences (a NaN
block's bytes, the sign of a zero scale or minimum) and tests/test_kvformat_codec_numpy.py pins down the C
codec's choice there. Also: ``decode(out=)`` into views with room, the choice of codec and its refusals, the
fallback without the extension, and ``SlotTensors.take`` decoding straight into a tensor with room.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_codec_util import BLOCKS, assert_same_bits, isa, isas, kv_values

from bladed import kvformat
from bladed.kvformat import CODEC_THREAD_MIN_VALUES, KVFormatError, QuantFormat, codec_info, kv_format
from bladed.kvstore import MemoryKV, kv_geometry
from bladed.slots import SlotTensors

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LAYOUTS = ("contiguous", "heads-first", "room", "strided-head-dim")


def fmt_of(kind: str, block: int) -> QuantFormat:
    f = kv_format(f"{kind}:{block}")
    assert isinstance(f, QuantFormat)
    return f


def bits(t: torch.Tensor) -> np.ndarray:
    """``t`` as numpy, bfloat16 as its uint16 bits (what assert_same_bits reads)."""
    t = t.detach().contiguous()
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def laid_out(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values ``[tokens, heads, hd]`` in another memory layout (a view, never a contiguous tensor)."""
    n, h, hd = x.shape
    if layout == "heads-first":                  # as attention makes K/V: [heads, tokens, hd], seen tokens-first
        return x.permute(1, 0, 2).contiguous().permute(1, 0, 2)
    if layout == "room":                         # the first tokens of a larger buffer, heads apart by more than hd
        big = torch.full((n + 3, h, hd + 16), 7.0, dtype=x.dtype)
        big[:n, :, :hd] = x
        return big[:n, :, :hd]
    if layout == "strided-head-dim":             # head_dim not contiguous: the codec copies
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    return x


def assert_rows_match(f: QuantFormat, x: torch.Tensor, c_rows: torch.Tensor, t_rows: torch.Tensor) -> None:
    """C rows equal torch rows bit for bit, but for what docs/kv-formats.md leaves open: a NaN block (torch: a NaN
    scale, and minimum, of any bits; C: 0x7E00 and codes 0), codes of a block that decodes to NaN throughout
    (q4 of only -inf), and the sign of a zero scale or minimum."""
    n, b, bb = c_rows.shape[0], f.block, f.block_bytes
    hdr = 2 if f.kind == "q8" else 4
    c, t = bits(c_rows).reshape(n, -1, bb), bits(t_rows).reshape(n, -1, bb)
    nan_block = np.isnan(bits(x.float()).reshape(n, -1, b)).any(-1)
    ch, th = c[..., :hdr].copy().view("<u2"), t[..., :hdr].copy().view("<u2")
    assert np.isnan(th.view(np.float16)[nan_block]).all(), "torch: a NaN block has a NaN scale"
    assert (ch[nan_block] == 0x7E00).all() and not c[nan_block][:, hdr:].any(), "C: NaN block as documented"
    zeros = ((ch & 0x7FFF) == 0) & ((th & 0x7FFF) == 0)
    ch, th = np.where(zeros, 0, ch), np.where(zeros, 0, th)
    bad = (ch != th) & ~nan_block[..., None]
    assert not bad.any(), f"{f.name}: scales differ at {np.argwhere(bad)[:3].tolist()}: {ch[bad][:3]} vs {th[bad][:3]}"
    poisoned = nan_block | ((th[..., 0] == 0xFC00) if f.kind == "q4" else False)
    bad = (c[..., hdr:] != t[..., hdr:]) & ~poisoned[..., None]
    assert not bad.any(), f"{f.name}: codes differ at {np.argwhere(bad)[:3].tolist()}"


def assert_decodes_match(f: QuantFormat, rows: torch.Tensor, shape: tuple[int, ...]) -> None:
    """C and torch decode ``rows`` to the same values (NaN: any NaN), into new tensors and into ``out``."""
    n = rows.shape[0]
    for dtype in DTYPES:
        want = f.decode(rows, dtype, shape, codec="torch")
        got = f.decode(rows, dtype, shape, codec="c")
        assert got.shape == want.shape == (n, *shape) and got.dtype == dtype
        assert_same_bits(bits(got), bits(want), f"{f.name} -> {dtype}")
        for codec in ("c", "torch"):
            big = torch.full((n + 2, *shape), 3.0, dtype=dtype)
            assert f.decode(rows, out=big[:n], codec=codec).data_ptr() == big.data_ptr()
            assert_same_bits(bits(big[:n]), bits(want), f"{f.name} -> {dtype} out= ({codec})")
            assert (big[n:] == 3.0).all()


# --- bit for bit against torch ---------------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(["q8", "q4"]), block=st.sampled_from(BLOCKS), blocks_per_head=st.integers(1, 3),
       tokens=st.integers(1, 5), heads=st.integers(1, 3), dtype=st.sampled_from(DTYPES),
       log_scale=st.floats(-9, 6), offset=st.floats(-4, 4), seed=st.integers(0, 2 ** 32 - 1),
       layout=st.sampled_from(LAYOUTS), threads=st.sampled_from([None, 1, 3]), build=st.sampled_from(isas()))
def test_c_rows_and_values_equal_torchs(kind: str, block: int, blocks_per_head: int, tokens: int, heads: int,
                                        dtype: torch.dtype, log_scale: float, offset: float, seed: int, layout: str,
                                        threads: int | None, build: str) -> None:
    f = fmt_of(kind, block)
    hd = block * blocks_per_head
    x = torch.from_numpy(kv_values(seed, tokens, heads, hd, block, log_scale, offset)).to(dtype)
    xv = laid_out(x, layout)
    t_rows = f.encode(xv, codec="torch")
    with isa(build):
        c_rows = f.encode(xv, codec="c", threads=threads)
        assert c_rows.shape == t_rows.shape == (tokens, f.row_bytes(heads, hd)) and c_rows.dtype == torch.uint8
        assert_rows_match(f, x, c_rows, t_rows)
        assert_decodes_match(f, t_rows, (heads, hd))


@settings(max_examples=100, deadline=None)
@given(kind=st.sampled_from(["q8", "q4"]), block=st.sampled_from(BLOCKS), nb=st.integers(1, 6),
       tokens=st.integers(1, 4), seed=st.integers(0, 2 ** 32 - 1), build=st.sampled_from(isas()))
def test_any_bytes_decode_to_torchs_values(kind: str, block: int, nb: int, tokens: int, seed: int,
                                           build: str) -> None:
    """Any scale (subnormal, inf, NaN) and any code."""
    f = fmt_of(kind, block)
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 256, (tokens, nb * f.block_bytes), dtype=torch.uint8, generator=g)
    with isa(build):
        assert_decodes_match(f, rows, (nb * block,))


@pytest.mark.parametrize("build", isas())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["q8", "q4", "q8:16", "q4:64"])
def test_model_shaped_kv_is_bit_identical(name: str, dtype: torch.dtype, build: str) -> None:
    """SmolLM2-like K of 2 x 3 heads x 64 heads-first, 40 tokens: rows and values as torch's."""
    f = kv_format(name)
    assert isinstance(f, QuantFormat)
    g = torch.Generator().manual_seed(5)
    k = (torch.randn(2, 3, 40, 64, generator=g) * 2).to(dtype).permute(2, 0, 1, 3)   # tokens first, strided
    with isa(build):
        c_rows = f.encode(k)
        assert_rows_match(f, k, c_rows, f.encode(k, codec="torch"))
        assert torch.equal(c_rows, f.encode(k, codec="torch"))                       # nothing open here
        assert torch.equal(f.decode(c_rows, dtype, (2, 3, 64)), f.decode(c_rows, dtype, (2, 3, 64), codec="torch"))


def test_documented_differences_from_torch() -> None:
    q8, q4 = fmt_of("q8", 4), fmt_of("q4", 4)
    x = torch.tensor([[1.0, float("nan"), 2.0, 3.0, -0.0, -0.0, -0.0, -0.0]])
    for f in (q8, q4):
        c, t = f.encode(x, codec="c"), f.encode(x, codec="torch")
        assert_rows_match(f, x, c, t)
        hdr = 2 if f is q8 else 4
        assert bits(c[0, :hdr]).view("<u2").tolist() == [0x7E00] * (hdr // 2)     # C: the quiet NaN
        assert np.isnan(bits(t[0, :2]).view(np.float16)).all()                     # torch: a NaN
        for codec in ("c", "torch"):
            assert torch.isnan(f.decode(c, torch.float32, codec=codec)[0, :4]).all()
            assert torch.isnan(f.decode(t, torch.float32, codec=codec)[0, :4]).all()
    inf = float("inf")
    y = torch.tensor([[-inf, -inf, -inf, -inf, 1.0, inf, -2.0, 0.5]])  # all -inf; +inf with finite values
    for f in (q8, q4):
        c, t = f.encode(y, codec="c"), f.encode(y, codec="torch")
        assert_rows_match(f, y, c, t)
        hdr = 2 if f is q8 else 4
        assert torch.equal(c[0, f.block_bytes:], t[0, f.block_bytes:])            # +inf: the same bytes
        assert bits(c[0, f.block_bytes:f.block_bytes + 2]).view("<u2")[0] == 0x7BFF   # step 65504
        assert torch.equal(c[0, :hdr], t[0, :hdr])                                # all -inf: the same header,
        if f is q4:
            assert bits(c[0, :4]).view("<u2").tolist() == [0xFC00, 0xFBFF] and not c[0, 4:6].any()  # C codes 0
            assert torch.isnan(f.decode(t, torch.float32, codec="c")[0, :4]).all()
        else:
            assert (bits(c[0, 2:6]).view(np.int8) == -127).all()
    c = q8.encode(x, codec="c")                                  # all -0: the scale is -0 (as torch's here)
    assert bits(c[0, 6:8]).view("<u2")[0] == 0x8000 == bits(q8.encode(x, codec="torch")[0, 6:8]).view("<u2")[0]
    assert str(q8.decode(c, torch.float32)[0, 4].item()) == "-0.0"


# --- decode(out=) ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("codec", ["c", "torch"])
@pytest.mark.parametrize("name", ["q8", "q4"])
def test_decode_into_views_with_room(name: str, codec: str) -> None:
    f = kv_format(name)
    k = torch.randn(6, 2, 3, 64)
    rows = f.encode(k)
    want = f.decode(rows, torch.float16, (2, 3, 64), codec="torch")
    tokens_first = torch.full((9, 2, 3, 64), 5.0, dtype=torch.float16)        # 6 tokens and room for 3
    assert f.decode(rows, out=tokens_first[:6], codec=codec) is not None
    assert torch.equal(tokens_first[:6], want) and (tokens_first[6:] == 5).all()
    heads_first = torch.full((2, 3, 9, 64), 5.0, dtype=torch.float16)         # [batch, heads, tokens + room, hd]
    f.decode(rows, torch.float16, (2, 3, 64), out=heads_first[:, :, :6].permute(2, 0, 1, 3), codec=codec)
    assert torch.equal(heads_first[:, :, :6].permute(2, 0, 1, 3), want) and (heads_first[:, :, 6:] == 5).all()
    odd = torch.zeros(2 * 3 * 64, 6, dtype=torch.float32).t()                 # no view with contiguous heads
    f.decode(rows, out=odd, codec=codec)
    assert torch.equal(odd, f.decode(rows, torch.float32, codec="torch"))
    assert torch.equal(f.decode(rows[:0], out=tokens_first[:0], codec=codec), tokens_first[:0])


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp32"])
def test_plain_formats_decode_into_out_too(name: str) -> None:
    f = kv_format(name)
    rows = f.encode(torch.randn(4, 3, 64))
    room = torch.full((6, 3, 64), 2.0)
    assert f.decode(rows, out=room[:4]).data_ptr() == room.data_ptr()
    assert torch.equal(room[:4], f.decode(rows, torch.float32, (3, 64))) and (room[4:] == 2).all()


@pytest.mark.parametrize("bad,part", [
    (lambda: torch.zeros(6, 2, 3, 64, dtype=torch.float32), "float16"),        # dtype given as float16
    (lambda: torch.zeros(5, 2, 3, 64, dtype=torch.float16), "[5, 2, 3, 64]"),   # tokens
    (lambda: torch.zeros(6, 3, 2, 64, dtype=torch.float16), "[6, 3, 2, 64]"),   # shape given as (2, 3, 64)
    (lambda: torch.zeros(6, 384, dtype=torch.int16), "int16"),
    (lambda: torch.zeros(6, 2, 3, 64, dtype=torch.float16, device="meta"), "meta"),
])
def test_decode_into_the_wrong_out_is_refused_in_one_line(bad: object, part: str) -> None:
    q8 = kv_format("q8")
    rows = q8.encode(torch.randn(6, 2, 3, 64))
    with pytest.raises(KVFormatError) as e:
        q8.decode(rows, torch.float16, (2, 3, 64), out=bad())                  # type: ignore[operator]
    assert part in str(e.value) and "\n" not in str(e.value), str(e.value)


# --- picking the codec -----------------------------------------------------------------------------------

def test_cpu_tensors_take_the_c_codec_and_others_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert codec_info()["built"], f"bladed._codec is not built ({codec_info()['error']}): pip install -e ."
    q4 = kv_format("q4")
    assert isinstance(q4, QuantFormat)
    calls: list[str] = []

    def counted(name: str) -> object:
        real = getattr(type(q4), name)

        def call(self: QuantFormat, *a: object, **k: object) -> object:
            calls.append(name)
            return real(self, *a, **k)
        return call

    for name in ("_encode_c", "_decode_c", "_encode_torch", "_decode_torch"):
        monkeypatch.setattr(type(q4), name, counted(name))
    x = torch.randn(3, 64)
    for dtype in DTYPES:
        q4.decode(q4.encode(x.to(dtype)), dtype)
    assert calls == ["_encode_c", "_decode_c"] * 3
    calls.clear()
    q4.decode(q4.encode(x.double()), torch.float64)                            # a dtype the C codec lacks
    q4.decode(q4.encode(x, codec="torch"), codec="torch")
    monkeypatch.setenv(kvformat.CODEC_ENV, "torch")
    q4.decode(q4.encode(x))
    assert calls == ["_encode_torch", "_decode_torch"] * 3


@pytest.mark.parametrize("call,part", [
    (lambda: kv_format("q8").encode(torch.zeros(2, 64, dtype=torch.float64), codec="c"), "float64"),
    (lambda: kv_format("q8").decode(torch.zeros(2, 34, dtype=torch.uint8), torch.float64, codec="c"), "float64"),
    (lambda: kv_format("q8").encode(torch.zeros(2, 64, device="meta"), codec="c"), "meta"),
    (lambda: kv_format("q8").encode(torch.zeros(2, 64), codec="C++"), "'C++'"),
    (lambda: kv_format("q8").encode(torch.zeros(2, 64), threads=0), "threads"),
])
def test_impossible_choices_are_refused_in_one_line(call: object, part: str) -> None:
    with pytest.raises(KVFormatError) as e:
        call()                                                                  # type: ignore[operator]
    assert part in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("var,value", [(kvformat.CODEC_ENV, "fast"), (kvformat.THREADS_ENV, "two"),
                                       (kvformat.ISA_ENV, "sse9")])
def test_bad_environment_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch, var: str,
                                                        value: str) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(KVFormatError) as e:
        kv_format("q8").encode(torch.zeros(2, 64))
    assert var in str(e.value) and value in str(e.value) and "\n" not in str(e.value)


def test_threads_cap_and_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kvformat.THREADS_ENV, raising=False)
    many = 64 * CODEC_THREAD_MIN_VALUES
    assert kvformat._threads(None, CODEC_THREAD_MIN_VALUES * 2 - 1) == 1                  # too few values
    assert kvformat._threads(None, many) == torch.get_num_threads()                    # torch's threads
    assert kvformat._threads(5, 10) == 5                                                # as given
    monkeypatch.setenv(kvformat.THREADS_ENV, "3")
    assert kvformat._threads(None, many) == 3 and kvformat._threads(None, 2 * CODEC_THREAD_MIN_VALUES) == 2
    f = kv_format("q8:16")
    x = torch.randn(29, 5, 64, dtype=torch.float16)
    rows = f.encode(x, threads=1)
    for t in (2, 3, 7, 40):
        assert torch.equal(f.encode(x, threads=t), rows)
        assert torch.equal(f.decode(rows, threads=t), f.decode(rows, threads=1))


def test_without_the_extension_the_torch_path_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvformat, "_extension", lambda: "bladed._codec: No module named 'bladed._codec'")
    q8 = kv_format("q8")
    x = torch.randn(3, 64)
    assert torch.equal(q8.encode(x), q8.encode(x, codec="torch"))
    assert codec_info()["built"] is False and "No module" in codec_info()["error"]
    with pytest.raises(KVFormatError, match=r"not built .*pip install -e \."):
        q8.encode(x, codec="c")


def test_kvformat_imports_without_torch_and_without_the_extension() -> None:
    """The daemon sizes rows with bladed.kvformat and loads neither."""
    child = textwrap.dedent("""
        import importlib.abc, sys
        class Refuse(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "torch" or name == "bladed._codec":
                    raise ImportError(f"no {name} here")
        sys.meta_path.insert(0, Refuse())
        from bladed.kvformat import KVFormatError, codec_info, kv_format
        info = codec_info()
        try:
            kv_format("q4").encode_array(__import__("numpy").zeros((1, 32), "float32"))
        except KVFormatError as e:
            refused = "not built" in str(e)
        print(kv_format("q4").row_bytes(3, 64), info["built"], refused, "torch" in sys.modules)
    """)
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["120", "False", "True", "False"]


# --- SlotTensors.take ------------------------------------------------------------------------------------

@pytest.mark.parametrize("codec", ["auto", "torch"])
@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_slot_take_decodes_straight_into_a_tensor_with_room(monkeypatch: pytest.MonkeyPatch, fmt: str,
                                                            codec: str) -> None:
    monkeypatch.setenv(kvformat.CODEC_ENV, codec)
    g = kv_geometry(layers=1, batch=2, kv_heads=3, head_dim=64, max_tokens=16, dtype=torch.float16, kv_format=fmt)
    slots = SlotTensors(MemoryKV(g, channels=1), torch.float16, tail=0)
    kv = torch.randn(2, 3, 10, 64).half()
    slots.put(0, 2, kv)
    before = slots.rows[0].clone()
    back = slots.take(0, 7, token_start=3, room=4)
    assert back.shape == (2, 3, 11, 64) and back.dtype == torch.float16
    want = kv_format(fmt).decode(slots.rows[0][3:10], torch.float16, (2, 3, 64), codec="torch")
    assert torch.equal(back[:, :, :7].permute(2, 0, 1, 3), want)
    assert back.permute(2, 0, 1, 3).is_contiguous()                   # tokens-first underneath, room at the end
    back.zero_()
    assert torch.equal(slots.rows[0], before)                         # never the slot's memory
