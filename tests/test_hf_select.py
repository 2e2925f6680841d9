"""``BladedCache(select=...)`` (docs/transformers.md, "Sparse decode reads"): exact at a whole budget, the runner's
tokens when sparse, through a daemon the in-memory arithmetic, and one-line refusals."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from daemon_util import DaemonProcess, short_tmpdir
from runner_util import CONFIGS, hf_greedy, hf_model, prompt, run, runner_model

from bladed.hf import SELECT_ATTENTION, BladedCache, geometry_for
from bladed.kvselect import SelectError
from bladed.kvstore import MemoryKV

GEN = 8
SPARSE = "keys:0.25,page=8"


@pytest.fixture(scope="module")
def hf() -> torch.nn.Module:
    model = hf_model(CONFIGS["llama-gqa"], torch.float32)
    yield model
    model.set_attn_implementation("sdpa")


def cache(hf: torch.nn.Module, ids: torch.Tensor, select: str | None, attach: bool = True) -> BladedCache:
    g = geometry_for(hf.config, ids.shape[0], ids.shape[1] + GEN, torch.float32)
    c = BladedCache(MemoryKV(g), select=select)
    if attach:
        c.attach(hf)
    return c


def test_a_whole_budget_gives_transformers_own_tokens_and_logits_bit_for_bit(hf: torch.nn.Module) -> None:
    ids = prompt(CONFIGS["llama-gqa"], 2, 150)
    hf.set_attn_implementation("sdpa")
    ref_tokens, ref_logits = hf_greedy(hf, ids, GEN)
    with cache(hf, ids, "keys:1") as c:
        tokens, logits = hf_greedy(hf, ids, GEN, cache=c)
    assert hf.config._attn_implementation == SELECT_ATTENTION
    assert torch.equal(tokens, ref_tokens)
    assert all(torch.equal(x, y) for x, y in zip(logits, ref_logits, strict=True))
    plain, _ = hf_greedy(hf, ids, GEN)                     # attached, no selecting cache: sdpa
    assert torch.equal(plain, ref_tokens)


def test_sparse_reads_give_the_runners_tokens_and_the_reuse_buffer_changes_nothing(hf: torch.nn.Module) -> None:
    ids = prompt(CONFIGS["llama-gqa"], 1, 150, seed=3)
    with cache(hf, ids, SPARSE) as c:
        tokens, logits = hf_greedy(hf, ids, GEN, cache=c)
        report = c.select_report()
    with cache(hf, ids, SPARSE + ",reuse=off") as c:
        tokens_off, logits_off = hf_greedy(hf, ids, GEN, cache=c)
    assert torch.equal(tokens, tokens_off)
    assert all(torch.equal(x, y) for x, y in zip(logits, logits_off, strict=True))
    assert 0 < report["reuse_hits"] < report["pages_selected"] and report["selector_bytes"] > 0
    runner = run(runner_model(hf), ids, GEN, kv_select=SPARSE)
    assert torch.equal(tokens, runner.tokens)               # the runner: another implementation of the same maths
    eps = torch.finfo(torch.float32).eps
    for x, y in zip(logits, runner.logits, strict=True):
        assert float((x - y).abs().max()) <= 16 * eps * max(1.0, float(y.abs().max()))


@pytest.fixture(scope="module")
def daemon() -> Iterator[str]:
    with short_tmpdir() as d, DaemonProcess(d, {"budget": {"override": 0}}).start() as dp:
        yield dp.socket_path


def test_through_a_daemon_the_cache_reads_less_and_computes_what_memory_does(hf: torch.nn.Module,
                                                                             daemon: str) -> None:
    ids = prompt(CONFIGS["llama-gqa"], 1, 150, seed=4)
    with cache(hf, ids, SPARSE) as c:
        ref, _ = hf_greedy(hf, ids, GEN, cache=c)
    c = BladedCache.open(hf.config, 1, ids.shape[1] + GEN, dtype=torch.float32, socket_path=daemon, select=SPARSE)
    c.attach(hf)
    tokens, _ = hf_greedy(hf, ids, GEN, cache=c)
    report = c.select_report()
    c.close()
    assert torch.equal(tokens, ref)
    assert report["reuse_hits"] > 0


def test_the_selection_needs_the_models_attention_and_says_so(hf: torch.nn.Module) -> None:
    ids = prompt(CONFIGS["llama-gqa"], 1, 150, seed=5)
    hf.set_attn_implementation("sdpa")
    with cache(hf, ids, SPARSE, attach=False) as c, pytest.raises(ValueError) as e:
        hf_greedy(hf, ids, GEN, cache=c)
    assert str(e.value) == ("BladedCache(select=...) reads the pages the query selects, and transformers gives the "
                            "query to the attention, not to the cache: call cache.attach(model) before generate")
    eager = hf_model(CONFIGS["llama-gqa"], torch.float32)
    eager.set_attn_implementation("eager")
    with cache(hf, ids, SPARSE, attach=False) as c, pytest.raises(ValueError) as e:
        c.attach(eager)
    assert str(e.value) == ("BladedCache.attach: the model's attention is 'eager'; the selection runs on sdpa's, load "
                            "the model with attn_implementation='sdpa'")


@pytest.mark.parametrize("select, message", [
    ("keys:-1", "select=: fraction -1 is outside (0, 1]; accepted (0, 1], e.g. keys:0.25"),
    ("keys:0.25,window=40", "select=: window=40 pages of 16 tokens exceed the context of 158 tokens; accepted "
                            "window=1..9"),
])
def test_a_bad_select_is_one_line(hf: torch.nn.Module, select: str, message: str) -> None:
    with pytest.raises(SelectError) as e:
        cache(hf, prompt(CONFIGS["llama-gqa"], 1, 150), select, attach=False)
    assert str(e.value) == message
