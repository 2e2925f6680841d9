"""What the kernel says a block device wrote: field 7 of ``/sys/block/<dev>/stat`` (sectors written, in
512-byte units whatever the LBA size), for the device that holds a path.

It counts every writer of the device, not bladed alone, and the block layer's requests only: NVMe
passthrough commands (the nvme backend's I/O) are counted only where the kernel is asked to
(``queue/iostats_passthrough`` = 1, where the kernel has it).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass

#: the unit of the stat file's sector fields
SECTOR_BYTES = 512
#: the 0-based field of ``stat`` that counts sectors written (Documentation/block/stat.rst)
WRITE_SECTORS_FIELD = 6
_NVME_NODE = re.compile(r"(?:ng|nvme)(\d+)n(\d+)")


@dataclass(frozen=True)
class BlockStat:
    """One block device's counters: its kernel name and its ``stat`` file."""

    name: str
    stat_path: str

    def written_bytes(self) -> int:
        """Bytes written to the device since boot, by the kernel's count."""
        with open(self.stat_path) as f:
            return int(f.read().split()[WRITE_SECTORS_FIELD]) * SECTOR_BYTES

    @property
    def passthrough_counted(self) -> bool | None:
        """Whether the kernel counts passthrough commands in this device's stat (``queue/iostats_passthrough``);
        None where the kernel has no such switch (whether it counts them then depends on its version: 5.10's
        block-node ioctls are counted, 6.x's are not)."""
        try:
            with open(os.path.join(os.path.dirname(self.stat_path), "queue", "iostats_passthrough")) as f:
                return f.read().strip() == "1"
        except OSError:
            return None


def _of_sysdir(sysdir: str) -> BlockStat | None:
    path = os.path.join(sysdir, "stat")
    if not os.path.isfile(path):
        return None
    return BlockStat(os.path.basename(os.path.realpath(sysdir)), path)


def _mount_source(path: str) -> str | None:
    """The source of the mount holding ``path`` when it is a ``/dev`` node (btrfs, overlay on one disk ...)."""
    real = os.path.realpath(path)
    best, source = -1, None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mount_point = left.split()[4].replace("\\040", " ")
                within = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
                if within and len(mount_point) > best:
                    best, source = len(mount_point), right.split()[1]
    except OSError:
        return None
    return source if source and source.startswith("/dev/") else None


def block_stat_of(path: str) -> BlockStat | str:
    """The block device holding ``path`` (the device itself for a block node or an NVMe namespace node, the
    filesystem's device for a file or directory), or why there is none (one line)."""
    try:
        st = os.stat(path)
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    if stat.S_ISCHR(st.st_mode):
        m = _NVME_NODE.fullmatch(os.path.basename(os.path.realpath(path)))
        found = _of_sysdir(f"/sys/block/nvme{m.group(1)}n{m.group(2)}") if m else None
        return found or f"{path} is a character device with no block device the kernel counts for it"
    dev = st.st_rdev if stat.S_ISBLK(st.st_mode) else st.st_dev
    found = _of_sysdir(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if found is not None:
        return found
    source = None if stat.S_ISBLK(st.st_mode) else _mount_source(path)
    if source is not None and source != path:
        got = block_stat_of(source)
        if isinstance(got, BlockStat):
            return got
    return (f"{path} is on device {os.major(dev)}:{os.minor(dev)}, which is no block device (tmpfs, overlay, a "
            "network filesystem?): the kernel has no count of what reaches a disk for it")


__all__ = ["SECTOR_BYTES", "BlockStat", "block_stat_of"]
