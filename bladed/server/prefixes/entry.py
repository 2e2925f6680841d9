"""A retained prefix: its key, its own storage (page-cache files and/or an extent), its checksums, and the
files that keep them; and what the cache uses of a session.  Must not allocate or evict (``prefixes.cache``)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from bladed.io import StagingBuffer
from bladed.protocol import IORange, RangeResult
from bladed.residency.geometry import Geometry
from bladed.residency.planner import KPU, Plan
from bladed.server.storage import ExtentKPUStore, PageCacheKPUStore
from bladed.server.storage.channel import Channel
from bladed.server.storage.integrity import row_crcs
from bladed.server.storage.journal import RetainedRecord


class SessionKV(Protocol):
    """What the prefix cache uses of a session (``sessions.session.ServedSession``)."""

    id: str
    geometry: Geometry
    prefix_key: tuple[str, str] | None

    def transfer(self, ch: Channel, ranges: Sequence[IORange]) -> list[RangeResult]: ...

    def filled_tokens(self) -> int: ...

    def count_written(self, written: Mapping[str, int]) -> None:
        """Device bytes written for the session on a channel of the daemon's (a prefix copied into it)."""


class RetainedPrefix:
    """One retained prefix: its key, its own storage (page-cache files and/or an extent) and its checksums."""

    def __init__(self, rec: RetainedRecord, plan: Plan, pagecache: PageCacheKPUStore, extent_store: ExtentKPUStore,
                 crcs: np.ndarray) -> None:
        self.rec = rec
        self.plan = plan
        self.pagecache = pagecache
        self.extent_store = extent_store
        #: crc32c of each (tensor, block): ``crcs[tid, b]`` covers the block's token rows of that KPU
        self.crcs = crcs
        self.last_used = time.time()
        self.hits = 0
        self.users = 0            # copies out of it in progress: not evictable meanwhile
        self.bad = False          # found corrupt while in use: out of the index, dropped by its last user
        #: one copy out of the entry at a time: its extent store assembles edge LBAs in one scratch buffer
        self.copy_lock = threading.Lock()

    def matches(self, scope: str, seed_hex: str, block_tokens: int) -> bool:
        """Same scope, same key seed (model, dtype, KV shape), same block size."""
        r = self.rec
        return r.scope == scope and r.seed == seed_hex and r.block_tokens == block_tokens

    @property
    def id(self) -> str:
        return self.rec.id

    @property
    def tokens(self) -> int:
        return len(self.rec.hashes) * self.rec.block_tokens

    @property
    def pagecache_bytes(self) -> int:
        return sum(k.pagecache_bytes for k in self.plan.pagecache_kpus())

    @property
    def device_bytes(self) -> int:
        ext = self.extent_store.extent
        return 0 if ext is None else ext.nblocks * self.plan.lba_size

    def store_of(self, kpu: KPU) -> PageCacheKPUStore | ExtentKPUStore:
        return self.extent_store if self.extent_store.holds(kpu.tensor_id) else self.pagecache

    def describe(self) -> dict[str, Any]:
        r = self.rec
        return {"entry": r.id, "scope": r.scope, "model": r.model, "dtype": r.dtype, "tokens": self.tokens,
                "block_tokens": r.block_tokens, "layers": r.geometry["layers"],
                "pagecache_bytes": self.pagecache_bytes, "device_bytes": self.device_bytes,
                "hits": self.hits, "created": r.created, "last_used": self.last_used, "in_use": self.users}


@dataclass
class Lookup:
    """What :meth:`PrefixCache.lookup` found for a prefix key: the entry (held) and how many blocks match."""

    model: str
    dtype: str
    ntokens: int
    entry: RetainedPrefix | None
    blocks: int
    #: the verified blocks the shared tier gave (used instead of ``entry`` when it reaches further)
    remote: list[bytes] = field(default_factory=list)


def crc_path(state_dir: str, entry_id: str) -> str:
    return os.path.join(state_dir, "prefixes", f"{entry_id}.crc")


def block_crcs(slot: StagingBuffer, blocks: int, block_bytes: int) -> np.ndarray:
    """crc32c of each of ``blocks`` consecutive ``block_bytes`` blocks at the start of ``slot``."""
    return row_crcs(slot.view(), 0, blocks, block_bytes)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["Lookup", "RetainedPrefix", "SessionKV", "block_crcs", "crc_path", "fsync_file"]
