"""Kernel feature detection (``bladed.io.features``) and the lines ``bladectl ns check`` shows for it.

On this machine each probe is compared with the raw system call made here through ctypes, not through
bladed's C extension.  Where a feature is missing, the child ``bladectl`` runs under a real seccomp
filter that refuses the system call as a container profile (EPERM) or a kernel without it (ENOSYS)
would; kernel.io_uring_disabled is set for real only inside the NVMe VM
(``tests/vm/test_features_in_vm.py``), never on a shared host.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import struct
import subprocess
import sys
from collections.abc import Callable

import pytest
import seccomp_util
from daemon_util import env_with_repo

from bladed.io import features

_libc = ctypes.CDLL(None, use_errno=True)
NR_IO_URING_SETUP, NR_IO_URING_REGISTER, NR_CACHESTAT = 425, 427, 451   # the same on x86-64 and arm64
IORING_REGISTER_PROBE = 8
IO_URING_OP_SUPPORTED = 1


# -- the raw system calls, for comparison ------------------------------------------------------------------
def raw_io_uring_fd() -> int:
    """io_uring_setup(1, params) through libc's syscall(); -errno on failure."""
    params = ctypes.create_string_buffer(120)                 # struct io_uring_params
    fd = _libc.syscall(NR_IO_URING_SETUP, 1, params)
    return fd if fd >= 0 else -ctypes.get_errno()


def raw_opcode_supported(fd: int, opcode: int) -> bool:
    """IORING_REGISTER_PROBE: struct io_uring_probe (16 bytes) + 256 struct io_uring_probe_op (8 bytes each)."""
    buf = ctypes.create_string_buffer(16 + 256 * 8)
    assert _libc.syscall(NR_IO_URING_REGISTER, fd, IORING_REGISTER_PROBE, buf, 256) == 0, ctypes.get_errno()
    ops_len = buf.raw[1]
    if opcode >= ops_len:
        return False
    _op, _resv, flags = struct.unpack_from("<BBH", buf.raw, 16 + 8 * opcode)
    return bool(flags & IO_URING_OP_SUPPORTED)


def raw_cachestat() -> int:
    """cachestat(fd, {0, 4096}, &cs, 0) on this interpreter: 0 or -errno."""
    rng = struct.pack("<QQ", 0, 4096)
    cs = ctypes.create_string_buffer(40)
    fd = os.open(sys.executable, os.O_RDONLY)
    try:
        ret = _libc.syscall(NR_CACHESTAT, fd, rng, cs, 0)
        return 0 if ret == 0 else -ctypes.get_errno()
    finally:
        os.close(fd)


def test_probes_agree_with_the_raw_system_calls() -> None:
    fd = raw_io_uring_fd()
    uring = features.io_uring()
    assert uring.available == (fd >= 0), (uring, fd)
    if fd >= 0:
        try:
            assert features.io_uring_cmd().available == raw_opcode_supported(fd, features.IORING_OP_URING_CMD)
        finally:
            os.close(fd)
    assert features.cachestat().available == (raw_cachestat() == 0)
    generic = features.nvme_generic_chardev()
    if os.path.isdir("/sys/class/nvme-generic"):
        assert generic.available
    elif os.path.isdir("/sys/module/nvme_core"):
        assert not generic.available and "kernel < 5.13" in generic.detail
    else:                                   # no NVMe driver (this build machine): what the kernel would do
        assert generic.available == (features.kernel_version() >= (5, 13)) and "no nvme driver" in generic.detail
    discard = features.io_uring_discard()
    assert discard.available == (features.io_uring_cmd().available and features.kernel_version() >= (6, 12))
    assert [f.name for f in features.detect()] == ["io_uring", "io_uring_cmd", "nvme generic char devices",
                                                   "cachestat", "io_uring discard"]
    assert all(f.fallback for f in features.detect())


def test_kernel_version_parses_distribution_releases() -> None:
    assert features.kernel_version("5.10.0-46-amd64") == (5, 10)
    assert features.kernel_version("6.12.117+deb12-amd64") == (6, 12)
    assert features.kernel_version("garbage") == (0, 0)
    assert features.kernel_version() == tuple(int(x) for x in platform.release().split(".")[:2])


@pytest.mark.parametrize(("err", "ctx", "want"), [
    (errno.EPERM, {"disabled": 2, "seccomp": 0}, "EPERM: kernel.io_uring_disabled = 2"),
    (errno.EPERM, {"disabled": 2, "seccomp": 2, "cap_sys_admin": True}, "EPERM: kernel.io_uring_disabled = 2"),
    (errno.EPERM, {"disabled": 1, "seccomp": 0, "groups": frozenset({1000}), "io_uring_group": -1},
     "EPERM: kernel.io_uring_disabled = 1 and not in kernel.io_uring_group (unset)"),
    (errno.EPERM, {"disabled": 1, "seccomp": 0, "groups": frozenset({1000}), "io_uring_group": 44},
     "EPERM: kernel.io_uring_disabled = 1 and not in kernel.io_uring_group (gid 44)"),
    # 1 lets CAP_SYS_ADMIN and the group in: their EPERM comes from somewhere else
    (errno.EPERM, {"disabled": 1, "seccomp": 2, "cap_sys_admin": True}, "EPERM: seccomp"),
    (errno.EPERM, {"disabled": 1, "seccomp": 2, "groups": frozenset({44}), "io_uring_group": 44}, "EPERM: seccomp"),
    (errno.EPERM, {"disabled": None, "seccomp": 2}, "EPERM: seccomp"),
    (errno.EPERM, {"disabled": 0, "seccomp": 0}, "EPERM: refused, not by seccomp nor kernel.io_uring_disabled"),
    (errno.ENOSYS, {"disabled": None, "seccomp": 0}, "ENOSYS: kernel without io_uring, or a sandbox such as gVisor"),
    (errno.ENOSYS, {"disabled": None, "seccomp": 2}, "ENOSYS: seccomp, or a kernel without io_uring"),
    (errno.ENOMEM, {"disabled": None, "seccomp": 0}, "ENOMEM: RLIMIT_MEMLOCK too small for a ring, kernel < 5.12"),
    (errno.EINVAL, {"disabled": None, "seccomp": 0}, "EINVAL: Invalid argument"),
])
def test_setup_refusal_names_the_cause(err: int, ctx: dict, want: str) -> None:
    assert features.setup_refusal(err, **ctx).startswith(want)


