"""``python -m bladed.runner``: FlexLLMGen-style benchmark/generation with the KV cache in bladed."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from bladed.pipeline import PIPELINE_MODES
from bladed.runner.engine import GenerationResult, Policy, Runner
from bladed.runner.kvstore import BladedKV, Geometry, KVBackend, MemoryKV
from bladed.runner.models import gib, kv_bytes
from bladed.runner.weights import SMOLLM2, load_model, smollm2_gguf

MODES = ("baseline", "cachepolicy", "direct", "dualblade")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_PROMPT = "What is the capital of France?"


def str2bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "y", "on"):
        return True
    if v.lower() in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {v!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bladed-runner", description=__doc__)
    p.add_argument("--model", default=SMOLLM2,
                   help="smollm2 | a checkpoint dir | facebook/opt-<size> (dummy weights) | tiny-opt | tiny-llama")
    p.add_argument("--prompt", default=None, help="prompt text (models with a tokenizer)")
    p.add_argument("--prompt-len", type=int, default=None, help="random prompt of this many tokens")
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--gpu-batch-size", type=int, default=1)
    p.add_argument("--num-gpu-batches", type=int, default=1)
    p.add_argument("--percent", nargs=6, type=float, default=[100, 0, 0, 0, 100, 0],
                   help="weights gpu/cpu, cache gpu/cpu, activations gpu/cpu percentages; "
                        "the rest of the cache is offloaded to bladed")
    p.add_argument("--overlap", type=str2bool, nargs="?", const=True, default=True,
                   help="overlap I/O with compute: layer-ahead prefetch + async writes")
    p.add_argument("--pipeline", choices=PIPELINE_MODES, default="adaptive")
    p.add_argument("--copy-threads", type=int, default=2)
    p.add_argument("--mode", choices=MODES, default="dualblade", help="bladed residency mode")
    p.add_argument("--backend", choices=("bladed", "memory"), default="bladed",
                   help="where offloaded KV goes (memory = in-process reference)")
    p.add_argument("--socket", default=None, help="bladed socket path (default: $BLADED_SOCKET / system)")
    p.add_argument("--spawn-daemon", action="store_true",
                   help="start a private bladed (python -m bladed.server) on the default file-backed store")
    p.add_argument("--state-dir", default=None, help="state dir of the spawned daemon and the model cache")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default float32 (CPU), float16 (CUDA)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--stop-at-eos", type=str2bool, nargs="?", const=True, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    return p


@contextlib.contextmanager
def spawned_daemon(state_dir: str, timeout: float = 60.0) -> Iterator[str]:
    """Run ``python -m bladed.server --state-dir DIR`` for the duration; yields its socket path."""
    os.makedirs(state_dir, exist_ok=True)
    sock = os.path.join(os.path.abspath(state_dir), "bladed.sock")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(sock)
    log = open(os.path.join(state_dir, "bladed-runner-daemon.log"), "ab")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "bladed.server", "--state-dir", state_dir],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        import socket as _s

        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"bladed exited with {proc.returncode}; see {log.name}")
            if os.path.exists(sock):
                c = _s.socket(_s.AF_UNIX, _s.SOCK_STREAM)
                try:
                    c.connect(sock)
                    break
                except OSError:
                    pass
                finally:
                    c.close()
            if time.monotonic() > deadline:
                raise TimeoutError(f"bladed did not open {sock} within {timeout:.0f} s")
            with contextlib.suppress(subprocess.TimeoutExpired):  # waiting for the daemon process to come up
                proc.wait(timeout=0.1)
        yield sock
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def format_report(res: GenerationResult, model_bytes: int, cache_bytes: int, hidden_bytes: int,
                  peak_gpu: int, info: dict[str, Any]) -> str:
    t = res.throughputs()
    lines = [
        f"model size: {gib(model_bytes):.3f} GB\tcache size: {gib(cache_bytes):.3f} GB\t"
        f"hidden size (p): {gib(hidden_bytes):.3f} GB",
        f"peak gpu mem: {gib(peak_gpu):.3f} GB\tprojected: False",
        f"prefill latency: {t['prefill_latency_s']:.3f} s\tprefill throughput: "
        f"{t['prefill_throughput_tok_s']:.3f} token/s",
        f"decode latency: {t['decode_latency_s']:.3f} s\tdecode throughput: "
        f"{t['decode_throughput_tok_s']:.3f} token/s",
        f"total latency: {t['total_latency_s']:.3f} s\ttotal throughput: "
        f"{t['total_throughput_tok_s']:.3f} token/s",
        f"bladed: mode {info['mode']}  backend {info['backend']}  kv tiers {info['tiers']}  "
        f"overlap {info['overlap']}  load wait {res.load_wait_s:.3f} s",
    ]
    for path, s in res.stats.items():
        lines.append(f"bladed path {path}: " + "  ".join(f"{k} {v}" for k, v in s.items()))
    pl = res.pipeline
    lines.append(f"pipeline: mode {pl.get('mode')}  decision {pl.get('decision')}  "
                 f"intra GB/s {pl.get('intra_GBps', {})}  cross GB/s {pl.get('cross_GBps', {})}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[a.dtype] if a.dtype else (torch.float16 if device == "cuda" else torch.float32)
    model_name = a.model
    if model_name == SMOLLM2 and smollm2_gguf() is None:
        model_name = "facebook/opt-125m"  # the model package is unavailable: random-weight OPT
    lm = load_model(model_name, dtype, a.state_dir, a.seed)
    cfg = lm.model.cfg
    nb, gbs = a.num_gpu_batches, a.gpu_batch_size
    batch = nb * gbs
    if lm.tokenizer is not None and a.prompt_len is None:
        text = a.prompt or DEFAULT_PROMPT
        enc = lm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               return_tensors="pt")
        ids = enc if isinstance(enc, torch.Tensor) else enc["input_ids"]
        ids = ids.repeat(batch, 1)
    else:
        g = torch.Generator().manual_seed(a.seed)
        ids = torch.randint(3, min(cfg.vocab_size, 50000), (batch, a.prompt_len or 32), generator=g)
    pol = Policy(gpu_batch_size=gbs, num_gpu_batches=nb, w_gpu_percent=a.percent[0], w_cpu_percent=a.percent[1],
                 cache_gpu_percent=a.percent[2], cache_cpu_percent=a.percent[3], act_gpu_percent=a.percent[4],
                 act_cpu_percent=a.percent[5], overlap=a.overlap, pipeline=a.pipeline,
                 copy_threads=a.copy_threads)
    stop = a.stop_at_eos if a.stop_at_eos is not None else lm.tokenizer is not None
    with contextlib.ExitStack() as stack:
        factory: Any
        if a.backend == "memory":
            def factory(g: Geometry) -> KVBackend:
                return MemoryKV(g, channels=max(2, a.copy_threads))
        else:
            from bladed import client as bclient

            sock = a.socket
            if a.spawn_daemon:
                sock = stack.enter_context(spawned_daemon(a.state_dir or os.path.join("var", "runner")))
            client = bclient.Client(socket_path=sock)
            stack.callback(client.close)

            def factory(g: Geometry) -> KVBackend:
                return BladedKV.open(g, mode=a.mode, channels=a.copy_threads, client=client)
        runner = Runner(lm.model, pol, kv_factory=factory, device=device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        res = runner.generate(ids, a.gen_len, eos_token_id=cfg.eos_token_id if stop else None)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    db = lm.model.weights[next(iter(lm.model.weights))].element_size()
    info = {"mode": a.mode, "backend": a.backend, "overlap": a.overlap, "model": cfg.name, "source": lm.source,
            "tiers": _tiers(res.tiers), "device": device, "dtype": str(dtype).removeprefix("torch.")}
    text = None
    if lm.tokenizer is not None:
        text = [lm.tokenizer.decode(res.tokens[b], skip_special_tokens=True) for b in range(res.batch)]
    cache_b = kv_bytes(cfg, batch, ids.shape[1] + a.gen_len, db)
    hidden_b = batch * ids.shape[1] * cfg.hidden_size * db
    if a.json:
        out = {"info": info, "policy": pol.percent, "prompt_len": int(ids.shape[1]), "gen_len": res.gen_len,
               "batch": batch, **res.throughputs(), "load_wait_s": res.load_wait_s, "stats": res.stats,
               "pipeline": res.pipeline, "plans": res.plans, "text": text, "tokens": res.tokens.tolist()}
        print(json.dumps(out))
    else:
        if text is not None:
            for t in text[:4]:
                print(t)
        print(format_report(res, cfg.weight_bytes(db), cache_b, hidden_b, peak, info))
    return 0


def _tiers(tiers: list[str]) -> str:
    return " ".join(f"{t}:{tiers.count(t)}" for t in ("gpu", "cpu", "disk") if tiers.count(t))


if __name__ == "__main__":
    raise SystemExit(main())
