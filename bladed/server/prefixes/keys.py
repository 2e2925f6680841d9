"""Prefix keys: a prompt's token ids cut into blocks and hashed as a chain from a seed of the model, its dtype
and the KV shape, so that equal hashes mean an equal prefix of the same model.  Pure functions."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from bladed.protocol import ErrorCode, RequestError, get_field
from bladed.residency.geometry import DTYPE_BYTES, GEOMETRY_FIELDS, Geometry

#: longest model name a prefix key may carry
MAX_MODEL_CHARS = 256
#: a token id is hashed as 4 little-endian bytes
TOKEN_LIMIT = 1 << 32
#: the hex digits kept of each block hash (128 bits)
HASH_HEX = 32


def seed_of(model: str, dtype: str, geometry: Geometry) -> bytes:
    """What every block hash of a prefix starts from: the model, its dtype and the KV shape and storage format (not
    its length): an entry of one KV format is never served to a session of another."""
    shape = ",".join(str(getattr(geometry, f)) for f in GEOMETRY_FIELDS if f != "max_tokens")
    if geometry.kv_format:      # unnamed plain rows keep the keys they always had
        shape += f",{geometry.kv_format}"
    return hashlib.sha256(f"bladed-prefix-1\0{model}\0{dtype}\0{shape}".encode()).digest()


def block_chain(seed: bytes, tokens: Sequence[int], block_tokens: int) -> list[str]:
    """The hash of each whole block of ``tokens``; block ``i``'s hash covers the seed and all tokens up to its end."""
    ids = np.asarray(tokens, dtype="<u4")
    out = []
    h = seed
    for b in range(len(ids) // block_tokens):
        h = hashlib.sha256(h + ids[b * block_tokens:(b + 1) * block_tokens].tobytes()).digest()
        out.append(h.hex()[:HASH_HEX])
    return out


def _tokens(raw: Any, name: str, limit: int) -> list[int]:
    if not isinstance(raw, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        raise RequestError(ErrorCode.BAD_REQUEST, f"field '{name}' must be a list of token ids (integers)")
    if len(raw) > limit:
        raise RequestError(ErrorCode.BAD_REQUEST, f"field '{name}' has {len(raw)} tokens, more than the session's "
                                                  f"max_tokens ({limit})")
    if raw and not 0 <= min(raw) <= max(raw) < TOKEN_LIMIT:
        raise RequestError(ErrorCode.BAD_REQUEST, f"field '{name}': token ids must be within 0..{TOKEN_LIMIT - 1}")
    return list(raw)


def parse_key(raw: Any, geometry: Geometry, *, where: str) -> tuple[str, str, list[int]]:
    """``(model, dtype, tokens)`` of a prefix key field (``open_session``'s ``prefix``, ``retain``)."""
    if not isinstance(raw, dict):
        raise RequestError(ErrorCode.BAD_REQUEST, f"field '{where}' must be an object with model, dtype and tokens")
    model = get_field(raw, "model", str, prefix=f"{where}.")
    dtype = get_field(raw, "dtype", str, prefix=f"{where}.")
    if not 0 < len(model) <= MAX_MODEL_CHARS:
        raise RequestError(ErrorCode.BAD_REQUEST, f"field '{where}.model' must be 1..{MAX_MODEL_CHARS} characters")
    size = DTYPE_BYTES.get(dtype.rsplit(".", 1)[-1].lower())
    if size is None:
        raise RequestError(ErrorCode.BAD_REQUEST, f"field '{where}.dtype': unknown dtype {dtype!r}; known are "
                                                  f"{', '.join(DTYPE_BYTES)}")
    if size != geometry.dtype_bytes:
        raise RequestError(ErrorCode.BAD_REQUEST, f"field '{where}.dtype': {dtype} has {size}-byte elements, the "
                                                  f"session's geometry has dtype_bytes {geometry.dtype_bytes}")
    if geometry.batch != 1:
        raise RequestError(ErrorCode.BAD_REQUEST, f"prefix reuse needs a geometry of batch 1 (one sequence), got "
                                                  f"batch {geometry.batch}; leave out '{where}'")
    return model, dtype, _tokens(raw.get("tokens"), f"{where}.tokens", geometry.max_tokens)


__all__ = ["HASH_HEX", "MAX_MODEL_CHARS", "TOKEN_LIMIT", "block_chain", "parse_key", "seed_of"]
