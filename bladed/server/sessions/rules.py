"""The request rulebook: what a request may address, checked before anything runs.

Every way in (JSON ``read``/``write``, binary I/O frames, a retained prefix's copy) goes through
:func:`check_ranges`; the C lane's checks (``cffi_build/bladed_lane.c``) are a pre-filter of these rules
for the ranges it serves itself, and send anything else here.  Must not touch storage or locks.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

from bladed.protocol import MIRROR, ErrorCode, IOOp, IORange, RequestError, get_field
from bladed.residency.geometry import GEOMETRY_FIELDS, Geometry, tensor_id, tensor_of
from bladed.residency.planner import Mode
from bladed.sizes import align_up

#: the open_session reply lists every KPU (2 per layer, at most 164 bytes each): 2048 layers keep the worst-case
#: reply at about 698 KB, 67% of MAX_FRAME_BYTES (docs/protocol.md, "Limits")
MAX_LAYERS = 2048


def open_geometry(body: dict[str, Any]) -> tuple[Geometry, Mode]:
    """An ``open_session`` request's geometry and mode."""
    raw = get_field(body, "geometry", dict)
    dims = {k: get_field(raw, k, int, minimum=1, maximum=MAX_LAYERS if k == "layers" else None,
                         prefix="geometry.") for k in GEOMETRY_FIELDS}
    fmt = get_field(raw, "kv_format", str, default="", prefix="geometry.")
    try:
        geometry = Geometry(**dims, kv_format=fmt)
    except (TypeError, ValueError) as e:
        raise RequestError(ErrorCode.BAD_REQUEST, f"bad geometry: {e}") from None
    try:
        mode = Mode.parse(get_field(body, "mode", str, default="dualblade"))
    except ValueError as e:
        raise RequestError(ErrorCode.BAD_REQUEST, f"field 'mode': {e}") from None
    return geometry, mode


def open_staging(body: dict[str, Any], geometry: Geometry, max_channels: int, max_staging_bytes: int,
                 align: int) -> tuple[int, int, int, int]:
    """An ``open_session`` request's channels, slot bytes, slot stride (``align``-ed) and staging bytes."""
    channels = get_field(body, "channels", int, minimum=1, maximum=max_channels)
    slot_bytes = get_field(body, "slot_bytes", int, default=geometry.kpu_bytes, minimum=geometry.kpu_bytes)
    stride = align_up(slot_bytes, align)
    staging_bytes = get_field(body, "staging_bytes", int, default=channels * stride, minimum=1)
    if staging_bytes < channels * stride or staging_bytes % align:
        raise RequestError(ErrorCode.BAD_REQUEST,
                           f"staging_bytes {staging_bytes} must be a multiple of {align} and hold "
                           f"{channels} slots of {stride} bytes (slot_bytes {slot_bytes})")
    if staging_bytes > max_staging_bytes:
        # the daemon maps and pins (registers) this memory: bound what one request can make it hold
        raise RequestError(ErrorCode.BAD_REQUEST,
                           f"staging of {staging_bytes} bytes exceeds io.max_staging_bytes "
                           f"({max_staging_bytes}); use fewer channels or a smaller geometry")
    return channels, slot_bytes, stride, staging_bytes


class CheckedRange(NamedTuple):
    """A range that passed :func:`check_ranges`: where it lands in its KPU and in the slot."""

    range: IORange
    kpu_offset: int
    nbytes: int
    slot_offset: int


def json_range(geometry: Geometry, op: str, body: dict[str, Any]) -> tuple[int, IORange]:
    """A JSON ``read``/``write`` request as (channel, range)."""
    g = geometry
    layer = get_field(body, "layer", int)
    kind = get_field(body, "kind", str)
    ch = get_field(body, "channel", int)
    start = get_field(body, "token_start", int, default=0)
    if not 0 <= layer < g.layers:
        raise RequestError(ErrorCode.OUT_OF_RANGE, f"layer {layer} outside 0..{g.layers - 1}")
    if kind not in ("k", "v"):
        raise RequestError(ErrorCode.OUT_OF_RANGE, f"kind must be 'k' or 'v', got {kind!r}")
    if not 0 <= start < g.max_tokens:
        raise RequestError(ErrorCode.OUT_OF_RANGE, f"token_start {start} outside 0..{g.max_tokens - 1}")
    n = get_field(body, "ntokens", int, default=g.max_tokens - start)
    return ch, IORange(IOOp.WRITE if op == "write" else IOOp.READ, tensor_id(layer, kind), start, n)