# -- bladectl ns check in a child, under a real seccomp filter ---------------------------------------------
def deny(rules: dict[int, int]) -> Callable[[], None]:
    """A ``preexec_fn`` that makes each system call of ``rules`` fail with its errno (a seccomp filter)."""
    prog = [(0x20, 0, 0, 0)]                                   # A = seccomp_data.nr
    for nr, err in rules.items():
        prog += [(0x15, 0, 1, nr), (0x06, 0, 0, 0x00050000 | err)]   # nr? return ERRNO(err)
    prog.append((0x06, 0, 0, 0x7FFF0000))                      # allow
    code = b"".join(struct.pack("HBBI", *ins) for ins in prog)

    def install() -> None:
        buf = ctypes.create_string_buffer(code)
        fprog = ctypes.create_string_buffer(struct.pack("HxxxxxxP", len(code) // 8, ctypes.addressof(buf)))
        if _libc.prctl(38, 1, 0, 0, 0) != 0:                   # PR_SET_NO_NEW_PRIVS
            raise OSError(ctypes.get_errno(), "prctl")
        if _libc.syscall(seccomp_util._SYSCALL[platform.machine()], 1, 0, fprog) != 0:   # SECCOMP_SET_MODE_FILTER
            raise OSError(ctypes.get_errno(), "seccomp")
    return install


def ns_check(path: str, *, preexec: Callable[[], None] | None, extra: tuple[str, ...] = ()) -> dict:
    r = subprocess.run([sys.executable, "-m", "bladed.cli.bladectl", "ns", "check", path, *extra, "--json"],
                       capture_output=True, text=True, timeout=120, env=env_with_repo(), preexec_fn=preexec)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    out = json.loads(r.stdout)
    assert out["usable"], out
    return {c["check"]: c for c in out["checks"]}


@pytest.fixture
def store_file(store_dir: str) -> str:
    path = os.path.join(store_dir, "kv.img")
    with open(path, "wb") as f:
        f.truncate(16 << 20)
    return path


def test_check_shows_each_feature_as_probed_here(store_file: str) -> None:
    by = ns_check(store_file, preexec=None)
    for f in (features.io_uring(), features.cachestat()):
        assert by[f.name]["status"] == ("ok" if f.available else "warn")
        assert by[f.name]["detail"] == f.describe()
    engine = "uring" if features.io_uring().available else "portable"
    assert f"file backend on the {engine} engine with io.engine = auto" in by["kernel"]["detail"]
    assert by["read"]["status"] == "ok" and f"on the {engine} engine" in by["read"]["detail"]


def test_check_under_a_container_seccomp_profile_warns_and_names_the_portable_engine(store_file: str) -> None:
    """Docker's and containerd's default profiles deny io_uring_setup with EPERM: a warning, not a failure."""
    by = ns_check(store_file, preexec=seccomp_util.deny_io_uring)
    assert by["io_uring"] == {"check": "io_uring", "status": "warn",
                              "detail": "unavailable (EPERM: seccomp) → portable engine (preadv2/pwritev2 threads)"}
    kernel = by["kernel"]["detail"]
    assert "on the portable engine with io.engine = auto (io_uring unavailable: EPERM: seccomp)" in kernel
    assert by["read"]["status"] == "ok" and "on the portable engine" in by["read"]["detail"]


def test_check_where_the_system_calls_do_not_exist(store_file: str) -> None:
    """ENOSYS, as from a kernel without io_uring (or gVisor) and one before cachestat(2) (6.5)."""
    by = ns_check(store_file, preexec=deny({NR_IO_URING_SETUP: errno.ENOSYS, NR_CACHESTAT: errno.ENOSYS}))
    assert by["io_uring"]["status"] == "warn"
    assert by["io_uring"]["detail"] == ("unavailable (ENOSYS: seccomp, or a kernel without io_uring) → "
                                        "portable engine (preadv2/pwritev2 threads)")
    assert by["cachestat"] == {"check": "cachestat", "status": "warn", "detail": "unavailable (ENOSYS: seccomp, "
                               "or kernel < 6.5) → page-cache residency by mincore(2) on the mapping"}
    assert by["read"]["status"] == "ok" and "on the portable engine" in by["read"]["detail"]


@pytest.mark.root
def test_check_of_a_block_device_under_seccomp_falls_back_to_blkdiscard(loop_device: str) -> None:
    by = ns_check(loop_device, preexec=seccomp_util.deny_io_uring)
    assert by["io_uring discard"] == {
        "check": "io_uring discard", "status": "warn",
        "detail": "unavailable (io_uring unavailable: EPERM: seccomp) → ioctl(BLKDISCARD)"}
    assert by["read"]["status"] == "ok" and "on the portable engine" in by["read"]["detail"]
    plain = ns_check(loop_device, preexec=None)["io_uring discard"]
    assert plain["detail"] == features.io_uring_discard().describe()
