"""Data connections and batched binary I/O against a real daemon (docs/protocol.md).

A copy thread attaches its own connection to one channel of a session, sends
batches of ranges and reads each reply itself.  Bad ranges refuse a batch
whole, before anything of it runs; a connection can never reach another
peer's session; closing the session ends its data connections.
"""

from __future__ import annotations

import os
import select
import socket
from collections.abc import Iterator

import pytest
from daemon_util import DaemonProcess, short_tmpdir

from bladed.client import Client
from bladed.datachannel import DataChannel
from bladed.protocol import (
    HEADER,
    IO_FORMAT,
    IO_RANGE,
    IO_REQUEST,
    MAGIC,
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    BadRequestError,
    DaemonLostError,
    FrameReader,
    IncompatibleProtocolError,
    IOOp,
    IORange,
    NoSuchSessionError,
    OutOfRangeError,
    ProtocolError,
    decode_io_reply,
    encode_io_request,
    hello_request,
    send_frame,
)
from bladed.residency.geometry import tensor_id

# on both engines, io_uring and the portable one (issue 29)
pytestmark = pytest.mark.usefixtures("io_engine")

#: 4 KiB token rows, 4 layers, 8 tokens: 32 KiB KPUs
GEO = {"layers": 4, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 8}
KPU = 8 * 4096
TB = 4096


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with short_tmpdir() as d, DaemonProcess(d, {"budget": {"override": 4 * KPU}}).start() as dp:
        yield dp


def control(d: DaemonProcess) -> tuple[socket.socket, FrameReader]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(d.socket_path)
    reader = FrameReader(sock)
    send_frame(sock, hello_request(0, "test"))
    assert reader.read().body["ok"]
    return sock, reader


