"""The client library used inside the inference process.

::

    with Client() as client, client.open_session(geometry, channels=2) as sess:
        sess.slot(0)[:n] = k_bytes                      # staging slot of channel 0
        sess.write(layer=3, kind="k", ch=0)             # whole KPU
        res = sess.read(layer=3, kind="k", ch=0, token_start=10, ntokens=1)

Staging memory is a sealed memfd created here and passed to the daemon with
``SCM_RIGHTS``; both processes map the same pages, so the copy threads' GPU
DMA and the daemon's NVMe DMA share one buffer (the paper's Co-DMA, §IV-B).
With a CUDA-capable torch already imported the mapping is pinned with
``cudaHostRegister``; on CPU it stays ordinary shared memory.

Every request is asynchronous underneath (replies are matched by id), so
copy threads on different channels overlap (overlap-intra, §IV-C).  A
session's I/O futures complete on their channel's pump thread
(``bladed-chN-pump``), control futures (``call_async``) on the client's
reader thread: done-callbacks run there and must not wait for another bladed
reply (hand such work to another thread).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import mmap
import os
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from bladed import __version__, cuda
from bladed.config import SocketLocation, find_socket
from bladed.datachannel import DataChannel
from bladed.protocol import (
    MIRROR,
    PROTOCOL_VERSION,
    BadBody,
    BadRequestError,
    BladedError,
    BusyError,
    ConnectionClosed,
    DaemonLostError,
    FrameError,
    FrameReader,
    IncompatibleProtocolError,
    IntegrityError,
    IOOp,
    IORange,
    NoMemoryError,
    NoSpaceError,
    NoSuchSessionError,
    OutOfRangeError,
    PermissionDeniedError,
    ProtocolError,
    QuotaExceededError,
    RangeResult,
    RemoteIOError,
    ShuttingDownError,
    WriteBudgetExhaustedError,
    error_for,
    error_from_reply,
    hello_request,
    send_frame,
)
from bladed.residency.geometry import GEOMETRY_FIELDS, dtype_bytes, tensor_id, tensor_of
from bladed.residency.planner import Mode
from bladed.sizes import align_up

log = logging.getLogger(__name__)

#: the residency modes by their names; ``open_session`` takes the paper's Table III labels too (``Mode.parse``)
MODES = tuple(m.value for m in Mode)
_OP_NAMES = {IOOp.WRITE: "write", IOOp.READ: "read"}

__all__ = [
    "BadRequestError",
    "BladedError",
    "BusyError",
    "Client",
    "DaemonLostError",
    "IncompatibleProtocolError",
    "IntegrityError",
    "NoMemoryError",
    "NoSpaceError",
    "NoSuchSessionError",
    "OpResult",
    "OutOfRangeError",
    "PermissionDeniedError",
    "PrefixKey",
    "ProtocolError",
    "QuotaExceededError",
    "RemoteIOError",
    "Session",
    "ShuttingDownError",
    "WriteBudgetExhaustedError",
    "geometry_dict",
]


@dataclass(frozen=True)
class PrefixKey:
    """What a retained prefix is found by: the model's name (anything that tells its weights apart), the KV
    dtype's name, and the token ids (of the prompt at open; the daemon hashes them in blocks)."""

    model: str
    dtype: str
    tokens: Sequence[int] = ()

    def to_wire(self) -> dict[str, Any]:
        return {"model": self.model, "dtype": self.dtype, "tokens": [int(t) for t in self.tokens]}


class OpResult(NamedTuple):
    """The outcome of one write or read (a named tuple: one is made per range on the request path)."""

    op: str
    layer: int
    kind: str
    channel: int
    path: str               # "pagecache" or "direct"
    nbytes: int
    service_ns: int         # measured by the daemon: first byte issued to last byte done
    hit_ratio: float | None  # page-cache reads: fraction of the bytes already cached
    #: when the daemon started and finished it (CLOCK_MONOTONIC ns of the host)
    started_ns: int = 0
    finished_ns: int = 0
    #: what failed (``submit(..., check=False)`` only); None when it was served
    error: BladedError | None = None


