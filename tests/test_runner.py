"""The runner with its KV cache offloaded.

Two kinds of comparison: against the runner with the in-process ``MemoryKV`` (the same arithmetic, so
bit for bit: offloading must not change a single bit) and against transformers' own generation (a
different implementation of the same maths: the same greedy tokens, logits within a few ulp).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from runner_util import (
    CONFIGS,
    assert_matches_transformers,
    assert_same,
    hf_greedy,
    hf_model,
    prompt,
    run,
    runner_model,
)

from bladed.kvstore import BladedKV, Geometry, MemoryKV
from bladed.runner.generation import GenerationResult
from bladed.runner.main import main, spawned_daemon
from bladed.runner.models import DecoderModel, ModelConfig

DTYPES = [torch.float32, torch.bfloat16]


@dataclass
class Case:
    cfg: ModelConfig
    hf: Any                          # the transformers model (the oracle)
    model: DecoderModel              # the runner's view of the same weights
    ids: torch.Tensor
    ref_tokens: torch.Tensor         # transformers' greedy tokens
    ref_logits: list[torch.Tensor]
    in_memory: GenerationResult      # the runner with every layer's KV in the in-process MemoryKV


@pytest.fixture(scope="module", params=[(a, d) for a in CONFIGS for d in DTYPES],
                ids=lambda p: f"{p[0]}-{str(p[1]).removeprefix('torch.')}")
def case(request: pytest.FixtureRequest) -> Case:
    arch, dtype = request.param
    cfg = CONFIGS[arch]
    hf = hf_model(cfg, dtype)
    ids = prompt(cfg, 2, 7)
    ref_tokens, ref_logits = hf_greedy(hf, ids, 6)
    model = runner_model(hf)
    return Case(cfg, hf, model, ids, ref_tokens, ref_logits, in_memory=run(model, ids, 6))


def test_offloaded_runner_matches_transformers_generation(case: Case) -> None:
    res = case.in_memory
    assert res.tiers == ["disk"] * case.cfg.num_layers
    assert_matches_transformers(res, case.ref_tokens, case.ref_logits, case.model.dtype)
    assert res.stats["memory"]["read_ops"] == 2 * case.cfg.num_layers * 5  # K+V per layer per decode step


@pytest.mark.parametrize("policy", [
    {"pipeline": "intra"}, {"pipeline": "cross"}, {"pipeline": "off", "overlap": False},
    {"pipeline": "adaptive", "copy_threads": 1},
    {"cache_gpu_percent": 50}, {"cache_gpu_percent": 25, "cache_cpu_percent": 25},
], ids=str)
def test_every_strategy_and_placement_equals_in_memory_kv(case: Case, policy: dict) -> None:
    assert_same(run(case.model, case.ids, 6, **policy), case.in_memory)


def test_gpu_batches_match_transformers_per_batch(case: Case) -> None:
    ids = prompt(case.cfg, 4, 5, seed=3)
    res = run(case.model, ids, 4, num_gpu_batches=2)
    for k in range(2):
        rows = slice(2 * k, 2 * k + 2)
        t, lg = hf_greedy(case.hf, ids[rows], 4)
        one = GenerationResult(tokens=res.tokens[rows], logits=[x[rows] for x in res.logits], prefill_latency=0.0,
                               decode_latency=0.0, step_latencies=[], prompt_len=5, batch=2)
        assert_matches_transformers(one, t, lg, case.model.dtype)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with spawned_daemon(str(tmp_path_factory.mktemp("bladed"))) as sock:
        yield sock


@pytest.mark.parametrize("defer", [False, True], ids=["", "deferred-writes"])
@pytest.mark.parametrize("mode", ["baseline", "cachepolicy", "direct", "dualblade"])
def test_kv_through_bladed_equals_in_memory_in_every_mode(case: Case, daemon: str, mode: str, defer: bool) -> None:
    from bladed.client import Client

    with Client(socket_path=daemon) as client:
        def factory(g: Geometry) -> BladedKV:
            return BladedKV.open(g, mode=mode, channels=2, client=client, defer_writes=defer)

        res = run(case.model, case.ids, 6, factory=factory)
    assert_same(res, case.in_memory)
    expect = {"baseline": {"pagecache"}, "cachepolicy": {"pagecache"}, "direct": {"direct"}}
    if mode in expect:
        assert set(res.stats) == expect[mode]
    assert sum(s["read_bytes"] for s in res.stats.values()) > 0
    assert res.plans and res.plans[0]["kpus"]


@pytest.mark.parametrize("policy", [
    {"pipeline": "intra"}, {"pipeline": "cross"}, {"pipeline": "off", "overlap": False},
    {"cache_gpu_percent": 50}, {"num_gpu_batches": 2},
], ids=str)
def test_deferred_writes_through_bladed_equal_in_memory_kv_for_every_strategy(case: Case, daemon: str,
                                                                             policy: dict) -> None:
    """Appends that ride on the next read's request land before any read of their KPU, on every schedule."""
    from bladed.client import Client

    ids = case.ids if "num_gpu_batches" not in policy else prompt(case.cfg, 4, 7, seed=5)
    ref = run(case.model, ids, 6, **policy)
    with Client(socket_path=daemon) as client:
        res = run(case.model, ids, 6, factory=lambda g: BladedKV.open(g, channels=2, client=client,
                                                                      defer_writes=True), **policy)
    assert_same(res, ref)


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


def test_runner_refuses_more_positions_than_the_model_has() -> None:
    cfg = CONFIGS["opt"]
    model = runner_model(hf_model(cfg, torch.float32))
    opened: list[Geometry] = []
    ids = prompt(cfg, 1, cfg.max_positions - 2)

    def factory(g: Geometry) -> Any:
        opened.append(g)
        raise AssertionError("no KV session may be opened for a request that cannot run")

    with pytest.raises(ValueError, match=rf"needs {cfg.max_positions + 2} positions, more than .*'s "
                                         rf"{cfg.max_positions}; shorten the prompt or gen_len"):
        run(model, ids, 5, factory=factory)
    assert opened == []
    assert run(model, ids, 3).gen_len == 3  # exactly max_positions positions is fine


def test_a_refused_request_leaves_no_threads_and_no_open_kv_session() -> None:
    """A backend with too few staging slots is closed when refused; a bad pipeline mode leaves no copy threads."""
    cfg = CONFIGS["opt"]
    model = runner_model(hf_model(cfg, torch.float32))
    ids = prompt(cfg, 1, 4)
    before = threading.active_count()
    opened: list[MemoryKV] = []

    def one_slot(g: Geometry) -> MemoryKV:
        kv = ClosingMemoryKV(g, channels=1)
        opened.append(kv)
        return kv

    with pytest.raises(ValueError, match=r"the KV backend has 1 staging slots, need 2; open it with channels >= 2"):
        run(model, ids, 2, factory=one_slot, copy_threads=2)
    assert [kv.closed for kv in opened] == [True]
    with pytest.raises(ValueError):
        run(model, ids, 2, pipeline="sideways")
    assert threading.active_count() == before


class ClosingMemoryKV(MemoryKV):
    closed = False

    def close(self) -> None:
        self.closed = True
        super().close()
