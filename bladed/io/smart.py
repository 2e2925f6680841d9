"""The drive's own wear figures: the NVMe SMART / Health Information log (Get Log Page, LID 02h) and, where
the controller has endurance groups, its endurance estimate (LID 09h), read by admin passthrough
(``NVME_IOCTL_ADMIN_CMD`` on the namespace's node, the one the nvme backend holds open).

Linux sends an admin command other than Identify only for a process with ``CAP_SYS_ADMIN`` (every kernel:
6.2+'s unprivileged passthrough covers I/O commands and some Identify CNS values, never Get Log Page), so a
daemon without it gets EACCES: :class:`SmartUnavailable` says so in one line, naming what to allow.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import struct
from dataclasses import asdict, dataclass
from typing import Any

#: _IOWR('N', 0x41, struct nvme_admin_cmd): linux/nvme_ioctl.h
NVME_IOCTL_ADMIN_CMD = 0xC0484E41
#: struct nvme_passthru_cmd: opcode, flags, rsvd1, nsid, cdw2, cdw3, metadata, addr, metadata_len, data_len,
#: cdw10..cdw15, timeout_ms, result (72 bytes)
_ADMIN_CMD = struct.Struct("<BBHIIIQQIIIIIIIIII")
OPC_GET_LOG_PAGE = 0x02
OPC_IDENTIFY = 0x06
LID_SMART = 0x02
LID_ENDURANCE_GROUP = 0x09
#: the controller as a whole (what ``nvme smart-log`` asks for by default)
NSID_ALL = 0xFFFFFFFF
SMART_LOG_BYTES = 512
#: one SMART data unit: 1000 units of 512 bytes (NVMe base specification, SMART / Health Information log)
DATA_UNIT_BYTES = 512_000
#: the endurance group log's Endurance Estimate counts billions of bytes
ENDURANCE_UNIT_BYTES = 1_000_000_000
#: Identify Controller CTRATT bit 4: the controller has endurance groups
CTRATT_ENDURANCE_GROUPS = 1 << 4


class SmartUnavailable(OSError):
    """The drive's figures cannot be read here; the message is the one line an operator reads."""


@dataclass(frozen=True)
class SmartLog:
    """The fields of the SMART / Health Information log that bladed reports (counters as the drive keeps them)."""

    critical_warning: int            # bit field: 0 spare, 1 temperature, 2 reliability, 3 read-only, 4 backup
    temperature_kelvin: int          # composite temperature
    available_spare: int             # percent
    available_spare_threshold: int   # percent
    percentage_used: int             # percent of the rated life used (may exceed 100)
    data_units_read: int             # of DATA_UNIT_BYTES, rounded up by the drive
    data_units_written: int
    host_read_commands: int
    host_write_commands: int
    controller_busy_minutes: int
    power_cycles: int
    power_on_hours: int
    unsafe_shutdowns: int
    media_errors: int                # media and data integrity errors
    error_log_entries: int

    @property
    def data_written_bytes(self) -> int:
        return self.data_units_written * DATA_UNIT_BYTES

    @property
    def data_read_bytes(self) -> int:
        return self.data_units_read * DATA_UNIT_BYTES

    @property
    def temperature_celsius(self) -> int:
        return self.temperature_kelvin - 273

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"data_written_bytes": self.data_written_bytes, "data_read_bytes": self.data_read_bytes,
                               "temperature_celsius": self.temperature_celsius}


def parse_smart_log(data: bytes) -> SmartLog:
    """The 512-byte SMART / Health Information log page (all integers little-endian, counters 128 bits)."""
    if len(data) < SMART_LOG_BYTES:
        raise ValueError(f"a SMART log page is {SMART_LOG_BYTES} bytes, got {len(data)}")

    def u128(off: int) -> int:
        return int.from_bytes(data[off:off + 16], "little")

    return SmartLog(
        critical_warning=data[0], temperature_kelvin=struct.unpack_from("<H", data, 1)[0],
        available_spare=data[3], available_spare_threshold=data[4], percentage_used=data[5],
        data_units_read=u128(32), data_units_written=u128(48), host_read_commands=u128(64),
        host_write_commands=u128(80), controller_busy_minutes=u128(96), power_cycles=u128(112),
        power_on_hours=u128(128), unsafe_shutdowns=u128(144), media_errors=u128(160), error_log_entries=u128(176),
    )


