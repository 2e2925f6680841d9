"""The C codec of q8 / q4 rows (``bladed._codec``) against a numpy reference of the formats, without torch.

The arm64 suites (tools/vm/arm64/run-arm64.sh --suites) run this module: their root has no torch, and the
arm64 build of the loops (NEON, the compiler's fp16 conversions) must write the same rows. The reference
(tests/kv_codec_util.py) is the torch encoder's arithmetic in numpy float32, with the C codec's documented
choices where torch leaves bits open; tests/test_kvformat_codec.py holds the C codec against torch itself.
Every build of the loops this CPU runs is checked (portable, and AVX2 + F16C on x86-64).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_codec_util import (
    BLOCKS,
    assert_same_bits,
    exact_floats,
    isa,
    isas,
    kv_values,
    ref_decode,
    ref_encode,
    to_elements,
)

from bladed.kvformat import KVFormatError, QuantFormat, codec_info, kv_format

DTYPES = ("float32", "float16", "bfloat16")


def fmt_of(kind: str, block: int) -> QuantFormat:
    f = kv_format(f"{kind}:{block}")
    assert isinstance(f, QuantFormat)
    return f


def encode(f: QuantFormat, x: np.ndarray, dtype: str, **kw: object) -> np.ndarray:
    return f.encode_array(x, elements="bfloat16" if dtype == "bfloat16" else None, **kw)  # type: ignore[arg-type]


def test_the_c_codec_is_built_here() -> None:
    info = codec_info()
    assert info["built"], f"bladed._codec is not built ({info['error']}): pip install -e . (tools/setup.sh)"
    assert "portable" in info["isas"] and info["isa"] in info["isas"]


def test_it_needs_no_torch() -> None:
    """In a process where torch cannot be imported: bladed.kvformat imports, sizes rows and runs the C codec."""
    child = textwrap.dedent("""
        import importlib.abc, sys
        class Refuse(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "torch":
                    raise ImportError("no torch here")
        sys.meta_path.insert(0, Refuse())
        import numpy as np
        from bladed.kvformat import kv_format
        q8 = kv_format("q8")
        rows = q8.encode_array(np.ones((2, 3, 64), np.float32))
        back = q8.decode_array(rows, "float32", (3, 64))
        print(q8.row_bytes(3, 64), rows.shape, round(float(back.max()), 3), "torch" in sys.modules)
    """)
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["204", "(2,", "204)", "1.0", "False"]


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(["q8", "q4"]), block=st.sampled_from(BLOCKS), blocks_per_head=st.integers(1, 3),
       tokens=st.integers(1, 5), heads=st.integers(1, 3), dtype=st.sampled_from(DTYPES),
       log_scale=st.floats(-9, 6), offset=st.floats(-4, 4), seed=st.integers(0, 2 ** 32 - 1),
       build=st.sampled_from(isas()))
def test_rows_equal_the_reference_bit_for_bit(kind: str, block: int, blocks_per_head: int, tokens: int, heads: int,
                                              dtype: str, log_scale: float, offset: float, seed: int,
                                              build: str) -> None:
    f = fmt_of(kind, block)
    hd = block * blocks_per_head
    x = to_elements(kv_values(seed, tokens, heads, hd, block, log_scale, offset), dtype)
    want = ref_encode(kind, block, exact_floats(x, dtype).reshape(tokens, -1))
    with isa(build):
        rows = encode(f, x, dtype)
        assert rows.dtype == np.uint8 and rows.shape == (tokens, f.row_bytes(heads, hd))
        assert np.array_equal(rows, want), np.argwhere(rows != want)[:4].tolist()
        for out in DTYPES:                           # decode: the reference's values, rounded to the output
            back = f.decode_array(rows, out, (heads, hd))
            assert back.shape == (tokens, heads, hd)
            assert_same_bits(back.reshape(tokens, -1), to_elements(ref_decode(kind, block, rows), out), out)


@settings(max_examples=100, deadline=None)
@given(kind=st.sampled_from(["q8", "q4"]), block=st.sampled_from(BLOCKS), nb=st.integers(1, 6),
       tokens=st.integers(1, 4), seed=st.integers(0, 2 ** 32 - 1), build=st.sampled_from(isas()))
def test_any_bytes_decode_as_the_reference(kind: str, block: int, nb: int, tokens: int, seed: int,
                                           build: str) -> None:
    """Any scale (subnormal, inf, NaN) and any code: the decoder's arithmetic, whatever wrote the rows."""
    f = fmt_of(kind, block)
    rows = np.random.default_rng(seed).integers(0, 256, (tokens, nb * f.block_bytes), dtype=np.uint8)
    with isa(build):
        for out in DTYPES:
            assert_same_bits(f.decode_array(rows, out), to_elements(ref_decode(kind, block, rows), out), out)


@pytest.mark.parametrize("build", isas())
@pytest.mark.parametrize("block", [4, 32])                # 32: the AVX2 build's single-pass loops
@pytest.mark.parametrize("kind", ["q8", "q4"])
def test_documented_nan_inf_and_zero_blocks(kind: str, block: int, build: str) -> None:
    f = fmt_of(kind, block)
    x = np.array([[[1.0, np.nan, 2.0, 3.0],          # NaN: scale (and minimum) 0x7E00, codes 0, all NaN back
                   [1.0, np.inf, -2.0, 0.5],         # +inf: the step clamps to 65504
                   [-0.0, -0.0, -0.0, -0.0],         # all -0
                   [0.0, -0.0, 0.0, 0.0],            # mixed zeros
                   [-np.inf, -np.inf, -np.inf, -np.inf]]], np.float32)
    x = np.tile(x, block // 4)                        # each block: its four values over and over
    with isa(build):
        rows = f.encode_array(x).reshape(5, f.block_bytes)
        back = f.decode_array(rows.reshape(1, -1), "float32").reshape(5, block)
    head = rows[:, :4].copy().view("<u2")
    assert head[0, 0] == 0x7E00 and not rows[0, 2 if kind == "q8" else 4:].any() and np.isnan(back[0]).all()
    if kind == "q8":
        assert head[1, 0] == 0x7BFF and rows[1, 3].view(np.int8) == 127     # d = 65504; inf -> code 127
        assert head[2, 0] == 0x8000 and head[3, 0] == 0x0000                 # -0 scale only for all -0
        assert np.array_equal(back[2].view(np.uint32), np.full(block, 0x80000000, np.uint32))
        assert head[4, 0] == 0x7BFF and (rows[4, 2:].view(np.int8) == -127).all()
    else:
        assert head[0, 1] == 0x7E00
        assert head[1, 0] == 0x7BFF                                           # d = 65504 (clamped from inf)
        assert head[2, 1] == 0x8000 and head[3, 1] == 0x8000                 # minimum -0 where a -0 is
        assert head[4, 0] == 0xFC00 and head[4, 1] == 0xFBFF                 # all -inf: d = -inf, m = -65504
        assert not rows[4, 4:].any() and np.isnan(back[4]).all()
    assert np.array_equal(rows.reshape(1, -1), ref_encode(kind, block, x.reshape(1, -1)))


def test_blocks_have_the_ggml_layout() -> None:
    q8, q4 = kv_format("q8"), kv_format("q4")
    assert isinstance(q8, QuantFormat) and isinstance(q4, QuantFormat)
    x = np.arange(-16, 16, dtype=np.float32)[None] * np.float32(0.5)   # max |x| = 8 -> d = 8/127 (fp16)
    rows = q8.encode_array(x)
    d = np.float16(np.float32(8) / np.float32(127))
    assert rows.shape == (1, 34) and rows[0, :2].copy().view("<f2")[0] == d     # d first, little-endian
    assert rows[0, 2:].view(np.int8).tolist() == np.rint(x[0] * (np.float32(1) / np.float32(d))).tolist()
    rows = q4.encode_array(np.arange(32, dtype=np.float32)[None] % 16)  # d = 1, m = 0: codes are the values
    assert rows[0, :4].copy().view("<f2").tolist() == [1.0, 0.0]
    assert rows[0, 4:].tolist() == [j | (j << 4) for j in range(16)]     # value j low, value j + 16 high


@pytest.mark.parametrize("kind", ["q8", "q4"])
def test_strided_arrays_and_outputs(kind: str) -> None:
    """Heads-first K/V seen tokens-first, a head_dim slice, a transposed head_dim and an output with room."""
    f = fmt_of(kind, 16)
    heads_first = kv_values(7, 2 * 3, 5, 64, 16).reshape(2, 3, 5, 64)     # [batch, kv_heads, tokens, hd]
    x = heads_first.transpose(2, 0, 1, 3)                                # tokens first: strided heads
    want = ref_encode(kind, 16, np.ascontiguousarray(x).reshape(5, -1))
    assert np.array_equal(f.encode_array(x), want)
    wide = np.zeros((5, 2, 3, 80), np.float32)
    wide[..., :64] = x
    assert np.array_equal(f.encode_array(wide[..., :64]), want)          # heads 80 values apart
    assert np.array_equal(f.encode_array(np.asfortranarray(x)), want)   # no view of [n, heads, hd]: a copy
    slot = np.zeros((5, want.shape[1] + 10), np.uint8)                   # rows of a wider slot: a run per row
    f.encode_array(x, out=slot[:, : want.shape[1]])
    assert np.array_equal(slot[:, : want.shape[1]], want) and not slot[:, want.shape[1]:].any()
    out = np.full((9, 2, 3, 64), 7.0, np.float16)                        # 5 tokens and room for 4
    f.decode_array(want, "float16", out=out[:5])
    assert_same_bits(out[:5].reshape(5, -1), to_elements(ref_decode(kind, 16, want), "float16"))
    assert (out[5:] == 7.0).all()
    t_out = np.full((2, 3, 9, 64), 7.0, np.float32)                       # heads-first with room
    f.decode_array(want, "float32", out=t_out[:, :, :5].transpose(2, 0, 1, 3))
    assert_same_bits(t_out[:, :, :5].transpose(2, 0, 1, 3).reshape(5, -1), ref_decode(kind, 16, want))
    assert (t_out[:, :, 5:] == 7.0).all()
    odd = np.zeros((64, 5), np.float32).T                                # no view with contiguous heads
    f.decode_array(want[:, : f.row_bytes(1, 64)], "float32", out=odd)
    assert_same_bits(odd, ref_decode(kind, 16, want[:, : f.row_bytes(1, 64)]))


@pytest.mark.parametrize("threads", [1, 2, 3, 16])
def test_threads_split_the_rows_into_the_same_bytes(threads: int) -> None:
    f = fmt_of("q4", 32)
    x = to_elements(kv_values(3, 37, 4, 64, 32), "float16")
    want = ref_encode("q4", 32, x.astype(np.float32).reshape(37, -1))
    rows = f.encode_array(x, threads=threads)
    assert np.array_equal(rows, want)
    assert_same_bits(f.decode_array(rows, threads=threads), to_elements(ref_decode("q4", 32, want), "float16"))


def test_bad_input_is_refused_in_one_line() -> None:
    q8 = fmt_of("q8", 32)
    cases = [
        (lambda: q8.encode_array(np.zeros((2, 64), np.float64)), "float64"),
        (lambda: q8.encode_array(np.zeros((2, 64), np.uint16)), "elements='bfloat16'"),
        (lambda: q8.encode_array(np.zeros(64, np.float32)), "[tokens, ..., head_dim]"),
        (lambda: q8.encode_array(np.zeros((2, 80), np.float32)), "head_dim 80"),
        (lambda: q8.encode_array(np.zeros((2, 64), np.float32), out=np.zeros((2, 67), np.uint8)), "[2, 68]"),
        (lambda: q8.decode_array(np.zeros((2, 33), np.uint8)), "k*34"),
        (lambda: q8.decode_array(np.zeros((2, 34), np.uint8), "float64"), "'float64'"),
        (lambda: q8.decode_array(np.zeros((2, 34), np.uint8), "float32", (3, 32)), "(3, 32)"),
        (lambda: q8.decode_array(np.zeros((2, 34), np.uint8), out=np.zeros((2, 32), np.float32)), "float16"),
        (lambda: q8.encode_array(np.zeros((2, 64), np.float32), threads=0), "threads"),
    ]
    for call, part in cases:
        with pytest.raises(KVFormatError) as e:
            call()
        assert part in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_empty_rows() -> None:
    q4 = fmt_of("q4", 32)
    assert q4.encode_array(np.zeros((0, 3, 64), np.float32)).shape == (0, 120)
    assert q4.decode_array(np.zeros((0, 120), np.uint8), "float32").shape == (0, 192)
