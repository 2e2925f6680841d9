"""One worker channel of a session: a thread that owns one Engine (one
io_uring) and the session's staging slot for that channel.

A client copy thread drives one channel; requests on one channel run in
order, requests on different channels run in parallel threads, so two copy
threads overlap their storage I/O (overlap-intra, paper §IV-C).  cffi drops
the GIL inside the engine, so channel threads really do run concurrently.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from bladed.io import BladedIOError, Engine, Op, StagingBuffer
from bladed.protocol import ErrorCode, RequestError, error_reply, ok_reply
from bladed.residency.planner import KPU, Path, Plan

if TYPE_CHECKING:
    from bladed.server.session import Session

log = logging.getLogger(__name__)

#: bounce buffer for sessions whose token rows are padded on the extent (at most this, at least one row)
BOUNCE_BYTES = 1 << 20


def bounce_bytes(plan: Plan) -> int:
    """Size of one channel's bounce buffer: whole padded rows, up to BOUNCE_BYTES and one KPU's worth.

    A request never spans more than one KPU, so more than ``max_tokens`` rows would never be used.
    """
    stride = plan.token_stride
    return max(1, min(BOUNCE_BYTES // stride, plan.geometry.max_tokens)) * stride


@dataclass
class IORequest:
    """One write or read of tokens ``[token_start, token_start + ntokens)`` of a KPU."""

    req_id: Any
    op: str                       # "read" | "write"
    kpu: KPU
    token_start: int
    ntokens: int
    reply: Callable[[dict[str, Any]], None]


_STOP = object()


@dataclass
class _Task:
    fn: Callable[[Channel], object]


class Channel:
    """A worker thread + Engine bound to one staging slot."""

    def __init__(self, session: Session, index: int, engine: Engine, slot: StagingBuffer,
                 bounce: StagingBuffer | None, max_outstanding: int) -> None:
        self.session = session
        self.index = index
        self.engine = engine
        self.slot = slot
        self.bounce = bounce
        self._bounce_lock = threading.Lock()
        self._queue: queue.Queue[Any] = queue.Queue()
        self._max = max_outstanding
        self._abandon = threading.Event()
        self.busy_ns = 0
        self.ops = 0
        self._thread = threading.Thread(target=self._run, name=f"bladed-{session.id}-ch{index}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def ensure_bounce(self) -> StagingBuffer:
        """This channel's bounce buffer for padded token rows, mapped now if it has none.

        Sessions with unaligned rows get one per channel at open when some KPU is
        on the direct path; otherwise a live demotion calls this for every channel
        *before* it moves a KPU there (from whichever worker carries it out), so
        the direct path never finds it missing.  Set once and never replaced: a
        transfer running on this channel keeps its buffer.  Added after the
        engine registered its buffers, it goes unregistered (plain, not fixed,
        buffer I/O on every backend).  Raises MemoryError if it cannot be mapped.
        """
        with self._bounce_lock:
            if self.bounce is None:
                buf = StagingBuffer(bounce_bytes(self.session.plan))
                self.session.bounces.append(buf)   # freed with the session's other buffers at close
                self.bounce = buf
            return self.bounce

    def submit(self, req: IORequest) -> None:
        """Queue a request (RequestError BUSY when the channel is backed up)."""
        if self._queue.qsize() >= self._max:
            raise RequestError(ErrorCode.BUSY, f"channel {self.index} has {self._max} requests outstanding "
                                               "(io.max_outstanding); wait for completions")
        self._queue.put(req)

    def post(self, task: Callable[[Channel], object]) -> None:
        """Queue daemon work (a live demotion) to run on this worker between requests."""
        self._queue.put(_Task(task))

    def stop(self, *, abandon: bool) -> None:
        """Finish (or, if ``abandon``: skip) queued requests, then end the thread."""
        if abandon:
            self._abandon.set()
        self._queue.put(_STOP)

    def join(self) -> None:
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while True:
            req = self._queue.get()
            if req is _STOP:
                return
            if self._abandon.is_set():
                continue  # nobody is left to answer
            if isinstance(req, _Task):
                try:
                    req.fn(self)
                except Exception:
                    log.exception("session %s channel %d: task failed", self.session.id, self.index)
                continue
            try:
                body = self._execute(req)
            except RequestError as e:
                body = error_reply(req.req_id, e.code, e.message)
            except BladedIOError as e:
                self.session.stats.io_error(req.kpu.path.value, req.op)
                body = error_reply(req.req_id, ErrorCode.IO_ERROR, str(e))
            except Exception as e:  # never let one request kill the worker
                log.exception("session %s channel %d: request failed", self.session.id, self.index)
                self.session.stats.io_error(req.kpu.path.value, req.op)
                body = error_reply(req.req_id, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
            req.reply(body)

    # -- the two paths -----------------------------------------------------------
    def _execute(self, req: IORequest) -> dict[str, Any]:
        # a pending live demotion of this KPU is carried out first (bladed.server.replan)
        live = self.session.live
        tid = req.kpu.tensor_id
        req.kpu = live.begin(tid, self)
        try:
            body = self._serve(req)
        finally:
            live.end(tid)
        if req.op == "write":
            live.wrote(tid, req.token_start + req.ntokens)
        return body

    def _serve(self, req: IORequest) -> dict[str, Any]:
        sess = self.session
        tb = sess.geometry.token_bytes
        off, nbytes = req.token_start * tb, req.ntokens * tb
        t0 = time.monotonic_ns()
        hit: float | None = None
        if req.kpu.path is Path.PAGECACHE:
            hit = self._pagecache(req, off, nbytes)
        else:
            self._direct(req, off, nbytes)
        if sess.checksums is not None:
            # record (write) or verify (read) the crc32c of each token row: bladed.server.integrity
            try:
                sess.checksums.after(req.op, req.kpu.tensor_id, req.kpu.layer, req.kpu.kind, self.slot.view(),
                                     req.token_start, req.ntokens)
            except RequestError:
                sess.stats.add("integrity_errors")
                raise
        t1 = time.monotonic_ns()
        dt = t1 - t0
        self.busy_ns += dt
        self.ops += 1
        sess.stats.observe_io(req.kpu.path.value, req.op, nbytes, dt / 1e9, hit)
        return ok_reply(req.req_id, path=req.kpu.path.value, nbytes=nbytes, service_ns=dt, hit_ratio=hit,
                        started_ns=t0, finished_ns=t1)

    def _pagecache(self, req: IORequest, off: int, nbytes: int) -> float | None:
        """Group 1 (and every KPU in baseline/cachepolicy): memcpy between the slot and the mmap'd file."""
        f = self.session.pc_files[req.kpu.tensor_id]
        hit: float | None = None
        if req.op == "write":
            f.write_from(self.slot, off, nbytes, src_offset=off)
        else:
            hit = float(f.read_into(self.slot, off, nbytes, dst_offset=off))
        if req.kpu.drop_after_use:
            # CachePolicy-Only (Table III): Group 2 is evicted right after use
            f.drop()
        return hit

    def _direct(self, req: IORequest, off: int, nbytes: int) -> None:
        """Group 2: NVMe commands straight between the extent and the shared staging pages."""
        sess = self.session
        geo = sess.geometry
        op = Op.WRITE if req.op == "write" else Op.READ
        tid = req.kpu.tensor_id
        if sess.plan.aligned:
            # Algorithm 2 with a box of whole token rows; the slot mirrors the KPU, so the
            # bytes go by DMA between the client's pages and the device (Co-DMA, §IV-B)
            slba, req_bytes = sess.extent_map.translate(
                tid, geo.shape, (req.token_start, 0, 0), (req.ntokens, geo.shape[1], geo.shape[2]), geo.dtype_bytes)
            self.engine.run([self.engine.transfer(op, slba, self.slot, offset=off, nbytes=req_bytes)])
            return
        # Token rows are padded to the LBA on the extent (the §IV-B precondition
        # does not hold): move whole padded rows through the bounce buffer.
        buf = self.ensure_bounce()   # already there: mapped at open or before the demotion committed
        tb = geo.token_bytes
        stride = sess.plan.token_stride
        rows = max(1, buf.nbytes // stride)
        bounce = np.frombuffer(buf.view(), np.uint8)
        slot = np.frombuffer(self.slot.view(), np.uint8)
        t, end = req.token_start, req.token_start + req.ntokens
        while t < end:
            k = min(rows, end - t)
            slba, req_bytes = sess.extent_map.translate(
                tid, geo.shape, (t, 0, 0), (k, geo.shape[1], geo.shape[2]), geo.dtype_bytes)
            # one strided copy per bounce-full of rows (no Python per row)
            padded_rows = bounce[:k * stride].reshape(k, stride)[:, :tb]
            dense_rows = slot[t * tb:(t + k) * tb].reshape(k, tb)
            if op is Op.WRITE:
                padded_rows[...] = dense_rows
                self.engine.write(slba, buf, nbytes=req_bytes)
            else:
                self.engine.read(slba, buf, nbytes=req_bytes)
                dense_rows[...] = padded_rows
            t += k
