"""The I/O floor: the C engine's wrapper, the extent-device interface and its
three backends (nvme, block, file).  Knows nothing of sessions or models."""

from __future__ import annotations

from typing import Any

from bladed.io.device import DEFAULT_QUEUE_DEPTH, Engine, ExtentDevice
from bladed.io.errors import (
    AlignmentError,
    BladedIOError,
    NVMeStatusError,
    ShortTransferError,
    TargetRangeError,
)
from bladed.io.uring import HugePages, Op, Ring, StagingBuffer, Transfer, transfer_error

BACKENDS = ("nvme", "block", "file")


def open_device(backend: str, path: str, *, engine: str = "auto", **options: Any) -> ExtentDevice:
    """Open a device of the named backend (``nvme``, ``block`` or ``file``) on ``engine`` (``io.engine``)."""
    dev: ExtentDevice
    if backend == "file":
        from bladed.io.file import FileDevice

        dev = FileDevice(path, **options)
    elif backend == "block":
        from bladed.io.block import BlockDevice

        dev = BlockDevice(path, **options)
    elif backend == "nvme":
        from bladed.io.nvme import NvmeDevice

        dev = NvmeDevice(path, **options)
    else:
        raise ValueError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    try:
        dev.engine = engine
    except ValueError:
        dev.close()
        raise
    return dev


__all__ = [
    "BACKENDS",
    "DEFAULT_QUEUE_DEPTH",
    "AlignmentError",
    "BladedIOError",
    "Engine",
    "ExtentDevice",
    "HugePages",
    "NVMeStatusError",
    "Op",
    "Ring",
    "ShortTransferError",
    "StagingBuffer",
    "TargetRangeError",
    "Transfer",
    "open_device",
    "transfer_error",
]
