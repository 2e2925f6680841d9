"""Helpers for tests that run a real bladed process and real client processes.

* :class:`DaemonProcess` starts ``python -m bladed.server`` with a config
  (through :class:`bladed.spawn.PrivateDaemon`, which waits for its
  ``READY=1`` on a notify socket the test owns, as systemd would), collects
  its log lines, notifications and structured events, and stops it with
  SIGTERM or SIGKILL.
* :class:`ClientProcess` runs this file as a separate client process that
  executes JSON commands read from stdin (connect, open, write, read-and-check,
  ...) and answers each with one JSON line, so tests drive clients step by step
  and can kill them at a chosen moment.

Nothing here sleeps to synchronise: every wait blocks on a socket, a pipe or
a condition variable, with a deadline.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import queue
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from bladed.spawn import PrivateDaemon, SpawnError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTUP_TIMEOUT = 60.0
#: ``io.engine`` of every daemon a test starts without naming one (the ``io_engine`` fixture sets it)
IO_ENGINE: str | None = None


def env_with_repo() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("NOTIFY_SOCKET", None)
    env.pop("BLADED_SOCKET", None)
    return env


@contextlib.contextmanager
def short_tmpdir(prefix: str = "bd-") -> Iterator[str]:
    """A directory under /tmp with a short path (Unix socket paths are limited to 107 bytes)."""
    d = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def toml_text(sections: dict[str, dict[str, Any]]) -> str:
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int | float):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{json.dumps(str(k))} = {value(x)}" for k, x in v.items()) + " }"
        raise TypeError(v)

    out = []
    for name, keys in sections.items():
        out.append(f"[{name}]")
        out.extend(f"{k} = {value(v)}" for k, v in keys.items())
        out.append("")
    return "\n".join(out)


def pattern(seed: int | str, layer: int, kind: str, nbytes: int) -> bytes:
    """Deterministic bytes of one KPU, the same in every process."""
    return random.Random(f"{seed}/{layer}/{kind}").randbytes(nbytes)


def forked_as(uid: int, body: Callable[[dict[str, Any]], None], groups: Sequence[int] = ()) -> dict[str, Any]:
    """Run ``body(out)`` in a forked child with ``uid`` (gid the same) and only ``groups`` as supplementary
    groups; returns ``out`` (JSON values). An exception ``body`` lets out is recorded as ``exception``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        out: dict[str, Any] = {}
        try:
            os.close(r)
            os.setgroups(list(groups))
            os.setgid(uid)
            os.setuid(uid)
            body(out)
        except Exception as e:
            out["exception"] = f"{type(e).__name__}: {e}"
        finally:
            os.write(w, json.dumps(out).encode())
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    os.waitpid(pid, 0)
    return dict(json.loads(data))


def run_as(uid: int, socket_path: str, action: Callable[[Any, dict[str, Any]], None]) -> dict[str, Any]:
    """Connect as ``uid`` (gid the same, no supplementary groups) in a forked child and run
    ``action(client, out)``; returns ``out``, plus ``exception``/``message`` if it raised."""
    from bladed.client import Client

    def body(out: dict[str, Any]) -> None:
        try:
            with Client(socket_path) as c:
                out["uid"] = os.getuid()
                action(c, out)
        except Exception as e:
            out.update(exception=type(e).__name__, message=str(e))

    return forked_as(uid, body)


_LOGFMT_PAIR = re.compile(r'(?:^|\s)([\w.]+)=("(?:[^"\\]|\\.)*"|\S*)')


def logfmt_fields(line: str) -> dict[str, str]:
    """The ``key=value`` fields of one daemon log line (``bladed.logfmt``; a journald ``<N>`` prefix is skipped)."""
    if line.startswith("<") and ">" in line[:4]:
        line = line[line.index(">") + 1:]
    return {k: json.loads(v) if v.startswith('"') else v for k, v in _LOGFMT_PAIR.findall(line)}


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over a Unix socket (the daemon's metrics endpoint with ``metrics.listen = "unix:..."``)."""

    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=10)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(self.path)


