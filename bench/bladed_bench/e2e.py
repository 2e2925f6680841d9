"""Real inference under real memory limits: tokens per second of a model whose KV does not fit, with bladed
and with what a user would run instead (``tools/bench_e2e.py``).

Every run is one ``bladed-runner`` process (the model's real compute, a random prompt of ``prompt_len``
tokens, ``gen_len`` greedy tokens without stopping at EOS) with its KV cache on one *side*:

* ``memory``: the KV in the runner's own memory (``--backend memory``), the in-RAM ideal, no limit;
* ``mmap``: FlexLLMGen's disk offload (``--backend mmap``: a ``.npy`` memmap per KPU, :mod:`bladed.torchdisk`);
* ``baseline``, ``cachepolicy``, ``direct``, ``dualblade``: bladed in that residency mode (Table III), and
  ``dualblade-q8`` (Dual-Blade with q8 rows, ``--kv-format q8``; any ``<mode>-<format>`` is accepted).

The process that owns the KV's page cache (bladed's daemon, started for the run on a file store in the work
directory with its defaults; or the mmap owner process, which the runner starts with ``--kv-cgroup``) runs in
a fresh memory cgroup (v1 on a hybrid host, else v2) with a hard limit: a fraction of the run's KV set. The
runner's own process, which holds the model's weights and activations, stays in the cgroup this tool runs in,
so they are not charged to the limit on either side; the record shows it (the runner's memory cgroup, and the
limited cgroup's peak anonymous memory, which is the owner's own, against the weights' bytes).

Every run starts cold (``sync; echo 3 > /proc/sys/vm/drop_caches``, then the device idle and free page
reporting quiet, as the KV sweep does). A repetition visits every limit (forwards, then backwards in the
next one), and at each limit runs every side once in the order of a row of a Williams Latin square, so
sides alternate and the order rotates. Figures per run: TTFT, prefill and decode tokens/s, the KV owner's
disk reads and writes (``/proc/<pid>/io``, from the runner's report) and the device's, the page-cache hit
ratio of the KV reads (the runner's op records), the cgroup's peak and ``failcnt``, the generated tokens
(every side's must equal ``memory``'s with the same KV format: the KV path is exact; a lossy format's against
the in-memory KV of that format) and the per-step split of the time (compute,
load wait, storage reads, DMA, writes) from the runner's op records.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import shutil
import stat
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from bladed.config import BudgetConfig
from bladed.sizes import PAGE_SIZE, align_up
from bladed_bench import stats, trials
from bladed_bench.cgroup import MemCgroup, can_drop_caches, drop_caches
from bladed_bench.metrics import (
    DiskSampler,
    DiskStat,
    block_device_of,
    wait_device_idle,
    wait_free_pages_reported,
)
from bladed_bench.repo import REPO, repo_env
from bladed_bench.workload import BenchDaemon

SCHEMA = "bladed.bench_e2e/1"
GiB = 1 << 30
MiB = 1 << 20
#: the sides of the issue, in the order tables show them
SIDES = ("memory", "mmap", "baseline", "cachepolicy", "direct", "dualblade", "dualblade-q8")
BLADED_MODES = ("baseline", "cachepolicy", "direct", "dualblade")
LABELS = {"memory": "memory (ideal)", "mmap": "mmap (FlexLLMGen)", "baseline": "bladed Baseline",
          "cachepolicy": "bladed CachePolicy-Only", "direct": "bladed NVMe-direct-Only", "dualblade": "Dual-Blade"}
#: the memory cgroup counters kept (their peak over the run's samples; v1 and v2 names)
CGROUP_STATS = ("cache", "rss", "shmem", "mapped_file", "dirty", "writeback", "file", "anon", "file_mapped",
                "file_dirty", "file_writeback", "pgmajfault")


#: a bladed side's ``~section.key=value`` suffixes: daemon settings of its own (``dualblade~budget.absorb_rate=0``:
#: Dual-Blade with the headroom fraction alone), for the before and after of a default
SETTING_SEP = "~"


def side_settings(side: str) -> dict[str, dict[str, Any]]:
    """The daemon settings a side names (``~budget.absorb_rate=0`` -> ``{"budget": {"absorb_rate": 0}}``)."""
    out: dict[str, dict[str, Any]] = {}
    for item in side.split(SETTING_SEP)[1:]:
        key, eq, text = item.partition("=")
        section, dot, name = key.partition(".")
        if not (eq and dot and section and name):
            raise ValueError(f"side {side!r}: a setting is ~section.key=value, got {item!r}")
        try:
            value: Any = json.loads(text)
        except json.JSONDecodeError:
            value = text
        out.setdefault(section, {})[name] = value
    return out


def _base(side: str) -> str:
    return side.split(SETTING_SEP)[0]


def side_label(side: str) -> str:
    if SETTING_SEP in side:
        return side_label(_base(side)) + " (" + ", ".join(side.split(SETTING_SEP)[1:]) + ")"
    if "@sel" in side:
        name, _, n = side.rpartition("@sel")
        return side_label(name) + f", sparse reads{f' {n}' if n else ''}"
    name, _, backing = side.partition("+")
    mode, _, fmt = name.partition("-")
    return LABELS.get(mode, mode) + (f" {fmt}" if fmt else "") + (f" ({backing} Group 1)" if backing else "")


#: a bladed side's ``+<backing>`` suffix: the daemon's ``pagecache.backing`` (``dualblade+disk``: Group 1 on disk
#: files, as before issue 39)
BACKINGS = ("memory", "disk")


#: a side's suffix for the plan's sparse decode reads (``dualblade@sel``: the runner's ``--kv-select`` with
#: :attr:`E2EPlan.select`)
SELECT_SUFFIX = "@sel"


def select_index(side: str) -> int | None:
    """Which of the plan's selections ``side`` runs with: ``dualblade@sel`` the first, ``dualblade@sel2`` the
    second, ...; None for a dense side."""
    _, at, n = _base(side).rpartition(SELECT_SUFFIX)
    if not at or (n and not n.isdigit()):
        return None
    return int(n) - 1 if n else 0


def side_selects(side: str) -> bool:
    """Whether ``side`` runs with one of the plan's sparse decode reads (``dualblade@sel``, ``memory@sel2``)."""
    return select_index(side) is not None


