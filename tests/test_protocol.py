"""The wire format, and a real daemon fed malformed, oversized and out-of-order
input: every case gets an error reply or a closed connection, the daemon
keeps serving, and no worker is left stuck."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import socket
import struct
import threading
from collections.abc import Iterator

import pytest
from daemon_util import DaemonProcess, short_tmpdir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bladed import client as client_mod
from bladed.client import Client
from bladed.protocol import (
    HEADER,
    INT_MAX,
    INT_MIN,
    MAGIC,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    BadBody,
    BladedError,
    BusyError,
    ConnectionClosed,
    ErrorCode,
    Frame,
    FrameError,
    FrameReader,
    FrameTooLargeError,
    IncompatibleProtocolError,
    RequestError,
    encode,
    error_for,
    error_from_reply,
    get_field,
    hello_request,
    ok_reply,
    request_id,
    send_frame,
)
from bladed.residency.budget import BudgetBreakdown
from bladed.residency.geometry import Geometry
from bladed.residency.planner import plan_session
from bladed.server.events import Peer
from bladed.server.metrics import Stats
from bladed.server.sessions.rules import MAX_LAYERS
from bladed.server.sessions.session import ServedSession
from bladed.server.wire.connection import Connection

GEOMETRY = {"layers": 2, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 8}
SLOT = 8 * 4096


# -- the format itself ------------------------------------------------------------------
def test_frames_round_trip_with_descriptors() -> None:
    a, b = socket.socketpair()
    r, w = os.pipe()
    try:
        send_frame(a, {"op": "status", "id": 7, "text": "é" * 1000})
        send_frame(a, {"op": "x", "id": 8}, [r])
        reader = FrameReader(b)
        f1 = reader.read()
        assert f1.body == {"op": "status", "id": 7, "text": "é" * 1000} and f1.fds == []
        f2 = reader.read()
        assert f2.body["id"] == 8 and len(f2.fds) == 1
        os.write(w, b"hi")
        assert os.read(f2.fds[0], 2) == b"hi"  # the passed descriptor is the same pipe
        f2.close_fds()
        a.close()
        with pytest.raises(ConnectionClosed):
            reader.read()
    finally:
        for fd in (r, w):
            os.close(fd)
        b.close()


def test_reader_rejects_bad_frames() -> None:
    cases = [
        (b"XX" + bytes(6), "magic"),
        (HEADER.pack(MAGIC, 9, 0, 2) + b"{}", "format 9"),
        (HEADER.pack(MAGIC, 1, 0, MAX_FRAME_BYTES + 1), "exceeds"),
        (HEADER.pack(MAGIC, 1, 0, 10) + b"{}", "middle of a frame"),
    ]
    for raw, why in cases:
        a, b = socket.socketpair()
        a.sendall(raw)
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(FrameError, match=why):
            FrameReader(b).read()
        a.close()
        b.close()
    a, b = socket.socketpair()
    a.sendall(HEADER.pack(MAGIC, 1, 0, 3) + b"[1]" + HEADER.pack(MAGIC, 1, 0, 2) + b"{}")
    reader = FrameReader(b)
    with pytest.raises(BadBody, match="JSON object"):
        reader.read()
    assert reader.read().body == {}  # a bad body does not desynchronise the stream
    a.close()
    b.close()


def test_every_error_code_raises_its_exception_and_the_relations_hold() -> None:
    """The classes made from protocol.ERRORS keep the relations users catch by."""
    from bladed import protocol

    for code in ErrorCode:
        err = error_for(code, "m")
        assert isinstance(err, BladedError) and err.code is code and str(err) == "m"
    assert type(error_for(ErrorCode.INTERNAL, "m")) is BladedError
    assert type(error_for(ErrorCode.UNKNOWN_OP, "m")) is protocol.BadRequestError
    assert type(error_for(ErrorCode.HANDSHAKE_REQUIRED, "m")) is protocol.ProtocolError
    assert issubclass(protocol.OutOfRangeError, protocol.BadRequestError)
    assert issubclass(protocol.BadRequestError, ValueError)
    assert issubclass(protocol.PermissionDeniedError, PermissionError)
    assert issubclass(protocol.RemoteIOError, OSError)
    assert issubclass(protocol.DaemonLostError, ConnectionError)
    assert protocol.NoSuchSessionError.code is ErrorCode.NO_SUCH_SESSION
    assert protocol.NoSuchSessionError.__module__ == "bladed.protocol"
    assert {name for name, _, _, _ in protocol.ERRORS} <= set(vars(protocol))   # each importable by its name


def test_field_checks_and_error_mapping() -> None:
    body = {"n": 3, "flag": True, "s": "x", "f": 1.0, "big": INT_MAX + 1, "low": INT_MIN, "junk": {"a": [1, {}]}}
    assert get_field(body, "n", int, minimum=0, maximum=3) == 3
    assert get_field(body, "missing", int, default=5) == 5
    assert get_field(body, "low", int) == INT_MIN
    assert get_field(body, "flag", bool) is True
    for name, kind, kw, msg in [
        ("missing", int, {}, "missing field 'missing'"),
        ("missing", int, {"prefix": "geometry."}, "missing field 'geometry.missing'"),
        ("flag", int, {}, "field 'flag' must be an integer, got true"),
        ("f", int, {}, "field 'f' must be an integer, got 1.0"),
        ("n", bool, {}, "field 'n' must be a boolean, got 3"),
        ("junk", str, {}, """field 'junk' must be a string, got {"a": [1, {}]}"""),
        ("s", dict, {"prefix": "x."}, "field 'x.s' must be an object, got \"x\""),
        ("n", int, {"maximum": 2}, "field 'n' must be <= 2, got 3"),
        ("big", int, {}, f"field 'big' must be <= {INT_MAX}, got {INT_MAX + 1}"),
        ("s", str, {"choices": ["k"]}, "field 's' must be one of k, got \"x\""),
    ]:
        with pytest.raises(RequestError) as info:
            get_field(body, name, kind, **kw)
        assert info.value.code is ErrorCode.BAD_REQUEST and info.value.message == msg
    # a hostile value is cut in the message, so the message stays one short line
    with pytest.raises(RequestError) as info:
        get_field({"op": ["x" * 10_000]}, "op", str)
    assert len(info.value.message) < 120 and "..." in info.value.message
    assert [request_id(b) for b in ({"id": 7}, {"id": True}, {"id": 1.0}, {"id": INT_MAX + 1}, {})] == [7] + [None] * 4
    err = error_from_reply({"ok": False, "error": {"code": "busy", "message": "slow down"}})
    assert isinstance(err, BusyError) and str(err) == "slow down" and err.code is ErrorCode.BUSY
    assert "weird" in str(error_from_reply({"ok": False, "error": {"code": "weird", "message": "m"}}))
    with pytest.raises(FrameTooLargeError, match="limit") as too_big:
        encode({"x": "y" * MAX_FRAME_BYTES})
    assert too_big.value.nbytes == MAX_FRAME_BYTES + 8  # {"x":"..."} around the padding


# -- against a running daemon ------------------------------------------------------------------
@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with short_tmpdir() as tmp:
        cfg = {"io": {"max_outstanding": 2, "send_timeout_s": 0.5, "max_staging_bytes": 4 * SLOT},
               "budget": {"override": 0}}
        with DaemonProcess(tmp, cfg).start() as d:
            yield d
            assert d.proc is not None and d.proc.poll() is None, "bladed died during the protocol tests"


class Raw:
    """A bare connection speaking frames by hand."""

    def __init__(self, path: str, greet: bool = True) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(20)
        self.sock.connect(path)
        self.reader = FrameReader(self.sock)
        if greet:
            assert self.call({"op": "hello", "id": 0, "protocol": PROTOCOL_VERSION})["ok"]

    def call(self, body: dict, fds: list[int] | None = None) -> dict:
        send_frame(self.sock, body, fds or [])
        return self.reader.read().body

    def closed(self) -> bool:
        try:
            self.reader.read()
        except (ConnectionClosed, ConnectionResetError):
            return True
        return False

    def close(self) -> None:
        self.sock.close()


def error_code(reply: dict) -> str:
    assert reply["ok"] is False, reply
    return str(reply["error"]["code"])


def staging_memfd(size: int = 2 * SLOT, seal: bool = True) -> int:
    fd = os.memfd_create("test-staging", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def assert_serving(d: DaemonProcess) -> None:
    with Client(d.socket_path) as c, c.open_session(GEOMETRY, channels=1) as s:
        s.slot(0)[:] = os.urandom(SLOT)
        want = bytes(s.slot(0))
        s.write(1, "v", 0)
        s.slot(0)[:] = bytes(SLOT)
        s.read(1, "v", 0)
        assert bytes(s.slot(0)) == want


def test_framing_errors_close_the_connection(daemon: DaemonProcess) -> None:
    for raw, code in [(b"GET / HTTP/1.0\r\n\r\n", "bad_frame"),
                      (HEADER.pack(MAGIC, 1, 0, MAX_FRAME_BYTES + 1), "bad_frame"),
                      (HEADER.pack(MAGIC, 2, 0, 2) + b"{}", "bad_frame")]:
        c = Raw(daemon.socket_path)
        c.sock.sendall(raw)
        assert error_code(c.reader.read().body) == code
        assert c.closed()
        c.close()
    assert_serving(daemon)


def test_bad_bodies_get_errors_and_the_connection_survives(daemon: DaemonProcess) -> None:
    c = Raw(daemon.socket_path)
    for body in (b"{not json", b"[1,2]", b'"str"', b"\xff\xfe"):
        c.sock.sendall(HEADER.pack(MAGIC, 1, 0, len(body)) + body)
        assert error_code(c.reader.read().body) == "bad_request"
    cases = [
        ({"op": "status"}, "bad_request"),                         # no id
        ({"op": "status", "id": True}, "bad_request"),             # bool is not an id
        ({"op": "frobnicate", "id": 1}, "unknown_op"),
        ({"id": 2}, "bad_request"),                                # no op
        ({"op": "hello", "id": 3, "protocol": 1}, "bad_request"),  # hello twice
        ({"op": "read", "id": 4, "session": "nope", "layer": 0, "kind": "k", "channel": 0}, "no_such_session"),
        ({"op": "read", "id": 5, "session": 17}, "bad_request"),
        ({"op": "open_session", "id": 6}, "bad_request"),          # no memfd
        ({"op": "close_session", "id": 7, "session": "nope"}, "no_such_session"),
    ]
    for body, code in cases:
        assert error_code(c.call(body)) == code, body
    assert c.call({"op": "status", "id": 8})["ok"]
    c.close()


def test_out_of_order_and_version_mismatch(daemon: DaemonProcess) -> None:
    c = Raw(daemon.socket_path, greet=False)
    assert error_code(c.call({"op": "status", "id": 1})) == "handshake_required"
    assert c.closed()
    c = Raw(daemon.socket_path, greet=False)
    reply = c.call({"op": "hello", "id": 1, "protocol": PROTOCOL_VERSION + 1})
    assert error_code(reply) == "incompatible_protocol"
    assert f"protocol {PROTOCOL_VERSION + 1}" in reply["error"]["message"]
    assert c.closed()


def reply_error(reply: dict) -> tuple[str, str]:
    assert reply["ok"] is False, reply
    return str(reply["error"]["code"]), str(reply["error"]["message"])


#: (request, code, message) for requests that are malformed whatever the op; "id" is 5 unless the case is about it
MALFORMED = [
    ({"op": "status"}, "bad_request", "missing field 'id'"),
    ({"op": "status", "id": None}, "bad_request", "missing field 'id'"),
    ({"op": "status", "id": True}, "bad_request", "field 'id' must be an integer, got true"),
    ({"op": "status", "id": 1.5}, "bad_request", "field 'id' must be an integer, got 1.5"),
    ({"op": "status", "id": "5"}, "bad_request", "field 'id' must be an integer, got \"5\""),
    ({"op": "status", "id": 2**64}, "bad_request", f"field 'id' must be <= {INT_MAX}, got {2**64}"),
    ({"op": "status", "id": -2**64}, "bad_request", f"field 'id' must be >= {INT_MIN}, got {-2**64}"),
    ({"id": 5}, "bad_request", "missing field 'op'"),
    ({"id": 5, "op": None}, "bad_request", "missing field 'op'"),
    ({"id": 5, "op": 5}, "bad_request", "field 'op' must be a string, got 5"),
    ({"id": 5, "op": True}, "bad_request", "field 'op' must be a string, got true"),
    ({"id": 5, "op": ["status"]}, "bad_request", """field 'op' must be a string, got ["status"]"""),
    ({"id": 5, "op": {"op": "status"}}, "bad_request", """field 'op' must be a string, got {"op": "status"}"""),
]


def test_malformed_requests_get_bad_request_naming_field_value_and_expectation(daemon: DaemonProcess) -> None:
    c = Raw(daemon.socket_path)
    for i, (body, code, message) in enumerate(MALFORMED):
        reply = c.call(body)
        assert reply_error(reply) == (code, message), body
        assert reply["id"] == (5 if body.get("id") == 5 else None), reply  # only a valid id is echoed
        assert c.call({"op": "status", "id": 100 + i})["ok"], body          # the connection stays usable
    # a string op the daemon does not know is unknown_op, not bad_request; so is the empty op
    for op in ("frobnicate", ""):
        code, message = reply_error(c.call({"op": op, "id": 6}))
        assert code == "unknown_op"
        assert message.startswith(f"unknown op {op!r}; protocol {PROTOCOL_VERSION} knows hello, ")
    c.close()


def test_malformed_hello_gets_bad_request_and_the_peer_may_try_again(daemon: DaemonProcess) -> None:
    cases = [
        ({"protocol": True}, "field 'protocol' must be an integer, got true"),
        ({"protocol": False}, "field 'protocol' must be an integer, got false"),
        ({"protocol": "1"}, "field 'protocol' must be an integer, got \"1\""),
        ({"protocol": 1.0}, "field 'protocol' must be an integer, got 1.0"),
        ({"protocol": [1]}, "field 'protocol' must be an integer, got [1]"),
        ({}, "missing field 'protocol'"),
        ({"protocol": 2**64}, f"field 'protocol' must be <= {INT_MAX}, got {2**64}"),
    ]
    for fields, message in cases:
        c = Raw(daemon.socket_path, greet=False)
        assert reply_error(c.call({"op": "hello", "id": 1, **fields})) == ("bad_request", message), fields
        # not greeted, not closed: a corrected hello is accepted
        assert c.call({"op": "hello", "id": 2, "protocol": PROTOCOL_VERSION})["ok"]
        assert c.call({"op": "status", "id": 3})["ok"]
        c.close()
    # a malformed first request is not "another first request": bad_request, and hello still works
    c = Raw(daemon.socket_path, greet=False)
    assert reply_error(c.call({"id": 1})) == ("bad_request", "missing field 'op'")
    assert reply_error(c.call({"op": 7, "id": 1})) == ("bad_request", "field 'op' must be a string, got 7")
    assert c.call({"op": "hello", "id": 2, "protocol": PROTOCOL_VERSION})["ok"]
    c.close()
    # a well-typed version the daemon does not speak still ends the connection
    c = Raw(daemon.socket_path, greet=False)
    code, message = reply_error(c.call({"op": "hello", "id": 1, "protocol": -1}))
    assert code == "incompatible_protocol" and "client speaks protocol -1" in message
    assert c.closed()


def test_malformed_read_and_write_fields_are_named(daemon: DaemonProcess) -> None:
    c = Raw(daemon.socket_path)
    fd = staging_memfd(SLOT)
    try:
        opened = c.call({"op": "open_session", "id": 1, "geometry": GEOMETRY, "channels": 1,
                         "staging_bytes": SLOT}, [fd])
    finally:
        os.close(fd)
    sid = opened["session"]
    good = {"session": sid, "layer": 0, "kind": "k", "channel": 0}
    cases = [
        ({"layer": 1.0}, "field 'layer' must be an integer, got 1.0"),
        ({"layer": True}, "field 'layer' must be an integer, got true"),
        ({"layer": None}, "missing field 'layer'"),
        ({"layer": 2**63}, f"field 'layer' must be <= {INT_MAX}, got {2**63}"),
        ({"channel": "0"}, "field 'channel' must be an integer, got \"0\""),
        ({"kind": 5}, "field 'kind' must be a string, got 5"),
        ({"kind": ["k"]}, """field 'kind' must be a string, got ["k"]"""),
        ({"token_start": False}, "field 'token_start' must be an integer, got false"),
        ({"ntokens": 2.5}, "field 'ntokens' must be an integer, got 2.5"),
        ({"ntokens": -2**70}, f"field 'ntokens' must be >= {INT_MIN}, got {-2**70}"),
        ({"session": 17}, "field 'session' must be a string, got 17"),
        ({"session": {"id": sid}}, f"""field 'session' must be a string, got {{"id": "{sid}"}}"""),
    ]
    for i, (fields, message) in enumerate(cases):
        for op in ("read", "write"):
            reply = c.call({"op": op, "id": 10 + i, **good, **fields})
            assert reply_error(reply) == ("bad_request", message), (op, fields)
            assert reply["id"] == 10 + i
    # in range for the protocol but not for the session: out_of_range, as before
    code, message = reply_error(c.call({"op": "read", "id": 50, **good, "layer": -1}))
    assert code == "out_of_range" and message == "layer -1 outside 0..1"
    assert c.call({"op": "read", "id": 51, **good})["ok"]  # the session still works
    assert reply_error(c.call({"op": "close_session", "id": 52, "session": None})) == (
        "bad_request", "missing field 'session'")
    assert c.call({"op": "close_session", "id": 53, "session": sid})["ok"]
    c.close()


def test_open_session_fields_are_named_with_value_and_limit(daemon: DaemonProcess) -> None:
    c = Raw(daemon.socket_path)
    req = {"op": "open_session", "id": 1, "geometry": GEOMETRY, "channels": 1, "staging_bytes": SLOT}

    def geo(**kw: object) -> dict:
        return dict(req, geometry=dict(GEOMETRY, **kw))

    no_layers = {k: v for k, v in GEOMETRY.items() if k != "layers"}
    cases = [
        ({k: v for k, v in req.items() if k != "geometry"}, "missing field 'geometry'"),
        (dict(req, geometry=[2, 2]), "field 'geometry' must be an object, got [2, 2]"),
        (dict(req, geometry=no_layers), "missing field 'geometry.layers'"),
        (geo(layers=MAX_LAYERS + 1), f"field 'geometry.layers' must be <= {MAX_LAYERS}, got {MAX_LAYERS + 1}"),
        (geo(layers=4096), f"field 'geometry.layers' must be <= {MAX_LAYERS}, got 4096"),
        (geo(layers=True), "field 'geometry.layers' must be an integer, got true"),
        (geo(batch=0), "field 'geometry.batch' must be >= 1, got 0"),
        (geo(kv_heads=-8), "field 'geometry.kv_heads' must be >= 1, got -8"),
        (geo(head_dim=128.0), "field 'geometry.head_dim' must be an integer, got 128.0"),
        (geo(max_tokens=2**64), f"field 'geometry.max_tokens' must be <= {INT_MAX}, got {2**64}"),
        (geo(max_tokens={"n": 8}), """field 'geometry.max_tokens' must be an integer, got {"n": 8}"""),
        (dict(req, channels="1"), "field 'channels' must be an integer, got \"1\""),
        (dict(req, channels=0), "field 'channels' must be >= 1, got 0"),
        (dict(req, channels=9), "field 'channels' must be <= 8, got 9"),
        (dict(req, staging_bytes=-SLOT), f"field 'staging_bytes' must be >= 1, got {-SLOT}"),
        (dict(req, staging_bytes=2**63), f"field 'staging_bytes' must be <= {INT_MAX}, got {2**63}"),
        (dict(req, mode=5), "field 'mode' must be a string, got 5"),
        (dict(req, checksums=1), "field 'checksums' must be a boolean, got 1"),
    ]
    before = open_fds(daemon.pid)
    for body, message in cases:
        fd = staging_memfd(SLOT)
        try:
            assert reply_error(c.call(body, [fd])) == ("bad_request", message), body
        finally:
            os.close(fd)
    fd = staging_memfd(SLOT)
    try:
        code, message = reply_error(c.call(geo(dtype_bytes=3), [fd]))
        assert code == "bad_request" and "dtype_bytes must be one of 1, 2, 4, 8" in message and "got 3" in message
        code, message = reply_error(c.call(dict(req, mode="turbo"), [fd]))
        assert code == "bad_request" and message.startswith("field 'mode': unknown residency mode 'turbo'")
    finally:
        os.close(fd)
    assert c.call({"op": "sessions", "id": 2})["sessions"] == []  # nothing was opened, nothing leaked
    assert open_fds(daemon.pid) <= before
    c.close()


def test_the_worst_case_open_session_reply_fits_a_frame() -> None:
    """The arithmetic behind MAX_LAYERS (docs/protocol.md, "Limits"): the largest reply an accepted request can
    produce, built by the daemon's own reply code, fits a frame."""
    # every number as large as an accepted request allows: one KPU as large as staging_bytes (< 2^63) on the
    # largest LBA (64 KiB); every KPU on the page-cache path (the longest entry)
    geo = Geometry(layers=MAX_LAYERS, batch=1, kv_heads=1, head_dim=1, dtype_bytes=1, max_tokens=INT_MAX)
    plan = plan_session(geo, "baseline", INT_MAX, 65536)
    assert all(k.path == "pagecache" and k.padded_bytes == INT_MAX + 1 for k in plan.kpus)
    # the budget sample with every string as long as a path may be, every number at its largest
    sample = BudgetBreakdown(host_available_bytes=INT_MAX, memory_limit_bytes=INT_MAX, anon_shmem_bytes=INT_MAX,
                             usable_bytes=INT_MAX, copy_threads=INT_MAX, pinned_per_thread_bytes=INT_MAX,
                             pagecache_budget_bytes=INT_MAX, cgroup="/" * 4096, cgroup_version="v" * 4096,
                             override_bytes=INT_MAX, cap_bytes=INT_MAX, sampled_at=-1.7976931348623157e308,
                             pagecache_budget_computed_bytes=INT_MAX, anon_bytes=INT_MAX, shmem_bytes=INT_MAX,
                             file_bytes=INT_MAX, kernel_bytes=INT_MAX, host_total_bytes=INT_MAX, limited=False,
                             memory_limit_source="/" * 4096, binding="b" * 4096, reason="r" * 4096)
    budget = sample.to_dict() | {"granted_bytes": INT_MAX, "held_by_others_bytes": INT_MAX, "error": "e" * 8192}
    peer = Peer(pid=INT_MAX, uid=INT_MAX, gid=INT_MAX)
    out = ServedSession("ffffffff", peer, geo, plan, budget, Stats()).open_reply()
    # the layout of an unbound session has no channels: give it the most (io.max_channels <= 64)
    out["layout"].update(channels=64, registered=[False] * 64, slot_bytes=INT_MAX, slot_stride=INT_MAX,
                         staging_bytes=INT_MAX, extent={"start": INT_MAX, "nblocks": INT_MAX})
    assert len(out["plan"]["kpus"]) == 2 * MAX_LAYERS
    size = len(encode(ok_reply(INT_MIN, **out)))  # encode raises if it does not fit
    assert size <= MAX_FRAME_BYTES
    print(f"\nworst-case open_session reply at {MAX_LAYERS} layers: {size} bytes "
          f"({100 * size / MAX_FRAME_BYTES:.0f}% of a frame)")


