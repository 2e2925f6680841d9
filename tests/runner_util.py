"""Helpers for the runner / pipeline / HF tests: tiny models, the HF oracle, a throttled backend."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from bladed.kvstore import Geometry, Kind, KVOp, MemoryKV
from bladed.runner.models import DecoderModel, ModelConfig, hf_config, tiny_config

CONFIGS: dict[str, ModelConfig] = {
    "opt": tiny_config("opt", layers=3, hidden=64, heads=4),
    "llama-gqa": tiny_config("llama", layers=4, hidden=64, heads=4, kv_heads=2),
}


def hf_model(cfg: ModelConfig, dtype: torch.dtype, seed: int = 0) -> Any:
    """A random-weight transformers model for ``cfg`` (eager attention, inference only)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(cfg), attn_implementation="sdpa")
    return model.to(dtype).eval().requires_grad_(False)


def runner_model(hf: Any) -> DecoderModel:
    return DecoderModel.from_hf(hf)


def prompt(cfg: ModelConfig, batch: int, length: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, cfg.vocab_size, (batch, length), generator=g)


def hf_greedy(hf: Any, ids: torch.Tensor, gen_len: int, cache: Any = None,
              **kw: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """transformers' own greedy generation: (new tokens [batch, gen_len], raw logits per step).

    ``cache``: a ``Cache`` to generate with (None: transformers' own), passed by the name the installed
    transformers takes it by (``bladed.hf.generate_kwargs``)."""
    if cache is not None:
        from bladed.hf import generate_kwargs  # imports transformers: only where a cache is passed

        kw.update(generate_kwargs(cache))
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_len, min_new_tokens=gen_len,
                      do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kw)
    return out.sequences[:, ids.shape[1]:], [x.float() for x in out.logits]


class ModelledPath:
    """A modelled storage path with a deterministic service time per byte.

    ``shared=False``: requests proceed independently (several device queues).
    ``shared=True``: one saturated device; requests are served one at a time
    and a request that finds another one in flight pays ``contention`` times
    the service time (the thrashing of Figure 16).
    """

    def __init__(self, ns_per_byte: float, shared: bool = False, contention: float = 1.0) -> None:
        self.ns_per_byte = ns_per_byte
        self.shared = shared
        self.contention = contention
        self._busy = threading.Lock()
        self._state = threading.Lock()
        self._inflight = 0

    def serve(self, nbytes: int) -> None:
        with self._state:
            self._inflight += 1
            contended = self._inflight > 1
        try:
            cost = nbytes * self.ns_per_byte * (self.contention if contended else 1.0) / 1e9
            if self.shared:
                with self._busy:
                    time.sleep(cost)  # modelled device service time (not synchronisation)
            else:
                time.sleep(cost)
        finally:
            with self._state:
                self._inflight -= 1


class ThrottledKV(MemoryKV):
    """``MemoryKV`` whose reads go through a modelled path per group (layers below group1_layers: group 1)."""

    def __init__(self, geometry: Geometry, paths: dict[int, ModelledPath], group1_layers: int,
                 channels: int = 2) -> None:
        super().__init__(geometry, channels, groups={j: 1 if j < group1_layers else 2 for j in range(geometry.layers)})
        self.paths = paths

    def read(self, layer: int, kind: Kind, ch: int, token_start: int = 0, ntokens: int | None = None) -> KVOp:
        op = super().read(layer, kind, ch, token_start, ntokens)
        path = self.paths.get(self.group(layer, kind))
        if path is not None:
            path.serve(op.nbytes)
        return KVOp("pagecache" if self.group(layer, kind) == 1 else "direct", op.nbytes, op.service_ns, None)


def run(model: DecoderModel, ids: torch.Tensor, gen_len: int, factory: Any = None, **policy: Any) -> Any:
    """Generate with the runner; KV offloaded to ``factory``'s backends (default: ``MemoryKV``)."""
    from bladed.runner.generation import Policy, Runner

    policy.setdefault("gpu_batch_size", ids.shape[0] // policy.get("num_gpu_batches", 1))
    fac = factory or (lambda g: MemoryKV(g))
    return Runner(model, Policy(**policy), kv_factory=fac).generate(ids, gen_len)


def assert_same(a: Any, b: Any) -> None:
    """Two runs of the same arithmetic (the runner with two KV backends): tokens and logits bit for bit."""
    assert torch.equal(a.tokens, b.tokens)
    assert len(a.logits) == len(b.logits)
    for x, y in zip(a.logits, b.logits, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)


#: how far the runner's logits may be from transformers', in units of the model dtype's epsilon at the
#: logits' magnitude: the two are different implementations of the same maths, and matmul kernels (hence the
#: last bit) differ by CPU and by call shape; 1.4 units were seen on an AMD EPYC,
#: 0 on the Intel Xeons of earlier CI runs
LOGIT_ULPS = 4


def assert_matches_transformers(a: Any, ref_tokens: torch.Tensor, ref_logits: list[torch.Tensor],
                                dtype: torch.dtype, ulps: float = LOGIT_ULPS) -> None:
    """The runner against transformers' own generation: the same tokens, logits within ``ulps``."""
    assert torch.equal(a.tokens, ref_tokens)
    assert len(a.logits) == len(ref_logits)
    eps = torch.finfo(dtype).eps
    for step, (x, y) in enumerate(zip(a.logits, ref_logits, strict=True)):
        assert x.dtype == y.dtype and x.shape == y.shape
        tol = ulps * eps * max(1.0, float(y.abs().max()))
        err = float((x - y).abs().max())
        assert err <= tol, f"step {step}: logits differ by {err:.3g} > {tol:.3g} ({ulps} ulp of {dtype})"
