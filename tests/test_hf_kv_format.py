"""``BladedCache(..., kv_format=...)`` for transformers (issue 31, "Clients").

The cache encodes each update's K/V into the format's rows and decodes what it reads back into its dtype, in
the model's process; bladed stores the rows as bytes. So ``model.generate`` with the cache over bladed equals,
bit for bit, the cache over ``MemoryKV`` of the same format (bladed adds no error of its own), and the format
is really applied (the decode steps' logits move off the default cache's by the rounding).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from runner_util import CONFIGS, hf_greedy, hf_model, prompt

from bladed.hf import BladedCache, geometry_for
from bladed.kvformat import KVFormatError
from bladed.kvstore import MemoryKV
from bladed.runner.main import spawned_daemon

CFG = CONFIGS["llama-gqa"]                 # 2 KV heads x 16: formats with blocks of 16
#: logits of this cache against transformers' default cache (two implementations): matmul kernels round
#: differently by CPU, so tokens compare exactly and logits within this
LOGIT_TOL = 1e-4


def assert_logits_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=LOGIT_TOL, atol=LOGIT_TOL)


@pytest.fixture(scope="module")
def hf() -> object:
    return hf_model(CFG, torch.float32)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with spawned_daemon(str(tmp_path_factory.mktemp("bladed-hf-kvfmt"))) as sock:
        yield sock


@pytest.mark.parametrize(("fmt", "mode", "tail"), [("q8:16", "dualblade", None), ("q4:16", "direct", 0),
                                                  ("q4:16", "dualblade", 2), ("bf16", "baseline", None)])
def test_generate_over_bladed_equals_memory_kv_of_the_same_format(hf: object, daemon: str, fmt: str,
                                                                  mode: str, tail: int | None) -> None:
    ids = prompt(CFG, 2, 6)
    _, ref_l = hf_greedy(hf, ids, 5)
    g = geometry_for(hf.config, 2, 11, torch.float32, kv_format=fmt)  # type: ignore[attr-defined]
    assert g.kv_format == fmt
    with BladedCache(MemoryKV(g), dtype=torch.float32, kv_format=fmt, kv_tail=tail) as cache:
        assert cache.kv_tail == (tail or 0)
        mem_t, mem_l = hf_greedy(hf, ids, 5, cache=cache)
    cache = BladedCache.open(hf.config, batch_size=2, max_tokens=11, dtype=torch.float32,  # type: ignore[attr-defined]
                             mode=mode, socket_path=daemon, kv_format=fmt, kv_tail=tail)
    try:
        assert cache.geometry == g and cache.backend.session.token_bytes == g.token_bytes
        assert cache.kv_tail == cache.backend.kv_tail == (tail or 0)
        t, lg = hf_greedy(hf, ids, 5, cache=cache)
    finally:
        cache.close()
    assert torch.equal(t, mem_t)
    assert all(torch.equal(a, b) for a, b in zip(lg, mem_l, strict=True))
    # against transformers' own cache (another implementation): the prefill attends to the new K/V, not the stored
    # rows, so its logits are the default cache's up to kernel rounding
    torch.testing.assert_close(mem_l[0], ref_l[0], rtol=LOGIT_TOL, atol=LOGIT_TOL)
    assert max(float((a - b).abs().max()) for a, b in zip(mem_l[1:], ref_l[1:], strict=True)) > LOGIT_TOL


def test_without_a_format_the_cache_is_the_default_cache(hf: object) -> None:
    ids = prompt(CFG, 1, 6)
    ref_t, ref_l = hf_greedy(hf, ids, 4)
    g = geometry_for(hf.config, 1, 10, torch.float32)  # type: ignore[attr-defined]
    assert g.kv_format == ""
    with BladedCache(MemoryKV(g), dtype=torch.float32, kv_format="") as cache:
        t, lg = hf_greedy(hf, ids, 4, cache=cache)
    assert torch.equal(t, ref_t)
    assert_logits_close(lg, ref_l)


def test_q4s_tail_attends_to_the_newest_tokens_as_computed_and_kv_tail_0_turns_it_off(hf: object) -> None:
    """6 + 4 tokens within q4's 128-token tail: the cache is the default cache (tokens exactly, logits within
    rounding); off, it is not."""
    ids = prompt(CFG, 1, 6)
    ref_t, ref_l = hf_greedy(hf, ids, 4)
    g = geometry_for(hf.config, 1, 10, torch.float32, kv_format="q4:16")  # type: ignore[attr-defined]
    with BladedCache(MemoryKV(g), dtype=torch.float32, kv_format="q4:16") as cache:
        assert cache.kv_tail == 128
        t, lg = hf_greedy(hf, ids, 4, cache=cache)
    assert torch.equal(t, ref_t)
    assert_logits_close(lg, ref_l)
    with BladedCache(MemoryKV(g), dtype=torch.float32, kv_tail=0) as cache:
        assert cache.kv_tail == 0
        _, off = hf_greedy(hf, ids, 4, cache=cache)
    assert max(float((a - b).abs().max()) for a, b in zip(off[1:], ref_l[1:], strict=True)) > LOGIT_TOL
    with pytest.raises(ValueError, match=r"^kv_tail=-1: the full-precision tail is a number of tokens, 0 or more"):
        BladedCache(MemoryKV(g), kv_tail=-1)


def test_a_kv_format_other_than_the_backends_is_refused(hf: object) -> None:
    g = geometry_for(hf.config, 1, 10, torch.float32, kv_format="q8:16")  # type: ignore[attr-defined]
    with pytest.raises(ValueError) as e:
        BladedCache(MemoryKV(g), kv_format="q4:16")
    assert str(e.value) == ("kv_format='q4:16' but the backend stores 'q8:16' rows; open the backend with "
                            "geometry_for(..., kv_format='q4:16'), or leave kv_format out")
    plain = geometry_for(hf.config, 1, 10, torch.float32)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="the backend stores plain rows"):
        BladedCache(MemoryKV(plain), kv_format="q8:16")


def test_a_format_the_models_head_dim_does_not_fit_is_refused_at_open(hf: object, daemon: str) -> None:
    with pytest.raises(KVFormatError, match="head_dim 16"):
        BladedCache.open(hf.config, batch_size=1, max_tokens=8, socket_path=daemon,  # type: ignore[attr-defined]
                         kv_format="q8")
