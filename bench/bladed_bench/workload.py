"""The KV workload driver: FlexLLMGen's access pattern against a KV target.

For a geometry (layers L, batch B, KV heads H, head dim D, fp16) with
``max_tokens = prompt_len + gen_len``:

* **prefill** (iteration 0): for every layer, the modelled compute, then for K
  and V on their copy threads (K on thread 0, V on thread 1) the modelled
  GPU->pinned DMA and a write of tokens ``[0, prompt_len)`` from the thread's
  staging slot; writes run behind the next layer's compute; the phase ends
  when the last write is done;
* **decode** (iterations 1 .. gen_len-1, ``pos = prompt_len + i - 1``): for
  every layer, a load of tokens ``[0, pos)`` of K and V (storage read into
  the slot, then the modelled pinned->GPU DMA) scheduled by
  :class:`bladed.pipeline.AdaptivePipeline` (``adaptive``/``intra``/
  ``cross``/``off``), the next layer's load issued before this layer computes
  (FlexLLMGen's I/O-compute overlap), then the one-token append of K and V at
  ``pos``.

Sparse decode reads (``select``, ``bladed.kvselect``; issue 47): a layer past the spec's dense layers reads
only the pages a real model selected at that layer and position (``select_trace``, recorded by
``tools/bench_kv_select.py --trace``; the workload's selecting layers take the trace's in turn), as the
runner does: on demand (its query comes first, so no layer-ahead prefetch), the pages the reuse buffer lacks
(with the spec's ``reuse``: the pages the layer read in the previous step, but the one not yet whole) as one
request per run of consecutive pages, pipelined; the DMA carries what was read.

No GPU is needed: compute is ``--compute-ms`` per layer (a sleep, so it takes
no CPU from the I/O), and the DMA between the staging slot and the GPU is
modelled as ``nbytes / dma_gbps`` under one lock (copies on one GPU copy
engine are serialised), or done as a real memcpy into a host buffer
(``dma="copy"``), or skipped (``dma="none"``).

Each token row of every KPU carries an 8-byte stamp (layer, kind, token) so
that reads are checked to return what was written (a few rows per read).

Targets: :class:`BladedTarget` (a real bladed daemon started for the run,
driven through :mod:`bladed.client`) and :class:`TorchDiskTarget` (the
Baseline: FlexLLMGen's TorchDisk, :mod:`bladed.torchdisk`).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from bladed.config import config_from_dict
from bladed.pipeline import AdaptivePipeline, CopyThreadPool, LoadJob
from bladed.residency.geometry import Geometry
from bladed.spawn import PrivateDaemon
from bladed.torchdisk import OP_READ, OP_WRITE, TorchDiskClient
from bladed_bench.metrics import DiskStat, cpu_seconds, rss_bytes
from bladed_bench.repo import REPO, repo_env

#: Table III labels, in the paper's order
CONFIGS = ("baseline", "cachepolicy", "direct", "dualblade")
LABELS = {"baseline": "Baseline", "cachepolicy": "CachePolicy-Only", "direct": "NVMe-direct-Only",
          "dualblade": "Dual-Blade"}


@dataclass(frozen=True)
class WorkloadSpec:
    """What one run replays."""

    layers: int = 32
    batch: int = 8
    kv_heads: int = 32
    head_dim: int = 128
    dtype_bytes: int = 2
    prompt_len: int = 512
    gen_len: int = 6
    channels: int = 2
    pipeline: str = "adaptive"
    compute_ms: float = 0.0          # per layer and decode step
    prefill_compute_ms: float = 0.0  # per layer in prefill
    dma: str = "none"                # none | model | copy
    dma_gbps: float = 25.0
    kv_format: str = ""              # "" (rows of dtype_bytes), or bladed.kvformat's name: fp16, q8, q4, ...
    #: the codec's measured rates (GB/s of decoded input, this CPU): each write is charged its quantize time, each
    #: read its dequantize time (issue 31: the sweep charges what the inference process would spend)
    quantize_gbps: float = 0.0
    dequantize_gbps: float = 0.0
    #: sparse decode reads: a ``bladed.kvselect`` spec (its page, dense layers and reuse apply) and the JSON of
    #: the pages a model selected (``tools/bench_kv_select.py --trace``); "" reads every step's whole past
    select: str = ""
    select_trace: str = ""

    @property
    def max_tokens(self) -> int:
        return self.prompt_len + self.gen_len

    def geometry(self) -> dict[str, int | str]:
        g: dict[str, int | str] = {"layers": self.layers, "batch": self.batch, "kv_heads": self.kv_heads,
                                   "head_dim": self.head_dim, "dtype_bytes": self.dtype_bytes,
                                   "max_tokens": self.max_tokens}
        if self.kv_format:
            g["kv_format"] = self.kv_format
        return g

    @property
    def shape(self) -> Geometry:
        """The session geometry this workload opens (sizes as the daemon computes them)."""
        return Geometry.from_dict(self.geometry())

    @property
    def decoded_token_bytes(self) -> int:
        """One token of one KPU as the model holds it (``B*H*D*e``), whatever the stored format."""
        return self.batch * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def token_bytes(self) -> int:
        return self.shape.token_bytes

    @property
    def kpu_bytes(self) -> int:
        return self.shape.kpu_bytes

    @property
    def kv_bytes(self) -> int:
        return self.shape.kv_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(max_tokens=self.max_tokens, token_bytes=self.token_bytes, kpu_bytes=self.kpu_bytes,
                 kv_bytes=self.kv_bytes)
        return d


@dataclass
class OpRecord:
    """One storage request as the driver saw it."""

    phase: str          # prefill | decode
    step: int
    op: str             # read | write
    layer: int
    kind: str
    ch: int
    group: int
    path: str
    nbytes: int
    t0: float           # perf_counter at submission
    t1: float           # perf_counter at the reply
    service_ns: int     # measured by the server (daemon / TorchDisk child)
    hit: float | None
    ticks_ms: int = 0   # device io_ticks during [t0, t1]

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0


class KVTarget(Protocol):
    """A KV store as the driver needs it."""

    config: str
    channels: int

    def slot(self, ch: int) -> memoryview: ...

    def group(self, layer: int, kind: str) -> int: ...

    def io(self, op: str, layer: int, kind: str, ch: int, t0: int, n: int) -> tuple[str, int, int, float | None]:
        """Run one request; (path, nbytes, service_ns, hit_ratio)."""
        ...

    def pids(self) -> list[int]: ...

    def info(self) -> dict[str, Any]: ...

    def end_info(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


# -- bladed --------------------------------------------------------------------------------

class BenchDaemon:
    """A private bladed (:class:`bladed.spawn.PrivateDaemon`) for one run, on a file store in ``state_dir``,
    started through an optional cgroup launcher."""

    def __init__(self, state_dir: str, store_bytes: int, launcher: Callable[[list[str]], list[str]] | None = None,
                 extra: dict[str, dict[str, Any]] | None = None, timeout: float = 120.0) -> None:
        self.state_dir = state_dir
        os.makedirs(state_dir, exist_ok=True)
        cfg: dict[str, dict[str, Any]] = {
            "device": {"backend": "file", "path": "kv-store.img", "size": store_bytes},
            "budget": {"interval_s": 3600.0},
            "log": {"level": "warning", "format": "text"},
        }
        for section, keys in (extra or {}).items():
            cfg.setdefault(section, {}).update(keys)
        self.config_path = os.path.join(state_dir, "bladed.toml")
        # bladed's own model writes the file (every key, as the daemon reads it back): a study's setting the
        # daemon would refuse fails here, with the daemon's message, before a process starts
        text = config_from_dict(cfg, state_dir=state_dir).to_toml()
        with open(self.config_path, "w") as f:
            f.write(text)
        self.socket_path = os.path.join(state_dir, "bladed.sock")
        self.log_path = os.path.join(state_dir, "bladed.log")
        self.daemon = PrivateDaemon(["--config", self.config_path, "--state-dir", state_dir], env=repo_env(),
                                    cwd=REPO, wrap=launcher, log_path=self.log_path, log_mode="w",
                                    notify_path=os.path.join(state_dir, "notify.sock"))
        t0 = time.perf_counter()
        self.daemon.start()
        try:
            self.daemon.wait_ready(timeout)
        except BaseException:
            self.daemon.stop()
            raise
        self.startup_s = time.perf_counter() - t0

    @property
    def pid(self) -> int:
        return self.daemon.pid

    def log_tail(self, n: int = 30) -> str:
        return self.daemon.log_tail(n)

    def stop(self, timeout: float = 120.0) -> int | None:
        return self.daemon.stop(timeout)


class BladedTarget:
    """A bladed daemon (started for the run) and one session of ``mode``."""

    def __init__(self, mode: str, spec: WorkloadSpec, state_dir: str, *, store_bytes: int,
                 launcher: Callable[[list[str]], list[str]] | None = None,
                 daemon_config: dict[str, dict[str, Any]] | None = None) -> None:
        from bladed.client import Client

        self.config = mode
        self.channels = spec.channels
        self.daemon = BenchDaemon(state_dir, store_bytes, launcher, daemon_config)
        try:
            t0 = time.perf_counter()
            self.client = Client(self.daemon.socket_path, timeout=600.0, name="bladed-bench")
            self.session = self.client.open_session(spec.geometry(), mode=mode, channels=spec.channels)
            self.open_s = time.perf_counter() - t0
        except BaseException:
            self.daemon.stop()
            raise
        self._groups = {(int(k["layer"]), str(k["kind"])): int(k["group"]) for k in self.session.plan["kpus"]}

    def slot(self, ch: int) -> memoryview:
        return self.session.slot(ch)

    def group(self, layer: int, kind: str) -> int:
        return self._groups[(layer, kind)]

    def io(self, op: str, layer: int, kind: str, ch: int, t0: int, n: int) -> tuple[str, int, int, float | None]:
        fn = self.session.read if op == "read" else self.session.write
        r = fn(layer, kind, ch, token_start=t0, ntokens=n)
        return r.path, r.nbytes, r.service_ns, r.hit_ratio

    def read_runs(self, layer: int, kind: str, ch: int, runs: list[tuple[int, int]]
                  ) -> tuple[str, int, int, float | None]:
        """Token ranges of one KPU in one request (protocol 6; more than the daemon's ``max_ranges`` in several,
        pipelined on the channel), as ``bladed.kvstore.BladedKV.read_runs`` sends them."""
        from bladed.kvstore import combined_op

        ranges = [self.session.range("read", layer, kind, t0, n) for t0, n in runs]
        replies = self.session.submit_many(ch, self.session.requests_of(ranges))
        op = combined_op([r for reply in replies for r in reply])
        return op.path, op.nbytes, op.service_ns, op.hit_ratio

    def pids(self) -> list[int]:
        return [self.daemon.pid]

    def end_info(self) -> dict[str, Any]:
        """What the daemon did on its own during the run: live re-planning (demotions), budget now."""
        out: dict[str, Any] = {}
        with contextlib.suppress(Exception):
            out["replan"] = self.client.stats().get("replan")
        with contextlib.suppress(Exception):
            mine = [s for s in self.client.sessions() if s.get("session") == self.session.id]
            if mine:
                keys = ("group1_layers", "group1_kpus", "group2_kpus", "pagecache_bytes", "direct_bytes",
                        "demoted_kpus", "demoted_bytes", "pending_demotions", "demotions_failed")
                out["session"] = {k: mine[0].get(k) for k in keys}
        return out

    def info(self) -> dict[str, Any]:
        plan = dict(self.session.plan)
        kpus = plan.pop("kpus", [])
        plan["paths"] = {"pagecache": sum(1 for k in kpus if k["path"] == "pagecache"),
                         "direct": sum(1 for k in kpus if k["path"] == "direct")}
        return {"target": "bladed", "mode": self.config, "daemon_pid": self.daemon.pid,
                "daemon_startup_s": self.daemon.startup_s, "session_open_s": self.open_s, "plan": plan,
                "daemon_rss_bytes": rss_bytes(self.daemon.pid)}

    def close(self) -> None:
        try:
            with contextlib.suppress(Exception):
                self.session.close()
            with contextlib.suppress(Exception):
                self.client.close()
        finally:
            rc = self.daemon.stop()
            if rc not in (0, None):
                raise RuntimeError(f"bladed exited with status {rc}; log:\n{self.daemon.log_tail()}")


# -- the Baseline ---------------------------------------------------------------------------

class TorchDiskTarget:
    """FlexLLMGen's TorchDisk path in a child process (see :mod:`bladed.torchdisk`)."""

    config = "baseline"

    def __init__(self, spec: WorkloadSpec, state_dir: str,
                 launcher: Callable[[list[str]], list[str]] | None = None) -> None:
        self.channels = spec.channels
        self.client = TorchDiskClient(launcher, env=repo_env()).open(os.path.join(state_dir, "torchdisk"),
                                                                     spec.shape, spec.channels)

    def slot(self, ch: int) -> memoryview:
        return self.client.slot(ch)

    def group(self, layer: int, kind: str) -> int:
        return 1

    def io(self, op: str, layer: int, kind: str, ch: int, t0: int, n: int) -> tuple[str, int, int, float | None]:
        nbytes, ns, hit = self.client.io(OP_READ if op == "read" else OP_WRITE, layer, kind, ch, t0, n)
        return "mmap", nbytes, ns, hit

    def pids(self) -> list[int]:
        return [self.client.pid]

    def end_info(self) -> dict[str, Any]:
        return {}

    def info(self) -> dict[str, Any]:
        return {"target": "torchdisk", "mode": "baseline", "child_pid": self.client.pid,
                "child_startup_s": self.client.setup_s, "child_rss_bytes": rss_bytes(self.client.pid)}

    def close(self) -> None:
        self.client.close()


