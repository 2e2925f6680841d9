"""Python face of the C engine: staging memory, rings and transfers.

The submit/reap loop, the Eq. 7-11 chunking and SQE preparation are in C
(``cffi_build/bladed_uring.c``); Python touches each *transfer* (one tensor or
index range) once on the way in and once on the way out, never each chunk.
cffi releases the GIL for every call into the extension, so channels run in
parallel threads.
"""

from __future__ import annotations

import enum
import errno
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from bladed._uring import ffi, lib
from bladed.io import engines
from bladed.io.errors import (
    AlignmentError,
    BladedIOError,
    InvalidRequestError,
    NVMeStatusError,
    ShortTransferError,
    TargetRangeError,
    errno_error,
)
from bladed.sizes import PAGE_SIZE, align_up

log = logging.getLogger(__name__)

#: a 2 MiB huge page
HUGE_PAGE_SIZE = 2 << 20


class Op(enum.IntEnum):
    """What a transfer does (values shared with the C engine)."""

    READ = lib.BD_OP_READ
    WRITE = lib.BD_OP_WRITE
    DISCARD = lib.BD_OP_DISCARD
    WRITE_ZEROES = lib.BD_OP_WRITE_ZEROES


class HugePages(enum.Enum):
    """How a staging buffer is backed."""

    NONE = 0
    THP = 1       # 2 MiB aligned, MADV_HUGEPAGE asked (the kernel may or may not oblige)
    HUGETLB = 2   # MAP_HUGETLB: guaranteed 2 MiB pages


def _flat(obj: Any) -> memoryview:
    """A 1-D writable byte memoryview over ``obj`` that keeps it alive (and, if it can resize, pinned).

    Never a cffi object holding a buffer export *of a memoryview*: when such a
    pair ends up in cyclic garbage, the collector may clear the exported
    memoryview first, and releasing the export afterwards crashes CPython
    (``memory_clear`` drops the view's managed buffer). A memoryview is sliced
    instead (its slices share its buffer); other exporters go through
    ``ffi.from_buffer``, which is safe to clear in any order.
    """
    if isinstance(obj, memoryview):
        if obj.readonly:
            raise TypeError("the buffer is read-only; I/O needs writable memory")
        if not obj.c_contiguous:
            raise ValueError("the buffer is not contiguous; I/O needs one contiguous range")
        # our own view of the same buffer: the caller may release() theirs
        return obj[:] if obj.ndim == 1 and obj.format == "B" else obj.cast("B")
    return memoryview(ffi.buffer(ffi.from_buffer(obj, require_writable=True)))


def _address_of(flat: memoryview) -> int:
    with ffi.from_buffer(flat) as c:            # released on the spot: see _flat
        return int(ffi.cast("uintptr_t", c))


def buffer_address(obj: Any) -> tuple[int, int, Any]:
    """(address, length, keep-alive) of a StagingBuffer or a writable buffer-protocol object.

    The keep-alive holds the memory itself, so a transfer in flight keeps its
    buffer mapped even if the StagingBuffer is closed meanwhile.
    """
    if isinstance(obj, StagingBuffer):
        return obj.address, obj.nbytes, obj.memory()
    flat = _flat(obj)
    return _address_of(flat), len(flat), flat


def _unmapper(nbytes: int) -> Any:
    def unmap(ptr: Any) -> None:
        lib.bd_staging_free(ptr, nbytes)
    return unmap


