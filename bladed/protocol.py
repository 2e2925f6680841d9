"""The wire format between ``bladed`` and its clients (see ``docs/protocol.md``).

A connection is a Unix stream socket carrying *frames*.  Each frame is an
8-byte header followed by a body::

    offset 0  2 bytes  magic b"BD"
    offset 2  u8       frame format: JSON_FORMAT (1) or IO_FORMAT (2)
    offset 3  u8       flags (0; reserved)
    offset 4  u32 LE   body length in bytes (at most MAX_FRAME_BYTES)
    offset 8  ...      body: a UTF-8 JSON object, or a binary I/O request/reply

File descriptors (the client's staging memfd) ride along as ``SCM_RIGHTS``
ancillary data on the first byte of the frame that needs them.  Every
request carries an ``op`` and a client-chosen integer ``id``; every reply
carries the same ``id`` and ``ok``.  The first request on a connection must
be ``hello``, which fixes the protocol version.

The *control* connection speaks JSON.  Each copy thread of a client has a
*data* connection of its own for one channel of a session (``attach``); after
the attach it carries only binary I/O frames: one request names many KPU
token ranges (a batch), one reply answers each of them (:class:`IORange`,
:class:`RangeResult`), and the daemon serves them on that connection's own
thread, with no queue between.

Shared by the server and the client; imports nothing from either.  The binary layouts and codes (the
WIRE-LAYOUT section below) are the only definition of those bytes: the C extensions are compiled from them.
The frames go through ``bladed._wire``, which needs no liburing, so a client process never loads it.
"""

from __future__ import annotations

import array
import builtins
import contextlib
import enum
import itertools
import json
import os
import socket
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

from bladed._wire import ffi, lib

#: version of the request/reply vocabulary; bumped on any incompatible change
#: (2: data connections with binary batched I/O frames, ``attach``; 3: descriptive reply field names
#: instead of the paper's symbols, and the daemon sizes an empty staging memfd itself; 4: prefix reuse;
#: 5: block pools, ``open_blocks`` and ``blocks``; 6: a request may name a KPU more than once, its ranges' tokens
#: apart: a sparse read's runs of pages in one request)
PROTOCOL_VERSION = 6
#: oldest client protocol this build still serves
MIN_PROTOCOL_VERSION = 4
#: largest body accepted in either direction; larger frames close the connection
MAX_FRAME_BYTES = 1 << 20
#: most descriptors accepted with one frame
MAX_FDS = 4
#: integers on the wire are 64-bit signed, so that every client language can hold them
INT_MIN = -(1 << 63)
INT_MAX = (1 << 63) - 1


# -- the binary layouts and codes: WIRE-LAYOUT-BEGIN ---------------------------------------------------------
# The one definition of the wire's bytes for both sides.  At build time cffi_build/wire_layout.py runs this
# section by itself (so it may use only ``struct``, ``enum`` and ``zlib``, and nothing defined outside it) and
# writes it as the C header the extensions are compiled with: each *_FIELDS record as a packed
# ``struct bd_<name>``, each WIRE_CODES entry as ``BD_<NAME>``.  Edit here, then rebuild (pip install -e .).
WireField = tuple[str, str]  # (name, struct code); "" names padding


def _record(fields: tuple[WireField, ...]) -> struct.Struct:
    """The little-endian struct of ``fields``, packed (no alignment): the C side declares it packed too."""
    return struct.Struct("<" + "".join(code for _, code in fields))


MAGIC = b"BD"
#: frame formats: the body is JSON, or a binary I/O request/reply (data connections)
JSON_FORMAT = 1
IO_FORMAT = 2
HEADER_FIELDS: tuple[WireField, ...] = (("magic", "2s"), ("format", "B"), ("flags", "B"), ("length", "I"))
HEADER = _record(HEADER_FIELDS)


class IOOp(enum.IntEnum):
    """What one range of an I/O request does."""

    WRITE = 1    # slot -> store
    READ = 2     # store -> slot