# -- the driver ---------------------------------------------------------------------------------

@dataclass
class RunTrace:
    """What one workload run produced (raw; :mod:`bladed_bench.report` summarises it)."""

    spec: dict[str, Any]
    t_start: float = 0.0
    t_prefill_end: float = 0.0
    t_decode_start: float = 0.0
    t_end: float = 0.0
    step_seconds: list[float] = field(default_factory=list)
    ops: list[OpRecord] = field(default_factory=list)
    pipeline: dict[str, Any] = field(default_factory=dict)
    verify_errors: int = 0
    verify_checked: int = 0
    cpu_s: dict[str, float | None] = field(default_factory=dict)
    disk_phase: dict[str, dict[str, float | None]] = field(default_factory=dict)
    #: sparse decode reads: pages the selecting layers' K attended to, of those their past held, read (the
    #: reuse buffer lacked them), the runs of consecutive pages K and V read and the requests they took (a
    #: daemon target: one per KPU read, protocol 6; the runs of a KPU number tens, never past ``max_ranges``)
    select_pages: int = 0
    select_all_pages: int = 0
    select_read_pages: int = 0
    select_runs: int = 0
    select_requests: int = 0
    select_source: dict[str, Any] = field(default_factory=dict)

    @property
    def prefill_s(self) -> float:
        return self.t_prefill_end - self.t_start

    @property
    def decode_s(self) -> float:
        return self.t_end - self.t_decode_start


