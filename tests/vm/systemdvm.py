"""Helpers for the tests that run in the VM booted with ``--init systemd``
(systemd as PID 1 on a cgroup-v2-only kernel; tests/test_nvme_vm.py, case
``systemd-cgroup2-k6.12``): commands with deadlines, waiting on journal lines,
and an ext4 filesystem on namespace 2.

Nothing here sleeps to synchronise: ``systemctl start`` returns at READY=1
(Type=notify), journal lines are waited for on ``journalctl --follow``'s
output, with a deadline.
"""

from __future__ import annotations

import os
import platform
import queue
import re
import subprocess
import threading
import time
from pathlib import Path

from nvmevm import ns_name

#: one command (a daemon start is two Python start-ups: tens of seconds under TCG on a loaded host)
TIMEOUT = 300.0
#: where namespace 2 is mounted (ext4): a disk filesystem, so page-cache pages are file pages
DISK = "/mnt/nvme-ns2"


def kernel_release() -> tuple[int, int]:
    """The running kernel's (major, minor)."""
    return tuple(int(x) for x in platform.release().split("-")[0].split(".")[:2])  # type: ignore[return-value]


#: NVMe passthrough (Identify and I/O commands) on a read-write /dev/ngXnY needs no capability
UNPRIVILEGED_PASSTHROUGH = kernel_release() >= (6, 2)


def systemd_problem() -> str | None:
    """Why this is not the systemd VM, or None if it is."""
    if os.environ.get("NVMEVM_INIT") != "systemd":
        return "NVMEVM_INIT is not systemd (boot the VM with run-in-nvme-vm.sh --init systemd)"
    comm = Path("/proc/1/comm").read_text().strip()
    if comm != "systemd":
        return f"PID 1 is {comm!r}, not systemd"
    return None


def run(*argv: str, timeout: float = TIMEOUT, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command; a failure (with ``check``) raises with its output."""
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited with {r.returncode}:\n{r.stdout}{r.stderr}")
    return r


def start(unit: str) -> None:
    """``systemctl start``; a failure raises with the unit's last journal lines."""
    r = run("systemctl", "start", unit, check=False)
    if r.returncode != 0:
        log = run("journalctl", "--unit", unit, "--lines=40", "--no-pager", "--output=cat", check=False).stdout
        raise AssertionError(f"systemctl start {unit} exited with {r.returncode}: {r.stderr.strip()}\n{log}")


def show(unit: str, *props: str) -> dict[str, str]:
    """``systemctl show`` properties of ``unit``."""
    out = run("systemctl", "show", unit, *(f"--property={p}" for p in props)).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


class JournalWatch:
    """The journal lines of ``unit`` logged after this object was made, waited for with a deadline.

    :meth:`wait` looks at the lines after a mark (:meth:`mark`, taken before the action whose line is
    awaited), or by default at those after the previous wait's match: right when the awaited line can only
    follow that one. The watch itself starts at the journal's cursor when it is made."""

    def __init__(self, unit: str) -> None:
        # the journal's last entry, whatever its unit (a unit that never logged has no entry of its own)
        out = run("journalctl", "--lines=1", "--show-cursor", "--no-pager", "--quiet").stdout
        m = re.search(r"^-- cursor: (\S+)", out, re.M)
        assert m, f"journalctl printed no cursor: {out!r}"
        self.lines: list[str] = []
        self._next = 0                      # where a wait without a mark starts: after the last match
        self._q: queue.Queue[str | None] = queue.Queue()
        self._ended = False
        self._proc = subprocess.Popen(
            ["journalctl", "--unit", unit, "--follow", "--output=cat", "--no-pager", f"--after-cursor={m.group(1)}"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def _take(self, timeout: float) -> bool:
        """Move one line that arrived (waiting up to ``timeout`` s for it) to :attr:`lines`; False if none."""
        if self._ended:
            return False
        try:
            line = self._q.get(timeout=timeout) if timeout > 0 else self._q.get_nowait()
        except queue.Empty:
            return False
        if line is None:
            self._ended = True
            return False
        self.lines.append(line)
        return True

    def mark(self) -> int:
        """How many lines have arrived: take it before an action, wait ``after`` it."""
        while self._take(0):
            pass
        return len(self.lines)

    def wait(self, pattern: str, timeout: float = TIMEOUT, *, after: int | None = None) -> re.Match[str]:
        """The first line after ``after`` (default: after the previous wait's match) that matches ``pattern``."""
        rx = re.compile(pattern)
        i = self._next if after is None else after
        deadline = time.monotonic() + timeout
        while True:
            while i < len(self.lines):
                m = rx.search(self.lines[i])
                i += 1
                if m:
                    self._next = i
                    return m
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no journal line matching {pattern!r} within {timeout:.0f} s; seen: "
                                     f"{len(self.lines) - (self._next if after is None else after)} line(s), "
                                     f"the last {self.lines[-1] if self.lines else None!r}")
            if not self._take(left) and self._ended:
                raise AssertionError(f"journalctl ended before a line matched {pattern!r}")

    def close(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> JournalWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def disk() -> str:
    """Namespace 2 as an ext4 filesystem on :data:`DISK` (made and mounted once per VM)."""
    if os.path.ismount(DISK):
        return DISK
    dev = f"/dev/{ns_name(2)}"
    # lazy init: mkfs writes only the superblocks; noinit_itable keeps the kernel from zeroing the rest
    run("mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", dev)
    os.makedirs(DISK, exist_ok=True)
    run("mount", "-o", "noinit_itable", dev, DISK)
    return DISK
