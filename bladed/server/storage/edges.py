"""Packed token rows on the extent: an access's *edge* LBAs (those it covers only in part) and each KPU's
*tail* (its fill mark and a copy of its last, partly filled LBA), for ``extent_store``.

Bookkeeping only: no device I/O, no locks taken (the extent store holds each tail's ``lock`` around it).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from bladed.io import StagingBuffer


@dataclass
class Edge:
    """One edge LBA of an access, assembled or read in the channel's scratch."""

    block: int                 # KPU-relative LBA index
    scratch: int               # byte offset of its copy in the scratch
    lo: int                    # the access's bytes inside this LBA: [lo, hi) relative to the LBA
    hi: int
    from_tail: bool = False    # a read served from the tail copy (no device command)


def edges_of(offset: int, nbytes: int, lba: int, scratch_at: int) -> list[Edge]:
    """The LBAs that bytes ``[offset, offset + nbytes)`` of a KPU cover only in part (none when the §IV-B
    precondition holds), their copies placed from ``scratch_at`` of the scratch."""
    o0, o1 = offset, offset + nbytes
    first, last = o0 // lba, (o1 - 1) // lba
    edges = []
    if o0 % lba:
        edges.append(Edge(first, scratch_at, o0 - first * lba, min(lba, o1 - first * lba)))
    if o1 % lba and (last != first or not o0 % lba):
        edges.append(Edge(last, scratch_at + len(edges) * lba, max(0, o0 - last * lba), o1 - last * lba))
    return edges


@dataclass
class Tail:
    """Per KPU: how far it is filled, and a copy of its last, partly filled LBA.

    ``dirty``: that LBA is not on the device yet. A session's store defers it (``ExtentKPUStore(...,
    defer_tail=True)``): an append that ends inside an LBA writes the whole LBAs before it and keeps the last
    one here, to be written once the appends after it fill it (a one-token append of a 768-byte row on 4 KiB
    LBAs would otherwise write 4 KiB, 5.3 times its bytes, and the same LBA again at every token). Then the
    copy is the only one: reads take it, and it is never forgotten.
    """

    lock: threading.Lock = field(default_factory=threading.Lock)
    fill: int = 0              # bytes [0, fill) of the KPU have been written (the highest end so far)
    block: int = -1            # KPU-relative index of the cached LBA (-1: none)
    data: bytearray = field(default_factory=bytearray)
    dirty: bool = False        # the cached LBA is not on the device yet (a deferred append)

    def forget(self) -> None:
        """Drop the copy (read the LBA back from the device next time), unless it is the only one."""
        if not self.dirty:
            self.block = -1

    def filled_to(self, end: int, lba: int, last_lba: memoryview | None, *, dirty: bool = False) -> None:
        """The KPU is written up to ``end``; ``last_lba`` is what its LBA holding byte ``end - 1`` holds now
        (read only when ``end`` is inside an LBA); ``dirty``: and only here, not on the device."""
        self.fill, self.block, self.dirty = end, -1, False
        if end % lba:
            assert last_lba is not None
            self.block, self.data, self.dirty = (end - 1) // lba, bytearray(last_lba), dirty

    def write_failed(self, end: int) -> None:
        """A write up to ``end`` failed: what its edge LBAs hold is unknown now (read them back next time; a
        dirty copy stays: what it holds was never on the device, and the failed write's bytes are lost anyway)."""
        self.forget()
        self.fill = max(self.fill, end)

    def after_write(self, end: int, lba: int, edges: list[Edge], scratch: StagingBuffer | None, *,
                    deferred: bool = False) -> None:
        """A write up to ``end`` whose edge LBAs were assembled in ``scratch``: keep the fill mark and the copy
        in step with what the device now holds (``deferred``: its last edge LBA was kept here, not written)."""
        if end >= self.fill:
            last = edges[-1] if end % lba else None
            assert last is None or (scratch is not None and last.block == (end - 1) // lba)
            self.filled_to(end, lba, scratch.view(last.scratch, lba) if last is not None and scratch else None,
                           dirty=deferred and last is not None)
        elif self.block >= 0:
            for e in edges:
                if e.block == self.block:
                    assert scratch is not None
                    self.data[:] = scratch.view(e.scratch, lba)
                    self.dirty = False         # a write inside written data sends all its edges


__all__ = ["Edge", "Tail", "edges_of"]
