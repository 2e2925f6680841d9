"""The wire format, and a real daemon fed malformed, oversized and out-of-order
input: every case gets an error reply or a closed connection, the daemon
keeps serving, and no worker is left stuck."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
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
    MAGIC,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    BadBody,
    BusyError,
    ConnectionClosed,
    ErrorCode,
    Frame,
    FrameError,
    FrameReader,
    IncompatibleProtocolError,
    RequestError,
    encode,
    error_from_reply,
    get_field,
    hello_request,
    send_frame,
)

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


def test_field_checks_and_error_mapping() -> None:
    body = {"n": 3, "flag": True, "s": "x"}
    assert get_field(body, "n", int, minimum=0, maximum=3) == 3
    assert get_field(body, "missing", int, default=5) == 5
    for name, kind, kw, msg in [("missing", int, {}, "missing field"), ("flag", int, {}, "must be int"),
                                ("n", int, {"maximum": 2}, "<= 2"), ("s", str, {"choices": ["k"]}, "one of k")]:
        with pytest.raises(RequestError, match=msg):
            get_field(body, name, kind, **kw)
    err = error_from_reply({"ok": False, "error": {"code": "busy", "message": "slow down"}})
    assert isinstance(err, BusyError) and str(err) == "slow down" and err.code is ErrorCode.BUSY
    assert "weird" in str(error_from_reply({"ok": False, "error": {"code": "weird", "message": "m"}}))
    with pytest.raises(ValueError, match="limit"):
        encode({"x": "y" * MAX_FRAME_BYTES})


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
        ({"id": 2}, "unknown_op"),
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


def test_out_of_range_requests_are_refused(daemon: DaemonProcess) -> None:
    with Client(daemon.socket_path) as cl, cl.open_session(GEOMETRY, channels=1) as s:
        base = {"session": s.id, "layer": 0, "kind": "k", "channel": 0}
        for field, value in [("layer", 2), ("layer", -1), ("kind", "q"), ("channel", 1), ("token_start", 8)]:
            reply = cl.call_async("read", **dict(base, **{field: value})).exception(10)
            assert reply is not None and reply.code is ErrorCode.OUT_OF_RANGE, (field, value)
        err = cl.call_async("write", **dict(base, token_start=6, ntokens=3)).exception(10)
        assert err is not None and "outside" in str(err)
        assert s.read(0, "k", 0, token_start=6, ntokens=2).nbytes == 2 * 4096


def test_a_backed_up_channel_answers_busy_instead_of_queueing_forever(daemon: DaemonProcess) -> None:
    with Client(daemon.socket_path) as cl, cl.open_session(GEOMETRY, channels=1) as s:
        futs = [s.read_async(1, "k", 0) for _ in range(64)]
        errors = [f.exception(30) for f in futs]
        busy = [e for e in errors if e is not None]
        assert busy and all(isinstance(e, BusyError) for e in busy)
        assert len(busy) < len(futs)  # the ones admitted completed normally
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

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    ev = daemon.wait_event("session_close", session=sid, timeout=60)
    assert ev["reason"] != "closed"
    daemon.wait_line("reply not delivered")
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


def test_protocol_doc_lists_every_op_and_error_code() -> None:
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "protocol.md")) as f:
        doc = f.read()
    from bladed.protocol import OPS

    for op in OPS:
        assert f"`{op}`" in doc, op
    for code in ErrorCode:
        assert f"`{code.value}`" in doc, code
    assert f"PROTOCOL_VERSION = {PROTOCOL_VERSION}" in doc or f"version {PROTOCOL_VERSION}" in doc
    assert struct.calcsize("<2sBBI") == HEADER.size == 8
    _ = Frame
