"""Optional end-to-end checksums of a session's KV data (``checksums`` in
``open_session``, default ``io.checksums``).

The chunk is one token row of a KPU (``token_bytes``): the unit every write
and read is made of, so a partial write never leaves a chunk half-covered.
On a write the daemon records the crc32c (Castagnoli) of each written row of
the staging slot; on a read it recomputes the rows it just placed in the slot
and compares them with the recorded ones.  A mismatch fails the read with
``integrity_error`` naming the KPU and the token rows.  Rows never written
have no checksum and are not checked.

The crc itself runs in the ``crc32c`` package (SSE4.2 / ARMv8 CRC
instructions); the rows are handed to it by ``map`` over a 2-D numpy view, so
there is no Python bytecode per chunk.  Checksums live in the daemon's
memory (4 bytes per token row), not on storage: they catch corruption on the
device or in the page-cache files while the session lives.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from typing import Any

import numpy as np

from bladed.protocol import ErrorCode, RequestError
from bladed.residency.geometry import Geometry

_crc32c: Any = None
with contextlib.suppress(ImportError):  # reported when a session asks for checksums
    _crc32c = importlib.import_module("crc32c")


def available() -> bool:
    return _crc32c is not None


def row_crcs(buf: Any, offset: int, nrows: int, row_bytes: int) -> np.ndarray:
    """crc32c of ``nrows`` consecutive ``row_bytes`` rows of ``buf`` from ``offset``."""
    assert _crc32c is not None
    rows: Any = np.frombuffer(buf, dtype=np.uint8, count=nrows * row_bytes, offset=offset).reshape(nrows, row_bytes)
    crc: Any = _crc32c.crc32c
    return np.fromiter(map(crc, rows), dtype=np.uint32, count=nrows)


class Checksums:
    """Per-KPU, per-token-row crc32c of what a session wrote."""

    def __init__(self, geometry: Geometry) -> None:
        if _crc32c is None:
            raise RequestError(ErrorCode.BAD_REQUEST, "checksums need the 'crc32c' Python package on the daemon's "
                                                      "host (pip install crc32c)")
        self.geometry = geometry
        self._crc: dict[int, np.ndarray] = {}
        self._valid: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        self.rows_written = 0
        self.rows_verified = 0

    def _arrays(self, tid: int) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            if tid not in self._crc:
                n = self.geometry.max_tokens
                self._crc[tid] = np.zeros(n, dtype=np.uint32)
                self._valid[tid] = np.zeros(n, dtype=bool)
            return self._crc[tid], self._valid[tid]

    def row(self, tid: int, row: int) -> int | None:
        """The crc32c recorded for one row (None: never written, or forgotten)."""
        crc, valid = self._arrays(tid)
        return int(crc[row]) if valid[row] else None

    def set_row(self, tid: int, row: int, value: int | None) -> None:
        """Record (a block pool's slot restored at start-up) or forget (``None``: a slot dropped) one row's crc."""
        crc, valid = self._arrays(tid)
        crc[row] = 0 if value is None else value
        valid[row] = value is not None

    def after(self, write: bool, tid: int, name: str, slot: Any, slot_offset: int, token_start: int,
              ntokens: int) -> None:
        """Record (write) or verify (read) rows ``[token_start, token_start + ntokens)``, at ``slot_offset`` of the
        slot (RequestError INTEGRITY_ERROR naming the KPU and the first bad row on a mismatch)."""
        tb = self.geometry.token_bytes
        crcs = row_crcs(slot, slot_offset, ntokens, tb)
        crc, valid = self._arrays(tid)
        end = token_start + ntokens
        if write:
            crc[token_start:end] = crcs
            valid[token_start:end] = True
            self.rows_written += ntokens
            return
        v = valid[token_start:end]
        bad = np.flatnonzero(v & (crc[token_start:end] != crcs))
        self.rows_verified += int(v.sum())
        if bad.size:
            first = token_start + int(bad[0])
            raise RequestError(ErrorCode.INTEGRITY_ERROR,
                               f"crc32c mismatch reading {name}: {bad.size} of {ntokens} "
                               f"token rows differ from what was written (first: token {first}, stored "
                               f"{int(crc[first]):#010x}, read {int(crcs[first - token_start]):#010x}); the data "
                               "on the device or in the page-cache file is corrupt")


__all__ = ["Checksums", "available", "row_crcs"]
