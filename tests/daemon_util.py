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
from typing import Any

from bladed.spawn import PrivateDaemon, SpawnError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTUP_TIMEOUT = 60.0


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


class DaemonProcess:
    """A bladed daemon in a child process, on a config written for the test."""

    def __init__(self, state_dir: str, config: dict[str, dict[str, Any]] | None = None,
                 env: dict[str, str] | None = None, *, embedded: bool = False) -> None:
        """``embedded``: no config file and no options, run from ``state_dir`` as the working
        directory, so the embedded default puts everything in ``state_dir/var/bladed``."""
        self.embedded = embedded
        self.state_dir = os.path.join(state_dir, "var", "bladed") if embedded else state_dir
        self.cwd = state_dir if embedded else ROOT
        self.extra_env = env or {}
        self.config = {"device": {"size": "64M"}, "budget": {"interval_s": 60.0}}
        for section, keys in (config or {}).items():
            self.config.setdefault(section, {}).update(keys)
        self.config_path = os.path.join(state_dir, "bladed.toml")
        self.notify_path = os.path.join(state_dir, "notify.sock")
        self.daemon: PrivateDaemon | None = None
        self.lines: list[str] = []
        self.notifications: list[str] = []
        self._cond = threading.Condition()
        self._log_reader: threading.Thread | None = None

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
        if not self.embedded:
            self.write_config()
        self.lines = []
        args = [] if self.embedded else ["--config", self.config_path, "--state-dir", self.state_dir]
        daemon = self.daemon = PrivateDaemon(args, env={**env_with_repo(), **self.extra_env}, cwd=self.cwd,
                                             notify_path=self.notify_path).start()
        self.notifications = daemon.notifications  # wait_ready's, then _read_notify's
        assert daemon.proc is not None and daemon.notify_socket is not None
        self._log_reader = threading.Thread(target=self._read_log, args=(daemon.proc,), daemon=True)
        self._log_reader.start()
        if wait:
            try:
                daemon.wait_ready(timeout)
            except SpawnError as e:
                if daemon.proc.poll() is not None:
                    self._log_reader.join(5)  # the log up to its end
                raise AssertionError(f"{e}:\n" + self.log_tail()) from None
        threading.Thread(target=self._read_notify, args=(daemon.notify_socket,), daemon=True).start()
        return self

    def _read_log(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def _read_notify(self, sock: socket.socket) -> None:
        while True:
            try:
                data = sock.recv(4096)
            except OSError:
                return
            with self._cond:
                self.notifications.extend(data.decode().splitlines())
                self._cond.notify_all()

    def _wait(self, pred: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                got = pred()
                if got:
                    return got
                if self.proc is not None and self.proc.poll() is not None and not pred():
                    # give the log reader a last chance to deliver the final lines
                    self._cond.wait(0.5)
                    got = pred()
                    if got:
                        return got
                    raise AssertionError(f"bladed exited ({self.proc.returncode}) while waiting for {what}:\n"
                                         + self.log_tail())
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out waiting for {what}; log:\n" + self.log_tail())
                self._cond.wait(min(left, 0.5))

    def wait_notify(self, item: str, timeout: float = 30.0) -> None:
        n = len([x for x in self.notifications if x == item])
        if item == "READY=1":
            n = 0
        self._wait(lambda: len([x for x in self.notifications if x == item]) > n, timeout, f"notify {item}")

    def events(self, name: str) -> list[dict[str, str]]:
        """Parsed ``event=NAME k=v ...`` log lines (every field of the line, ``level`` and ``logger`` too)."""
        with self._cond:
            lines = list(self.lines)
        return [f for f in map(logfmt_fields, lines) if f.get("event") == name]

    def wait_event(self, name: str, timeout: float = 30.0, **match: Any) -> dict[str, str]:
        def find() -> dict[str, str] | None:
            for ev in self.events(name):
                if all(ev.get(k) == str(v) for k, v in match.items()):
                    return ev
            return None

        return self._wait(find, timeout, f"event {name} {match}")

    def wait_fields(self, pred: Callable[[dict[str, str]], bool], count: int = 1,
                    timeout: float = 30.0) -> list[dict[str, str]]:
        """The parsed log lines (:func:`logfmt_fields`) that ``pred`` holds for, once there are ``count``."""
        def found() -> list[dict[str, str]] | None:
            hits = [f for f in map(logfmt_fields, self.lines) if pred(f)]
            return hits if len(hits) >= count else None

        return list(self._wait(found, timeout, f"{count} log line(s) matching {pred}"))

    def wait_line(self, text: str, timeout: float = 30.0) -> str:
        return self._wait(lambda: next((ln for ln in self.lines if text in ln), None), timeout, repr(text))

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait (SIGKILL after ``timeout`` s); returns the exit status."""
        assert self.daemon is not None
        rc = self.daemon.stop(timeout)
        assert rc is not None
        return rc

    def kill(self) -> None:
        assert self.daemon is not None and self.daemon.proc is not None
        self.daemon.proc.kill()
        self.daemon.stop()

    def log_tail(self, n: int = 40) -> str:
        with self._cond:
            return "\n".join(self.lines[-n:])

    def log(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stop()


class ClientProcess:
    """A client in its own process, driven by JSON commands (see :func:`serve_commands`)."""

    def __init__(self, socket_path: str, timeout: float = STARTUP_TIMEOUT) -> None:
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), socket_path], cwd=ROOT,
                                     env=env_with_repo(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)
        self._out: queue.Queue[str | None] = queue.Queue()
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()
        self.hello = self._next(timeout)

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