def test_an_oversize_reply_becomes_an_error_reply_not_a_dropped_connection() -> None:
    """No request within the limits makes one (the test above), so the daemon's send path is driven directly,
    over a real socket: the peer gets an internal error naming the size and the limit, and the next reply."""
    a, b = socket.socketpair()
    try:
        conn = Connection(None, a, Peer(pid=os.getpid(), uid=os.getuid(), gid=os.getgid()))  # type: ignore[arg-type]
        big = {"id": 5, "ok": True, "blob": "x" * MAX_FRAME_BYTES}
        conn.send(big)
        conn.send({"id": 6, "ok": True})
        reader = FrameReader(b)
        first = reader.read().body
        assert first["id"] == 5 and reply_error(first)[0] == "internal"
        nbytes = len(json.dumps(big, separators=(",", ":")))
        assert f"would be {nbytes} bytes, over the {MAX_FRAME_BYTES}-byte frame limit" in first["error"]["message"]
        assert reader.read().body == {"id": 6, "ok": True}
    finally:
        a.close()
        b.close()


def test_client_gets_a_clear_incompatible_protocol_error(daemon: DaemonProcess,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def newer_hello(req_id: int, name: str) -> dict:
        return {**hello_request(req_id, name), "protocol": PROTOCOL_VERSION + 1}

    monkeypatch.setattr(client_mod, "hello_request", newer_hello)
    with pytest.raises(IncompatibleProtocolError, match="upgrade"):
        Client(daemon.socket_path)


def test_open_session_staging_is_checked_and_descriptors_are_not_leaked(daemon: DaemonProcess) -> None:
    c = Raw(daemon.socket_path)
    req = {"op": "open_session", "id": 1, "geometry": GEOMETRY, "channels": 2, "staging_bytes": 2 * SLOT}
    before = open_fds(daemon.pid)
    r, w = os.pipe()
    mine = [r, w]

    def memfd(size: int = 2 * SLOT, seal: bool = True) -> int:
        mine.append(staging_memfd(size, seal))
        return mine[-1]

    def message(body: dict, fds: list[int]) -> str:
        return str(c.call(body, fds)["error"]["message"])

    try:
        assert "sealed" in message(req, [memfd(seal=False)])
        assert "announced" in message(req, [memfd(SLOT)])
        assert "memfd" in message(req, [r])
        assert "exactly one" in message(req, [memfd(), memfd()])
        assert error_code(c.call({"op": "status", "id": 2}, [r])) == "bad_request"
        assert "dtype_bytes" in message(dict(req, geometry=dict(GEOMETRY, dtype_bytes=3)), [memfd()])
        assert error_code(c.call(dict(req, channels=999), [memfd()])) == "bad_request"
        assert error_code(c.call(dict(req, mode="turbo"), [memfd()])) == "bad_request"
        big = dict(req, channels=5, staging_bytes=5 * SLOT)
        assert "io.max_staging_bytes" in message(big, [memfd(5 * SLOT)])
    finally:
        for fd in mine:
            os.close(fd)
    assert c.call({"op": "status", "id": 3})["ok"]
    assert open_fds(daemon.pid) <= before  # every descriptor that came with a refused request was closed
    c.close()


def test_an_empty_memfd_is_sized_and_sealed_by_the_daemon(daemon: DaemonProcess) -> None:
    """What the client library sends: the daemon lays the slots out, sizes the memfd and seals it."""
    c = Raw(daemon.socket_path)
    fd = os.memfd_create("test-staging", os.MFD_ALLOW_SEALING)
    try:
        reply = c.call({"op": "open_session", "id": 1, "geometry": GEOMETRY, "channels": 2}, [fd])
        layout = reply["layout"]
        assert (layout["slot_bytes"], layout["slot_stride"], layout["staging_bytes"]) == (SLOT, SLOT, 2 * SLOT)
        assert os.fstat(fd).st_size == 2 * SLOT
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)                      # the client cannot pull the pages from under the daemon
        # staging_bytes, when given, is what the empty memfd is sized to
        bigger = os.memfd_create("test-staging", os.MFD_ALLOW_SEALING)
        try:
            reply = c.call({"op": "open_session", "id": 2, "geometry": GEOMETRY, "channels": 1,
                            "staging_bytes": 3 * SLOT}, [bigger])
            assert reply["layout"]["staging_bytes"] == os.fstat(bigger).st_size == 3 * SLOT
        finally:
            os.close(bigger)
        # a memfd that cannot be sealed is refused, naming what the daemon needs
        unsealable = os.memfd_create("test-staging")
        try:
            code, message = reply_error(c.call({"op": "open_session", "id": 3, "geometry": GEOMETRY,
                                                "channels": 1}, [unsealable]))
            assert code == "bad_request" and "F_SEAL_SHRINK" in message and "empty and not sealed" in message
        finally:
            os.close(unsealable)
    finally:
        os.close(fd)
    c.close()


