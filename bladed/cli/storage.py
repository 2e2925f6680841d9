"""The storage side of ``bladectl ns check`` / ``ns setup``: which backend a path is, and whether
something else already uses it (the checks that follow are in :mod:`bladed.cli.checks`).

"In use" means, in this order: a live bladed serves it (the daemon keeps its store open and holds
the flock on ``bladed.lock`` in its state directory, :mod:`bladed.server.storage.journal`), a filesystem on it
(or on one of its partitions) is mounted, it is swap, a device-mapper / md device is stacked on it,
or another process has it open exclusively (``O_EXCL`` gives ``EBUSY``).  For an NVMe namespace
(``/dev/ngXnY``) the same questions are asked of its block device ``/dev/nvmeXnY``: passthrough
writes would go under a mounted filesystem's feet.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any

from bladed.io.nvme import block_node_problem
from bladed.server.storage.journal import LOCK

KINDS = {"file": "plain file", "block": "block device", "nvme": "character device (NVMe namespace)"}


class StorageError(Exception):
    """``path`` cannot be checked or used; ``code`` is machine-readable, ``usage``: the path itself is wrong."""

    def __init__(self, message: str, code: str, *, usage: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.usage = usage


def target_backend(path: str, requested: str = "auto") -> str:
    """The backend for ``path`` (``file``, ``block`` or ``nvme``), or StorageError.

    A ``/dev`` path is a device or nothing: never a store file to create.
    """
    under_dev = os.path.abspath(path).startswith("/dev/")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if under_dev or requested in ("block", "nvme"):
            raise StorageError(f"no such device {path}; see `bladectl ns list`", "no_such_device",
                               usage=True) from None
        return "file"
    except OSError as e:
        raise StorageError(f"cannot look at {path}: {e.strerror}", "os_error") from None
    if stat.S_ISCHR(st.st_mode):
        kind = "nvme"
        sysdir = f"/sys/dev/char/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        if os.path.basename(os.path.realpath(f"{sysdir}/subsystem")) != "nvme-generic":
            raise StorageError(f"{path} is a character device but not an NVMe namespace (/dev/ngXnY); see "
                               "`bladectl ns list`", "not_a_namespace", usage=True)
    elif stat.S_ISBLK(st.st_mode):
        kind = "block"
        if requested == "nvme":
            # the NVMe backend takes a namespace's block node where the kernel makes no /dev/ngXnY (before 5.13)
            problem = block_node_problem(path, st)
            if problem:
                raise StorageError(problem, "not_a_namespace", usage=True)
            kind = "nvme"
    elif stat.S_ISREG(st.st_mode):
        kind = "file"
    else:
        raise StorageError(f"{path} is {'a directory' if stat.S_ISDIR(st.st_mode) else 'not a regular file'}; "
                           "give a store file, a block device or an NVMe namespace (/dev/ngXnY)", "not_a_store",
                           usage=True)
    if kind == "file" and under_dev:
        raise StorageError(f"{path} is a plain file under /dev, not a device; give a device (`bladectl ns list`) "
                           "or a store file on a disk filesystem", "not_a_device", usage=True)
    if requested not in ("auto", kind):
        raise StorageError(f"{path} is a {KINDS[kind]}, not what --backend {requested} uses; give --backend {kind} "
                           "(or leave --backend auto)", "wrong_backend", usage=True)
    return kind


# -- who uses it -----------------------------------------------------------------------------------
@dataclass
class Process:
    """A process that has the store open."""

    pid: int
    comm: str
    #: the ``bladed.lock`` it holds the flock on ("" = not a bladed daemon)
    lock: str = ""
    sockets: list[str] = field(default_factory=list)

    def describe(self) -> str:
        if self.lock:
            where = ", ".join(self.sockets) or f"state directory {os.path.dirname(self.lock)}"
            return f"bladed pid {self.pid} ({'socket ' if self.sockets else ''}{where})"
        return f"pid {self.pid} ({self.comm})"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _unescape(s: str) -> str:
    """Undo the octal escapes of /proc/self/mountinfo and /proc/swaps (``\\040`` = space)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def _same_file(st: os.stat_result) -> Any:
    """What identifies an open file: the device number of a device node, else (st_dev, st_ino)."""
    if stat.S_ISBLK(st.st_mode) or stat.S_ISCHR(st.st_mode):
        return ("dev", st.st_rdev)
    return ("ino", st.st_dev, st.st_ino)


def _flocks() -> set[tuple[int, int, int]]:
    """(pid, st_dev, st_ino) of every flock held (/proc/locks)."""
    out = set()
    for line in _read("/proc/locks").splitlines():
        f = line.split()
        if len(f) < 6 or f[1] != "FLOCK":
            continue  # "->" lines are waiters
        try:
            maj, mnr, ino = f[5].split(":")
            out.add((int(f[4]), os.makedev(int(maj, 16), int(mnr, 16)), int(ino)))
        except ValueError:
            continue
    return out


def _listening_sockets() -> dict[int, str]:
    """inode -> path of every listening Unix stream socket with a path (/proc/net/unix)."""
    out = {}
    for line in _read("/proc/net/unix").splitlines()[1:]:
        f = line.split(None, 7)  # the path may hold spaces
        with contextlib.suppress(ValueError):
            if len(f) == 8 and int(f[3], 16) & 0x10000 and f[4] == "0001" and f[7].startswith("/"):
                out[int(f[6])] = f[7]
    return out


