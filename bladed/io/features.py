"""Kernel and sandbox features bladed's I/O depends on, detected by trying them (not by the version alone).

Each function answers for this process, once (cached): a seccomp filter, a sysctl or a sandbox can
refuse what the kernel has, so a kernel version says what to expect, never what works.  Every
:class:`Feature` names what bladed does without it.  ``bladectl ns check`` shows them
(:func:`detect`); the engine choice (:mod:`bladed.io.engines`) reads :func:`io_uring` and
:func:`io_uring_cmd`.  docs/operations.md, "Kernel features and fallbacks", has the table.
"""

from __future__ import annotations

import errno
import functools
import os
import platform
import re
from dataclasses import dataclass

from bladed._uring import ffi, lib

#: IORING_OP_NOP: any ring that sets up supports it (the io_uring probe)
IORING_OP_NOP = 0
#: IORING_OP_URING_CMD (kernel 5.19+): NVMe passthrough through io_uring
IORING_OP_URING_CMD = 46

PORTABLE_ENGINE = "portable engine (preadv2/pwritev2 threads)"
IOCTL_PASSTHROUGH = "NVMe passthrough by ioctl (NVME_IOCTL_IO64_CMD) on the portable engine"
BLOCK_NODE = "passthrough ioctls on the namespace's block node /dev/nvmeXnY"
MINCORE = "page-cache residency by mincore(2) on the mapping"
BLKDISCARD = "ioctl(BLKDISCARD)"

IO_URING_DISABLED = "/proc/sys/kernel/io_uring_disabled"
IO_URING_GROUP = "/proc/sys/kernel/io_uring_group"


@dataclass(frozen=True)
class Feature:
    """One feature: whether this process has it, why (not), and what bladed does instead."""

    name: str
    available: bool
    detail: str
    fallback: str

    def describe(self) -> str:
        """``available (...)`` or ``unavailable (...) → fallback``: one line for ``bladectl ns check``."""
        if self.available:
            return f"available ({self.detail})"
        return f"unavailable ({self.detail}) → {self.fallback}"