class StagingBuffer:
    """Page-aligned host memory for DMA, huge-page backed where the size allows.

    Either owned (allocated here with ``bd_staging_alloc``) or a view of
    memory owned by someone else (``StagingBuffer.wrap``: e.g. a client's
    memfd mapped by the daemon).

    The buffer holds one memoryview of its whole memory until :meth:`close`;
    every :meth:`view` is a slice of it, and transfers in flight and rings it
    is registered with hold it too. Owned memory is unmapped (wrapped memory
    released) when the last of those lets go, so a view taken before
    ``close()`` stays valid (never a dangling pointer); after ``close()`` the
    buffer itself refuses new views and addresses with ``ValueError``.
    """

    def __init__(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"staging buffer size must be positive, got {nbytes}")
        size = align_up(nbytes, PAGE_SIZE)
        how = ffi.new("int *")
        ptr = lib.bd_staging_alloc(size, how)
        if ptr == ffi.NULL:
            raise MemoryError(f"cannot map {size} bytes of staging memory")
        # the cffi buffer references the ffi.gc pointer: munmap when the last view goes
        self._whole: memoryview | None = memoryview(ffi.buffer(ffi.gc(ptr, _unmapper(size), size), size))
        self._address = int(ffi.cast("uintptr_t", ptr))
        self.nbytes = size
        self.huge = HugePages(how[0])

    @classmethod
    def wrap(cls, obj: Any) -> StagingBuffer:
        """A StagingBuffer over existing writable memory (never freed by us; its views keep ``obj`` alive)."""
        self = cls.__new__(cls)
        self._whole = _flat(obj)
        self._address = _address_of(self._whole)
        self.nbytes = len(self._whole)
        self.huge = HugePages.NONE
        return self

    def memory(self) -> memoryview:
        """The memoryview of the whole buffer: whoever holds it (or a slice of it) keeps the memory mapped."""
        whole = self._whole
        if whole is None:
            raise ValueError(f"staging buffer of {self.nbytes} bytes is closed; take views and addresses "
                             f"before close() (those taken earlier stay valid)")
        return whole

    @property
    def address(self) -> int:
        """Start address of the memory (ValueError once closed)."""
        self.memory()
        return self._address

    def view(self, offset: int = 0, nbytes: int | None = None) -> memoryview:
        """A writable memoryview of ``[offset, offset + nbytes)`` that keeps the memory alive."""
        whole = self.memory()
        n = self.nbytes - offset if nbytes is None else nbytes
        if offset < 0 or n < 0 or offset + n > self.nbytes:
            raise ValueError(f"view [{offset}, {offset + n}) outside a {self.nbytes}-byte buffer")
        return whole[offset:offset + n]

    def close(self) -> None:
        """Let go of the memory; owned memory is unmapped once no view or transfer holds it. Idempotent."""
        self._whole = None

    def __enter__(self) -> StagingBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def request_error(why: int, target: Any, op: int, slba: int, nbytes: int, what: str, *,
                  address: int = 0, offset: int = 0) -> BladedIOError:
    """The exception for a request the C engine refused (``why``: its enum bd_bad)."""
    err = errno.EOVERFLOW if why in (lib.BD_BAD_LBA_RANGE, lib.BD_BAD_BUFFER_RANGE) else errno.EINVAL
    if why == lib.BD_BAD_TARGET:
        kind = "none" if target == ffi.NULL else str(int(target.kind))
        return InvalidRequestError(err, f"{what}: target kind {kind} is not file (0), block (1) or nvme (2)")
    if why == lib.BD_BAD_OP:
        return InvalidRequestError(err, f"{what}: op {op} is not read (0), write (1), discard (2) or "
                                        f"write zeroes (3)")
    shift = int(target.lba_shift)
    if why == lib.BD_BAD_LBA_SHIFT:
        return InvalidRequestError(err, f"{what}: lba_shift {shift} is outside {lib.BD_LBA_SHIFT_MIN}.."
                                        f"{lib.BD_LBA_SHIFT_MAX} (LBA sizes 512 B to 64 KiB); set it to "
                                        f"log2 of the device's LBA size")
    lba = 1 << shift
    if why == lib.BD_BAD_CHUNK:
        return InvalidRequestError(err, f"{what}: per-command limit max_chunk_bytes={int(target.max_chunk_bytes)} "
                                        f"is smaller than one {lba}-byte LBA; it must be at least {lba}")
    if why == lib.BD_BAD_LENGTH:
        return AlignmentError(err, f"{what}: length {nbytes} is not a multiple of the {lba}-byte LBA; "
                                   f"round it to whole LBAs")
    if why == lib.BD_BAD_LBA_RANGE:
        if int(target.kind) == lib.BD_KIND_NVME:
            space = "the 64-bit LBA space (slba + LBAs must be at most 2^64 - 1)"
        else:
            space = f"63-bit byte offsets (with {lba}-byte LBAs, slba + LBAs must be at most {(2**63 - 1) >> shift})"
        return TargetRangeError(err, f"{what}: a range of {nbytes >> shift} LBAs from LBA {slba} ends past {space}")
    if why == lib.BD_BAD_BUFFER:
        return InvalidRequestError(err, f"{what}: the buffer address is NULL; pass a StagingBuffer or a "
                                        f"writable buffer")
    if why == lib.BD_BAD_BUFFER_RANGE:
        return InvalidRequestError(err, f"{what}: a buffer at 0x{address:x} of {nbytes} bytes would end past "
                                        f"the top of the address space")
    if why == lib.BD_BAD_OFFSET:
        return InvalidRequestError(err, f"{what}: chunk offset {offset} is not an LBA multiple below {nbytes}")
    return errno_error(err, f"{what} (refused, reason {why})")


