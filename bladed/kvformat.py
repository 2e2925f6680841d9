"""KV storage formats: how one token row of a KPU is turned into bytes and back.

bladed stores each layer's K and V as rows of bytes, one row per token: the row holds that token's
``B*H*D`` elements (``[batch, kv_heads, head_dim]``, row-major; ``Geometry.row_elems``). A format
maps such rows to bytes (:meth:`KVFormat.encode`) and back (:meth:`KVFormat.decode`) in the
inference process, on the tensor's device (vectorised torch ops: CPU, or CUDA kernels on a GPU);
the daemon only needs :meth:`KVFormat.row_bytes`. Every format keeps a row **self-contained**: a
token's bytes depend on that token's values only, so rows are appended, read, retained and shared
one token at a time exactly as for fp16.

========  ==========================================================  ===================  ===========
name      one row                                                     bytes, H=3 D=64      vs fp16
========  ==========================================================  ===================  ===========
``fp32``  the elements as float32                                     768                  2
``fp16``  the elements as float16                                     384                  1
``bf16``  the elements as bfloat16                                    384                  1
``q8``    ``H*D/32`` blocks of ``{fp16 d; int8 q[32]}``, x = q*d       204                  0.53
``q4``    ``H*D/32`` blocks of ``{fp16 d; fp16 m; u8 qs[16]}``,        120                  0.31
          x = q*d + m, ``qs[j] = q[j] | q[j+16] << 4``
========  ==========================================================  ===================  ===========

``q8`` is symmetric like llama.cpp's ``q8_0`` (``d = max|x| / 127``, ``q = round(x / d)``); ``q4``
is asymmetric like its ``q4_1`` (``m = min x``, ``d = (max x - m) / 15``, ``q = round((x - m) / d)``
in ``0..15``): blocks run along head_dim (32 values each by default, ``q8:<n>`` / ``q4:<n>`` name
another block size) and the byte layout of a block is ggml's, little-endian. Each value comes back
within half a step of its block (``d / 2``; for ``q4`` the stored minimum is rounded down to fp16,
so the bound holds there too). Inputs are expected to lie in fp16's range, as KV does.

Measured with ``tools/bench_kv_accuracy.py`` (SmolLM2-135M, the whole GPL-3 text, past KV stored in
the format and read back; docs/kv-formats.md, docs/bench/kv-accuracy-2026-11-26T1516Z.json): ``q8``
changes perplexity by -0.07% (mean KL 0.0006, top-1 98.7%). ``q4`` alone costs +7.0%; attending to
the newest 128 tokens at full precision from the client's memory (:attr:`KVFormat.full_precision_tail`;
their rows are written all the same) brings it to +0.29%. Keys grouped per channel over 32-token
groups (KIVI) with the same tail measure +0.37% (KL 0.0040 against 0.0060): no clear gain, and they
would make a 32-token group, not a row, the unit of storage, so ``q4`` groups per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:      # the daemon sizes rows with this module and never loads torch; encode/decode import it
    import torch

__all__ = ["FORMATS", "KVFormat", "KVFormatError", "PlainFormat", "Q4Format", "Q8Format", "kv_format", "q4_params",
           "quantize_q4_"]

#: the default block (group) size of the quantized formats, along head_dim
BLOCK = 32
_FP16_MAX = 65504.0


class KVFormatError(ValueError):
    """A KV format name or a geometry a format cannot store (one-line message naming the value)."""


@dataclass(frozen=True)
class KVFormat:
    """One KV storage format. Subclasses: :class:`PlainFormat`, :class:`Q8Format`, :class:`Q4Format`."""

    #: the canonical name (``fp16``, ``q8``, ``q4:64``, ...)
    name: str
    #: values per quantization block along head_dim (1 for the plain formats)
    block: int
    #: the newest tokens the clients (SlotTensors, BladedCache, the runner) attend to at full precision from
    #: their memory instead of their read-back rows (the rows are written all the same), as the accuracy
    #: measurement applied it
    full_precision_tail: ClassVar[int] = 0
    #: whether a row is the elements themselves (fp16, bf16, fp32), not a quantized encoding
    plain: ClassVar[bool] = False

    def check(self, head_dim: int) -> None:
        """Raise :class:`KVFormatError` unless rows of this ``head_dim`` can be stored."""
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
            raise KVFormatError(f"head_dim must be a positive int, got {head_dim!r}")
        if head_dim % self.block:
            raise KVFormatError(
                f"KV format {self.name} quantizes head_dim in blocks of {self.block}, which do not divide "
                f"head_dim {head_dim}; use a format whose block divides it ({_block_hint(head_dim, self)}) "
                "or fp16/bf16/fp32")

    def row_bytes(self, num_heads: int, head_dim: int) -> int:
        """Bytes of one stored token row of ``num_heads`` (``batch * kv_heads``) heads of ``head_dim``."""
        self.check(head_dim)
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
            raise KVFormatError(f"num_heads must be a positive int, got {num_heads!r}")
        return num_heads * head_dim // self.block * self.block_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one stored block of :attr:`block` values."""
        raise NotImplementedError

    @property
    def bits_per_value(self) -> float:
        """Stored bits per K/V element, scales included."""
        return 8 * self.block_bytes / self.block

    def encode(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` of shape ``[tokens, ..., head_dim]`` (one row per token) as uint8 ``[tokens, row_bytes]``.

        Runs on ``x``'s device. With ``out`` (uint8 ``[tokens, row_bytes]``, contiguous rows, e.g. a
        staging slot's rows) the rows are written there and ``out`` is returned.
        """
        raise NotImplementedError

    def decode(self, rows: torch.Tensor, dtype: torch.dtype | None = None,
               shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """uint8 ``rows`` (``[tokens, row_bytes]``) back as ``dtype``: ``[tokens, *shape]``, or
        ``[tokens, elements]`` without ``shape``."""
        raise NotImplementedError

    def _rows_in(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2:
            raise KVFormatError(f"KV to encode must be [tokens, ..., head_dim], got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise KVFormatError(f"KV to encode must be a floating-point tensor, got {x.dtype}")
        self.check(int(x.shape[-1]))
        return x.reshape(x.shape[0], -1)

    def _out(self, out: torch.Tensor | None, n: int, elems: int, device: torch.device) -> torch.Tensor:
        """``[n, blocks, block_bytes]`` uint8 to encode into: ``out``'s memory, or new."""
        import torch

        nb = elems // self.block
        if out is None:
            return torch.empty(n, nb, self.block_bytes, dtype=torch.uint8, device=device)
        want = (n, nb * self.block_bytes)
        if out.dtype != torch.uint8 or tuple(out.shape) != want or out.device != device:
            raise KVFormatError(f"{self.name} encodes these rows into uint8 {list(want)} on {device}, "
                                f"got out {out.dtype} {list(out.shape)} on {out.device}")
        try:
            return out.view(n, nb, self.block_bytes)
        except RuntimeError:
            raise KVFormatError(f"{self.name} encodes into contiguous rows; out has strides {out.stride()}") from None

    def _rows_out(self, rows: torch.Tensor) -> tuple[int, int]:
        """``(tokens, elements per row)`` of encoded ``rows``."""
        import torch

        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] % self.block_bytes:
            raise KVFormatError(
                f"{self.name} rows must be uint8 [tokens, k*{self.block_bytes}], got {rows.dtype} {tuple(rows.shape)}")
        return int(rows.shape[0]), int(rows.shape[1]) // self.block_bytes * self.block

    def _shaped(self, x: torch.Tensor, n: int, elems: int, shape: tuple[int, ...] | None) -> torch.Tensor:
        if shape is None:
            return x.view(n, elems)
        if math.prod(shape) != elems:
            raise KVFormatError(f"row shape {tuple(shape)} has {math.prod(shape)} elements, the rows hold {elems}")
        return x.view(n, *shape)


@dataclass(frozen=True)
class PlainFormat(KVFormat):
    """Identity encodings: the elements in ``dtype``'s own bytes."""

    plain: ClassVar[bool] = True
    #: the torch dtype's name and its element size (no torch needed to size a row)
    dtype_name: str = "float16"
    element_bytes: int = 2

    @property
    def dtype(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype_name)
        return dtype

    @property
    def block_bytes(self) -> int:
        return self.element_bytes

    def encode(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        import torch

        r = self._rows_in(x)
        if out is None:
            return r.to(self.dtype, copy=True).contiguous().view(torch.uint8)
        o = self._out(out, r.shape[0], r.shape[1], x.device)
        o.view(r.shape[0], -1).view(self.dtype).copy_(r)
        return out

    def decode(self, rows: torch.Tensor, dtype: torch.dtype | None = None,
               shape: tuple[int, ...] | None = None) -> torch.Tensor:
        import torch

        dtype = torch.float16 if dtype is None else dtype
        n, elems = self._rows_out(rows)
        x = rows.contiguous().view(self.dtype).to(dtype)
        return self._shaped(x, n, elems, shape)


@dataclass(frozen=True)
class Q8Format(KVFormat):
    """Symmetric int8 in blocks along head_dim with one fp16 scale each (llama.cpp ``q8_0``)."""

    kind: ClassVar[str] = "q8"

    @property
    def block_bytes(self) -> int:
        return 2 + self.block

    def encode(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        import torch

        r = self._rows_in(x)
        n, b = r.shape[0], self.block
        xf = r.reshape(n, -1, b).to(torch.float32, copy=True)
        # two plain reductions: faster on CPU than abs().amax() (no temporary) or vector_norm(inf)
        amax = torch.maximum(xf.amax(-1, keepdim=True), xf.amin(-1, keepdim=True).neg_())
        d = amax.div_(127).clamp_(max=_FP16_MAX).half()
        df = d.float()
        inv = torch.where(df > 0, 1 / df, torch.zeros_like(df))
        o = self._out(out, n, r.shape[1], x.device)
        o[..., :2] = d.view(torch.uint8)
        o[..., 2:].view(torch.int8).copy_(xf.mul_(inv).round_().clamp_(-127, 127))
        return o.view(n, -1) if out is None else out

    def decode(self, rows: torch.Tensor, dtype: torch.dtype | None = None,
               shape: tuple[int, ...] | None = None) -> torch.Tensor:
        import torch

        dtype = torch.float16 if dtype is None else dtype
        n, elems = self._rows_out(rows)
        r = rows.contiguous().view(n, -1, self.block_bytes)
        d = r[..., :2].contiguous().view(torch.float16).float()
        x = r[..., 2:].view(torch.int8).to(torch.float32).mul_(d)
        return self._shaped(x.to(dtype), n, elems, shape)


@dataclass(frozen=True)
class Q4Format(KVFormat):
    """Asymmetric 4-bit in blocks along head_dim with an fp16 scale and minimum each (llama.cpp ``q4_1``)."""

    kind: ClassVar[str] = "q4"
    full_precision_tail: ClassVar[int] = 128

    def check(self, head_dim: int) -> None:
        if isinstance(head_dim, int) and not isinstance(head_dim, bool) and head_dim > 0 and head_dim % 2:
            raise KVFormatError(f"KV format {self.name} packs two values per byte and needs an even head_dim, "
                                f"got head_dim {head_dim}; use fp16/bf16/fp32")
        super().check(head_dim)

    @property
    def block_bytes(self) -> int:
        return 4 + self.block // 2

    def encode(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        import torch

        r = self._rows_in(x)
        n, b = r.shape[0], self.block
        xf = r.reshape(n, -1, b).to(torch.float32, copy=True)
        d, m = q4_params(xf, -1)
        q = quantize_q4_(xf, d, m)
        o = self._out(out, n, r.shape[1], x.device)
        o[..., 0:2] = d.view(torch.uint8)
        o[..., 2:4] = m.view(torch.uint8)
        torch.bitwise_or(q[..., : b // 2], q[..., b // 2:].bitwise_left_shift_(4), out=o[..., 4:])
        return o.view(n, -1) if out is None else out

    def decode(self, rows: torch.Tensor, dtype: torch.dtype | None = None,
               shape: tuple[int, ...] | None = None) -> torch.Tensor:
        import torch

        dtype = torch.float16 if dtype is None else dtype
        n, elems = self._rows_out(rows)
        r = rows.contiguous().view(n, -1, self.block_bytes)
        d = r[..., 0:2].contiguous().view(torch.float16).float()
        m = r[..., 2:4].contiguous().view(torch.float16).float()
        p = r[..., 4:]
        h = self.block // 2
        x = torch.empty(n, r.shape[1], self.block, dtype=torch.float32, device=rows.device)
        x[..., :h] = p & 0x0F
        x[..., h:] = p >> 4
        x.mul_(d).add_(m)
        return self._shaped(x.to(dtype), n, elems, shape)


def q4_params(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 scale ``d`` and minimum ``m`` of ``x``'s groups along ``dim`` (kept as size 1).

    ``m`` is rounded down to fp16 (so ``x - m >= 0``); shared by :class:`Q4Format` and the accuracy
    tool's per-channel variant.
    """
    import torch

    lo = x.amin(dim, keepdim=True).float().clamp_(-_FP16_MAX, _FP16_MAX)
    hi = x.amax(dim, keepdim=True).float()
    m = lo.half()
    m = torch.where(m.float() > lo, torch.nextafter(m, torch.full_like(m, -math.inf)), m)
    d = hi.sub_(m.float()).div_(15).clamp_(max=_FP16_MAX).half()
    return d, m


def quantize_q4_(x: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``0..15`` of float32 ``x`` for fp16 scale ``d`` and minimum ``m`` (broadcast).

    Overwrites ``x`` (its scratch space).
    """
    import torch

    df = d.float()
    inv = torch.where(df > 0, 1 / df, torch.zeros_like(df))
    return x.sub_(m.float()).mul_(inv).round_().clamp_(0, 15).to(torch.uint8)


def _block_hint(head_dim: int, fmt: KVFormat) -> str:
    kind = "q4" if isinstance(fmt, Q4Format) else "q8"
    fits = [f"{kind}:{b}" for b in (8, 16, 32, 64, 128) if head_dim % b == 0]
    return ", ".join(fits) if fits else f"none of {kind}:8..128 does"


#: the formats by canonical name (default block sizes)
FORMATS: dict[str, KVFormat] = {
    "fp16": PlainFormat("fp16", 1, "float16", 2),
    "bf16": PlainFormat("bf16", 1, "bfloat16", 2),
    "fp32": PlainFormat("fp32", 1, "float32", 4),
    "q8": Q8Format("q8", BLOCK),
    "q4": Q4Format("q4", BLOCK),
}
_ALIASES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32"}
_KNOWN = "fp16, bf16, fp32, q8, q4 (q8:<block>, q4:<block> for another block size)"


def kv_format(spec: str | KVFormat) -> KVFormat:
    """The format named ``spec`` (``fp16``, ``bf16``, ``fp32``, ``q8``, ``q4``, ``q8:64``, ``torch.float16``...).

    Raises :class:`KVFormatError` naming the value and the known names.
    """
    if isinstance(spec, KVFormat):
        return spec
    if not isinstance(spec, str):
        raise KVFormatError(f"a KV format is named by a string, got {type(spec).__name__} {spec!r}; known are {_KNOWN}")
    name = spec.strip().lower().removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name in FORMATS:
        return FORMATS[name]
    kind, sep, size = name.partition(":")
    if sep and kind in ("q8", "q4"):
        cls: type[Q8Format] | type[Q4Format] = Q8Format if kind == "q8" else Q4Format
        if not size.isdigit() or int(size) < 2 or int(size) > 4096 or int(size) % 2:
            raise KVFormatError(f"block size of KV format {spec!r} must be an even number from 2 to 4096, got {size!r}")
        block = int(size)
        return cls(kind if block == BLOCK else f"{kind}:{block}", block)
    raise KVFormatError(f"unknown KV format {spec!r}; known are {_KNOWN}")
