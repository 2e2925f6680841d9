"""Model geometry: how many bytes one KV Placement Unit (KPU) takes.

A KPU is one layer's K or one layer's V tensor, shaped ``(max_tokens, B*H, D)``
(paper §IV-A, footnote on Fig. 2).  One token of one KPU is ``B*H*D*e`` bytes
(Table II): the minimal I/O unit of a decode-step append.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bladed.kvformat import KVFormatError, kv_format

#: (layers, KV heads, head dim) of the models the paper evaluates (Table II).
MODEL_SHAPES: dict[str, tuple[int, int, int]] = {
    "opt-1.3b": (24, 32, 64),
    "opt-6.7b": (32, 32, 128),
    "opt-13b": (40, 40, 128),
}

#: bytes per element of a dtype, by name: a geometry's ``dtype_bytes`` for that dtype (:func:`dtype_bytes`)
DTYPE_BYTES: dict[str, int] = {
    "float8": 1, "fp8": 1,
    "float16": 2, "fp16": 2, "half": 2, "bfloat16": 2, "bf16": 2,
    "float32": 4, "fp32": 4, "float": 4,
    "float64": 8, "fp64": 8,
}
#: the element sizes a geometry may have
_DTYPE_SIZES = tuple(sorted(set(DTYPE_BYTES.values())))
#: the two tensors of a layer's KV cache
KINDS = ("k", "v")


def tensor_id(layer: int, kind: str) -> int:
    """The id of layer ``layer``'s K (``2 * layer``) or V (``2 * layer + 1``) tensor.

    Tensor ids are also the order in which a decode step reads the KPUs.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
    return 2 * layer + (kind == "v")


def tensor_of(tid: int) -> tuple[int, str]:
    """``(layer, kind)`` of a tensor id (the inverse of :func:`tensor_id`)."""
    return tid // 2, KINDS[tid % 2]