def geometry_dict(geometry: Any) -> dict[str, int | str]:
    """The six geometry fields of a ``bladed.residency.Geometry``, a mapping or any
    object with those attributes (``dtype`` by name is accepted for ``dtype_bytes``),
    and its ``kv_format`` (a name or a :class:`bladed.kvformat.KVFormat`) where it has one."""
    get: Callable[[str], Any]
    if isinstance(geometry, Mapping):
        src = dict(geometry)
        get = src.get
    else:
        def get(name: str) -> Any:
            return getattr(geometry, name, None)
    out: dict[str, int | str] = {}
    for name in GEOMETRY_FIELDS:
        value = get(name)
        if value is None and name == "dtype_bytes" and get("dtype") is not None:
            try:
                value = dtype_bytes(get("dtype"))
            except ValueError as e:
                raise ValueError(f"{e}, or give dtype_bytes") from None
        if value is None:
            raise ValueError(f"geometry lacks {name!r}")
        out[name] = int(value)
    fmt = get("kv_format")
    if fmt:
        out["kv_format"] = getattr(fmt, "name", fmt)     # a name as given: the daemon checks it
    return out


class Client:
    """A connection to bladed.  Thread-safe: copy threads may share one client."""

    def __init__(self, socket_path: str | SocketLocation | None = None, *, timeout: float | None = 30.0,
                 name: str = "bladed.client") -> None:
        """Connect to ``socket_path``; None: where :func:`bladed.config.find_socket` says."""
        where = socket_path if isinstance(socket_path, SocketLocation) else find_socket(socket_path)
        self.socket_path = where.path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._timeout = timeout
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(self.socket_path)
        except FileNotFoundError:
            self._sock.close()
            raise DaemonLostError(f"no bladed socket at {where} ({where.why})") from None
        except ConnectionRefusedError:
            self._sock.close()
            raise DaemonLostError(f"bladed is not running: {where} refuses connections, the stale socket of a "
                                  f"stopped daemon ({where.why})") from None
        except PermissionError:
            self._sock.close()
            raise PermissionDeniedError(f"no permission to connect to {where} ({where.origin}): the daemon's "
                                        f"socket.mode / socket.group must let uid {os.getuid()} in") from None
        except OSError as e:
            self._sock.close()
            raise DaemonLostError(f"cannot connect to bladed at {where} ({where.origin}): "
                                  f"{e.strerror or e}") from None
        self._reader = FrameReader(self._sock)
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, concurrent.futures.Future[dict[str, Any]]] = {}
        self._pending_lock = threading.Lock()
        self._lost: BladedError | None = None
        self._sessions: dict[str, Session] = {}
        self._closed = False
        try:
            self.server = self._handshake(name)
        except BaseException:
            self._sock.close()
            raise
        self._sock.settimeout(None)
        self._thread = threading.Thread(target=self._read_loop, name="bladed-client-reader", daemon=True)
        self._thread.start()

    @property
    def max_ranges(self) -> int:
        """The most ranges one I/O request may carry: the daemon's ``max_ranges`` (its hello reply)."""
        return max(1, int(self.server["max_ranges"]))

    # -- plumbing ----------------------------------------------------------------
    def _handshake(self, name: str) -> dict[str, Any]:
        try:
            send_frame(self._sock, hello_request(0, f"{name}/{__version__}"))
            frame = self._reader.read()
        except (ConnectionClosed, OSError) as e:
            raise DaemonLostError(f"bladed at {self.socket_path} closed the connection during the handshake "
                                  f"({e or 'EOF'})") from None
        except (FrameError, BadBody) as e:
            raise ProtocolError(f"bad handshake reply from {self.socket_path}: {e}") from None
        frame.close_fds()
        reply = frame.body
        if not reply.get("ok"):
            raise error_from_reply(reply)
        if reply.get("protocol") != PROTOCOL_VERSION:
            raise IncompatibleProtocolError(
                f"bladed speaks protocol {reply.get('protocol')}, this client {PROTOCOL_VERSION}")
        return reply

    def _read_loop(self) -> None:
        err: BladedError
        try:
            while True:
                frame = self._reader.read()
                frame.close_fds()
                req_id = frame.body.get("id")
                with self._pending_lock:
                    fut = self._pending.pop(req_id, None) if isinstance(req_id, int) else None
                if fut is None:
                    if req_id is None and not frame.body.get("ok", True):
                        # an unsolicited error (e.g. shutting down) precedes a close
                        log.warning("bladed: %s", frame.body.get("error"))
                    continue
                if frame.body.get("ok"):
                    fut.set_result(frame.body)
                else:
                    fut.set_exception(error_from_reply(frame.body))
        except ConnectionClosed:
            err = DaemonLostError(f"lost connection to bladed at {self.socket_path} "
                                  "(daemon stopped, crashed or restarted; reconnect with a new Client)")
        except (FrameError, BadBody) as e:
            err = ProtocolError(f"bad frame from bladed: {e}")
        except OSError as e:
            err = DaemonLostError(f"lost connection to bladed at {self.socket_path} ({e.strerror or e}; daemon "
                                  "stopped, crashed or restarted; reconnect with a new Client)")
        if self._closed:
            err = DaemonLostError("client is closed")
        self._fail_all(err)

    def _fail_all(self, err: BladedError) -> None:
        with self._pending_lock:
            self._lost = err
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(err)

    def call_async(self, op: str, fds: tuple[int, ...] = (),
                   **fields: Any) -> concurrent.futures.Future[dict[str, Any]]:
        """Send one request; the future holds the reply body or the error as an exception."""
        fut: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        req_id = next(self._ids)
        with self._pending_lock:
            if self._lost is not None:
                raise self._lost
            self._pending[req_id] = fut
        try:
            with self._send_lock:
                send_frame(self._sock, {"op": op, "id": req_id, **fields}, fds)
        except OSError as e:
            with self._pending_lock:
                self._pending.pop(req_id, None)
            raise DaemonLostError(f"lost connection to bladed at {self.socket_path}: {e}") from None
        return fut

    def call(self, op: str, fds: tuple[int, ...] = (), **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its reply (raises the matching BladedError)."""
        return self.call_async(op, fds, **fields).result(self._timeout)

    # -- sessions ----------------------------------------------------------------
    def open_session(self, geometry: Any, mode: str | Mode = "dualblade", channels: int = 2,
                     staging_bytes: int | None = None, *, slot_bytes: int | None = None, pin: bool | None = None,
                     checksums: bool | None = None, prefix: PrefixKey | None = None) -> Session:
        """Open a session: the daemon plans it (Algorithm 1) and binds its extents (Eq. 3-6).

        ``mode``: a name of :data:`MODES` or the paper's Table III label of one (``Dual-Blade``, ...).

        Each channel gets a staging slot of ``slot_bytes`` (default: one KPU,
        which the default range layout mirrors; more lets one request carry
        ranges of several KPUs at their own slot offsets); ``staging_bytes``
        defaults to one slot per channel.  The daemon lays the slots out and
        sizes the staging memory; the session takes that layout from its reply.
        ``pin`` (None = when torch with CUDA is already imported) registers the
        staging mapping with ``cudaHostRegister``.  ``checksums`` (None = the
        daemon's ``io.checksums``): the daemon keeps a crc32c of every token row
        written and fails a read whose data differs with IntegrityError.
        ``prefix``: look the prompt's tokens up among the retained prefixes of
        the peer's scope; the KV of the longest match is copied into the session
        before the reply, and :attr:`Session.prefix_tokens` says how many
        leading tokens are there (docs/protocol.md, "Prefix reuse").
        """
        try:
            mode = Mode.parse(mode).value      # the paper's label (Dual-Blade, NVMe-direct-Only, ...) goes as the name
        except ValueError as e:
            raise ValueError(f"mode: {e}, or the paper's Table III label of one (Baseline, CachePolicy-Only, "
                             f"NVMe-direct-Only, Dual-Blade)") from None
        if channels < 1:
            raise ValueError(f"channels must be >= 1, got {channels}")
        extra: dict[str, Any] = {} if slot_bytes is None else {"slot_bytes": slot_bytes}
        if staging_bytes is not None:
            extra["staging_bytes"] = align_up(staging_bytes, int(self.server["staging_align"]))
        if checksums is not None:
            extra["checksums"] = bool(checksums)
        if prefix is not None:
            extra["prefix"] = prefix.to_wire()
        # an empty memfd: the daemon sizes it to the layout and seals it, so that neither side can shrink the
        # memory under the other's DMA (docs/protocol.md, open_session)
        fd = os.memfd_create("bladed-staging", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            reply = self.call("open_session", (fd,), geometry=geometry_dict(geometry), mode=mode, channels=channels,
                              **extra)
            try:
                mapping = mmap.mmap(fd, int(reply["layout"]["staging_bytes"]))
            except BaseException:
                self.call_async("close_session", session=reply["session"])
                raise
        finally:
            os.close(fd)
        sess = Session(self, reply, mapping, pin)
        self._sessions[sess.id] = sess
        return sess

    # -- daemon queries ------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return _strip(self.call("status"))

    def sessions(self) -> list[dict[str, Any]]:
        return list(self.call("sessions")["sessions"])

    def stats(self) -> dict[str, Any]:
        return _strip(self.call("stats"))

    def budget(self) -> dict[str, Any]:
        return _strip(self.call("budget"))

    def wear(self) -> dict[str, Any]:
        """What bladed wrote to the device today and since install, the write budget, the drive's figures and
        days left (docs/operations.md, "Wear")."""
        return _strip(self.call("wear"))

    def prefixes(self) -> dict[str, Any]:
        """The retained prefixes this peer may see (all of them for an admin), its scope and the block size."""
        return _strip(self.call("prefixes"))

    def evict_prefixes(self, entry: str | None = None) -> list[str]:
        """Evict one retained prefix by id, or every one this peer may see; the ids evicted."""
        return list(self.call_async("evict_prefixes", entry=entry).result()["evicted"])

    def trim(self) -> dict[str, Any]:
        """TRIM the whole region (refused while any session is open; admin only)."""
        return _strip(self.call_async("trim").result())  # no timeout: a large region takes a while

    def close(self) -> None:
        """Close every session of this client, then the connection."""
        if self._closed:
            return
        for sess in list(self._sessions.values()):
            with contextlib.suppress(BladedError):
                sess.close()
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(5)
        self._sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _strip(reply: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in reply.items() if k not in ("id", "ok")}


class Session:
    """One model's KV cache in bladed: its plan, its staging slots and its I/O.

    Each channel's I/O goes over a data connection of its own
    (:class:`bladed.datachannel.DataChannel`, opened on first use): the copy
    thread that owns channel ``ch`` sends its requests and reads the replies
    itself.  :meth:`submit` sends a batch of ranges in one request.
    """

    def __init__(self, client: Client, reply: dict[str, Any], mapping: mmap.mmap, pin: bool | None) -> None:
        self.client = client
        self.id: str = reply["session"]
        self.plan: dict[str, Any] = reply["plan"]
        layout = reply["layout"]
        self.channels: int = int(layout["channels"])
        self.token_bytes: int = int(layout["token_bytes"])
        self.kpu_bytes: int = int(layout["kpu_bytes"])
        self.max_tokens: int = int(layout["max_tokens"])
        self.slot_bytes: int = int(layout["slot_bytes"])
        self.slot_stride: int = int(layout["slot_stride"])
        self.staging_bytes: int = int(layout["staging_bytes"])
        self._attach_token: str = layout["attach_token"]
        prefix = reply.get("prefix") or {}
        #: leading tokens whose KV a retained prefix supplied at open (0: none, or no prefix key given)
        self.prefix_tokens: int = int(prefix.get("tokens", 0))
        #: the retained prefix they came from (None on a miss)
        self.prefix_entry: str | None = prefix.get("entry")
        #: tokens per hashed block on the daemon (``prefix.block_tokens``; None: no prefix key given)
        self.prefix_block_tokens: int | None = prefix.get("block_tokens")
        #: where they came from: "local" (a retained prefix of this daemon), "shared" (the shared tier), None
        self.prefix_source: str | None = prefix.get("source")
        self._mapping = mapping
        self._view = memoryview(mapping)
        self._closed = False
        self._data: list[DataChannel | None] = [None] * self.channels
        self._data_lock = threading.Lock()
        self.pinned = self._pin() if pin or (pin is None and cuda.available()) else False

    def _pin(self) -> bool:
        """Page-lock the staging mapping for CUDA DMA (``cudaHostRegister``); False, with a warning, when that
        fails: the session still works, its GPU copies are then staged through pageable memory."""
        try:
            import torch  # only reached when torch is imported or pinning was asked for

            if not torch.cuda.is_available():
                return False
            rc = cuda.host_register(_address(self._mapping), len(self._mapping))
        except Exception as e:  # e.g. CUDA initialised before a fork: refused in the child
            log.warning("cannot page-lock the %d staging bytes for CUDA (%s); GPU copies stay pageable",
                        len(self._mapping), e)
            return False
        if rc != 0:
            log.warning("cudaHostRegister of %d staging bytes failed (%s); GPU copies stay pageable",
                        len(self._mapping), rc)
            return False
        return True

    def slot(self, ch: int) -> memoryview:
        """Channel ``ch``'s staging slot (``slot_bytes``; by default one KPU, token ``t`` at ``t * token_bytes``)."""
        if not 0 <= ch < self.channels:
            raise IndexError(f"channel {ch} outside 0..{self.channels - 1}")
        if self._closed:
            raise ValueError("session is closed")
        start = ch * self.slot_stride
        return self._view[start:start + self.slot_bytes]

    def kpu(self, layer: int, kind: str) -> dict[str, Any]:
        """The plan entry of one KPU (its group, path and size)."""
        for k in self.plan["kpus"]:
            if k["layer"] == layer and k["kind"] == kind:
                return dict(k)
        raise KeyError(f"no KPU ({layer}, {kind!r}) in the plan")

    # -- I/O ---------------------------------------------------------------------------
    def channel(self, ch: int) -> DataChannel:
        """Channel ``ch``'s data connection (connected on first use)."""
        if self._closed:
            raise ValueError("session is closed")
        if not 0 <= ch < self.channels:
            raise IndexError(f"channel {ch} outside 0..{self.channels - 1}")
        dc = self._data[ch]
        if dc is None:
            with self._data_lock:
                dc = self._data[ch]
                if dc is None:
                    dc = self._data[ch] = DataChannel(self.client.socket_path, self.id, ch, self._attach_token,
                                                      self.client._timeout)
        return dc

    def range(self, op: str, layer: int, kind: str, token_start: int = 0, ntokens: int | None = None,
              slot_offset: int | None = None) -> IORange:
        """One range of a request: tokens of KPU (layer, kind) <-> the slot (at ``slot_offset``; default: mirrored)."""
        if op not in ("read", "write"):
            raise ValueError(f"op must be 'read' or 'write', got {op!r}")
        n = self.max_tokens - token_start if ntokens is None else ntokens
        return IORange(IOOp.WRITE if op == "write" else IOOp.READ, tensor_id(layer, kind), token_start, n,
                       MIRROR if slot_offset is None else slot_offset)

    def submit(self, ch: int, ranges: Sequence[IORange], *, check: bool = True) -> list[OpResult]:
        """Run a batch of ranges in one request on channel ``ch``; one result per range, in order.

        With ``check`` a failed range raises its error once all have run (a bad
        range refuses the whole request before anything runs, in any case).
        """
        return self._results(ch, ranges, self.channel(ch).submit(ranges), check)

    def requests_of(self, ranges: Sequence[IORange]) -> list[list[IORange]]:
        """``ranges`` in order, cut into requests of at most the daemon's ``max_ranges`` (for :meth:`submit_many`)."""
        limit = self.client.max_ranges
        return [list(ranges[i:i + limit]) for i in range(0, len(ranges), limit)]

    def submit_many(self, ch: int, requests: Sequence[Sequence[IORange]], *,
                    check: bool = True) -> list[list[OpResult]]:
        """Several requests on channel ``ch``, pipelined (sent ahead of their replies); per request its results.

        For more ranges than one request may carry (``max_ranges``: :meth:`requests_of` cuts them)."""
        replies = self.channel(ch).submit_many(requests)
        return [self._results(ch, r, res, check) for r, res in zip(requests, replies, strict=True)]

    @staticmethod
    def _results(ch: int, ranges: Sequence[IORange], results: list[RangeResult], check: bool) -> list[OpResult]:
        out = []
        first: BladedError | None = None
        for r, res in zip(ranges, results, strict=True):
            layer, kind = tensor_of(r.tensor_id)
            op = _OP_NAMES[r.op]
            if res.error is not None:
                err = error_for(res.error, res.message)
                first = first or err
                out.append(OpResult(op, layer, kind, ch, res.path or "", 0, 0, None, 0, 0, err))
                continue
            nbytes, hit = res.nbytes, res.hit_bytes
            out.append(OpResult(op, layer, kind, ch, res.path or "", nbytes, res.service_ns,
                                None if hit is None or not nbytes else hit / nbytes, res.started_ns, res.finished_ns))
        if check and first is not None:
            raise first
        return out

    def _one_async(self, op: str, layer: int, kind: str, ch: int, token_start: int,
                   ntokens: int | None) -> concurrent.futures.Future[OpResult]:
        rng = [self.range(op, layer, kind, token_start, ntokens)]
        raw = self.channel(ch).submit_async(rng)
        out: concurrent.futures.Future[OpResult] = concurrent.futures.Future()

        def done(f: concurrent.futures.Future[list[RangeResult]]) -> None:
            exc = f.exception()
            if exc is not None:
                out.set_exception(exc)
                return
            try:
                out.set_result(self._results(ch, rng, f.result(), True)[0])
            except BladedError as e:
                out.set_exception(e)

        raw.add_done_callback(done)
        return out

    def write_async(self, layer: int, kind: str, ch: int, token_start: int = 0,
                    ntokens: int | None = None) -> concurrent.futures.Future[OpResult]:
        """Store tokens ``[token_start, token_start + ntokens)`` of KPU (layer, kind) from slot ``ch``."""
        return self._one_async("write", layer, kind, ch, token_start, ntokens)

    def read_async(self, layer: int, kind: str, ch: int, token_start: int = 0,
                   ntokens: int | None = None) -> concurrent.futures.Future[OpResult]:
        """Load tokens of KPU (layer, kind) into slot ``ch`` at the same offsets."""
        return self._one_async("read", layer, kind, ch, token_start, ntokens)

    def write(self, layer: int, kind: str, ch: int, token_start: int = 0, ntokens: int | None = None) -> OpResult:
        """Store tokens of KPU (layer, kind) from slot ``ch`` and wait (raises the BladedError on failure)."""
        return self.submit(ch, [self.range("write", layer, kind, token_start, ntokens)])[0]

    def read(self, layer: int, kind: str, ch: int, token_start: int = 0, ntokens: int | None = None) -> OpResult:
        """Load tokens of KPU (layer, kind) into slot ``ch`` and wait (raises the BladedError on failure)."""
        return self.submit(ch, [self.range("read", layer, kind, token_start, ntokens)])[0]

    def retain(self, tokens: Sequence[int], prefix: PrefixKey | None = None, *, close: bool = False) -> dict[str, Any]:
        """Keep the KV of the first whole token blocks of ``tokens`` (the token ids whose KV this session wrote, from
        token 0) as a retained prefix, under the model and dtype of ``prefix`` or of the key the session was
        opened with.  Returns ``{"session", "entry", "tokens", "new"}``.  With ``close`` the session ends with it
        (and the entry may take the session's page-cache budget); a retain that fails leaves the session open."""
        fields: dict[str, Any] = {"session": self.id, "tokens": [int(t) for t in tokens], "close": close}
        if prefix is not None:
            fields["prefix"] = {"model": prefix.model, "dtype": prefix.dtype}
        out = _strip(self.client.call_async("retain", **fields).result())
        if close:
            self._closed = True
            self.client._sessions.pop(self.id, None)
            for dc in self._data:
                if dc is not None:
                    dc.close()
            self._unmap()
        return out

    def close(self) -> None:
        """Free the session's extents (TRIM) and page-cache files; unmap the staging memory."""
        if self._closed:
            return
        self._closed = True
        self.client._sessions.pop(self.id, None)
        for dc in self._data:
            if dc is not None:
                dc.close()
        try:
            # no timeout: the requests in progress complete first, then the TRIM
            self.client.call_async("close_session", session=self.id).result()
        except (DaemonLostError, NoSuchSessionError):
            pass  # the daemon already tore it down
        finally:
            self._unmap()

    def _unmap(self) -> None:
        if self.pinned:
            # unregister while the pages are still mapped: the mapping goes right after
            self.pinned = False
            try:
                rc = cuda.host_unregister(_address(self._mapping))
            except Exception as e:  # CUDA already torn down (interpreter exit): the registration went with it
                log.debug("cudaHostUnregister of the staging memory: %s", e)
            else:
                if rc != 0:
                    log.warning("cudaHostUnregister of the staging memory failed (%s)", rc)
        self._view.release()
        try:
            self._mapping.close()
        except BufferError:
            log.debug("staging views still exported; the mapping is freed when they are released")

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _address(mapping: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(mapping))
