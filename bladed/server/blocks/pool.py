"""One block pool: its key, its storage (a plan, a page-cache store and an extent store shared by every
attachment), its row checksums and its slot table; dropping slots (TRIM, punched pages).  Must not allocate
extents or journal (``blocks.store`` does)."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import numpy as np

from bladed.io import BladedIOError, Engine, ExtentDevice
from bladed.residency.geometry import Geometry
from bladed.residency.planner import Plan
from bladed.server.blocks.index import SlotTable
from bladed.server.storage import ExtentKPUStore, PageCacheKPUStore
from bladed.server.storage.integrity import Checksums
from bladed.server.storage.journal import RetainedRecord
from bladed.sizes import PAGE_SIZE

log = logging.getLogger("bladed.blocks")

#: the channels a pool's extent store keeps buffers for (the most one attachment may have: io.max_channels <= 64)
MAX_POOL_CHANNELS = 64
#: a pool's id starts with this (a journal record of a pool, not of a retained prefix)
POOL_ID_PREFIX = "b"


def pool_geometry(pages: int, page_bytes: int, capacity: int) -> Geometry:
    """KPU ``p`` holds page ``p`` of every block, one row per block slot (pages rounded up to K/V pairs)."""
    return Geometry(layers=(pages + 1) // 2, batch=1, kv_heads=1, head_dim=page_bytes, dtype_bytes=1,
                    max_tokens=capacity)


def pool_seed(model: str, dtype: str, pages: int, page_bytes: int, block_tokens: int) -> str:
    """What tells one pool's blocks from another's: the model, its KV dtype and the block's shape."""
    return hashlib.sha256(f"bladed-blocks-1\0{model}\0{dtype}\0{pages},{page_bytes},{block_tokens}".encode()
                          ).hexdigest()


def is_pool_record(rec: RetainedRecord) -> bool:
    return rec.id.startswith(POOL_ID_PREFIX)


class BlockPool:
    """A pool's storage, checksums and slot table."""

    def __init__(self, rec: RetainedRecord, plan: Plan, pagecache: PageCacheKPUStore, extent_store: ExtentKPUStore,
                 index_path: str) -> None:
        self.rec = rec
        self.plan = plan
        self.geometry = plan.geometry
        self.pagecache = pagecache
        self.extent_store = extent_store
        self.checksums = Checksums(self.geometry)
        self.table = SlotTable(self.geometry.max_tokens, 2 * self.geometry.layers, index_path)
        self.attachments: set[str] = set()

    @property
    def id(self) -> str:
        return self.rec.id

    @property
    def capacity(self) -> int:
        return self.geometry.max_tokens

    @property
    def block_bytes(self) -> int:
        return 2 * self.geometry.layers * self.geometry.token_bytes

    @property
    def pagecache_bytes(self) -> int:
        return sum(k.pagecache_bytes for k in self.plan.pagecache_kpus())

    @property
    def device_bytes(self) -> int:
        ext = self.extent_store.extent
        return 0 if ext is None else ext.nblocks * self.plan.lba_size

    def describe(self) -> dict[str, Any]:
        r = self.rec
        return {"pool": r.id, "scope": r.scope, "model": r.model, "dtype": r.dtype,
                "block_tokens": r.block_tokens, "kpus": 2 * self.geometry.layers,
                "page_bytes": self.geometry.token_bytes, "block_bytes": self.block_bytes,
                "pagecache_bytes": self.pagecache_bytes, "device_bytes": self.device_bytes,
                "group1_kpus": len(self.plan.pagecache_kpus()), "attachments": len(self.attachments),
                "created": r.created} | self.table.gauges()

    # -- checksums ------------------------------------------------------------------------
    def crcs_of(self, slot: int) -> np.ndarray:
        """The crc32c of each KPU's row of ``slot`` (0 where a row was never written: it then never verifies)."""
        out = np.zeros(2 * self.geometry.layers, dtype=np.uint32)
        for t in range(out.size):
            c = self.checksums.row(t, slot)
            out[t] = 0 if c is None else c
        return out

    def written(self, slot: int) -> bool:
        """Whether every KPU's row of ``slot`` was written (has a crc)."""
        return all(self.checksums.row(t, slot) is not None for t in range(2 * self.geometry.layers))

    def restore(self, slots: list[tuple[int, np.ndarray]]) -> None:
        for s, crcs in slots:
            for t, c in enumerate(crcs.tolist()):
                self.checksums.set_row(t, s, int(c))

    # -- dropping slots -------------------------------------------------------------------
    def trim(self, device: ExtentDevice, slots: list[int]) -> int:
        """TRIM the direct KPUs' rows of ``slots`` and punch the page-cache files' rows; forget their crcs.
        Returns the bytes deallocated on the device."""
        if not slots:
            return 0
        tb, lba = self.geometry.token_bytes, self.plan.lba_size
        for s in slots:
            for t in range(2 * self.geometry.layers):
                self.checksums.set_row(t, s, None)
        runs = _runs(sorted(slots))
        trimmed = 0
        if tb % PAGE_SIZE == 0:
            for kpu in self.plan.pagecache_kpus():
                f = self.pagecache.file(kpu.tensor_id)
                if not f.materialized:
                    continue
                for s, n in runs:
                    try:
                        f.punch(s * tb, n * tb)
                    except OSError as e:
                        log.warning("block pool %s: punching rows %d+%d of %s failed: %s", self.id, s, n, kpu.name, e)
        ext = self.extent_store.extent
        if ext is not None and tb % lba == 0:
            per = tb // lba
            ranges = []
            for kpu in self.plan.direct_kpus():
                if not self.extent_store.map.is_materialized(kpu.tensor_id):
                    continue
                start, _ = self.extent_store.map.lookup(kpu.tensor_id)
                ranges += [(start + s * per, n * per) for s, n in runs]
            if ranges:
                try:
                    with Engine(device, 4) as eng:
                        for slba, nb in ranges:
                            eng.discard(slba, nb)
                            trimmed += nb * lba
                except (BladedIOError, OSError) as e:
                    log.warning("block pool %s: TRIM of dropped blocks failed: %s", self.id, e)
        return trimmed


def _runs(slots: list[int]) -> list[tuple[int, int]]:
    """Sorted slots as (first, count) runs of consecutive slots."""
    out: list[tuple[int, int]] = []
    for s in slots:
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((s, 1))
    return out


__all__ = ["MAX_POOL_CHANNELS", "POOL_ID_PREFIX", "BlockPool", "is_pool_record", "pool_geometry", "pool_seed"]