def dtype_bytes(dtype: object) -> int:
    """Bytes per element of ``dtype``: a name of :data:`DTYPE_BYTES` (``"fp16"``), or any object whose
    ``str()`` ends in one (``torch.float16``, a numpy dtype); ValueError naming the known ones otherwise."""
    try:
        return DTYPE_BYTES[str(dtype).rsplit(".", 1)[-1].lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known are {', '.join(DTYPE_BYTES)}") from None


def check_lba_size(lba_size: int) -> int:
    """Raise unless ``lba_size`` is a power of two from 512 to 64 KiB (what NVMe formats offer)."""
    if isinstance(lba_size, bool) or not isinstance(lba_size, int):
        raise TypeError(f"LBA size must be an int, got {type(lba_size).__name__}")
    if lba_size < 512 or lba_size > 65536 or lba_size & (lba_size - 1):
        raise ValueError(f"LBA size must be a power of two from 512 to 65536 bytes, got {lba_size}")
    return lba_size


#: the fields that define a :class:`Geometry` (on the wire, in this order)
GEOMETRY_FIELDS = ("layers", "batch", "kv_heads", "head_dim", "dtype_bytes", "max_tokens")


@dataclass(frozen=True)
class Geometry:
    """The KV-cache shape of one session.

    ``kv_heads`` is the number of K/V heads (smaller than the query heads for
    GQA/MQA models); ``max_tokens`` is prompt plus generation length.
    ``kv_format`` is how a token row is stored (:mod:`bladed.kvformat`): ``""``
    (rows of ``dtype_bytes`` elements, as bladed always stored them), a plain
    format (``fp16``, ``bf16``, ``fp32``: the same bytes, named, so that a
    retained prefix is served only to sessions of that format) or a quantized
    one (``q8``, ``q4``): then ``dtype_bytes`` is the size of the elements the
    client decodes to, and the row is the format's bytes.
    """

    layers: int
    batch: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    max_tokens: int
    kv_format: str = ""

    def __post_init__(self) -> None:
        for name in GEOMETRY_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Geometry.{name} must be an int, got {type(value).__name__} ({value!r})")
            if value <= 0:
                raise ValueError(f"Geometry.{name} must be positive, got {value}")
        if self.dtype_bytes not in _DTYPE_SIZES:
            raise ValueError(
                f"Geometry.dtype_bytes must be one of {', '.join(map(str, _DTYPE_SIZES))} "
                f"(fp8 / fp16-bf16 / fp32 / fp64), got {self.dtype_bytes}"
            )
        if not isinstance(self.kv_format, str):
            raise TypeError(f"Geometry.kv_format must be a str, got {type(self.kv_format).__name__}")
        if self.kv_format:
            fmt = kv_format(self.kv_format)       # KVFormatError (a ValueError) names the value
            fmt.check(self.head_dim)
            if fmt.plain and fmt.block_bytes != self.dtype_bytes:
                raise KVFormatError(f"KV format {fmt.name} stores {fmt.block_bytes}-byte elements, but "
                                    f"dtype_bytes is {self.dtype_bytes}; give dtype_bytes {fmt.block_bytes} or "
                                    "another format")
            object.__setattr__(self, "kv_format", fmt.name)   # the canonical name (fp16 for float16, ...)

    @classmethod
    def for_model(cls, model: str, *, batch: int, max_tokens: int, dtype_bytes: int = 2,
                  kv_format: str = "") -> Geometry:
        """The geometry of a model named in :data:`MODEL_SHAPES` (e.g. ``opt-6.7b``)."""
        try:
            layers, heads, head_dim = MODEL_SHAPES[model.lower()]
        except KeyError:
            raise ValueError(f"unknown model {model!r}: known are {', '.join(sorted(MODEL_SHAPES))}") from None
        return cls(layers=layers, batch=batch, kv_heads=heads, head_dim=head_dim,
                   dtype_bytes=dtype_bytes, max_tokens=max_tokens, kv_format=kv_format)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Geometry:
        """The geometry of a record's or a request's fields (:data:`GEOMETRY_FIELDS`, ``kv_format`` if there)."""
        return cls(**{f: int(d[f]) for f in GEOMETRY_FIELDS}, kv_format=str(d.get("kv_format", "")))

    def fields(self) -> dict[str, int | str]:
        """What :meth:`from_dict` takes back: the defining fields (a record's ``geometry``)."""
        out: dict[str, int | str] = {f: getattr(self, f) for f in GEOMETRY_FIELDS}
        if self.kv_format:
            out["kv_format"] = self.kv_format
        return out

    @functools.cached_property      # every request's range checks read it: the format is parsed once
    def token_bytes(self) -> int:
        """One token of one K or V tensor: ``B*H*D*e`` (Table II), or the row of a quantized format."""
        if self.kv_format:
            return kv_format(self.kv_format).row_bytes(self.batch * self.kv_heads, self.head_dim)
        return self.batch * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def row_elems(self) -> int:
        """Elements in one token row (``B*H*D``)."""
        return self.batch * self.kv_heads * self.head_dim

    @property
    def kpu_bytes(self) -> int:
        """One K or V tensor at full length (``S_kpu`` of Algorithm 1, ``M_pin`` of Eq. 2)."""
        return self.token_bytes * self.max_tokens

    @property
    def kv_bytes(self) -> int:
        """The whole KV cache of the session: ``2 * L * S_kpu``."""
        return 2 * self.layers * self.kpu_bytes

    @property
    def shape(self) -> tuple[int, int, int]:
        """The target shape ``(d0, d1, d2) = (max_tokens, B*H, D)`` of one KPU (Algorithm 2)."""
        return (self.max_tokens, self.batch * self.kv_heads, self.head_dim)

    def aligned(self, lba_size: int) -> bool:
        """The alignment precondition of the paper's §IV-B (NVMe-direct path): one token of a KPU is a
        whole number of LBAs."""
        return self.token_bytes % check_lba_size(lba_size) == 0

    def to_dict(self) -> dict[str, int | str]:
        return {
            "layers": self.layers,
            "batch": self.batch,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "dtype_bytes": self.dtype_bytes,
            "max_tokens": self.max_tokens,
            "kv_format": self.kv_format,
            "token_bytes": self.token_bytes,
            "kpu_bytes": self.kpu_bytes,
            "kv_bytes": self.kv_bytes,
        }
