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
_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_RET_K = 0x20, 0x15, 0x06


def _filter() -> bytes:
    prog = [(_BPF_LD_W_ABS, 0, 0, 0)]                  # A = seccomp_data.nr
    for i, nr in enumerate(IO_URING_SYSCALLS):
        prog.append((_BPF_JEQ_K, len(IO_URING_SYSCALLS) - i, 0, nr))   # to the EPERM return
    prog.append((_BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW))
    prog.append((_BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM))
    return b"".join(struct.pack("HBBI", *ins) for ins in prog)


def deny_io_uring() -> None:
    """Install the filter in the calling process (irreversible: call it in a child)."""
    code = _filter()
    buf = ctypes.create_string_buffer(code)
    fprog = struct.pack("HxxxxxxP", len(code) // 8, ctypes.addressof(buf))
    fbuf = ctypes.create_string_buffer(fprog)
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if _libc.syscall(_SYSCALL[platform.machine()], SECCOMP_SET_MODE_FILTER, 0, fbuf) != 0:
        raise OSError(ctypes.get_errno(), "seccomp(SECCOMP_SET_MODE_FILTER)")


def command(argv: list[str]) -> list[str]:
    """``argv`` run under the filter (a ``PrivateDaemon`` ``wrap``)."""
    return [sys.executable, os.path.abspath(__file__), *argv]


if __name__ == "__main__":
    deny_io_uring()
    os.execvp(sys.argv[1], sys.argv[1:])