#: ``slot_offset`` for "where the KPU has it": ``token_start * token_bytes`` (the slot mirrors one KPU)
MIRROR = (1 << 64) - 1
#: request body: request id, number of ranges, flags (0)
IO_REQUEST_FIELDS: tuple[WireField, ...] = (("request_id", "Q"), ("nranges", "H"), ("flags", "H"))
IO_REQUEST = _record(IO_REQUEST_FIELDS)
#: one range: op, tensor id, first token, tokens, byte offset in the channel's staging slot (IORange's fields)
IO_RANGE_FIELDS: tuple[WireField, ...] = (("op", "B"), ("", "3x"), ("tensor_id", "I"), ("token_start", "I"),
                                          ("ntokens", "I"), ("slot_offset", "Q"))
IO_RANGE = _record(IO_RANGE_FIELDS)
#: reply body: request id, status (SERVED: see each result; else 1 + error index: refused whole), results
IO_REPLY_FIELDS: tuple[WireField, ...] = (("request_id", "Q"), ("status", "B"), ("", "x"), ("nresults", "H"))
IO_REPLY = _record(IO_REPLY_FIELDS)
#: one range's result: status (SERVED, else 1 + error index), path (PATH_CODES), bytes, service ns, resident
#: bytes of a page-cache read (``NO_HIT`` otherwise), started/finished ns
IO_RESULT_FIELDS: tuple[WireField, ...] = (("status", "B"), ("path", "B"), ("", "6x"), ("nbytes", "Q"),
                                           ("service_ns", "Q"), ("hit_bytes", "Q"), ("started_ns", "Q"),
                                           ("finished_ns", "Q"))
IO_RESULT = _record(IO_RESULT_FIELDS)
#: the status of a served request and of a range that succeeded
SERVED = 0
#: ``hit_bytes`` of a range that is not a page-cache read
NO_HIT = (1 << 64) - 1
#: a result's ``path``
PATH_CODES = {None: 0, "pagecache": 1, "direct": 2}

#: what the C side is compiled with
WIRE_RECORDS: dict[str, tuple[WireField, ...]] = {
    "frame_header": HEADER_FIELDS, "io_request": IO_REQUEST_FIELDS, "io_range": IO_RANGE_FIELDS,
    "io_reply": IO_REPLY_FIELDS, "io_result": IO_RESULT_FIELDS}
WIRE_CODES: dict[str, int] = {
    "MAGIC_LE16": int.from_bytes(MAGIC, "little"), "JSON_FORMAT": JSON_FORMAT, "IO_FORMAT": IO_FORMAT,
    "WIRE_OP_WRITE": IOOp.WRITE.value, "WIRE_OP_READ": IOOp.READ.value, "MIRROR": MIRROR, "STATUS_SERVED": SERVED,
    "NO_HIT": NO_HIT, **{f"WIRE_PATH_{(name or 'none').upper()}": code for name, code in PATH_CODES.items()}}
#: a digest of the layout: the extension carries the one it was built from (``BD_WIRE_LAYOUT_ID``)
WIRE_LAYOUT_ID = zlib.crc32(repr((MAGIC, sorted(WIRE_RECORDS.items()), sorted(WIRE_CODES.items()))).encode())
# WIRE-LAYOUT-END ------------------------------------------------------------------------------------------

if lib.BD_WIRE_LAYOUT_ID != WIRE_LAYOUT_ID:   # an editable install whose C was not rebuilt after an edit above
    raise ImportError("bladed._wire was built from another wire layout than bladed/protocol.py's; rebuild the "
                      "extensions (pip install -e .)")

#: the format of the frames ``encode`` makes
FRAME_FORMAT = JSON_FORMAT

#: the JSON requests (docs/protocol.md has one section per op)
OPS = (
    "hello", "open_session", "close_session", "attach", "write", "read",
    "status", "sessions", "stats", "budget", "trim", "retain", "prefixes", "evict_prefixes", "wear",
    "open_blocks", "blocks",
)


