"""What a benchmark records about the machine it ran on: CPU, memory, OS, kernel,
the filesystem and block device under the data, the git commit.

Shared by every study; :mod:`bladed_bench.trials` puts it in the JSON's envelope.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from collections.abc import Sequence
from typing import Any


def read_text(path: str) -> str | None:
    """A small /proc or /sys file, stripped; None if it cannot be read."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def run_text(cmd: Sequence[str]) -> str | None:
    """A command's stdout, stripped; None if it cannot run or fails."""
    try:
        out = subprocess.run(list(cmd), check=True, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def os_release() -> str | None:
    for line in (read_text("/etc/os-release") or "").splitlines():
        if line.startswith("PRETTY_NAME="):
            return line.split("=", 1)[1].strip('"')
    return None


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``), or None."""
    for line in (read_text("/proc/cpuinfo") or "").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return None


def machine_info() -> dict[str, Any]:
    """CPU, memory, virtualisation, OS, kernel, Python and the load average now."""
    hypervisor = any(line.startswith("flags") and " hypervisor" in line
                     for line in (read_text("/proc/cpuinfo") or "").splitlines())
    mem_total = None
    for line in (read_text("/proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            mem_total = int(line.split()[1]) * 1024
    return {
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_bytes": mem_total,
        "hypervisor": hypervisor,                                 # cpuinfo flag: a virtual machine
        "systemd_detect_virt": run_text(["systemd-detect-virt"]),  # may name a container instead
        "kernel": platform.release(),
        "kernel_version": platform.version(),
        "os": os_release(),
        "python": platform.python_version(),
        "loadavg_start": read_text("/proc/loadavg"),
    }


def filesystem_of(path: str) -> dict[str, Any] | None:
    """Mount point, fstype, source and options of the filesystem holding ``path``."""
    st = os.stat(path)
    devno = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    real = os.path.realpath(path)
    best: dict[str, Any] | None = None
    for line in (read_text("/proc/self/mountinfo") or "").splitlines():
        left, _, right = line.partition(" - ")
        f = left.split()
        r = right.split()
        if len(f) < 6 or len(r) < 2 or f[2] != devno:
            continue
        mnt = f[4].replace("\\040", " ")
        if not (real == mnt or real.startswith(mnt.rstrip("/") + "/")):
            continue
        if best is None or len(mnt) > len(best["mount_point"]):
            best = {"mount_point": mnt, "fstype": r[0], "source": r[1], "options": f[5],
                    "super_options": r[2] if len(r) > 2 else ""}
    return best


def disk_info(sysdir: str | None) -> dict[str, Any] | None:
    """Queue settings of the block device at ``sysdir`` (``/sys/dev/block/M:m``, resolved)."""
    if not sysdir:
        return None
    queue = os.path.join(sysdir, "queue")
    if not os.path.isdir(queue):      # a partition: the queue is the parent's
        queue = os.path.join(os.path.dirname(sysdir), "queue")
    return {
        "sysfs": sysdir,
        "name": os.path.basename(sysdir),
        "scheduler": read_text(os.path.join(queue, "scheduler")),
        "rotational": read_text(os.path.join(queue, "rotational")),
        "max_sectors_kb": read_text(os.path.join(queue, "max_sectors_kb")),
        "max_hw_sectors_kb": read_text(os.path.join(queue, "max_hw_sectors_kb")),
        "nr_requests": read_text(os.path.join(queue, "nr_requests")),
    }


def git_info(repo: str, paths: Sequence[str] = ()) -> dict[str, Any]:
    """HEAD of ``repo`` and whether tracked files (under ``paths``, if given) differ from it."""
    commit = run_text(["git", "-C", repo, "rev-parse", "HEAD"])
    status = run_text(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no",
                       *(["--", *paths] if paths else [])])
    return {"commit": commit or None, "dirty": bool(status) if status is not None else None}


__all__ = ["cpu_model", "disk_info", "filesystem_of", "git_info", "machine_info", "os_release", "read_text", "run_text"]
