"""The page-cache path (Group 1): one mmap'd file per KPU.

A read is one ``memmove`` out of the file's shared mapping (ctypes, which
releases the GIL); a write is a ``pwrite(2)`` into the page cache, so that
pages are never dirtied through the mapping (why: :meth:`PageCacheFile.write_from`).
Before each read the exact range is
checked with ``cachestat(2)`` (kernel 6.5+; ``mincore(2)`` on the mapping
otherwise), which gives the paper's hit ratio: the fraction of read bytes
served from the page cache.

Files are created lazily on first access (the "materialize" step of §IV-A)
and their blocks reserved with ``fallocate``, so that a full filesystem shows
as an error at that point and never as a SIGBUS in the middle of a copy.

A *memory* store (``PageCacheStore(None, memory=True)``) keeps its files in
memory (``memfd_create``: shmem, no directory, no disk): the kernel never
writes their pages back, so KV planned to stay in memory costs the drive
nothing, and they go with the process; but the kernel cannot reclaim them
either (without swap), so the daemon's live demotion is their eviction path.
``fallocate`` charges their memory at once, so a memory cgroup without room
refuses it there (ENOMEM / ENOSPC) and never in the middle of a copy.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from bladed._uring import ffi, lib
from bladed.io.errors import BladedIOError, TargetRangeError, errno_error
from bladed.io.uring import StagingBuffer
from bladed.sizes import PAGE_SIZE, align_up

log = logging.getLogger(__name__)

SYNC_FILE_RANGE_WAIT_BEFORE = 1
SYNC_FILE_RANGE_WRITE = 2
SYNC_FILE_RANGE_WAIT_AFTER = 4
#: fallocate(2) modes (<linux/falloc.h>)
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
SUFFIX = ".kv"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,200}$")

_libc = ctypes.CDLL(None, use_errno=True)
_mincore = _libc.mincore
_mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_mincore.restype = ctypes.c_int


@dataclass(frozen=True)
class CacheStat:
    """``struct cachestat`` of a file range, in pages."""

    cache: int
    dirty: int
    writeback: int
    evicted: int
    recently_evicted: int


_cachestat_ok: bool | None = None


def cachestat(fd: int, offset: int, nbytes: int) -> CacheStat | None:
    """``cachestat(2)`` of ``[offset, offset + nbytes)``; None where the kernel lacks it."""
    global _cachestat_ok
    if _cachestat_ok is False:
        return None
    out = ffi.new("uint64_t[5]")
    ret = lib.bd_cachestat(fd, offset, nbytes, out)
    if ret in (-errno.ENOSYS, -errno.EPERM) and _cachestat_ok is None:
        # ENOSYS: kernel < 6.5, or a seccomp filter that answers so; EPERM: a filter that denies it
        log.info("cachestat(2) unavailable (%s: kernel < 6.5 or a seccomp filter); measuring residency with "
                 "mincore(2)", errno.errorcode[-ret])
        _cachestat_ok = False
        return None
    if ret < 0:
        raise errno_error(-ret, f"cachestat of [{offset}, {offset + nbytes})")
    _cachestat_ok = True
    return CacheStat(*ffi.unpack(out, 5))


def _pages(offset: int, nbytes: int) -> int:
    return (offset + nbytes - 1) // PAGE_SIZE - offset // PAGE_SIZE + 1 if nbytes > 0 else 0


def _address(obj: Any, nbytes: int, offset: int, writable: bool) -> tuple[int, Any]:
    """Address of ``obj[offset:offset+nbytes]`` (a StagingBuffer, a buffer or a raw int address)."""
    if isinstance(obj, int) and not isinstance(obj, bool):
        if obj <= 0:
            raise ValueError(f"invalid buffer address {obj}")
        return obj + offset, None
    if isinstance(obj, StagingBuffer):
        base, size, keep = obj.address, obj.nbytes, obj.memory()  # the memory itself: outlives a close()
    else:
        cbuf = ffi.from_buffer(obj, require_writable=writable)
        base, size, keep = int(ffi.cast("uintptr_t", cbuf)), len(cbuf), cbuf
    if offset < 0 or offset + nbytes > size:
        raise ValueError(f"buffer range [{offset}, {offset + nbytes}) outside a {size}-byte buffer")
    return base + offset, keep


class PageCacheFile:
    """One KPU's file on the page-cache path: mmap'd, materialized on first access (in memory for a memory
    store: its :attr:`path` is then ``memfd:<name>``, a name for messages only)."""

    def __init__(self, store: PageCacheStore, name: str, nbytes: int) -> None:
        self.store = store
        self.name = name
        self.nbytes = nbytes
        self.memory = store.memory
        self.path = f"memfd:{name}" if store.memory else os.path.join(store.directory, name + SUFFIX)
        self.fd = -1
        self._mm: mmap.mmap | None = None
        self._cbuf: Any = None
        self._base = 0
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._users = 0              # copies in progress: close() waits for them before unmapping
        self._closed = False
        #: why the file's bytes are gone (a demotion freed them and could not read them back), or None
        self.lost: str | None = None
        self.bytes_read = 0
        self.bytes_hit = 0
        self.bytes_written = 0

    @property
    def materialized(self) -> bool:
        return self._mm is not None

    @property
    def address(self) -> int:
        """Where the file is mapped (0 until it is materialized)."""
        return self._base

    def _materialize(self) -> None:
        with self._lock:
            if self._mm is not None:
                return
            if self._closed:
                raise BladedIOError(errno.EBADF, f"{self.path}: file is closed")
            if self.memory:
                fd = os.memfd_create(f"bladed-kv-{self.name}", os.MFD_CLOEXEC)
            else:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                # reserved (a full filesystem, or a memory cgroup without room for a memory file, is an error
                # here, not a SIGBUS in the middle of a request), and measured faster than a sparse file for the
                # prefill's writes (1.36 vs 1.82 s, docs/benchmarks.md)
                ret = lib.bd_fallocate(fd, 0, 0, self.nbytes)
                if ret == -errno.EOPNOTSUPP:
                    os.ftruncate(fd, self.nbytes)
                elif ret < 0:
                    raise errno_error(-ret, f"reserving {self.nbytes} bytes for {self.path}")
                mm = mmap.mmap(fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                os.close(fd)
                if not self.memory:
                    with contextlib.suppress(OSError):
                        os.unlink(self.path)
                raise
            self.fd = fd
            self._cbuf = ffi.from_buffer(mm)
            self._base = int(ffi.cast("uintptr_t", self._cbuf))
            self._mm = mm

    def _bounds(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise TargetRangeError(errno.ERANGE,
                                  f"{self.path}: range [{offset}, {offset + nbytes}) outside {self.nbytes} bytes")

    def _enter(self) -> None:
        """Keep the mapping alive (against a concurrent close) until :meth:`_leave`."""
        with self._lock:
            if self._closed:
                raise BladedIOError(errno.EBADF, f"{self.path}: file is closed")
            if self.lost is not None:
                raise BladedIOError(errno.EIO, f"{self.path}: the KV is lost: {self.lost}")
            if self._mm is None:
                self._materialize()
            self._users += 1

    def _leave(self, read: int = 0, hit: int = 0, written: int = 0) -> None:
        with self._lock:
            self._users -= 1
            self.bytes_read += read
            self.bytes_hit += hit
            self.bytes_written += written
            if self._users == 0 and self._closed:
                self._idle.notify_all()

    @contextlib.contextmanager
    def _use(self) -> Iterator[None]:
        """:meth:`_enter` ... :meth:`_leave` as a context (for the paths that are not per request)."""
        self._enter()
        try:
            yield
        finally:
            self._leave()

    def residency(self, offset: int = 0, nbytes: int | None = None) -> float:
        """Fraction of the pages of ``[offset, offset + nbytes)`` now in the page cache."""
        n = self.nbytes - offset if nbytes is None else nbytes
        self._bounds(offset, n)
        pages = _pages(offset, n)
        if pages == 0:
            return 1.0
        if self._mm is None:
            return 0.0
        with self._use():
            return self._residency(offset, n, pages)

    def cached_bytes(self) -> int:
        """Bytes of the file now in the page cache; 0 before it is materialized (not mapped, none of it ours)."""
        with self._lock:
            if self._mm is None or self._closed:
                return 0
            self._users += 1
        try:
            return self._cached_pages(0, self.nbytes) * PAGE_SIZE
        finally:
            self._leave()

    def _residency(self, offset: int, nbytes: int, pages: int) -> float:
        return self._cached_pages(offset, nbytes) / pages

    def _cached_pages(self, offset: int, nbytes: int) -> int:
        """Pages of ``[offset, offset + nbytes)`` in the page cache: cachestat(2), or mincore(2) of the mapping."""
        cs = cachestat(self.fd, offset, nbytes)
        if cs is not None:
            return min(cs.cache, _pages(offset, nbytes))
        return self._mincore(offset, nbytes)

    def _mincore(self, offset: int, nbytes: int) -> int:
        start = offset - offset % PAGE_SIZE
        pages = _pages(offset, nbytes)
        vec = (ctypes.c_ubyte * pages)()
        if _mincore(self._base + start, pages * PAGE_SIZE, vec) != 0:
            e = ctypes.get_errno()
            raise errno_error(e, f"mincore of {self.path}")
        return int(np.count_nonzero(np.frombuffer(memoryview(vec).cast("B"), np.uint8) & 1))

    def read_into(self, dst: Any, file_offset: int, nbytes: int, *, dst_offset: int = 0) -> float:
        """Copy ``[file_offset, file_offset + nbytes)`` into ``dst``; return the page-cache hit ratio.

        The ratio is measured on the exact range before the copy.  ``dst`` is a
        StagingBuffer, a writable buffer, or a raw address.
        """
        self._bounds(file_offset, nbytes)
        addr, keep = _address(dst, nbytes, dst_offset, writable=True)
        self._enter()
        ratio = 1.0
        try:
            ratio = self._copy_out(addr, file_offset, nbytes)
        finally:
            hit = round(ratio * nbytes)
            self._leave(read=nbytes, hit=hit)
        del keep
        self.store._account(read=nbytes, hit=hit)
        return ratio

    def write_from(self, src: Any, file_offset: int, nbytes: int, *, src_offset: int = 0) -> None:
        """Copy ``nbytes`` from ``src`` (StagingBuffer, buffer or address) into the file."""
        self._bounds(file_offset, nbytes)
        addr, keep = _address(src, nbytes, src_offset, writable=False)
        self._enter()
        try:
            self._copy_in(addr, file_offset, nbytes)
        finally:
            self._leave(written=nbytes)
        del keep
        self.store._account(written=nbytes)

    def _copy_out(self, addr: int, file_offset: int, nbytes: int) -> float:
        """Copy the range from the mapping to ``addr``; the fraction that was resident (measured first)."""
        assert self._mm is not None
        ratio = self._residency(file_offset, nbytes, _pages(file_offset, nbytes)) if nbytes else 1.0
        if ratio < 1.0:
            # start reading the whole range now rather than fault by fault
            start = file_offset - file_offset % PAGE_SIZE
            with contextlib.suppress(OSError):
                self._mm.madvise(mmap.MADV_WILLNEED, start, file_offset + nbytes - start)
        ctypes.memmove(addr, self._base + file_offset, nbytes)
        return ratio

    def _copy_in(self, addr: int, file_offset: int, nbytes: int) -> None:
        # pwrite, not a store through the mapping: in a cgroup-v1 memcg at its limit, files written through
        # mappings kept open went to disk whole while being written (1776 of 1920 MiB), with pwrite
        # 272-528 MiB (docs/benchmarks.md, "Prefill below the full-fit limit")
        ret = lib.bd_pwrite_full(self.fd, addr, nbytes, file_offset)
        if ret < 0:
            raise self.write_error(-ret, file_offset, nbytes)

    @contextlib.contextmanager
    def mapped(self) -> Iterator[Any]:
        """The file's mapping (its whole pages) as a writable buffer, for the engine to write to the device from
        or read into (a live demotion, and its undoing); a concurrent :meth:`close` waits meanwhile."""
        with self._use():
            yield ffi.buffer(ffi.cast("char *", self._base), align_up(self.nbytes, PAGE_SIZE))

    def lose(self, why: str) -> None:
        """Its bytes are gone (``why``): every later read or write of it fails with EIO, none returns zeroes."""
        with self._lock:
            self.lost = why
        log.error("%s: the KV is lost: %s", self.path, why)

    def punch(self, offset: int, nbytes: int) -> None:
        """Free the pages of ``[offset, offset + nbytes)`` (page aligned, or to the end) now: they read as zeroes
        afterwards.

        A live demotion gives a memory file's memory back as each part of it reaches the device, not once the
        whole KPU has (a KPU of OPT-6.7B at batch 32 is 272 MiB: over 100 ms of writes)."""
        if offset % PAGE_SIZE or (nbytes % PAGE_SIZE and offset + nbytes < self.nbytes):
            raise ValueError(f"{self.path}: punch of [{offset}, {offset + nbytes}) is not page aligned")
        with self._use():
            ret = lib.bd_fallocate(self.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, nbytes)
            if ret < 0:
                raise errno_error(-ret, f"freeing [{offset}, {offset + nbytes}) of {self.path}")

    def write_error(self, err: int, file_offset: int, nbytes: int) -> BladedIOError:
        """The error of a write of ``[file_offset, file_offset + nbytes)`` that failed with errno ``err`` (here
        or in the daemon's lane, which writes in C)."""
        return errno_error(err, f"write of [{file_offset}, {file_offset + nbytes}) to {self.path}")

    def drop(self, offset: int = 0, nbytes: int | None = None) -> None:
        """Evict the range from the page cache (CachePolicy-Only's proactive eviction).

        Our own mapping must let go first (``fadvise`` skips mapped pages), then
        dirty pages are written back and waited for (``fadvise`` skips dirty and
        writeback pages too), then the clean pages are dropped.
        """
        if self._mm is None:
            return
        if self.memory:   # its pages are the only copy of the KV: a memory file is demoted, never dropped
            raise BladedIOError(errno.EINVAL, f"{self.path}: a memory file's pages cannot be dropped")
        n = self.nbytes - offset if nbytes is None else nbytes
        self._bounds(offset, n)
        start = offset - offset % PAGE_SIZE
        end = min(self.nbytes, align_up(offset + n, PAGE_SIZE))
        if end <= start:
            return
        with self._use():
            assert self._mm is not None
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)
            ret = lib.bd_sync_file_range(
                self.fd, start, end - start,
                SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER)
            if ret < 0:
                raise errno_error(-ret, f"sync_file_range of {self.path}")
            os.posix_fadvise(self.fd, start, end - start, os.POSIX_FADV_DONTNEED)
        self.store._account(dropped=end - start)

    def sync(self) -> None:
        """Write the file's dirty pages to storage and wait for them (``msync`` + ``fsync``)."""
        with self._use():
            assert self._mm is not None
            self._mm.flush()
            os.fsync(self.fd)

    def close(self, unlink: bool = True) -> None:
        """Unmap and close; remove the file unless ``unlink`` is False.  Idempotent.

        Waits for copies in progress in other threads; later calls raise EBADF.
        """
        with self._lock:
            self._closed = True
            while self._users:
                self._idle.wait()
            if self._mm is not None:
                ffi.release(self._cbuf)
                self._cbuf = None
                self._mm.close()
                self._mm = None
                self._base = 0
            if self.fd >= 0:
                if unlink and not self.memory:
                    # the KV goes with the file: truncating drops its pages, dirty ones too, without writing them
                    # back (fadvise(DONTNEED), used before, first writes every dirty page to disk: a closed
                    # 2 GiB session cost 2 GiB of disk writes) and frees its blocks now
                    with contextlib.suppress(OSError):
                        os.ftruncate(self.fd, 0)
                os.close(self.fd)
            self.fd = -1
        if unlink and not self.memory:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self.store._forget(self)

    def __enter__(self) -> PageCacheFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "materialized" if self.materialized else "bound"
        return f"<PageCacheFile {self.path} {self.nbytes} bytes {state}>"


