"""Drive one vLLM engine (run with .venv-vllm/bin/python): the requests of tests/test_vllm.py and
tools/bench_vllm.py, with or without bladed's OffloadingConnector.  Prints one JSON object per step on stdout
(lines starting with ``{``), so the caller reads them as they come.

Steps (``--steps``, comma-separated): ``warm`` (a short unrelated prompt), ``ttft`` (the prompt, one token:
its wall time is the time to first token), ``gen`` (the prompt, ``--gen`` tokens, greedy), ``reset``
(``reset_prefix_cache()``: vLLM's own cache only), ``wait`` (read a line from stdin before going on: the
caller restarts the daemon meanwhile), ``evict`` (drop the pool's blocks in bladed).  ``--steps -`` reads the
steps from stdin, one a line, until it ends.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def prompt_ids(text: list[int], tokens: int, seed: int) -> list[int]:
    """``tokens`` ids of real text (a document's, from offset ``seed * 997``): greedy decoding of random ids is
    so flat that bf16/fp32 rounding of another prefill split flips it."""
    start = (seed * 997) % max(1, len(text) - tokens)
    return text[start:start + tokens]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tier", choices=["none", "bladed", "cpu", "fs"], default="bladed")
    ap.add_argument("--socket", default="")
    ap.add_argument("--fs-path", default="")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--text", required=True, help="a text file the prompts are cut from")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--steps", default="gen,reset,gen")
    ap.add_argument("--kv-gib", type=int, default=1)
    ap.add_argument("--capacity", type=int, default=256 << 20)
    ap.add_argument("--retry-s", type=float, default=5.0)
    a = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(a.kv_gib))

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kv: dict[str, object] | None = None
    if a.tier == "bladed":
        kv = {"kv_connector": "BladedOffloadingConnector", "kv_connector_module_path": "bladed.integrations.vllm",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"socket": a.socket, "capacity_bytes": a.capacity,
                                            "retry_s": a.retry_s}}
    elif a.tier == "cpu":
        kv = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"cpu_bytes_to_use": a.capacity}}
    elif a.tier == "fs":
        kv = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": a.capacity,
                                            "secondary_tiers": [{"type": "fs", "root_dir": a.fs_path}]}}
    t0 = time.perf_counter()
    try:
        llm = LLM(model=a.model, block_size=32, max_model_len=8192, enable_prefix_caching=True, dtype=a.dtype,
                  enforce_eager=True, kv_transfer_config=kv, disable_log_stats=True)
    except Exception as e:
        print(json.dumps({"step": "start", "error": f"{type(e).__name__}: {e}"[:1500]}), flush=True)
        return 3
    print(json.dumps({"step": "start", "seconds": time.perf_counter() - t0}), flush=True)
    with open(a.text) as f:
        text = llm.get_tokenizer().encode(f.read())
    if len(text) < a.tokens + 64:
        text = text * (1 + (a.tokens + 64) // max(1, len(text)))
    ids = prompt_ids(text, a.tokens, a.seed)
    steps = (line.strip() for line in sys.stdin) if a.steps == "-" else iter(a.steps.split(","))
    for step in steps:
        out: dict[str, object] = {"step": step}
        t = time.perf_counter()
        if step == "warm":
            llm.generate([TokensPrompt(prompt_token_ids=[t + 1 for t in text[:40]])], SamplingParams(max_tokens=1),
                         use_tqdm=False)
        elif step in ("ttft", "gen"):
            n = 1 if step == "ttft" else a.gen
            (r,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(temperature=0, max_tokens=n),
                                use_tqdm=False)
            out["tokens"] = list(r.outputs[0].token_ids)
            out["cached"] = r.num_cached_tokens
        elif step == "reset":
            llm.reset_prefix_cache()
        elif step == "wait":
            print(json.dumps({"step": "waiting"}), flush=True)
            sys.stdin.readline()
        elif step == "evict":
            from bladed.client import Client

            with Client(a.socket or None) as c:
                for p in c.call("blocks", action="pools")["pools"]:
                    c.call("blocks", action="evict", pool=p["pool"])
            llm.reset_prefix_cache()
        out["seconds"] = time.perf_counter() - t
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