class SelectTrace:
    """The pages a model selected per layer and decode position (``WorkloadSpec.select_trace``), for the
    workload's layers: the first ``dense_layers`` read everything, the others take the trace's selecting layers
    in turn."""

    def __init__(self, spec: WorkloadSpec) -> None:
        from bladed.kvselect import parse_select

        self.select = parse_select(spec.select, "select")
        with open(spec.select_trace) as f:
            doc = json.load(f)
        if doc.get("page") != self.select.page or doc.get("first_position") != spec.prompt_len:
            raise ValueError(f"{spec.select_trace}: a trace of pages of {doc.get('page')} from position "
                             f"{doc.get('first_position')}; the workload needs pages of {self.select.page} from "
                             f"{spec.prompt_len} (tools/bench_kv_select.py --trace ... --trace-prompt "
                             f"{spec.prompt_len})")
        if int(doc.get("steps", 0)) < spec.gen_len - 1:
            raise ValueError(f"{spec.select_trace}: {doc.get('steps')} steps, the workload decodes {spec.gen_len - 1}")
        self.dense_layers = int(doc["dense_layers"])
        self.layers = [doc["pages"][k] for k in sorted(doc["pages"], key=int)]
        self.first = spec.prompt_len
        self.source = {k: doc.get(k) for k in ("spec", "model", "text", "steps")}

    def pages(self, layer: int, pos: int) -> list[int] | None:
        """The pages layer ``layer`` reads at decode position ``pos`` (None: all of its past)."""
        if layer < self.dense_layers:
            return None
        return list(self.layers[(layer - self.dense_layers) % len(self.layers)][pos - self.first])


