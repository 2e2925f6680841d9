"""Block backend: a raw block device or partition, O_DIRECT io_uring.

Discard uses the io_uring block discard command (kernel 6.12+) and falls
back to ``ioctl(BLKDISCARD)``; write-zeroes uses ``fallocate(ZERO_RANGE)``.
"""

from __future__ import annotations

import errno
import os
import stat

from bladed._uring import ffi, lib
from bladed.io.device import ExtentDevice
from bladed.io.errors import BladedIOError, errno_error

DEFAULT_MAX_COMMAND = 1 << 20


def _sysfs_queue(fd: int) -> str:
    st = os.fstat(fd)
    major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
    base = os.path.realpath(f"/sys/dev/block/{major}:{minor}")
    # a partition has its queue/ on the parent disk
    return os.path.join(base if os.path.isdir(os.path.join(base, "queue")) else os.path.dirname(base), "queue")


def _read_int(path: str, default: int = 0) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return default


class BlockDevice(ExtentDevice):
    """A block device (or partition) opened exclusively with O_DIRECT."""

    kind = "block"
    c_kind = lib.BD_KIND_BLOCK

    def __init__(self, path: str, *, max_command_bytes: int = DEFAULT_MAX_COMMAND,
                 exclusive: bool = True) -> None:
        self.path = os.fspath(path)
        self.fd = -1
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "block device does not exist", self.path) from None
        if not stat.S_ISBLK(st.st_mode):
            raise BladedIOError(errno.ENOTBLK, f"{self.path} is not a block device")
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT | (os.O_EXCL if exclusive else 0)
        try:
            self.fd = os.open(self.path, flags)
        except OSError as e:
            if e.errno == errno.EBUSY:
                raise BladedIOError(errno.EBUSY, f"{self.path} is in use (mounted or claimed)") from e
            raise
        size = ffi.new("uint64_t *")
        lbs = ffi.new("uint32_t *")
        ret = lib.bd_block_geometry(self.fd, size, lbs)
        if ret < 0:
            self.close()
            raise errno_error(-ret, f"{self.path}: reading geometry")
        queue = _sysfs_queue(self.fd)
        self.lba_size = int(lbs[0])
        self.capacity_blocks = int(size[0]) // self.lba_size
        hw_limit = _read_int(os.path.join(queue, "max_hw_sectors_kb"), 0) * 1024
        # the block layer splits large bios, so the limit is a choice, not a cap
        self.max_transfer_bytes = max_command_bytes
        self.max_transfer_bytes_huge = max_command_bytes
        self.hw_max_transfer_bytes = hw_limit
        self.discard_max_bytes = _read_int(os.path.join(queue, "discard_max_bytes"), 0)
        self.max_discard_blocks = 0
        # loop devices punch holes in their backing file: those read back as zeroes
        self.zeroes_after_discard = os.path.basename(os.path.realpath(self.path)).startswith("loop")
