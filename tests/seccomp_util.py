"""Run a child the way a container's default seccomp profile runs it: io_uring_setup/enter/register fail
with EPERM (Docker's and containerd's default profiles deny them), everything else allowed.

``deny_io_uring`` is a ``preexec_fn``: it installs the filter in the child, between fork and exec;
``command(argv)`` runs ``argv`` under it (``python tests/seccomp_util.py ARGV...``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
import sys

_libc = ctypes.CDLL(None, use_errno=True)

PR_SET_NO_NEW_PRIVS = 38
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
# the same numbers on x86-64 and arm64 (syscalls added since 4.20 share one table)
IO_URING_SYSCALLS = (425, 426, 427)
_SYSCALL = {"x86_64": 317, "aarch64": 277}            # __NR_seccomp
_IOCTL = {"x86_64": 16, "aarch64": 29}                # __NR_ioctl
#: NVME_IOCTL_IO64_CMD and NVME_IOCTL_IO_CMD (_IOWR('N', 0x48 / 0x43, 80- / 72-byte structs): one encoding on both)
NVME_IO_IOCTLS = (0xC0504E48, 0xC0484E43)
_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_RET_K = 0x20, 0x15, 0x06
_ARG1_LOW = 24                                        # seccomp_data.args[1], its low 32 bits (little-endian)


def _filter(ioctls: tuple[int, ...] = ()) -> bytes:
    """EPERM for io_uring_setup/enter/register and for ``ioctl(fd, REQ)`` with REQ in ``ioctls``."""
    deny = (_BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM)
    allow = (_BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW)
    prog = [(_BPF_LD_W_ABS, 0, 0, 0)]                  # A = seccomp_data.nr
    # each JEQ jumps to the deny at the end when it matches (jt counts the instructions skipped)
    tail: list[tuple[int, int, int, int]] = []
    if ioctls:
        tail = [(_BPF_LD_W_ABS, 0, 0, _ARG1_LOW)]
        tail += [(_BPF_JEQ_K, len(ioctls) - i, 0, req) for i, req in enumerate(ioctls)]
        tail.append(allow)
    n = len(IO_URING_SYSCALLS)
    for i, nr in enumerate(IO_URING_SYSCALLS):
        prog.append((_BPF_JEQ_K, n - i + len(tail) + (1 if ioctls else 0), 0, nr))
    if ioctls:
        prog.append((_BPF_JEQ_K, 1, 0, _IOCTL[platform.machine()]))   # ioctl: look at its request
    prog.append(allow)
    prog += tail
    prog.append(deny)
    return b"".join(struct.pack("HBBI", *ins) for ins in prog)


def deny_io_uring(ioctls: tuple[int, ...] = ()) -> None:
    """Install the filter in the calling process (irreversible: call it in a child); ``ioctls``: requests to
    deny as well (:data:`NVME_IO_IOCTLS`: a process that may use neither io_uring nor NVMe passthrough)."""
    code = _filter(ioctls)
    buf = ctypes.create_string_buffer(code)
    fprog = struct.pack("HxxxxxxP", len(code) // 8, ctypes.addressof(buf))
    fbuf = ctypes.create_string_buffer(fprog)
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if _libc.syscall(_SYSCALL[platform.machine()], SECCOMP_SET_MODE_FILTER, 0, fbuf) != 0:
        raise OSError(ctypes.get_errno(), "seccomp(SECCOMP_SET_MODE_FILTER)")


def command(argv: list[str], *, deny_nvme_ioctls: bool = False) -> list[str]:
    """``argv`` run under the filter (a ``PrivateDaemon`` ``wrap``)."""
    return [sys.executable, os.path.abspath(__file__), *(["--deny-nvme-ioctls"] if deny_nvme_ioctls else []), *argv]


if __name__ == "__main__":
    args = sys.argv[1:]
    nvme = args[:1] == ["--deny-nvme-ioctls"]
    deny_io_uring(NVME_IO_IOCTLS if nvme else ())
    os.execvp(args[nvme], args[nvme:])
