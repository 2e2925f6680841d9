"""The extent-device interface every storage backend implements, and the
per-channel engine (one ring + one device) that moves bytes.

Backends: :mod:`bladed.io.nvme` (NVMe generic char device, io_uring_cmd),
:mod:`bladed.io.block` (raw block device, O_DIRECT), :mod:`bladed.io.file`
(preallocated file, O_DIRECT; the embedded default).
"""

from __future__ import annotations

import abc
import contextlib
import errno
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

from bladed._uring import ffi, lib
from bladed.io import engines
from bladed.io.chunking import chunk_bytes
from bladed.io.errors import AlignmentError, BladedIOError, TargetRangeError
from bladed.io.uring import HugePages, Op, Ring, StagingBuffer, Transfer, buffer_address

log = logging.getLogger(__name__)

DEFAULT_QUEUE_DEPTH = 32


class ExtentDevice(abc.ABC):
    """Storage addressed in logical blocks: what bladed needs from a backend.

    Subclasses open the device and fill in the geometry attributes below; the
    I/O itself always goes through an :class:`Engine`.
    """

    kind: ClassVar[str]
    c_kind: ClassVar[int]
    big_sqe: ClassVar[bool] = False

    path: str
    fd: int
    lba_size: int
    capacity_blocks: int
    #: per-command payload limit (before Eq. 7 rounding) for ordinary pages
    max_transfer_bytes: int
    #: per-command limit when the buffer is backed by 2 MiB pages
    max_transfer_bytes_huge: int
    #: reads of deallocated blocks return zeroes (NVMe DLFEAT=001, punched holes)
    zeroes_after_discard: bool
    nsid: int = 0
    max_discard_blocks: int = 0
    max_zeroes_blocks: int = 0
    _engine: engines.EngineChoice | None = None

    @property
    def engine(self) -> str:
        """The engine every :class:`Engine` of this device runs (``uring`` or ``portable``)."""
        return self.engine_choice.engine

    @engine.setter
    def engine(self, setting: str) -> None:
        self._engine = engines.choose(setting, self.kind)

    @property
    def engine_choice(self) -> engines.EngineChoice:
        """The engine and why: set from ``io.engine`` at open, else what ``auto`` finds."""
        if self._engine is None:
            self._engine = engines.choose(engines.AUTO, self.kind)
        return self._engine

    def fixed_buffers_usable(self, buffers: Sequence[StagingBuffer]) -> bool:
        """Whether registering these staging buffers with the ring works for this device."""
        return True

    @property
    def lba_shift(self) -> int:
        return self.lba_size.bit_length() - 1

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_blocks * self.lba_size

    def make_target(self, huge_pages: bool = False, discard_mode: int = 0) -> Any:
        """A C ``struct bd_target`` describing this device to the engine."""
        t = ffi.new("struct bd_target *")
        t.fd = self.fd
        t.kind = self.c_kind
        t.nsid = self.nsid
        t.lba_shift = self.lba_shift
        limit = self.max_transfer_bytes_huge if huge_pages else self.max_transfer_bytes
        t.max_chunk_bytes = chunk_bytes(limit, self.lba_size, kind=self.c_kind)
        t.max_discard_blocks = self.max_discard_blocks
        t.max_zeroes_blocks = self.max_zeroes_blocks
        t.timeout_ms = 0
        t.discard_mode = discard_mode
        return t

    def check_range(self, slba: int, nbytes: int) -> None:
        """Raise unless ``[slba, slba + nbytes)`` is LBA aligned and inside the device."""
        if slba < 0 or nbytes < 0:
            raise TargetRangeError(errno.EINVAL, f"negative LBA or length (slba={slba}, nbytes={nbytes})")
        if nbytes % self.lba_size:
            raise AlignmentError(
                errno.EINVAL,
                f"length {nbytes} is not a multiple of the {self.lba_size}-byte LBA of {self.path}",
            )
        end = slba + nbytes // self.lba_size
        if end > self.capacity_blocks:
            raise TargetRangeError(
                errno.ERANGE,
                f"LBA range [{slba}, {end}) is past the end of {self.path} ({self.capacity_blocks} blocks)",
            )

    def describe(self) -> dict[str, Any]:
        """Geometry, for logs and ``bladectl``."""
        return {
            "kind": self.kind,
            "path": self.path,
            "lba_size": self.lba_size,
            "capacity_blocks": self.capacity_blocks,
            "capacity_bytes": self.capacity_bytes,
            "max_transfer_bytes": self.max_transfer_bytes,
            "max_transfer_bytes_huge": self.max_transfer_bytes_huge,
            "zeroes_after_discard": self.zeroes_after_discard,
            "nsid": self.nsid,
            "engine": self.engine,
        }

    def close(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> ExtentDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.path} lba={self.lba_size} blocks={self.capacity_blocks}>"


