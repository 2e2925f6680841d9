"""Exceptions of the I/O layer and decoding of NVMe status codes into words."""

from __future__ import annotations

import errno
import os


class BladedIOError(OSError):
    """Base class of every I/O-path failure raised by bladed."""


class AlignmentError(BladedIOError, ValueError):
    """An address, offset or length is not aligned as the device requires."""


class TargetRangeError(BladedIOError, ValueError):
    """A request reaches outside its target: past the end of the device, region or file (or below 0)."""


class InvalidRequestError(BladedIOError, ValueError):
    """The engine refused a request or a target before submitting anything (a bad shift, size or buffer)."""


class ShortTransferError(BladedIOError):
    """The kernel moved fewer bytes than a command asked for."""


class NVMeStatusError(BladedIOError):
    """The controller completed a command with a non-zero NVMe status."""

    def __init__(self, status: int, slba: int, op: str) -> None:
        self.status = status
        self.sct = (status >> 8) & 0x7
        self.sc = status & 0xFF
        self.dnr = bool(status & 0x4000)
        self.slba = slba
        super().__init__(errno.EIO, f"NVMe {op} failed: {describe_nvme_status(status)} (command at LBA {slba})")


# NVMe base spec 2.0, Figure 100-102 (generic command status, SCT 0) and the
# command-specific / media error tables (SCT 1, SCT 2) for what bladed issues.
_GENERIC = {
    0x00: "success",
    0x01: "invalid command opcode",
    0x02: "invalid field in command",
    0x03: "command ID conflict",
    0x04: "data transfer error",
    0x05: "commands aborted due to power loss notification",
    0x06: "internal error",
    0x07: "command abort requested",
    0x08: "command aborted due to SQ deletion",
    0x0B: "invalid namespace or format",
    0x0C: "command sequence error",
    0x0D: "invalid SGL segment descriptor",
    0x0F: "data SGL length invalid",
    0x15: "operation denied",
    0x80: "LBA out of range",
    0x81: "capacity exceeded",
    0x82: "namespace not ready",
    0x83: "reservation conflict",
    0x84: "format in progress",
}
_COMMAND_SPECIFIC = {
    0x80: "conflicting attributes",
    0x81: "invalid protection information",
    0x82: "attempted write to read only range",
    0x83: "command size limit exceeded",
}
_MEDIA = {
    0x80: "write fault",
    0x81: "unrecovered read error",
    0x82: "end-to-end guard check error",
    0x83: "end-to-end application tag check error",
    0x84: "end-to-end reference tag check error",
    0x85: "compare failure",
    0x86: "access denied",
    0x87: "deallocated or unwritten logical block",
}
_SCT_NAMES = {0: "generic", 1: "command specific", 2: "media and data integrity", 3: "path related"}


def describe_nvme_status(status: int) -> str:
    """Turn a completion status (``cqe->res`` > 0) into a sentence, e.g. ``LBA out of range``."""
    sct = (status >> 8) & 0x7
    sc = status & 0xFF
    table = {0: _GENERIC, 1: _COMMAND_SPECIFIC, 2: _MEDIA}.get(sct, {})
    text = table.get(sc, f"unknown {_SCT_NAMES.get(sct, f'type {sct}')} status 0x{sc:02x}")
    flags = []
    if status & 0x4000:
        flags.append("do not retry")
    if status & 0x2000:
        flags.append("more info in log")
    suffix = f" ({', '.join(flags)})" if flags else ""
    return f"{text} [sct={sct} sc=0x{sc:02x}]{suffix}"


def errno_error(err: int, what: str) -> BladedIOError:
    """An exception for a positive errno, naming the operation."""
    return BladedIOError(err, f"{what}: {os.strerror(err)}")
