"""KV storage formats: how one token row of a KPU is turned into bytes and back.

bladed stores each layer's K and V as rows of bytes, one row per token: the row holds that token's
``B*H*D`` elements (``[batch, kv_heads, head_dim]``, row-major; ``Geometry.row_elems``). A format
maps such rows to bytes (:meth:`KVFormat.encode`) and back (:meth:`KVFormat.decode`) in the
inference process, on the tensor's device (``q8`` / ``q4``: C on the CPU, torch ops elsewhere; below);
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

**The codec, by device.** ``q8`` and ``q4`` encode and decode CPU tensors of float32, float16 or bfloat16 in C
(``bladed._codec``, ``cffi_build/bladed_codec.c``: vectorised loops, threads over rows for large tensors),
anything else (CUDA tensors, other dtypes) with the torch ops, which stay the reference. The two write the
same rows and decode them to the same values, bit for bit, but where torch's own bits depend on its code
path: a block holding a NaN (it decodes to NaN whatever its bytes; C writes its scale, and ``q4``'s minimum,
as the quiet NaN ``0x7E00`` and its codes as 0), a ``q4`` block of only ``-inf`` (NaN too; C's codes 0), the
sign of a zero scale or minimum (C: a ``q8`` scale is ``-0`` only for a block of ``-0``, a ``q4`` minimum is
``-0`` where the block's smallest value is a zero and one of its zeros is ``-0``; decoded values differ at
most in the sign of a ``q8`` block's zeros), and the payload of a NaN decoded. docs/kv-formats.md, *The
CPU codec*, has the details and the tests. ``codec="torch"`` (or ``BLADED_KV_CODEC=torch`` in the
environment) takes the torch path, ``codec="c"`` refuses to fall back to it. Without ``bladed._codec`` built
the quantized formats run on torch; without torch the module imports all the same (the daemon sizes rows
with it). ``threads`` (default: ``BLADED_CODEC_THREADS``, else torch's intra-op threads) caps the C codec's
threads, one per :data:`CODEC_THREAD_MIN_VALUES` values. :meth:`QuantFormat.encode_array` and
:meth:`QuantFormat.decode_array` run the C codec on numpy arrays, without torch.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:      # the daemon sizes rows with this module and never loads torch; encode/decode import it
    import numpy as np
    import torch

__all__ = ["CODEC_THREAD_MIN_VALUES", "FORMATS", "KVFormat", "KVFormatError", "PlainFormat", "Q4Format", "Q8Format",
           "QuantFormat", "codec_info", "kv_format", "q4_params", "quantize_q4_"]

#: the default block (group) size of the quantized formats, along head_dim
BLOCK = 32
_FP16_MAX = 65504.0
#: values per thread of the C codec: a tensor of fewer than ``2 * CODEC_THREAD_MIN_VALUES`` values is coded on
#: the caller's thread alone (starting a thread costs tens of microseconds)
CODEC_THREAD_MIN_VALUES = 1 << 18
#: the environment's choices: the codec (auto, c, torch), the C codec's threads, its build (auto, portable, avx2)
CODEC_ENV, THREADS_ENV, ISA_ENV = "BLADED_KV_CODEC", "BLADED_CODEC_THREADS", "BLADED_CODEC_ISA"
_CODECS = ("auto", "c", "torch")
_ISAS = ("portable", "avx2")                      # enum bd_codec_isa
_ELEMENTS = ("float32", "float16", "bfloat16")    # enum bd_codec_elem


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

    def encode(self, x: torch.Tensor, out: torch.Tensor | None = None, *, codec: str | None = None,
               threads: int | None = None) -> torch.Tensor:
        """``x`` of shape ``[tokens, ..., head_dim]`` (one row per token) as uint8 ``[tokens, row_bytes]``.

        Runs on ``x``'s device. With ``out`` (uint8 ``[tokens, row_bytes]``, contiguous rows, e.g. a
        staging slot's rows) the rows are written there and ``out`` is returned. ``codec`` (``auto``, ``c``,
        ``torch``) and ``threads``: the quantized formats' codec (module docstring); plain rows have none.
        """
        raise NotImplementedError

    def decode(self, rows: torch.Tensor, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None,
               *, out: torch.Tensor | None = None, codec: str | None = None,
               threads: int | None = None) -> torch.Tensor:
        """uint8 ``rows`` (``[tokens, row_bytes]``) back as ``dtype``: ``[tokens, *shape]``, or
        ``[tokens, elements]`` without ``shape``.

        With ``out`` (floating, ``tokens`` rows of the row's elements, on ``rows``' device, any strides: e.g.
        the first tokens of a larger tensor) the values are written there in ``out``'s dtype, and ``out`` is
        returned; ``dtype`` and ``shape``, if given, must be ``out``'s.
        """
        raise NotImplementedError

    def _check_in(self, x: torch.Tensor) -> tuple[int, int]:
        """``(tokens, elements per row)`` of K/V ``x`` to encode."""
        if x.dim() < 2:
            raise KVFormatError(f"KV to encode must be [tokens, ..., head_dim], got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise KVFormatError(f"KV to encode must be a floating-point tensor, got {x.dtype}")
        self.check(int(x.shape[-1]))
        return int(x.shape[0]), math.prod(int(s) for s in x.shape[1:])

    def _rows_in(self, x: torch.Tensor) -> torch.Tensor:
        n, elems = self._check_in(x)
        return x.reshape(n, elems)

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

    def _dest(self, out: torch.Tensor, rows: torch.Tensor, n: int, elems: int, dtype: torch.dtype | None,
              shape: tuple[int, ...] | None) -> torch.dtype:
        """``out``'s dtype, once ``out`` can take the ``n`` decoded rows of ``elems`` values."""
        if (not out.is_floating_point() or out.device != rows.device or (dtype is not None and out.dtype != dtype)
                or out.dim() < 1 or out.shape[0] != n or out.numel() != n * elems
                or (shape is not None and tuple(out.shape[1:]) != tuple(shape))):
            want = f"[{n}, {elems} values]" if shape is None else str([n, *shape])
            raise KVFormatError(f"{self.name} decodes these rows into {want} of {dtype or 'a floating dtype'} on "
                                f"{rows.device}, got out {out.dtype} {list(out.shape)} on {out.device}")
        return out.dtype

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

    def encode(self, x: torch.Tensor, out: torch.Tensor | None = None, *, codec: str | None = None,
               threads: int | None = None) -> torch.Tensor:
        import torch

        r = self._rows_in(x)
        if out is None:
            return r.to(self.dtype, copy=True).contiguous().view(torch.uint8)
        o = self._out(out, r.shape[0], r.shape[1], x.device)
        o.view(r.shape[0], -1).view(self.dtype).copy_(r)
        return out

    def decode(self, rows: torch.Tensor, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None,
               *, out: torch.Tensor | None = None, codec: str | None = None,
               threads: int | None = None) -> torch.Tensor:
        import torch

        n, elems = self._rows_out(rows)
        x = rows.contiguous().view(self.dtype)
        if out is not None:
            self._dest(out, rows, n, elems, dtype, shape)
            return out.copy_(x.view(out.shape))
        return self._shaped(x.to(torch.float16 if dtype is None else dtype), n, elems, shape)


