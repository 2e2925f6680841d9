"""Adaptive pipeline parallelism (Dual-Blade §IV-C), independent of any model.

A layer's KV load is a list of jobs, one per copy thread (thread 1 K, thread 2
V). Each job is a storage *read* into the thread's own staging slot followed by
a *DMA* from the slot to the compute device. The DMA engine is one resource:
H2D copies are serialised (one copy engine; on CUDA, one copy stream).

Strategies:

* ``intra`` (overlap-intra): all threads read storage in parallel, the DMAs
  follow one at a time.
* ``cross`` (overlap-cross): staggered start; thread i+1's read starts when
  thread i's read finishes, so it overlaps thread i's DMA on the other
  hardware path.
* ``off``: no pipeline parallelism; read, DMA, read, DMA one after another.

``AdaptivePipeline(mode="adaptive")`` runs decode iteration 1 as a warm-up
and fixes, separately for each group (1 = page-cache path, 2 = NVMe-direct),
the strategy with the higher measured throughput for the rest of the run.  The
paper measures iteration 2 under overlap-intra and iteration 3 under
overlap-cross; bladed measures both in iteration 2, on alternate layers of each
group (intra, cross, intra, ...), and decides at its end.  The trial then
costs half an iteration in the worse strategy, not a whole one (in the KV
sweep's 5-step runs of q8 and q4 rows, the whole overlap-cross iteration took
1.2-1.55 x the other steps: docs/bench/HISTORY.md, "Issue 31 evening"), and
both are measured under the same conditions, alternately, not one iteration
apart.  A group with a single layer in iteration 2 is measured under
overlap-cross in iteration 3, as the paper does.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

Strategy = Literal["intra", "cross", "off"]
PipelineMode = Literal["adaptive", "intra", "cross", "off"]
PIPELINE_MODES: tuple[str, ...] = ("adaptive", "intra", "cross", "off")

T = TypeVar("T")

WARMUP_ITER = 1
#: both strategies on alternate layers of each group
TRIAL_ITER = 2
#: overlap-cross for a group that had one layer in the trial iteration
CROSS_ITER = 3


class CopyThread:
    """A real thread with a FIFO of jobs; it owns staging slot ``index``."""

    def __init__(self, index: int, name: str = "bladed-copy") -> None:
        self.index = index
        self._q: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"{name}-{index}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        self._q.put((fn, fut))
        return fut

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()

    @property
    def ident(self) -> int | None:
        return self._thread.ident


class CopyThreadPool:
    """``n`` copy threads; thread ``i`` owns staging slot ``i`` of every backend."""

    def __init__(self, n: int = 2, name: str = "bladed-copy") -> None:
        if n < 1:
            raise ValueError("need at least one copy thread")
        self.threads = [CopyThread(i, name) for i in range(n)]

    def __len__(self) -> int:
        return len(self.threads)

    def submit(self, ch: int, fn: Callable[[], T]) -> Future[T]:
        return self.threads[ch % len(self.threads)].submit(fn)

    def drain(self) -> None:
        """Wait until every job submitted so far has run."""
        for f in [t.submit(lambda: None) for t in self.threads]:
            f.result()

    def close(self) -> None:
        for t in self.threads:
            t.close()


@dataclass
class LoadJob:
    """One thread's share of a layer load: storage -> slot, then slot -> device."""

    read: Callable[[], Any]
    dma: Callable[[], Any]
    nbytes: int


@dataclass
class LoadHandle:
    """The in-flight load of one layer; ``result()`` gives the DMA results in job order."""

    group: int
    strategy: Strategy
    nbytes: int
    futures: list[Future[Any]] = field(default_factory=list)
    t_start: int = 0
    t_end: int = 0
    read_results: list[Any] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def result(self) -> list[Any]:
        return [f.result() for f in self.futures]

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def _mark(self, start: int | None = None, end: int | None = None) -> None:
        with self._lock:
            if start is not None and (self.t_start == 0 or start < self.t_start):
                self.t_start = start
            if end is not None and end > self.t_end:
                self.t_end = end

    @property
    def span_ns(self) -> int:
        return max(0, self.t_end - self.t_start)