def check_channel(index: int, channels: int) -> None:
    """A request names one of the session's channels."""
    if not 0 <= index < channels:
        raise RequestError(ErrorCode.OUT_OF_RANGE, f"channel {index} outside 0..{channels - 1}")


def check_ranges(geometry: Geometry, slot_bytes: int, ranges: Sequence[IORange], limit: int) -> list[CheckedRange]:
    """Every range of a request checked before any runs; the first bad one refuses the whole request.

    A KPU may be named more than once (protocol 6: a sparse read's runs of pages in one request, submitted
    together) when its ranges' tokens are apart: two that overlap would leave the result to their order."""
    g = geometry
    tb, ntensors, max_tokens = g.token_bytes, 2 * g.layers, g.max_tokens
    n = len(ranges)
    if n > limit:
        raise RequestError(ErrorCode.BAD_REQUEST, f"a request of {n} ranges exceeds "
                                                  f"io.max_outstanding ({limit}); split it")
    out = []
    for i, r in enumerate(ranges):
        tid, t0, nt = r.tensor_id, r.token_start, r.ntokens
        nbytes = nt * tb
        so = t0 * tb if r.slot_offset == MIRROR else r.slot_offset
        if not 0 <= tid < ntensors or nt < 1 or t0 + nt > max_tokens or so + nbytes > slot_bytes:
            _refuse_range(g, slot_bytes, i, n, r, so, nbytes)
        out.append(CheckedRange(r, t0 * tb, nbytes, so))
    if n > 1:
        tokens = sorted((r.tensor_id, r.token_start, r.token_start + r.ntokens, i) for i, r in enumerate(ranges))
        for (t1, _, e1, i1), (t2, s2, _, i2) in itertools.pairwise(tokens):
            if t1 == t2 and s2 < e1:
                first, second = min(i1, i2), max(i1, i2)
                layer, kind = tensor_of(t1)
                raise RequestError(ErrorCode.BAD_REQUEST, f"ranges {first} and {second} of layer {layer} "
                                                          f"{kind.upper()} overlap in its tokens; give one "
                                                          "KPU's ranges apart")
        spans = sorted((c.slot_offset, c.slot_offset + c.nbytes, i) for i, c in enumerate(out))
        for (_, e1, i1), (s2, _, i2) in itertools.pairwise(spans):
            if s2 < e1:
                raise RequestError(ErrorCode.BAD_REQUEST, f"ranges {min(i1, i2)} and {max(i1, i2)} overlap in the "
                                                          "staging slot; give them disjoint slot offsets")
    return out


def _refuse_range(g: Geometry, slot_bytes: int, i: int, n: int, r: IORange, so: int, nbytes: int) -> None:
    """The RequestError for range ``i`` of ``n`` that :func:`check_ranges` found bad, naming it."""
    where = f"range {i}" if n > 1 else "the range"
    layer, kind = tensor_of(r.tensor_id)
    if not 0 <= r.tensor_id < 2 * g.layers:
        raise RequestError(ErrorCode.OUT_OF_RANGE, f"{where}: layer {layer} {kind.upper()} (tensor "
                                                   f"{r.tensor_id}) outside the session's layers "
                                                   f"0..{g.layers - 1}")
    end = r.token_start + r.ntokens
    if r.ntokens < 1 or end > g.max_tokens:
        raise RequestError(ErrorCode.OUT_OF_RANGE, f"{where}: tokens [{r.token_start}, {end}) outside the "
                                                   f"KPU's 0..{g.max_tokens} tokens")
    raise RequestError(ErrorCode.OUT_OF_RANGE, f"{where}: slot bytes [{so}, {so + nbytes}) outside the "
                                               f"channel's {slot_bytes}-byte slot")


__all__ = ["MAX_LAYERS", "CheckedRange", "check_channel", "check_ranges", "json_range", "open_geometry", "open_staging"]
