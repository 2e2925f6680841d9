"""The q8 / q4 codec's tests, shared (no torch: the arm64 suites load it): K/V values that reach every branch of
the codec, and a numpy reference of the formats' arithmetic (bladed/kvformat.py's torch encoder, step by
step, with the C codec's documented choices where torch leaves the bits open: docs/kv-formats.md).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import numpy as np

from bladed.kvformat import ISA_ENV, codec_info

FP16_MAX = np.float32(65504.0)
QNAN = np.uint16(0x7E00)
#: block sizes the tests draw (any even size divides some head_dim)
BLOCKS = (2, 4, 6, 8, 16, 32, 64, 128)
#: fp16 magnitudes around a q8 scale that rounds to an fp16 subnormal (amax / 127 < 2**-14) or to zero
SUBNORMAL_AMAX = (127 * 2.0 ** -24, 127 * 2.0 ** -20, 127 * 2.0 ** -15, 1.5 * 2.0 ** -24)


def isas() -> list[str]:
    """The builds of the C loops this CPU runs (portable, and avx2 where it has AVX2 + F16C)."""
    return list(codec_info()["isas"])


@contextlib.contextmanager
def isa(name: str) -> Iterator[None]:
    """Run the C codec's ``name`` build inside (``BLADED_CODEC_ISA``)."""
    old = os.environ.get(ISA_ENV)
    os.environ[ISA_ENV] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ISA_ENV, None)
        else:
            os.environ[ISA_ENV] = old


