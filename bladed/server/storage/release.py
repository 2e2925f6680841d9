"""Giving back a run of the region that someone wrote to: TRIM (Dataset Management deallocate, paper
§IV-B), Write Zeroes where a deallocated block may read back old data, then free -- or, where neither
worked, keep it out of use.  The one release path of sessions, retained prefixes and start-up reclaim;
the caller journals what stays quarantined."""

from __future__ import annotations

import logging

from bladed.io import BladedIOError, Engine, ExtentDevice
from bladed.residency.extents import Extent, ExtentAllocator
from bladed.server.metrics import Stats

log = logging.getLogger("bladed")


def scrub(device: ExtentDevice, start: int, nblocks: int, *, always_zero: bool = False) -> tuple[int, int, bool]:
    """Deallocate ``nblocks`` from ``start`` and make sure they read back as zeroes.

    TRIM first (paper §IV-B).  Where the device does not promise zeroes after a
    deallocate (NVMe DLFEAT, punched holes), or the deallocate failed, or
    ``always_zero``: Write Zeroes too, so a later session never reads an
    earlier one's bytes.  Returns (trimmed bytes, zeroed bytes, safe to reuse).
    """
    lba = device.lba_size
    trimmed = zeroed = 0
    with Engine(device, 4) as eng:
        try:
            eng.discard(start, nblocks)
            trimmed = nblocks * lba
        except BladedIOError as e:
            log.warning("TRIM of LBA [%d, %d) failed: %s", start, start + nblocks, e)
        if trimmed and device.zeroes_after_discard and not always_zero:
            return trimmed, 0, True
        try:
            eng.write_zeroes(start, nblocks)
            zeroed = nblocks * lba
        except BladedIOError as e:
            log.error("Write Zeroes of LBA [%d, %d) failed: %s", start, start + nblocks, e)
            return trimmed, 0, False
    return trimmed, zeroed, True


def scrub_and_free(device: ExtentDevice, allocator: ExtentAllocator, stats: Stats, ext: Extent, *,
                   always_zero: bool, owner: str) -> tuple[int, int, bool]:
    """:func:`scrub` a run that ``owner`` (a session, a retained prefix) wrote to, count it, and give it back
    to ``allocator`` -- unless it could be neither deallocated to zeroes nor zeroed: then it stays out of use
    (counted in ``quarantined_bytes``; the caller journals it so a restart scrubs it again).  Returns
    (trimmed bytes, zeroed bytes, freed)."""
    trimmed, zeroed, safe = scrub(device, ext.start, ext.nblocks, always_zero=always_zero)
    stats.add("trimmed_bytes", trimmed)
    stats.add("zeroed_bytes", zeroed)
    if safe:
        allocator.free(ext)
    else:
        # never hand out blocks that may still hold someone's bytes
        log.error("%s: extent %d+%d could be neither deallocated to zeroes nor zeroed; keeping it out of use "
                  "until restart", owner, ext.start, ext.nblocks)
        stats.add("quarantined_bytes", ext.nblocks * device.lba_size)
    return trimmed, zeroed, safe


__all__ = ["scrub", "scrub_and_free"]
