"""The runner generates exactly what transformers does, with its KV cache offloaded."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from runner_util import CONFIGS, assert_same, hf_greedy, hf_model, prompt, run, runner_model

from bladed.runner.cli import main, spawned_daemon
from bladed.runner.kvstore import BladedKV, Geometry

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", params=[(a, d) for a in CONFIGS for d in DTYPES],
                ids=lambda p: f"{p[0]}-{str(p[1]).removeprefix('torch.')}")
def case(request: pytest.FixtureRequest) -> tuple:
    arch, dtype = request.param
    cfg = CONFIGS[arch]
    hf = hf_model(cfg, dtype)
    ids = prompt(cfg, 2, 7)
    ref_tokens, ref_logits = hf_greedy(hf, ids, 6)
    return cfg, hf, runner_model(hf), ids, ref_tokens, ref_logits


def test_offloaded_runner_equals_transformers_generation(case: tuple) -> None:
    _, _, model, ids, ref_tokens, ref_logits = case
    res = run(model, ids, 6)
    assert res.tiers == ["disk"] * model.cfg.num_layers
    assert_same(res, ref_tokens, ref_logits)
    assert res.stats["memory"]["read_ops"] == 2 * model.cfg.num_layers * 5  # K+V per layer per decode step


@pytest.mark.parametrize("policy", [
    {"pipeline": "intra"}, {"pipeline": "cross"}, {"pipeline": "off", "overlap": False},
    {"pipeline": "adaptive", "copy_threads": 1},
    {"cache_gpu_percent": 50}, {"cache_gpu_percent": 25, "cache_cpu_percent": 25},
], ids=str)
def test_every_strategy_and_placement_equals_in_memory_kv(case: tuple, policy: dict) -> None:
    _, _, model, ids, ref_tokens, ref_logits = case
    assert_same(run(model, ids, 6, **policy), ref_tokens, ref_logits)


def test_gpu_batches_equal_transformers_per_batch(case: tuple) -> None:
    cfg, hf, model, _, _, _ = case
    ids = prompt(cfg, 4, 5, seed=3)
    res = run(model, ids, 4, num_gpu_batches=2)
    for k in range(2):
        t, lg = hf_greedy(hf, ids[2 * k:2 * k + 2], 4)
        assert torch.equal(res.tokens[2 * k:2 * k + 2], t)
        for x, y in zip(res.logits, lg, strict=True):
            assert torch.equal(x[2 * k:2 * k + 2], y)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with spawned_daemon(str(tmp_path_factory.mktemp("bladed"))) as sock:
        yield sock


@pytest.mark.parametrize("mode", ["baseline", "cachepolicy", "direct", "dualblade"])
def test_kv_through_bladed_equals_in_memory_in_every_mode(case: tuple, daemon: str, mode: str) -> None:
    from bladed.client import Client

    _, _, model, ids, ref_tokens, ref_logits = case
    with Client(socket_path=daemon) as client:
        def factory(g: Geometry) -> BladedKV:
            return BladedKV.open(g, mode=mode, channels=2, client=client)

        res = run(model, ids, 6, factory=factory)
    assert_same(res, ref_tokens, ref_logits)
    expect = {"baseline": {"pagecache"}, "cachepolicy": {"pagecache"}, "direct": {"direct"}}
    if mode in expect:
        assert set(res.stats) == expect[mode]
    assert sum(s["read_bytes"] for s in res.stats.values()) > 0
    assert res.plans and res.plans[0]["kpus"]


def test_cli_reports_flexllmgen_lines_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", "tiny-llama", "--backend", "memory", "--prompt-len", "8", "--gen-len", "5",
            "--gpu-batch-size", "2", "--percent", "100", "0", "25", "0", "100", "0"]
    assert main(args) == 0
    text = capsys.readouterr().out
    for line in ("prefill latency:", "decode throughput:", "total latency:", "pipeline: mode adaptive"):
        assert line in text
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gen_len"] == 5 and len(out["tokens"]) == 2 and len(out["tokens"][0]) == 5
    assert out["decode_throughput_tok_s"] > 0
    assert set(out["pipeline"]["decision"]) == {"1"}