def transfer_error(c: Any, describe_target: str = "") -> BladedIOError | None:
    """The failure of a finished ``struct bd_xfer`` as an exception, or None (``describe_target``: " on DEVICE")."""
    kind = c.err_kind
    if kind == lib.BD_OK:
        return None
    op, slba, nbytes = Op(c.op), int(c.slba), int(c.nbytes)
    what = f"{op.name.lower()} of {nbytes} bytes at LBA {slba}{describe_target}"
    if kind == lib.BD_ERR_INVALID:
        return request_error(int(c.err_value), c.target, int(c.op), slba, nbytes, what,
                             address=int(ffi.cast("uintptr_t", c.buf)))
    if kind == lib.BD_ERR_NVME:
        return NVMeStatusError(int(c.err_value), int(c.err_slba), what)
    if kind == lib.BD_ERR_SHORT:
        return ShortTransferError(
            errno.EIO,
            f"{what}: short transfer, a command at LBA {int(c.err_slba)} moved only "
            f"{int(c.err_value)} bytes (past the end of the backing store?)",
        )
    return errno_error(int(c.err_value), f"{what} (command at LBA {int(c.err_slba)})")


class Transfer:
    """One request (a tensor, an index range, a discard) and, once done, its outcome."""

    __slots__ = ("_c", "_keep", "describe_target", "nbytes", "op", "slba", "tag")

    def __init__(self, target: Any, op: Op, slba: int, nbytes: int, address: int, keep: Any,
                 tag: int = 0, describe_target: str = "") -> None:
        c = ffi.new("struct bd_xfer *")
        c.target = target
        c.op = int(op)
        c.buf_index = -1
        c.slba = slba
        c.nbytes = nbytes
        c.buf = ffi.cast("void *", address)
        c.tag = tag
        self._c = c
        self._keep = keep
        self.op = op
        self.slba = slba
        self.nbytes = nbytes
        self.tag = tag
        self.describe_target = describe_target

    @property
    def ok(self) -> bool:
        return bool(self._c.err_kind == lib.BD_OK)

    @property
    def chunks(self) -> int:
        """Commands the engine issued for this transfer (Eq. 8's n_chunks; a read under a read window: its pieces)."""
        return int(self._c.n_chunks)

    @property
    def service_ns(self) -> int:
        """First submission to last completion, in nanoseconds."""
        return int(self._c.t_done_ns - self._c.t_submit_ns)

    @property
    def registered(self) -> bool:
        return bool(self._c.buf_index >= 0)

    def error(self) -> BladedIOError | None:
        """The failure of this transfer as an exception, or None."""
        return transfer_error(self._c, self.describe_target)

    def raise_for_status(self) -> Transfer:
        err = self.error()
        if err is not None:
            raise err
        return self


_memlock_warned = threading.Event()