class ErrorCode(enum.StrEnum):
    """Machine-readable ``error.code`` of a failed reply."""

    BAD_FRAME = "bad_frame"                      # framing broken: connection closed after the reply
    BAD_REQUEST = "bad_request"                  # a field is missing, of the wrong type or out of range
    UNKNOWN_OP = "unknown_op"
    HANDSHAKE_REQUIRED = "handshake_required"    # first request was not hello: connection closed
    INCOMPATIBLE_PROTOCOL = "incompatible_protocol"  # connection closed
    PERMISSION_DENIED = "permission_denied"
    NO_SUCH_SESSION = "no_such_session"          # unknown id, or a session of another connection
    OUT_OF_RANGE = "out_of_range"                # layer / kind / channel / token range outside the session
    QUOTA_EXCEEDED = "quota_exceeded"
    NO_SPACE = "no_space"                        # the region has no extent large enough
    BUSY = "busy"                                # too many outstanding requests, or sessions open (trim)
    IO_ERROR = "io_error"                        # the device or the page-cache file failed
    INTEGRITY_ERROR = "integrity_error"          # a read's crc32c differs from what was written (checksums on)
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"
    NO_MEMORY = "no_memory"                      # the daemon's memory (its cgroup's limit) cannot hold the staging
    WRITE_BUDGET_EXHAUSTED = "write_budget_exhausted"  # today's direct-path writes reached io.write_budget