def scrape(conn: http.client.HTTPConnection) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics: {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    assert resp.status == 200
    out = {}
    for fam in text_string_to_metric_families(resp.read().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    conn.close()
    return out


@dataclass(frozen=True)
class Mark:
    """Where one daemon's output stood at a moment: its run (one per :meth:`DaemonProcess.start`) and how
    many log lines and notifications of that run had arrived. A wait given ``after=mark`` considers only
    what arrived later, so it cannot be satisfied by what an earlier action caused."""

    run: int
    lines: int
    notifications: int


class DaemonProcess:
    """A bladed daemon in a child process, on a config written for the test.

    Its log lines (:attr:`lines`) and sd_notify notifications (:attr:`notifications`) are collected from
    :meth:`start` on, one run at a time. The waits (:meth:`wait_event`, :meth:`wait_fields`,
    :meth:`wait_line`, :meth:`wait_notify`) look at what arrived after ``after`` (a :class:`Mark` taken
    before the action whose effect is awaited, e.g. ``mark = d.mark(); action(); d.wait_event("x",
    after=mark)``, or the mark :meth:`signal` returns); without it, at everything since the start of the
    current run, which is right only for what the start itself causes (``daemon_start``,
    ``region_scrub``, ``reclaim``, ``prefix_restore``) or for an item no earlier action can have caused
    (a fresh session id's). :meth:`stop` returns once every line and notification is in.
    """

    def __init__(self, state_dir: str, config: dict[str, dict[str, Any]] | None = None,
                 env: dict[str, str] | None = None, *, embedded: bool = False,
                 wrap: Callable[[list[str]], list[str]] | None = None) -> None:
        """``embedded``: no config file and no options, run from ``state_dir`` as the working
        directory, so the embedded default puts everything in ``state_dir/var/bladed``; ``wrap``: turns
        the daemon's argv into the one to run (``seccomp_util.command``)."""
        self.embedded = embedded
        self.wrap = wrap
        self.state_dir = os.path.join(state_dir, "var", "bladed") if embedded else state_dir
        self.cwd = state_dir if embedded else ROOT
        self.extra_env = env or {}
        self.config: dict[str, dict[str, Any]] = {"device": {"size": "64M"}, "budget": {"interval_s": 60.0}}
        if IO_ENGINE is not None:
            self.config["io"] = {"engine": IO_ENGINE}
        for section, keys in (config or {}).items():
            self.config.setdefault(section, {}).update(keys)
        self.config_path = os.path.join(state_dir, "bladed.toml")
        self.notify_path = os.path.join(state_dir, "notify.sock")
        self.daemon: PrivateDaemon | None = None
        #: this run's log lines and notifications (a new list each :meth:`start`)
        self.lines: list[str] = []
        self.notifications: list[str] = []
        self.run = 0
        self._cond = threading.Condition()
        self._log_reader: threading.Thread | None = None
        self._notify_reader: threading.Thread | None = None

    @property
    def proc(self) -> subprocess.Popen[str] | None:
        return None if self.daemon is None else self.daemon.proc

    @property
    def socket_path(self) -> str:
        sock = self.config.get("socket", {}).get("path", "bladed.sock")
        return os.path.join(self.state_dir, sock)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def write_config(self) -> None:
        with open(self.config_path, "w") as f:
            f.write(toml_text(self.config))

    def start(self, *, wait: bool = True, timeout: float = STARTUP_TIMEOUT) -> DaemonProcess:
        """Start a run (a running one is stopped first); with ``wait``, return at its ``READY=1``. A daemon
        that is not ready in time is killed before this raises."""
        if self.daemon is not None:
            self.stop()
        if not self.embedded:
            self.write_config()
        args = [] if self.embedded else ["--config", self.config_path, "--state-dir", self.state_dir]
        daemon = PrivateDaemon(args, env={**env_with_repo(), **self.extra_env}, cwd=self.cwd, wrap=self.wrap,
                               notify_path=self.notify_path).start()
        assert daemon.proc is not None and daemon.notify_socket is not None
        with self._cond:
            self.run += 1
            self.daemon = daemon
            self.lines = []
            self.notifications = daemon.notifications  # wait_ready's, then _read_notify's
        self._log_reader = threading.Thread(target=self._read_log, args=(daemon.proc, self.lines), daemon=True)
        self._log_reader.start()
        if wait:
            try:
                daemon.wait_ready(timeout)
            except SpawnError as e:
                self.kill()
                print(self.log_tail(), file=sys.stderr)
                raise AssertionError(f"{e} (its log is on stderr)") from None
            except BaseException:
                self.kill()
                raise
        self._notify_reader = threading.Thread(target=self._read_notify,
                                               args=(daemon.notify_socket, self.notifications), daemon=True)
        self._notify_reader.start()
        return self

    def _read_log(self, proc: subprocess.Popen[str], lines: list[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with self._cond:
                lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def _read_notify(self, sock: socket.socket, notifications: list[str]) -> None:
        sock.settimeout(None)   # wait_ready's timeout would end this reader after half a second of quiet
        while True:
            try:
                data = sock.recv(4096)
            except OSError:
                return
            if not data:  # shut down for reading (_drain) and nothing left queued
                return
            with self._cond:
                notifications.extend(data.decode(errors="replace").splitlines())
                self._cond.notify_all()

    def _drain(self, timeout: float = 30.0) -> None:
        """Once the daemon has exited: wait until its every log line and notification is in."""
        daemon = self.daemon
        if daemon is None or daemon.proc is None or daemon.proc.poll() is None:
            return
        if daemon.notify_socket is not None and self._notify_reader is not None:
            # a datagram socket shut down for reading still hands out what is queued, then b""
            with contextlib.suppress(OSError):
                daemon.notify_socket.shutdown(socket.SHUT_RD)
            self._notify_reader.join(timeout)
        if self._log_reader is not None:
            self._log_reader.join(timeout)  # stdout is at EOF once the daemon is gone

    # -- marks and waits ------------------------------------------------------------------------------
    def mark(self) -> Mark:
        """Where the output stands now: take it before an action, wait ``after`` it."""
        with self._cond:
            return Mark(self.run, len(self.lines), len(self.notifications))

    @property
    def started(self) -> Mark:
        """The start of the current run (what ``after=None`` means)."""
        return Mark(self.run, 0, 0)

    def _origin(self, after: Mark | None) -> Mark:
        """``after`` in the current run: an earlier run's mark (or none) is the start of this one."""
        if after is None or after.run < self.run:
            return self.started
        assert after.run == self.run, f"{after} is a mark of a later run than this one ({self.run})"
        return after

    def lines_after(self, after: Mark | None = None) -> list[str]:
        with self._cond:
            return self.lines[self._origin(after).lines:]

    def notifications_after(self, after: Mark | None = None) -> list[str]:
        with self._cond:
            return self.notifications[self._origin(after).notifications:]

    def _wait(self, pred: Callable[[], Any], timeout: float, what: str, seen: Callable[[], str]) -> Any:
        """``pred()`` once it is not None (checked whenever a line or notification arrives), with a deadline."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                got = pred()
                if got is not None:
                    return got
                if self.proc is not None and self.proc.poll() is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    print(self.log_tail(), file=sys.stderr)
                    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; seen: {seen()} "
                                         "(log tail on stderr)")
                self._cond.wait(min(left, 0.5))  # also notices a daemon that exits without a word
        self._drain()  # exited: its last lines may still be on their way
        with self._cond:
            got = pred()
            if got is not None:
                return got
            print(self.log_tail(), file=sys.stderr)
            assert self.proc is not None
            raise AssertionError(f"bladed exited ({self.proc.returncode}) while waiting for {what}; seen: {seen()} "
                                 "(log tail on stderr)")

    @staticmethod
    def _since(after: Mark | None) -> str:
        if after is None:
            return "since the start"
        return f"after the mark (run {after.run}, line {after.lines}, notification {after.notifications})"

    def _seen_lines(self, after: Mark | None, keep: Callable[[str], bool] = lambda _: True) -> str:
        lines = [ln for ln in self.lines[self._origin(after).lines:] if keep(ln)]
        if not lines:
            return "no line"
        return f"{len(lines)} line(s), the last {lines[-1][:160]!r}"

    def _seen_events(self, after: Mark | None) -> str:
        names = [f.get("event") for f in map(logfmt_fields, self.lines[self._origin(after).lines:]) if f.get("event")]
        return f"events {names[-20:]}" if names else f"no event ({self._seen_lines(after)})"

    def wait_notify(self, item: str, timeout: float = 30.0, *, after: Mark | None = None) -> int:
        """The index in :attr:`notifications` of the first ``item`` (``READY=1``) after ``after``."""
        def find() -> int | None:
            start = self._origin(after).notifications
            return next((start + i for i, x in enumerate(self.notifications[start:]) if x == item), None)

        def seen() -> str:
            return repr(self.notifications[self._origin(after).notifications:])

        return int(self._wait(find, timeout, f"notification {item} {self._since(after)}", seen))

    def events(self, name: str, *, after: Mark | None = None) -> list[dict[str, str]]:
        """Parsed ``event=NAME k=v ...`` log lines (every field of the line, ``level`` and ``logger`` too)."""
        return [f for f in map(logfmt_fields, self.lines_after(after)) if f.get("event") == name]

    def wait_event(self, name: str, timeout: float = 30.0, *, after: Mark | None = None,
                   **match: Any) -> dict[str, str]:
        """The first ``event=NAME`` line after ``after`` whose fields equal ``match`` (values as strings)."""
        def find() -> dict[str, str] | None:
            for ln in self.lines[self._origin(after).lines:]:
                f = logfmt_fields(ln)
                if f.get("event") == name and all(f.get(k) == str(v) for k, v in match.items()):
                    return f
            return None

        what = f"event {name}" + "".join(f" {k}={v}" for k, v in match.items()) + f" {self._since(after)}"
        return dict(self._wait(find, timeout, what, lambda: self._seen_events(after)))

    def wait_fields(self, pred: Callable[[dict[str, str]], bool], count: int = 1, timeout: float = 30.0, *,
                    after: Mark | None = None) -> list[dict[str, str]]:
        """The parsed log lines (:func:`logfmt_fields`) after ``after`` that ``pred`` holds for, once there
        are ``count`` of them."""
        def found() -> list[dict[str, str]] | None:
            hits = [f for f in map(logfmt_fields, self.lines[self._origin(after).lines:]) if pred(f)]
            return hits if len(hits) >= count else None

        def seen() -> str:
            hits = [f for f in map(logfmt_fields, self.lines[self._origin(after).lines:]) if pred(f)]
            return f"{len(hits)} matching of {self._seen_lines(after)}"

        what = f"{count} log line(s) matching {pred!r} {self._since(after)}"
        return list(self._wait(found, timeout, what, seen))

    def wait_line(self, text: str, timeout: float = 30.0, *, after: Mark | None = None) -> str:
        """The first log line after ``after`` that contains ``text``."""
        def find() -> str | None:
            return next((ln for ln in self.lines[self._origin(after).lines:] if text in ln), None)

        return str(self._wait(find, timeout, f"a log line with {text!r} {self._since(after)}",
                              lambda: self._seen_lines(after)))

    # -- signals and stopping ----------------------------------------------------------------------
    def signal(self, sig: int) -> Mark:
        """Send ``sig``; returns the mark taken just before, to wait for what the signal causes."""
        assert self.proc is not None
        mark = self.mark()
        self.proc.send_signal(sig)
        return mark

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait (SIGKILL after ``timeout`` s); returns the exit status once the daemon's every
        log line and notification is in."""
        assert self.daemon is not None and self.daemon.proc is not None
        proc = self.daemon.proc
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        self._drain()
        rc = self.daemon.stop(timeout)
        assert rc is not None
        return rc

    def kill(self) -> None:
        """SIGKILL, and wait as :meth:`stop` does."""
        assert self.daemon is not None and self.daemon.proc is not None
        if self.daemon.proc.poll() is None:
            self.daemon.proc.kill()
        self.stop()

    def log_tail(self, n: int = 40) -> str:
        with self._cond:
            return "\n".join(self.lines[-n:])

    def log(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        """Ends the daemon whatever happened in the block: SIGTERM, SIGKILL after a grace period."""
        if self.daemon is not None:
            self.stop()


def end_process(proc: subprocess.Popen[Any], grace: float = 10.0) -> int:
    """End ``proc`` and every process below it, whatever process group or session they are in: SIGTERM first
    (so that it can end what it started), SIGKILL after ``grace`` s; waited for. Its exit status."""
    import procguard  # not at the top: the client process (this file run as a script) does without pytest

    below = procguard.descendants(list(procguard.processes()), proc.pid)  # before they can be orphaned
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    procguard.end(below, grace)  # only those still running: each checked by pidfd and start time
    return proc.returncode


@contextlib.contextmanager
def ended(proc: subprocess.Popen[Any], grace: float = 10.0) -> Iterator[subprocess.Popen[Any]]:
    """``proc``, ended with everything below it (:func:`end_process`) however the block is left."""
    try:
        yield proc
    finally:
        end_process(proc, grace)


def wait_connections(c: Any, n: int, timeout: float = 30.0, *, queued: bool = False) -> dict[str, Any]:
    """``stats`` through the client ``c``, once the daemon counts exactly ``n`` connections (``c`` among them):
    the teardown of the others, which runs on their own threads after their sessions are closed.

    Every connection to wait for must already be counted, i.e. accepted: one that got an answer is. With
    ``queued``, some may still wait in the listen queue (a client killed right after ``connect``): first a
    fresh connection's round trip, the sequence point after them (the daemon accepts one connection at a
    time, in queue order), and that connection's own teardown is waited for with the rest. Each check is a
    round trip to the daemon, not a sleep."""
    from bladed.client import Client

    if queued:
        with Client(c.socket_path) as fresh:
            fresh.status()
    deadline = time.monotonic() + timeout
    while (st := c.stats())["connections"] != n:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for the daemon to count {n} "
                                 f"connection(s); seen: {st['connections']}, {st['sessions']} session(s)")
    return dict(st)


class ClientProcess:
    """A client in its own process, driven by JSON commands (see :func:`serve_commands`)."""

    def __init__(self, socket_path: str, timeout: float = STARTUP_TIMEOUT) -> None:
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), socket_path], cwd=ROOT,
                                     env=env_with_repo(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)
        self._out: queue.Queue[str | None] = queue.Queue()
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()
        try:
            self.hello = self._next(timeout)
        except BaseException:
            self.kill()
            raise

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._out.put(line)
        self._out.put(None)

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._out.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("client process did not answer in time") from None
        if line is None:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"client process exited ({self.proc.wait()}):\n{err}")
        return dict(json.loads(line))

    def send(self, cmd: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()

    def call(self, cmd: str, timeout: float = 60.0, **args: Any) -> dict[str, Any]:
        """Run one command; raises if the client reports an unexpected exception."""
        self.send(cmd, **args)
        out = self._next(timeout)
        if "exception" in out and not args.get("expect_error"):
            raise AssertionError(f"client command {cmd} failed: {out['exception']}: {out.get('message')}")
        return out

    def expect(self, timeout: float = 60.0) -> dict[str, Any]:
        return self._next(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)
        self._pump_thread.join(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.send("exit")
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._pump_thread.join(30)  # stdout is at EOF once the process is gone
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()

    def __enter__(self) -> ClientProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the client process side ---------------------------------------------------------------
def serve_commands(socket_path: str) -> None:  # pragma: no cover - runs in the child
    """Execute JSON commands from stdin against bladed; one JSON reply per command."""
    from bladed.client import Client, Session
    from bladed.residency import Geometry

    client: Client | None = None
    sess: Session | None = None
    geo: Geometry | None = None
    loop_stop = threading.Event()

    def out(**kw: Any) -> None:
        sys.stdout.write(json.dumps(kw) + "\n")
        sys.stdout.flush()

    def token_range(a: dict[str, Any]) -> tuple[int, int]:
        assert geo is not None
        start = int(a.get("token_start", 0))
        n = a.get("ntokens")
        return start * geo.token_bytes, (geo.max_tokens - start if n is None else int(n)) * geo.token_bytes

    out(ready=True, pid=os.getpid())
    for line in sys.stdin:
        a = json.loads(line)
        cmd = a.pop("cmd")
        a.pop("expect_error", None)
        try:
            if cmd == "exit":
                loop_stop.set()
                if client is not None:
                    client.close()
                out(ok=True)
                return
            if cmd == "connect":
                client = Client(a.get("socket", socket_path))
                out(ok=True, server=client.server)
            elif cmd == "open":
                assert client is not None
                geo = Geometry(**a["geometry"])
                sess = client.open_session(geo, mode=a.get("mode", "dualblade"), channels=a.get("channels", 2))
                mine = [s for s in client.sessions() if s["session"] == sess.id]
                out(ok=True, session=sess.id, plan=sess.plan, extent=mine[0]["extent"] if mine else None)
            elif cmd in ("write", "read_check", "read"):
                assert sess is not None and geo is not None
                layer, kind, ch = int(a["layer"]), a["kind"], int(a.get("ch", 0))
                off, n = token_range(a)
                data = pattern(a.get("seed", 0), layer, kind, geo.kpu_bytes)
                if cmd == "write":
                    sess.slot(ch)[off:off + n] = data[off:off + n]
                    r = sess.write(layer, kind, ch, a.get("token_start", 0), a.get("ntokens"))
                    out(ok=True, path=r.path, nbytes=r.nbytes, service_ns=r.service_ns)
                else:
                    sess.slot(ch)[off:off + n] = bytes(n)
                    r = sess.read(layer, kind, ch, a.get("token_start", 0), a.get("ntokens"))
                    got = bytes(sess.slot(ch)[off:off + n])
                    out(ok=True, path=r.path, nbytes=r.nbytes, hit_ratio=r.hit_ratio,
                        match=got == data[off:off + n], zeros=got == bytes(n))
            elif cmd == "write_all":
                assert sess is not None and geo is not None
                paths = []
                for layer in range(geo.layers):
                    for kind in "kv":
                        sess.slot(0)[:] = pattern(a.get("seed", 0), layer, kind, geo.kpu_bytes)
                        paths.append(sess.write(layer, kind, 0).path)
                out(ok=True, paths=paths)
            elif cmd == "check_all":
                assert sess is not None and geo is not None
                bad = []
                for layer in range(geo.layers):
                    for kind in "kv":
                        sess.slot(1)[:] = bytes(geo.kpu_bytes)
                        sess.read(layer, kind, 1)
                        if bytes(sess.slot(1)) != pattern(a.get("seed", 0), layer, kind, geo.kpu_bytes):
                            bad.append(f"{kind}{layer}")
                out(ok=True, bad=bad)
            elif cmd == "write_loop":
                # keep both channels busy with whole-KPU writes until killed
                assert sess is not None and geo is not None
                started = threading.Event()

                def loop(s: Session, g: Geometry, ch: int, started: threading.Event) -> None:
                    i = 0
                    while not loop_stop.is_set():
                        fut = s.write_async(i % g.layers, "kv"[i % 2], ch)
                        started.set()
                        fut.result()
                        i += 1

                for ch in range(sess.channels):
                    threading.Thread(target=loop, args=(sess, geo, ch, started), daemon=True).start()
                started.wait(30)
                out(ok=True, looping=True)
            elif cmd == "call":
                assert client is not None
                op = a.pop("op")
                out(ok=True, reply=client.call(op, **a))
            elif cmd == "close":
                assert sess is not None
                sess.close()
                sess = None
                out(ok=True)
            else:
                out(exception="ValueError", message=f"unknown command {cmd}")
        except Exception as e:
            out(exception=type(e).__name__, message=str(e), code=getattr(getattr(e, "code", None), "value", None))


if __name__ == "__main__":  # pragma: no cover
    sys.path.insert(0, ROOT)
    serve_commands(sys.argv[1])


def documented_exit_statuses(header: str) -> set[int]:
    """The statuses in the docs/operations.md table whose header row starts with ``header``."""
    with open(os.path.join(ROOT, "docs", "operations.md")) as f:
        doc = f.read()
    table = doc[doc.index(f"| {header} | meaning |"):]
    table = table[:table.index("\n\n")]
    return {int(m) for m in re.findall(r"^\| (\d+) \|", table, re.MULTILINE)}
