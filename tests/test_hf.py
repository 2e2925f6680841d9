"""``bladed.hf.BladedCache``: model.generate with the KV offloaded equals the default cache.

Bit for bit: transformers computes everything either way, and the cache hands its attention K/V of the
same values, shapes and strides as ``DynamicCache`` (checked below), so the same kernels run.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator

import pytest
import torch
from runner_util import CONFIGS, hf_greedy, hf_model, prompt
from transformers import DynamicCache

from bladed.hf import BladedCache, cache_kwarg_name, generate_kwargs, geometry_for
from bladed.kvstore import Kind, KVOp, MemoryKV
from bladed.runner.main import spawned_daemon


class CountingKV(MemoryKV):
    """``MemoryKV`` that counts writes (to show a refused update wrote nothing)."""

    writes = 0

    def write(self, layer: int, kind: Kind, ch: int, token_start: int = 0, ntokens: int | None = None) -> KVOp:
        self.writes += 1
        return super().write(layer, kind, ch, token_start, ntokens)


def _memory_cache(hf: object, batch: int, max_tokens: int, dtype: torch.dtype, **kw: object) -> BladedCache:
    g = geometry_for(hf.config, batch, max_tokens, dtype)  # type: ignore[attr-defined]
    return BladedCache(CountingKV(g), dtype=dtype, **kw)  # type: ignore[arg-type]


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[batch, tokens, heads, dim] -> [batch, heads, tokens, dim] as a strided view, as attention makes K/V."""
    return x.transpose(1, 2)


def test_attention_gets_the_same_tensors_as_from_the_default_cache() -> None:
    """Values, shapes, dtypes and strides of the returned K/V equal DynamicCache's at every step."""
    cfg = CONFIGS["llama-gqa"]
    hf = hf_model(cfg, torch.float32)
    g = torch.Generator().manual_seed(5)
    steps = [torch.randn(2, n, cfg.num_kv_heads, cfg.head_dim, generator=g) for n in (6, 1, 1, 1)]
    ref = DynamicCache()
    with _memory_cache(hf, 2, 9, torch.float32, prefetch=False) as cache:
        for x in steps:
            k, v = _heads_first(x), _heads_first(-x)
            for j in range(cfg.num_layers):
                got = cache.update(k, v, j)
                want = ref.update(k, v, j)
                for a, b in zip(got, want, strict=True):
                    assert torch.equal(a, b) and a.dtype == b.dtype and a.stride() == b.stride()


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_generate_with_offloaded_cache_equals_default_cache(arch: str, dtype: torch.dtype, prefetch: bool) -> None:
    cfg = CONFIGS[arch]
    hf = hf_model(cfg, dtype)
    ids = prompt(cfg, 2, 6)
    ref_t, ref_l = hf_greedy(hf, ids, 6)
    with _memory_cache(hf, 2, 12, dtype, prefetch=prefetch) as cache:
        t, lg = hf_greedy(hf, ids, 6, cache=cache)
        assert cache.get_seq_length() == 6 + 5
        assert all(layer.keys is None for layer in cache.layers)  # nothing resident between steps
    assert torch.equal(t, ref_t)
    assert all(torch.equal(a, b) for a, b in zip(lg, ref_l, strict=True))


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_the_cache_goes_by_the_name_the_installed_transformers_takes(arch: str) -> None:
    """``generate`` and the model's forward take the cache by ``cache_kwarg_name()`` and warn nothing about it.

    transformers 5.24 renamed ``past_key_values`` to ``cache`` and warns (FutureWarning) at the old name
    (issue 27). The detection (generation's cache names) agrees with the model's own forward signature.
    ``generate``'s warning points at its caller, so pyproject's filterwarnings turns it into an error in
    every test that passes a cache; a forward called through ``nn.Module`` points into torch, so it is
    checked here by its message.
    """
    cfg = CONFIGS[arch]
    hf = hf_model(cfg, torch.float32)
    forward = inspect.signature(type(hf).forward).parameters
    name = cache_kwarg_name()
    assert name == ("cache" if "cache" in forward else "past_key_values") and name in forward
    ids = prompt(cfg, 1, 6)
    with (_memory_cache(hf, 1, 6, torch.float32) as first, _memory_cache(hf, 1, 10, torch.float32) as second,
          warnings.catch_warnings(record=True) as seen):
        warnings.simplefilter("always")
        assert generate_kwargs(first) == {name: first}
        hf(ids, **generate_kwargs(first))
        hf_greedy(hf, ids, 4, cache=second)
        assert first.get_seq_length() == 6 and second.get_seq_length() == 6 + 3
    about_the_cache = [f"{w.filename}:{w.lineno}: {w.message}" for w in seen if "past_key_values" in str(w.message)]
    assert about_the_cache == []


