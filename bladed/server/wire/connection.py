"""One client connection, on its own thread: a control connection (JSON requests) or, after
``attach``, a data connection serving one channel of a session with binary batched I/O frames.

A data connection runs each request right where it arrives: decode, run the
ranges on the channel (``ServedSession.execute``), send the reply.  No queue and no
other thread sits between the client's copy thread and the device.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import os
import socket
import threading
import time
from typing import Any

from bladed import __version__
from bladed.io import BladedIOError
from bladed.logfmt import fields
from bladed.protocol import (
    IO_FORMAT,
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
from bladed.server.events import Peer
from bladed.server.sessions.session import ServedSession
from bladed.server.wire.lane import Lane
from bladed.server.wire.services import Services

log = logging.getLogger("bladed.connection")

#: each session costs a ring and a slot per channel: bound what one connection can ask for
MAX_SESSIONS_PER_CONNECTION = 64
#: refusals that mean the client does not speak the protocol: the first one of a connection is logged
PROTOCOL_ERRORS = frozenset({ErrorCode.BAD_FRAME, ErrorCode.BAD_REQUEST, ErrorCode.UNKNOWN_OP,
                             ErrorCode.HANDSHAKE_REQUIRED, ErrorCode.INCOMPATIBLE_PROTOCOL})


def oversize_message(e: FrameTooLargeError) -> str:
    """The error for a reply that does not fit a frame (docs/protocol.md, "Limits")."""
    return (f"the reply would be {e.nbytes} bytes, over the {MAX_FRAME_BYTES}-byte frame limit (MAX_FRAME_BYTES; "
            "see docs/protocol.md, 'Limits')")


def refuse(sock: socket.socket, code: ErrorCode, why: str) -> None:
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


class Connection:
    """One client connection: its thread, its sessions (control) or its channel (data), its replies."""

    def __init__(self, services: Services, sock: socket.socket, peer: Peer) -> None:
        self.services = services
        self.sock = sock
        self.peer = peer
        self.sessions: dict[str, ServedSession] = {}
        self._send_lock = threading.Lock()
        self._dead = False
        self.greeted = False
        self.attached: tuple[ServedSession, int] | None = None
        #: requests served and refused on this connection (reported when it closes, at DEBUG)
        self.requests = 0
        self.refused = 0
        self._protocol_error_logged = False
        self.thread = threading.Thread(target=self._run, name=f"bladed-conn-{peer.pid}", daemon=True)

    def _refuse(self, code: ErrorCode, message: str, op: Any = None) -> None:
        """Count a request refused for something the client did (``bad_requests``, by code).

        The first protocol error of the connection is logged (a client that keeps sending garbage
        must not flood the log: the rest are only counted); other refusals of control requests are
        DEBUG lines.
        """
        self.services.stats.count("bad_requests", code.value)
        self.refused += 1
        if code in PROTOCOL_ERRORS:
            if not self._protocol_error_logged:
                self._protocol_error_logged = True
                log.warning("bad request; later ones on this connection are only counted (bad_requests)",
                            extra=fields(pid=self.peer.pid, uid=self.peer.uid, reason=code.value, error=message))
        elif self.attached is None:
            log.debug("request refused", extra=fields(pid=self.peer.pid, uid=self.peer.uid, op=op,
                                                      reason=code.value, error=message))

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
        """Graceful stop: no new requests; the one in progress still completes and is answered."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RD)

    # -- the reader -----------------------------------------------------------------
    def _run(self) -> None:
        log.debug("connection opened", extra=fields(pid=self.peer.pid, uid=self.peer.uid, gid=self.peer.gid))
        reader = FrameReader(self.sock, MAX_FRAME_BYTES)
        reason = "closed"
        try:
            while self.attached is None:
                try:
                    frame = reader.read()
                except BadBody as e:
                    self.requests += 1
                    self._refuse(ErrorCode.BAD_REQUEST, str(e))
                    self.send(error_reply(None, ErrorCode.BAD_REQUEST, str(e)))
                    continue
                if not self._handle(frame):
                    reason = "protocol"
                    break
            if self.attached is not None:
                reason = self._serve_data(*self.attached)
        except ConnectionClosed:
            reason = "client_gone" if not self.services.stopping.is_set() else "shutdown"
        except FrameError as e:
            self._refuse(ErrorCode.BAD_FRAME, f"{e}; connection closed")
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
        if self.services.stopping.is_set():
            reason = "shutdown"
        log.debug("connection closed", extra=fields(
            pid=self.peer.pid, uid=self.peer.uid, reason=reason, kind="data" if self.attached else "control",
            requests=self.requests, refused=self.refused, sessions_closed=len(self.sessions)))
        if self.attached is not None:
            self.attached[0].detach(self)
        for sess in list(self.sessions.values()):
            try:
                self._close(sess, reason)
            except Exception:
                log.exception("teardown of session %s failed", sess.id)
        self.sessions.clear()
        if self.attached is None:
            self.services.blocks.forget(self)   # its pins and unfinished reservations of block pools
        self._dead = True
        with contextlib.suppress(OSError):
            self.sock.close()
        self.services.forget(self)

    def _handle(self, frame: Frame) -> bool:
        """Dispatch one JSON request; False closes the connection."""
        body = frame.body
        req_id = request_id(body)  # echoed in the reply only when valid
        op: Any = body.get("op")
        self.requests += 1
        try:
            # a malformed request is not the first request: it gets bad_request, before or after hello
            valid_id: int = get_field(body, "id", int)
            op = get_field(body, "op", str)
            if not self.greeted:
                if op != "hello":
                    message = f"the first request must be 'hello' (got {op!r})"
                    self._refuse(ErrorCode.HANDSHAKE_REQUIRED, message, op)
                    self.send(error_reply(req_id, ErrorCode.HANDSHAKE_REQUIRED, message))
                    return False
                return self._hello(valid_id, body)
            if op not in ("open_session", "open_blocks") and frame.fds:
                raise RequestError(ErrorCode.BAD_REQUEST, f"'{op}' takes no file descriptors")
            handler = getattr(self, f"_op_{op}", None) if op in OPS else None
            if handler is None:
                raise RequestError(ErrorCode.UNKNOWN_OP, f"unknown op {op!r}; protocol {PROTOCOL_VERSION} "
                                                         f"knows {', '.join(OPS)}")
            self.send(ok_reply(req_id, **handler(body, frame)))
        except RequestError as e:
            self._refuse(e.code, e.message, op)
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
        try:
            proto = get_field(body, "protocol", int)
        except RequestError as e:
            # a malformed hello is a bad request; the peer may try again on this connection
            self._refuse(e.code, e.message, "hello")
            self.send(error_reply(req_id, e.code, e.message))
            return True
        if not MIN_PROTOCOL_VERSION <= proto <= PROTOCOL_VERSION:
            message = (f"client speaks protocol {proto}; this bladed {__version__} speaks "
                       f"{MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION} (upgrade the client or the daemon)")
            self._refuse(ErrorCode.INCOMPATIBLE_PROTOCOL, message, "hello")
            self.send(error_reply(req_id, ErrorCode.INCOMPATIBLE_PROTOCOL, message))
            return False
        self.greeted = True
        d = self.services
        # the client's version: this daemon speaks it (an older client never sends what it added since)
        self.send(ok_reply(req_id, protocol=proto, server=f"bladed/{__version__}", pid=os.getpid(),
                           lba_size=d.device.lba_size, staging_align=d.manager.staging_align,
                           max_channels=d.cfg.io.max_channels, max_frame_bytes=MAX_FRAME_BYTES,
                           max_ranges=d.cfg.io.max_outstanding))
        return True

    def _session(self, body: dict[str, Any]) -> ServedSession:
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
        if self.services.stopping.is_set():
            raise RequestError(ErrorCode.SHUTTING_DOWN, "bladed is shutting down")
        if len(self.sessions) >= MAX_SESSIONS_PER_CONNECTION:
            raise RequestError(ErrorCode.BUSY, f"{MAX_SESSIONS_PER_CONNECTION} sessions are open on this "
                                               "connection; close one first")
        fds, frame.fds = frame.fds, []
        sess = self.services.manager.open(self.peer, body, fds)
        out = sess.open_reply()
        try:
            encode(ok_reply(body["id"], **out))
        except FrameTooLargeError as e:
            # MAX_LAYERS is set so that this cannot happen; if it does, the client must not be left
            # with a session it cannot name
            log.error("open_session of pid %d: %s; closing session %s", self.peer.pid, e, sess.id)
            self.services.manager.close(sess, "reply_too_large")
            raise RequestError(ErrorCode.INTERNAL, oversize_message(e)) from None
        self.sessions[sess.id] = sess
        plan, budget = sess.plan, sess.budget
        log.debug("session plan", extra=fields(
            session=sess.id, pid=self.peer.pid, mode=plan.mode.value,
            pagecache_budget_bytes=budget.get("pagecache_budget_bytes"), granted=budget.get("granted_bytes"),
            held_by_others=budget.get("held_by_others_bytes"), group1_limit_bytes=plan.group1_limit_bytes,
            group1_layers=plan.group1_layers, group1=",".join(k.name for k in plan.group1()) or "none",
            group2=",".join(k.name for k in plan.group2()) or "none", extent_blocks=plan.extent_blocks,
            staging_bytes=sess.staging_bytes))
        return out

    def _op_close_session(self, body: dict[str, Any], frame: Frame) -> dict[str, Any]:
        sess = self._session(body)
        del self.sessions[sess.id]
        self._close(sess, "closed")
        return {"session": sess.id}

    def _close(self, sess: ServedSession, reason: str) -> None:
        """A session, or an attachment to a block pool (whose storage stays the pool's)."""
        if self.services.blocks.owns(sess):
            self.services.blocks.close(sess)
        else:
            self.services.manager.close(sess, reason)

    def _op_open_blocks(self, body: dict[str, Any], frame: Frame) -> dict[str, Any]:
        """An attachment to a block pool: a session over the pool's storage (docs/protocol.md, "Block pools")."""
        if self.services.stopping.is_set():
            raise RequestError(ErrorCode.SHUTTING_DOWN, "bladed is shutting down")
        if len(self.sessions) >= MAX_SESSIONS_PER_CONNECTION:
            raise RequestError(ErrorCode.BUSY, f"{MAX_SESSIONS_PER_CONNECTION} sessions are open on this "
                                               "connection; close one first")
        fds, frame.fds = frame.fds, []
        sess, out = self.services.blocks.attach(self.peer, body, fds)
        try:
            encode(ok_reply(body["id"], **out))
        except FrameTooLargeError as e:
            self.services.blocks.close(sess)
            raise RequestError(ErrorCode.INTERNAL, oversize_message(e)) from None
        self.sessions[sess.id] = sess
        return out

    def _op_blocks(self, body: dict[str, Any], frame: Frame) -> dict[str, Any]:
        return self.services.blocks.op(self.peer, self.services.is_admin(self.peer), self, body)

    def _op_attach(self, body: dict[str, Any], frame: Frame) -> dict[str, Any]:
        """Make this connection the data connection of one channel of a session of this peer."""
        sid = get_field(body, "session", str)
        ch = get_field(body, "channel", int)
        token = get_field(body, "token", str)
        if self.sessions:
            raise RequestError(ErrorCode.BAD_REQUEST, "a connection with sessions of its own cannot attach; "
                                                      "open a new connection for each channel")
        sess = self.services.manager.get(sid) or self.services.blocks.get(sid)
        # the same answer whether the session does not exist or is someone else's: no probing
        if sess is None or sess.peer.uid != self.peer.uid or not hmac.compare_digest(sess.attach_token, token):
            raise RequestError(ErrorCode.NO_SUCH_SESSION, f"no session {sid!r} with that attach token")
        sess.channel(ch)
        sess.attach(self)
        self.attached = (sess, ch)
        log.debug("data connection attached", extra=fields(pid=self.peer.pid, session=sid, channel=ch))
        return {"session": sid, "channel": ch, "format": IO_FORMAT}

    def _op_write(self, body: dict[str, Any], frame: Frame) -> dict[str, Any]:
        return self._json_io("write", body)

    def _op_read(self, body: dict[str, Any], frame: Frame) -> dict[str, Any]:
        return self._json_io("read", body)

    def _json_io(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        """One range over JSON (simple clients and tools; copy threads use a data connection)."""
        sess = self._session(body)
        ch, rng = sess.json_range(op, body)
        (r,) = sess.execute(ch, [rng], self.services.cfg.io.max_outstanding)
        if r.error is not None:
            raise RequestError(r.error, r.message)
        hit = None if r.hit_bytes is None or not r.nbytes else r.hit_bytes / r.nbytes
        return {"path": r.path, "nbytes": r.nbytes, "service_ns": r.service_ns, "hit_ratio": hit,
                "started_ns": r.started_ns, "finished_ns": r.finished_ns}

    def _op_status(self, body: dict[str, Any], frame: Frame) -> dict[str, Any]:
        return self.services.status()

    def _op_sessions(self, body: dict[str, Any], frame: Frame) -> dict[str, Any]:
        admin = self.services.is_admin(self.peer)
        live = self.services.manager.live_sessions()
        return {"sessions": [s.describe() for s in live if admin or s.peer.uid == self.peer.uid]}

    def _op_stats(self, body: dict[str, Any], frame: Frame) -> dict[str, Any]:
        out = self.services.stats.snapshot()
        out.update(self.services.gauges())
        out["time"] = time.time()
        return out

    def _op_budget(self, body: dict[str, Any], frame: Frame) -> dict[str, Any]:
        return self.services.budget()

    def _op_wear(self, body: dict[str, Any], frame: Frame) -> dict[str, Any]:
        return self.services.wear_report()

    def _op_trim(self, body: dict[str, Any], frame: Frame) -> dict[str, Any]:
        if not self.services.is_admin(self.peer):
            raise RequestError(ErrorCode.PERMISSION_DENIED, f"uid {self.peer.uid} may not trim "
                                                            "(root or access.admin_uids only)")
        return self.services.trim_region()

    def _op_retain(self, body: dict[str, Any], frame: Frame) -> dict[str, Any]:
        sess = self._session(body)
        if self.services.blocks.owns(sess):
            raise RequestError(ErrorCode.BAD_REQUEST, f"{sess.id} is an attachment to a block pool, whose blocks "
                                                      "stay in the pool; retain a session's prefix instead")
        out = self.services.manager.retain(sess, body)
        if body.get("close") is True:
            del self.sessions[sess.id]
        return out | {"session": sess.id}

    def _op_prefixes(self, body: dict[str, Any], frame: Frame) -> dict[str, Any]:
        cache = self.services.manager.prefixes
        return {"prefixes": cache.describe(self.peer, self.services.is_admin(self.peer)),
                "scope": cache.scope_of(self.peer), "block_tokens": cache.block_tokens}

    def _op_evict_prefixes(self, body: dict[str, Any], frame: Frame) -> dict[str, Any]:
        entry = get_field(body, "entry", str, default=None)
        evicted = self.services.manager.prefixes.evict_matching(self.peer, self.services.is_admin(self.peer), entry)
        return {"evicted": evicted}

    # -- the data path ------------------------------------------------------------------
    def _serve_data(self, sess: ServedSession, ch: int) -> str:
        """Serve binary I/O requests for one channel until the peer or the session goes (:meth:`Lane.serve`)."""
        lane = Lane(sess, sess.channel(ch), self.sock, self.services.cfg.io.max_outstanding)
        try:
            return lane.serve(self._refuse, self.peer.pid)
        finally:
            self.requests += lane.served + lane.general_requests


__all__ = ["MAX_SESSIONS_PER_CONNECTION", "Connection", "refuse"]
