"""The page-cache path: each KPU is a file in the session's page-cache directory, mmap'd by the daemon (or a
memory file, ``memory=True``: Dual-Blade's Group 1 with ``pagecache.backing = "memory"``, which the kernel never
writes back; ``bladed.io.pagecache``).

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
from bladed.server.storage.base import Access, ChannelIO, KPUStore
from bladed.server.storage.gates import KPUGates

log = logging.getLogger("bladed.session")

#: prefix of a session's page-cache directory (start-up removes what a crashed instance left)
SESSION_DIR_PREFIX = "session-"
#: prefix of a retained prefix's page-cache directory (start-up keeps those the journal lists as ready)
RETAINED_DIR_PREFIX = "prefix-"


class PageCacheKPUStore(KPUStore):
    """One session's (or retained prefix's) page-cache files: created with it, removed at its end."""

    path: ClassVar[KVPath] = KVPath.PAGECACHE

    def __init__(self, root: str, owner_id: str, kpus: Iterable[KPU], *, dir_prefix: str = SESSION_DIR_PREFIX,
                 memory: bool = False) -> None:
        self._kpus = {k.tensor_id: k for k in kpus}
        #: the files are in memory (no directory): only a session's, never a retained prefix's (those stay for
        #: the next start, on disk)
        self.memory = memory
        self.directory = os.path.join(root, dir_prefix + owner_id) if self._kpus and not memory else ""
        self._files: dict[int, PageCacheFile] = {}
        self._store: PageCacheStore | None = None
        self._lock = threading.Lock()

    def create(self, *, keep_existing: bool = False) -> None:
        """Make the directory and bind one (not yet materialized) file per KPU.

        ``keep_existing``: the files are already there (a retained prefix after a restart): keep their bytes.
        """
        if not self._kpus:
            return
        if self.memory:
            self._store = PageCacheStore(None, memory=True)
        else:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            self._store = PageCacheStore(self.directory, clean_stale=not keep_existing)
        for k in self._kpus.values():
            self._files[k.tensor_id] = self._store.open(k.name, k.nbytes)

    def cached_bytes(self) -> int:
        """Bytes of these KPUs' files now in the page cache (part of the cgroup's mapped page cache; for memory
        files, of its shmem)."""
        store = self._store          # a concurrent close() drops it
        return store.cached_bytes() if store is not None else 0

    def holds(self, tensor_id: int) -> bool:
        return tensor_id in self._files

    def offer_gate(self, kpu: KPU, gates: KPUGates) -> bool:
        """A page-cache KPU may be served by the lane once its file exists, unless it is dropped after use
        (its pages go after every access: the general path's)."""
        t = kpu.tensor_id
        if kpu.drop_after_use or not self.holds(t):
            return True
        f = self.file(t)
        if f.lost is not None:
            return True         # never the lane's: its reads go where they fail (PageCacheFile.lose)
        return f.materialized and gates.open(t, f.fd, f.address, f.nbytes)

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
                a.fail(ErrorCode.IO_ERROR, range_failure(a.write, a.kpu.name, e))
                continue
            a.served(KVPath.PAGECACHE, t0, hit)
        del keep

    def file_paths(self) -> list[str]:
        """The path of every KPU's file."""
        return [f.path for f in self._files.values()]

    def sync(self) -> None:
        """Write every materialized file's dirty pages to storage and wait (a retained prefix before it is ready)."""
        for f in list(self._files.values()):
            if f.materialized:
                f.sync()

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

    def close(self, *, remove: bool = True) -> int:
        """Unmap every file, and remove the files and the directory unless ``remove`` is False (a retained
        prefix at a clean stop: its files stay for the next start); returns how many files there were."""
        with self._lock:
            files, self._files = list(self._files.values()), {}
        for f in files:
            try:
                if not remove and f.materialized:
                    f.sync()
                f.close(unlink=remove)
            except OSError as e:
                log.warning("closing page-cache file %s failed: %s", f.path, e)
        if self._store is not None:
            self._store.close()
            self._store = None
        if self.directory and remove:
            shutil.rmtree(self.directory, ignore_errors=True)
        return len(files)


def range_failure(write: bool, name: str, e: Exception) -> str:
    """The message of a page-cache range that failed."""
    return f"page-cache {'write' if write else 'read'} of {name}: {e}"


def sweep_pagecache(root: str, keep: Iterable[str] = ()) -> int:
    """Remove the session and retained-prefix directories a previous instance left in ``root``, except the
    directories in ``keep``; returns how many."""
    n = 0
    kept = {os.path.abspath(d) for d in keep if d}
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        return 0
    for name in entries:
        if name.startswith((SESSION_DIR_PREFIX, RETAINED_DIR_PREFIX)) and os.path.abspath(
                os.path.join(root, name)) not in kept:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            n += 1
    return n


__all__ = ["RETAINED_DIR_PREFIX", "SESSION_DIR_PREFIX", "PageCacheKPUStore", "range_failure", "sweep_pagecache"]
