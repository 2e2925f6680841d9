"""A serving engine's KV offloading over a block pool, with no engine's API in it: the scheduler's side
(:class:`BlockManager`: lookups, reservations, pins) and the worker's side (:class:`BlockWorker`: jobs that move
the pages of an engine's KV blocks between its cache tensors and the pool, on a thread of their own).

Faults never reach the engine: with the daemon absent or restarted, a lookup is a miss, a store is dropped
and a load's blocks are reported as failed (the engine recomputes them), each outage logged once, and the
connection tried again at most every :data:`RETRY_S` seconds.  A load reads its blocks, then asks the daemon
whether each slot still holds the block it pinned (its generation); a block that fails its crc or that check
is failed, never handed over.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from bladed.blocks import PoolAttachment, PoolControl, PoolKey, Reservation, SlotGen
from bladed.client import Client
from bladed.protocol import BladedError, IOOp

#: seconds between attempts to reach a daemon that was not there
RETRY_S = 5.0
#: the connect and handshake timeout: a daemon that does not answer is a miss, not a stall of the engine
CONNECT_TIMEOUT_S = 2.0
_T = TypeVar("_T")


class _Link:
    """A lazily made connection to the daemon that logs an outage once and retries at most every RETRY_S."""

    def __init__(self, socket_path: str | None, log: logging.Logger, what: str, retry_s: float = RETRY_S) -> None:
        self.socket_path = socket_path
        self.retry_s = retry_s
        self.log = log
        self.what = what
        self.client: Client | None = None
        self._down_since: float | None = None
        self._next_try = 0.0
        self.lock = threading.RLock()

    def get(self, make: Callable[[Client], _T]) -> tuple[Client, _T] | None:
        """A client and what ``make`` built on it, or None while the daemon is out of reach."""
        with self.lock:
            if self.client is not None:       # what was built on it is gone: start again
                self.client.close()
                self.client = None
            if time.monotonic() < self._next_try:
                return None
            try:
                c = Client(self.socket_path, timeout=CONNECT_TIMEOUT_S, name=f"bladed.integrations/{self.what}")
                try:
                    out = make(c)
                except BaseException:
                    c.close()
                    raise
            except (BladedError, OSError) as e:
                self.lost(e)
                return None
            if self._down_since is not None:
                self.log.info("bladed is back (%s): KV offloading resumes", self.what)
            self._down_since = None
            self.client = c
            return c, out

    def lost(self, why: BaseException) -> None:
        """The daemon went away (or refused): drop the connection; the first time, one warning line."""
        with self.lock:
            if self.client is not None:
                self.client.close()
                self.client = None
            self._next_try = time.monotonic() + self.retry_s
            if self._down_since is None:
                self._down_since = time.monotonic()
                self.log.warning("bladed unreachable (%s: %s): KV blocks are recomputed until it is back",
                                 self.what, str(why).splitlines()[0] if str(why) else type(why).__name__)

    def close(self) -> None:
        with self.lock:
            if self.client is not None:
                self.client.close()
                self.client = None


class BlockManager:
    """The scheduler's side: which blocks the pool holds, slots for new ones, pins for loads."""

    def __init__(self, key: PoolKey, socket_path: str | None = None, log: logging.Logger | None = None,
                 retry_s: float = RETRY_S) -> None:
        self.key = key
        self.log = log or logging.getLogger("bladed.integrations")
        self._link = _Link(socket_path, self.log, "scheduler", retry_s)
        self._pool: PoolControl | None = None
        #: reservations not yet completed: key -> (slot, generation)
        self._reserved: dict[bytes, SlotGen] = {}
        #: pins of loads not yet completed: key -> their (slot, generation)s
        self._pins: dict[bytes, list[SlotGen]] = collections.defaultdict(list)

    def _control(self) -> PoolControl | None:
        if self._pool is not None:
            return self._pool
        got = self._link.get(lambda c: PoolControl(c, self.key))
        if got is not None:
            self._pool = got[1]
            self._reserved.clear()
            self._pins.clear()
        return self._pool

    def _do(self, call: Callable[[PoolControl], _T], default: _T) -> _T:
        for again in (True, False):
            pool = self._control()
            if pool is None:
                return default
            try:
                return call(pool)
            except (BladedError, OSError, TimeoutError) as e:
                self._pool = None
                if again and isinstance(e, ConnectionError):
                    self._link.close()      # a restarted daemon: one more try on a new connection, at once
                    continue
                self._link.lost(e)
        return default

    def lookup(self, keys: Sequence[bytes]) -> list[str]:
        """Per key: ``ready``, ``pending`` or ``miss`` (every one a miss while the daemon is away)."""
        return self._do(lambda p: p.lookup(keys), ["miss"] * len(keys))

    def prepare_load(self, keys: Sequence[bytes]) -> list[SlotGen | None]:
        """Pin ``keys`` for a load; a key gone meanwhile (or the daemon) is None: its block fails to load."""
        none: list[SlotGen | None] = [None] * len(keys)
        got = self._do(lambda p: p.pin(keys), none)
        for k, x in zip(keys, got, strict=True):
            if x is not None:
                self._pins[k].append(x)
        return got

    def complete_load(self, keys: Iterable[bytes]) -> None:
        items = [self._pins[k].pop() for k in keys if self._pins.get(k)]
        if items:
            self._do(lambda p: p.unpin(items), None)

    def prepare_store(self, keys: Sequence[bytes]) -> Reservation | None:
        """Slots for the keys the pool lacks (least recently used blocks evicted for them); None when nothing
        can be stored (the daemon away, or every slot being read)."""
        r = self._do(lambda p: p.reserve(keys), None)
        if r is None or (not r.store and r.refused):
            return None
        for k, s, g in r.store:
            self._reserved[k] = (s, g)
        return r

    def complete_store(self, keys: Iterable[bytes]) -> list[bytes]:
        """A store job is done: reserved slots its worker did not commit are freed; the keys it stored."""
        items = {k: self._reserved.pop(k) for k in keys if k in self._reserved}
        if not items:
            return []
        aborted = set(self._do(lambda p: p.abort(items.values()), [s for s, _ in items.values()]))
        return [k for k, (s, _) in items.items() if s not in aborted]

    def touch(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._do(lambda p: p.touch(keys), None)

    def evict_all(self) -> list[bytes]:
        return self._do(lambda p: p.evict(None), [])

    def close(self) -> None:
        self._link.close()


@dataclass
class Job:
    """One transfer: ``op`` WRITE stores the engine's blocks ``block_ids`` into ``slots``, READ loads them."""

    job_id: int
    op: IOOp
    block_ids: list[int]
    slots: list[SlotGen | None]
    done: threading.Event = field(default_factory=threading.Event)
    nbytes: int = 0
    seconds: float = 0.0
    #: the engine's blocks whose load failed (to be recomputed)
    failed: list[int] = field(default_factory=list)


class BlockWorker:
    """The worker's side: jobs run in order on a thread of their own, each in pieces of ``slot_blocks`` blocks
    through the staging slot (one batched request per run of consecutive slots)."""

    def __init__(self, key: PoolKey, caches: Sequence[Any], *, slot_blocks: int = 64, socket_path: str | None = None,
                 log: logging.Logger | None = None, retry_s: float = RETRY_S) -> None:
        """``caches``: the engine's KV cache tensors, one per page of a block, each ``[num_blocks, page_bytes]``
        of 1-byte elements (torch)."""
        import torch

        if len(caches) != key.pages or any(tuple(c.shape[1:]) != (key.page_bytes,) or c.element_size() != 1
                                           for c in caches):
            raise ValueError(f"the KV caches are not {key.pages} tensors of [num_blocks, {key.page_bytes}] bytes")
        self.torch = torch
        self.key = key
        self.caches = list(caches)
        self.slot_blocks = slot_blocks
        self.log = log or logging.getLogger("bladed.integrations")
        self._link = _Link(socket_path, self.log, "worker", retry_s)
        self._att: PoolAttachment | None = None
        self._control: PoolControl | None = None
        self._staging: Any = None
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._finished: list[Job] = []
        self._jobs: dict[int, Job] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="bladed-offload", daemon=True)
        self._thread.start()

    # -- the engine's calls -----------------------------------------------------------------
    def submit(self, job_id: int, op: IOOp, block_ids: Sequence[int], slots: Sequence[SlotGen | None]) -> bool:
        job = Job(job_id, op, [int(b) for b in block_ids], list(slots))
        with self._lock:
            self._jobs[job_id] = job
        self._queue.put(job)
        return True

    def get_finished(self) -> list[Job]:
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: Iterable[int]) -> None:
        for j in job_ids:
            with self._lock:
                job = self._jobs.get(j)
            if job is not None:
                job.done.wait()

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._drop()
        self._link.close()

    # -- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            t0 = time.perf_counter()
            for again in (True, False):
                job.failed, job.nbytes = [], 0
                try:
                    self._transfer(job)
                    break
                except Exception as e:      # never the engine's problem: a lost store, or blocks recomputed
                    self._drop()
                    if again and isinstance(e, ConnectionError):
                        continue            # a restarted daemon: the job once more, on a new connection
                    self._link.lost(e)
                    if job.op is IOOp.READ:
                        job.failed = list(job.block_ids)
            job.seconds = time.perf_counter() - t0
            with self._lock:
                self._jobs.pop(job.job_id, None)
                self._finished.append(job)
            job.done.set()

    def _attached(self) -> tuple[PoolAttachment, PoolControl] | None:
        if self._att is not None and self._control is not None:
            return self._att, self._control
        got = self._link.get(lambda c: (PoolAttachment(c, self.key, slot_blocks=self.slot_blocks),
                                        PoolControl(c, self.key)))
        if got is None:
            return None
        self._att, self._control = got[1]
        kpus = 2 * ((self.key.pages + 1) // 2)
        self._staging = self.torch.frombuffer(self._att.slot(0), dtype=self.torch.int8).view(
            kpus, self.slot_blocks, self.key.page_bytes)
        return self._att, self._control

    def _drop(self) -> None:
        self._staging = None
        if self._att is not None:
            with contextlib.suppress(BladedError, OSError, BufferError):
                self._att.close()
        self._att = self._control = None
        self._link.close()

    def _transfer(self, job: Job) -> None:
        got = self._attached()
        if got is None:
            if job.op is IOOp.READ:
                job.failed = list(job.block_ids)
            return
        att, control = got
        n = self.slot_blocks
        for i in range(0, len(job.block_ids), n):
            ids, slots = job.block_ids[i:i + n], job.slots[i:i + n]
            if job.op is IOOp.WRITE:
                self._store(att, control, job, ids, slots)
            else:
                self._load(att, control, job, ids, slots)

    def _store(self, att: PoolAttachment, control: PoolControl, job: Job, ids: list[int],
               slots: list[SlotGen | None]) -> None:
        keep = [(b, s) for b, s in zip(ids, slots, strict=True) if s is not None]
        if not keep:
            return
        torch = self.torch
        index = torch.tensor([b for b, _ in keep], dtype=torch.long)
        for p, cache in enumerate(self.caches):
            torch.index_select(cache, 0, index, out=self._staging[p, :len(keep)])
        results = att.move(IOOp.WRITE, [s for _, (s, _) in keep])
        bad = _failed_slots(results)
        items = [sg for _, sg in keep if sg[0] not in bad]
        if items:
            control.commit(items)
        job.nbytes += len(items) * self.key.pages * self.key.page_bytes

    def _load(self, att: PoolAttachment, control: PoolControl, job: Job, ids: list[int],
              slots: list[SlotGen | None]) -> None:
        job.failed += [b for b, s in zip(ids, slots, strict=True) if s is None]
        keep = [(b, s) for b, s in zip(ids, slots, strict=True) if s is not None]
        if not keep:
            return
        wanted = [s for _, (s, _) in keep]
        bad = _failed_slots(att.move(IOOp.READ, wanted))
        if len(bad) > 1:
            # a range fails for its whole run of slots: read slot by slot to keep the good ones (rare: corruption)
            bad = _failed_slots(att.move(IOOp.READ, wanted, runs=False))
        # read first, then ask: a slot that still holds the generation pinned held it during the read
        valid = control.verify([sg for _, sg in keep])
        good = [(i, b) for i, ((b, (s, _)), ok) in enumerate(zip(keep, valid, strict=True)) if ok and s not in bad]
        job.failed += [b for (b, (s, _)), ok in zip(keep, valid, strict=True) if not ok or s in bad]
        if len(good) < len(keep):
            self.log.warning("bladed: %d of %d blocks failed to load (checksum or evicted); recomputing them",
                             len(keep) - len(good), len(keep))
        if not good:
            return
        torch = self.torch
        rows = torch.tensor([i for i, _ in good], dtype=torch.long)
        index = torch.tensor([b for _, b in good], dtype=torch.long)
        for p, cache in enumerate(self.caches):
            cache.index_copy_(0, index, self._staging[p].index_select(0, rows))
        job.nbytes += len(good) * self.key.pages * self.key.page_bytes


def _failed_slots(results: list[tuple[Any, Any]]) -> set[int]:
    """The slots of every range that failed (a range covers a run of slots of one page)."""
    return {s for rng, r in results if r.error is not None
            for s in range(rng.token_start, rng.token_start + rng.ntokens)}


__all__ = ["CONNECT_TIMEOUT_S", "RETRY_S", "BlockManager", "BlockWorker", "Job"]
