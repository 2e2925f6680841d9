"""KV storage formats (bladed.kvformat): round trips, error bounds, row sizes, self-contained rows, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bladed.kvformat import FORMATS, KVFormat, KVFormatError, Q4Format, Q8Format, kv_format

NAMES = ("fp16", "bf16", "fp32", "q8", "q4")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def kv(tokens: int = 7, heads: int = 3, head_dim: int = 64, scale: float = 2.0, seed: int = 0,
       dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """Random K/V rows ``[tokens, heads, head_dim]`` with a few outlier channels, as real keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, head_dim, generator=g) * scale
    x[..., ::17] *= 8
    return x.to(dtype).to(device)


def blocks(fmt: KVFormat, rows: torch.Tensor) -> torch.Tensor:
    return rows.view(rows.shape[0], -1, fmt.block_bytes)


def scales(fmt: KVFormat, rows: torch.Tensor) -> torch.Tensor:
    """The fp16 step ``d`` of every block, as float32 ``[tokens, blocks, 1]``."""
    return blocks(fmt, rows)[..., 0:2].contiguous().view(torch.float16).float()


def minimums(fmt: KVFormat, rows: torch.Tensor) -> torch.Tensor:
    return blocks(fmt, rows)[..., 2:4].contiguous().view(torch.float16).float()


def assert_within_half_step(fmt: KVFormat, x: torch.Tensor) -> None:
    """Every value of ``x`` decodes within half its block's step (float32 rounding allowed)."""
    rows = fmt.encode(x)
    back = fmt.decode(rows, torch.float32, tuple(x.shape[1:]))
    n = x.shape[0]
    err = (back - x.float()).reshape(n, -1, fmt.block).abs()
    bound = scales(fmt, rows) / 2 + 1e-6 * x.float().reshape(n, -1, fmt.block).abs() + 1e-30
    assert bool((err <= bound).all()), f"{fmt.name}: worst error/step {(err / scales(fmt, rows)).max():.4f}"


# --- round trips -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_round_trip_keeps_shape_dtype_and_device(name: str, dtype: torch.dtype, device: str) -> None:
    fmt = kv_format(name)
    x = kv(tokens=5, heads=6, dtype=dtype, device=device).view(5, 2, 3, 64)  # [tokens, batch, kv_heads, head_dim]
    rows = fmt.encode(x)
    assert rows.dtype == torch.uint8 and rows.device == x.device
    assert tuple(rows.shape) == (5, fmt.row_bytes(6, 64))
    back = fmt.decode(rows, dtype, (2, 3, 64))
    assert back.shape == x.shape and back.dtype == dtype and back.device == x.device
    flat = fmt.decode(rows, torch.float32)
    assert tuple(flat.shape) == (5, 2 * 3 * 64)
    assert torch.equal(flat.view(5, 2, 3, 64), fmt.decode(rows, torch.float32, (2, 3, 64)))