@dataclass
class GroupSample:
    nbytes: int = 0
    ns: int = 0
    loads: int = 0

    @property
    def gbps(self) -> float:
        return self.nbytes / self.ns if self.ns else 0.0

    def add(self, h: LoadHandle) -> None:
        self.nbytes += h.nbytes
        self.ns += h.span_ns
        self.loads += 1


class AdaptivePipeline:
    """Schedules layer loads on the copy threads under the current strategy.

    Call :meth:`begin_iteration` with the decode iteration number (0 = prefill,
    1 = first decode step), submit loads with :meth:`load`, and call
    :meth:`end_iteration` when the step is over.
    """

    def __init__(self, pool: CopyThreadPool, mode: PipelineMode = "adaptive",
                 dma_lock: threading.Lock | None = None) -> None:
        if mode not in PIPELINE_MODES:
            raise ValueError(f"pipeline mode {mode!r} not in {PIPELINE_MODES}")
        self.pool = pool
        self.mode: PipelineMode = mode
        self.dma_lock = dma_lock or threading.Lock()
        self.iteration = 0
        self.decision: dict[int, Strategy] = {}
        self.samples: dict[int, dict[int, GroupSample]] = {}  # iteration -> group -> sample
        #: the adaptive trial's measurements: group -> strategy -> sample
        self.trial: dict[int, dict[Strategy, GroupSample]] = {}
        self._cur: dict[int, GroupSample] = {}
        self._pending: list[LoadHandle] = []
        self._trial_loads: dict[int, int] = {}   # group -> loads submitted in the trial iteration

    # -- strategy --------------------------------------------------------
    def strategy_for(self, group: int) -> Strategy:
        """The strategy of the next load of ``group`` (in the trial iteration, alternately intra and cross)."""
        if self.mode != "adaptive":
            return self.mode
        if group in self.decision:
            return self.decision[group]
        if self.iteration == TRIAL_ITER:
            return "cross" if self._trial_loads.get(group, 0) % 2 else "intra"
        if self.iteration == CROSS_ITER and "cross" not in self.trial.get(group, {}):
            return "cross"
        return "intra"  # prefill, warm-up, and a group first seen after the trial

    def begin_iteration(self, it: int) -> None:
        self.iteration = it
        self._cur = {}
        self._pending = []
        self._trial_loads = {}

    def end_iteration(self) -> None:
        trial = self.mode == "adaptive" and self.iteration in (TRIAL_ITER, CROSS_ITER)
        for h in self._pending:
            h.result()
            self._cur.setdefault(h.group, GroupSample()).add(h)
            if trial and h.group not in self.decision:
                self.trial.setdefault(h.group, {}).setdefault(h.strategy, GroupSample()).add(h)
        self.samples[self.iteration] = self._cur
        self._pending = []
        if trial:
            for g, by in sorted(self.trial.items()):
                if g not in self.decision and "intra" in by and "cross" in by:
                    self.decision[g] = "cross" if by["cross"].gbps > by["intra"].gbps else "intra"

    # -- scheduling ------------------------------------------------------
    def load(self, jobs: Sequence[LoadJob], group: int, *, exclusive_dma: bool = True) -> LoadHandle:
        """Submit one layer's jobs (job i on copy thread i). ``exclusive_dma``: their DMAs one at a time (a GPU
        link's one copy engine); False where each "DMA" is its copy thread's own CPU copy, which may run at once."""
        strategy = self.strategy_for(group)
        if self.iteration == TRIAL_ITER:
            self._trial_loads[group] = self._trial_loads.get(group, 0) + 1
        h = LoadHandle(group=group, strategy=strategy, nbytes=sum(j.nbytes for j in jobs))
        n = len(jobs)
        read_done = [threading.Event() for _ in range(n)]
        all_done = [threading.Event() for _ in range(n)]
        dma_lock: Any = self.dma_lock if exclusive_dma else contextlib.nullcontext()
        h.read_results = [None] * n

        def run(i: int, job: LoadJob) -> Any:
            try:
                if i > 0 and strategy == "cross":
                    read_done[i - 1].wait()
                elif i > 0 and strategy == "off":
                    all_done[i - 1].wait()
                t0 = time.perf_counter_ns()
                h._mark(start=t0)
                h.read_results[i] = job.read()
                read_done[i].set()
                with dma_lock:
                    out = job.dma()
                h._mark(end=time.perf_counter_ns())
                return out
            finally:
                read_done[i].set()
                all_done[i].set()

        for i, job in enumerate(jobs):
            h.futures.append(self.pool.submit(i, _bind(run, i, job)))
        if self.iteration > 0:
            self._pending.append(h)
        return h

    def report(self) -> dict[str, Any]:
        """The decision and the measured per-group throughputs (GB/s) of the trial."""
        def row(it: int) -> dict[str, float]:
            return {str(g): round(s.gbps, 4) for g, s in sorted(self.samples.get(it, {}).items())}

        def trial(strategy: Strategy) -> dict[str, float]:
            return {str(g): round(by[strategy].gbps, 4) for g, by in sorted(self.trial.items()) if strategy in by}

        out: dict[str, Any] = {"mode": self.mode,
                               "decision": {str(g): s for g, s in sorted(self.decision.items())}}
        if self.mode == "adaptive":
            out["intra_GBps"] = trial("intra")
            out["cross_GBps"] = trial("cross")
        out["per_iteration_GBps"] = {str(it): row(it) for it in sorted(self.samples) if it > 0}
        return out


