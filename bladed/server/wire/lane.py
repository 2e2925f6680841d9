"""The lane: a data connection's requests whose ranges all address KPUs with open gates, served in C.

Every one-token append and most of a decode step's reads are such requests.
In Python each step of a round trip (framing, checking, counting, copying,
replying) cost microseconds on an edge CPU: a one-token page-cache round trip
stayed at 4.4x a framed ping-pong (docs/benchmarks.md, "The page-cache lane"),
and a one-token direct write at 2.5-3.2x a bare io_uring write ("The request
loop in C").  So the loop of a data connection runs in C (``bd_lane_run``,
``cffi_build/bladed_lane.c``): it reads each frame, checks it with ``bd_lane_check``,
a pre-filter that takes exactly what ``sessions.rules.check_ranges`` accepts
(``tests/test_lane_rules.py``) and hands anything else to Python, takes the channel lock
(a C mutex, the one :class:`~bladed.server.storage.channel.Channel` hands Python),
counts itself in on each KPU's gate (``bladed.server.storage.gates``), runs the ranges
and sends the reply, without coming back to Python:

* a plain page-cache KPU by copy between the slot and the KPU's file;
* a direct KPU whose token rows are whole LBAs (the §IV-B precondition) by one
  transfer on the channel's ring straight between the slot and the KPU's LBAs
  (Algorithm 2), when the slot offset sits on an LBA.  All the request's
  transfers are queued together, writes first, and the page-cache copies run
  while the device works.

It counts what it served per path (read by :class:`Stats` when asked).

Anything else comes back to Python untouched: a JSON frame, a request that is
malformed or out of range, a KPU dropped after use, whose file does not exist
yet or that was not used yet on the extent, a direct KPU of packed rows (edge
LBAs and tails are the extent store's), a direct range whose slot offset is
not on an LBA, or a closed gate (a pending demotion, a session closing or
retained, checksums on).  The connection serves it with
:meth:`ServedSession.execute`, which serves it or refuses it with the exact error,
and then opens the gates that have become openable.  A request the lane ran
where a range failed also comes back, for its reply with the failure's
message.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any

from bladed._uring import ffi, lib
from bladed.io import transfer_error
from bladed.protocol import (
    HEADER,
    IO_FORMAT,
    IO_RANGE,
    IO_REPLY,
    IO_REQUEST,
    IO_RESULT,
    MAX_RANGES,
    NO_HIT,
    ConnectionClosed,
    ErrorCode,
    FrameError,
    FrameStream,
    IOOp,
    RangeResult,
    RequestError,
    decode_io_request,
    encode_io_refusal,
    encode_io_reply,
)
from bladed.residency.planner import KVPath
from bladed.server.metrics import LATENCY_BOUNDS_NS
from bladed.server.sessions.session import ServedSession
from bladed.server.storage.channel import Channel
from bladed.server.storage.pagecache_store import range_failure

log = logging.getLogger("bladed.connection")

# the lane's C histogram has BD_LANE_BOUNDS buckets; cffi would pad a shorter bounds list with zeroes
assert len(LATENCY_BOUNDS_NS) == lib.BD_LANE_BOUNDS, "metrics.LATENCY_BUCKETS and BD_LANE_BOUNDS disagree"

_PATH_NAMES = {lib.BD_PATH_PAGECACHE: KVPath.PAGECACHE.value, lib.BD_PATH_DIRECT: KVPath.DIRECT.value}


class Lane:
    """The lane of one data connection, attached to channel ``ch`` of session ``sess``."""

    def __init__(self, sess: ServedSession, ch: Channel, sock: socket.socket, limit: int) -> None:
        self.sess = sess
        self.ch = ch
        #: ranges one request may carry (``io.max_outstanding``)
        self.limit = limit
        #: requests that came back to Python (:meth:`serve`)
        self.general_requests = 0
        limit = max(1, min(limit, MAX_RANGES))
        g = sess.geometry
        gates = sess.live.gates
        lane = ffi.new("struct bd_lane *")
        self._rows = ffi.new("struct bd_lane_row[]", limit)
        self._reply = ffi.new("uint8_t[]", HEADER.size + IO_REPLY.size + limit * IO_RESULT.size)
        self._scratch = ffi.new("uint64_t[]", 2 * limit)
        lane.chan = ch.chan
        lane.gates = gates.array
        lane.ngates = gates.count
        lane.token_bytes = g.token_bytes
        lane.max_tokens = g.max_tokens
        lane.limit = limit
        lane.slot = ch.slot.address
        lane.slot_bytes = sess.slot_bytes
        lane.bounds_ns = list(LATENCY_BOUNDS_NS)
        lane.rows = self._rows
        lane.reply = self._reply
        lane.scratch = self._scratch
        lba = sess.plan.lba_size
        slot = ch.slot
        if sess.plan.aligned and slot.address % lba == 0:
            # direct KPUs (now, or after a demotion): the channel's ring, and the device's target for the slot
            self._xfers = ffi.new("struct bd_xfer[]", limit)
            self._done = ffi.new("struct bd_xfer *[]", limit)
            lane.target = ch.engine.target_for(slot.address, slot.nbytes)
            lane.ring = ch.engine.ring.c
            lane.lba_bytes = lba
            lane.xfers = self._xfers
            lane.done = self._done
        self.c = lane
        #: frames in and out: the same C stream the lane reads through
        self.stream = FrameStream(sock, into=ffi.addressof(lane, "stream"))
        #: the KPUs whose gates may still open (DemotionState.open_lane_gates decides, and prunes it); refresh fills
        #: it with every KPU whenever the demotions done (DemotionState.lane_epoch) differ from this
        self._candidates: set[int] = set()
        self._epoch = -1
        self._served_before = ch.lane_requests
        self.refresh()

    @property
    def served(self) -> int:
        """Requests the lane served on this channel since this connection attached."""
        return self.ch.lane_requests - self._served_before

    def next(self) -> tuple[int, memoryview] | bytes:
        """Serve requests in C until one needs Python: ``(format, body)`` of a frame the lane does not serve
        (valid until the next call), or the reply frame of a request the lane ran in which a range failed.

        Raises as :meth:`FrameStream.read` does when the connection ends or breaks, OSError when a reply
        cannot be sent or the channel's ring failed (the connection ends)."""
        r = lib.bd_lane_run(self.c)
        if r == 0:
            return self.stream.frame()
        if r == 1:
            return self._partial_reply()
        raise self.stream.error(r)

    def serve(self, refuse: Callable[[ErrorCode, str], None], pid: int) -> str:
        """Serve binary I/O requests until the peer or the session goes; returns why it ended.  The lane runs
        what it can in C; the rest comes back here for :meth:`ServedSession.execute` (counted in
        :attr:`general_requests`); ``refuse(code, message)`` counts a request the client got wrong."""
        sess, ch = self.sess, self.ch.index
        send = self.stream.send
        while True:
            try:
                got = self.next()
            except ConnectionClosed:
                return "closed" if not sess.closing else "session_closed"
            if isinstance(got, bytes):      # the lane ran it; a range failed
                send(got)
                continue
            fmt, body = got
            if fmt != IO_FORMAT:
                raise FrameError("a JSON frame on a data connection (only binary I/O frames after attach)")
            self.general_requests += 1
            req_id = 0
            try:
                req_id, ranges = decode_io_request(body)
                data = encode_io_reply(req_id, sess.execute(ch, ranges, self.limit))
            except RequestError as e:
                if not req_id and len(body) >= IO_REQUEST.size:
                    req_id = IO_REQUEST.unpack_from(body)[0]     # a malformed request's id, for its refusal
                refuse(e.code, e.message)
                data = encode_io_refusal(req_id, e.code, e.message)
            except Exception as e:
                log.exception("I/O request of pid %d on session %s channel %d failed", pid, sess.id, ch)
                data = encode_io_refusal(req_id, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
            self.refresh()          # a KPU file that request made: the lane serves it from now on
            send(data)

    def refresh(self) -> None:
        """Open the gates that can open now (after the general path made a KPU's file or bound its LBAs)."""
        live = self.sess.live
        if live.lane_epoch != self._epoch:       # (again after a demotion: the KPU may open on the direct path)
            self._epoch = live.lane_epoch
            self._candidates = {k.tensor_id for k in self.sess.plan.kpus}
        if self._candidates:
            with self.ch.lock:
                live.open_lane_gates(self._candidates)

    def _partial_reply(self) -> bytes:
        lane = self.c
        tb = lane.token_bytes
        body = self.stream.frame()[1]
        results = []
        for i in range(lane.nrows):
            row = lane.rows[i]
            if row.err:
                op, tid, t0, nt, _ = IO_RANGE.unpack_from(body, IO_REQUEST.size + i * IO_RANGE.size)
                results.append(RangeResult(ErrorCode.IO_ERROR, self._failure(row, i, op == IOOp.WRITE, tid,
                                                                             t0 * tb, nt * tb)))
            else:
                results.append(RangeResult(path=_PATH_NAMES[row.path], nbytes=row.nbytes, service_ns=row.service_ns,
                                           hit_bytes=None if row.hit == NO_HIT else row.hit,
                                           started_ns=row.started_ns, finished_ns=row.finished_ns))
        return encode_io_reply(int(lane.req_id), results)

    def _failure(self, row: Any, i: int, write: bool, tensor_id: int, offset: int, nbytes: int) -> str:
        """The message the general path gives for the same failure."""
        if row.path == lib.BD_PATH_DIRECT:
            # the transfer's own account, as ExtentKPUStore words it
            err = transfer_error(self.c.xfers[i], self.ch.engine.describe_target)
            return f"direct {'write' if write else 'read'} of {self.sess.plan.kpu(tensor_id).name}: {err}"
        # only a pwrite fails on the page-cache path (a read copies from the mapping)
        store = self.sess.pagecache
        assert store is not None
        f = store.file(tensor_id)
        return range_failure(write, f.name, f.write_error(row.err, offset, nbytes))


__all__ = ["Lane"]
