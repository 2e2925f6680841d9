"""Eq. 7-11 of the paper: splitting one tensor request into device commands.

There is one implementation, in C: ``bd_chunk_cap`` (Eq. 7, with the NVMe
16-bit NLB and the kernel's per-read/write limit applied) and ``bd_chunk_at``
(Eq. 8-11), which the engine's submit loop calls for every command it issues.
This module wraps those two for planners and tests; it computes nothing itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bladed._uring import ffi, lib
from bladed.io.uring import Op, request_error

_U32_MAX = 0xFFFF_FFFF


@dataclass(frozen=True)
class Chunk:
    """One device command: start LBA, 0-based block count, offset into the host buffer."""

    slba: int
    nlb: int          # 0-based: the command moves nlb + 1 blocks (Eq. 10)
    buf_offset: int   # dbuf - buf_ptr (Eq. 11)

    @property
    def blocks(self) -> int:
        return self.nlb + 1


def lba_shift(lba_size: int) -> int:
    """log2 of a power-of-two LBA size."""
    if lba_size <= 0 or lba_size & (lba_size - 1):
        raise ValueError(f"LBA size must be a power of two, got {lba_size}")
    return lba_size.bit_length() - 1


def planning_target(lba_size: int, max_transfer_bytes: int, kind: int = lib.BD_KIND_FILE) -> Any:
    """A ``struct bd_target`` carrying only what the chunk math reads (no file descriptor)."""
    t = ffi.new("struct bd_target *")
    t.fd = -1
    t.kind = kind
    t.lba_shift = lba_shift(lba_size)
    # the field is 32 bits: a larger limit cannot be expressed (and bd_chunk_cap caps commands lower anyway)
    t.max_chunk_bytes = max(0, min(max_transfer_bytes, _U32_MAX))
    return t


def _what(op: Op, slba: int, nbytes: int) -> str:
    name = op.name.lower() if isinstance(op, Op) else f"op {op}"
    return f"planning {name} of {nbytes} bytes at LBA {slba}"


def chunk_cap(target: Any, op: Op = Op.READ) -> int:
    """Eq. 7: the most bytes one ``op`` command carries on ``target``."""
    cap = int(lib.bd_chunk_cap(target, op))
    if cap == 0:
        c = ffi.new("struct bd_chunk *")
        lib.bd_chunk_at(target, op, 0, 0, 0, c)      # only to learn why the target was refused
        raise request_error(int(c.why), target, op, 0, 0, _what(op, 0, 0))
    return cap


def command_chunk(target: Any, op: Op, slba: int, nbytes: int, offset: int = 0) -> tuple[Chunk, int]:
    """Eq. 8-11: the command that starts at byte ``offset`` of a transfer, and the transfer's n_chunks."""
    c = ffi.new("struct bd_chunk *")
    if lib.bd_chunk_at(target, op, slba, nbytes, offset, c) < 0:
        raise request_error(int(c.why), target, op, slba, nbytes, _what(op, slba, nbytes), offset=offset)
    return Chunk(slba=int(c.slba), nlb=int(c.nlb), buf_offset=int(c.buf_off)), int(c.count)


def target_chunks(target: Any, op: Op, slba: int, nbytes: int) -> list[Chunk]:
    """Every command, in order, that the engine issues for the transfer ``(slba, nbytes)`` on ``target``."""
    if nbytes == 0:
        chunk_cap(target, op)                          # still refuse a bad target
        return []
    out: list[Chunk] = []
    offset = 0
    while offset < nbytes:
        chunk, _ = command_chunk(target, op, slba, nbytes, offset)
        out.append(chunk)
        offset += chunk.blocks << int(target.lba_shift)
    return out


def chunk_bytes(max_transfer_bytes: int, lba_size: int, *, kind: int = lib.BD_KIND_FILE, op: Op = Op.READ) -> int:
    """Eq. 7: the largest LBA multiple that fits in one command (within the command's own field limits)."""
    return chunk_cap(planning_target(lba_size, max_transfer_bytes, kind), op)


def plan_chunks(slba: int, req_bytes: int, lba_size: int, max_transfer_bytes: int, *,
                kind: int = lib.BD_KIND_FILE, op: Op = Op.READ) -> list[Chunk]:
    """Eq. 8-11: the commands that move ``req_bytes`` starting at ``slba``."""
    return target_chunks(planning_target(lba_size, max_transfer_bytes, kind), op, slba, req_bytes)