@pytest.mark.parametrize("name,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_plain_formats_are_exact_for_their_own_dtype(name: str, dtype: torch.dtype) -> None:
    fmt = kv_format(name)
    x = kv(dtype=dtype)
    assert torch.equal(fmt.decode(fmt.encode(x), dtype, (3, 64)), x)
    assert torch.equal(fmt.encode(x).view(dtype).view_as(x), x)  # the bytes are the elements themselves


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_q8_error_is_at_most_half_a_step(dtype: torch.dtype, device: str) -> None:
    fmt = kv_format("q8")
    x = kv(tokens=33, dtype=dtype, device=device)
    assert_within_half_step(fmt, x)
    # the step is the block's max |x| / 127, rounded to fp16 (llama.cpp's q8_0)
    amax = x.float().reshape(33, -1, 32).abs().amax(-1, keepdim=True)
    assert torch.allclose(scales(fmt, fmt.encode(x)), amax / 127, rtol=2 ** -10)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_q4_error_is_at_most_half_a_step(dtype: torch.dtype, device: str) -> None:
    fmt = kv_format("q4")
    x = kv(tokens=33, dtype=dtype, device=device) + 1.5  # off-centre: the minimum matters
    assert_within_half_step(fmt, x)
    rows = fmt.encode(x)
    lo = x.float().reshape(33, -1, 32).amin(-1, keepdim=True)
    hi = x.float().reshape(33, -1, 32).amax(-1, keepdim=True)
    assert bool((minimums(fmt, rows) <= lo).all())  # the stored minimum never exceeds the block's
    assert torch.allclose(scales(fmt, rows), (hi - lo) / 15, rtol=2 ** -9, atol=1e-3)


def test_zero_and_constant_rows_come_back_exactly() -> None:
    z = torch.zeros(4, 3, 64)
    for name in NAMES:
        fmt = kv_format(name)
        assert torch.equal(fmt.decode(fmt.encode(z), torch.float32, (3, 64)), z), name
    c = torch.full((4, 3, 64), -0.75)  # representable in fp16: q4's minimum holds it exactly
    q4 = kv_format("q4")
    assert torch.equal(q4.decode(q4.encode(c), torch.float32, (3, 64)), c)


@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(1, 6), heads=st.integers(1, 4), head_dim=st.sampled_from([32, 64, 96, 128]),
       log_scale=st.floats(-3, 3), offset=st.floats(-50, 50), seed=st.integers(0, 2 ** 16),
       name=st.sampled_from(["q8", "q4", "q8:16", "q4:16", "q4:64"]),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
def test_round_trip_error_bound_property(tokens: int, heads: int, head_dim: int, log_scale: float, offset: float,
                                         seed: int, name: str, dtype: torch.dtype) -> None:
    fmt = kv_format(name)
    if head_dim % fmt.block:
        return
    x = (kv(tokens, heads, head_dim, scale=10 ** log_scale, seed=seed) + offset * 10 ** log_scale).to(dtype)
    assert_within_half_step(fmt, x)


# --- row sizes and layout --------------------------------------------------------------------------------

@pytest.mark.parametrize("heads,head_dim,sizes", [
    (3, 64, {"fp16": 384, "bf16": 384, "fp32": 768, "q8": 204, "q4": 120}),         # SmolLM2-135M
    (32, 128, {"fp16": 8192, "bf16": 8192, "fp32": 16384, "q8": 4352, "q4": 2560}),  # OPT-6.7B
])
def test_row_bytes_as_documented(heads: int, head_dim: int, sizes: dict[str, int]) -> None:
    for name, size in sizes.items():
        fmt = kv_format(name)
        assert fmt.row_bytes(heads, head_dim) == size, name
        assert fmt.encode(torch.zeros(2, heads, head_dim)).shape[1] == size, name
    # per value: 16, 16, 32, 8.5 (int8 + an fp16 scale per 32), 5 (4 bits + fp16 scale and minimum per 32)
    assert [FORMATS[n].bits_per_value for n in NAMES] == [16, 16, 32, 8.5, 5]
    assert kv_format("q8:64").row_bytes(heads, head_dim) == heads * head_dim // 64 * 66


def test_blocks_have_ggml_q8_0_and_q4_1_layout() -> None:
    q8, q4 = kv_format("q8"), kv_format("q4")
    block = bytearray(torch.tensor([0.5], dtype=torch.float16).view(torch.uint8).tolist())
    block += bytes((i - 16) & 0xFF for i in range(32))  # int8 -16..15
    x = q8.decode(torch.tensor(list(block), dtype=torch.uint8)[None], torch.float32)
    assert x[0].tolist() == [0.5 * (i - 16) for i in range(32)]
    hdr = torch.tensor([2.0, -3.0], dtype=torch.float16).view(torch.uint8).tolist()  # d, m
    qs = [(j % 16) | ((15 - j % 16) << 4) for j in range(16)]  # value j in the low nibble, value j+16 in the high
    x = q4.decode(torch.tensor(hdr + qs, dtype=torch.uint8)[None], torch.float32)
    codes = list(range(16)) + [15 - j for j in range(16)]
    assert x[0].tolist() == [2.0 * c - 3.0 for c in codes]


def test_rows_are_self_contained() -> None:
    x = kv(tokens=9)
    for name in NAMES:
        fmt = kv_format(name)
        rows = fmt.encode(x)
        for i in range(x.shape[0]):
            assert torch.equal(fmt.encode(x[i:i + 1])[0], rows[i]), (name, i)
        y = x.clone()
        y[4] *= 1000  # one token changes: no other row's bytes do
        other = fmt.encode(y)
        keep = [i for i in range(9) if i != 4]
        assert torch.equal(other[keep], rows[keep]), name


def test_encode_into_a_slot_writes_only_those_rows() -> None:
    x = kv(tokens=4)
    for name in NAMES:
        fmt = kv_format(name)
        slot = torch.zeros(10, fmt.row_bytes(3, 64), dtype=torch.uint8)
        assert fmt.encode(x, out=slot[3:7]).data_ptr() == slot[3].data_ptr()
        assert torch.equal(slot[3:7], fmt.encode(x))
        assert not slot[:3].any() and not slot[7:].any()
        with pytest.raises(KVFormatError, match=r"\[4, \d+\]"):
            fmt.encode(x, out=slot[3:6])


# --- names and bad input ---------------------------------------------------------------------------------

def test_names_and_aliases() -> None:
    assert kv_format("fp16") is FORMATS["fp16"]
    assert kv_format("float16").name == kv_format("torch.float16").name == kv_format(" FP16 ").name == "fp16"
    assert kv_format("bfloat16").name == "bf16" and kv_format("float32").name == "fp32"
    assert kv_format("q8:32") == kv_format("q8") and kv_format("q8:64").name == "q8:64"
    assert isinstance(kv_format("q4:16"), Q4Format) and isinstance(kv_format("q8"), Q8Format)
    assert kv_format(FORMATS["q4"]) is FORMATS["q4"]
    assert [FORMATS[n].plain for n in NAMES] == [True, True, True, False, False]
    assert [FORMATS[n].full_precision_tail for n in NAMES] == [0, 0, 0, 0, 128]


def one_line_error(call: object, *args: object) -> str:
    with pytest.raises(KVFormatError) as e:
        call(*args)  # type: ignore[operator]
    msg = str(e.value)
    assert isinstance(e.value, ValueError) and "\n" not in msg and msg
    return msg


@pytest.mark.parametrize("spec", ["q3", "int8", "fp8", "q8:", "q8:7", "q4:x", ""])
def test_unknown_format_is_refused_naming_it(spec: str) -> None:
    msg = one_line_error(kv_format, spec)
    assert repr(spec) in msg
    assert "fp16" in msg or "block size" in msg


def test_block_that_does_not_divide_head_dim_is_refused() -> None:
    for name in ("q8", "q4"):
        msg = one_line_error(kv_format(name).row_bytes, 32, 80)
        assert "80" in msg and "32" in msg and f"{name}:16" in msg  # names the value, the block, what fits
        one_line_error(kv_format(name).encode, torch.zeros(2, 3, 80))
    assert kv_format("q8:16").row_bytes(32, 80) == 32 * 5 * 18


def test_q4_with_odd_head_dim_is_refused() -> None:
    msg = one_line_error(kv_format("q4").row_bytes, 8, 63)
    assert "63" in msg and "even" in msg
    one_line_error(kv_format("q4").encode, torch.zeros(2, 3, 63))


def test_bad_shapes_and_rows_are_refused() -> None:
    q8 = kv_format("q8")
    assert "head_dim" in one_line_error(q8.row_bytes, 3, 0)
    assert "num_heads" in one_line_error(q8.row_bytes, 0, 64)
    one_line_error(q8.encode, torch.zeros(64))                              # no token axis
    one_line_error(q8.encode, torch.zeros(2, 64, dtype=torch.int32))        # not floating point
    one_line_error(q8.decode, torch.zeros(2, 33, dtype=torch.uint8))        # not whole blocks
    one_line_error(q8.decode, torch.zeros(2, 34, dtype=torch.int8))         # not bytes
    rows = q8.encode(torch.zeros(2, 3, 64))
    assert "(2, 64)" in one_line_error(q8.decode, rows, torch.float32, (2, 64))  # shape of the wrong size
    assert math.prod((3, 64)) == q8.decode(rows, torch.float32, (3, 64))[0].numel()
