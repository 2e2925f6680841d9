"""The page-cache path: each KPU is a file in the session's page-cache directory, mmap'd by the daemon.

Group 1 lives here (kept resident within the budget ``B_pc``, Eq. 1-2), and in
``baseline``/``cachepolicy`` every KPU (CachePolicy-Only drops Group 2's pages
right after each use, Table III).  A request copies between the channel's
staging slot and the mapping: one ``memmove`` per range.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Iterable
from typing import ClassVar

from bladed.io import BladedIOError
from bladed.io.pagecache import PageCacheFile, PageCacheStore
from bladed.protocol import ErrorCode
from bladed.residency.planner import KPU, KVPath
from bladed.server.stores.base import Access, ChannelIO, KPUStore

log = logging.getLogger("bladed.session")

#: prefix of a session's page-cache directory (start-up removes what a crashed instance left)
SESSION_DIR_PREFIX = "session-"


class PageCacheKPUStore(KPUStore):
    """One session's page-cache files: created with the session, removed at its end."""

    path: ClassVar[KVPath] = KVPath.PAGECACHE

    def __init__(self, root: str, session_id: str, kpus: Iterable[KPU]) -> None:
        self._kpus = {k.tensor_id: k for k in kpus}
        self.directory = os.path.join(root, SESSION_DIR_PREFIX + session_id) if self._kpus else ""
        self._files: dict[int, PageCacheFile] = {}
        self._store: PageCacheStore | None = None
        self._lock = threading.Lock()

    def create(self) -> None:
        """Make the directory and bind one (not yet materialized) file per KPU."""
        if not self._kpus:
            return
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        self._store = PageCacheStore(self.directory)
        for k in self._kpus.values():
            self._files[k.tensor_id] = self._store.open(k.name, k.nbytes)

    def holds(self, tensor_id: int) -> bool:
        return tensor_id in self._files

    @property
    def file_count(self) -> int:
        return len(self._files)

    def run(self, ch: ChannelIO, accesses: list[Access]) -> None:
        slot = ch.slot
        base, keep = slot.address, slot.memory()     # the slot's memory stays mapped until we are done
        for a in accesses:
            t0 = time.monotonic_ns()
            f = self._files[a.kpu.tensor_id]
            try:
                if a.write:
                    f.write_from(base + a.slot_offset, a.offset, a.nbytes)
                    hit = None
                else:
                    hit = round(f.read_into(base + a.slot_offset, a.offset, a.nbytes) * a.nbytes)
                if a.kpu.drop_after_use:
                    # CachePolicy-Only (Table III): Group 2 is evicted right after use
                    f.drop()
            except (OSError, BladedIOError) as e:
                a.fail(ErrorCode.IO_ERROR, f"page-cache {a.op.name.lower()} of {a.kpu.name}: {e}")
                continue
            a.served(KVPath.PAGECACHE, t0, hit)
        del keep

    def drop(self, tensor_id: int) -> None:
        """Evict one KPU's pages now (a CachePolicy-Only demotion)."""
        self._files[tensor_id].drop()

    def file(self, tensor_id: int) -> PageCacheFile:
        """One KPU's file (a live demotion copies from it before :meth:`detach`)."""
        return self._files[tensor_id]

    def detach(self, tensor_id: int) -> PageCacheFile:
        """Hand one KPU's file over (a live demotion copies it to the extent, then closes it)."""
        with self._lock:
            f = self._files.pop(tensor_id)
            del self._kpus[tensor_id]
            return f

    def close(self) -> int:
        """Unmap and remove every file and the directory; returns how many files there were."""
        with self._lock:
            files, self._files = list(self._files.values()), {}
        for f in files:
            try:
                f.close(unlink=True)
            except OSError as e:
                log.warning("removing page-cache file %s failed: %s", f.path, e)
        if self._store is not None:
            self._store.close()
            self._store = None
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)
        return len(files)

    def describe(self) -> dict[str, object]:
        return {"kpus": len(self._files), "directory": self.directory,
                "bytes": sum(self._kpus[t].pagecache_bytes for t in self._files)}


def sweep_pagecache(root: str) -> int:
    """Remove session directories a previous instance left in ``root``; returns how many."""
    n = 0
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        return 0
    for name in entries:
        if name.startswith(SESSION_DIR_PREFIX):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            n += 1
    return n


__all__ = ["SESSION_DIR_PREFIX", "PageCacheKPUStore", "sweep_pagecache"]