# -- exceptions (raised by the client) ------------------------------------------
class BladedError(Exception):
    """Base class of every error the client library raises."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


#: The one table of error codes and the exceptions the client raises for them (docs/protocol.md, "Error
#: codes"): exception, what else it is (a builtin exception, or one above it in this table), the codes it
#: is raised for (the first is its ``code``), what it means.  ``internal`` (and any code this client does
#: not know) raises BladedError itself.
ERRORS: tuple[tuple[str, str, tuple[ErrorCode, ...], str], ...] = (
    ("ProtocolError", "", (ErrorCode.BAD_FRAME, ErrorCode.HANDSHAKE_REQUIRED),
     "The peer broke the wire format (bad frame, bad JSON, unexpected reply)."),
    ("IncompatibleProtocolError", "", (ErrorCode.INCOMPATIBLE_PROTOCOL,),
     "The daemon and the client speak different protocol versions."),
    ("PermissionDeniedError", "PermissionError", (ErrorCode.PERMISSION_DENIED,),
     "The peer's uid/gid is not allowed, or the op needs an admin."),
    ("NoSuchSessionError", "", (ErrorCode.NO_SUCH_SESSION,),
     "The session is unknown, closing, or belongs to another connection."),
    ("BadRequestError", "ValueError", (ErrorCode.BAD_REQUEST, ErrorCode.UNKNOWN_OP),
     "A request field was missing, mistyped or out of range, or the op is unknown."),
    ("OutOfRangeError", "BadRequestError", (ErrorCode.OUT_OF_RANGE,),
     "A layer, kind, channel, token range or slot bytes outside the session."),
    ("QuotaExceededError", "", (ErrorCode.QUOTA_EXCEEDED,),
     "The uid's sessions would hold more than its quota."),
    ("NoSpaceError", "", (ErrorCode.NO_SPACE,), "The region has no contiguous run large enough."),
    ("BusyError", "", (ErrorCode.BUSY,),
     "Too many requests, sessions or connections at once, or sessions open (trim)."),
    ("RemoteIOError", "OSError", (ErrorCode.IO_ERROR,),
     "The daemon's device or page-cache I/O failed for this request."),
    ("IntegrityError", "", (ErrorCode.INTEGRITY_ERROR,),
     "A read returned data whose crc32c differs from what was written (session checksums on)."),
    ("ShuttingDownError", "", (ErrorCode.SHUTTING_DOWN,), "The daemon is draining."),
    ("NoMemoryError", "", (ErrorCode.NO_MEMORY,),
     "The daemon's memory (its memory cgroup's limit) cannot hold the session's staging."),
    ("WriteBudgetExhaustedError", "", (ErrorCode.WRITE_BUDGET_EXHAUSTED,),
     "Today's direct-path writes reached io.write_budget: a new spill to the device is refused until 00:00 UTC."),
)


def _exception_classes() -> tuple[dict[str, type[BladedError]], dict[ErrorCode, type[BladedError]]]:
    """The classes of :data:`ERRORS`, by name and by code."""
    by_name: dict[str, type[BladedError]] = {}
    by_code: dict[ErrorCode, type[BladedError]] = {ErrorCode.INTERNAL: BladedError}
    for name, also, codes, doc in ERRORS:
        bases: tuple[type[Exception], ...] = (
            (by_name[also],) if also in by_name else (BladedError, getattr(builtins, also)) if also else (BladedError,))
        cls = cast("type[BladedError]", type(name, bases, {"__doc__": doc, "__module__": __name__,
                                                            "__qualname__": name, "code": codes[0]}))
        by_name[name] = cls
        by_code.update(dict.fromkeys(codes, cls))
    if set(by_code) != set(ErrorCode):
        raise RuntimeError(f"protocol.ERRORS misses {sorted(set(ErrorCode) - set(by_code))}")  # a bug, at import
    return by_name, by_code


_CLASSES, _BY_CODE = _exception_classes()
# the names users import and catch (``except NoSuchSessionError``), one per row of ERRORS
ProtocolError = _CLASSES["ProtocolError"]
IncompatibleProtocolError = _CLASSES["IncompatibleProtocolError"]
PermissionDeniedError = _CLASSES["PermissionDeniedError"]
NoSuchSessionError = _CLASSES["NoSuchSessionError"]
BadRequestError = _CLASSES["BadRequestError"]
OutOfRangeError = _CLASSES["OutOfRangeError"]
QuotaExceededError = _CLASSES["QuotaExceededError"]
NoSpaceError = _CLASSES["NoSpaceError"]
BusyError = _CLASSES["BusyError"]
RemoteIOError = _CLASSES["RemoteIOError"]
IntegrityError = _CLASSES["IntegrityError"]
ShuttingDownError = _CLASSES["ShuttingDownError"]
NoMemoryError = _CLASSES["NoMemoryError"]
WriteBudgetExhaustedError = _CLASSES["WriteBudgetExhaustedError"]


class DaemonLostError(BladedError, ConnectionError):
    """The connection to bladed broke (daemon stopped, crashed or restarted); no error code sent it."""

    code = ErrorCode.SHUTTING_DOWN


def error_for(code: ErrorCode, message: str) -> BladedError:
    """The exception the client raises for ``code`` (its row of :data:`ERRORS`)."""
    return _BY_CODE[code](message, code)


def error_from_reply(reply: dict[str, Any]) -> BladedError:
    """The exception for a reply with ``ok: false``."""
    raw_err = reply.get("error")
    err: dict[str, Any] = raw_err if isinstance(raw_err, dict) else {}
    raw = str(err.get("code", "internal"))
    message = str(err.get("message", "request failed"))
    try:
        code = ErrorCode(raw)
    except ValueError:
        return BladedError(f"{message} [{raw}]")
    return error_for(code, message)


class RequestError(Exception):
    """Raised inside the daemon to turn into an error reply."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# -- frames ------------------------------------------------------------------
class FrameError(Exception):
    """The byte stream is not a valid frame sequence: the connection cannot continue."""


