"""File backend: a preallocated file on any filesystem, O_DIRECT io_uring.

The embedded default, so bladed runs on any box.  Discard punches holes
(``fallocate(PUNCH_HOLE|KEEP_SIZE)``), which read back as zeroes.
"""

from __future__ import annotations

import errno
import os

from bladed._uring import lib
from bladed.io.device import ExtentDevice
from bladed.io.errors import BladedIOError

DEFAULT_FILE_LBA = 4096
DEFAULT_MAX_COMMAND = 1 << 20


def supports_o_direct(directory: str) -> bool:
    """Can a store file in ``directory`` be opened with O_DIRECT (tmpfs, for one, cannot)?"""
    path = os.path.join(directory, ".odirect-probe")
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(path)
    return True


class FileDevice(ExtentDevice):
    """A regular file used as an array of ``lba_size`` blocks."""

    kind = "file"
    c_kind = lib.BD_KIND_FILE

    def __init__(self, path: str, size_bytes: int | None = None, *, lba_size: int = DEFAULT_FILE_LBA,
                 max_command_bytes: int = DEFAULT_MAX_COMMAND, create: bool = True) -> None:
        if lba_size not in (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536):
            raise ValueError(f"file LBA size must be a power of two from 512 to 65536, got {lba_size}")
        self.path = os.fspath(path)
        self.fd = -1
        exists = os.path.exists(self.path)
        if not exists and not create:
            raise FileNotFoundError(errno.ENOENT, "store file does not exist", self.path)
        if exists and not os.path.isfile(self.path):
            raise BladedIOError(errno.EINVAL, f"{self.path} is not a regular file (use the block backend)")
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT | (os.O_CREAT if create else 0)
        try:
            self.fd = os.open(self.path, flags, 0o600)
        except OSError as e:
            if e.errno == errno.EINVAL:
                raise BladedIOError(
                    errno.EINVAL, f"{self.path}: the filesystem does not support O_DIRECT (tmpfs?)"
                ) from e
            raise
        try:
            current = os.fstat(self.fd).st_size
            if size_bytes is None:
                size_bytes = current
            if size_bytes <= 0:
                raise ValueError(f"{self.path}: store size must be positive (got {size_bytes})")
            if size_bytes % lba_size:
                raise ValueError(f"store size {size_bytes} is not a multiple of the {lba_size}-byte LBA")
            if current < size_bytes:
                # allocate now so that a full filesystem shows at start, not mid-transfer
                os.posix_fallocate(self.fd, 0, size_bytes)
            elif current > size_bytes:
                size_bytes = current - current % lba_size
        except BaseException:
            self.close()
            raise
        self.lba_size = lba_size
        self.capacity_blocks = size_bytes // lba_size
        self.max_transfer_bytes = max_command_bytes
        self.max_transfer_bytes_huge = max_command_bytes
        self.zeroes_after_discard = True
        self.max_discard_blocks = 0