def test_cache_refuses_more_tokens_than_sized_for() -> None:
    cfg = CONFIGS["opt"]
    hf = hf_model(cfg, torch.float32)
    with _memory_cache(hf, 1, 8, torch.float32) as cache, pytest.raises(ValueError, match="max_tokens"):
        hf_greedy(hf, prompt(cfg, 1, 6), 6, cache=cache)


@pytest.mark.parametrize(("cache_batch", "prompt_batch"), [(1, 2), (2, 1)])
def test_cache_refuses_a_prompt_batch_it_was_not_opened_for(cache_batch: int, prompt_batch: int) -> None:
    cfg = CONFIGS["llama-gqa"]
    hf = hf_model(cfg, torch.float32)
    cache = _memory_cache(hf, cache_batch, 12, torch.float32)
    with pytest.raises(ValueError) as err:
        hf_greedy(hf, prompt(cfg, prompt_batch, 6), 4, cache=cache)
    msg = str(err.value)
    assert f"shape ({prompt_batch}, {cfg.num_kv_heads}, 6, {cfg.head_dim})" in msg
    assert f"[{cache_batch}, " in msg and "batch size differs" in msg and f"batch_size={prompt_batch}" in msg
    assert cache.backend.writes == 0  # refused before anything was written
    cache.close()


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_a_cache_narrower_than_the_model_is_refused(cache_dtype: torch.dtype) -> None:
    cfg = CONFIGS["opt"]
    hf = hf_model(cfg, torch.float32)
    cache = _memory_cache(hf, 1, 10, cache_dtype)
    name = str(cache_dtype).removeprefix("torch.")
    with pytest.raises(ValueError, match=f"states are float32 but the cache stores {name}, which would round"):
        hf_greedy(hf, prompt(cfg, 1, 6), 3, cache=cache)
    assert cache.backend.writes == 0
    cache.close()


def test_a_narrower_cache_with_lossy_dtype_rounds_the_kv_and_still_generates() -> None:
    cfg = CONFIGS["opt"]
    hf = hf_model(cfg, torch.float32)
    ids = prompt(cfg, 2, 6)
    _, ref_l = hf_greedy(hf, ids, 5)
    with _memory_cache(hf, 2, 11, torch.bfloat16, lossy_dtype=True) as cache:
        t, lg = hf_greedy(hf, ids, 5, cache=cache)
    assert len(t[0]) == 5 and all(x.dtype == torch.float32 for x in lg)
    assert torch.equal(lg[0], ref_l[0])  # the prefill attends to the new K/V, not the stored copy
    assert max(float((a - b).abs().max()) for a, b in zip(lg[1:], ref_l[1:], strict=True)) > 0  # rounded KV


def test_a_wider_cache_than_the_model_is_lossless() -> None:
    cfg = CONFIGS["llama-gqa"]
    hf = hf_model(cfg, torch.bfloat16)
    ids = prompt(cfg, 2, 6)
    ref_t, ref_l = hf_greedy(hf, ids, 5)
    with _memory_cache(hf, 2, 11, torch.float32) as cache:
        t, lg = hf_greedy(hf, ids, 5, cache=cache)
    assert torch.equal(t, ref_t)
    assert all(torch.equal(a, b) for a, b in zip(lg, ref_l, strict=True))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with spawned_daemon(str(tmp_path_factory.mktemp("bladed-hf"))) as sock:
        yield sock


@pytest.mark.parametrize("mode", ["baseline", "dualblade"])
def test_generate_through_the_daemon(daemon: str, mode: str) -> None:
    cfg = CONFIGS["llama-gqa"]
    hf = hf_model(cfg, torch.float32)
    ids = prompt(cfg, 2, 6)
    ref_t, ref_l = hf_greedy(hf, ids, 5)
    cache = BladedCache.open(hf.config, batch_size=2, max_tokens=11, dtype=torch.float32, mode=mode,
                             socket_path=daemon)
    try:
        t, lg = hf_greedy(hf, ids, 5, cache=cache)
    finally:
        cache.close()
    assert torch.equal(t, ref_t)
    assert all(torch.equal(a, b) for a, b in zip(lg, ref_l, strict=True))