def dense_side(side: str) -> str:
    """``side`` without its selection (``dualblade@sel2``: ``dualblade``; its settings kept)."""
    base = _base(side)
    if not side_selects(side):
        return side
    return base.rpartition(SELECT_SUFFIX)[0] + side[len(base):]


def parse_side(side: str) -> tuple[str, str | None]:
    """``dualblade-q8`` -> ``("dualblade", "q8")``; ValueError naming the known sides for anything else."""
    if SETTING_SEP in side and parse_side(_base(side))[0] not in BLADED_MODES:
        raise ValueError(f"side {side!r}: only a bladed side takes daemon settings")
    side_settings(side)
    side = _base(dense_side(side))
    name, _, backing = side.partition("+")
    mode, _, fmt = name.partition("-")
    if mode not in ("memory", "mmap", *BLADED_MODES) or (backing and (backing not in BACKINGS or
                                                                      mode not in BLADED_MODES)):
        raise ValueError(f"unknown side {side!r}; choose from {', '.join(SIDES)} (a side may carry a KV format: "
                         "dualblade-q8, mmap-q8, ...; a bladed side a page-cache backing: dualblade+disk; any side "
                         f"the plan's sparse decode reads: dualblade{SELECT_SUFFIX})")
    return mode, fmt or None


def side_backing(side: str) -> str | None:
    """The ``pagecache.backing`` a bladed side names (``dualblade+disk``: ``disk``), or None (the default)."""
    return _base(dense_side(side)).partition("+")[2] or None


def reference_side(side: str) -> str:
    """The in-memory side whose tokens ``side``'s must equal: the same KV format and selection, KV in RAM."""
    fmt = parse_side(side)[1]
    suffix = _base(side)[len(_base(dense_side(side))):]
    return "memory" + (f"-{fmt}" if fmt else "") + suffix


@dataclass(frozen=True)
class E2EWorkload:
    """What every run generates: the model, where it computes, the batch and the lengths."""

    name: str
    model: str
    device: str = "cpu"
    dtype: str | None = None          # None: the runner's default (float32 on the CPU, float16 on CUDA)
    batch: int = 8
    prompt_len: int = 1024
    gen_len: int = 16
    copy_threads: int = 2
    prefetch: int | None = None       # None: the runner's default

    def runner_args(self) -> list[str]:
        args = ["--model", self.model, "--device", self.device, "--gpu-batch-size", str(self.batch),
                "--prompt-len", str(self.prompt_len), "--gen-len", str(self.gen_len), "--stop-at-eos", "false",
                "--copy-threads", str(self.copy_threads), "--seed", "0", "--json"]
        return args + (["--dtype", self.dtype] if self.dtype else []) + (
            ["--prefetch", str(self.prefetch)] if self.prefetch else [])


#: the workloads of the issue: SmolLM2-135M on the CPU (KV 0.54 GiB in float32; a run takes about 40 s),
#: OPT-6.7B's shape with random fp16 weights on CUDA (KV about 4.1 GiB), and a tiny one for the test
WORKLOADS = {
    "smollm2": E2EWorkload("smollm2", "smollm2", "cpu", "float32", batch=12, prompt_len=1024, gen_len=16),
    "opt-6.7b": E2EWorkload("opt-6.7b", "facebook/opt-6.7b", "cuda", "float16", batch=8, prompt_len=1024,
                            gen_len=32),
    "tiny": E2EWorkload("tiny", "tiny-llama", "cpu", None, batch=2, prompt_len=96, gen_len=6),
}


@dataclass
class E2EPlan:
    workload: E2EWorkload
    sides: list[str] = field(default_factory=lambda: list(SIDES))
    #: the hard limits: the owner's own memory (:func:`owner_allowance`) plus these fractions of the run's KV set
    #: (all layers' K and V at prompt + gen tokens)
    fractions: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75, 1.0, 1.25])
    #: the owner's own memory, in bytes (None: :func:`owner_allowance` of the workload)
    allowance: int | None = None
    reps: int = 3
    workdir: str = "/var/tmp/bladed-e2e"
    drop: bool = True
    settle: bool = True
    timeout_s: float = 1800.0
    notes: dict[str, Any] = field(default_factory=dict)
    #: what a cold start drops: "all" (``drop_caches``) or "workdir" (``sync``, then the pages of the files
    #: under ``workdir`` evicted: the KV's stores; the interpreter's and CUDA's libraries stay cached)
    drop_scope: str = "all"
    #: seconds the sweep may take from its start, warm-up included (None: no limit): a run that would likely
    #: end past it (it and the longest run so far) is not started, nor any after it; the JSON's ``budget``
    #: says how many ran
    budget_s: float | None = None
    #: called after every limit of every repetition with (repetition, fraction, limit, the JSON so far): another
    #: system run at the same point of the same alternation (``tools/gpu/gpu_check_steps.py``: FlexGen)
    after_limit: Callable[[int, float, int, dict[str, Any]], None] | None = None
    #: the sparse decode reads of the ``@sel`` sides (the runner's ``--kv-select``; docs/kv-select.md)
    #: the sparse decode reads of the ``@sel`` sides (the runner's ``--kv-select``; docs/kv-select.md): ``@sel`` the
    #: first, ``@sel2`` the second, ...
    select: list[str] = field(default_factory=list)