def test_out_of_range_requests_are_refused(daemon: DaemonProcess) -> None:
    with Client(daemon.socket_path) as cl, cl.open_session(GEOMETRY, channels=1) as s:
        base = {"session": s.id, "layer": 0, "kind": "k", "channel": 0}
        for field, value in [("layer", 2), ("layer", -1), ("kind", "q"), ("channel", 1), ("token_start", 8)]:
            reply = cl.call_async("read", **dict(base, **{field: value})).exception(10)
            assert reply is not None and reply.code is ErrorCode.OUT_OF_RANGE, (field, value)
        err = cl.call_async("write", **dict(base, token_start=6, ntokens=3)).exception(10)
        assert err is not None and "outside" in str(err)
        assert s.read(0, "k", 0, token_start=6, ntokens=2).nbytes == 2 * 4096


def test_pipelined_requests_on_a_channel_complete_in_order(daemon: DaemonProcess) -> None:
    """A copy thread may send many requests before reading a reply: each is served, in order (the daemon
    holds none of them in a queue; the socket's buffer is the only backlog)."""
    with Client(daemon.socket_path) as cl, cl.open_session(GEOMETRY, channels=1) as s:
        dc = s.channel(0)
        ranges = [[s.range("read", 1, "k", t, 1)] for t in range(GEOMETRY["max_tokens"])] * 8
        for r in ranges:
            dc.send(r)
        for _ in ranges:
            (res,) = dc.receive()
            assert res.ok and res.nbytes == s.token_bytes
        assert s.read(1, "k", 0).nbytes == SLOT


