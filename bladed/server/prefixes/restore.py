"""Start-up: an entry rebuilt from its journal record (its layout made again by Algorithm 1 with the record's
grant) and read back whole against its crcs.  Must not evict or journal (``prefixes.cache`` does)."""

from __future__ import annotations

import os

import numpy as np

from bladed.protocol import IOOp
from bladed.residency.extents import ExtentAllocator
from bladed.residency.geometry import Geometry
from bladed.residency.planner import Mode, plan_session
from bladed.server.prefixes.entry import RetainedPrefix, block_crcs
from bladed.server.storage import Access, ExtentKPUStore, PageCacheKPUStore
from bladed.server.storage.channel import Channel
from bladed.server.storage.journal import RetainedRecord
from bladed.server.storage.pagecache_store import RETAINED_DIR_PREFIX


def rebuild(rec: RetainedRecord, pagecache_dir: str, crc_file: str, lba_size: int,
            allocator: ExtentAllocator) -> RetainedPrefix:
    """The entry of a journal record (ValueError where the record, its crcs or its storage disagree)."""
    geometry = Geometry.from_dict(rec.geometry)
    plan = plan_session(geometry, Mode.DUALBLADE, rec.grant, lba_size)
    blocks = len(rec.hashes)
    crcs = np.fromfile(crc_file, dtype=np.uint32)
    if crcs.size != 2 * geometry.layers * blocks:
        raise ValueError(f"its checksum file has {crcs.size} entries, {2 * geometry.layers * blocks} expected")
    ext = None
    if rec.extents:
        s, n = rec.extents[0]
        ext = next((x for x in allocator.extents if x.owner == rec.id), None)
        if ext is None or n != plan.extent_blocks:
            raise ValueError(f"its extent {s}+{n} does not hold its layout")
    elif plan.extent_blocks:
        raise ValueError("its layout needs an extent and the journal lists none")
    pagecache = PageCacheKPUStore(pagecache_dir, rec.id, plan.pagecache_kpus(), dir_prefix=RETAINED_DIR_PREFIX)
    if pagecache.directory != rec.pagecache_dir:
        raise ValueError(f"its page-cache directory {rec.pagecache_dir!r} is not where its layout puts it")
    pagecache.create(keep_existing=True)
    store = ExtentKPUStore(plan, ext, 1)
    store.prepare()
    store.assume_written(geometry.max_tokens * geometry.token_bytes)
    entry = RetainedPrefix(rec, plan, pagecache, store, crcs.reshape(2 * geometry.layers, blocks))
    entry.last_used = rec.created
    return entry


def verify(entry: RetainedPrefix, ch: Channel) -> None:
    """Read every KPU of the entry back and compare each block's crc (ValueError naming the first bad one)."""
    geometry = Geometry.from_dict(entry.rec.geometry)
    B, n, tb = entry.rec.block_tokens, entry.tokens, geometry.token_bytes
    for f in entry.pagecache.file_paths():  # a missing file would read back as zeroes
        if not os.path.exists(f):
            raise ValueError(f"its page-cache file {f} is missing")
    for kpu in entry.plan.kpus:
        a = Access(IOOp.READ, kpu, 0, n, 0, n * tb, 0)
        entry.store_of(kpu).run(ch, [a])
        if a.result.error is not None:
            raise ValueError(a.result.message)
        if not np.array_equal(block_crcs(ch.slot, n // B, B * tb), entry.crcs[kpu.tensor_id]):
            raise ValueError(f"{kpu.name} does not match its checksums")


__all__ = ["rebuild", "verify"]
