"""The FlexLLMGen-style generation loop over the zig-zag (token, layer, GPU batch) schedule.

For every generated token ``i`` the loop walks the layers ``j`` and, inside a
layer, the GPU batches ``k``. A layer's KV cache lives on one of three tiers
chosen by the policy's cache percentages: the compute device ("gpu"), host
memory ("cpu"), or offloaded to a ``KVBackend`` ("disk": bladed). Offloaded
KV moves through the copy threads: prefill writes every offloaded layer's K
and V (tokens ``[0, prompt_len)``); each decode step reads tokens
``[0, pos)`` and appends the new token's K/V at ``pos`` (Algorithm 2
offsets: ``token_start * token_bytes``). With ``overlap`` the load of the next
offloaded (layer, batch) is issued before the current one computes
(layer-ahead prefetch) and writes are not waited for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from bladed.pipeline import AdaptivePipeline, CopyThreadPool, LoadHandle, LoadJob, PipelineMode, TorchDma
from bladed.runner.kvstore import Geometry, KVBackend, SlotTensors, StatsBook, dtype_bytes
from bladed.runner.models import DecoderModel

KVFactory = Callable[[Geometry], KVBackend]


@dataclass
class Policy:
    """FlexLLMGen's policy: batch shape, the six placement percentages, overlap.

    Percentages are of layers: the first ``cache_gpu_percent`` of the layers keep
    their KV on the compute device, the next ``cache_cpu_percent`` in host memory,
    the rest is offloaded to bladed. Weights and activations: the ``gpu`` share
    stays on the compute device, the rest is kept in host memory and moved per
    use (the same memory on a CPU-only host).
    """

    gpu_batch_size: int = 1
    num_gpu_batches: int = 1
    w_gpu_percent: float = 100.0
    w_cpu_percent: float = 0.0
    cache_gpu_percent: float = 0.0
    cache_cpu_percent: float = 0.0
    act_gpu_percent: float = 100.0
    act_cpu_percent: float = 0.0
    overlap: bool = True
    pipeline: PipelineMode = "adaptive"
    copy_threads: int = 2

    @property
    def percent(self) -> list[float]:
        return [self.w_gpu_percent, self.w_cpu_percent, self.cache_gpu_percent, self.cache_cpu_percent,
                self.act_gpu_percent, self.act_cpu_percent]

    def cache_tiers(self, num_layers: int) -> list[str]:
        n_gpu = round(num_layers * self.cache_gpu_percent / 100)
        n_cpu = min(num_layers - n_gpu, round(num_layers * self.cache_cpu_percent / 100))
        return ["gpu"] * n_gpu + ["cpu"] * n_cpu + ["disk"] * (num_layers - n_gpu - n_cpu)

    def weight_tiers(self, num_layers: int) -> list[str]:
        n_gpu = round(num_layers * self.w_gpu_percent / 100)
        return ["gpu"] * n_gpu + ["cpu"] * (num_layers - n_gpu)


@dataclass
class GenerationResult:
    tokens: torch.Tensor                     # [batch, gen_len]
    logits: list[torch.Tensor]               # gen_len x [batch, vocab], float32
    prefill_latency: float
    decode_latency: float
    step_latencies: list[float]
    prompt_len: int
    batch: int
    stats: dict[str, Any] = field(default_factory=dict)
    pipeline: dict[str, Any] = field(default_factory=dict)
    tiers: list[str] = field(default_factory=list)
    plans: list[dict[str, Any]] = field(default_factory=list)
    load_wait_s: float = 0.0

    @property
    def gen_len(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def total_latency(self) -> float:
        return self.prefill_latency + self.decode_latency

    def throughputs(self) -> dict[str, float]:
        b = self.batch
        dec_tokens = b * max(0, self.gen_len - 1)
        return {
            "prefill_latency_s": self.prefill_latency,
            "prefill_throughput_tok_s": b * self.prompt_len / self.prefill_latency if self.prefill_latency else 0.0,
            "decode_latency_s": self.decode_latency,
            "decode_throughput_tok_s": dec_tokens / self.decode_latency if self.decode_latency else 0.0,
            "total_latency_s": self.total_latency,
            "total_throughput_tok_s": b * self.gen_len / self.total_latency if self.total_latency else 0.0,
        }


class Runner:
    """Runs a :class:`DecoderModel` with its KV cache placed by a :class:`Policy`."""

    def __init__(self, model: DecoderModel, policy: Policy | None = None, kv_factory: KVFactory | None = None,
                 device: str | torch.device = "cpu") -> None:
        self.model = model
        self.policy = policy or Policy()
        self.kv_factory = kv_factory
        self.device = torch.device(device)
        cfg = model.cfg
        self.tiers = self.policy.cache_tiers(cfg.num_layers)
        if "disk" in self.tiers and kv_factory is None:
            raise ValueError("the policy offloads KV but no KV backend factory was given")
        wt = self.policy.weight_tiers(cfg.num_layers)
        self._lw_dev: dict[int, dict[str, torch.Tensor]] = {}
        self._lw_host: dict[int, dict[str, torch.Tensor]] = {}
        for j in range(cfg.num_layers):
            lw = model.layer_weights(j)
            if wt[j] == "gpu" or self.device.type == "cpu":
                self._lw_dev[j] = {k: v.to(self.device) for k, v in lw.items()}
            else:
                self._lw_host[j] = {k: v.pin_memory() if torch.cuda.is_available() else v for k, v in lw.items()}
        if self.device.type != "cpu":
            self.model = model.to(self.device)
        self.act_offload = self.device.type == "cuda" and self.policy.act_gpu_percent < 100

    def _weights(self, j: int) -> dict[str, torch.Tensor]:
        lw = self._lw_dev.get(j)
        if lw is not None:
            return lw
        return {k: v.to(self.device, non_blocking=True) for k, v in self._lw_host[j].items()}

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, gen_len: int, eos_token_id: int | None = None,
                 on_step: Callable[[int, float], None] | None = None) -> GenerationResult:
        """Greedy generation of up to ``gen_len`` tokens (fewer when every sequence produced ``eos_token_id``).

        ``on_step(tokens_done, step_seconds)`` is called after each step (the first is the prefill).
        """
        pol, m, cfg = self.policy, self.model, self.model.cfg
        nb, gbs = pol.num_gpu_batches, pol.gpu_batch_size
        if input_ids.shape[0] != nb * gbs:
            raise ValueError(f"a batch of {input_ids.shape[0]} prompts does not match gpu_batch_size * "
                             f"num_gpu_batches = {gbs} * {nb}; pass {nb * gbs} prompts or change the policy")
        if gen_len < 1:
            raise ValueError(f"gen_len {gen_len} must be at least 1")
        prompt_len = int(input_ids.shape[1])
        max_tokens = prompt_len + gen_len
        positions = max_tokens - 1  # the last generated token is never fed back
        if positions > cfg.max_positions:
            raise ValueError(f"a {prompt_len}-token prompt plus gen_len {gen_len} needs {positions} positions, "
                             f"more than {cfg.name}'s {cfg.max_positions}; shorten the prompt or gen_len")
        dev, dtype = self.device, m.dtype
        cuda = dev.type == "cuda"
        disk_layers = [j for j, t in enumerate(self.tiers) if t == "disk"]
        bidx = {j: i for i, j in enumerate(disk_layers)}

        backends: list[KVBackend] = []
        slots: list[SlotTensors] = []
        pool = CopyThreadPool(pol.copy_threads)
        pipe = AdaptivePipeline(pool, pol.pipeline)
        dma = TorchDma(dev)
        book = StatsBook()
        writes: list[Future[Any]] = []
        mem: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        load_wait = 0.0
        try:
            if disk_layers:
                assert self.kv_factory is not None
                geo = Geometry(layers=len(disk_layers), batch=gbs, kv_heads=cfg.num_kv_heads,
                                 head_dim=cfg.head_dim, dtype_bytes=dtype_bytes(dtype), max_tokens=max_tokens)
                for _ in range(nb):
                    be = self.kv_factory(geo)
                    if be.channels < min(2, pol.copy_threads):
                        raise ValueError(f"backend has {be.channels} staging slots, need {pol.copy_threads}")
                    backends.append(be)
                    slots.append(SlotTensors(be, dtype, pin=cuda and not getattr(be, "prepinned", False)))
            nthreads = pol.copy_threads
            ch_of = {"k": 0, "v": 1 % nthreads}

            def submit_load(j: int, k: int, ntok: int) -> LoadHandle:
                be, st, lj = backends[k], slots[k], bidx[j]
                jobs = []
                for kind in ("k", "v"):
                    ch = ch_of[kind]

                    def rd(kind: str = kind, ch: int = ch) -> Any:
                        op = be.read(lj, kind, ch, 0, ntok)  # type: ignore[arg-type]
                        book.add(op, True)
                        return op

                    def dm(ch: int = ch) -> torch.Tensor:
                        return dma.run(lambda: st.take(ch, ntok, dev, non_blocking=cuda))

                    jobs.append(LoadJob(read=rd, dma=dm, nbytes=ntok * be.geometry.token_bytes))
                return pipe.load(jobs, be.group(lj, "k"))

            def submit_write(j: int, k: int, kind: str, t0: int, x: torch.Tensor) -> None:
                be, st, lj, ch = backends[k], slots[k], bidx[j], ch_of[kind]

                def job() -> Any:
                    dma.run(lambda: st.put(ch, t0, x))
                    op = be.write(lj, kind, ch, t0, x.shape[2])  # type: ignore[arg-type]
                    book.add(op, False)
                    return op

                fut = pool.submit(ch, job)
                if not pol.overlap:
                    fut.result()
                writes.append(fut)

            order = [(j, k) for j in range(cfg.num_layers) for k in range(nb)]
            disk_order = [idx for idx, (j, _) in enumerate(order) if self.tiers[j] == "disk"]
            hidden: list[torch.Tensor] = []
            cur = [input_ids[k * gbs:(k + 1) * gbs].to(dev) for k in range(nb)]
            out_tokens: list[torch.Tensor] = []
            out_logits: list[torch.Tensor] = []
            steps: list[float] = []
            finished = torch.zeros(nb * gbs, dtype=torch.bool)
            for i in range(gen_len):
                if cuda:
                    torch.cuda.synchronize(dev)
                t_step = time.perf_counter()
                pipe.begin_iteration(i)
                pos = 0 if i == 0 else prompt_len + i - 1
                hidden = [m.embed(cur[k], pos) for k in range(nb)]
                pending: dict[tuple[int, int], LoadHandle] = {}
                for idx, (j, k) in enumerate(order):
                    lw = self._weights(j)
                    past: tuple[torch.Tensor, torch.Tensor] | None = None
                    if i > 0:
                        if self.tiers[j] == "disk":
                            hd = pending.pop((j, k), None) or submit_load(j, k, pos)
                            tw = time.perf_counter()
                            kk, vv = hd.result()
                            load_wait += time.perf_counter() - tw
                            past = (kk, vv)
                        else:
                            pk, pv = mem[(j, k)]
                            past = (pk.to(dev, non_blocking=True), pv.to(dev, non_blocking=True))
                    if pol.overlap and i > 0:
                        nxt = next((d for d in disk_order if d > idx and order[d] not in pending), None)
                        if nxt is not None and not pending:
                            pending[order[nxt]] = submit_load(*order[nxt], pos)
                    h = hidden[k].to(dev, non_blocking=True) if self.act_offload else hidden[k]
                    h, q, kn, vn = m.qkv(lw, h, pos)
                    keys = kn if past is None else torch.cat([past[0], kn], dim=-2)
                    vals = vn if past is None else torch.cat([past[1], vn], dim=-2)
                    h = m.attend_mlp(lw, h, q, keys, vals)
                    hidden[k] = h.to("cpu", non_blocking=True) if self.act_offload else h
                    tier = self.tiers[j]
                    if tier == "disk":
                        submit_write(j, k, "k", pos, kn)
                        submit_write(j, k, "v", pos, vn)
                    else:
                        host = tier == "cpu" and cuda
                        mem[(j, k)] = (keys.to("cpu") if host else keys, vals.to("cpu") if host else vals)
                step_logits = [m.head(hidden[k].to(dev)).float() for k in range(nb)]
                logits = torch.cat(step_logits, dim=0)
                tok = logits.argmax(dim=-1)
                cur = [tok[k * gbs:(k + 1) * gbs, None] for k in range(nb)]
                out_tokens.append(tok.cpu())
                out_logits.append(logits.cpu())
                pipe.end_iteration()
                if cuda:
                    torch.cuda.synchronize(dev)
                steps.append(time.perf_counter() - t_step)
                if on_step is not None:
                    on_step(i + 1, steps[-1])
                if eos_token_id is not None:
                    finished = finished | (tok.cpu() == eos_token_id)
                    if bool(finished.all()):
                        break
            t_drain = time.perf_counter()
            pool.drain()
            for f in writes:
                f.result()
            steps[-1] += time.perf_counter() - t_drain
            plans = [dict(getattr(be, "plan", {}) or {}) for be in backends]
            return GenerationResult(
                tokens=torch.stack(out_tokens, dim=1), logits=out_logits, prefill_latency=steps[0],
                decode_latency=sum(steps[1:]), step_latencies=steps, prompt_len=prompt_len, batch=nb * gbs,
                stats=book.as_dict(), pipeline=pipe.report(), tiers=list(self.tiers), plans=plans,
                load_wait_s=load_wait,
            )
        finally:
            pool.close()
            for st in slots:
                st.close()
            for be in backends:
                be.close()


__all__ = ["GenerationResult", "KVFactory", "Policy", "Runner"]
