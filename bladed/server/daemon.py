"""The bladed daemon: socket, connections, lifecycle, signals and sd_notify.

Threads: the main thread accepts connections and handles signals; each
connection has a reader thread (requests, control ops, teardown when the
peer goes away); each session channel has a worker thread with its own
io_uring (:mod:`bladed.server.channel`).

Signals: SIGTERM/SIGINT drain in-flight requests, TRIM every extent, remove
the page-cache files and exit 0; SIGHUP reloads what can be reloaded
(``access``, ``budget``, ``log``, ``io.max_channels`` ...).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import selectors
import signal
import socket
import struct
import sys
import threading
import time
from typing import Any

from bladed import __version__
from bladed.config import Config, ConfigError, format_size, group_id, load_config, region_of, reload_changes
from bladed.config import validate_device as config_device_problems
from bladed.io import BladedIOError, Engine, ExtentDevice, open_device
from bladed.protocol import (
    MAX_FRAME_BYTES,
    MIN_PROTOCOL_VERSION,
    OPS,
    PROTOCOL_VERSION,
    BadBody,
    ConnectionClosed,
    ErrorCode,
    Frame,
    FrameError,
    FrameReader,
    FrameTooLargeError,
    RequestError,
    encode,
    error_reply,
    get_field,
    ok_reply,
    request_id,
    send_frame,
)
from bladed.residency.extents import ExtentAllocator
from bladed.server.metrics import Collector, MetricsServer, Stats
from bladed.server.session import Peer, Session, SessionManager, event, scrub, sweep_pagecache
from bladed.server.state import QUARANTINED, Journal, SessionRecord, StateLockedError

log = logging.getLogger("bladed")

#: how long a start-up may spend scrubbing the whole region before systemd gives up on it
SCRUB_START_TIMEOUT_S = 1800

#: each session costs a thread and a ring per channel: bound what one connection can ask for
MAX_SESSIONS_PER_CONNECTION = 64


# -- systemd notification ------------------------------------------------------------
def sd_notify(*items: str) -> bool:
    """Send ``READY=1``-style lines to ``$NOTIFY_SOCKET``; False when not under systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto("\n".join(items).encode(), addr)
        return True
    except OSError as e:
        log.warning("sd_notify to %s failed: %s", addr, e)
        return False


# -- logging -------------------------------------------------------------------------
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


class JournalFormatter(logging.Formatter):
    """``<prio>message``: journald takes the priority from the prefix and adds its own timestamp."""

    def format(self, record: logging.LogRecord) -> str:
        msg = super().format(record).replace("\n", " | ")
        return f"<{_PRIORITY.get(record.levelno, 6)}>{msg}"