def test_a_peer_that_stops_reading_loses_its_session_not_a_worker(daemon: DaemonProcess) -> None:
    c = Raw(daemon.socket_path)
    opened = c.call({"op": "open_session", "id": 1, "geometry": GEOMETRY, "channels": 1,
                     "staging_bytes": SLOT}, [staging_memfd(SLOT)])
    sid = opened["session"]
    blob = b"".join(
        encode({"op": "read", "id": i, "session": sid, "layer": 0, "kind": "k", "channel": 0, "ntokens": 1})
        for i in range(2, 40000))

    def flood() -> None:
        with contextlib.suppress(OSError):  # the daemon gave up on us: that is the point
            c.sock.sendall(blob)

    flooding = daemon.mark()  # the daemon is shared by the module: only what follows the flood counts
    t = threading.Thread(target=flood, daemon=True)
    t.start()
    ev = daemon.wait_event("session_close", after=flooding, session=sid, timeout=60)
    assert ev["reason"] != "closed"
    daemon.wait_line("reply not delivered", after=flooding)
    t.join(30)
    c.close()
    assert_serving(daemon)


def test_truncated_frames_and_abrupt_closes(daemon: DaemonProcess) -> None:
    for raw in (HEADER.pack(MAGIC, 1, 0, 100)[:5], HEADER.pack(MAGIC, 1, 0, 100) + b'{"op":'):
        c = Raw(daemon.socket_path)
        c.sock.sendall(raw)
        c.sock.close()
    c = Raw(daemon.socket_path)
    c.sock.sendall(HEADER.pack(MAGIC, 1, 0, 50) + b"{}")
    c.sock.shutdown(socket.SHUT_WR)
    assert error_code(c.reader.read().body) == "bad_frame"
    c.close()
    assert_serving(daemon)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.one_of(
    st.binary(max_size=64),
    st.builds(lambda b: HEADER.pack(MAGIC, 1, 0, len(b)) + b, st.binary(max_size=64)),
    st.builds(lambda d: (lambda b: HEADER.pack(MAGIC, 1, 0, len(b)) + b)(json.dumps(d).encode()),
              st.dictionaries(st.sampled_from(["op", "id", "session", "layer", "kind", "channel", "ntokens",
                                               "token_start", "geometry"]),
                              st.one_of(st.integers(-2**40, 2**40), st.text(max_size=8), st.none(), st.booleans(),
                                        st.sampled_from(["read", "write", "open_session", "status", "trim"])))),
))
def test_fuzzed_input_never_kills_the_daemon(daemon: DaemonProcess, junk: bytes) -> None:
    c = Raw(daemon.socket_path)
    c.sock.sendall(junk)
    c.sock.shutdown(socket.SHUT_WR)
    try:
        while True:
            body = c.reader.read().body
            assert set(body) >= {"id", "ok"}
    except (ConnectionClosed, ConnectionResetError, FrameError):
        pass
    c.close()
    r = Raw(daemon.socket_path)
    assert r.call({"op": "status", "id": 1})["ok"]
    r.close()


