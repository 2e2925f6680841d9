"""Eq. 7-11 of the paper: splitting one tensor request into device commands.

The C engine does this per transfer in its hot loop; this module is the
reference the tests hold the engine to, and what planners use to predict
command counts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    """One device command: start LBA, 0-based block count, offset into the host buffer."""

    slba: int
    nlb: int          # 0-based: the command moves nlb + 1 blocks (Eq. 10)
    buf_offset: int   # dbuf - buf_ptr (Eq. 11)

    @property
    def blocks(self) -> int:
        return self.nlb + 1


def chunk_bytes(max_transfer_bytes: int, lba_size: int) -> int:
    """Eq. 7: the largest LBA multiple that fits in one command."""
    if lba_size <= 0 or lba_size & (lba_size - 1):
        raise ValueError(f"LBA size must be a power of two, got {lba_size}")
    chunk = (max_transfer_bytes // lba_size) * lba_size
    if chunk == 0:
        raise ValueError(f"per-command limit {max_transfer_bytes} is smaller than one {lba_size}-byte LBA")
    return chunk


def plan_chunks(slba: int, req_bytes: int, lba_size: int, max_transfer_bytes: int) -> list[Chunk]:
    """Eq. 8-11: the commands that move ``req_bytes`` starting at ``slba``."""
    if req_bytes % lba_size:
        raise ValueError(f"request of {req_bytes} bytes is not a multiple of the {lba_size}-byte LBA")
    chunk = chunk_bytes(max_transfer_bytes, lba_size)
    max_blocks = chunk // lba_size                       # Eq. 8, n_maxBlocks
    n_chunks = -(-req_bytes // chunk)                    # Eq. 8, ceil
    remains = req_bytes // lba_size
    out = []
    for i in range(n_chunks):                            # N = i + 1
        blocks = min(max_blocks, remains)
        out.append(Chunk(slba=slba + i * max_blocks, nlb=blocks - 1, buf_offset=i * chunk))  # Eq. 9-11
        remains -= blocks
    return out