def openers(path: str) -> list[Process]:
    """Processes other than this one that have ``path`` open (those whose /proc we may read)."""
    want = _same_file(os.stat(path))
    locks = _flocks()
    listening: dict[int, str] | None = None
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        pid = int(name)
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue  # gone, or another user's
        holds, lock, inodes = False, "", []
        for fd in fds:
            try:
                link = os.readlink(f"{fd_dir}/{fd}")
                if link.startswith("socket:["):
                    inodes.append(int(link[8:-1]))
                    continue
                if not link.startswith("/"):
                    continue  # pipe:, anon_inode:
                st = os.stat(f"{fd_dir}/{fd}")
            except (OSError, ValueError):
                continue
            holds = holds or _same_file(st) == want
            if os.path.basename(link) == LOCK and (pid, st.st_dev, st.st_ino) in locks:
                lock = link
        if not holds:
            continue
        p = Process(pid, _read(f"/proc/{pid}/comm").strip(), lock)
        if lock:
            listening = _listening_sockets() if listening is None else listening
            p.sockets = sorted(listening[i] for i in inodes if i in listening)
        out.append(p)
    return out


def _sys_block(rdev: int) -> str:
    """/sys/class/block/NAME of a block device number ("" if sysfs does not know it)."""
    p = os.path.realpath(f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}")
    return p if os.path.isdir(p) else ""


def _dev_number(sysdir: str) -> int | None:
    try:
        maj, mnr = _read(os.path.join(sysdir, "dev")).strip().split(":")
        return os.makedev(int(maj), int(mnr))
    except ValueError:
        return None


def _block_users(node: str, rdev: int) -> str | None:
    """Why the block device ``rdev`` (``node`` in /dev, "" if none) is in use, or None."""
    sysdir = _sys_block(rdev)
    # the device and its partitions: a mounted partition makes the whole disk busy
    parts: dict[int, str] = {rdev: ""}
    part_dirs = [sysdir] if sysdir else []
    for entry in sorted(os.listdir(sysdir)) if sysdir else []:
        sub = os.path.join(sysdir, entry)
        n = _dev_number(sub) if os.path.exists(os.path.join(sub, "partition")) else None
        if n is not None:
            parts[n] = f"its partition {entry} is "
            part_dirs.append(sub)
    mounts: dict[int, list[str]] = {}
    for line in _read("/proc/self/mountinfo").splitlines():
        f = line.split()
        try:
            maj, mnr = f[2].split(":")
            dev = os.makedev(int(maj), int(mnr))
            source = f[f.index("-") + 2]
        except (ValueError, IndexError):
            continue
        if dev not in parts and source.startswith("/dev/"):
            with contextlib.suppress(OSError):
                dev = os.stat(source).st_rdev  # btrfs and others show an anonymous device number
        if dev in parts:
            mounts.setdefault(dev, []).append(_unescape(f[4]))
    for dev, points in mounts.items():
        points = sorted(set(points), key=len)
        more = f" (and {len(points) - 1} more mount points)" if len(points) > 1 else ""
        return f"{parts[dev]}mounted at {points[0]}{more}"
    for line in _read("/proc/swaps").splitlines()[1:]:
        swap = _unescape(line.split()[0]) if line.split() else ""
        with contextlib.suppress(OSError):
            if swap.startswith("/dev/") and os.stat(swap).st_rdev in parts:
                return f"{parts[os.stat(swap).st_rdev]}used as swap"
    for part_dir in part_dirs:
        holders_dir = os.path.join(part_dir, "holders")
        for h in sorted(os.listdir(holders_dir)) if os.path.isdir(holders_dir) else []:
            dm = _read(f"/sys/class/block/{h}/dm/name").strip()
            kind = (f"device-mapper {dm or h} (LVM, dm-crypt or multipath)" if h.startswith("dm-")
                    else f"software RAID {h}" if h.startswith("md") else h)
            return f"held by {kind}" + ("" if part_dir == sysdir else f" through {os.path.basename(part_dir)}")
    if node:
        try:
            fd = os.open(node, os.O_RDONLY | os.O_EXCL | os.O_CLOEXEC)
        except OSError as e:
            if e.errno != errno.EBUSY:
                return None  # no right to probe: the checks report the permission
            others = [p.describe() for p in openers(node)]
            return "opened exclusively by " + (" or ".join(others) or "another process")
        os.close(fd)
    return None


def nvme_block_device(char_device: str) -> tuple[str, int] | None:
    """(``/dev/nvmeXnY``, its device number) of a namespace's generic char device, or None."""
    from bladed.io.discovery import block_name_for

    rdev = os.stat(char_device).st_rdev
    generic = os.path.basename(os.path.realpath(f"/sys/dev/char/{os.major(rdev)}:{os.minor(rdev)}"))
    block = block_name_for(generic)
    n = _dev_number(f"/sys/class/block/{block}") if block else None
    if block is None or n is None:
        return None
    return f"/dev/{block}", n


def in_use(path: str, kind: str) -> str | None:
    """Why bladed must not take ``path`` (an existing store of backend ``kind``), or None."""
    procs = openers(path)
    daemons = [p for p in procs if p.lock]
    if daemons:
        return "in use by " + " and ".join(p.describe() for p in daemons)
    if kind == "block":
        why = _block_users(path, os.stat(path).st_rdev)
        return f"in use: {why}" if why else None
    if kind == "nvme":
        blk = nvme_block_device(path)
        if blk is not None:
            node, rdev = blk
            why = _block_users(node if os.path.exists(node) else "", rdev)
            if why:
                return f"in use through its block device {node}: {why}"
    return None


def partition_offset(fd: int) -> int:
    """Where the partition open on ``fd`` starts in its disk, in bytes (0: a whole disk)."""
    base = _sys_block(os.fstat(fd).st_rdev)
    try:
        return int(_read(os.path.join(base, "start")).strip()) * 512 if base else 0
    except ValueError:
        return 0  # a whole disk