class PageCacheStore:
    """The page-cache directory of one daemon: files, stale-file cleanup, hit statistics.

    The directory is locked (``flock`` on ``.lock``) so two daemons never share
    it; files with the store's suffix left by a previous run are removed when
    the lock is taken. ``memory``: the files are in memory (module docstring) and ``directory`` is None:
    there is nothing to lock or clean up, memory files go with the process.
    """

    def __init__(self, directory: str | None, *, clean_stale: bool = True, memory: bool = False) -> None:
        if (directory is None) != memory:
            raise ValueError("a memory store has no directory, a disk store needs one")
        self.memory = memory
        self.directory = "" if directory is None else os.path.abspath(os.fspath(directory))
        self._lockfd = -1
        self._lock = threading.Lock()
        self._files: dict[str, PageCacheFile] = {}
        self.reads = 0
        self.bytes_read = 0
        self.bytes_hit = 0
        self.bytes_written = 0
        self.bytes_dropped = 0
        self.stale_removed = 0
        if memory:
            return
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        self._lockfd = os.open(os.path.join(self.directory, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lockfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lockfd)
            raise BladedIOError(errno.EBUSY, f"{self.directory} is in use by another page-cache store") from None
        self.stale_removed = self.cleanup_stale() if clean_stale else 0

    def cleanup_stale(self) -> int:
        """Remove KV files not open in this store (left by a crashed run); return how many."""
        if self.memory:
            return 0
        removed = 0
        with self._lock:
            live = {f.path for f in self._files.values()}
        for entry in os.scandir(self.directory):
            if entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False) and entry.path not in live:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed += 1
        if removed:
            log.info("removed %d stale page-cache files from %s", removed, self.directory)
        return removed

    def open(self, name: str, nbytes: int) -> PageCacheFile:
        """Bind a file for one KPU (created on first access)."""
        if not _NAME.match(name):
            raise ValueError(f"invalid page-cache file name {name!r} (letters, digits, '_', '-', '.')")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"file size must be a positive int, got {nbytes!r}")
        with self._lock:
            if name in self._files:
                raise FileExistsError(errno.EEXIST, "page-cache file already open", name)
            f = PageCacheFile(self, name, nbytes)
            self._files[name] = f
            return f

    @property
    def files(self) -> list[PageCacheFile]:
        with self._lock:
            return list(self._files.values())

    def cached_bytes(self) -> int:
        """Bytes of the store's mapped files now in the page cache."""
        return sum(f.cached_bytes() for f in self.files)

    def _forget(self, f: PageCacheFile) -> None:
        with self._lock:
            if self._files.get(f.name) is f:
                del self._files[f.name]

    def _account(self, read: int = 0, hit: int = 0, written: int = 0, dropped: int = 0) -> None:
        with self._lock:
            if read:
                self.reads += 1
            self.bytes_read += read
            self.bytes_hit += hit
            self.bytes_written += written
            self.bytes_dropped += dropped

    @property
    def hit_fraction(self) -> float:
        """Fraction of read bytes served from the page cache (the paper's hit ratio), 1.0 before any read."""
        with self._lock:
            return self.bytes_hit / self.bytes_read if self.bytes_read else 1.0

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "directory": self.directory,
                "memory": self.memory,
                "files": len(self._files),
                "materialized": sum(1 for f in self._files.values() if f.materialized),
                "reads": self.reads,
                "bytes_read": self.bytes_read,
                "bytes_hit": self.bytes_hit,
                "hit_fraction": self.bytes_hit / self.bytes_read if self.bytes_read else 1.0,
                "bytes_written": self.bytes_written,
                "bytes_dropped": self.bytes_dropped,
            }

    def reset_stats(self) -> None:
        with self._lock:
            self.reads = self.bytes_read = self.bytes_hit = self.bytes_written = self.bytes_dropped = 0

    def close(self) -> None:
        """Close (and remove) every file, release the directory."""
        for f in self.files:
            f.close()
        if self._lockfd >= 0:
            os.close(self._lockfd)
            self._lockfd = -1

    def __enter__(self) -> PageCacheStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
