"""NVMe-direct backend: the generic char device ``/dev/ngXnY`` driven with
NVMe READ/WRITE/DSM commands over ``io_uring_cmd`` (paper §IV-B), or by
passthrough ioctls on the portable engine.

On a kernel without generic char devices (before 5.13) the backend takes the
namespace's block node ``/dev/nvmeXnY`` instead: the same NVMe ioctls
(NVME_IOCTL_ID, NVME_IOCTL_ADMIN_CMD, NVME_IOCTL_IO64_CMD) work on it, and
``io_uring_cmd`` does not exist there anyway.  It is opened ``O_RDWR``
without ``O_EXCL``, like the char device (which has no exclusive open):
passthrough commands bypass the block layer, and the daemon, ``bladectl``
and the tests open the namespace side by side.  A node that is mounted or
claimed (an ``O_EXCL`` open says EBUSY) is refused when it is opened.

Geometry comes from the controller itself: the namespace id (NVME_IOCTL_ID),
LBA size, capacity and DLFEAT (Identify Namespace), MDTS (Identify
Controller).  The command size is capped by MDTS, by the kernel's
``max_hw_sectors_kb`` and by ``max_segments`` pages, since passthrough
commands are never split by the kernel.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bladed._uring import ffi, lib
from bladed.io import engines
from bladed.io.device import ExtentDevice
from bladed.io.errors import BladedIOError, NVMeStatusError, errno_error
from bladed.io.uring import HUGE_PAGE_SIZE, StagingBuffer
from bladed.sizes import PAGE_SIZE

CNS_NAMESPACE = 0
CNS_CONTROLLER = 1
#: I/O Command Set specific Identify Controller (CSI 0, NVM): holds DMRSL
CNS_CS_CONTROLLER = 6
#: the controller's memory page (CAP.MPSMIN, 4 KiB; Linux's NVME_CTRL_PAGE_SIZE): the unit of MDTS
NVME_PAGE_SIZE = 4096


@dataclass(frozen=True)
class NamespaceIdentity:
    """The fields of Identify Namespace / Controller that bladed uses."""

    nsid: int
    nsze: int              # namespace size in LBAs
    lba_size: int
    metadata_size: int
    lba_formats: tuple[tuple[int, int], ...]   # (lba_size, metadata bytes) of each format
    current_format: int
    dlfeat: int            # bits 2:0: 1 = deallocated reads zeroes, 2 = all ones
    mdts: int              # 0 = unlimited; else max transfer = 2^mdts * 4 KiB (CAP.MPSMIN)
    model: str
    serial: str

    @property
    def mdts_bytes(self) -> int:
        return 0 if self.mdts == 0 else (1 << self.mdts) * NVME_PAGE_SIZE

    @property
    def deallocate_reads_zeroes(self) -> bool:
        return (self.dlfeat & 0x7) == 1


def identify(fd: int, nsid: int, cns: int) -> bytes:
    """The 4 KiB Identify data structure (admin opcode 0x06) for ``cns``."""
    buf = ffi.new("char[]", 4096)
    ret = lib.bd_nvme_identify(fd, nsid, cns, buf)
    if ret < 0:
        raise errno_error(-ret, f"NVMe Identify (CNS {cns})")
    if ret > 0:
        raise NVMeStatusError(ret, 0, f"Identify (CNS {cns})")
    return bytes(ffi.buffer(buf, 4096))


def dsm_range_limit(fd: int) -> int:
    """DMRSL, the most blocks one Dataset Management range may cover (0: no limit, or not reported).

    Linux 6.1 turns it into ``discard_max_hw_bytes``; 5.10 reports the block
    layer's maximum there instead (2199023255040 bytes in the test VM), and QEMU
    silently skips a longer range while completing the command with success, so
    bladed asks the controller itself.
    """
    try:
        data = identify(fd, 0, CNS_CS_CONTROLLER)
    except OSError:   # a controller that does not know CNS 06h (Invalid Field), or no right to send Identify
        return 0
    return int(struct.unpack_from("<I", data, 4)[0])


def parse_identity(nsid: int, ns: bytes, ctrl: bytes) -> NamespaceIdentity:
    nsze = struct.unpack_from("<Q", ns, 0)[0]
    nlbaf = ns[25] + 1
    flbas = ns[26]
    fmt = (flbas & 0xF) | ((flbas >> 5) & 0x3) << 4
    formats = []
    for i in range(min(nlbaf, 64)):
        ms, lbads, _rp = struct.unpack_from("<HBB", ns, 128 + 4 * i)
        formats.append((1 << lbads if lbads else 0, ms))
    lba_size, ms = formats[fmt]
    return NamespaceIdentity(
        nsid=nsid, nsze=nsze, lba_size=lba_size, metadata_size=ms, lba_formats=tuple(formats),
        current_format=fmt, dlfeat=ns[33], mdts=ctrl[77],
        serial=ctrl[4:24].decode("ascii", "replace").strip(),
        model=ctrl[24:64].decode("ascii", "replace").strip(),
    )


_NODE_NAME = re.compile(r"(?:ng|nvme)(\d+)n(\d+)")


def block_sysfs_of(path: str) -> str | None:
    """``/sys/block/nvmeXnY`` for ``/dev/ngXnY`` or ``/dev/nvmeXnY``, if present."""
    m = _NODE_NAME.fullmatch(os.path.basename(os.path.realpath(path)))
    if not m:
        return None
    d = f"/sys/block/nvme{m.group(1)}n{m.group(2)}"
    return d if os.path.isdir(d) else None


def block_node_problem(path: str, st: os.stat_result) -> str | None:
    """Why the NVMe backend must not take the block node ``path``, or None."""
    sysdir = f"/sys/dev/block/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    name = os.path.basename(os.path.realpath(sysdir))
    if os.path.exists(os.path.join(sysdir, "partition")):
        return (f"{path} is a partition ({name}); NVMe commands address the whole namespace: "
                "give the namespace (/dev/ngXnY, or /dev/nvmeXnY before Linux 5.13)")
    m = _NODE_NAME.fullmatch(name)
    if m is None or not name.startswith("nvme"):
        return f"{path} ({name}) is not an NVMe namespace (want /dev/ngXnY, or /dev/nvmeXnY before Linux 5.13)"
    generic = f"ng{m.group(1)}n{m.group(2)}"
    if os.path.exists(f"/sys/class/nvme-generic/{generic}"):
        return (f"{path} is not a character device: use /dev/{generic}, the namespace's generic node "
                "(io_uring passthrough needs it; the block node is for kernels without one, before 5.13)")
    return None


def _read_int(path: str, default: int) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return default


def transfer_limits(ident: NamespaceIdentity, sysfs_block: str | None) -> tuple[int, int]:
    """(ordinary-page limit, huge-page limit) for one passthrough command."""
    limits = [ident.mdts_bytes] if ident.mdts_bytes else []
    segments = 127
    if sysfs_block:
        hw = _read_int(os.path.join(sysfs_block, "queue", "max_hw_sectors_kb"), 0) * 1024
        if hw:
            limits.append(hw)
        segments = _read_int(os.path.join(sysfs_block, "queue", "max_segments"), segments)
    base = min(limits) if limits else 1 << 20
    # one segment per page; a buffer not page aligned touches one more page
    page_cap = (segments - 1) * PAGE_SIZE
    huge_cap = max(segments - 1, 1) * HUGE_PAGE_SIZE
    return min(base, page_cap), min(base, huge_cap)


class NvmeDevice(ExtentDevice):
    """An NVMe namespace through its generic char device (``/dev/ngXnY``), or through its block
    node (``/dev/nvmeXnY``) on a kernel that makes no generic one."""

    kind = "nvme"
    c_kind = lib.BD_KIND_NVME
    big_sqe = True

    def __init__(self, path: str) -> None:
        self.path = os.fspath(path)
        self.fd = -1
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "NVMe generic device does not exist", self.path) from None
        if stat.S_ISBLK(st.st_mode):
            problem = block_node_problem(self.path, st)
            if problem:
                raise BladedIOError(errno.ENODEV, problem)
            self.node = "block"
            try:   # mounted, swap, or claimed by a holder: refuse (the claim is not kept: see the module doc)
                os.close(os.open(self.path, os.O_RDONLY | os.O_EXCL | os.O_CLOEXEC))
            except OSError as e:
                if e.errno == errno.EBUSY:
                    raise BladedIOError(errno.EBUSY, f"{self.path} is in use (mounted or claimed)") from e
                raise
        elif stat.S_ISCHR(st.st_mode):
            self.node = "generic"
        else:
            raise BladedIOError(errno.ENODEV, f"{self.path} is not a character device (want /dev/ngXnY, "
                                "or /dev/nvmeXnY before Linux 5.13)")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        try:
            nsid = lib.bd_nvme_ns_id(self.fd)
            if nsid < 0:
                raise errno_error(-nsid, f"{self.path}: NVME_IOCTL_ID (not an NVMe namespace?)")
            self.identity = parse_identity(nsid, identify(self.fd, nsid, CNS_NAMESPACE),
                                           identify(self.fd, 0, CNS_CONTROLLER))
        except BaseException:
            self.close()
            raise
        ident = self.identity
        if ident.metadata_size:
            self.close()
            raise BladedIOError(errno.EINVAL, f"{self.path}: LBA format with {ident.metadata_size} bytes of "
                                "metadata is not supported; format the namespace without metadata")
        self.nsid = nsid
        self.lba_size = ident.lba_size
        self.capacity_blocks = ident.nsze
        self.sysfs_block = block_sysfs_of(self.path)
        self.max_transfer_bytes, self.max_transfer_bytes_huge = transfer_limits(ident, self.sysfs_block)
        self.zeroes_after_discard = ident.deallocate_reads_zeroes
        # one DSM range may not exceed DMRSL (6.1 exposes it as discard_max_hw_bytes, 5.10 does
        # not: asked of the controller too); QEMU silently skips a longer range
        self.max_discard_blocks = self._queue_blocks("discard_max_hw_bytes", 0xFFFFFFFF)
        dmrsl = dsm_range_limit(self.fd)
        if dmrsl:
            self.max_discard_blocks = min(self.max_discard_blocks, dmrsl)
        self.max_zeroes_blocks = self._queue_blocks("write_zeroes_max_bytes", 65536)
        self._fixed_ok: bool | None = None
        self.max_segments = 127
        if self.sysfs_block:
            self.max_segments = _read_int(os.path.join(self.sysfs_block, "queue", "max_segments"), 127)

    def _queue_blocks(self, name: str, default: int) -> int:
        nbytes = _read_int(os.path.join(self.sysfs_block, "queue", name), 0) if self.sysfs_block else 0
        blocks = nbytes // self.lba_size
        return min(blocks, default) if blocks else default

    def fixed_buffers_usable(self, buffers: Sequence[StagingBuffer]) -> bool:
        """Registered buffers no longer than ``max_segments`` pages work on every
        kernel with fixed-buffer passthrough (6.1+); larger ones need
        :meth:`fixed_buffers_supported`.  Never on the portable engine, which registers nothing."""
        if self.engine != engines.URING:
            return False
        return all(b.nbytes <= self.max_segments * PAGE_SIZE for b in buffers) or self.fixed_buffers_supported()

    def fixed_buffers_supported(self) -> bool:
        """Whether this kernel takes registered-buffer passthrough commands that
        start anywhere in a large registered buffer.

        Linux 6.1 (Debian 12) does not: it counts the pages from a command's
        start to the *end of the registered buffer* against ``max_segments``
        and fails the command with EINVAL; 6.12 is fine.  Probed once per
        device with a read of one block into the start of a registered buffer
        one page longer than ``max_segments`` (a read: the device is untouched).
        """
        if self.engine != engines.URING:
            return False   # ioctl passthrough: nothing registered (and no io_uring_cmd to probe with before 5.19)
        if self._fixed_ok is None:
            from bladed.io.uring import Op, Ring, Transfer

            with StagingBuffer((self.max_segments + 1) * PAGE_SIZE) as probe, Ring(1, big_sqe=True) as ring:
                if not ring.register_buffers([probe]):
                    self._fixed_ok = False
                    return False
                target = self.make_target()
                x = Transfer(target, Op.READ, 0, self.lba_size, probe.address, (probe, target))
                ring.run([x])
                self._fixed_ok = x.ok
        return self._fixed_ok

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(mdts=self.identity.mdts, mdts_bytes=self.identity.mdts_bytes, dlfeat=self.identity.dlfeat,
                 model=self.identity.model, serial=self.identity.serial)
        return d