def page_runs(pages: list[int], page: int, ntok: int) -> list[tuple[int, int]]:
    """Sorted page ids as token ranges of runs of consecutive pages, clipped to ``ntok`` tokens."""
    out: list[tuple[int, int]] = []
    for p in pages:
        if out and out[-1][0] + out[-1][1] == p * page:
            out[-1] = (out[-1][0], out[-1][1] + page)
        else:
            out.append((p * page, page))
    return [(t0, min(n, ntok - t0)) for t0, n in out if t0 < ntok]


def _stamp_base(layer: int, kind: str) -> int:
    return (0x5B << 56) | (layer << 36) | ((kind == "v") << 32)


class Workload:
    """Drives one :class:`KVTarget` through prefill and decode."""

    def __init__(self, spec: WorkloadSpec, target: KVTarget, disk_sysdir: str | None = None,
                 on_op: Callable[[OpRecord], None] | None = None) -> None:
        self.spec = spec
        self.target = target
        self.sysdir = disk_sysdir
        self.on_op = on_op
        self._ops_lock = threading.Lock()
        self._dma_lock = threading.Lock()
        tb = spec.token_bytes
        self._rows = [np.frombuffer(target.slot(ch), dtype=np.uint64).reshape(spec.max_tokens, tb // 8)
                      for ch in range(spec.channels)]
        # charge the staging pages to this (the inference) process, not to the server under test
        for r in self._rows:
            r.fill(0)
        self._gpu: list[np.ndarray] = []
        if spec.dma == "copy":
            self._gpu = [np.empty_like(r) for r in self._rows]
        self._verify_lock = threading.Lock()
        self.select = SelectTrace(spec) if spec.select else None
        #: per (layer, kind): the pages the reuse buffer holds (what the layer read in the previous step)
        self._held: dict[tuple[int, str], set[int]] = {}

    # -- pieces ---------------------------------------------------------------------
    def _ticks(self) -> int:
        if self.sysdir is None:
            return 0
        try:
            return DiskStat.read(self.sysdir).io_ticks_ms
        except OSError:
            return 0

    def _io(self, trace: RunTrace, phase: str, step: int, op: str, layer: int, kind: str, ch: int, t0: int,
            n: int) -> OpRecord:
        k0 = self._ticks()
        s = time.perf_counter()
        path, nbytes, service_ns, hit = self.target.io(op, layer, kind, ch, t0, n)
        e = time.perf_counter()
        rec = OpRecord(phase=phase, step=step, op=op, layer=layer, kind=kind, ch=ch,
                       group=self.target.group(layer, kind), path=path, nbytes=nbytes, t0=s, t1=e,
                       service_ns=service_ns, hit=hit, ticks_ms=self._ticks() - k0)
        with self._ops_lock:
            trace.ops.append(rec)
        if self.on_op is not None:
            self.on_op(rec)
        return rec

    def _io_runs(self, trace: RunTrace, step: int, layer: int, kind: str, ch: int,
                 runs: list[tuple[int, int]]) -> OpRecord:
        k0 = self._ticks()
        s = time.perf_counter()
        read_runs = getattr(self.target, "read_runs", None)
        if read_runs is not None:
            path, nbytes, service_ns, hit = read_runs(layer, kind, ch, runs)
        else:
            got = [self.target.io("read", layer, kind, ch, t0, n) for t0, n in runs]
            path, nbytes, service_ns, hit = got[0][0], sum(g[1] for g in got), sum(g[2] for g in got), None
        e = time.perf_counter()
        rec = OpRecord(phase="decode", step=step, op="read", layer=layer, kind=kind, ch=ch,
                       group=self.target.group(layer, kind), path=path, nbytes=nbytes, t0=s, t1=e,
                       service_ns=service_ns, hit=hit, ticks_ms=self._ticks() - k0)
        with self._ops_lock:
            trace.ops.append(rec)
            trace.select_runs += len(runs)
            trace.select_requests += 1 if read_runs is not None else len(runs)
        if self.on_op is not None:
            self.on_op(rec)
        return rec

    def _dma(self, ch: int, ntok: int, to_gpu: bool) -> None:
        spec = self.spec
        if spec.dma == "none":
            return
        with self._dma_lock:  # one copy engine: H2D/D2H copies are serialised
            if spec.dma == "copy":
                if to_gpu:
                    np.copyto(self._gpu[ch][:ntok], self._rows[ch][:ntok])
                else:
                    np.copyto(self._rows[ch][:ntok], self._gpu[ch][:ntok])
            else:
                time.sleep(ntok * spec.token_bytes / (spec.dma_gbps * 1e9))

    def _codec(self, ntok: int, quantize: bool) -> None:
        """The inference process's quantize (before a write) or dequantize (after a read) time, at the measured
        rate (WorkloadSpec.quantize_gbps / dequantize_gbps); nothing for plain rows."""
        spec = self.spec
        rate = spec.quantize_gbps if quantize else spec.dequantize_gbps
        if spec.kv_format and rate > 0:
            time.sleep(ntok * spec.decoded_token_bytes / (rate * 1e9))

    def _stamp(self, ch: int, layer: int, kind: str, t0: int, n: int) -> None:
        rows = self._rows[ch]
        rows[t0:t0 + n, 0] = np.uint64(_stamp_base(layer, kind)) + np.arange(t0, t0 + n, dtype=np.uint64)

    def _verify(self, trace: RunTrace, ch: int, layer: int, kind: str, ntok: int,
                check: set[int] | None = None) -> None:
        """The stamps of a few rows read: of tokens ``[0, ntok)`` the first, middle and last, or ``check``."""
        rows = self._rows[ch]
        base = _stamp_base(layer, kind)
        bad = 0
        check = check or {0, ntok // 2, ntok - 1}
        for t in check:
            if int(rows[t, 0]) != base + t:
                bad += 1
        with self._verify_lock:
            trace.verify_checked += len(check)
            trace.verify_errors += bad

    # -- the run --------------------------------------------------------------------
    def run(self, on_phase: Callable[[str], None] | None = None,
            on_step: Callable[[int], None] | None = None) -> RunTrace:
        spec = self.spec
        L = spec.layers
        trace = RunTrace(spec=spec.to_dict(), select_source=self.select.source if self.select else {})
        pool = CopyThreadPool(spec.channels, name="bench-copy")
        pipe = AdaptivePipeline(pool, spec.pipeline)  # type: ignore[arg-type]
        ch_of = {"k": 0, "v": 1 % spec.channels}
        pids = self.target.pids()
        cpu0 = {p: cpu_seconds(p) for p in pids}
        disk0 = DiskStat.read(self.sysdir) if self.sysdir else None
        writes: list[Future[Any]] = []

        def write_job(step: int, layer: int, kind: str, t0: int, n: int) -> Callable[[], Any]:
            ch = ch_of[kind]

            def job() -> Any:
                self._dma(ch, n, to_gpu=False)      # GPU -> pinned slot
                self._codec(n, quantize=True)
                self._stamp(ch, layer, kind, t0, n)
                return self._io(trace, "prefill" if step == 0 else "decode", step, "write", layer, kind, ch, t0, n)

            return job

        def sparse_load(step: int, layer: int, ntok: int, pages: list[int]) -> Any:
            assert self.select is not None
            page, reuse = self.select.select.page, self.select.select.reuse
            jobs = []
            for kind in ("k", "v"):
                ch = ch_of[kind]
                held = self._held.get((layer, kind), set())
                partial = ntok // page               # the page not yet whole: kept for this step only
                miss = [p for p in pages if p not in held or p >= partial]
                self._held[(layer, kind)] = {p for p in pages if p < partial} if reuse else set()
                runs = page_runs(miss, page, ntok)
                with self._ops_lock:
                    trace.select_pages += len(pages) if kind == "k" else 0
                    trace.select_read_pages += len(miss) if kind == "k" else 0
                    trace.select_all_pages += -(-ntok // page) if kind == "k" else 0
                nread = sum(n for _, n in runs)

                def rd(kind: str = kind, ch: int = ch, runs: list[tuple[int, int]] = runs) -> Any:
                    if not runs:
                        return None
                    rec = self._io_runs(trace, step, layer, kind, ch, runs)
                    self._verify(trace, ch, layer, kind, 0, {runs[0][0], runs[-1][0] + runs[-1][1] - 1})
                    return rec

                def dm(ch: int = ch, nread: int = nread) -> None:
                    self._codec(nread, quantize=False)
                    self._dma(ch, nread, to_gpu=True)

                jobs.append(LoadJob(read=rd, dma=dm, nbytes=nread * spec.token_bytes))
            return pipe.load(jobs, self.target.group(layer, "k"))

        def load(step: int, layer: int, ntok: int) -> Any:
            pages = self.select.pages(layer, ntok) if self.select is not None else None
            if pages is not None:
                return sparse_load(step, layer, ntok, pages)
            jobs = []
            for kind in ("k", "v"):
                ch = ch_of[kind]

                def rd(kind: str = kind, ch: int = ch) -> Any:
                    rec = self._io(trace, "decode", step, "read", layer, kind, ch, 0, ntok)
                    self._verify(trace, ch, layer, kind, ntok)
                    return rec

                def dm(ch: int = ch) -> None:
                    self._codec(ntok, quantize=False)
                    self._dma(ch, ntok, to_gpu=True)

                jobs.append(LoadJob(read=rd, dma=dm, nbytes=ntok * spec.token_bytes))
            return pipe.load(jobs, self.target.group(layer, "k"))

        try:
            # -- prefill ------------------------------------------------------------
            if on_phase:
                on_phase("prefill")
            trace.t_start = time.perf_counter()
            pipe.begin_iteration(0)
            for layer in range(L):
                if spec.prefill_compute_ms:
                    time.sleep(spec.prefill_compute_ms / 1e3)
                for kind in ("k", "v"):
                    writes.append(pool.submit(ch_of[kind], write_job(0, layer, kind, 0, spec.prompt_len)))
            for f in writes:
                f.result()
            writes.clear()
            pipe.end_iteration()
            trace.t_prefill_end = time.perf_counter()
            trace.step_seconds.append(trace.t_prefill_end - trace.t_start)
            disk1 = DiskStat.read(self.sysdir) if self.sysdir else None
            cpu1 = {p: cpu_seconds(p) for p in pids}
            if on_step:
                on_step(0)
            # -- decode -------------------------------------------------------------
            if on_phase:
                on_phase("decode")
            trace.t_decode_start = time.perf_counter()
            for i in range(1, spec.gen_len):
                ts = time.perf_counter()
                pos = spec.prompt_len + i - 1
                pipe.begin_iteration(i)
                pending = load(i, 0, pos)
                for layer in range(L):
                    cur = pending
                    cur.result()
                    sparse_next = False
                    if layer + 1 < L:
                        # layer-ahead prefetch (I/O-compute overlap); a selecting layer's pages are known only
                        # from its own query, so its load starts after the layer before it has computed
                        sparse_next = self.select is not None and self.select.pages(layer + 1, pos) is not None
                        if not sparse_next:
                            pending = load(i, layer + 1, pos)
                    if spec.compute_ms:
                        time.sleep(spec.compute_ms / 1e3)
                    for kind in ("k", "v"):
                        writes.append(pool.submit(ch_of[kind], write_job(i, layer, kind, pos, 1)))
                    if layer + 1 < L and sparse_next:
                        pending = load(i, layer + 1, pos)
                pipe.end_iteration()
                if i == spec.gen_len - 1:
                    for f in writes:
                        f.result()
                    writes.clear()
                trace.step_seconds.append(time.perf_counter() - ts)
                if on_step:
                    on_step(i)
            for f in writes:
                f.result()
            trace.t_end = time.perf_counter()
            disk2 = DiskStat.read(self.sysdir) if self.sysdir else None
            cpu2 = {p: cpu_seconds(p) for p in pids}
        finally:
            pool.close()
        trace.pipeline = pipe.report()
        if disk0 and disk1 and disk2:
            trace.disk_phase = {"prefill": disk1.delta(disk0), "decode": disk2.delta(disk1)}

        def diff(a: dict[int, float | None], b: dict[int, float | None]) -> float | None:
            vals = [(b[p] or 0.0) - (a[p] or 0.0) for p in pids if a.get(p) is not None and b.get(p) is not None]
            return sum(vals) if vals else None

        trace.cpu_s = {"prefill": diff(cpu0, cpu1), "decode": diff(cpu1, cpu2)}
        return trace


__all__ = ["CONFIGS", "LABELS", "BenchDaemon", "BladedTarget", "KVTarget", "OpRecord", "RunTrace", "SelectTrace",
           "TorchDiskTarget", "Workload", "WorkloadSpec"]
