"""Where a decode step of the runner goes, layer by layer: KV through bladed against KV kept on the GPU (issue 41).

Used by ``tools/gpu/gpu_check_steps.py profile``. :func:`profiled` swaps the runner's per-``generate`` state
(``bladed.runner.generation._Generation``) for :class:`ProfiledGeneration`, which times, per step:

* on the compute thread (host seconds): ``load_cache`` (for offloaded KV: the wait for its load, the
  ``load_wait`` of the runner's own ``steps``), the layer's compute (launching it, on CUDA), ``store_cache``
  (handing its writes to the copy threads);
* with CUDA events: the layer's compute on the compute stream (GPU time; the stream also waits there for
  the copies it depends on), each slot-to-device copy (``dma``) and each device-to-slot copy of a write
  (``write_dma``) on its copy thread's stream;
* and keeps the runner's own per-step split (``StepTimes``: the copy threads' read, DMA and write seconds).

Without CUDA the events are not recorded (their fields are None) and the rest is measured the same way: a
rehearsal proves the hooks are called where the runner calls them. Nothing of bladed changes: the subclass
only wraps the named steps.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from bladed.pipeline import TorchDma
from bladed.runner import generation

#: per step, what :class:`ProfiledGeneration` adds up (milliseconds); the ``*_gpu_ms`` ones come from CUDA events
FIELDS = ("load_cache_ms", "compute_host_ms", "store_cache_ms", "compute_gpu_ms", "dma_gpu_ms", "write_dma_gpu_ms")
#: calls counted per step
COUNTS = ("load_cache", "compute", "store_cache", "dma", "write_dma")


class Recorder:
    """What every :class:`ProfiledGeneration` of a :func:`profiled` block measured, one list of steps per
    ``generate`` call."""

    def __init__(self) -> None:
        self.calls: list[list[dict[str, Any]]] = []
        self.lock = threading.Lock()

    def new_call(self) -> list[dict[str, Any]]:
        steps: list[dict[str, Any]] = []
        self.calls.append(steps)
        return steps


class _TimedDma(TorchDma):
    """The runner's :class:`TorchDma`, each copy bracketed by CUDA events on the stream it runs on."""

    def __init__(self, device: Any, gen: ProfiledGeneration) -> None:
        super().__init__(device)
        self.gen = gen

    def run(self, fn: Any, after: Any = None, *, independent: bool = False) -> Any:
        kind = "dma" if independent else "write_dma"       # loads read host memory only; writes wait for compute
        step = getattr(self.gen.tag, "step", self.gen.step)
        if not self.cuda:
            out = super().run(fn, after, independent=independent)
            self.gen.add(step, kind, None)
            return out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def bracketed() -> Any:
            start.record()                                   # the copy thread's stream: current inside run()
            res = fn()
            end.record()
            return res

        out = super().run(bracketed, after, independent=independent)   # returns once the copy is complete
        self.gen.add(step, kind, start.elapsed_time(end))
        return out


