"""A private bladed: ``python -m bladed.server`` as a child process, ready when it says ``READY=1``.

The one launcher of the runner's ``--spawn-daemon``, the benchmark harness and the tests. Ready means
the daemon's own sd_notify ``READY=1`` on a datagram socket of this process (as systemd would have it),
so neither a stale socket file nor another daemon's socket is taken for it. A leaf: standard library only.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any


class SpawnError(RuntimeError):
    """The daemon exited before ``READY=1`` or was not ready in time; the message is one line naming its log."""


class PrivateDaemon:
    """``python -m bladed.server ARGS`` started by :meth:`start`, awaited by :meth:`wait_ready`, ended by :meth:`stop`.

    As a context manager: entering starts it (unless :meth:`start` already did; it does not wait, call
    :meth:`wait_ready`), leaving stops it however the block is left.

    ``args``: the server's options (``--config PATH``, ``--state-dir DIR``); ``env``: the child's environment
    (default: this one), with ``NOTIFY_SOCKET`` set on top; ``wrap``: turns the argv into the one to run (a
    cgroup launcher); ``log_path``: where its stdout and stderr go (``log_mode`` ``"a"`` or ``"w"``), or
    None for a text pipe at ``proc.stdout`` that the caller reads; ``own_group``: a process group of its own,
    so a terminal's Ctrl-C reaches this process alone; ``notify_path``: the notify socket's file (default:
    an abstract address, nothing to clean up); ``name``: how errors call the daemon.
    """

    def __init__(self, args: Sequence[str] = (), *, env: Mapping[str, str] | None = None, cwd: str | None = None,
                 wrap: Callable[[list[str]], list[str]] | None = None, log_path: str | None = None,
                 log_mode: str = "a", own_group: bool = False, notify_path: str | None = None,
                 name: str = "bladed") -> None:
        self.args = list(args)
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        self.wrap = wrap
        self.log_path = log_path
        self.log_mode = log_mode
        self.own_group = own_group
        self.notify_path = notify_path
        self.name = name
        self.proc: subprocess.Popen[Any] | None = None
        #: every notification received by :meth:`wait_ready`, one item per line (``READY=1``, ``STATUS=...``)
        self.notifications: list[str] = []
        self.notify_socket: socket.socket | None = None
        self._log: IO[bytes] | None = None
        self._log_start = 0

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def start(self) -> PrivateDaemon:
        """Bind the notify socket and start the daemon; does not wait (see :meth:`wait_ready`)."""
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            if self.notify_path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.notify_path)
                notify.bind(self.notify_path)
                self.env["NOTIFY_SOCKET"] = self.notify_path
            else:
                addr = f"bladed-spawn-{os.getpid()}-{secrets.token_hex(4)}"
                notify.bind("\0" + addr)
                self.env["NOTIFY_SOCKET"] = "@" + addr
            argv = [sys.executable, "-m", "bladed.server", *self.args]
            if self.wrap is not None:
                argv = self.wrap(argv)
            if self.log_path is not None:
                self._log = open(self.log_path, self.log_mode + "b")  # noqa: SIM115 - closed in stop()
                self._log_start = self._log.tell()
                self.proc = subprocess.Popen(argv, cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL,
                                             stdout=self._log, stderr=subprocess.STDOUT,
                                             process_group=0 if self.own_group else None)
            else:
                self.proc = subprocess.Popen(argv, cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL,
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                             process_group=0 if self.own_group else None)
        except BaseException:
            notify.close()
            if self._log is not None:
                self._log.close()
            raise
        self.notify_socket = notify
        return self

    def wait_ready(self, timeout: float) -> None:
        """Block until the daemon's ``READY=1``; SpawnError if it exits first or ``timeout`` s pass."""
        assert self.proc is not None and self.notify_socket is not None, "not started"
        log = f" (log: {self.log_path})" if self.log_path is not None else ""
        deadline = time.monotonic() + timeout
        while "READY=1" not in self.notifications:
            if self.proc.poll() is not None:
                last = f": {self.last_line()}" if self.log_path is not None else ""
                raise SpawnError(f"{self.name} exited with status {self.proc.returncode}{last}{log}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise SpawnError(f"{self.name} was not ready within {timeout:.0f} s{log}")
            self.notify_socket.settimeout(min(left, 0.5))  # also notices a daemon that exits without a word
            with contextlib.suppress(TimeoutError):
                self.notifications += self.notify_socket.recv(4096).decode(errors="replace").splitlines()

    def log_tail(self, n: int = 30) -> str:
        """The last ``n`` lines of the log written since :meth:`start` ("" without a log file)."""
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                lines = f.read().decode(errors="replace").splitlines(keepends=True)
        except OSError:
            return ""
        return "".join(lines[-n:])

    def last_line(self) -> str:
        """The last non-empty log line since :meth:`start`, or a word on why there is none."""
        if self.log_path is None or not os.access(self.log_path, os.R_OK):
            return "(its log cannot be read)"
        lines = [ln.strip() for ln in self.log_tail(1000).splitlines() if ln.strip()]
        return lines[-1] if lines else "(its log is empty)"

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, SIGKILL after ``timeout`` s; closes the log and the notify socket. The exit status."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.notify_socket is not None:
            with contextlib.suppress(OSError):
                self.notify_socket.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv
            self.notify_socket.close()
            self.notify_socket = None
        if self._log is not None:
            self._log.close()
            self._log = None
        return None if self.proc is None else self.proc.returncode

    def __enter__(self) -> PrivateDaemon:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def cgroup_launcher(cgroup_dir: str) -> Callable[[list[str]], list[str]]:
    """A ``wrap`` for :class:`PrivateDaemon` (or any child's argv): the process joins the cgroup at ``cgroup_dir``
    (its pid written to ``cgroup.procs``) before it ``exec``s, so every page it touches is charged there from
    its first instruction on."""
    procs = shlex.quote(os.path.join(cgroup_dir, "cgroup.procs"))

    def wrap(argv: list[str]) -> list[str]:
        return ["/bin/sh", "-c", f'echo $$ > {procs} && exec "$@"', "bladed-cgroup-launcher", *argv]

    return wrap


__all__ = ["PrivateDaemon", "SpawnError", "cgroup_launcher"]
