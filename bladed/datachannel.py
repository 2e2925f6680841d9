"""The client side of a data connection: one channel of a session, driven by the copy thread that owns it.

The copy thread sends a binary I/O request (a batch of token ranges) and reads
the reply itself: no reader thread, no queue, no future between it and the
daemon's connection thread (docs/protocol.md); the frames go in and out
through C (``protocol.FrameStream``).  Requests may be
pipelined (:meth:`DataChannel.send` several, then :meth:`DataChannel.receive`
in order).  The future-returning calls of ``bladed.client.Session`` use a pump
thread, started on their first use for that channel only.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import itertools
import json
import socket
import threading
from collections.abc import Sequence
from typing import Any

from bladed import __version__
from bladed.protocol import (
    IO_FORMAT,
    BladedError,
    ConnectionClosed,
    DaemonLostError,
    FrameError,
    FrameStream,
    IORange,
    ProtocolError,
    RangeResult,
    decode_io_reply,
    encode_io_request,
    error_for,
    error_from_reply,
    hello_request,
    send_frame,
)


class DataChannel:
    """One channel's data connection.  Thread-safe, but meant for one copy thread."""

    def __init__(self, socket_path: str, session_id: str, channel: int, token: str,
                 timeout: float | None = 30.0) -> None:
        self.socket_path = socket_path
        self.channel = channel
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(socket_path)
            self._stream = FrameStream(self._sock)
            self._json(hello_request(0, f"bladed.datachannel/{__version__}"))
            self._json({"op": "attach", "id": 1, "session": session_id, "channel": channel, "token": token})
            self._sock.settimeout(None)
        except OSError as e:
            self._sock.close()
            raise DaemonLostError(f"cannot open a data connection to bladed at {socket_path} for channel {channel}: "
                                  f"{e.strerror or e}") from None
        except BaseException:
            self._sock.close()
            raise
        self._ids = itertools.count(2)
        self._lock = threading.Lock()
        self._sent: collections.deque[int] = collections.deque()
        self._futures: collections.deque[concurrent.futures.Future[list[RangeResult]]] = collections.deque()
        self._pump: threading.Thread | None = None
        self._pending = threading.Semaphore(0)     # replies the pump has yet to read
        self._lost: BladedError | None = None
        self._closed = False

    def _json(self, body: dict[str, Any]) -> dict[str, Any]:
        send_frame(self._sock, body)
        try:
            fmt, raw = self._stream.read()
        except ConnectionClosed:
            raise DaemonLostError(f"bladed at {self.socket_path} closed the data connection") from None
        if fmt == IO_FORMAT:
            raise ProtocolError("a binary frame before the attach was answered")
        reply = json.loads(bytes(raw))
        if not reply.get("ok"):
            raise error_from_reply(reply)
        return dict(reply)

    # -- synchronous, pipelined ---------------------------------------------------------
    def send(self, ranges: Sequence[IORange]) -> int:
        """Send one request without waiting; its reply comes from :meth:`receive`, in order."""
        if self._lost is not None:
            raise self._lost
        req_id = next(self._ids)
        data = encode_io_request(req_id, ranges)
        try:
            self._stream.send(data)
        except OSError as e:
            raise self._fail(self._parting_error() or self._lost_error(e.strerror or str(e))) from None
        self._sent.append(req_id)
        return req_id

    def receive(self) -> list[RangeResult]:
        """The results of the oldest request sent and not yet received (BladedError if refused whole)."""
        if self._lost is not None:
            raise self._lost
        want = self._sent.popleft()
        try:
            fmt, body = self._stream.read()
        except ConnectionClosed:
            raise self._fail(self._lost_error("closed")) from None
        except (FrameError, OSError) as e:
            raise self._fail(self._lost_error(str(e))) from None
        if fmt != IO_FORMAT:
            # the daemon says why it is closing the connection (bad_frame), in JSON
            try:
                err = error_from_reply(json.loads(bytes(body)))
            except ValueError:
                err = ProtocolError("a JSON frame on a data connection")
            raise self._fail(err)
        req_id, refused, message, results = decode_io_reply(body)
        if req_id != want:
            raise self._fail(ProtocolError(f"reply to request {req_id} while waiting for {want}"))
        if refused is not None:
            raise error_for(refused, message)
        return results

    def submit(self, ranges: Sequence[IORange]) -> list[RangeResult]:
        """Send one request and wait for its reply."""
        with self._lock:
            if self._pump is None:
                self.send(ranges)
                return self.receive()
        return self.submit_async(ranges).result()

    def submit_many(self, requests: Sequence[Sequence[IORange]], window: int = 32) -> list[list[RangeResult]]:
        """Send several requests pipelined, at most ``window`` unanswered at a time, and wait for every reply;
        their results in order. A request refused whole raises its error once the others' replies are read
        (the connection stays usable)."""
        with self._lock:
            if self._pump is None:
                out: list[list[RangeResult]] = []
                first: BladedError | None = None
                sent = 0
                while len(out) < len(requests):
                    while sent < len(requests) and sent - len(out) < window:
                        self.send(requests[sent])
                        sent += 1
                    try:
                        out.append(self.receive())
                    except BladedError as e:
                        if self._lost is not None:
                            raise
                        first = first or e
                        out.append([])
                if first is not None:
                    raise first
                return out
        futures = [self.submit_async(r) for r in requests]
        return [f.result() for f in futures]

    # -- futures (a pump thread) -----------------------------------------------------------
    def submit_async(self, ranges: Sequence[IORange]) -> concurrent.futures.Future[list[RangeResult]]:
        """Send one request; the future holds its results (or the error that refused it)."""
        fut: concurrent.futures.Future[list[RangeResult]] = concurrent.futures.Future()
        with self._lock:
            self.send(ranges)
            self._futures.append(fut)
            if self._pump is None:
                self._pump = threading.Thread(target=self._run_pump, name=f"bladed-ch{self.channel}-pump",
                                              daemon=True)
                self._pump.start()
        self._pending.release()
        return fut

    def _run_pump(self) -> None:
        """Read replies in order and complete the futures (only for channels that used them)."""
        while True:
            self._pending.acquire()
            if self._closed and self._lost is not None:
                return
            try:
                results = self.receive()
            except BladedError as e:
                with self._lock:
                    fut = self._futures.popleft() if self._futures else None
                if fut is not None:
                    fut.set_exception(e)
                if self._lost is not None:
                    self._fail_pending(self._lost)
                    return
                continue
            with self._lock:
                fut = self._futures.popleft()
            fut.set_result(results)

    def _parting_error(self) -> BladedError | None:
        """The error the daemon sent before closing the connection (a send then fails), if any.

        Only without a pump: the pump thread owns the reading side then, and reports it itself."""
        if self._pump is not None:
            return None
        try:
            self._sock.settimeout(1.0)     # the peer has closed: buffered bytes or EOF come at once
            fmt, body = self._stream.read()
        except (ConnectionClosed, FrameError, OSError):
            return None
        if fmt == IO_FORMAT:
            return None
        try:
            return error_from_reply(json.loads(bytes(body)))
        except ValueError:
            return None

    def _lost_error(self, why: str) -> DaemonLostError:
        return DaemonLostError(f"lost connection to bladed at {self.socket_path} (data connection of channel "
                               f"{self.channel}: {why}; daemon stopped, crashed or restarted, or the session was "
                               "closed; reconnect with a new Client)")

    def _fail(self, err: BladedError) -> BladedError:
        self._lost = err
        return err

    def _fail_pending(self, err: BladedError) -> None:
        with self._lock:
            pending, self._futures = list(self._futures), collections.deque()
        for f in pending:
            if not f.done():
                f.set_exception(err)

    def close(self) -> None:
        """Close the connection; futures still pending fail with DaemonLostError."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        pump = self._pump
        if pump is not None:
            self._lost = self._lost or DaemonLostError("the data channel is closed")
            self._pending.release()
            if pump is not threading.current_thread():
                pump.join(5)
        self._sock.close()
        self._fail_pending(DaemonLostError("the data channel is closed"))


__all__ = ["DataChannel"]