class ProfiledGeneration(generation._Generation):
    """``_Generation`` with its named steps timed (module doc)."""

    recorder: Recorder | None = None

    def __init__(self, runner: Any, prompt_len: int, gen_len: int) -> None:
        super().__init__(runner, prompt_len, gen_len)
        self.tag = threading.local()                         # the step a copy thread's job was issued in
        self.dma = _TimedDma(self.device, self)
        self.rec_steps = self.recorder.new_call() if self.recorder is not None else []
        self.pending: list[tuple[int, Any, Any]] = []        # (step, start, end) compute events not read yet
        self._lock = threading.Lock()

    def add(self, step: int, kind: str, gpu_ms: float | None, host_ms: float | None = None) -> None:
        with self._lock:
            while len(self.rec_steps) <= step:
                self.rec_steps.append({"step": len(self.rec_steps), **dict.fromkeys(FIELDS, 0.0),
                                       **{f"n_{c}": 0 for c in COUNTS}})
            rec = self.rec_steps[step]
            rec[f"n_{kind}"] += 1
            if host_ms is not None:
                rec[f"{kind}_host_ms" if kind == "compute" else f"{kind}_ms"] += host_ms
            gpu_key = f"{kind}_gpu_ms"
            if gpu_key in rec:
                rec[gpu_key] = None if gpu_ms is None or rec[gpu_key] is None else rec[gpu_key] + gpu_ms

    def load_cache(self, layer: int, gpu_batch: int) -> Any:
        t0 = time.perf_counter()
        out = super().load_cache(layer, gpu_batch)
        self.add(self.step, "load_cache", None, (time.perf_counter() - t0) * 1e3)
        return out

    def timed_compute(self, weights: Any, hidden: Any, past: Any) -> Any:
        events = None
        if self.cuda:
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[0].record()
        t0 = time.perf_counter()
        out = super().timed_compute(weights, hidden, past)
        host = (time.perf_counter() - t0) * 1e3
        if events is not None:
            events[1].record()
            self.pending.append((self.step, *events))
            self.add(self.step, "compute", 0.0, host)
        else:
            self.add(self.step, "compute", None, host)
        return out

    def store_cache(self, layer: int, gpu_batch: int, new_kv: Any, full_kv: Any) -> None:
        t0 = time.perf_counter()
        super().store_cache(layer, gpu_batch, new_kv, full_kv)
        self.add(self.step, "store_cache", None, (time.perf_counter() - t0) * 1e3)

    def _copy_to_device(self, step: int, *args: Any) -> Any:
        self.tag.step = step
        return super()._copy_to_device(step, *args)

    def _write_kv(self, step: int, *args: Any, **kw: Any) -> Any:
        self.tag.step = step
        return super()._write_kv(step, *args, **kw)

    def sync(self) -> float:
        seconds = super().sync()                             # the device synchronised: the compute events are done
        for step, start, end in self.pending:
            with self._lock:
                rec = self.rec_steps[step]
                rec["compute_gpu_ms"] = (rec["compute_gpu_ms"] or 0.0) + start.elapsed_time(end)
        self.pending.clear()
        return seconds

    def result(self) -> Any:
        res = super().result()
        with self._lock:
            for rec, times in zip(self.rec_steps, res.step_times, strict=False):
                rec.update({k: times[k] for k in ("wall_s", "compute_s", "load_wait_s", "read_s", "dma_s", "write_s",
                                                  "read_bytes", "write_bytes")})
        return res


@contextlib.contextmanager
def profiled() -> Iterator[Recorder]:
    """Within the block, every ``Runner.generate`` records into the yielded :class:`Recorder`."""
    rec = Recorder()
    original = generation._Generation
    cls = type("ProfiledGenerationOfBlock", (ProfiledGeneration,), {"recorder": rec})
    generation._Generation = cls                              # Runner.generate looks it up by name
    try:
        yield rec
    finally:
        generation._Generation = original


def per_layer(steps: list[dict[str, Any]], layers: int) -> dict[str, Any]:
    """Milliseconds per layer of the decode steps (all but the prefill), means over the steps; None where a
    figure was not measured (CUDA events on the CPU)."""
    decode = steps[1:]
    if not decode:
        return {}
    out: dict[str, Any] = {"decode_steps": len(decode)}
    keys = ("wall_s", "load_wait_s", "read_s", "dma_s", "write_s", *FIELDS)
    for k in keys:
        vals = [s.get(k) for s in decode]
        if any(v is None for v in vals):
            out[k.replace("_s", "_ms") if k.endswith("_s") else k] = None
            continue
        mean = sum(vals) / len(vals) / layers
        out[k.replace("_s", "_ms") if k.endswith("_s") else k] = round(mean * (1e3 if k.endswith("_s") else 1.0), 4)
    for c in COUNTS:
        out[f"n_{c}_per_step"] = round(sum(s.get(f"n_{c}", 0) for s in decode) / len(decode), 2)
    return out


def top_ops(prof: Any, n: int = 15) -> dict[str, list[dict[str, Any]]]:
    """The torch.profiler's heaviest operators: by self CPU time and, where CUDA was profiled, by device time."""
    avgs = prof.key_averages()

    def device_us(e: Any) -> float:
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)) or 0.0)

    def row(e: Any) -> dict[str, Any]:
        return {"name": e.key, "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
                "cpu_total_ms": round(e.cpu_time_total / 1e3, 3), "self_device_ms": round(device_us(e) / 1e3, 3)}

    out = {"by_self_cpu": [row(e) for e in sorted(avgs, key=lambda e: -e.self_cpu_time_total)[:n]]}
    if any(device_us(e) for e in avgs):
        out["by_device"] = [row(e) for e in sorted(avgs, key=lambda e: -device_us(e))[:n]]
    return out


__all__ = ["COUNTS", "FIELDS", "ProfiledGeneration", "Recorder", "per_layer", "profiled", "top_ops"]