class Ring:
    """A queue of transfers driven by the C engine; owned by one thread at a time.

    ``engine="uring"``: an io_uring instance.  ``engine="portable"``: a pool of
    at most ``min(queue_depth, 8)`` threads running the same commands as
    positional syscalls and ioctls (no registered buffers).
    """

    def __init__(self, queue_depth: int = 32, *, big_sqe: bool = False, engine: str = engines.URING) -> None:
        if not 1 <= queue_depth <= 4096:
            raise ValueError(f"queue depth must be within 1..4096, got {queue_depth}")
        err = ffi.new("int *")
        ring = lib.bd_ring_new(queue_depth, 1 if big_sqe else 0, engines.c_engine(engine), err)
        if ring == ffi.NULL:
            if engine == engines.URING and err[0] in (-errno.EPERM, -errno.ENOSYS, -errno.EACCES):
                raise BladedIOError(-err[0], f"io_uring is not available to bladed here "
                                             f"({errno.errorcode.get(-err[0], -err[0])}: {os.strerror(-err[0])}): "
                                             f'set io.engine = "auto" or "portable"')
            raise errno_error(-err[0], f"{engine} engine setup (depth {queue_depth}, big_sqe={big_sqe})")
        self._ring: Any = ring
        self.engine = engine
        self.queue_depth = queue_depth
        self.big_sqe = big_sqe
        self.registered_buffers = 0
        self._registered_memory: list[Any] = []   # registered memory stays mapped while the kernel holds it
        self._pending: dict[Any, Transfer] = {}
        self._done = ffi.new("struct bd_xfer *[]", 256)

    def register_buffers(self, buffers: Sequence[StagingBuffer]) -> bool:
        """Register staging memory as fixed buffers; False (logged once) if the kernel refuses.

        Always False on the portable engine: its threads pass plain addresses.
        """
        if not buffers or self.engine != engines.URING:
            return False
        memory = [b.memory() for b in buffers]
        addrs = ffi.new("void *[]", [ffi.cast("void *", b.address) for b in buffers])
        lens = ffi.new("uint64_t[]", [b.nbytes for b in buffers])
        ret = lib.bd_ring_register_buffers(self._ring, addrs, lens, len(buffers))
        if ret < 0:
            if not _memlock_warned.is_set():
                _memlock_warned.set()
                log.warning(
                    "io_uring fixed-buffer registration failed (%s); using unregistered buffers. "
                    "Raise RLIMIT_MEMLOCK (LimitMEMLOCK=) or grant CAP_IPC_LOCK to avoid the per-I/O pinning.",
                    errno.errorcode.get(-ret, str(-ret)),
                )
            return False
        self.registered_buffers = len(buffers)
        self._registered_memory = memory
        return True

    def unregister_buffers(self) -> None:
        if self.registered_buffers:
            ret = lib.bd_ring_unregister_buffers(self._ring)
            if ret < 0:
                raise errno_error(-ret, "unregistering io_uring buffers (wait for the transfers in flight first)")
            self.registered_buffers = 0
            self._registered_memory = []

    def submit(self, xfer: Transfer) -> None:
        """Queue a transfer; it starts as soon as the ring has room."""
        c = xfer._c
        if self.registered_buffers and xfer.op in (Op.READ, Op.WRITE):
            c.buf_index = lib.bd_ring_buffer_index(self._ring, c.buf, c.nbytes)
        ret = lib.bd_enqueue(self._ring, c)
        if ret == -errno.EBUSY:
            raise BladedIOError(errno.EBUSY, f"{xfer.op.name.lower()} of {xfer.nbytes} bytes at LBA {xfer.slba} "
                                             f"is already queued; wait for it before submitting it again")
        if ret < 0:
            raise xfer.error() or errno_error(-ret, "queueing a transfer")
        self._pending[c] = xfer

    @property
    def outstanding(self) -> int:
        return int(lib.bd_outstanding(self._ring))

    @property
    def c(self) -> Any:
        """The C ring (``struct bd_ring *``), for a C loop that drives it while it owns this Ring (the lane)."""
        return self._ring

    @property
    def read_window(self) -> int:
        """Most read bytes in flight at once (reads go in pieces of half of it); 0: no limit (the default).

        A device serves its queue in order: a write submitted on any ring of the
        device waits behind the read commands already queued, so the window
        bounds how long a small write can wait behind this ring's bulk reads.
        """
        return int(lib.bd_ring_read_window(self._ring))

    @read_window.setter
    def read_window(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"read window must be 0 (no limit) or positive, got {nbytes}")
        lib.bd_ring_set_read_window(self._ring, nbytes)

    def stats(self) -> dict[str, int]:
        """Engine counters: commands submitted/completed, peak in flight, waits."""
        out = ffi.new("uint64_t[4]")
        lib.bd_ring_stats(self._ring, out)
        return {"submitted": int(out[0]), "completed": int(out[1]),
                "max_inflight": int(out[2]), "waits": int(out[3])}

    def wait(self, min_done: int = 1) -> list[Transfer]:
        """Drive the ring until ``min_done`` transfers completed; return those completed."""
        n = lib.bd_progress(self._ring, min_done, self._done, len(self._done))
        if n < 0:
            raise errno_error(-n, f"{self.engine} engine submit/wait")
        return [self._pending.pop(self._done[i]) for i in range(n)]

    def run(self, xfers: Iterable[Transfer]) -> list[Transfer]:
        """Submit all and wait for all, keeping the queue full across them."""
        xs = list(xfers)
        for x in xs:
            self.submit(x)
        left = len(xs)
        while left:
            got = self.wait(1)
            if not got:
                raise BladedIOError(errno.EIO, "engine stalled with transfers outstanding")
            left -= len(got)
        return xs

    def close(self) -> None:
        if self._ring is not None:
            if self._pending:
                # drain: the kernel may still write into the buffers otherwise
                while self.outstanding:
                    self.wait(self.outstanding)
            lib.bd_ring_free(self._ring)
            self._ring = None
            self._registered_memory = []

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover
        if getattr(self, "_ring", None) is not None:
            self.close()
