"""Prefix reuse in the runner: time to first token with and without retained prefixes (docs/benchmarks.md).

SmolLM2-135M (float32, CPU unless CUDA is there), the KV of all 30 layers in a spawned bladed (file store), three
workloads, each run with reuse (sessions opened with a prefix key, every request retaining its KV at the end)
and without (the same sessions without a key), the two alternated in each repeat (which goes first alternates):

* ``chat``: a multi-turn chat, a shared system prompt of ``--system-tokens`` tokens and ``--turns`` user
  messages; every turn sends the whole conversation so far (``bladed-runner --chat``). Before each chat with
  reuse every retained prefix is evicted, so turn 1 is a miss and turns 2.. find the previous turn's KV.
* ``document``: ``--doc-requests`` questions about one ``--doc-tokens``-token document (the document first,
  then the question); request 1 is a miss, the later ones find the document's blocks.
* ``quota``: ``prefix.device_bytes`` (and no page-cache share) smaller than the working set: ``--quota-docs``
  documents of ``--quota-doc-tokens`` tokens asked about in a seeded random order; hits, misses and the
  evictions by reason from the daemon's stats (reuse only).

TTFT is the runner's: opening the KV session (the prefix lookup and the copy of its KV included) plus the
prefill step. Writes the raw per-request figures and the medians as JSON (docs/bench/prefix-<UTC time>.json)
and, with matplotlib, a plot of the chat's TTFT per turn next to it.
Usage: tools/bench_prefix.py [--repeats 5] [--out FILE] [--dir DIR]
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from bladed.client import Client, PrefixKey
from bladed.kvstore import BladedKV, Geometry, KVBackend
from bladed.runner.generation import GenerationResult, Policy, Runner
from bladed.runner.weights import LoadedModel, load_model
from bladed_bench import stats, trials
from bladed_bench.environment import filesystem_of, git_info, machine_info
from bladed_bench.redis_server import RedisServer
from bladed_bench.repo import REPO as ROOT
from bladed_bench.workload import BenchDaemon

USER_TURNS = [
    "Which rule covers late deliveries?", "Summarise rule 12 in one sentence.", "Is rule 7 stricter than rule 3?",
    "What should I do first on a Monday?", "Who approves an exception?", "List two rules about safety.",
    "How often are the rules reviewed?", "Thank you. Anything else I should know?",
]
QUESTIONS = ["What is the document about?", "Name one place it mentions.", "What happens at the end?",
             "Who is the main character?", "What is the tone of the text?"]
WORDS = ["river", "stone", "market", "winter", "lantern", "harbour", "garden", "engine", "letter", "window", "bridge",
         "orchard", "signal", "ladder", "compass", "meadow", "archive", "thunder", "pepper", "violin", "canyon"]


def text_of(tokenizer: Any, tokens: int, seed: int, kind: str) -> str:
    """Deterministic prose of about ``tokens`` tokens: numbered rules (a system prompt) or sentences (a document)."""
    rnd = random.Random(seed)
    parts: list[str] = []
    n = 0
    while n < tokens:
        words = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(6, 12)))
        parts.append(f"Rule {len(parts) + 1}: always keep the {words}." if kind == "rules"
                     else f"The {words} was seen near the {rnd.choice(WORDS)}.")
        n = len(tokenizer(" ".join(parts))["input_ids"])
    ids = tokenizer(" ".join(parts))["input_ids"][:tokens]
    return str(tokenizer.decode(ids))


class Bench:
    """One loaded model and one daemon; requests with or without prefix reuse."""

    def __init__(self, lm: LoadedModel, client: Client, gen_len: int, device: str) -> None:
        self.lm, self.client, self.gen_len = lm, client, gen_len
        self.runner = Runner(lm.model, Policy(), kv_factory=self._open, device=device)
        self.key: PrefixKey | None = None
        self.dtype = str(lm.model.dtype).removeprefix("torch.")
        self.eos = lm.model.cfg.eos_token_id

    def _open(self, g: Geometry) -> KVBackend:
        return BladedKV.open(g, channels=2, client=self.client, defer_writes=True, prefix=self.key)

    def ids(self, messages: list[dict[str, str]]) -> torch.Tensor:
        assert self.lm.tokenizer is not None      # SmolLM2's GGUF carries its tokenizer
        enc = self.lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        return enc if isinstance(enc, torch.Tensor) else enc["input_ids"]

    def request(self, ids: torch.Tensor, reuse: bool, gen_len: int | None = None) -> GenerationResult:
        self.key = PrefixKey(self.lm.identity, self.dtype, ids[0].tolist()) if reuse else None
        return self.runner.generate(ids, gen_len or self.gen_len, eos_token_id=self.eos, retain_prefix=reuse)

    def reply(self, res: GenerationResult) -> str:
        tokens = res.tokens[0].tolist()
        if self.eos in tokens:
            tokens = tokens[:tokens.index(self.eos)]
        assert self.lm.tokenizer is not None
        return str(self.lm.tokenizer.decode(tokens, skip_special_tokens=True))


def row(res: GenerationResult) -> dict[str, Any]:
    return {"prompt_len": res.prompt_len, "prefix_tokens": res.prefix_tokens, "ttft_s": res.ttft,
            "open_s": res.open_latency, "prefill_s": res.prefill_latency, "gen_len": res.gen_len,
            "tokens": res.tokens[0].tolist()}


def chat(b: Bench, system: str, turns: int, reuse: bool) -> list[dict[str, Any]]:
    b.client.evict_prefixes()        # both modes start from no retained prefix
    history = [{"role": "system", "content": system}]
    out = []
    for message in USER_TURNS[:turns]:
        history.append({"role": "user", "content": message})
        res = b.request(b.ids(history), reuse)
        history.append({"role": "assistant", "content": b.reply(res)})
        out.append(row(res))
    return out


def document(b: Bench, doc: str, requests: int, reuse: bool) -> list[dict[str, Any]]:
    b.client.evict_prefixes()        # both modes start from no retained prefix
    return [row(b.request(b.ids([{"role": "user", "content": f"{doc}\n\nQuestion: {q}"}]), reuse))
            for q in QUESTIONS[:requests]]


#: the median of the values, NaN for none (as the JSONs have it)
median = functools.partial(stats.median, default=float("nan"))


def alternated(repeats: int, run: Callable[[bool], list[dict[str, Any]]], name: str) -> dict[str, list[Any]]:
    """``repeats`` rounds of the workload with and without reuse, the first of each round alternating."""
    rounds: dict[str, list[Any]] = {"reuse": [], "plain": []}
    for r in range(repeats):
        for reuse in trials.abba((True, False), r):
            t0 = time.perf_counter()
            rows = run(reuse)
            rounds["reuse" if reuse else "plain"].append(rows)
            print(f"{name} repeat {r + 1}/{repeats} {'reuse' if reuse else 'plain'}: "
                  f"{time.perf_counter() - t0:.0f} s, TTFT " + " ".join(f"{x['ttft_s']:.2f}" for x in rows)
                  + ", reused " + " ".join(str(x["prefix_tokens"]) for x in rows), file=sys.stderr, flush=True)
    return rounds


def summary(rounds: dict[str, list[list[dict[str, Any]]]], later_from: int = 1) -> dict[str, Any]:
    """Median TTFT per position, and over the requests after the first (the ones reuse can serve)."""
    n = len(rounds["reuse"][0])
    per = {mode: [median([rs[i]["ttft_s"] for rs in rounds[mode]]) for i in range(n)] for mode in rounds}
    later = {mode: median([r["ttft_s"] for rs in rounds[mode] for r in rs[later_from:]]) for mode in rounds}
    same = all(a["tokens"] == b["tokens"] for ra, rb in zip(rounds["reuse"], rounds["plain"], strict=True)
               for a, b in zip(ra, rb, strict=True))
    return {"median_ttft_s_per_request": per, "median_ttft_s_later": later,
            "ratio_later_reuse_over_plain": later["reuse"] / later["plain"],
            "prompt_len": [r["prompt_len"] for r in rounds["reuse"][0]],
            "median_prefix_tokens": [median([rs[i]["prefix_tokens"] for rs in rounds["reuse"]]) for i in range(n)],
            "same_tokens_with_and_without_reuse": same}


def quota_run(lm: LoadedModel, base: str, args: argparse.Namespace, device: str) -> dict[str, Any]:
    """Reuse under a device quota smaller than the working set: hits, misses, evictions."""
    kv_per_token = 2 * lm.model.cfg.num_layers * lm.model.cfg.num_kv_heads * lm.model.cfg.head_dim * 4
    quota = int(args.quota_entries * args.quota_doc_tokens * kv_per_token)
    daemon = BenchDaemon(os.path.join(base, "quota"), store_bytes=args.store_gib << 30,
                         extra={"prefix": {"device_bytes": quota, "pagecache_bytes": 0}})
    rnd = random.Random(7)
    order = [rnd.randrange(args.quota_docs) for _ in range(args.quota_requests)]
    try:
        with Client(daemon.socket_path, timeout=600.0) as c:
            b = Bench(lm, c, args.gen_len, device)
            docs = [text_of(lm.tokenizer, args.quota_doc_tokens, 100 + i, "doc") for i in range(args.quota_docs)]
            rows = []
            for i, d in enumerate(order):
                res = b.request(b.ids([{"role": "user", "content": f"{docs[d]}\n\nQuestion: {QUESTIONS[0]}"}]),
                                True, gen_len=2)
                rows.append({"doc": d, **row(res)})
                print(f"quota request {i + 1}/{len(order)} doc {d}: reused {res.prefix_tokens} TTFT "
                      f"{res.ttft:.2f}", file=sys.stderr, flush=True)
            stats = c.stats()
    finally:
        daemon.stop()
    # a document hit reuses the document's blocks; the chat template's own header is shared by every prompt,
    # so the daemon also counts a hit of only its first block(s)
    hits = [r for r in rows if 2 * r["prefix_tokens"] >= r["prompt_len"]]
    misses = [r for r in rows if 2 * r["prefix_tokens"] < r["prompt_len"]]
    return {"device_bytes": quota, "kv_bytes_per_token": kv_per_token, "docs": args.quota_docs,
            "doc_tokens": args.quota_doc_tokens, "requests": rows, "order": order,
            "hits": len(hits), "misses": len(misses), "hit_ratio": len(hits) / len(rows),
            "median_ttft_s_hit": median([r["ttft_s"] for r in hits]),
            "median_ttft_s_miss": median([r["ttft_s"] for r in misses]),
            "daemon_stats": {k: v for k, v in stats.items() if k.startswith("prefix_")}}


def shared_run(lm: LoadedModel, base: str, args: argparse.Namespace, device: str) -> dict[str, Any]:
    """The shared tier: two daemons (separate stores) on one Redis on loopback.  Daemon A serves the document
    prompt and retains it (publishing its blocks); then daemon B serves the same prompt, once from the shared
    tier and once cold (no key), in alternating order."""
    import redis

    server = RedisServer(base)
    secret = os.path.join(base, "shared-secret")    # the fleet secret that signs the tier's values (mode 0600)
    with os.fdopen(os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(os.urandom(32).hex() + "\n")
    extra = {"prefix": {"shared_url": server.url, "shared_secret_file": secret}}
    a = BenchDaemon(os.path.join(base, "shared-a"), store_bytes=args.store_gib << 30, extra=extra)
    b = BenchDaemon(os.path.join(base, "shared-b"), store_bytes=args.store_gib << 30, extra=extra)
    doc = text_of(lm.tokenizer, args.doc_tokens, 3, "doc")
    rows: dict[str, list[dict[str, Any]]] = {"shared": [], "cold": []}
    try:
        with Client(a.socket_path, timeout=600.0) as ca, Client(b.socket_path, timeout=600.0) as cb, \
                redis.Redis.from_url(server.url) as r:
            ba, bb = Bench(lm, ca, 2, device), Bench(lm, cb, 2, device)
            for rep_i in range(args.repeats):
                r.flushall()
                ca.evict_prefixes()
                cb.evict_prefixes()
                ids = ba.ids([{"role": "user", "content": f"{doc}\n\nQuestion: {QUESTIONS[rep_i % len(QUESTIONS)]}"}])
                published = ca.stats()["prefix_shared_published"]
                ba.request(ids, True, gen_len=2)
                deadline = time.monotonic() + 120
                while ca.stats()["prefix_shared_published"] == published:   # the publish runs in the background
                    if time.monotonic() > deadline:
                        raise SystemExit("daemon A did not publish its blocks within 120 s")
                    time.sleep(0.05)
                for mode in trials.abba(("shared", "cold"), rep_i):
                    res = bb.request(ids, mode == "shared", gen_len=2)
                    rows[mode].append(row(res))
                    cb.evict_prefixes()      # what B retained must not serve its next request
                print(f"shared repeat {rep_i + 1}/{args.repeats}: TTFT from the shared tier "
                      f"{rows['shared'][-1]['ttft_s']:.2f} s ({rows['shared'][-1]['prefix_tokens']} tokens), cold "
                      f"{rows['cold'][-1]['ttft_s']:.2f} s", file=sys.stderr, flush=True)
            stats_b = cb.stats()
    finally:
        a.stop()
        b.stop()
        server.stop()
    shared, cold = median([x["ttft_s"] for x in rows["shared"]]), median([x["ttft_s"] for x in rows["cold"]])
    return {"redis": "loopback TCP", "rows": rows, "median_ttft_s_shared": shared, "median_ttft_s_cold": cold,
            "ratio_shared_over_cold": shared / cold,
            "same_tokens": all(x["tokens"] == y["tokens"] for x, y in zip(rows["shared"], rows["cold"], strict=True)),
            "daemon_b_stats": {k: v for k, v in stats_b.items() if k.startswith("prefix_")}}


def plot(result: dict[str, Any], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    per = result["chat"]["summary"]["median_ttft_s_per_request"]
    turns = list(range(1, len(per["reuse"]) + 1))
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(turns, per["plain"], "o-", label="without reuse")
    ax.plot(turns, per["reuse"], "s-", label="with --reuse-prefix")
    ax.set_xlabel("turn")
    ax.set_ylabel("median TTFT (s)")
    ax.set_title(f"SmolLM2-135M chat, {result['system_tokens']}-token system prompt")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--gen-len", type=int, default=8, help="tokens generated per chat turn and document request")
    p.add_argument("--doc-tokens", type=int, default=2048)
    p.add_argument("--doc-requests", type=int, default=3)
    p.add_argument("--quota-docs", type=int, default=4)
    p.add_argument("--quota-doc-tokens", type=int, default=512)
    p.add_argument("--quota-entries", type=float, default=2.5, help="prefix.device_bytes in documents' KV")
    p.add_argument("--quota-requests", type=int, default=16)
    p.add_argument("--store-gib", type=int, default=4)
    p.add_argument("--skip", nargs="*", default=[], choices=("chat", "document", "quota", "shared"))
    p.add_argument("--dir", default=None, help="where the daemon's store goes (default: a temp dir in /var/tmp)")
    p.add_argument("--out", default=None, help="JSON output (default: docs/bench/prefix-<UTC time>.json)")
    args = p.parse_args(argv)
    base = args.dir or tempfile.mkdtemp(prefix="bladed-bench-prefix-", dir="/var/tmp")
    out = args.out or os.path.join(ROOT, "docs", "bench", time.strftime("prefix-%Y-%m-%dT%H%MZ.json", time.gmtime()))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lm = load_model("smollm2", torch.float32)
    assert lm.tokenizer is not None
    system = text_of(lm.tokenizer, args.system_tokens, 1, "rules")
    doc = text_of(lm.tokenizer, args.doc_tokens, 2, "doc")
    result: dict[str, Any] = {
        "what": "prefix reuse: TTFT with and without (tools/bench_prefix.py)", "model": lm.identity,
        "dtype": "float32", "device": device, "args": vars(args),
        "system_tokens": len(lm.tokenizer(system)["input_ids"]), "doc_tokens": len(lm.tokenizer(doc)["input_ids"]),
    }
    daemon = BenchDaemon(os.path.join(base, "state"), store_bytes=args.store_gib << 30)
    try:
        with Client(daemon.socket_path, timeout=600.0) as c:
            b = Bench(lm, c, args.gen_len, device)
            if "chat" not in args.skip:
                rounds = alternated(args.repeats, lambda reuse: chat(b, system, args.turns, reuse), "chat")
                result["chat"] = {"rounds": rounds, "summary": summary(rounds)}
            if "document" not in args.skip:
                rounds = alternated(args.repeats, lambda reuse: document(b, doc, args.doc_requests, reuse), "document")
                result["document"] = {"rounds": rounds, "summary": summary(rounds)}
            result["block_tokens"] = c.prefixes()["block_tokens"]
            result["daemon_stats"] = {k: v for k, v in c.stats().items() if k.startswith("prefix_")}
    finally:
        daemon.stop()
    if "quota" not in args.skip:
        result["quota"] = quota_run(lm, base, args, device)
    if "shared" not in args.skip:
        result["shared"] = shared_run(lm, base, args, device)
    result.update(machine=machine_info(), filesystem=filesystem_of(base), git=git_info(ROOT))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    trials.write_json(out, result)
    for name in ("chat", "document"):
        if name in result:
            s = result[name]["summary"]
            print(f"{name}: prompt tokens {s['prompt_len']}")
            print(f"{name}: reused tokens (median) {s['median_prefix_tokens']}")
            for mode in ("plain", "reuse"):
                print(f"{name}: median TTFT per request {mode:5s} " + " ".join(
                    f"{x:.3f}" for x in s["median_ttft_s_per_request"][mode]))
            print(f"{name}: median TTFT of requests 2..: reuse {s['median_ttft_s_later']['reuse']:.3f} s, "
                  f"plain {s['median_ttft_s_later']['plain']:.3f} s, ratio {s['ratio_later_reuse_over_plain']:.3f}; "
                  f"same tokens: {s['same_tokens_with_and_without_reuse']}")
    if "quota" in result:
        q = result["quota"]
        print(f"quota: device_bytes {q['device_bytes']} for {q['docs']} docs of {q['doc_tokens']} tokens: "
              f"{q['hits']} document hits {q['misses']} misses (hit ratio {q['hit_ratio']:.2f}), median TTFT hit "
              f"{q['median_ttft_s_hit']:.3f} s miss {q['median_ttft_s_miss']:.3f} s; daemon {q['daemon_stats']}")
    if "shared" in result:
        sh = result["shared"]
        print(f"shared tier: daemon B's first request, median TTFT from the tier {sh['median_ttft_s_shared']:.3f} s, "
              f"cold {sh['median_ttft_s_cold']:.3f} s, ratio {sh['ratio_shared_over_cold']:.3f}; same tokens: "
              f"{sh['same_tokens']}; daemon B {sh['daemon_b_stats']}")
    if "chat" in result:
        png = plot(result, out.removesuffix(".json") + ".png")
        if png:
            print(f"wrote {png}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