def kv_values(seed: int, tokens: int, heads: int, head_dim: int, block: int, log_scale: float = 0.0,
              offset: float = 0.0, special: bool = True) -> np.ndarray:
    """float32 ``[tokens, heads, head_dim]``, each block one of: Gaussian (``10**log_scale`` scale, ``offset`` in
    scales; most blocks), constant, zeros of either sign, exact ties of the rounding (values ``(k + 1/2) * 2**e``
    with the block's step ``2**e``), magnitudes whose q8 scale is an fp16 subnormal, raw random bits (NaN
    payloads, infinities, float32 subnormals) or Gaussian with NaN / +-inf / +-65504 sprinkled in."""
    rng = np.random.default_rng(seed)
    scale = 10.0 ** log_scale
    x = (rng.standard_normal((tokens, heads, head_dim)) * scale + offset * scale).astype(np.float32)
    blocks = x.reshape(-1, block)
    modes = rng.choice(8, size=blocks.shape[0], p=[0.5, 0.07, 0.07, 0.07, 0.07, 0.07, 0.1, 0.05] if special
                       else [0.65, 0.1, 0.1, 0.1, 0.05, 0, 0, 0.0])
    for i, mode in enumerate(modes):
        b = blocks[i]
        if mode == 1:                                    # constant
            b[:] = np.float32(rng.standard_normal() * scale)
        elif mode == 2:                                  # zeros, +0 and -0 mixed (or all of one sign)
            b[:] = np.where(rng.random(block) < rng.choice([0.0, 0.5, 1.0]), np.float32(-0.0), np.float32(0.0))
        elif mode == 3:                                  # ties: amax = 127 * 2**e (q8 step exactly 2**e)
            e = int(rng.integers(-20, 8))
            b[:] = (rng.integers(-127, 127, block) + 0.5).astype(np.float32) * np.float32(2.0 ** e)
            b[int(rng.integers(block))] = np.float32(127 * 2.0 ** e) * rng.choice([-1, 1])
        elif mode == 4:                                  # a q8 scale that is an fp16 subnormal, or rounds to 0
            b[:] = (rng.uniform(-1, 1, block) * rng.choice(SUBNORMAL_AMAX)).astype(np.float32)
        elif mode == 5:                                  # any float32 bits
            b[:] = rng.integers(0, 2 ** 32, block, dtype=np.uint64).astype(np.uint32).view(np.float32)
        elif mode == 6:                                  # specials in a Gaussian block
            specials = np.array([np.nan, np.inf, -np.inf, 65504.0, -65504.0, -np.nan], np.float32)
            for _ in range(int(rng.integers(1, 3))):
                b[int(rng.integers(block))] = rng.choice(specials)
        elif mode == 7:                                  # one value throughout but for one other
            b[:] = b[0]
            b[int(rng.integers(block))] = np.float32(rng.standard_normal() * scale)
    return x


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 ``x`` rounded to bfloat16, as uint16 bits (c10's round to nearest even; NaN: 0x7FC0)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), r)


def from_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _key(x: np.ndarray) -> np.ndarray:
    i = x.view(np.int32)
    return i ^ ((i >> 31) & 0x7FFFFFFF)


def _unkey(k: np.ndarray) -> np.ndarray:
    return (k ^ ((k >> 31) & 0x7FFFFFFF)).astype(np.int32).view(np.float32)


def ref_encode(kind: str, block: int, x: np.ndarray) -> np.ndarray:
    """The rows of float32 ``x`` ``[tokens, elements]`` (the exact values of the K/V elements), uint8 ``[tokens,
    row_bytes]``: the torch encoder's steps in float32, and the C codec's choices where torch's bits vary (a
    block's min and max in the order -0 < +0; a NaN block's scale and minimum 0x7E00, its codes 0; codes 0 where
    the inverse step is 0)."""
    n, elems = x.shape
    xb = np.ascontiguousarray(x, np.float32).reshape(n, elems // block, block)
    keys = _key(xb)
    lo, hi = _unkey(keys.min(-1)), _unkey(keys.max(-1))
    nan = np.isnan(xb).any(-1)
    with np.errstate(all="ignore"):
        if kind == "q8":
            neg = -lo
            amax = np.where(hi < neg, neg, hi)
            t = amax / np.float32(127)
            m16 = None
        else:
            lo = np.where(lo < -FP16_MAX, -FP16_MAX, np.where(lo > FP16_MAX, FP16_MAX, lo))
            m16 = lo.astype(np.float16)
            m16 = np.where(m16.astype(np.float32) > lo, np.nextafter(m16, np.float16(-np.inf)), m16)
            t = (hi - m16.astype(np.float32)) / np.float32(15)
        d16 = np.where(t > FP16_MAX, FP16_MAX, t).astype(np.float16)
        df = d16.astype(np.float32)
        inv = np.where(nan | ~(df > 0), np.float32(0), np.float32(1) / df).astype(np.float32)
        d_bits = np.where(nan, QNAN, d16.view(np.uint16))
        if kind == "q8":
            y = xb * inv[..., None]
            y = np.where(inv[..., None] == 0, np.float32(0), y)
            codes = np.rint(np.clip(y, -127, 127)).astype(np.int8).view(np.uint8)
            head = [d_bits]
        else:
            assert m16 is not None
            y = (xb - m16.astype(np.float32)[..., None]) * inv[..., None]
            y = np.where(inv[..., None] == 0, np.float32(0), y)
            q = np.rint(np.clip(y, 0, 15)).astype(np.uint8)
            codes = q[..., : block // 2] | (q[..., block // 2:] << 4)
            head = [d_bits, np.where(nan, QNAN, m16.view(np.uint16))]
    parts = [h.astype("<u2")[..., None].view(np.uint8) for h in head] + [codes]
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def ref_decode(kind: str, block: int, rows: np.ndarray) -> np.ndarray:
    """float32 ``[tokens, elements]`` of ``rows`` (the torch decoder: ``q * d``, ``q * d + m`` in two roundings)."""
    bb = 2 + block if kind == "q8" else 4 + block // 2
    r = np.ascontiguousarray(rows).reshape(rows.shape[0], -1, bb)
    d = r[..., 0:2].copy().view("<f2").astype(np.float32)
    with np.errstate(all="ignore"):
        if kind == "q8":
            x = r[..., 2:].view(np.int8).astype(np.float32) * d
        else:
            m = r[..., 2:4].copy().view("<f2").astype(np.float32)
            p = r[..., 4:]
            q = np.concatenate([p & 15, p >> 4], axis=-1).astype(np.float32)
            x = (q * d) + m
    return x.reshape(rows.shape[0], -1).astype(np.float32)


def to_elements(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``x`` in ``dtype`` (bfloat16: uint16 bits), rounded to nearest even."""
    with np.errstate(all="ignore"):
        if dtype == "float32":
            return x.astype(np.float32)
        if dtype == "float16":
            return x.astype(np.float16)
    return to_bf16(x)


def exact_floats(x: np.ndarray, dtype: str) -> np.ndarray:
    """The float32 values of elements ``x`` of ``dtype`` (bfloat16: uint16 bits)."""
    return from_bf16(x) if dtype == "bfloat16" else x.astype(np.float32)


def assert_same_bits(a: np.ndarray, b: np.ndarray, what: str = "") -> None:
    """Equal bit for bit, but that any NaN matches any NaN (payloads are not specified)."""
    fa, fb = a.astype(np.float32) if a.dtype != np.uint16 else from_bf16(a), \
        b.astype(np.float32) if b.dtype != np.uint16 else from_bf16(b)
    nan = np.isnan(fa)
    assert np.array_equal(nan, np.isnan(fb)), f"{what}: NaN at different places"
    ia, ib = a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}")
    bad = (ia != ib) & ~nan
    assert not bad.any(), f"{what}: {int(bad.sum())} values differ, first at {np.argwhere(bad)[0].tolist()}: " \
                          f"{a[tuple(np.argwhere(bad)[0])]} vs {b[tuple(np.argwhere(bad)[0])]}"