def _top_level_fields(cell: str) -> set[str]:
    """The backquoted names of a reply-fields cell outside any parentheses (what a field holds is inside)."""
    depth, flat = 0, []
    for ch in cell:
        depth += ch == "("
        if not depth:
            flat.append(ch)
        depth -= ch == ")" and depth > 0
    return set(re.findall(r"`(\w+)`", "".join(flat)))


def test_protocol_doc_lists_every_field_of_the_status_reply(daemon: DaemonProcess) -> None:
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "protocol.md")) as f:
        (row,) = [ln for ln in f if ln.startswith("| `status` |")]
    with Client(daemon.socket_path) as c:
        status = c.status()
    assert _top_level_fields(row.split("|")[2]) == set(status)
    assert set(status["engine"]) == {"engine", "reason"} and status["engine"]["engine"] in ("uring", "portable")
    assert set(status["budget"]) == {"pagecache_budget_bytes", "usable_bytes", "cgroup", "cgroup_version"}
    for field in status["device"]:
        assert f"`{field}`" in row, field


def test_protocol_doc_lists_every_op_and_error_code() -> None:
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "protocol.md")) as f:
        doc = f.read()
    from bladed.protocol import OPS

    for op in OPS:
        assert f"`{op}`" in doc, op
    for code in ErrorCode:
        # the "Error codes" table names the exception error_for() raises (protocol.ERRORS)
        assert f"| `{code.value}` | `{type(error_for(code, '')).__name__}`" in doc, code
    assert f"PROTOCOL_VERSION = {PROTOCOL_VERSION}" in doc or f"version {PROTOCOL_VERSION}" in doc
    assert struct.calcsize("<2sBBI") == HEADER.size == 8
    _ = Frame
