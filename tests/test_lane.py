"""The lane (bladed.server.wire.lane): what the daemon serves in C is served, counted and ordered as the
general path would, against a real daemon.

The lane takes requests whose every range is on a KPU with an open gate (a
plain page-cache KPU, or a direct KPU of whole-LBA rows with the range's slot
offset on an LBA); everything else must come back to Python and behave
exactly as before (a refusal naming the range, a slot offset off an LBA, a
pending demotion).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest
from daemon_util import DaemonProcess, short_tmpdir

from bladed.client import Client, OpResult, Session
from bladed.protocol import MIRROR, FrameError, FrameStream, IOOp, IORange, OutOfRangeError

# on both engines, io_uring and the portable one (issue 29)
pytestmark = pytest.mark.usefixtures("io_engine")

#: 4 KiB token rows, 4 layers, 8 tokens: 32 KiB KPUs
GEO = {"layers": 4, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 8}
KPU = 8 * 4096
TB = 4096


@pytest.fixture()
def daemon() -> Iterator[DaemonProcess]:
    with short_tmpdir() as d, DaemonProcess(d, {"budget": {"override": 64 * KPU}}).start() as dp:
        yield dp


def pagecache_io(c: Client) -> dict[str, dict[str, int]]:
    return c.stats()["io"]["pagecache"]


def lane_requests(c: Client) -> int:
    (row,) = c.sessions()
    return int(row["lane_requests"])


def round_trip_every_token(s: Session) -> tuple[list[OpResult], list[OpResult]]:
    """Append every token of every KPU, one range per request, then read each back and compare, as a decode loop
    does them; the write and the read results."""
    slot = s.slot(0)
    want = {}
    writes = []
    for t in range(8):
        for layer in range(4):
            for kind in "kv":
                row = os.urandom(TB)
                slot[t * TB:(t + 1) * TB] = row
                writes.append(s.write(layer, kind, 0, t, 1))
                want[(layer, kind, t)] = row
    slot[:] = bytes(len(slot))
    reads = []
    for (layer, kind, t), row in want.items():
        reads.append(s.read(layer, kind, 0, t, 1))
        assert bytes(slot[t * TB:(t + 1) * TB]) == row, (layer, kind, t)
    return writes, reads


def test_one_token_appends_read_back_and_are_counted(daemon: DaemonProcess) -> None:
    """Appends and reads of every token of every KPU, one range per request, as a decode loop does them."""
    with Client(daemon.socket_path) as c:
        before = pagecache_io(c)
        with c.open_session(GEO, channels=1) as s:
            assert {k["path"] for k in s.plan["kpus"]} == {"pagecache"}
            _, reads = round_trip_every_token(s)
            for r in reads:
                assert (r.path, r.hit_ratio) == ("pagecache", 1.0)      # just written: resident
            (row,) = c.sessions()
            assert row["ops"] == 2 * len(reads)
            during = pagecache_io(c)
        after = pagecache_io(c)
    for op in ("write", "read"):
        assert during[op]["ops"] - before[op]["ops"] == len(reads)
        assert during[op]["bytes"] - before[op]["bytes"] == len(reads) * TB
        assert after[op]["ops"] == during[op]["ops"]     # kept once the session (and its lane) is gone
        assert after[op]["latency_sum_s"] > 0


def test_direct_appends_run_on_the_lane_read_back_and_are_counted(daemon: DaemonProcess) -> None:
    """On the direct path (4 KiB rows: whole LBAs), every request after a KPU's first runs in C on the channel's
    ring; appends and reads of every token read back and are counted on the direct path."""
    with Client(daemon.socket_path) as c:
        before = c.stats()["io"]["direct"]
        with c.open_session(GEO, mode="direct", channels=1) as s:
            assert {k["path"] for k in s.plan["kpus"]} == {"direct"}
            writes, reads = round_trip_every_token(s)
            assert {w.path for w in writes} == {"direct"}
            for r in reads:
                assert (r.path, r.nbytes, r.hit_ratio) == ("direct", TB, None)
            assert lane_requests(c) == 2 * len(reads) - 8      # each KPU's first request bound it, in Python
            during = c.stats()["io"]["direct"]
        after = c.stats()["io"]["direct"]
    for op in ("write", "read"):
        assert during[op]["ops"] - before[op]["ops"] == len(reads)
        assert during[op]["bytes"] - before[op]["bytes"] == len(reads) * TB
        assert after[op]["ops"] == during[op]["ops"]     # kept once the session (and its lane) is gone


def test_a_batch_of_both_paths_runs_on_the_lane_and_a_slot_offset_off_an_lba_goes_to_python() -> None:
    """A decode step's batch of every KPU of a Dual-Blade session, page-cache and direct ranges together, runs
    in one C request; a direct range whose slot offset is not on an LBA is served by the general path."""
    with short_tmpdir() as d, DaemonProcess(d, {"budget": {"override": 4 * KPU}}).start() as dp, \
            Client(dp.socket_path) as c, c.open_session(GEO, mode="dualblade", channels=1,
                                                        slot_bytes=8 * KPU + 2 * TB) as s:
        paths = {k["tensor_id"]: k["path"] for k in s.plan["kpus"]}
        assert set(paths.values()) == {"pagecache", "direct"}, paths
        slot = s.slot(0)
        for tid in range(8):
            slot[tid * KPU:(tid + 1) * KPU] = bytes([tid + 1]) * KPU
            s.submit(0, [IORange(IOOp.WRITE, tid, 0, 8, tid * KPU)])     # every file made, every extent bound
        rows = [os.urandom(TB) for _ in range(8)]
        for tid, row in enumerate(rows):
            slot[tid * TB:(tid + 1) * TB] = row
        served = lane_requests(c)
        results = s.submit(0, [IORange(IOOp.WRITE, tid, 3, 1, tid * TB) for tid in range(8)])
        assert [r.path for r in results] == [paths[t] for t in range(8)]
        assert lane_requests(c) == served + 1
        slot[:] = bytes(len(slot))
        results = s.submit(0, [IORange(IOOp.READ, tid, 0, 8, tid * KPU) for tid in range(8)])
        assert lane_requests(c) == served + 2
        for tid in range(8):
            kpu = bytes(slot[tid * KPU:(tid + 1) * KPU])
            assert kpu == bytes([tid + 1]) * 3 * TB + rows[tid] + bytes([tid + 1]) * 4 * TB, tid
        direct = next(t for t in range(8) if paths[t] == "direct")
        slot[8 * KPU + 100:8 * KPU + 100 + TB] = rows[0]                 # not on an LBA: bounced, in Python
        (r,) = s.submit(0, [IORange(IOOp.WRITE, direct, 5, 1, 8 * KPU + 100)])
        assert r.path == "direct" and lane_requests(c) == served + 2
        s.submit(0, [IORange(IOOp.READ, direct, 5, 1, 0)])
        assert bytes(slot[:TB]) == rows[0]


def test_pipelined_requests_are_answered_in_order(daemon: DaemonProcess) -> None:
    """Requests sent back to back without waiting (several in one receive buffer) are each answered, in order."""
    with Client(daemon.socket_path) as c, c.open_session(GEO, channels=1, slot_bytes=8 * KPU) as s:
        ch = s.channel(0)
        slot = s.slot(0)
        rows = [os.urandom(TB) for _ in range(8)]
        for t, row in enumerate(rows):
            slot[t * TB:(t + 1) * TB] = row
        ids = [ch.send([IORange(IOOp.WRITE, tid, t, 1)]) for t in range(8) for tid in range(8)]
        assert len(ids) == 64
        for _ in ids:
            (r,) = ch.receive()
            assert r.ok and r.path == "pagecache" and r.nbytes == TB
        slot[:] = bytes(len(slot))
        for tid in range(8):
            s.submit(0, [IORange(IOOp.READ, tid, 0, 8, tid * KPU)])
            assert bytes(slot[tid * KPU:(tid + 1) * KPU]) == b"".join(rows), tid


def test_a_batch_the_lane_cannot_take_is_refused_or_served_as_before(daemon: DaemonProcess) -> None:
    """A bad range in a page-cache batch refuses it whole with the range named; nothing of it ran."""
    with Client(daemon.socket_path) as c, c.open_session(GEO, channels=1, slot_bytes=2 * KPU) as s:
        slot = s.slot(0)
        first = os.urandom(KPU)
        slot[:KPU] = first
        s.write(0, "k", 0)                                  # made the file: the lane serves it from now on
        slot[:KPU] = os.urandom(KPU)
        with pytest.raises(OutOfRangeError, match="range 1: tokens \\[7, 9\\) outside"):
            s.submit(0, [IORange(IOOp.WRITE, 0, 0, 8), IORange(IOOp.WRITE, 1, 7, 2, KPU)])
        slot[:KPU] = bytes(KPU)
        s.submit(0, [IORange(IOOp.READ, 0, 0, 8, MIRROR)])
        assert bytes(slot[:KPU]) == first


def test_the_c_stream_names_what_is_wrong_with_a_frame() -> None:
    """The frame reader both ends use: a frame cut short, a stranger's bytes, an oversized frame."""
    for data, message in [(b"BD\x02\x00\x10\x00\x00\x00abc", "connection closed in the middle of a frame (11 bytes)"),
                          (b"GET / HTTP/1.1\r\n", "bad frame magic b'GE' (not a bladed peer?)"),
                          (b"BD\x07\x00\x00\x00\x00\x00", "frame format 7 not supported"),
                          (b"BD\x02\x00\x00\x00\x10\x00", "frame of 1048576 bytes exceeds the 4096-byte limit")]:
        a, b = socket.socketpair()
        with a, b:
            a.sendall(data)
            a.shutdown(socket.SHUT_WR)
            with pytest.raises(FrameError) as e:
                FrameStream(b, 4096).read()
            assert str(e.value).startswith(message)