def _bind(fn: Callable[[int, LoadJob], Any], i: int, job: LoadJob) -> Callable[[], Any]:
    return lambda: fn(i, job)


class TorchDma:
    """The copies between staging slots and the compute device. CPU: a tensor copy. CUDA: copies on a stream of
    the copy thread's own, waited on with an event.

    ``run(fn)`` runs ``fn`` (which issues the copies) and returns once the copies are complete, so the staging
    slot can be reused. The *consumer* stream is the one current on the thread that made this object (the
    compute thread's); on CUDA two stream hazards are handled here:

    * a copy *from* the device reads what the consumer stream produced, so the copy stream first waits for
      it: for the event ``after`` (:meth:`produced`, recorded on the compute thread when it handed the tensor
      over: that work and no later), else for everything queued on the consumer stream so far (the safe
      default). A copy that reads host memory only (slot to device) passes ``independent=True`` and waits
      for nothing, so it overlaps the compute;
    * a tensor that ``fn`` allocates on the copy stream and returns is used on the consumer stream: it is
      recorded there (``record_stream``), so the caching allocator does not hand its memory to the next copy
      while the consumer stream may still read it.
    """

    def __init__(self, device: Any = "cpu") -> None:
        import torch

        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._streams: dict[int, Any] = {}
        self._torch = torch
        #: where the copies' results are used: the stream current on the thread that made this object
        self.consumer = torch.cuda.current_stream(self.device) if self.cuda else None

    def stream(self) -> Any:
        if not self.cuda:
            return None
        tid = threading.get_ident()
        s = self._streams.get(tid)
        if s is None:
            s = self._streams[tid] = self._torch.cuda.Stream(device=self.device)
        return s

    def produced(self) -> Any:
        """On the compute thread: an event after the work queued so far on its current stream, for ``run(after=)``
        of a copy that reads that work's output; None on CPU."""
        if not self.cuda:
            return None
        ev = self._torch.cuda.Event()
        ev.record(self._torch.cuda.current_stream(self.device))
        return ev

    def run(self, fn: Callable[[], T], after: Any = None, *, independent: bool = False) -> T:
        if not self.cuda:
            return fn()
        torch = self._torch
        s = self.stream()
        with torch.cuda.stream(s):
            if after is not None:
                s.wait_event(after)
            elif not independent:
                s.wait_stream(self.consumer)
            out = fn()
            ev = torch.cuda.Event()
            ev.record(s)
        ev.synchronize()
        self._hand_over(out)
        return out

    def _hand_over(self, out: Any) -> None:
        """Record the CUDA tensors in ``out`` (a tensor, or a tuple or list of them) on the consumer stream."""
        items = out if isinstance(out, tuple | list) else (out,)
        for t in items:
            if isinstance(t, self._torch.Tensor) and t.is_cuda and self.consumer is not None:
                t.record_stream(self.consumer)


__all__ = ["PIPELINE_MODES", "AdaptivePipeline", "CopyThread", "CopyThreadPool", "GroupSample", "LoadHandle",
           "LoadJob", "PipelineMode", "Strategy", "TorchDma"]