def kernel_version(release: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``uname -r`` (or ``release``); (0, 0) if unreadable."""
    m = re.match(r"(\d+)\.(\d+)", release if release is not None else platform.release())
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _status_field(name: str) -> str:
    """A field of /proc/self/status ("" if absent)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _seccomp_mode() -> int:
    """0 none, 1 strict, 2 filter (``Seccomp:`` of /proc/self/status)."""
    field = _status_field("Seccomp")
    return int(field) if field.isdigit() else 0


def _cap_sys_admin() -> bool:
    """Whether this process has CAP_SYS_ADMIN (bit 21 of ``CapEff:``), which kernel.io_uring_disabled = 1 lets in."""
    try:
        return bool(int(_status_field("CapEff") or "0", 16) >> 21 & 1)
    except ValueError:
        return False


def setup_refusal(err: int, *, disabled: int | None, seccomp: int, groups: frozenset[int] = frozenset(),
                  io_uring_group: int | None = None, cap_sys_admin: bool = False) -> str:
    """Why io_uring_setup(2) failed with ``err``, from what this process can see of its sandbox.

    ``disabled``: kernel.io_uring_disabled (None: no such sysctl, before 6.6); ``seccomp``: the
    process's seccomp mode; ``groups``: its group ids; ``io_uring_group``: kernel.io_uring_group;
    ``cap_sys_admin``: whether the process has CAP_SYS_ADMIN.
    """
    name = errno.errorcode.get(err, str(err))
    if err == errno.EPERM:
        if disabled == 2:
            return "EPERM: kernel.io_uring_disabled = 2"
        if disabled == 1 and not cap_sys_admin and (io_uring_group is None or io_uring_group not in groups):
            group = f"gid {io_uring_group}" if io_uring_group is not None and io_uring_group >= 0 else "unset"
            return f"EPERM: kernel.io_uring_disabled = 1 and not in kernel.io_uring_group ({group})"
        if seccomp == 2:
            return "EPERM: seccomp"
        return "EPERM: refused, not by seccomp nor kernel.io_uring_disabled (an LSM?)"
    if err == errno.ENOSYS:
        if seccomp == 2:
            return "ENOSYS: seccomp, or a kernel without io_uring"
        return "ENOSYS: kernel without io_uring, or a sandbox such as gVisor"
    if err == errno.ENOMEM:
        return "ENOMEM: RLIMIT_MEMLOCK too small for a ring, kernel < 5.12"
    return f"{name}: {os.strerror(err)}"


def _probe(opcode: int) -> int:
    """bd_uring_probe: 1 supported, 0 not, -errno: io_uring_setup failed."""
    return int(lib.bd_uring_probe(opcode))


@functools.cache
def io_uring() -> Feature:
    """Whether io_uring_setup(2) works for this process (seccomp, sysctl and sandboxes can refuse it)."""
    ret = _probe(IORING_OP_NOP)
    if ret >= 0:
        return Feature("io_uring", True, "io_uring_setup works", PORTABLE_ENGINE)
    gid = _read_int(IO_URING_GROUP)
    why = setup_refusal(-ret, disabled=_read_int(IO_URING_DISABLED), seccomp=_seccomp_mode(),
                        groups=frozenset((os.getegid(), *os.getgroups())), io_uring_group=gid,
                        cap_sys_admin=_cap_sys_admin())
    return Feature("io_uring", False, why, PORTABLE_ENGINE)


@functools.cache
def io_uring_cmd() -> Feature:
    """Whether io_uring has IORING_OP_URING_CMD (NVMe passthrough; Linux 5.19+), by IORING_REGISTER_PROBE."""
    if not io_uring().available:
        return Feature("io_uring_cmd", False, f"io_uring unavailable: {io_uring().detail}", IOCTL_PASSTHROUGH)
    ret = _probe(IORING_OP_URING_CMD)
    if ret > 0:
        return Feature("io_uring_cmd", True, "IORING_OP_URING_CMD supported", IOCTL_PASSTHROUGH)
    return Feature("io_uring_cmd", False, "IORING_OP_URING_CMD not supported: kernel < 5.19", IOCTL_PASSTHROUGH)


@functools.cache
def nvme_generic_chardev() -> Feature:
    """Whether the kernel makes NVMe generic char devices ``/dev/ngXnY`` (Linux 5.13+).

    The nvme driver registers the ``nvme-generic`` class when it loads: with the driver present
    (``/sys/module/nvme_core``) the class directory answers; without it (a host with no NVMe)
    the kernel version says what the driver would do.
    """
    if os.path.isdir("/sys/class/nvme-generic"):
        return Feature("nvme generic char devices", True, "/sys/class/nvme-generic exists", BLOCK_NODE)
    if os.path.isdir("/sys/module/nvme_core"):
        return Feature("nvme generic char devices", False, "nvme driver loaded, no nvme-generic class: kernel < 5.13",
                       BLOCK_NODE)
    expected = kernel_version() >= (5, 13)
    return Feature("nvme generic char devices", expected,
                   "no nvme driver loaded: " + ("kernel >= 5.13 makes them" if expected else "kernel < 5.13"),
                   BLOCK_NODE)


@functools.cache
def cachestat() -> Feature:
    """Whether cachestat(2) (syscall 451, Linux 6.5+) works: tried on this interpreter's executable."""
    out = ffi.new("uint64_t[5]")
    try:
        fd = os.open("/proc/self/exe", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        return Feature("cachestat", False, f"cannot open a file to try it on: {e.strerror}", MINCORE)
    try:
        ret = int(lib.bd_cachestat(fd, 0, 4096, out))
    finally:
        os.close(fd)
    if ret == 0:
        return Feature("cachestat", True, "cachestat(2) works", MINCORE)
    err = -ret
    if err == errno.ENOSYS:
        why = ("ENOSYS: seccomp, or kernel < 6.5"
               if _seccomp_mode() == 2 else "ENOSYS: kernel < 6.5")
    elif err == errno.EPERM:
        why = "EPERM: seccomp"
    else:
        why = f"{errno.errorcode.get(err, str(err))}: {os.strerror(err)}"
    return Feature("cachestat", False, why, MINCORE)


@functools.cache
def io_uring_discard() -> Feature:
    """Whether block discard can go through io_uring (BLOCK_URING_CMD_DISCARD, Linux 6.12+).

    It has no opcode of its own to probe (it rides on IORING_OP_URING_CMD on a block device), and
    trying it needs a writable block device that may be discarded, which a start-up check does not
    have.  So: without io_uring_cmd it is certainly missing; with it, a kernel from 6.12 on is
    expected to have it, and the engine tries it first and switches to ioctl(BLKDISCARD) for good
    on the first EOPNOTSUPP/EINVAL (``Engine._discard_fallback``), so a wrong guess costs one
    refused command, never a failed discard.
    """
    cmd = io_uring_cmd()
    if not cmd.available:
        return Feature("io_uring discard", False, cmd.detail, BLKDISCARD)
    if kernel_version() >= (6, 12):
        return Feature("io_uring discard", True, "kernel >= 6.12: tried first, falls back to BLKDISCARD on refusal",
                       BLKDISCARD)
    return Feature("io_uring discard", False, "BLOCK_URING_CMD_DISCARD needs kernel 6.12+", BLKDISCARD)


def detect() -> list[Feature]:
    """Every feature, in the order ``bladectl ns check`` shows them."""
    return [io_uring(), io_uring_cmd(), nvme_generic_chardev(), cachestat(), io_uring_discard()]