@dataclass(frozen=True)
class QuantFormat(KVFormat):
    """A quantized format (:class:`Q8Format`, :class:`Q4Format`): blocks of :attr:`block` values along head_dim
    with fp16 parameters, coded in C for CPU tensors of float32 / float16 / bfloat16 and with torch otherwise
    (the module docstring says when, and how the two agree)."""

    #: ``q8`` or ``q4``
    kind: ClassVar[str] = ""
    #: enum bd_codec_kind of bladed_codec.h
    _kind_code: ClassVar[int] = 0

    def encode(self, x: torch.Tensor, out: torch.Tensor | None = None, *, codec: str | None = None,
               threads: int | None = None) -> torch.Tensor:
        n, elems = self._check_in(x)
        o = self._out(out, n, elems, x.device)
        if n and self._use_c(codec, x.device, x.dtype):
            self._encode_c(x, o, n, elems, threads)
        elif n:
            self._encode_torch(x.reshape(n, elems), o)
        return o.view(n, elems // self.block * self.block_bytes) if out is None else out

    def decode(self, rows: torch.Tensor, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None,
               *, out: torch.Tensor | None = None, codec: str | None = None,
               threads: int | None = None) -> torch.Tensor:
        import torch

        n, elems = self._rows_out(rows)
        if out is not None:
            dtype = self._dest(out, rows, n, elems, dtype, shape)
        dtype = torch.float16 if dtype is None else dtype
        if n and self._use_c(codec, rows.device, dtype):
            dst = torch.empty(n, elems, dtype=dtype) if out is None else out
            self._decode_c(rows, dst, n, elems, threads)
            return self._shaped(dst, n, elems, shape) if out is None else out
        x = self._decode_torch(rows.contiguous().view(n, elems // self.block, self.block_bytes))
        if out is None:
            return self._shaped(x.to(dtype), n, elems, shape)
        return out.copy_(x.view(out.shape))

    def encode_array(self, x: np.ndarray, out: np.ndarray | None = None, *, elements: str | None = None,
                     threads: int | None = None) -> np.ndarray:
        """The C codec on numpy, no torch: ``x`` ``[tokens, ..., head_dim]`` of float32 or float16 (or bfloat16 as
        uint16 bits, with ``elements="bfloat16"``) as uint8 ``[tokens, row_bytes]``, into ``out`` if given.

        The same rows as :meth:`encode`; KVFormatError where ``bladed._codec`` is not built.
        """
        import numpy as np

        x = np.asarray(x)
        elem = _array_elements(x, elements)
        if x.ndim < 2:
            raise KVFormatError(f"KV to encode must be [tokens, ..., head_dim], got shape {x.shape}")
        hd = int(x.shape[-1])
        self.check(hd)
        n, elems = int(x.shape[0]), math.prod(int(s) for s in x.shape[1:])
        width = elems // self.block * self.block_bytes
        if out is None:
            out = np.empty((n, width), np.uint8)
        elif (out.dtype != np.uint8 or out.shape != (n, width) or not out.flags.writeable
              or (n and width > 1 and out.strides[1] != 1)):
            raise KVFormatError(f"{self.name} encodes these rows into writable uint8 {[n, width]} of contiguous "
                                f"rows, got out {out.dtype} {list(out.shape)} of strides {out.strides}")
        if n:
            src, heads, x_row, x_head = _array_layout(x, n, hd)
            self._c(False, elem, n, heads, hd, src.ctypes.data, x_row, x_head, out.ctypes.data, out.strides[0],
                    _threads(threads, n * elems))
        return out

    def decode_array(self, rows: np.ndarray, dtype: str = "float16", shape: tuple[int, ...] | None = None, *,
                     out: np.ndarray | None = None, threads: int | None = None) -> np.ndarray:
        """The C codec on numpy, no torch: uint8 ``rows`` ``[tokens, row_bytes]`` as ``dtype`` (``float32``,
        ``float16``, or ``bfloat16`` as uint16 bits), ``[tokens, *shape]`` or ``[tokens, elements]``, or into
        ``out`` (any strides). The same values as :meth:`decode`."""
        import numpy as np

        rows = np.asarray(rows)
        bb = self.block_bytes
        if rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape[1] % bb:
            raise KVFormatError(f"{self.name} rows must be uint8 [tokens, k*{bb}], got {rows.dtype} {rows.shape}")
        if dtype not in _ELEMENTS:
            raise KVFormatError(f"{self.name} decodes numpy rows to one of {', '.join(_ELEMENTS)}, got {dtype!r}")
        n, elems = int(rows.shape[0]), int(rows.shape[1]) // bb * self.block
        kind = np.dtype({"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[dtype])
        if shape is not None and math.prod(shape) != elems:
            raise KVFormatError(f"row shape {tuple(shape)} has {math.prod(shape)} elements, the rows hold {elems}")
        if out is None:
            out = np.empty((n, *(shape or (elems,))), kind)
        elif (out.dtype != kind or out.ndim < 1 or out.shape[0] != n or out.size != n * elems
              or not out.flags.writeable or (shape is not None and tuple(out.shape[1:]) != tuple(shape))):
            raise KVFormatError(f"{self.name} decodes these rows into writable {kind} [{n}, {elems} values], got out "
                                f"{out.dtype} {list(out.shape)}")
        if n:
            if rows.strides[1] != 1:
                rows = np.ascontiguousarray(rows)
            last = int(out.shape[-1]) if out.ndim > 1 else elems
            hd = last if last % self.block == 0 else elems
            dst, heads, x_row, x_head = _array_layout(out, n, hd)
            if dst is not out:               # no view of the layout: decode into a copy, then copy it in
                hd, heads, x_row, x_head = elems, 1, elems * kind.itemsize, elems * kind.itemsize
            self._c(True, _ELEMENTS.index(dtype), n, heads, hd, dst.ctypes.data, x_row, x_head, rows.ctypes.data,
                    rows.strides[0], _threads(threads, n * elems))
            if dst is not out:
                out[...] = dst.reshape(out.shape)
        return out

    def _encode_torch(self, r: torch.Tensor, o: torch.Tensor) -> None:
        """The torch encoder (the reference): float rows ``r`` ``[n, elements]`` into ``o`` ``[n, blocks,
        block_bytes]``."""
        raise NotImplementedError

    def _decode_torch(self, r: torch.Tensor) -> torch.Tensor:
        """The torch decoder (the reference): ``r`` ``[n, blocks, block_bytes]`` as float32 ``[n, blocks, block]``."""
        raise NotImplementedError

    def _use_c(self, codec: str | None, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether the C codec takes tensors of ``dtype`` on ``device``; KVFormatError where ``codec`` is "c" and
        it cannot."""
        mode = _codec_mode(codec)
        if mode == "torch":
            return False
        ext = _extension()
        why = None
        if device.type != "cpu":
            why = f"codes CPU tensors only, these are on {device}"
        elif str(dtype).removeprefix("torch.") not in _ELEMENTS:
            why = f"codes float32, float16 and bfloat16, not {dtype}"
        elif isinstance(ext, str):
            why = f"is not built ({ext}); build it with pip install -e . (tools/setup.sh)"
        if why is None:
            return True
        if mode == "c":
            raise KVFormatError(f"{self.name}: the C codec {why}; use codec='torch' or 'auto'")
        return False

    def _encode_c(self, x: torch.Tensor, o: torch.Tensor, n: int, elems: int, threads: int | None) -> None:
        hd = int(x.shape[-1])
        layout = _tensor_layout(x, n, hd)
        if layout is None:                   # heads no view can reach (or strided head_dim): a contiguous copy
            x = x.contiguous()
            layout = (elems // hd, elems, hd)
        heads, x_row, x_head = layout
        es = x.element_size()
        self._c(False, _ELEMENTS.index(str(x.dtype).removeprefix("torch.")), n, heads, hd, x.data_ptr(),
                x_row * es, x_head * es, o.data_ptr(), o.stride(0), _threads(threads, n * elems))

    def _decode_c(self, rows: torch.Tensor, dst: torch.Tensor, n: int, elems: int, threads: int | None) -> None:
        import torch

        if rows.stride(1) != 1:
            rows = rows.contiguous()
        last = int(dst.shape[-1]) if dst.dim() > 1 else elems
        hd = last if last % self.block == 0 else elems
        layout = _tensor_layout(dst, n, hd)
        target = dst
        if layout is None:                   # no view of the layout: decode into a new tensor, then copy it in
            target = torch.empty(n, elems, dtype=dst.dtype)
            hd, layout = elems, (1, elems, elems)
        heads, x_row, x_head = layout
        es = target.element_size()
        self._c(True, _ELEMENTS.index(str(dst.dtype).removeprefix("torch.")), n, heads, hd, target.data_ptr(),
                x_row * es, x_head * es, rows.data_ptr(), rows.stride(0), _threads(threads, n * elems))
        if target is not dst:
            dst.copy_(target.view(dst.shape))

    def _c(self, decode: bool, elem: int, n: int, heads: int, hd: int, x: int, x_row: int, x_head: int, q: int,
           q_row: int, threads: int) -> None:
        """One job of bladed_codec.h: ``n`` rows of ``heads`` x ``hd`` values at address ``x`` (strides in bytes)
        <-> rows at address ``q``."""
        ext = _extension()
        if isinstance(ext, str):
            raise KVFormatError(f"{self.name}: the C codec is not built ({ext}); build it with pip install -e .")
        ffi, lib = ext
        job = ffi.new("struct bd_codec_job *", {
            "kind": self._kind_code, "block": self.block, "elem": elem, "isa": _isa(lib), "rows": n, "heads": heads,
            "head_dim": hd, "x": ffi.cast("void *", x), "x_row": x_row, "x_head": x_head,
            "q": ffi.cast("uint8_t *", q), "q_row": q_row})
        rc = (lib.bd_codec_decode if decode else lib.bd_codec_encode)(job, threads)
        if rc:
            raise KVFormatError(f"{self.name}: the C codec refused {n} rows of {heads} x {hd} (error {rc}); "
                                "a bug: use codec='torch' meanwhile")


@dataclass(frozen=True)
class Q8Format(QuantFormat):
    """Symmetric int8 in blocks along head_dim with one fp16 scale each (llama.cpp ``q8_0``)."""

    kind: ClassVar[str] = "q8"
    _kind_code: ClassVar[int] = 8

    @property
    def block_bytes(self) -> int:
        return 2 + self.block

    def _encode_torch(self, r: torch.Tensor, o: torch.Tensor) -> None:
        import torch

        xf = r.reshape(o.shape[0], o.shape[1], self.block).to(torch.float32, copy=True)
        # two plain reductions: faster on CPU than abs().amax() (no temporary) or vector_norm(inf)
        amax = torch.maximum(xf.amax(-1, keepdim=True), xf.amin(-1, keepdim=True).neg_())
        d = amax.div_(127).clamp_(max=_FP16_MAX).half()
        df = d.float()
        inv = torch.where(df > 0, 1 / df, torch.zeros_like(df))
        o[..., :2] = d.view(torch.uint8)
        o[..., 2:].view(torch.int8).copy_(xf.mul_(inv).round_().clamp_(-127, 127))

    def _decode_torch(self, r: torch.Tensor) -> torch.Tensor:
        import torch

        return r[..., 2:].view(torch.int8).to(torch.float32).mul_(_fp16_at(r, 0))


@dataclass(frozen=True)
class Q4Format(QuantFormat):
    """Asymmetric 4-bit in blocks along head_dim with an fp16 scale and minimum each (llama.cpp ``q4_1``)."""

    kind: ClassVar[str] = "q4"
    _kind_code: ClassVar[int] = 4
    full_precision_tail: ClassVar[int] = 128

    def check(self, head_dim: int) -> None:
        if isinstance(head_dim, int) and not isinstance(head_dim, bool) and head_dim > 0 and head_dim % 2:
            raise KVFormatError(f"KV format {self.name} packs two values per byte and needs an even head_dim, "
                                f"got head_dim {head_dim}; use fp16/bf16/fp32")
        super().check(head_dim)

    @property
    def block_bytes(self) -> int:
        return 4 + self.block // 2

    def _encode_torch(self, r: torch.Tensor, o: torch.Tensor) -> None:
        import torch

        b = self.block
        xf = r.reshape(o.shape[0], o.shape[1], b).to(torch.float32, copy=True)
        d, m = q4_params(xf, -1)
        q = quantize_q4_(xf, d, m)
        o[..., 0:2] = d.view(torch.uint8)
        o[..., 2:4] = m.view(torch.uint8)
        torch.bitwise_or(q[..., : b // 2], q[..., b // 2:].bitwise_left_shift_(4), out=o[..., 4:])

    def _decode_torch(self, r: torch.Tensor) -> torch.Tensor:
        import torch

        d, m = _fp16_at(r, 0), _fp16_at(r, 2)
        p = r[..., 4:]
        h = self.block // 2
        x = torch.empty(r.shape[0], r.shape[1], self.block, dtype=torch.float32, device=r.device)
        x[..., :h] = p & 0x0F
        x[..., h:] = p >> 4
        return x.mul_(d).add_(m)


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


def _fp16_at(r: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte ``at`` of every block of ``r`` ``[n, blocks, block_bytes]``, as float32 ``[n, blocks, 1]``
    (through a fresh 2-D view: viewing bytes as fp16 checks every stride, and a size-1 dimension may keep any)."""
    import torch

    return r[..., at:at + 2].contiguous().view(-1, 2).view(torch.float16).view(r.shape[0], r.shape[1], 1).float()


@functools.cache
def _extension() -> tuple[Any, Any] | str:
    """``(ffi, lib)`` of ``bladed._codec``, or why it does not import."""
    try:
        from bladed._codec import ffi, lib
    except ImportError as e:
        return f"bladed._codec: {e}"
    return ffi, lib


def codec_info() -> dict[str, Any]:
    """The C codec here: ``built``, ``error`` (why it is not), ``isa`` (the build of its loops that runs), ``isas``
    (those this CPU runs), ``codec`` (what ``BLADED_KV_CODEC`` picks), ``threads`` (``BLADED_CODEC_THREADS``)."""
    ext = _extension()
    info: dict[str, Any] = {"built": not isinstance(ext, str), "error": ext if isinstance(ext, str) else None,
                            "isa": None, "isas": [], "codec": _codec_mode(None),
                            "threads": os.environ.get(THREADS_ENV) or None}
    if not isinstance(ext, str):
        info["isa"] = _ISAS[_isa(ext[1])]
        info["isas"] = list(_ISAS[:ext[1].bd_codec_best_isa() + 1])
    return info


def _isa(lib: Any) -> int:
    """The build of the loops to run: ``BLADED_CODEC_ISA`` (auto, portable, avx2), auto: the fastest here."""
    want = os.environ.get(ISA_ENV, "").strip().lower() or "auto"
    best = int(lib.bd_codec_best_isa())
    if want == "auto":
        return best
    if want not in _ISAS:
        raise KVFormatError(f"{ISA_ENV}={want!r} is not one of auto, {', '.join(_ISAS)}; unset it for auto")
    if _ISAS.index(want) > best:
        raise KVFormatError(f"{ISA_ENV}={want}: this CPU runs only {', '.join(_ISAS[:best + 1])}; unset it for auto")
    return _ISAS.index(want)


def _codec_mode(codec: str | None) -> str:
    """``codec``, or ``BLADED_KV_CODEC`` where it is None (default auto), checked."""
    if codec is None:
        env = os.environ.get(CODEC_ENV, "").strip().lower() or "auto"
        if env not in _CODECS:
            raise KVFormatError(f"{CODEC_ENV}={env!r} is not one of {', '.join(_CODECS)}; unset it for auto")
        return env
    if codec not in _CODECS:
        raise KVFormatError(f"codec must be one of {', '.join(_CODECS)}, got {codec!r}")
    return codec


def _threads(threads: int | None, values: int) -> int:
    """The C codec's threads for ``values`` values: ``threads`` as given, else at most ``BLADED_CODEC_THREADS``
    (default: torch's intra-op threads where torch is loaded, else 1), one per CODEC_THREAD_MIN_VALUES values."""
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise KVFormatError(f"threads must be a positive int, got {threads!r}")
        return threads
    env = os.environ.get(THREADS_ENV, "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise KVFormatError(f"{THREADS_ENV}={env!r} must be a positive integer; unset it for the default")
        cap = int(env)
    else:
        torch = sys.modules.get("torch")
        cap = int(torch.get_num_threads()) if torch is not None else 1
    return max(1, min(cap, values // CODEC_THREAD_MIN_VALUES))


def _tensor_layout(t: torch.Tensor, n: int, hd: int) -> tuple[int, int, int] | None:
    """``t``'s ``n`` rows as a view ``[n, heads, hd]`` whose heads are contiguous: ``(heads, row stride, head
    stride)`` in elements, or None where there is no such view."""
    try:
        v = t.view(n, -1, hd)
    except RuntimeError:
        return None
    return (int(v.shape[1]), v.stride(0), v.stride(1)) if v.stride(2) == 1 else None


def _array_layout(a: np.ndarray, n: int, hd: int) -> tuple[np.ndarray, int, int, int]:
    """``(array, heads, row stride, head stride)`` (strides in bytes) of ``a``'s ``n`` rows as ``[n, heads, hd]``
    with contiguous heads: ``a`` itself where a view can be, else a contiguous copy."""
    import numpy as np

    if a.flags.aligned:
        try:
            v = a.reshape((n, -1, hd), copy=False)   # numpy >= 2.1; ValueError where only a copy would do
        except (TypeError, ValueError):
            v = None
        if v is not None and v.strides[2] == a.itemsize:
            return a, int(v.shape[1]), v.strides[0], v.strides[1]
    c = np.ascontiguousarray(a)
    elems = c.size // n
    return c, elems // hd, elems * c.itemsize, hd * c.itemsize


def _array_elements(x: np.ndarray, elements: str | None) -> int:
    """enum bd_codec_elem of numpy ``x``'s elements (bfloat16: uint16 bits, named)."""
    import numpy as np

    want = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
    name = elements if elements is not None else {"float32": "float32", "float16": "float16"}.get(x.dtype.name)
    if name not in want or x.dtype != want[name]:
        raise KVFormatError(f"the C codec encodes numpy float32 or float16 (bfloat16: uint16 with "
                            f"elements='bfloat16'), got {x.dtype} with elements={elements!r}")
    return _ELEMENTS.index(name)


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