def admin_command(fd: int, opcode: int, nsid: int, nbytes: int, cdw10: int, cdw11: int = 0) -> bytes:
    """Run one admin command that reads ``nbytes`` into a page-aligned buffer; its data.

    OSError with the ioctl's errno; OSError(EIO) naming the NVMe status when the controller refuses it."""
    with mmap.mmap(-1, max(nbytes, mmap.PAGESIZE)) as buf:
        anchor = ctypes.c_char.from_buffer(buf)
        try:
            cmd = bytearray(_ADMIN_CMD.pack(opcode, 0, 0, nsid, 0, 0, 0, ctypes.addressof(anchor), 0, nbytes,
                                            cdw10, cdw11, 0, 0, 0, 0, 0, 0))
            status = fcntl.ioctl(fd, NVME_IOCTL_ADMIN_CMD, cmd, True)
        finally:
            del anchor
        if status:
            raise OSError(errno.EIO, f"NVMe status 0x{status:x}")
        return bytes(buf[:nbytes])


def get_log_page(fd: int, lid: int, nbytes: int, nsid: int = NSID_ALL, lsi: int = 0) -> bytes:
    """Get Log Page ``lid`` (RAE set: the kernel's asynchronous events are left alone)."""
    numd = nbytes // 4 - 1
    cdw10 = lid | (1 << 15) | ((numd & 0xFFFF) << 16)
    return admin_command(fd, OPC_GET_LOG_PAGE, nsid, nbytes, cdw10, (numd >> 16) | (lsi << 16))


def read_smart_log(fd: int, path: str) -> SmartLog:
    """The controller's SMART / Health log through ``fd`` (an open namespace node at ``path``).

    :class:`SmartUnavailable` with one line naming the cause and what to allow."""
    try:
        return parse_smart_log(get_log_page(fd, LID_SMART, SMART_LOG_BYTES))
    except OSError as e:
        code = errno.errorcode.get(e.errno or 0, str(e.errno))
        if e.errno in (errno.EACCES, errno.EPERM):
            raise SmartUnavailable(e.errno, f"{path}: the drive's SMART / Health log (NVMe Get Log Page 02h) is "
                                            f"refused ({code}): Linux sends admin commands other than Identify only "
                                            "for CAP_SYS_ADMIN; give bladed CAP_SYS_ADMIN (systemd/dropins/"
                                            "cap-sys-admin.conf), or read it with `nvme smart-log` as root") from None
        raise SmartUnavailable(e.errno or errno.EIO, f"{path}: reading the SMART / Health log (NVMe Get Log Page "
                                                     f"02h) failed: {e.strerror or e} ({code})") from None


def endurance_estimate(fd: int) -> int | None:
    """Bytes the drive says endurance group 1 may be written over its life (Endurance Estimate of LID 09h), or
    None: no endurance groups (CTRATT bit 4), no estimate (0), or the controller refused."""
    with contextlib.suppress(OSError):
        ctrl = admin_command(fd, OPC_IDENTIFY, 0, 4096, 1)
        if not struct.unpack_from("<I", ctrl, 96)[0] & CTRATT_ENDURANCE_GROUPS:
            return None
        log = get_log_page(fd, LID_ENDURANCE_GROUP, SMART_LOG_BYTES, nsid=0, lsi=1)
        estimate = int.from_bytes(log[32:48], "little")
        return estimate * ENDURANCE_UNIT_BYTES if estimate else None
    return None


__all__ = ["DATA_UNIT_BYTES", "SmartLog", "SmartUnavailable", "endurance_estimate", "parse_smart_log",
           "read_smart_log"]