class FrameTooLargeError(ValueError):
    """A body to send encodes to more than MAX_FRAME_BYTES (nothing was sent)."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(f"frame of {nbytes} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
        self.nbytes = nbytes


class ConnectionClosed(Exception):
    """The peer closed the connection at a frame boundary."""


@dataclass
class Frame:
    """One received frame: its decoded body and any descriptors that came with it."""

    body: dict[str, Any]
    fds: list[int] = field(default_factory=list)

    def close_fds(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()


def encode(body: dict[str, Any]) -> bytes:
    """Header + compact JSON for ``body``."""
    data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    if len(data) > MAX_FRAME_BYTES:
        raise FrameTooLargeError(len(data))
    return HEADER.pack(MAGIC, FRAME_FORMAT, 0, len(data)) + data


def send_frame(sock: socket.socket, body: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """Send one frame (and ``fds`` as SCM_RIGHTS with its first byte)."""
    data = encode(body)
    if fds:
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        data = data[sent:]
    if data:
        sock.sendall(data)


class FrameReader:
    """Reads frames from a stream socket, collecting passed descriptors."""

    def __init__(self, sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES) -> None:
        self.sock = sock
        self.max_bytes = max_bytes
        self._fds: list[int] = []
        self._anc = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)

    def _recv_exact(self, n: int, *, at_boundary: bool) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            nbytes, anc, flags, _ = self.sock.recvmsg_into([view[got:]], self._anc, socket.MSG_CMSG_CLOEXEC)
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
                    self._fds.extend(fds)
            if flags & socket.MSG_CTRUNC:
                self._drop_fds()
                raise FrameError(f"more than {MAX_FDS} descriptors passed with one frame")
            if nbytes == 0:
                if got == 0 and at_boundary:
                    raise ConnectionClosed()
                raise FrameError(f"connection closed in the middle of a frame ({got} of {n} bytes)")
            got += nbytes
        return bytes(buf)

    def _drop_fds(self) -> None:
        Frame({}, self._fds).close_fds()
        self._fds = []

    def read(self) -> Frame:
        """The next frame; raises ConnectionClosed at EOF, FrameError on garbage."""
        head = self._recv_exact(HEADER.size, at_boundary=True)
        magic, fmt, _flags, length = HEADER.unpack(head)
        try:
            if magic != MAGIC:
                raise FrameError(f"bad frame magic {magic!r} (not a bladed client?)")
            if fmt == IO_FORMAT:
                raise FrameError("a binary I/O frame on a control connection (attach a data connection first)")
            if fmt != JSON_FORMAT:
                raise FrameError(f"frame format {fmt} not supported (this side speaks {JSON_FORMAT} and {IO_FORMAT})")
            if length > self.max_bytes:
                raise FrameError(f"frame of {length} bytes exceeds the {self.max_bytes}-byte limit")
            raw = self._recv_exact(length, at_boundary=False)
        except BaseException:
            self._drop_fds()
            raise
        fds, self._fds = self._fds, []
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:
            Frame({}, fds).close_fds()
            raise BadBody(f"frame body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            Frame({}, fds).close_fds()
            raise BadBody(f"frame body must be a JSON object, got {type(body).__name__}")
        return Frame(body, fds)


class BadBody(Exception):
    """A well-framed message whose body is not a JSON object (the stream is still in sync)."""


# -- binary I/O frames (data connections) --------------------------------------
#: one served range as the daemon's general path counts it: bytes, service ns, resident bytes of a page-cache read
#: (``NO_HIT`` otherwise), started ns, finished ns (an IO_RESULT without its status and path)
ServedRow = tuple[int, int, int, int, int]
#: most ranges in one request: a request and its reply (with messages) always fit a frame
MAX_RANGES = 4096
#: longest message carried per failed range in a binary reply
MAX_RANGE_MESSAGE = 160
_ERROR_INDEX = {code: i for i, code in enumerate(ErrorCode)}
_ERROR_BY_INDEX = tuple(ErrorCode)
_PATH_CODES = PATH_CODES
_PATH_NAMES = tuple(sorted(PATH_CODES, key=lambda name: PATH_CODES[name]))
_U16 = struct.Struct("<H")
_IO_OPS = {int(op): op for op in IOOp}
# the frame header and a request's head in one pack (the client's hot path)
_IO_REQUEST_HEAD = struct.Struct(HEADER.format + IO_REQUEST.format[1:])


class IORange(NamedTuple):
    """Tokens ``[token_start, token_start + ntokens)`` of tensor ``tensor_id`` <-> the channel's slot.

    ``slot_offset`` is where the range's first token sits in the slot; the default
    (``MIRROR``) puts token ``t`` at ``t * token_bytes``, as the KPU has it.
    """

    op: IOOp
    tensor_id: int
    token_start: int
    ntokens: int
    slot_offset: int = MIRROR


@dataclass(slots=True)
class RangeResult:
    """What happened to one range of an I/O request."""

    error: ErrorCode | None = None    # None: served
    message: str = ""
    path: str | None = None           # "pagecache" | "direct"
    nbytes: int = 0
    service_ns: int = 0
    hit_bytes: int | None = None      # page-cache reads: bytes that were already resident
    started_ns: int = 0
    finished_ns: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None


def _frame(fmt: int, body: bytes) -> bytes:
    if len(body) > MAX_FRAME_BYTES:
        raise FrameTooLargeError(len(body))
    return HEADER.pack(MAGIC, fmt, 0, len(body)) + body


def encode_io_request(req_id: int, ranges: Sequence[IORange]) -> bytes:
    """A whole binary I/O request frame (header included)."""
    if not 1 <= len(ranges) <= MAX_RANGES:
        raise ValueError(f"an I/O request carries 1..{MAX_RANGES} ranges, got {len(ranges)}")
    n = len(ranges)
    # MAX_RANGES keeps the frame under MAX_FRAME_BYTES; an IORange's fields are IO_RANGE's, in its order
    return _IO_REQUEST_HEAD.pack(MAGIC, IO_FORMAT, 0, IO_REQUEST.size + n * IO_RANGE.size, req_id, n, 0) + \
        b"".join(itertools.starmap(IO_RANGE.pack, ranges))


def decode_io_request(body: bytes | memoryview) -> tuple[int, list[IORange]]:
    """``(request id, ranges)`` of a binary I/O request body; RequestError(BAD_REQUEST) if malformed."""
    if len(body) < IO_REQUEST.size:
        raise RequestError(ErrorCode.BAD_REQUEST, f"I/O request of {len(body)} bytes is shorter than its "
                                                  f"{IO_REQUEST.size}-byte head")
    req_id, n, flags = IO_REQUEST.unpack_from(body)
    if flags:
        raise RequestError(ErrorCode.BAD_REQUEST, f"I/O request flags must be 0, got {flags:#x}")
    if not 1 <= n <= MAX_RANGES:
        raise RequestError(ErrorCode.BAD_REQUEST, f"an I/O request carries 1..{MAX_RANGES} ranges, got {n}")
    if len(body) != IO_REQUEST.size + n * IO_RANGE.size:
        raise RequestError(ErrorCode.BAD_REQUEST, f"I/O request of {n} ranges must be "
                                                  f"{IO_REQUEST.size + n * IO_RANGE.size} bytes, got {len(body)}")
    out = []
    ops = _IO_OPS
    for i, (op, tid, t0, nt, so) in enumerate(IO_RANGE.iter_unpack(memoryview(body)[IO_REQUEST.size:])):
        kind = ops.get(op)
        if kind is None:
            raise RequestError(ErrorCode.BAD_REQUEST, f"range {i}: op must be 1 (write) or 2 (read), got {op}")
        out.append(IORange(kind, tid, t0, nt, so))
    return req_id, out


def encode_io_reply(req_id: int, results: Sequence[RangeResult]) -> bytes:
    """A whole binary I/O reply frame: one result per range, then the messages of the failed ones."""
    parts = [IO_REPLY.pack(req_id, SERVED, len(results))]
    messages = []
    for r in results:
        status = SERVED if r.error is None else 1 + _ERROR_INDEX[r.error]
        parts.append(IO_RESULT.pack(status, _PATH_CODES[r.path], r.nbytes, r.service_ns,
                                    NO_HIT if r.hit_bytes is None else r.hit_bytes, r.started_ns, r.finished_ns))
        if status:
            text = clip(r.message, MAX_RANGE_MESSAGE).encode()
            messages.append(_U16.pack(len(text)) + text)
    return _frame(IO_FORMAT, b"".join(parts + messages))


def encode_io_refusal(req_id: int, code: ErrorCode, message: str) -> bytes:
    """A reply refusing a whole I/O request (nothing of it was done)."""
    text = clip(message).encode()
    return _frame(IO_FORMAT, IO_REPLY.pack(req_id, 1 + _ERROR_INDEX[code], 0) + _U16.pack(len(text)) + text)


def decode_io_reply(body: bytes | memoryview) -> tuple[int, ErrorCode | None, str, list[RangeResult]]:
    """``(request id, refusal code or None, refusal message, results)`` of a binary I/O reply."""
    try:
        req_id, status, n = IO_REPLY.unpack_from(body)
        pos = IO_REPLY.size
        if status:
            (length,) = _U16.unpack_from(body, pos)
            text = bytes(body[pos + 2:pos + 2 + length]).decode()
            return req_id, _ERROR_BY_INDEX[status - 1], text, []
        results = []
        for _ in range(n):
            st, path, nbytes, ns, hit, t0, t1 = IO_RESULT.unpack_from(body, pos)
            pos += IO_RESULT.size
            results.append(RangeResult(None if st == SERVED else _ERROR_BY_INDEX[st - 1], "", _PATH_NAMES[path],
                                       nbytes, ns, None if hit == NO_HIT else hit, t0, t1))
        for r in results:
            if r.error is not None:
                (length,) = _U16.unpack_from(body, pos)
                r.message = bytes(body[pos + 2:pos + 2 + length]).decode()
                pos += 2 + length
    except (struct.error, IndexError, UnicodeDecodeError) as e:
        raise FrameError(f"malformed I/O reply: {e}") from None
    return req_id, None, "", results


class FrameStream:
    """Frame reads on a data connection, in C (``bladed._wire``, ``cffi_build/bladed_wire.c``: no liburing): one
    ``recv`` per frame when the peer sent it in one piece.

    Bytes that arrive beyond the current frame (a pipelined request) stay in
    the buffer for the next :meth:`read`.  No descriptors on these connections.
    The daemon's lane reads through the same C stream (``into``: the ``struct bd_stream`` inside its
    ``struct bd_lane``; ``bladed._uring`` includes ``bladed._wire``'s declarations, so the types are one).
    """

    def __init__(self, sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES, *, into: Any = None) -> None:
        self.sock = sock
        self.max_bytes = max_bytes
        self._mem = ffi.new("uint8_t[]", HEADER.size + max_bytes)
        self._view = memoryview(ffi.buffer(self._mem))
        # the buffer holds the largest frame: a pipelined request never waits for it to grow
        self.c = into if into is not None else ffi.new("struct bd_stream *")
        c = self.c
        c.fd = sock.fileno()
        c.max_bytes = max_bytes
        c.buf = self._mem
        c.cap = HEADER.size + max_bytes

    def _timeout_ms(self) -> int:
        t = self.sock.gettimeout()
        return -1 if t is None else max(0, round(t * 1000))

    def send(self, data: bytes) -> None:
        """Send a whole frame (in C: no Python between the pieces of a short write)."""
        r = lib.bd_send_all(self.c.fd, data, len(data))
        if r:
            raise OSError(-r, os.strerror(-r))

    def read(self) -> tuple[int, memoryview]:
        """``(format, body)`` of the next frame; the body view is valid until the next read."""
        r = lib.bd_stream_read(self.c, self._timeout_ms())
        if r:
            raise self.error(r)
        return self.frame()

    def frame(self) -> tuple[int, memoryview]:
        """``(format, body)`` of the frame last read."""
        c = self.c
        at = c.at
        return c.fmt, self._view[at:at + c.len]

    def error(self, r: int) -> Exception:
        """The exception for a negative return of the C stream."""
        detail = self.c.detail
        if r == -lib.BD_STREAM_CLOSED:
            return ConnectionClosed()
        if r == -lib.BD_STREAM_TRUNCATED:
            return FrameError(f"connection closed in the middle of a frame ({detail} bytes)")
        if r == -lib.BD_STREAM_BAD_MAGIC:
            return FrameError(f"bad frame magic {detail.to_bytes(2, 'little')!r} (not a bladed peer?)")
        if r == -lib.BD_STREAM_BAD_FORMAT:
            return FrameError(f"frame format {detail} not supported (this side speaks {JSON_FORMAT} and "
                              f"{IO_FORMAT})")
        if r == -lib.BD_STREAM_TOO_LARGE:
            return FrameError(f"frame of {detail} bytes exceeds the {self.max_bytes}-byte limit")
        if r == -lib.BD_STREAM_TIMEOUT:
            return TimeoutError("timed out")
        return OSError(-r, os.strerror(-r))


# -- request field checking ---------------------------------------------------
_MISSING: Any = object()


_JSON_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "an object",
               list: "an array"}


def shown(value: Any, limit: int = 64) -> str:
    """``value`` as the JSON the client sent, cut to ``limit`` characters (for error messages)."""
    try:
        text = json.dumps(value)
    except ValueError:  # an int past Python's digit limit cannot come from the parser; be safe anyway
        text = type(value).__name__
    return clip(text, limit)


def get_field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], *, default: Any = _MISSING,
              minimum: Any = None, maximum: Any = None,
              choices: Sequence[Any] | None = None, prefix: str = "") -> Any:
    """A typed field of a request, or RequestError(BAD_REQUEST) naming the field, the value and what was expected.

    The one place request fields are checked: JSON ``true``/``false`` is not an
    integer, and an integer outside ``INT_MIN..INT_MAX`` is refused even without
    ``minimum``/``maximum``.  ``prefix`` names the enclosing object in messages
    (``"geometry."``).
    """
    label = f"{prefix}{name}"
    if name not in body or body[name] is None:
        if default is _MISSING:
            raise RequestError(ErrorCode.BAD_REQUEST, f"missing field {label!r}")
        return default
    value = body[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int in Python; JSON true is not a number
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        names = " or ".join(_JSON_NAMES.get(k, k.__name__) for k in kinds)
        raise RequestError(ErrorCode.BAD_REQUEST, f"field {label!r} must be {names}, got {shown(value)}")
    if isinstance(value, int) and not isinstance(value, bool):
        minimum = INT_MIN if minimum is None else minimum
        maximum = INT_MAX if maximum is None else maximum
    if minimum is not None and value < minimum:
        raise RequestError(ErrorCode.BAD_REQUEST, f"field {label!r} must be >= {minimum}, got {shown(value)}")
    if maximum is not None and value > maximum:
        raise RequestError(ErrorCode.BAD_REQUEST, f"field {label!r} must be <= {maximum}, got {shown(value)}")
    if choices is not None and value not in choices:
        raise RequestError(ErrorCode.BAD_REQUEST,
                           f"field {label!r} must be one of {', '.join(map(str, choices))}, got {shown(value)}")
    return value


def request_id(body: dict[str, Any]) -> int | None:
    """The request's ``id`` when it is a valid one (to echo in the reply), else None."""
    value = body.get("id")
    if isinstance(value, int) and not isinstance(value, bool) and INT_MIN <= value <= INT_MAX:
        return value
    return None


def ok_reply(req_id: Any, **fields: Any) -> dict[str, Any]:
    return {"id": req_id, "ok": True, **fields}


#: longest error message sent; hostile values echoed in a message are cut, so a reply always fits a frame
MAX_ERROR_MESSAGE = 1024


def clip(text: str, limit: int = MAX_ERROR_MESSAGE) -> str:
    """``text``, cut in the middle with ``...`` when longer than ``limit`` characters."""
    if len(text) <= limit:
        return text
    head = limit * 3 // 4
    return f"{text[:head]}...{text[len(text) - (limit - head - 3):]}"


def error_reply(req_id: Any, code: ErrorCode, message: str) -> dict[str, Any]:
    return {"id": req_id, "ok": False, "error": {"code": code.value, "message": clip(message)}}


def hello_request(req_id: int, client: str) -> dict[str, Any]:
    return {"op": "hello", "id": req_id, "protocol": PROTOCOL_VERSION, "client": client}