# -- one run ---------------------------------------------------------------------------------

def _peak_stats(samples: Iterable[dict[str, float]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in samples:
        for k, v in s.items():
            out[k] = max(out.get(k, 0), int(v))
    return out


def _cgroup_sample(cg: MemCgroup) -> dict[str, float]:
    stat = cg.stat()
    out = {k: float(stat[k]) for k in CGROUP_STATS if k in stat}
    out["usage"] = float(cg.usage())
    return out


def _memory_cgroup_of(pid: int) -> str | None:
    """The memory cgroup of ``pid`` (the v1 ``memory`` line, else the v2 ``0::`` one)."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    v1 = [ln.split(":", 2)[2] for ln in lines if ln.split(":", 2)[1:2] and "memory" in ln.split(":", 2)[1].split(",")]
    v2 = [ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")]
    found = v1 or v2
    return found[0] if found else None


def _plan_summary(plans: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What bladed planned for the run's sessions: page-cache and direct bytes, Group 1 layers, the budget."""
    if not plans or not any(plans):
        return None
    pc = sum(k.get("nbytes", 0) for p in plans for k in p.get("kpus", []) if k.get("path") == "pagecache")
    total = sum(k.get("nbytes", 0) for p in plans for k in p.get("kpus", []))
    return {"pagecache_bytes": pc, "direct_bytes": total - pc, "fits": pc / total if total else None,
            "group1_layers": [p.get("group1_layers") for p in plans],
            "budget_bytes": [p.get("budget_bytes") for p in plans],
            "budget": plans[0].get("budget")}      # Eq. 1-2's terms as the daemon sampled them for the first


def _hit_ratios(stats: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """From the runner's per-path statistics: the hit ratio of the page-cache path's reads (bladed's
    ``pagecache``, the mmap side's ``mmap``) and the share of all KV read bytes served from memory."""
    pc_paths = [p for p in stats if p in ("pagecache", "mmap", "memory")]
    pc_bytes = sum(stats[p].get("read_bytes", 0) for p in pc_paths)
    hit_bytes = sum(stats[p].get("read_bytes", 0) * stats[p].get("hit_ratio", 0.0) for p in pc_paths
                    if stats[p].get("hit_ratio") is not None)
    all_bytes = sum(s.get("read_bytes", 0) for s in stats.values())
    return {"pagecache_hit_ratio": hit_bytes / pc_bytes if pc_bytes else None,
            "served_from_memory": hit_bytes / all_bytes if all_bytes else None}


class E2ERunner:
    """Runs one side at one limit, cold, and records what the issue asks for."""

    def __init__(self, plan: E2EPlan) -> None:
        self.plan = plan
        os.makedirs(plan.workdir, exist_ok=True)
        self.sysdir = block_device_of(plan.workdir)
        if plan.drop_scope not in ("all", "workdir"):
            raise ValueError(f"drop_scope {plan.drop_scope!r}: give 'all' (drop_caches) or 'workdir' (its files)")
        self.drop_ok = plan.drop and can_drop_caches()
        self.cgroups = os.geteuid() == 0
        self.env = repo_env() | {"BLADED_CACHE_DIR": os.path.join(plan.workdir, "models")}
        self.store_bytes = 0         # set from the KV set once it is known

    def runner_argv(self, side: str, state: str, cg: MemCgroup | None, socket_path: str | None) -> list[str]:
        mode, fmt = parse_side(side)
        argv = [sys.executable, "-m", "bladed.runner", *self.plan.workload.runner_args()]
        if mode == "memory":
            argv += ["--backend", "memory"]
        elif mode == "mmap":
            argv += ["--backend", "mmap", "--kv-dir", os.path.join(state, "torchdisk")]
            if cg is not None:
                argv += ["--kv-cgroup", cg.path]
        else:
            assert socket_path is not None
            argv += ["--backend", "bladed", "--socket", socket_path, "--mode", mode]
        if fmt:
            argv += ["--kv-format", fmt]
        i = select_index(side)
        if i is not None:
            if i >= len(self.plan.select):
                raise ValueError(f"side {side!r} needs selection {i + 1} of the plan's (tools/bench_e2e.py --select)")
            argv += ["--kv-select", self.plan.select[i]]
        return argv

    def settle(self) -> dict[str, Any]:
        """Drop the caches (``plan.drop_scope``), then wait for the device to go idle and free page reporting to
        go quiet."""
        out: dict[str, Any] = {"cold": self.drop_ok, "drop_caches_s": None}
        if self.drop_ok:
            out["drop_scope"] = self.plan.drop_scope
            out["drop_caches_s"] = drop_caches() if self.plan.drop_scope == "all" else evict_files(self.plan.workdir)
        if self.plan.settle and self.sysdir is not None:
            out["settle_s"], out["settled"] = wait_device_idle(self.sysdir)
        if self.plan.settle:
            waited, quiet, _ = wait_free_pages_reported()
            out["memory_settle_s"], out["memory_settled"] = waited, quiet
        return out

    def run(self, side: str, limit: int | None, *, cold: bool = True) -> dict[str, Any]:
        """One runner process on ``side`` with its KV owner limited to ``limit`` bytes (None: no limit)."""
        mode, fmt = parse_side(side)
        state = os.path.join(self.plan.workdir, "run")
        for sub in ("pagecache", "torchdisk"):
            shutil.rmtree(os.path.join(state, sub), ignore_errors=True)
        os.makedirs(state, exist_ok=True)
        rec: dict[str, Any] = {"side": side, "mode": mode, "kv_format": fmt, "limit_bytes": limit,
                               "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
        if cold:
            rec.update(self.settle())
        cg = MemCgroup(limit, prefix="bladed-e2e") if self.cgroups and mode != "memory" else None
        daemon: BenchDaemon | None = None
        sampler: DiskSampler | None = None
        before: DiskStat | None = None
        try:
            if mode in BLADED_MODES:
                # bladed as a user runs it: a file store big enough for the KV set, the daemon's defaults
                # (the KV sweep's harness fixes budget.interval_s at an hour; here it stays the default)
                extra: dict[str, dict[str, Any]] = {"budget": {"interval_s": BudgetConfig().interval_s}}
                if side_backing(side):
                    extra["pagecache"] = {"backing": side_backing(side)}
                for section, keys in side_settings(side).items():
                    extra.setdefault(section, {}).update(keys)
                daemon = BenchDaemon(os.path.join(state, "daemon"), self.store_bytes,
                                     cg.launcher if cg is not None else None, extra)
                rec["daemon_startup_s"] = round(daemon.startup_s, 3)
            argv = self.runner_argv(side, state, cg, daemon.socket_path if daemon is not None else None)
            rec["argv"] = argv[2:]
            if self.sysdir is not None:
                before = DiskStat.read(self.sysdir)
                sampler = DiskSampler(self.sysdir, 0.1, extra=(lambda: _cgroup_sample(cg)) if cg else None,
                                      extra_every=1).start()
            t0 = time.perf_counter()
            proc = subprocess.Popen(argv, cwd=REPO, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
            rec["runner_cgroup"] = _memory_cgroup_of(proc.pid)
            try:
                out, err = proc.communicate(timeout=self.plan.timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                raise RuntimeError(f"the runner took more than {self.plan.timeout_s:.0f} s") from None
            rec["process_s"] = round(time.perf_counter() - t0, 3)
            if proc.returncode != 0:
                raise RuntimeError(f"the runner exited with status {proc.returncode}: "
                                   f"{(err.strip().splitlines() or ['(no output)'])[-1]}")
            report = json.loads(out)
        finally:
            if sampler is not None:
                sampler.stop()
            if cg is not None:
                rec["cgroup"] = {"version": cg.version, "path": cg.path, "limit_bytes": cg.limit(),
                                 "peak_bytes": cg.peak(), "failcnt": cg.failcnt(), "events": cg.events(),
                                 "peak_stat": _peak_stats(v for _, v in sampler.extra_samples) if sampler else {}}
            try:
                if daemon is not None:
                    rc = daemon.stop()
                    if rc not in (0, None):
                        rec["daemon_exit"] = rc
                        rec["daemon_log_tail"] = daemon.log_tail(10)
            finally:
                if cg is not None:
                    cg.remove()
        if before is not None and sampler is not None and sampler.samples:
            d = sampler.samples[-1].delta(before)
            rec["device"] = {"read_bytes": d["read_bytes"], "write_bytes": d["write_bytes"], "seconds": d["seconds"]}
        rec.update(self._from_report(report))
        return rec

    def _from_report(self, r: dict[str, Any]) -> dict[str, Any]:
        owners = r["info"].get("kv_owner") or []
        ios = [o.get("io") for o in owners]
        owner_io = None if not ios or any(io is None for io in ios) else {
            k: sum(io.get(k, 0) for io in ios) for k in ("read_bytes", "write_bytes")}
        return {
            "ttft_s": r["ttft_s"], "prefill_s": r["prefill_latency_s"], "decode_s": r["decode_latency_s"],
            "prefill_tok_s": r["prefill_throughput_tok_s"], "decode_tok_s": r["decode_throughput_tok_s"],
            "gen_len": r["gen_len"], "kv_bytes": r.get("kv_bytes"), "weight_bytes": r.get("weight_bytes"),
            "tiers": r["info"].get("tiers", ""),
            "kv_format": r["info"].get("kv_format"), "owner_io": owner_io, "owners": owners,
            "hit": _hit_ratios(r.get("stats", {})), "stats": r.get("stats", {}), "load_wait_s": r.get("load_wait_s"),
            "pipeline": {k: r.get("pipeline", {}).get(k) for k in ("decision", "intra_GBps", "cross_GBps")},
            "plan": _plan_summary(r.get("plans") or []), "steps": r.get("steps"), "tokens": r["tokens"],
            "select": r.get("select"),
        }


# -- the sweep -------------------------------------------------------------------------------

#: what an owner process holds besides KV after a cold start: its interpreter's heap and the code pages of
#: Python, numpy and bladed it faults in (the daemon: 27 MiB of anonymous memory measured, plus its libraries)
OWNER_BASE = 48 * MiB


def owner_allowance(kv_bytes: int, offloaded_layers: int, channels: int = 2) -> int:
    """The memory a KV owner needs before any KV: :data:`OWNER_BASE` and one staging slot (a KPU) per copy
    thread (Eq. 2's ``N_threads * M_pin``), charged to the owner on both sides."""
    kpu = kv_bytes // max(1, 2 * offloaded_layers)
    return OWNER_BASE + channels * align_up(kpu, PAGE_SIZE)


def offloaded_layers(tiers: str) -> int:
    """The layers offloaded, from the runner's ``tiers`` (``"disk:30"``, ``"gpu:2 disk:28"``)."""
    for part in tiers.split():
        name, _, n = part.partition(":")
        if name == "disk":
            return int(n)
    return 0


def evict_files(top: str) -> float:
    """``sync``, then every file under ``top`` out of the page cache (``POSIX_FADV_DONTNEED``); the seconds taken."""
    t0 = time.perf_counter()
    os.sync()
    for dirpath, _, names in os.walk(top):
        for n in names:
            path = os.path.join(dirpath, n)
            try:
                if not stat.S_ISREG(os.lstat(path).st_mode):    # a socket, a FIFO (opening it would block)
                    continue
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:            # gone meanwhile
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)
    return time.perf_counter() - t0


def run_e2e(plan: E2EPlan, out_path: str | None, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The sweep (module doc): a warm-up run for the KV set's size and the reference tokens, then ``reps``
    repetitions of every side at every limit; the JSON is rewritten after every run."""
    for s in plan.sides:
        parse_side(s)
    runner = E2ERunner(plan)
    say = progress or (lambda _m: None)
    doc: dict[str, Any] = {
        "schema": SCHEMA, "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": trials.machine(plan.workdir, ("bladed", "cffi_build", "bench", "tools")),
        "workload": dataclasses.asdict(plan.workload),
        "plan": {"sides": plan.sides, "fractions": plan.fractions, "reps": plan.reps, "workdir": plan.workdir,
                 "cold_runs": runner.drop_ok, "cgroups": runner.cgroups, "settle": plan.settle,
                 "order": "williams", "notes": plan.notes, "drop_scope": plan.drop_scope,
                 "budget_s": plan.budget_s, "select": plan.select},
        "runs": [],
    }
    lock = threading.Lock()

    def save() -> None:
        if out_path is None:
            return
        with lock:
            trials.write_json(out_path, doc, newline=True)

    t_begin = time.perf_counter()
    say("warm-up: memory side (model conversion, KV set size, reference tokens)")
    warm = runner.run("memory", None, cold=False)
    # a lossy format's (or a selection's) tokens are compared with the in-memory KV of the same format and
    # selection (the same arithmetic)
    refs: dict[str, Any] = {"memory": warm["tokens"]}
    for ref in sorted({reference_side(s) for s in plan.sides} - {"memory"}):
        say(f"warm-up: side {ref} (its reference tokens)")
        refs[ref] = runner.run(ref, None, cold=False)["tokens"]
    kv = int(warm["kv_bytes"])
    runner.store_bytes = align_up(kv + 256 * MiB, MiB)
    allowance = plan.allowance if plan.allowance is not None else owner_allowance(
        kv, offloaded_layers(warm["tiers"]), plan.workload.copy_threads)
    doc["kv_bytes"] = kv
    doc["weight_bytes"] = warm.get("weight_bytes")
    doc["owner_allowance_bytes"] = allowance
    doc["warmup"] = {k: warm[k] for k in ("process_s", "ttft_s", "decode_tok_s", "prefill_tok_s")}
    doc["reference_tokens"] = dict(refs)
    limits = [align_up(allowance + int(f * kv), PAGE_SIZE) for f in plan.fractions]  # the kernel keeps pages
    doc["limits"] = limits
    total = plan.reps * len(limits) * len(plan.sides)
    doc["budget"] = budget = {"budget_s": plan.budget_s, "stopped": False, "runs_done": 0, "runs_planned": total}
    longest = time.perf_counter() - t_begin       # a run's length, until one has been timed: the warm-up's
    t_start = time.perf_counter()
    for rep in range(plan.reps):
        order = trials.abba(limits, rep)
        for ri, limit in enumerate(order):
            frac = plan.fractions[limits.index(limit)]
            for si in trials.williams(len(plan.sides), rep * len(limits) + ri):
                side = plan.sides[si]
                if plan.budget_s is not None and time.perf_counter() - t_begin + longest > plan.budget_s:
                    budget["stopped"] = True
                    say(f"budget: {plan.budget_s:.0f} s would be passed; {len(doc['runs'])} of {total} runs done")
                    break
                t_run = time.perf_counter()
                say(f"rep {rep + 1}/{plan.reps} limit {limit / GiB:.3f} GiB ({frac:g} of the KV) {side} "
                    f"[{len(doc['runs']) + 1}/{total}]")
                try:
                    rec = runner.run(side, limit)
                except Exception as e:    # one failed run must not lose the sweep
                    rec = {"side": side, "limit_bytes": limit, "error": f"{type(e).__name__}: {e}"}
                rec.update(rep=rep, fraction=frac, round=rep * len(limits) + ri)
                if "tokens" in rec:
                    rec["tokens_equal_memory"] = rec["tokens"] == refs[reference_side(side)]
                doc["runs"].append(rec)
                budget["runs_done"] = len(doc["runs"])
                longest = max(longest, time.perf_counter() - t_run)
                save()
            if budget["stopped"]:
                break
            if plan.after_limit is not None:
                plan.after_limit(rep, frac, limit, doc)
                save()
        if budget["stopped"]:
            break
    doc["wall_s"] = round(time.perf_counter() - t_start, 1)
    trials.loadavg_end(doc["machine"])
    doc["summary"] = summary_by_limit(doc)
    save()
    return doc


# -- figures from the JSON ------------------------------------------------------------------

def paired_at(doc: dict[str, Any], a: str, b: str, key: str, limit: int) -> list[float]:
    """At ``limit``: ``a``'s ``key`` ÷ ``b``'s, run against run in the same round (the same repetition and limit)."""
    by_round = stats.paired([r for r in stats.ok_runs(doc) if r["limit_bytes"] == limit], a, b,
                            name=lambda r: r["side"], group=lambda r: r["round"], value=lambda r: r.get(key))
    return [x for xs in by_round.values() for x in xs]


def summary_by_limit(doc: dict[str, Any]) -> dict[str, Any]:
    """The JSON's ``summary``: per limit and side, medians [min-max] of the figures; the issue's ratios, paired
    within a round."""
    runs = stats.ok_runs(doc)
    sides = doc["plan"]["sides"]
    out: dict[str, Any] = {"by_limit": [], "errors": len(doc["runs"]) - len(runs),
                           "tokens_equal_memory": all(r.get("tokens_equal_memory", False) for r in runs)}
    for limit, frac in zip(doc["limits"], doc["plan"]["fractions"], strict=True):
        row: dict[str, Any] = {"limit_bytes": limit, "fraction": frac, "sides": {}}
        for side in sides:
            rs = [r for r in runs if r["side"] == side and r["limit_bytes"] == limit]
            if not rs:
                continue
            plans = [r["plan"]["fits"] for r in rs if r.get("plan") and r["plan"].get("fits") is not None]
            row["sides"][side] = {
                "runs": len(rs),
                "decode_tok_s": stats.median_range([r["decode_tok_s"] for r in rs]),
                "prefill_tok_s": stats.median_range([r["prefill_tok_s"] for r in rs]),
                "ttft_s": stats.median_range([r["ttft_s"] for r in rs]),
                "owner_read_bytes": stats.median_range([(r.get("owner_io") or {}).get("read_bytes") for r in rs]),
                "owner_write_bytes": stats.median_range([(r.get("owner_io") or {}).get("write_bytes") for r in rs]),
                "pagecache_hit_ratio": stats.median_range([r["hit"]["pagecache_hit_ratio"] for r in rs]),
                "served_from_memory": stats.median_range([r["hit"]["served_from_memory"] for r in rs]),
                "cgroup_peak_bytes": stats.median_range([(r.get("cgroup") or {}).get("peak_bytes") for r in rs]),
                "cgroup_anon_peak_bytes": stats.median_range([(r.get("cgroup") or {}).get("peak_stat", {}).get(
                    "rss", (r.get("cgroup") or {}).get("peak_stat", {}).get("anon")) for r in rs]),
                "failcnt": stats.median_range([(r.get("cgroup") or {}).get("failcnt") for r in rs]),
                "planned_fits": stats.median_range(plans),
                "tokens_equal_memory": all(r.get("tokens_equal_memory", False) for r in rs),
            }
        ratios: dict[str, Any] = {}
        pairs = [("dualblade", "mmap"), ("dualblade", "baseline"), ("dualblade", "memory"), ("baseline", "mmap"),
                 ("dualblade-q8", "dualblade"), ("dualblade-q8", "mmap")]
        pairs += [(side.partition("+")[0], side) for side in sides if "+" in side]   # a backing against the default
        pairs += [(_base(side), side) for side in sides if SETTING_SEP in side]       # settings against the default
        pairs += [(side, b) for side in sides if side_selects(side)                 # the sparse reads
                  for b in (dense_side(side), "memory")]
        for a, b in pairs:
            if a in sides and b in sides:
                ratios[f"{a}/{b}"] = {"decode_time": stats.median_range(paired_at(doc, a, b, "decode_s", limit)),
                                      "ttft": stats.median_range(paired_at(doc, a, b, "ttft_s", limit)),
                                      "decode_tok_s": stats.median_range(paired_at(doc, a, b, "decode_tok_s", limit))}
        row["ratios"] = ratios
        out["by_limit"].append(row)
    return out


def worst_point(doc: dict[str, Any], a: str = "dualblade", b: str = "mmap") -> int | None:
    """The limit where ``a``'s decode time is the largest share of ``b``'s (median of the paired ratios)."""
    best: tuple[float, int] | None = None
    for limit in doc["limits"]:
        r = stats.median_range(paired_at(doc, a, b, "decode_s", limit))
        if r is not None and (best is None or r["median"] > best[0]):
            best = (r["median"], limit)
    return None if best is None else best[1]


def breakdown(doc: dict[str, Any], limit: int, sides: Iterable[str]) -> dict[str, Any]:
    """Per side at ``limit``: the decode steps' time split (:data:`bladed.runner.generation.STEP_FIELDS`), per
    step, medians over the repetitions, and the prefill step's."""
    out: dict[str, Any] = {}
    for side in sides:
        rs = [r for r in stats.ok_runs(doc) if r["side"] == side and r["limit_bytes"] == limit and r.get("steps")]
        if not rs:
            continue
        fields = [k for k in rs[0]["steps"][0] if k != "step"]
        decode = {k: statistics.median(sum(s[k] for s in r["steps"][1:]) / max(1, len(r["steps"]) - 1)
                                       for r in rs) for k in fields}
        prefill = {k: statistics.median(r["steps"][0][k] for r in rs) for k in fields}
        out[side] = {"decode_per_step": decode, "prefill": prefill, "runs": len(rs)}
    return out


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets against this run (issue 38): each a measure, its target, the values per limit and
    whether it holds. Decode and TTFT ratios are of times (below 1: Dual-Blade is faster), paired in a round;
    "full fit" is the highest limit."""
    summ = doc.get("summary") or summary_by_limit(doc)
    rows = summ["by_limit"]

    def med(row: dict[str, Any], pair: str, key: str) -> float | None:
        m = row["ratios"].get(pair, {}).get(key)
        return None if m is None else float(m["median"])

    def values(pair: str, key: str, pick: list[dict[str, Any]]) -> list[tuple[float, float | None]]:
        return [(row["fraction"], med(row, pair, key)) for row in pick]

    def held(vals: list[tuple[float, float | None]], ok: Callable[[float], bool]) -> bool | None:
        known = [v for _, v in vals if v is not None]
        return None if not known else all(ok(v) for v in known)

    under_half = [row for row in rows if row["fraction"] < 0.5]
    full = rows[-1:] if rows else []
    out = []
    for measure, target, vals, ok in (
            ("decode time, Dual-Blade ÷ mmap, where less than half the KV set fits", "<= 0.65",
             values("dualblade/mmap", "decode_time", under_half), lambda v: v <= 0.65),
            ("decode time, Dual-Blade ÷ mmap, every limit", "<= 1.0",
             values("dualblade/mmap", "decode_time", rows), lambda v: v <= 1.0),
            ("TTFT, Dual-Blade ÷ mmap, every limit", "<= 1.0", values("dualblade/mmap", "ttft", rows),
             lambda v: v <= 1.0),
            ("decode tokens/s at full fit, Dual-Blade ÷ memory", ">= 0.85",
             values("dualblade/memory", "decode_tok_s", full), lambda v: v >= 0.85),
            ("decode time, Dual-Blade q8 ÷ Dual-Blade (fp32 rows)", "report",
             values("dualblade-q8/dualblade", "decode_time", rows), lambda v: True)):
        out.append({"measure": measure, "target": target, "values": vals,
                    "met": None if target == "report" else held(vals, ok)})
    out.append({"measure": "generated tokens equal to memory's (of the same KV format)", "target": "all runs",
                "values": [], "met": bool(summ.get("tokens_equal_memory"))})
    return out


def markdown(doc: dict[str, Any]) -> str:
    """The tables of the report: decode tokens/s by limit and side; the issue's ratios; where the time goes."""
    summ = doc.get("summary") or summary_by_limit(doc)
    sides = doc["plan"]["sides"]
    w = doc["workload"]
    kv = doc["kv_bytes"]
    lines = [f"Workload: {w['model']} on {w['device']}, batch {w['batch']}, prompt {w['prompt_len']}, "
             f"{w['gen_len']} tokens, KV set {kv / GiB:.3f} GiB; {doc['plan']['reps']} repetitions, "
             f"{'cold' if doc['plan']['cold_runs'] else 'warm'} runs, sides alternated; "
             f"machine {doc['machine'].get('cpu_model', '?')}, {doc['machine'].get('cpus', '?')} CPUs.", "",
             f"Decode tokens/s, median [min-max]. *limit*: the KV owner's memory cgroup, its own memory "
             f"({doc['owner_allowance_bytes'] / MiB:.0f} MiB: interpreter, libraries, staging slots) plus *KV*, a "
             "share of the KV set; *fits*: the share of the KV set Dual-Blade planned on the page-cache path.", ""]
    head = "| limit (GiB) | KV | fits | " + " | ".join(side_label(s) for s in sides) + " |"
    lines += [head, "|" + " --- |" * (3 + len(sides))]
    for row in summ["by_limit"]:
        fits = row["sides"].get("dualblade", {}).get("planned_fits")
        cells = [stats.fmt(row["sides"].get(s, {}).get("decode_tok_s")) for s in sides]
        lines.append(f"| {row['limit_bytes'] / GiB:.3f} | {row['fraction']:.2f} | "
                     f"{fits['median'] if fits else float('nan'):.2f} | " + " | ".join(cells) + " |")
    lines += ["", "Ratios, paired run against run in a round, median [min-max] (time ratios: below 1 is faster):",
              "", "| limit (GiB) | decode time DB ÷ mmap | TTFT DB ÷ mmap | decode time DB ÷ bladed Baseline | "
                  "decode tok/s DB ÷ memory | decode time DB q8 ÷ DB | hit ratio DB / mmap | "
                  "owner disk reads DB / mmap (GiB) | cgroup peak DB / mmap (GiB) | failcnt DB / mmap |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    def get(row: dict[str, Any], side: str, key: str, scale: float = 1.0, digits: int = 2) -> str:
        m = row["sides"].get(side, {}).get(key)
        return f"{m['median'] * scale:.{digits}f}" if m else "-"

    for row in summ["by_limit"]:
        r = row["ratios"]

        lines.append(
            f"| {row['limit_bytes'] / GiB:.3f} | {stats.fmt(r.get('dualblade/mmap', {}).get('decode_time'))} | "
            f"{stats.fmt(r.get('dualblade/mmap', {}).get('ttft'))} | "
            f"{stats.fmt(r.get('dualblade/baseline', {}).get('decode_time'))} | "
            f"{stats.fmt(r.get('dualblade/memory', {}).get('decode_tok_s'))} | "
            f"{stats.fmt(r.get('dualblade-q8/dualblade', {}).get('decode_time'))} | "
            f"{get(row, 'dualblade', 'pagecache_hit_ratio')} / {get(row, 'mmap', 'pagecache_hit_ratio')} | "
            f"{get(row, 'dualblade', 'owner_read_bytes', 1 / GiB)} / "
            f"{get(row, 'mmap', 'owner_read_bytes', 1 / GiB)} | "
            f"{get(row, 'dualblade', 'cgroup_peak_bytes', 1 / GiB, 3)} / "
            f"{get(row, 'mmap', 'cgroup_peak_bytes', 1 / GiB, 3)} | "
            f"{get(row, 'dualblade', 'failcnt', digits=0)} / {get(row, 'mmap', 'failcnt', digits=0)} |")
    worst = worst_point(doc)
    if worst is not None:
        bd = breakdown(doc, worst, [s for s in ("memory", "mmap", "dualblade") if s in sides])
        lines += ["", f"Where the time goes at {worst / GiB:.3f} GiB (the limit where Dual-Blade's decode is the "
                      "largest share of mmap's): seconds per decode step, medians of the runs; compute and load "
                      "wait are the compute thread's, read / DMA / write the copy threads' busy time (they overlap "
                      "the compute):", "",
                  "| side | step wall | compute | load wait | storage read | DMA | write | read GiB/step |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for side, b in bd.items():
            d = b["decode_per_step"]
            lines.append(f"| {side_label(side)} | {d['wall_s']:.3f} | {d['compute_s']:.3f} | {d['load_wait_s']:.3f} "
                         f"| {d['read_s']:.3f} | {d['dma_s']:.3f} | {d['write_s']:.3f} | "
                         f"{d['read_bytes'] / GiB:.3f} |")
    lines += ["", "The targets (issue 38):", "", "| measure | target | value (KV share of the limit: median) | |",
              "| --- | --- | --- | --- |"]
    for t in targets(doc):
        vals = ", ".join(f"{f:g}: {'-' if v is None else f'{v:.2f}'}" for f, v in t["values"]) or "-"
        verdict = {True: "met", False: "**missed**", None: ""}[t["met"]]
        lines.append(f"| {t['measure']} | {t['target']} | {vals} | {verdict} |")
    sparse = [side for side in sides if side_selects(side)]
    if sparse:
        specs = doc["plan"].get("select") or []
        specs = [specs] if isinstance(specs, str) else specs
        lines += ["", "Sparse decode reads, paired ratios, median [min-max]:", "",
                  "| limit (GiB) | side | `--kv-select` | decode time ÷ dense | decode tok/s ÷ memory (dense) |",
                  "| --- | --- | --- | --- | --- |"]
        for row in summ["by_limit"]:
            r = row["ratios"]
            for side in sparse:
                dense = dense_side(side)
                i = select_index(side) or 0
                lines.append(f"| {row['limit_bytes'] / GiB:.3f} | {side_label(side)} | "
                             f"{specs[i] if i < len(specs) else '?'} | "
                             f"{stats.fmt(r.get(f'{side}/{dense}', {}).get('decode_time'))} | "
                             f"{stats.fmt(r.get(f'{side}/memory', {}).get('decode_tok_s'))} |")
    eq = summ.get("tokens_equal_memory")
    lines += ["", f"Generated tokens equal to memory's (of the same KV format) on every run: "
                  f"{'yes' if eq else 'NO'}; failed runs: "
                  f"{summ.get('errors', 0)}."]
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str) -> None:
    """Decode tokens/s against the limit, one line per side (the memory side: the ideal, no limit)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = doc.get("summary") or summary_by_limit(doc)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for side in doc["plan"]["sides"]:
        xs, ys, lo, hi = [], [], [], []
        for row in summ["by_limit"]:
            m = row["sides"].get(side, {}).get("decode_tok_s")
            if m:
                xs.append(row["limit_bytes"] / GiB)
                ys.append(m["median"])
                lo.append(m["median"] - m["min"])
                hi.append(m["max"] - m["median"])
        if xs:
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=side_label(side),
                        linestyle="--" if side == "memory" else "-")
    ax.axvline(doc["kv_bytes"] / GiB, color="grey", linewidth=0.8, linestyle=":")
    w = doc["workload"]
    ax.set_xlabel("memory limit of the KV's owner (GiB); dotted: the KV set")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{w['model']} on {w['device']}: batch {w['batch']}, prompt {w['prompt_len']}, "
                 f"{w['gen_len']} tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["SELECT_SUFFIX", "SIDES", "WORKLOADS", "E2EPlan", "E2ERunner", "E2EWorkload", "breakdown", "markdown",
           "plot", "run_e2e", "summary_by_limit", "worst_point"]