def setup_logging(cfg: Config) -> None:
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    fmt = cfg.log.format
    if fmt == "journal" or (fmt == "auto" and os.environ.get("JOURNAL_STREAM")):
        handler.setFormatter(JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(cfg.log.level.upper())


# -- access control -------------------------------------------------------------------
def peer_credentials(sock: socket.socket) -> Peer:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(pid=pid, uid=uid, gid=gid)


def supplementary_groups(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


def _refuse(sock: socket.socket, code: ErrorCode, why: str) -> None:
    """Answer a refused peer's hello (if it sends one promptly) with an error, then close."""
    req_id = None
    try:
        sock.settimeout(1.0)
        frame = FrameReader(sock, 4096).read()
        frame.close_fds()
        req_id = request_id(frame.body)
    except (OSError, ConnectionClosed, FrameError, BadBody):
        pass
    with contextlib.suppress(OSError, ValueError):
        send_frame(sock, error_reply(req_id, code, why))
    sock.close()


def oversize_message(e: FrameTooLargeError) -> str:
    """The error for a reply that does not fit a frame (docs/protocol.md, "Limits")."""
    return (f"the reply would be {e.nbytes} bytes, over the {MAX_FRAME_BYTES}-byte frame limit (MAX_FRAME_BYTES; "
            "see docs/protocol.md, 'Limits')")


class Connection:
    """One client connection: its reader thread, its sessions, its replies."""

    def __init__(self, daemon: Daemon, sock: socket.socket, peer: Peer) -> None:
        self.daemon = daemon
        self.sock = sock
        self.peer = peer
        self.sessions: dict[str, Session] = {}
        self._send_lock = threading.Lock()
        self._dead = False
        self.greeted = False
        self.thread = threading.Thread(target=self._run, name=f"bladed-conn-{peer.pid}", daemon=True)

    # -- sending ------------------------------------------------------------------
    def send(self, body: dict[str, Any]) -> None:
        """Send a reply; a peer that does not read (send timeout) or is gone loses its connection.

        A reply too big for a frame (docs/protocol.md, "Limits") becomes an ``internal`` error for
        that request: the peer keeps its connection.
        """
        if self._dead:
            return
        try:
            with self._send_lock:
                try:
                    send_frame(self.sock, body)
                except FrameTooLargeError as e:
                    log.error("connection of pid %d: reply to request %s not sent: %s", self.peer.pid,
                              body.get("id"), e)
                    send_frame(self.sock, error_reply(body.get("id"), ErrorCode.INTERNAL, oversize_message(e)))
        except (OSError, ValueError) as e:
            if not self._dead:
                log.info("connection of pid %d: reply not delivered (%s); closing it", self.peer.pid, e)
            self.kill()

    def kill(self) -> None:
        """Stop talking to this peer: the reader sees EOF and tears its sessions down."""
        self._dead = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def shutdown_read(self) -> None:
        """Graceful stop: no new requests; queued ones still complete and are answered."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RD)

    # -- the reader -----------------------------------------------------------------
    def _run(self) -> None:
        reader = FrameReader(self.sock, MAX_FRAME_BYTES)
        reason = "closed"
        try:
            while True:
                try:
                    frame = reader.read()
                except BadBody as e:
                    self.daemon.stats.add("bad_requests")
                    self.send(error_reply(None, ErrorCode.BAD_REQUEST, str(e)))
                    continue
                if not self._handle(frame):
                    reason = "protocol"
                    break
        except ConnectionClosed:
            reason = "client_gone" if not self.daemon.stopping.is_set() else "shutdown"
        except FrameError as e:
            self.daemon.stats.add("bad_requests")
            log.info("connection of pid %d uid %d: %s; closing it", self.peer.pid, self.peer.uid, e)
            self.send(error_reply(None, ErrorCode.BAD_FRAME, str(e)))
            reason = "bad_frame"
        except OSError as e:  # ECONNRESET when the client is killed
            reason = "client_gone" if e.errno in (errno.ECONNRESET, errno.EPIPE) else f"error:{e.errno}"
        except Exception:
            log.exception("connection of pid %d: unexpected failure", self.peer.pid)
            reason = "internal_error"
        finally:
            self._teardown(reason)

    def _teardown(self, reason: str) -> None:
        abandon = reason != "shutdown" and reason != "closed"
        if self.daemon.stopping.is_set():
            reason, abandon = "shutdown", False
        for sess in list(self.sessions.values()):
            try:
                self.daemon.manager.close(sess, reason, abandon=abandon or self._dead)
            except Exception:
                log.exception("teardown of session %s failed", sess.id)
        self.sessions.clear()
        self._dead = True
        with contextlib.suppress(OSError):
            self.sock.close()
        self.daemon.forget(self)

    def _handle(self, frame: Frame) -> bool:
        """Dispatch one request; False closes the connection."""
        body = frame.body
        req_id = request_id(body)  # echoed in the reply only when valid
        op: Any = body.get("op")
        try:
            # a malformed request is not the first request: it gets bad_request, before or after hello
            valid_id: int = get_field(body, "id", int)
            op = get_field(body, "op", str)
            if not self.greeted:
                if op != "hello":
                    self.send(error_reply(req_id, ErrorCode.HANDSHAKE_REQUIRED,
                                          f"the first request must be 'hello' (got {op!r})"))
                    return False
                return self._hello(valid_id, body)
            if op != "open_session" and frame.fds:
                raise RequestError(ErrorCode.BAD_REQUEST, f"'{op}' takes no file descriptors")
            if op in ("write", "read"):
                self._session(body).request(req_id, op, body, self.send)
                return True
            handler = getattr(self, f"_op_{op}", None) if op in OPS else None
            if handler is None:
                raise RequestError(ErrorCode.UNKNOWN_OP, f"unknown op {op!r}; protocol {PROTOCOL_VERSION} "
                                                         f"knows {', '.join(OPS)}")
            self.send(ok_reply(req_id, **handler(body, frame)))
        except RequestError as e:
            self.daemon.stats.add("bad_requests")
            self.send(error_reply(req_id, e.code, e.message))
        except BladedIOError as e:
            self.send(error_reply(req_id, ErrorCode.IO_ERROR, str(e)))
        except Exception as e:
            log.exception("request %r of pid %d failed", op, self.peer.pid)
            self.send(error_reply(req_id, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"))
        finally:
            frame.close_fds()
        return True

    def _hello(self, req_id: int, body: dict[str, Any]) -> bool:
        proto = get_field(body, "protocol", int)  # a mistyped version is bad_request; the peer may try again
        if not MIN_PROTOCOL_VERSION <= proto <= PROTOCOL_VERSION:
            self.send(error_reply(req_id, ErrorCode.INCOMPATIBLE_PROTOCOL,
                                  f"client speaks protocol {proto!r}; this bladed {__version__} speaks "
                                  f"{MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION} (upgrade the client or the daemon)"))
            return False
        self.greeted = True
        d = self.daemon
        self.send(ok_reply(req_id, protocol=PROTOCOL_VERSION, server=f"bladed/{__version__}", pid=os.getpid(),
                           lba_size=d.device.lba_size, staging_align=d.manager.staging_align,
                           max_channels=d.cfg.io.max_channels, max_frame_bytes=MAX_FRAME_BYTES))
        return True

    def _session(self, body: dict[str, Any]) -> Session:
        sid = get_field(body, "session", str)
        sess = self.sessions.get(sid)
        if sess is None:
            # sessions of other connections are invisible: a session addresses only its own tensors
            raise RequestError(ErrorCode.NO_SUCH_SESSION, f"no session {sid!r} on this connection")
        return sess

    # -- control ops -------------------------------------------------------------------
    def _op_hello(self, body: dict[str, Any], frame: Frame) -> dict[str, Any]:
        raise RequestError(ErrorCode.BAD_REQUEST, "hello was already exchanged on this connection")

    def _op_open_session(self, body: dict[str, Any], frame: Frame) -> dict[str, Any]:
        if self.daemon.stopping.is_set():
            raise RequestError(ErrorCode.SHUTTING_DOWN, "bladed is shutting down")
        if len(self.sessions) >= MAX_SESSIONS_PER_CONNECTION:
            raise RequestError(ErrorCode.BUSY, f"{MAX_SESSIONS_PER_CONNECTION} sessions are open on this "
                                               "connection; close one first")
        fds, frame.fds = frame.fds, []
        sess = self.daemon.manager.open(self.peer, body, fds)
        out = sess.open_reply()
        try:
            encode(ok_reply(body["id"], **out))
        except FrameTooLargeError as e:
            # MAX_LAYERS is set so that this cannot happen; if it does, the client must not be left
            # with a session it cannot name
            log.error("open_session of pid %d: %s; closing session %s", self.peer.pid, e, sess.id)
            self.daemon.manager.close(sess, "reply_too_large")
            raise RequestError(ErrorCode.INTERNAL, oversize_message(e)) from None
        self.sessions[sess.id] = sess
        return out

    def _op_close_session(self, body: dict[str, Any], frame: Frame) -> dict[str, Any]:
        sess = self._session(body)
        del self.sessions[sess.id]
        self.daemon.manager.close(sess, "closed")
        return {"session": sess.id}

    def _op_status(self, body: dict[str, Any], frame: Frame) -> dict[str, Any]:
        return self.daemon.status()

    def _op_sessions(self, body: dict[str, Any], frame: Frame) -> dict[str, Any]:
        admin = self.daemon.is_admin(self.peer)
        with self.daemon.manager._lock:
            live = list(self.daemon.manager.sessions.values())
        return {"sessions": [s.describe() for s in live if admin or s.peer.uid == self.peer.uid]}

    def _op_stats(self, body: dict[str, Any], frame: Frame) -> dict[str, Any]:
        out = self.daemon.stats.snapshot()
        out.update(self.daemon.gauges())
        out["time"] = time.time()
        return out

    def _op_budget(self, body: dict[str, Any], frame: Frame) -> dict[str, Any]:
        return self.daemon.budget()

    def _op_trim(self, body: dict[str, Any], frame: Frame) -> dict[str, Any]:
        if not self.daemon.is_admin(self.peer):
            raise RequestError(ErrorCode.PERMISSION_DENIED, f"uid {self.peer.uid} may not trim "
                                                            "(root or access.admin_uids only)")
        return self.daemon.trim_region()


class Daemon:
    """Owns the device, the region, the page-cache directory and the socket."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.stats = Stats()
        self.stopping = threading.Event()
        self.started = time.time()
        self.journal = Journal(cfg.state_dir)
        self.device: ExtentDevice
        self.allocator: ExtentAllocator
        self.manager: SessionManager
        self.listener: socket.socket | None = None
        self.metrics: MetricsServer | None = None
        self._conns: set[Connection] = set()
        self._conns_lock = threading.Lock()
        self._last_budget: dict[str, Any] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._signals: list[int] = []

    # -- start-up -----------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.cfg
        sd_notify("STATUS=starting")
        self.journal.acquire()
        try:
            self.device = self._open_device()
            start, blocks = region_of(cfg, self.device.capacity_blocks)
            self.allocator = ExtentAllocator(start, blocks, lba_size=self.device.lba_size)
            os.makedirs(cfg.pagecache_dir, mode=0o750, exist_ok=True)
            self._reclaim(start, blocks)
            self.manager = SessionManager(cfg, self.device, self.allocator, self.journal, self.stats)
            self._listen()
            if cfg.metrics.enabled:
                self.metrics = MetricsServer(cfg.metrics_target, Collector(self.stats, self.gauges),
                                             cfg.socket.mode)
        except BaseException:
            self.journal.release()
            raise
        self._sample_budget()
        # keep re-sampling B_pc and demote live sessions' KPUs when it shrinks (bladed.server.replan)
        self.manager.replanner.start()
        desc = self.device.describe()
        event("daemon_start", version=__version__, pid=os.getpid(), backend=desc["kind"], device=desc["path"],
              lba_size=desc["lba_size"], region=f"{start}+{blocks}", socket=cfg.socket_path,
              pagecache=cfg.pagecache_dir, metrics=self.metrics.address if self.metrics else "off",
              config=cfg.source or "embedded-default")
        sd_notify("READY=1", f"STATUS=serving on {cfg.socket_path}: {desc['kind']} {desc['path']}, "
                             f"region {format_size(blocks * self.device.lba_size)}", f"MAINPID={os.getpid()}")

    def _open_device(self) -> ExtentDevice:
        cfg = self.cfg
        d = cfg.device
        path = cfg.device_path
        opts: dict[str, Any] = {}
        if d.backend == "file":
            if not os.path.exists(path) and not d.size:
                raise ConfigError([f"device.path: store file {path} does not exist and device.size is 0"],
                                  cfg.source)
            if not os.path.isdir(os.path.dirname(path)):
                raise ConfigError([f"device.path: directory {os.path.dirname(path)} does not exist"], cfg.source)
            opts = {"size_bytes": d.size or None, "lba_size": d.lba_size or 4096,
                    "max_command_bytes": d.max_command_bytes}
        elif d.backend == "block":
            opts = {"max_command_bytes": d.max_command_bytes}
        if d.backend != "file" and not os.path.exists(path):
            raise ConfigError([f"device.path: {path} does not exist (missing device; check `bladectl ns list`)"],
                              cfg.source)
        try:
            dev = open_device(d.backend, path, **opts)
        except PermissionError as e:
            raise ConfigError([f"device.path: no permission to open {path} read-write ({e.strerror})"],
                              cfg.source) from None
        except (OSError, ValueError) as e:
            raise ConfigError([f"device.path: cannot use {path} as a {d.backend} device: {e}"], cfg.source) from None
        problems = config_device_problems(cfg, lba_size=dev.lba_size, capacity_blocks=dev.capacity_blocks,
                                          path=path)
        if problems:
            dev.close()
            raise ConfigError(problems, cfg.source)
        return dev

    def _reclaim(self, start: int, blocks: int) -> None:
        """Scrub what a crashed instance left and remove its page-cache files.

        With a journal of this device and region, only the extents it lists
        are scrubbed.  Without one (first start, state directory wiped, journal
        unreadable, or written for another device or region), nothing says
        which blocks hold an earlier session's KV cache, so the whole region
        is: a new session must never read bytes it did not write.
        """
        dev = self.device
        always_zero = self.cfg.device.zero_freed == "always"
        here = {"path": dev.path, "kind": dev.kind, "lba_size": dev.lba_size, "region": [start, blocks]}
        trimmed = zeroed = reclaimed = 0
        unscrubbed: list[tuple[int, int]] = []
        whole_region = ""
        try:
            stale, old_device = self.journal.load_stale()
        except ValueError as e:
            log.warning("%s; scrubbing the whole region [%d, %d) to be safe", e, start, start + blocks)
            stale, old_device, whole_region = [], None, "unreadable_journal"
        if old_device is None:
            whole_region = whole_region or "no_journal"
        elif any(old_device.get(k) != here[k] for k in ("path", "lba_size", "region")):
            whole_region = "journal_of_another_device_or_region"
            if stale:
                log.warning("the journal names sessions on %s; this instance uses %s: not scrubbing them",
                            old_device, here)
            stale = []
        for rec in stale:
            for s, n in rec.extents:
                # only inside today's region: blocks outside it may have been given to someone else
                lo, hi = max(s, start), min(s + n, start + blocks)
                if hi - lo != n:
                    log.warning("stale extent %d+%d of session %s is not inside the region [%d, %d); "
                                "scrubbing only the part inside", s, n, rec.id, start, start + blocks)
                if hi <= lo:
                    continue
                # TRIM, plus Write Zeroes where the device does not read zeroes after it
                t, z, safe = scrub(dev, lo, hi - lo, always_zero=always_zero)
                trimmed, zeroed = trimmed + t, zeroed + z
                if not safe:
                    log.error("stale extent %d+%d of session %s could be neither deallocated to zeroes nor "
                              "zeroed; keeping it out of use", lo, hi - lo, rec.id)
                    unscrubbed.append((lo, hi - lo))
            reclaimed += 1
            event("session_reclaim", session=rec.id, uid=rec.uid, pid=rec.pid, extents=len(rec.extents),
                  pagecache_dir=rec.pagecache_dir or "none")
        if whole_region:
            t0 = time.monotonic()
            # a deallocate of a whole namespace takes seconds, Write Zeroes of one may take minutes:
            # ask systemd for more than TimeoutStartSec (systemd >= 236)
            sd_notify(f"STATUS=scrubbing the region {start}+{blocks} ({whole_region})",
                      f"EXTEND_TIMEOUT_USEC={SCRUB_START_TIMEOUT_S * 1_000_000}")
            t, z, safe = scrub(dev, start, blocks, always_zero=always_zero)
            self.stats.add("region_scrubbed_bytes", blocks * dev.lba_size)
            event("region_scrub", reason=whole_region, region=f"{start}+{blocks}", trimmed_bytes=t,
                  zeroed_bytes=z, seconds=f"{time.monotonic() - t0:.3f}")
            if not safe:
                raise ConfigError([f"device.path: {dev.path} can neither deallocate the region to zeroes nor "
                                   f"Write-Zero it, and there is no journal saying which blocks hold earlier "
                                   f"sessions' data ({whole_region}); refusing to serve it"], self.cfg.source)
        removed = sweep_pagecache(self.cfg.pagecache_dir)
        self.stats.add("trimmed_bytes", trimmed)
        self.stats.add("zeroed_bytes", zeroed)
        self.stats.add("sessions_reclaimed", reclaimed)
        if reclaimed or removed or whole_region:
            event("reclaim", sessions=reclaimed, trimmed_bytes=trimmed, zeroed_bytes=zeroed,
                  pagecache_dirs_removed=removed, whole_region_scrubbed=whole_region or "no")
        self.journal.reset(here)
        for lo, n in unscrubbed:
            # quarantined until a later start-up manages the scrub; the journal keeps it for that
            self.allocator.reserve(lo, n, owner=QUARANTINED)
            self.journal.add(SessionRecord(id=f"{QUARANTINED}-{lo}", uid=os.getuid(), pid=os.getpid(),
                                           mode=QUARANTINED, extents=[(lo, n)]))
            self.stats.add("quarantined_bytes", n * dev.lba_size)

    def _listen(self) -> None:
        cfg = self.cfg
        path = cfg.socket_path
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.exists(path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # left by a crashed instance (we hold the state lock)
            else:
                raise ConfigError([f"socket.path: another process is serving {path}"], cfg.source)
            finally:
                probe.close()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)  # no window in which the socket is more open than configured
        try:
            s.bind(path)
        finally:
            os.umask(old)
        gid = group_id(cfg.socket.group) if cfg.socket.group else -1
        if gid >= 0:
            os.chown(path, -1, gid)
        os.chmod(path, cfg.socket.mode)
        s.listen(64)
        s.setblocking(False)
        self.listener = s

    # -- the main loop ------------------------------------------------------------------------
    def install_signals(self) -> None:
        """Catch SIGTERM/SIGINT/SIGHUP from now on (handled by the main loop)."""
        self._wake_w.setblocking(False)
        self._wake_r.setblocking(False)
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)

    def serve_forever(self) -> None:
        assert self.listener is not None
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ, "accept")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        next_budget = time.monotonic() + self.cfg.budget.interval_s
        try:
            while not self.stopping.is_set():
                timeout = max(0.0, next_budget - time.monotonic())
                for key, _ in sel.select(timeout):
                    if key.data == "accept":
                        self._accept()
                    else:
                        with contextlib.suppress(BlockingIOError):
                            self._wake_r.recv(512)
                self._dispatch_signals()
                if time.monotonic() >= next_budget:
                    self._sample_budget()
                    next_budget = time.monotonic() + self.cfg.budget.interval_s
        finally:
            sel.close()
            signal.set_wakeup_fd(-1)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signals.append(signum)

    def _dispatch_signals(self) -> None:
        while self._signals:
            sig = self._signals.pop(0)
            if sig == signal.SIGHUP:
                try:
                    self.reload()
                except Exception:  # a reload must never take the daemon down
                    log.exception("SIGHUP: reload failed; keeping the running configuration")
            else:
                log.info("%s received: draining and stopping", signal.Signals(sig).name)
                self.stopping.set()

    def _accept(self) -> None:
        assert self.listener is not None
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("accept failed: %s", e)
                return
            sock.setblocking(True)
            try:
                self._admit(sock)
            except Exception:
                log.exception("admitting a connection failed")
                sock.close()

    def _admit(self, sock: socket.socket) -> None:
        peer = peer_credentials(sock)
        why = self._refusal(peer)
        if why is not None:
            self.stats.add("connections_refused")
            event("connection_refused", uid=peer.uid, gid=peer.gid, pid=peer.pid, reason=why)
            code = ErrorCode.PERMISSION_DENIED if "not allowed" in why else ErrorCode.BUSY
            threading.Thread(target=_refuse, args=(sock, code, why), name="bladed-refuse", daemon=True).start()
            return
        # replies to a client that stops reading must not block its channel workers forever
        secs = int(self.cfg.io.send_timeout_s)
        usecs = int((self.cfg.io.send_timeout_s - secs) * 1e6)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", secs, usecs))
        conn = Connection(self, sock, peer)
        with self._conns_lock:
            self._conns.add(conn)
        conn.thread.start()

    def _refusal(self, peer: Peer) -> str | None:
        if not self.is_allowed(peer):
            return (f"uid {peer.uid} (gid {peer.gid}) is not allowed to use bladed "
                    "(access.allowed_uids / access.allowed_gids)")
        with self._conns_lock:
            if len(self._conns) >= self.cfg.socket.max_connections:
                return f"too many connections ({self.cfg.socket.max_connections}, socket.max_connections)"
        return None

    def is_allowed(self, peer: Peer) -> bool:
        a = self.cfg.access
        if peer.uid in (0, os.getuid()) or peer.uid in a.allowed_uids:
            return True
        if not a.allowed_gids:
            return False
        return peer.gid in a.allowed_gids or bool(supplementary_groups(peer.pid) & set(a.allowed_gids))

    def is_admin(self, peer: Peer) -> bool:
        return peer.uid in (0, os.getuid()) or peer.uid in self.cfg.access.admin_uids

    def forget(self, conn: Connection) -> None:
        with self._conns_lock:
            self._conns.discard(conn)

    # -- reporting -------------------------------------------------------------------------------
    def gauges(self) -> dict[str, Any]:
        return {"sessions": len(self.manager.sessions),
                "extents": {"used_blocks": self.allocator.used_blocks, "free_blocks": self.allocator.free_blocks,
                            "largest_free": self.allocator.largest_free},
                "lba_size": self.device.lba_size,
                "budget": {k: v for k, v in self._last_budget.items()
                           if k in ("m_avail", "m_max", "m_anon_shmem", "m_star", "b_pc", "b_pc_computed",
                                    "m_file", "mem_total")}
                | {"held": self.manager.ledger.held_bytes},
                "replan": self.manager.replanner.to_dict()}

    def _sample_budget(self) -> dict[str, Any]:
        """Eq. 1-2 for the daemon as a whole: N_threads * M_pin is every open session's staging."""
        with self.manager._lock:
            live = list(self.manager.sessions.values())
        pinned = sum(s.staging_bytes for s in live)
        try:
            self._last_budget = self.manager.budgeter(1 if pinned else 0, pinned).sample("periodic").to_dict()
        except (OSError, ValueError) as e:
            log.warning("budget sampling failed: %s", e)
        return self._last_budget

    def budget(self) -> dict[str, Any]:
        sample = self._sample_budget()
        held = self.manager.ledger.held_bytes
        with self.manager._lock:
            live = list(self.manager.sessions.values())
        return {
            "sample": sample,
            "held_bytes": held,
            "available_bytes": max(0, int(sample.get("b_pc", 0)) - held),
            "override_bytes": self.cfg.budget.override,
            "cap_bytes": self.cfg.budget.cap,
            "sessions": [{"session": s.id, "channels": len(s.channels), "m_pin": s.slot_stride,
                          "b_pc": s.plan.budget_bytes, "x_bytes": s.plan.x_bytes, "n1": s.plan.n1,
                          "group1_bytes": s.plan.group1_bytes, "budget": s.budget} for s in live],
        }

    def status(self) -> dict[str, Any]:
        d = self.device
        return {
            "version": __version__, "protocol": PROTOCOL_VERSION, "pid": os.getpid(),
            "uptime_s": time.time() - self.started, "config": self.cfg.source or "embedded-default",
            "state_dir": self.cfg.state_dir, "socket": self.cfg.socket_path, "pagecache_dir": self.cfg.pagecache_dir,
            "device": d.describe(),
            "region": {"start_lba": self.allocator.start_lba, "blocks": self.allocator.nblocks,
                       "bytes": self.allocator.nblocks * d.lba_size},
            "extents": {"used_blocks": self.allocator.used_blocks, "free_blocks": self.allocator.free_blocks},
            "sessions": len(self.manager.sessions), "connections": len(self._conns),
            "metrics": self.metrics.address if self.metrics else None,
            "budget": {k: self._last_budget.get(k) for k in ("b_pc", "m_star", "cgroup", "cgroup_version")},
        }

    def trim_region(self) -> dict[str, Any]:
        """Deallocate the whole region; refused while any session is open."""
        if self.manager.sessions:
            raise RequestError(ErrorCode.BUSY, f"{len(self.manager.sessions)} session(s) open; "
                                               "trim reclaims the region only when none is")
        a = self.allocator
        t0 = time.perf_counter()
        with Engine(self.device, 4) as eng:
            eng.discard(a.start_lba, a.nblocks)
        nbytes = a.nblocks * self.device.lba_size
        removed = sweep_pagecache(self.cfg.pagecache_dir)
        self.stats.add("trimmed_bytes", nbytes)
        event("trim", region=f"{a.start_lba}+{a.nblocks}", trimmed_bytes=nbytes, pagecache_dirs_removed=removed)
        return {"trimmed_bytes": nbytes, "start_lba": a.start_lba, "blocks": a.nblocks,
                "seconds": time.perf_counter() - t0, "pagecache_dirs_removed": removed}

    # -- reload and stop ----------------------------------------------------------------------------
    def reload(self) -> None:
        """SIGHUP: re-read the configuration file and apply the keys that can change live."""
        sd_notify("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")
        try:
            if not self.cfg.source:
                log.info("SIGHUP: running on the embedded default configuration; nothing to reload")
                return
            try:
                new = load_config(self.cfg.source, state_dir=self.cfg.daemon.state_dir)
            except ConfigError as e:
                log.error("SIGHUP: keeping the running configuration: %s", e)
                return
            applied, restart = reload_changes(self.cfg, new)
            for name in applied:
                section, key = name.split(".", 1)
                setattr(getattr(self.cfg, section), key, getattr(getattr(new, section), key))
            if "log.level" in applied or "log.format" in applied:
                setup_logging(self.cfg)
            if any(name.startswith("budget.") for name in applied):
                self.manager.replanner.restart()   # new override/cap/cgroup: re-sample and apply now
            event("reload", applied=",".join(applied) or "none", needs_restart=",".join(restart) or "none")
        finally:
            sd_notify("READY=1", f"STATUS=serving on {self.cfg.socket_path} (reloaded)")

    def stop(self) -> None:
        """Graceful drain: refuse new work, finish in-flight requests, TRIM, remove files, exit."""
        self.stopping.set()
        sd_notify("STOPPING=1", "STATUS=draining sessions")
        if self.listener is not None:
            self.listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.cfg.socket_path)
        with self._conns_lock:
            conns = list(self._conns)
        for c in conns:
            c.shutdown_read()
        for c in conns:
            c.thread.join()
        self.manager.replanner.stop()
        self.manager.close_all("shutdown")
        if self.metrics is not None:
            self.metrics.close()
        event("daemon_stop", trimmed_bytes=self.stats.trimmed_bytes, sessions_closed=self.stats.sessions_closed)
        # every closed session left the journal; what is still there (quarantined blocks, a session
        # whose teardown failed) the next start-up scrubs again
        self.device.close()
        self.journal.release()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bladed", description="Dual-path NVMe-direct KV-cache daemon (Dual-Blade).")
    p.add_argument("--config", "-c", metavar="PATH", help="TOML configuration (default: the embedded default)")
    p.add_argument("--state-dir", metavar="DIR", help="override daemon.state_dir")
    p.add_argument("--check-config", action="store_true",
                   help="validate the configuration and the device, print the result and exit")
    p.add_argument("--print-config", action="store_true", help="print the effective configuration as TOML and exit")
    p.add_argument("--version", action="version", version=f"bladed {__version__} (protocol {PROTOCOL_VERSION})")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config, state_dir=args.state_dir)
    except ConfigError as e:
        print(f"bladed: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(cfg.to_toml())
        return 0
    setup_logging(cfg)
    if args.check_config:
        try:
            os.makedirs(cfg.state_dir, exist_ok=True)
            dev = Daemon(cfg)._open_device()
        except ConfigError as e:
            print(f"bladed: {e}", file=sys.stderr)
            return 2
        start, blocks = region_of(cfg, dev.capacity_blocks)
        print(f"configuration OK: {dev.kind} {dev.path}, {dev.lba_size}-byte LBAs, region [{start}, {start + blocks})"
              f" = {format_size(blocks * dev.lba_size)}, socket {cfg.socket_path}")
        dev.close()
        return 0
    daemon = Daemon(cfg)
    daemon.install_signals()
    try:
        daemon.start()
    except ConfigError as e:
        log.error("%s", e)
        print(f"bladed: {e}", file=sys.stderr)
        return 2
    except StateLockedError as e:
        log.error("%s", e)
        return 1
    try:
        daemon.serve_forever()
    finally:
        daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