_fixed_unsupported_logged: set[str] = set()


def _log_fixed_unsupported(device: ExtentDevice) -> None:
    if device.path not in _fixed_unsupported_logged:
        _fixed_unsupported_logged.add(device.path)
        log.warning("%s: this kernel refuses registered-buffer passthrough commands inside large buffers "
                    "(Linux < 6.12 counts pages to the end of the buffer against max_segments); "
                    "using unregistered buffers", device.path)


class Engine:
    """One ring bound to one device, on the device's engine: what a worker channel owns.

    Not thread-safe: give each thread its own Engine (they may share the device).
    """

    def __init__(self, device: ExtentDevice, queue_depth: int = DEFAULT_QUEUE_DEPTH,
                 buffers: Sequence[StagingBuffer] = ()) -> None:
        self.device = device
        self.ring = Ring(queue_depth, big_sqe=device.big_sqe, engine=device.engine)
        self.target = device.make_target()
        # commands from 2 MiB-page buffers may be larger (one segment per huge
        # page): those transfers get their own target with the larger limit
        self.target_huge = device.make_target(huge_pages=True)
        self._huge_ranges = [(b.address, b.address + b.nbytes) for b in buffers if b.huge is HugePages.HUGETLB]
        self.registered = False
        if buffers:
            if device.fixed_buffers_usable(buffers):
                self.registered = self.ring.register_buffers(buffers)
            else:
                _log_fixed_unsupported(device)
        self._suffix = f" on {device.path}"
        #: bytes of the write commands this engine completed without error, by :attr:`label`: what it wrote to
        #: the device (whole LBAs, edges included), read by the daemon's wear counters
        self.written: dict[str, int] = {}
        #: what the writes are for (:meth:`labelled`); ``requests`` unless a caller says otherwise
        self.label = "requests"

    @contextlib.contextmanager
    def labelled(self, label: str) -> Iterator[None]:
        """Count the writes completed inside the block under ``label`` (a demotion's copy, an extent's move)."""
        previous, self.label = self.label, label
        try:
            yield
        finally:
            self.label = previous

    def _count(self, done: Iterable[Transfer]) -> None:
        n = sum(x.nbytes for x in done if x.op is Op.WRITE and x.ok)
        if n:
            self.written[self.label] = self.written.get(self.label, 0) + n

    @property
    def max_chunk_bytes(self) -> int:
        """Per-command payload for buffers of ordinary pages (Eq. 7)."""
        return int(self.target.max_chunk_bytes)

    @property
    def max_chunk_bytes_huge(self) -> int:
        """Per-command payload for transfers from this engine's hugetlb buffers."""
        return int(self.target_huge.max_chunk_bytes)

    def target_for(self, addr: int, nbytes: int) -> Any:
        """The C target (``struct bd_target *``) a transfer from memory ``[addr, addr + nbytes)`` goes to."""
        for lo, hi in self._huge_ranges:
            if lo <= addr and addr + nbytes <= hi:
                return self.target_huge
        return self.target

    def transfer(self, op: Op, slba: int, buf: Any = None, *, offset: int = 0,
                 nbytes: int | None = None, tag: int = 0) -> Transfer:
        """Build (and validate) a transfer without submitting it."""
        dev = self.device
        if op in (Op.READ, Op.WRITE):
            if buf is None:
                raise ValueError(f"{op.name.lower()} needs a buffer")
            base, size, keep = buffer_address(buf)
            n = size - offset if nbytes is None else nbytes
            if offset < 0 or n < 0 or offset + n > size:
                raise ValueError(f"buffer range [{offset}, {offset + n}) outside a {size}-byte buffer")
            addr = base + offset
            if addr % dev.lba_size:
                raise AlignmentError(
                    errno.EINVAL,
                    f"buffer address 0x{addr:x} is not aligned to the {dev.lba_size}-byte LBA "
                    f"(O_DIRECT and NVMe DMA need aligned memory; use a StagingBuffer)",
                )
            target = self.target_for(addr, n)
        else:
            if nbytes is None:
                raise ValueError(f"{op.name.lower()} needs nbytes")
            n, addr, keep, target = nbytes, 0, None, self.target
        dev.check_range(slba, n)
        return Transfer(target, op, slba, n, addr, keep, tag=tag, describe_target=self._suffix)

    # -- asynchronous --------------------------------------------------------
    def submit(self, op: Op, slba: int, buf: Any = None, *, offset: int = 0,
               nbytes: int | None = None, tag: int = 0) -> Transfer:
        """Validate and queue one transfer; collect it with :meth:`wait`."""
        x = self.transfer(op, slba, buf, offset=offset, nbytes=nbytes, tag=tag)
        self.ring.submit(x)
        return x

    def wait(self, min_done: int = 1) -> list[Transfer]:
        """Completed transfers (at least ``min_done`` unless fewer are outstanding)."""
        done = self.ring.wait(min_done)
        self._count(done)
        return done

    @property
    def outstanding(self) -> int:
        return self.ring.outstanding

    @property
    def describe_target(self) -> str:
        """" on DEVICE", as the transfers' messages end."""
        return self._suffix

    # -- synchronous ---------------------------------------------------------
    def run(self, xfers: Iterable[Transfer], *, check: bool = True) -> list[Transfer]:
        """Run prepared transfers back to back with the queue kept full; raise the first error."""
        done = self.ring.run(xfers)
        self._count(done)
        if check:
            for x in done:
                x.raise_for_status()
        return done

    def read(self, slba: int, buf: Any, *, offset: int = 0, nbytes: int | None = None) -> Transfer:
        return self.run([self.transfer(Op.READ, slba, buf, offset=offset, nbytes=nbytes)])[0]

    def write(self, slba: int, buf: Any, *, offset: int = 0, nbytes: int | None = None) -> Transfer:
        return self.run([self.transfer(Op.WRITE, slba, buf, offset=offset, nbytes=nbytes)])[0]

    def discard(self, slba: int, nblocks: int) -> Transfer:
        """Deallocate (TRIM) ``nblocks`` from ``slba``."""
        x = self.transfer(Op.DISCARD, slba, nbytes=nblocks * self.device.lba_size)
        self.run([x], check=False)
        err = x.error()
        if err is not None and self._discard_fallback(err):
            x = self.transfer(Op.DISCARD, slba, nbytes=nblocks * self.device.lba_size)
            self.run([x], check=False)
        return x.raise_for_status()

    def write_zeroes(self, slba: int, nblocks: int) -> Transfer:
        """Make ``nblocks`` from ``slba`` read back as zeroes."""
        return self.run([self.transfer(Op.WRITE_ZEROES, slba, nbytes=nblocks * self.device.lba_size)])[0]

    def _discard_fallback(self, err: BladedIOError) -> bool:
        """Switch block devices from the io_uring discard command to BLKDISCARD."""
        if (self.device.c_kind == lib.BD_KIND_BLOCK and self.target.discard_mode == lib.BD_DISCARD_URING_CMD
                and err.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOTTY)):
            log.info("%s: io_uring block discard unsupported (%s); using BLKDISCARD",
                     self.device.path, errno.errorcode.get(err.errno or 0, "?"))
            self.target.discard_mode = lib.BD_DISCARD_IOCTL
            return True
        return False

    def close(self) -> None:
        self.ring.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
