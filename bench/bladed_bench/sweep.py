"""The memory-limit sweep: cgroup limit steps, cold caches, alternation, repetition.

A sweep is a list of *points* (configuration, pipeline, memory limit, and for
Table V a fixed page-cache budget).  Points that share a limit form a
*round*; every repetition visits every round, and a round starts with its
reference measurements (fio's sequential write and read of the same
filesystem, the resident page-cache read bandwidth) followed by its runs in
the order of one row of a Williams Latin square (:func:`bladed_bench.trials.williams`):
every configuration runs in every position and after every other one, so
what a run leaves behind does not always land on the same successor.  Rounds
are visited forwards in even repetitions and backwards in odd ones, so slow
drift of the shared disk does not line up with one limit or configuration.

Every run starts cold: ``sync; echo 3 > /proc/sys/vm/drop_caches``, a wait
until the disk has been idle for 0.5 s (at most 20 s: ext4 mounted with
``discard`` sends the discards of the blocks the previous teardown freed
after the sync), a wait until free page reporting has handed the freed
memory back to the host (on a VM that has it: touching a reported page costs
a host fault, so without the wait a run is warmer or colder depending on
what the previous one freed), then a fresh memory cgroup with the limit, a fresh server
process placed in it (the bladed daemon, or the Baseline's TorchDisk child),
the workload, and teardown.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from bladed.residency.damon import pageout_schemes
from bladed.sizes import PAGE_SIZE, align_up
from bladed_bench import codec, probes, trials
from bladed_bench.cgroup import MemCgroup, can_drop_caches, drop_caches
from bladed_bench.metrics import (
    DiskSampler,
    block_device_of,
    rss_bytes,
    union_seconds,
    wait_device_idle,
    wait_free_pages_reported,
)
from bladed_bench.stats import latency_stats, median, summarize
from bladed_bench.workload import (
    LABELS,
    BladedTarget,
    KVTarget,
    OpRecord,
    RunTrace,
    TorchDiskTarget,
    Workload,
    WorkloadSpec,
)

SCHEMA = "bladed.bench_kv/1"
GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class Point:
    """One configuration at one memory limit."""

    study: str                   # "sweep" (Fig. 3/10/11/12, Table IV), "pipeline" (P·P on/off), "alpha" (Table V),
    #                              "headroom" (Dual-Blade with a smaller budget than Eq. 1-2 gives),
    #                              "noreplan" (Dual-Blade with the daemon's live re-planning off),
    #                              "portable" (Dual-Blade on the portable engine: io.engine = "portable")
    config: str                  # baseline | cachepolicy | direct | dualblade
    pipeline: str                # adaptive | intra | cross | off
    limit_bytes: int | None      # None: no limit
    budget_override: int | None = None
    alpha: float | None = None
    dma: str | None = None       # None: the plan's workload setting
    live_replan: bool | None = None  # None: the daemon's default (budget.live_replan)
    engine: str | None = None        # None: the daemon's default (io.engine = "auto")
    kv_format: str | None = None     # None: plain rows of the workload's dtype; else q8, q4, fp16, ... (issue 31)
    select: str = ""                 # sparse decode reads (issue 47): a bladed.kvselect spec, "" for none
    select_trace: str = ""           # and the JSON of the pages a model selected with it

    @property
    def name(self) -> str:
        """The configuration as the sweep's ``--configs`` names it (``dualblade``, ``dualblade-q8``), with its
        selection (``dualblade@keys:0.25,...``)."""
        return self.config + (f"-{self.kv_format}" if self.kv_format else "") + (f"@{self.select}" if self.select
                                                                                 else "")

    @property
    def round_key(self) -> tuple[str, int | None, float | None]:
        return (self.study if self.study == "alpha" else "limit", self.limit_bytes, self.alpha)


@dataclass
class SweepPlan:
    spec: WorkloadSpec
    points: list[Point]
    reps: int = 5
    workdir: str = "/var/tmp/bladed-bench"
    fio_size: int = GiB
    pc_probe_size: int = 512 * MiB
    drop: bool = True
    sample_interval: float = 0.1
    keep_series: str = "lowest"   # all | lowest | none: which runs keep their device time series
    settle: bool = True           # wait for the device to go idle before every run and probe
    memory_settle: bool = True    # and for free page reporting to go quiet (with settle)
    store_bytes: int = 0          # the daemon's store file (0: KV set + 256 MiB)
    #: charge the KV formats' codec time measured on this CPU (True), or none: what a box whose quantization
    #: runs on a GPU at hundreds of GB/s sees, the storage side alone
    codec_charge: bool = True
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def settles_memory(self) -> bool:
        return self.settle and self.memory_settle

    def rounds(self) -> list[tuple[tuple[str, int | None, float | None], list[Point]]]:
        out: dict[tuple[str, int | None, float | None], list[Point]] = {}
        for p in self.points:
            out.setdefault(p.round_key, []).append(p)
        return list(out.items())

    @property
    def total_runs(self) -> int:
        return self.reps * len(self.points)


#: the daemon's own anonymous memory when it plans a session (about 24 MiB seen), for the headroom study
DAEMON_ANON_ESTIMATE = 32 * MiB


def headroom_override(limit: int, kpu_bytes: int, frac: float, channels: int = 2) -> int:
    """A page-cache budget ``frac`` of the limit below what Eq. 1-2 gives (for the headroom study)."""
    stride = align_up(kpu_bytes, PAGE_SIZE)
    return max(0, int(limit - channels * stride - DAEMON_ANON_ESTIMATE - frac * limit))


def split_config(name: str) -> tuple[str, str | None]:
    """``dualblade-q8`` -> ``("dualblade", "q8")``; ``baseline`` -> ``("baseline", None)``; an ``@sel`` suffix
    (the plan's sparse reads) is not part of either."""
    config, _, fmt = name.removesuffix("@sel").partition("-")
    return config, fmt or None


def default_points(configs: list[str], limits: list[int], pipelines: list[str], *,
                   pp_limits: list[int] | None = None, alphas: list[float] | None = None, kv_bytes: int = 0,
                   kpu_bytes: int = 0, alpha_headroom: int = 256 * MiB, headroom_limits: list[int] | None = None,
                   headroom_frac: float = 0.05, alpha_dma: str | None = None,
                   noreplan_limits: list[int] | None = None,
                   portable_limits: list[int] | None = None,
                   select_traces: list[tuple[str, str]] | None = None) -> list[Point]:
    """The main sweep, the pipeline on/off study, the budget-headroom and no-live-replan diagnostics and
    the Table V study. A configuration named ``<config>@sel`` is one point per ``(spec, trace)`` of
    ``select_traces`` (the sparse decode reads the trace recorded)."""
    def point(study: str, name: str, pipeline: str, lim: int) -> list[Point]:
        config, fmt = split_config(name)
        if not name.endswith("@sel"):
            return [Point(study, config, pipeline, lim, kv_format=fmt)]
        return [Point(study, config, pipeline, lim, kv_format=fmt, select=spec, select_trace=path)
                for spec, path in select_traces or []]

    pts = [p for lim in limits for c in configs for p in point("sweep", c, pipelines[0], lim)]
    for lim in pp_limits or []:
        for pl in pipelines[1:]:
            pts.extend(p for c in configs for p in point("pipeline", c, pl, lim))
    for lim in headroom_limits or []:
        pts.append(Point("headroom", "dualblade", pipelines[0], lim,
                         budget_override=headroom_override(lim, kpu_bytes, headroom_frac)))
    for lim in noreplan_limits or []:
        pts.append(Point("noreplan", "dualblade", pipelines[0], lim, live_replan=False))
    for lim in portable_limits or []:
        pts.append(Point("portable", "dualblade", pipelines[0], lim, engine="portable"))
    for a in alphas or []:
        override = int(a * kv_bytes)
        lim = override + 2 * kpu_bytes + alpha_headroom
        for pl in pipelines:
            pts.append(Point("alpha", "dualblade", pl, lim, budget_override=override, alpha=a, dma=alpha_dma))
    return pts


# -- environment -------------------------------------------------------------------------

def machine_info(workdir: str) -> dict[str, Any]:
    """The machine, and the filesystem and disk under ``workdir`` (:func:`bladed_bench.trials.machine`); fio's
    version and DAMON's page-out schemes."""
    return trials.machine(workdir, ("bladed", "cffi_build", "bench")) | {
        "fio": probes.fio_version(), "damon_pageout": [s.describe() for s in pageout_schemes()]}


# -- one run -----------------------------------------------------------------------------------

def _stats(recs: list[OpRecord], client: bool = False) -> dict[str, Any]:
    return latency_stats([r.seconds if client else r.service_ns / 1e9 for r in recs])


def _union_gbps(recs: list[OpRecord]) -> float | None:
    if not recs:
        return None
    span = union_seconds((r.t0, r.t1) for r in recs)
    return sum(r.nbytes for r in recs) / span / 1e9 if span > 0 else None


def _busy(recs: list[OpRecord]) -> float | None:
    dur = sum(r.seconds for r in recs)
    return min(1.0, sum(r.ticks_ms for r in recs) / 1e3 / dur) if dur > 0 else None


def summarize_trace(trace: RunTrace) -> dict[str, Any]:
    """Aggregates of one run's op records (Table IV, hit ratio, bytes per path and group)."""
    ops = trace.ops
    pw = [o for o in ops if o.phase == "prefill" and o.op == "write"]
    dr = [o for o in ops if o.phase == "decode" and o.op == "read"]
    dw = [o for o in ops if o.phase == "decode" and o.op == "write"]
    read_bytes = sum(o.nbytes for o in dr)
    hit_bytes = sum((o.hit or 0.0) * o.nbytes for o in dr)
    by_group: dict[str, Any] = {}
    for g in sorted({o.group for o in dr}):
        rs = [o for o in dr if o.group == g]
        nb = sum(o.nbytes for o in rs)
        by_group[str(g)] = {"read_bytes": nb, "hit_ratio": sum((o.hit or 0.0) * o.nbytes for o in rs) / nb
                            if nb else None, "kpus": len({(o.layer, o.kind) for o in rs})}
    by_path: dict[str, Any] = {}
    for path in sorted({o.path for o in dr}):
        rs = [o for o in dr if o.path == path]
        nb = sum(o.nbytes for o in rs)
        by_path[path] = {"read_bytes": nb, "hit_ratio": sum((o.hit or 0.0) * o.nbytes for o in rs) / nb
                         if nb else None, "kpus": len({(o.layer, o.kind) for o in rs})}
    # T_ideal's split: what each step really read through the page cache and from the device directly
    # (a KPU the daemon demoted during the run counts where it was read from)
    per_step: dict[str, dict[str, int]] = {}
    for o in dr:
        d = per_step.setdefault(str(o.step), {"g1": 0, "g2": 0, "g1_plan": 0, "g2_plan": 0})
        d["g2" if o.path == "direct" else "g1"] += o.nbytes
        d["g1_plan" if o.group == 1 else "g2_plan"] += o.nbytes
    # a one-token append issued while the other channel streams a read from the device waits behind it
    dev_reads = [o for o in dr if o.path != "pagecache" or (o.hit or 0.0) < 0.95]

    def contended(w: OpRecord) -> bool:
        return any(r.ch != w.ch and r.t0 < w.t1 and w.t0 < r.t1 for r in dev_reads)

    dw_alone = [o for o in dw if not contended(o)]
    dw_cont = [o for o in dw if contended(o)]
    lat: dict[str, Any] = {
        "prefill_write": _stats(pw), "decode_read": _stats(dr), "decode_write": _stats(dw),
        "prefill_write_client": _stats(pw, True), "decode_read_client": _stats(dr, True),
        "decode_write_client": _stats(dw, True),
        "decode_read_miss": _stats([o for o in dr if (o.hit or 0.0) < 0.05]),
        "decode_read_hit": _stats([o for o in dr if (o.hit or 0.0) >= 0.95]),
    }
    for path in sorted({o.path for o in ops}):
        lat[f"prefill_write[{path}]"] = _stats([o for o in pw if o.path == path])
        lat[f"decode_read[{path}]"] = _stats([o for o in dr if o.path == path])
        lat[f"decode_write[{path}]"] = _stats([o for o in dw if o.path == path])
        lat[f"decode_write_client[{path}]"] = _stats([o for o in dw if o.path == path], True)
        lat[f"decode_write_alone[{path}]"] = _stats([o for o in dw_alone if o.path == path])
        lat[f"decode_write_contended[{path}]"] = _stats([o for o in dw_cont if o.path == path])
    busy = {"prefill_write": _busy(pw), "decode_read": _busy(dr), "decode_write": _busy(dw),
            "decode_read_miss": _busy([o for o in dr if (o.hit or 0.0) < 0.05])}
    thr = {"prefill_write_GBps": _union_gbps(pw), "decode_read_GBps": _union_gbps(dr),
           "prefill_write_direct_GBps": _union_gbps([o for o in pw if o.path == "direct"]),
           "decode_read_direct_GBps": _union_gbps([o for o in dr if o.path == "direct"])}
    moved = sum(o.nbytes for o in ops)
    cpu_total = sum(v for v in trace.cpu_s.values() if v is not None) if trace.cpu_s else None
    return {
        "prefill_s": trace.prefill_s, "decode_s": trace.decode_s, "step_s": trace.step_seconds,
        "hit_ratio": hit_bytes / read_bytes if read_bytes else None,
        "hit_by_group": by_group, "hit_by_path": by_path,
        "bytes": {"prefill_written": sum(o.nbytes for o in pw), "decode_read": read_bytes,
                  "decode_written": sum(o.nbytes for o in dw), "decode_read_per_step": per_step},
        "latency": lat, "busy": busy, "throughput": thr,
        "cpu": {"prefill_s": trace.cpu_s.get("prefill"), "decode_s": trace.cpu_s.get("decode"),
                "s_per_GB": cpu_total / (moved / 1e9) if cpu_total is not None and moved else None,
                "bytes_moved": moved},
        "disk_phase": trace.disk_phase,
        "pipeline_report": trace.pipeline,
        "verify": {"checked": trace.verify_checked, "errors": trace.verify_errors},
        "select": {"pages": trace.select_pages, "pages_total": trace.select_all_pages,
                   "pages_read": trace.select_read_pages, "runs": trace.select_runs,
                   "requests": trace.select_requests,
                   "trace": trace.select_source} if trace.select_source else None,
    }


class SweepRunner:
    """Runs points, one cold run at a time, and collects the records."""

    def __init__(self, plan: SweepPlan, progress: Callable[[str], None] | None = None) -> None:
        self.plan = plan
        os.makedirs(plan.workdir, exist_ok=True)
        self.sysdir = block_device_of(plan.workdir)
        self.progress = progress
        self._drop_ok = plan.drop and can_drop_caches()
        #: the codec rates of each KV format the points use (charged to their runs: bladed_bench/codec.py)
        self.codec = {f: codec.measure(f, plan.spec) for f in sorted({p.kv_format for p in plan.points
                                                                       if p.kv_format})}

    def make_target(self, p: Point, spec: WorkloadSpec, state_dir: str, cg: MemCgroup | None) -> KVTarget:
        launcher = cg.launcher if cg is not None else None
        if p.config == "baseline":
            return TorchDiskTarget(spec, state_dir, launcher)
        extra: dict[str, dict[str, Any]] = {}
        if p.budget_override is not None:
            extra.setdefault("budget", {})["override"] = p.budget_override
        if p.live_replan is not None:
            extra.setdefault("budget", {})["live_replan"] = p.live_replan
            if not p.live_replan:   # memory files are evicted by live demotion only
                extra.setdefault("pagecache", {})["backing"] = "disk"
        if p.engine is not None:
            extra.setdefault("io", {})["engine"] = p.engine
        store = self.plan.store_bytes or align_up(spec.kv_bytes + 256 * MiB, MiB)
        return BladedTarget(p.config, spec, state_dir, store_bytes=store, launcher=launcher, daemon_config=extra)

    def run_point(self, p: Point, rep: int, keep_series: bool) -> dict[str, Any]:
        spec = replace(self.plan.spec, pipeline=p.pipeline, dma=p.dma or self.plan.spec.dma)
        if p.select:
            spec = replace(spec, select=p.select, select_trace=p.select_trace)
        if p.kv_format:
            rates = self.codec[p.kv_format] if self.plan.codec_charge else {"quantize_gbps": 0.0,
                                                                              "dequantize_gbps": 0.0}
            spec = replace(spec, kv_format=p.kv_format, quantize_gbps=rates["quantize_gbps"],
                           dequantize_gbps=rates["dequantize_gbps"])
        state_dir = os.path.join(self.plan.workdir, "run")
        shutil.rmtree(os.path.join(state_dir, "pagecache"), ignore_errors=True)
        shutil.rmtree(os.path.join(state_dir, "torchdisk"), ignore_errors=True)
        rec: dict[str, Any] = {"study": p.study, "config": p.config, "kv_format": p.kv_format,
                               "label": LABELS[p.config] + (f" {p.kv_format}" if p.kv_format else "") + (
                                   " sparse" if p.select else ""), "name": p.name,
                               "select": spec.select or None,
                               "pipeline": p.pipeline, "limit_bytes": p.limit_bytes, "alpha": p.alpha,
                               "budget_override": p.budget_override, "rep": rep, "dma": spec.dma,
                               "live_replan": p.live_replan, "engine": p.engine,
                               "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
        rec["drop_caches_s"] = drop_caches() if self._drop_ok else None
        rec["cold"] = self._drop_ok
        rec.update(self.settle())
        cg = MemCgroup(p.limit_bytes) if os.geteuid() == 0 else None
        target: KVTarget | None = None
        sampler: DiskSampler | None = None
        cg_samples: list[int] = []
        try:
            t_setup = time.perf_counter()
            target = self.make_target(p, spec, state_dir, cg)
            rec["setup_s"] = time.perf_counter() - t_setup
            rec["target"] = target.info()
            marks: dict[str, float] = {}
            extra = (lambda: {"page_cache": float(cg.page_cache_bytes()), "usage": float(cg.usage())}) \
                if cg is not None else None
            if self.sysdir:
                sampler = DiskSampler(self.sysdir, self.plan.sample_interval, extra=extra).start()
            wl = Workload(spec, target, self.sysdir)
            trace = wl.run(on_phase=lambda ph: marks.__setitem__(ph, time.perf_counter()))
            rec["server_rss_bytes_end"] = {str(pid): rss_bytes(pid) for pid in target.pids()}
            rec["target_end"] = target.end_info()
        finally:
            if sampler is not None:
                sampler.stop()
            if cg is not None:
                rec["cgroup"] = {"version": cg.version, "failcnt": cg.failcnt(), "events": cg.events(),
                                 "stat_end": {k: v for k, v in cg.stat().items()
                                              if k in ("cache", "rss", "shmem", "mapped_file", "dirty",
                                                       "writeback", "active_file", "inactive_file", "file",
                                                       "anon", "kernel")}}
            t_close = time.perf_counter()
            try:
                if target is not None:
                    target.close()
            finally:
                rec["close_s"] = time.perf_counter() - t_close
                if cg is not None:
                    cg.remove()
        rec.update(summarize_trace(trace))
        if sampler is not None:
            t0 = trace.t_start
            if cg is not None:
                cg_samples = [int(v["page_cache"]) for (t, v) in sampler.extra_samples
                              if trace.t_decode_start <= t <= trace.t_end]
                rec.setdefault("cgroup", {})["page_cache_decode_median"] = median(cg_samples)
                rec["cgroup"]["usage_max"] = max((int(v["usage"]) for _, v in sampler.extra_samples), default=None)
            if keep_series:
                s = sampler.series(t0)
                rec["series"] = {**s, "prefill_end": trace.t_prefill_end - t0, "decode_start":
                                 trace.t_decode_start - t0, "end": trace.t_end - t0}
        return rec

    def settle(self) -> dict[str, Any]:
        """Let the device finish what the previous run left (writeback, discards of freed blocks), then let
        free page reporting hand what it freed back to the host (:func:`wait_free_pages_reported`), so
        every run starts equally cold.  The record's fields of both waits (None: not waited)."""
        disk: tuple[float | None, bool | None] = (None, None)
        memory: tuple[float | None, bool | None, int | None] = (None, None, None)
        if self.plan.settle and self.sysdir is not None:
            disk = wait_device_idle(self.sysdir)
        if self.plan.settles_memory:
            memory = wait_free_pages_reported()
        return {"settle_s": disk[0], "settled": disk[1], "memory_settle_s": memory[0],
                "memory_settled": memory[1], "memory_reported_kib": memory[2]}

    def round_probes(self, device: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
        if not device:
            return out
        d = os.path.join(self.plan.workdir, "probe")
        os.makedirs(d, exist_ok=True)
        if self._drop_ok:
            drop_caches()
        out.update(self.settle())
        try:
            out["fio"] = probes.fio_seq(d, self.plan.fio_size)
        except (OSError, RuntimeError, ValueError, KeyError) as e:
            out["fio"] = {"error": str(e)}
        out["pagecache"] = probes.pagecache_read_bw(d, self.plan.pc_probe_size)
        return out


def select_summary(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 47's figures of the sparse (``@<spec>``) points: per limit and point, decode time ÷ the dense point
    of the same configuration in the same round (median [min-max] of the paired ratios), the bytes read per decode
    step, the share of the selecting layers' pages attended and read, and the requests per step."""
    runs = [r for r in doc["runs"] if "error" not in r and r.get("decode_s")]
    dense = {(r["round"], r["config"], r.get("kv_format")): r for r in runs if not r.get("select")}
    out = []
    for name in sorted({r["name"] for r in runs if r.get("select")}):
        for limit in sorted({r["limit_bytes"] for r in runs if r["name"] == name}):
            rs = [r for r in runs if r["name"] == name and r["limit_bytes"] == limit]
            pairs = [(r, dense.get((r["round"], r["config"], r.get("kv_format")))) for r in rs]
            ratios = [r["decode_s"] / d["decode_s"] for r, d in pairs if d is not None]
            steps = max(1, doc["workload"]["gen_len"] - 1)
            sel = [r["select"] for r in rs if r.get("select")]
            out.append({
                "point": name, "limit_bytes": limit, "runs": len(rs),
                "decode_time_over_dense": summarize(ratios),
                "decode_s": summarize([r["decode_s"] for r in rs]),
                "dense_decode_s": summarize([d["decode_s"] for _, d in pairs if d is not None]),
                "read_bytes_per_step": statistics.median(r["bytes"]["decode_read"] / steps for r in rs),
                "dense_read_bytes_per_step": statistics.median(d["bytes"]["decode_read"] / steps
                                                               for _, d in pairs if d is not None),
                "pages_attended_share": median(x["pages"] / x["pages_total"] for x in sel),
                "pages_read_share": median(x["pages_read"] / x["pages_total"] for x in sel),
                "requests_per_step": median(x["requests"] / steps for x in sel),
                # JSONs before protocol 6 sent one request per run and have no "runs"
                "runs_per_step": median(x.get("runs", x["requests"]) / steps for x in sel),
            })
    return out


def run_sweep(plan: SweepPlan, out_path: str | None, *, bar: Any = None,
              bare_write: bool = True) -> dict[str, Any]:
    """Run every point ``plan.reps`` times (see the module doc); write the JSON after every run."""
    runner = SweepRunner(plan)
    spec = plan.spec
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(plan.workdir),
        "workload": spec.to_dict(),
        "plan": {"reps": plan.reps, "points": [p.__dict__ for p in plan.points], "workdir": plan.workdir,
                 "fio_size": plan.fio_size, "pc_probe_size": plan.pc_probe_size, "cold_runs": runner._drop_ok,
                 "cgroups": os.geteuid() == 0, "settle": plan.settle,
                 "memory_settle": plan.settles_memory, "order": "williams",
                 "sample_interval": plan.sample_interval, "codec_charge": plan.codec_charge,
                 "notes": plan.notes},
        "rounds": [], "runs": [], "reference": {},
        "codec": runner.codec,
    }
    lock = threading.Lock()

    def save() -> None:
        if out_path is None:
            return
        with lock:
            trials.write_json(out_path, doc, default=_json_default)

    if bare_write:
        d = os.path.join(plan.workdir, "probe")
        os.makedirs(d, exist_ok=True)
        doc["reference"]["bare_uring_write"] = probes.bare_uring_writes(
            d, spec.token_bytes, spec.kpu_bytes, spec.prompt_len, min(spec.gen_len, 8), 2 * spec.layers)
    rounds = plan.rounds()
    lowest = min((p.limit_bytes for p in plan.points if p.study == "sweep" and p.limit_bytes), default=None)
    t_start = time.perf_counter()
    for rep in range(plan.reps):
        order = trials.abba(rounds, rep)
        for ri, (key, pts) in enumerate(order):
            # the alpha study needs no device ceilings
            rnd = {"rep": rep, "key": list(key), "index": ri,
                   **runner.round_probes(device=any(p.study != "alpha" for p in pts))}
            doc["rounds"].append(rnd)
            for p in [pts[i] for i in trials.williams(len(pts), rep)]:
                if bar is not None:
                    lim = f"{p.limit_bytes / GiB:.2f}G" if p.limit_bytes else "nolimit"
                    bar.set_postfix_str(f"rep {rep + 1}/{plan.reps} {p.study} {p.name}/{p.pipeline} {lim}")
                keep = plan.keep_series == "all" or (plan.keep_series == "lowest" and p.limit_bytes == lowest
                                                     and p.study == "sweep")
                try:
                    rec = runner.run_point(p, rep, keep)
                except Exception as e:  # one failed run must not lose the sweep
                    rec = {"study": p.study, "config": p.config, "kv_format": p.kv_format, "pipeline": p.pipeline,
                           "rep": rep,
                           "limit_bytes": p.limit_bytes, "alpha": p.alpha, "error": f"{type(e).__name__}: {e}"}
                rec["round"] = len(doc["rounds"]) - 1
                doc["runs"].append(rec)
                save()
                if bar is not None:
                    bar.update(1)
    doc["wall_s"] = time.perf_counter() - t_start
    trials.loadavg_end(doc["machine"])
    save()
    return doc


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"cannot serialise {type(o).__name__}")


__all__ = [
    "SCHEMA",
    "Point",
    "SweepPlan",
    "SweepRunner",
    "default_points",
    "headroom_override",
    "machine_info",
    "run_sweep",
    "summarize_trace",
]