def test_a_batch_moves_several_kpus_at_their_slot_offsets_on_both_paths(daemon: DaemonProcess) -> None:
    """One request writes the same token of every KPU (a decode step's appends), another reads them all."""
    with Client(daemon.socket_path) as c, c.open_session(GEO, channels=1, slot_bytes=8 * KPU) as s:
        assert {k["path"] for k in s.plan["kpus"]} == {"pagecache", "direct"}
        data = {t: os.urandom(TB) for t in range(8)}
        slot = s.slot(0)
        for t, b in data.items():
            slot[t * KPU + 5 * TB:t * KPU + 6 * TB] = b
        writes = [s.range("write", t // 2, "kv"[t % 2], 5, 1, slot_offset=t * KPU + 5 * TB) for t in range(8)]
        results = s.submit(0, writes)
        assert [r.path for r in results] == [k["path"] for k in s.plan["kpus"]]
        slot[:] = bytes(len(slot))
        reads = [s.range("read", t // 2, "kv"[t % 2], 5, 1, slot_offset=(7 - t) * TB) for t in range(8)]
        s.submit(0, reads)
        for t, b in data.items():
            assert bytes(slot[(7 - t) * TB:(8 - t) * TB]) == b


def test_the_runs_of_one_kpu_come_back_in_one_request_on_both_paths(daemon: DaemonProcess) -> None:
    """A sparse read's runs of pages (protocol 6): one KPU named several times, its tokens apart, in one request
    with another KPU's runs; each run lands at its mirrored offset and the bytes between them are not touched."""
    with Client(daemon.socket_path) as c, c.open_session(GEO, channels=1, slot_bytes=8 * KPU) as s:
        paths = {(k["layer"], k["kind"]): k["path"] for k in s.plan["kpus"]}
        direct = next(lk for lk, p in paths.items() if p == "direct")
        cached = next(lk for lk, p in paths.items() if p == "pagecache")
        slot = s.slot(0)
        kv = {lk: os.urandom(KPU) for lk in (direct, cached)}
        for (layer, kind), data in kv.items():
            slot[:KPU] = data
            s.write(layer, kind, 0)
        runs = [(0, 2), (3, 1), (5, 3)]
        for first, second in ((direct, cached), (cached, direct)):
            slot[:] = b"\xee" * len(slot)
            requests = [s.range("read", *first, t0, n) for t0, n in runs]
            requests += [s.range("read", *second, t0, n, slot_offset=KPU + t0 * TB) for t0, n in runs]
            results = s.submit(0, requests)
            assert [r.path for r in results] == [paths[first]] * 3 + [paths[second]] * 3
            for base, lk in ((0, first), (KPU, second)):
                for t in range(8):
                    got = bytes(slot[base + t * TB:base + (t + 1) * TB])
                    read = any(t0 <= t < t0 + n for t0, n in runs)
                    assert got == (kv[lk][t * TB:(t + 1) * TB] if read else b"\xee" * TB), (lk, t)


def test_a_bad_range_refuses_the_whole_batch_before_anything_runs(daemon: DaemonProcess) -> None:
    with Client(daemon.socket_path) as c, c.open_session(GEO, channels=1, slot_bytes=2 * KPU) as s:
        before = os.urandom(KPU)
        s.slot(0)[:KPU] = before
        s.write(3, "k", 0)
        s.slot(0)[:KPU] = os.urandom(KPU)
        good = s.range("write", 3, "k", 0, 8)
        cases = [
            (s.range("read", 1, "v", 6, 3), OutOfRangeError, "range 1: tokens [6, 9) outside the KPU's 0..8 tokens"),
            (IORange(IOOp.READ, 8, 0, 1), OutOfRangeError,
             "range 1: layer 4 K (tensor 8) outside the session's layers 0..3"),
            (s.range("read", 3, "k", 0, 1, slot_offset=KPU), BadRequestError,
             "ranges 0 and 1 of layer 3 K overlap in its tokens"),
            (s.range("read", 2, "k", 0, 2, slot_offset=KPU - TB), BadRequestError,
             "ranges 0 and 1 overlap in the staging slot"),
            (s.range("read", 2, "k", 0, 2, slot_offset=2 * KPU - TB), OutOfRangeError,
             f"range 1: slot bytes [{2 * KPU - TB}, {2 * KPU + TB}) outside the channel's {2 * KPU}-byte slot"),
            (IORange(IOOp.READ, 0, 0, 0), OutOfRangeError, "range 1: tokens [0, 0) outside"),
        ]
        for bad, exc, message in cases:
            with pytest.raises(exc) as e:
                s.submit(0, [good, bad])
            assert str(e.value).startswith(message), str(e.value)
        s.read(3, "k", 0)
        assert bytes(s.slot(0)[:KPU]) == before            # the good range of each refused batch never ran
        limit = c.server["max_ranges"]
        with pytest.raises(BadRequestError, match=f"exceeds io.max_outstanding \\({limit}\\)"):
            s.submit(0, [s.range("read", 0, "k", 0, 1)] * (limit + 1))


def test_malformed_binary_requests_are_refused_and_the_connection_serves_on(daemon: DaemonProcess) -> None:
    with Client(daemon.socket_path) as c, c.open_session(GEO, channels=1) as s:
        dc = s.channel(0)
        sock = dc._sock
        head = IO_REQUEST.pack(7, 1, 0)
        for body, message in [
            (IO_REQUEST.pack(7, 0, 0), "an I/O request carries 1..4096 ranges, got 0"),
            (IO_REQUEST.pack(7, 1, 4), "I/O request flags must be 0, got 0x4"),
            (head, "I/O request of 1 ranges must be 36 bytes, got 12"),
            (head + IO_RANGE.pack(3, 0, 0, 1, 0), "range 0: op must be 1 (write) or 2 (read), got 3"),
        ]:
            sock.sendall(HEADER.pack(MAGIC, IO_FORMAT, 0, len(body)) + body)
            _, raw = dc._stream.read()
            req_id, refused, text, results = decode_io_reply(raw)
            assert (req_id, refused, results) == (7, "bad_request", []) and text == message
        assert s.read(0, "k", 0).nbytes == KPU                 # the data connection still serves


def test_attach_reveals_nothing_of_sessions_it_may_not_use(daemon: DaemonProcess) -> None:
    with Client(daemon.socket_path) as c, c.open_session(GEO, channels=2) as s:
        token = s._attach_token
        for sid, ch, tok in [("nosuchid", 0, token), (s.id, 0, "0" * 32), (s.id, 0, token[:-1] + "x")]:
            with pytest.raises(NoSuchSessionError, match="with that attach token"):
                DataChannel(daemon.socket_path, sid, ch, tok)
        with pytest.raises(OutOfRangeError, match=r"channel 2 outside 0\.\.1"):
            DataChannel(daemon.socket_path, s.id, 2, token)
        # a connection with sessions of its own cannot become a data connection
        with pytest.raises(BadRequestError, match="cannot attach"):
            c.call("attach", session=s.id, channel=0, token=token)


@pytest.mark.parametrize("wait_for_close", [False, True], ids=["racing", "after_close"])
def test_frames_of_the_wrong_kind_break_the_connection(daemon: DaemonProcess, wait_for_close: bool) -> None:
    sock, reader = control(daemon)
    sock.sendall(encode_io_request(1, [IORange(IOOp.READ, 0, 0, 1)]))
    body = reader.read().body
    assert body["error"]["code"] == "bad_frame" and "attach a data connection first" in body["error"]["message"]
    sock.close()
    with Client(daemon.socket_path) as c, c.open_session(GEO, channels=1) as s:
        dc = s.channel(0)
        send_frame(dc._sock, {"op": "status", "id": 3})
        if wait_for_close:
            # the next request's send then fails (EPIPE); the daemon's reason must still be what is raised
            poller = select.poll()
            poller.register(dc._sock, select.POLLHUP)
            assert poller.poll(10_000), "the daemon kept a data connection that sent a JSON frame"
        with pytest.raises(ProtocolError, match="a JSON frame on a data connection"):
            dc.submit([s.range("read", 0, "k")])


def test_closing_the_session_ends_its_data_connections(daemon: DaemonProcess) -> None:
    with Client(daemon.socket_path) as c:
        s = c.open_session(GEO, channels=2)
        dc = s.channel(1)
        dc.submit([s.range("write", 0, "k")])
        c.call("close_session", session=s.id)           # behind the Session object's back
        with pytest.raises(DaemonLostError, match="data connection of channel 1"):
            dc.submit([s.range("read", 0, "k")])
        s._closed = True


@pytest.mark.parametrize("old", [1, 2])
def test_an_older_protocol_client_is_told_to_upgrade(daemon: DaemonProcess, old: int) -> None:
    """Protocol 1 had no data connections; protocol 2 named reply fields after the paper's symbols."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(daemon.socket_path)
    send_frame(sock, {**hello_request(0, "old"), "protocol": old})
    body = FrameReader(sock).read().body
    assert body["error"]["code"] == "incompatible_protocol"
    assert f"client speaks protocol {old}; this bladed" in body["error"]["message"]
    assert f"speaks {MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION}" in body["error"]["message"]
    assert sock.recv(1) == b""                          # and the connection is closed
    sock.close()
    with pytest.raises(IncompatibleProtocolError):
        raise IncompatibleProtocolError("the class exists for clients")


def test_tensor_ids_on_the_wire_are_layer_and_kind() -> None:
    assert [tensor_id(layer, kind) for layer in range(2) for kind in "kv"] == [0, 1, 2, 3]
    assert IO_RANGE.size == 24 and IO_REQUEST.size == 12
