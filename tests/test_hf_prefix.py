"""Prefix reuse with ``bladed.hf.BladedCache`` against a real daemon (docs/transformers.md, "Prefix reuse").

A cache opened with the prompt's ids starts with the K/V bladed retained for an earlier prompt of the same
start, and ``model.generate`` computes only the rest of the prompt: the greedy tokens equal a cold run's and
the logits are within a few float32 ulps of it (``ULPS`` says why).  After an eviction the same prompt is a miss
and the run is the cold one, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from daemon_util import DaemonProcess, short_tmpdir
from runner_util import CONFIGS, LOGIT_ULPS, hf_greedy, hf_model, prompt

from bladed.client import Client
from bladed.hf import BladedCache, geometry_for
from bladed.kvstore import MemoryKV

CFG = CONFIGS["llama-gqa"]
BLOCK = 8
MODEL_ID = "tiny-llama-gqa-seed0"
GEN = 7
MAX_TOKENS = 64
#: how far reused-prefix logits may be from a cold run's, in float32 ulps at the logits' magnitude. Reuse
#: changes how the arithmetic is chunked, not what it computes: the prefix's K/V come from an earlier prefill
#: of another length, and the prompt's rest attends to them in a prefill of fewer query rows than the cold
#: run's single one, so matmuls of other shapes (other kernels, other summation orders) run. At most 1.25 ulp
#: was seen over 40 prompts on the build machine; the bound is the one for the runner against transformers,
#: whose last bits differ for the same reason (kernels by CPU and call shape)
ULPS = LOGIT_ULPS


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with short_tmpdir() as d, DaemonProcess(d, {"prefix": {"block_tokens": BLOCK}}).start() as dp:
        yield dp


@pytest.fixture(scope="module")
def hf() -> Any:
    return hf_model(CFG, torch.float32)


@pytest.fixture(autouse=True)
def no_retained_prefixes(daemon: DaemonProcess) -> None:
    with Client(daemon.socket_path) as c:
        c.evict_prefixes()


@contextmanager
def forward_lengths(hf: Any) -> Iterator[list[int]]:
    """The number of tokens each forward of the decoder computes."""
    seen: list[int] = []

    def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        seen.append(int(kwargs["input_ids"].shape[1]))

    handle = hf.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def ids_of(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts, dim=1)


def open_cache(daemon: DaemonProcess, hf: Any, ids: torch.Tensor, **kw: Any) -> BladedCache:
    return BladedCache.open(hf.config, batch_size=1, max_tokens=MAX_TOKENS, dtype=torch.float32,
                            socket_path=daemon.socket_path, prompt_ids=ids, **{"model_id": MODEL_ID, **kw})


def run(daemon: DaemonProcess, hf: Any, ids: torch.Tensor,
        retain: bool = True) -> tuple[BladedCache, torch.Tensor, list[torch.Tensor], list[int], dict[str, Any]]:
    """Generate ``ids`` with a prefix-keyed cache, then retain (closing it): (cache, tokens, logits, forward
    lengths, what retain kept)."""
    cache = open_cache(daemon, hf, ids)
    try:
        with forward_lengths(hf) as lengths:
            tokens, logits = hf_greedy(hf, ids, GEN, cache=cache)
        kept = cache.retain(ids_of(ids, tokens), close=True) if retain else {}
    finally:
        cache.close()
    return cache, tokens, logits, lengths, kept


def assert_close(logits: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    eps = torch.finfo(torch.float32).eps
    for step, (x, y) in enumerate(zip(logits, ref, strict=True)):
        tol = ULPS * eps * max(1.0, float(y.abs().max()))
        err = float((x - y).abs().max())
        assert err <= tol, f"step {step}: logits differ by {err:.3g} > {tol:.3g} ({ULPS} float32 ulps)"


def test_a_prompt_with_a_retained_start_prefills_only_the_rest(daemon: DaemonProcess, hf: Any) -> None:
    shared = prompt(CFG, 1, 20, seed=3)
    first, second = ids_of(shared, prompt(CFG, 1, 5, seed=4)), ids_of(shared, prompt(CFG, 1, 5, seed=5))

    cache, tokens, logits, lengths, kept = run(daemon, hf, first)
    assert (cache.prefix_tokens, cache.prefix_entry) == (0, None)       # nothing retained yet: a miss
    assert lengths[0] == 25
    ref_tokens, ref_logits = hf_greedy(hf, first, GEN)
    assert torch.equal(tokens, ref_tokens)
    assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits, strict=True))
    # 32 ids given, 31 with K/V (the last generated token was never fed): 3 whole blocks kept
    assert kept["tokens"] == 24 and kept["new"]

    cache, tokens, logits, lengths, _ = run(daemon, hf, second, retain=False)
    # the 20 shared tokens hold 2 whole blocks: those are reused, the other 9 prompt tokens computed
    assert (cache.prefix_tokens, cache.prefix_entry) == (16, kept["entry"])
    assert lengths == [9] + [1] * (GEN - 1)
    ref_tokens, ref_logits = hf_greedy(hf, second, GEN)
    assert torch.equal(tokens, ref_tokens)
    assert_close(logits, ref_logits)
    with Client(daemon.socket_path) as c:
        st = c.stats()
        (entry,) = c.prefixes()["prefixes"]
    assert st["prefix_reused_tokens"] >= 16 and entry["hits"] == 1 and entry["model"] == MODEL_ID


def test_a_whole_prompt_match_computes_only_its_last_token(daemon: DaemonProcess, hf: Any) -> None:
    ids = prompt(CFG, 1, 24, seed=6)
    run(daemon, hf, ids)
    cache, tokens, logits, lengths, kept = run(daemon, hf, ids)
    # all 3 blocks are there; the last prompt token is computed again, for the logits of the first new token
    assert cache.prefix_tokens == 23 and lengths[0] == 1
    ref_tokens, ref_logits = hf_greedy(hf, ids, GEN)
    assert torch.equal(tokens, ref_tokens)
    assert_close(logits, ref_logits)
    assert kept["tokens"] == 24 and not kept["new"]                     # the same blocks: the entry is kept


def test_after_eviction_the_prompt_is_a_miss_and_the_run_a_cold_one(daemon: DaemonProcess, hf: Any) -> None:
    ids = prompt(CFG, 1, 17, seed=7)
    _, _, _, _, kept = run(daemon, hf, ids)
    with Client(daemon.socket_path) as c:
        assert c.evict_prefixes(kept["entry"]) == [kept["entry"]]
    cache, tokens, logits, lengths, _ = run(daemon, hf, ids, retain=False)
    assert cache.prefix_tokens == 0 and lengths[0] == 17
    ref_tokens, ref_logits = hf_greedy(hf, ids, GEN)
    assert torch.equal(tokens, ref_tokens)
    assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits, strict=True))


def test_another_model_id_or_dtype_does_not_reuse_the_prefix(daemon: DaemonProcess, hf: Any) -> None:
    ids = prompt(CFG, 1, 16, seed=8)
    run(daemon, hf, ids)
    with open_cache(daemon, hf, ids, model_id="another-model") as cache:
        assert cache.prefix_tokens == 0
    with BladedCache.open(hf.config, 1, MAX_TOKENS, dtype=torch.float64, socket_path=daemon.socket_path,
                          prompt_ids=ids, model_id=MODEL_ID) as cache:
        assert cache.prefix_tokens == 0


def test_generate_with_other_ids_than_the_cache_was_opened_for_is_refused(daemon: DaemonProcess, hf: Any) -> None:
    ids = prompt(CFG, 1, 16, seed=9)
    run(daemon, hf, ids)
    with open_cache(daemon, hf, ids) as cache, pytest.raises(ValueError) as err:
        hf_greedy(hf, prompt(CFG, 1, 20, seed=9), GEN, cache=cache)
    assert str(err.value) == ("the first forward brings 5 tokens after the 15 reused ones, but the cache was "
                              "opened for a prompt of 16 tokens; pass the same ids to "
                              "BladedCache.open(prompt_ids=) and to generate")


def test_bad_prefix_arguments_are_refused_in_one_line(daemon: DaemonProcess, hf: Any) -> None:
    ids = prompt(CFG, 1, 16)
    with pytest.raises(ValueError, match=r"^prefix reuse \(prompt_ids=\) needs batch_size=1, got 2; open one"):
        BladedCache.open(hf.config, 2, MAX_TOKENS, socket_path=daemon.socket_path, prompt_ids=ids, model_id="m")
    assert hf.config.name_or_path == ""                                 # a model built from a config
    with pytest.raises(ValueError, match=r"config.name_or_path is empty; pass model_id="):
        BladedCache.open(hf.config, 1, MAX_TOKENS, socket_path=daemon.socket_path, prompt_ids=ids)
    with pytest.raises(ValueError, match=r"^token ids of shape \(2, 16\): prefix reuse takes one sequence"):
        BladedCache.open(hf.config, 1, MAX_TOKENS, socket_path=daemon.socket_path,
                         prompt_ids=prompt(CFG, 2, 16), model_id="m")
    memory = BladedCache(MemoryKV(geometry_for(hf.config, 1, MAX_TOKENS, torch.float32)))
    with pytest.raises(ValueError, match=r"^retain needs a cache on a bladed session; open it with"):
        memory.retain(ids)
    memory.close()
    with Client(daemon.socket_path) as c:
        assert c.sessions() == []                                      # nothing refused was left open
