"""``bladed.hf.BladedCache``: model.generate with the KV offloaded equals the default cache."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from runner_util import CONFIGS, hf_greedy, hf_model, prompt

from bladed.hf import BladedCache, geometry_for
from bladed.runner.cli import spawned_daemon
from bladed.runner.kvstore import Geometry, MemoryKV


def _memory_cache(hf: object, batch: int, max_tokens: int, dtype: torch.dtype, **kw: object) -> BladedCache:
    g = geometry_for(hf.config, batch, max_tokens, dtype)  # type: ignore[attr-defined]
    geo = Geometry(g.layers, g.batch, g.kv_heads, g.head_dim, g.dtype_bytes, g.max_tokens)
    return BladedCache(MemoryKV(geo), dtype=dtype, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_generate_with_offloaded_cache_equals_default_cache(arch: str, dtype: torch.dtype, prefetch: bool) -> None:
    cfg = CONFIGS[arch]
    hf = hf_model(cfg, dtype)
    ids = prompt(cfg, 2, 6)
    ref_t, ref_l = hf_greedy(hf, ids, 6)
    with _memory_cache(hf, 2, 12, dtype, prefetch=prefetch) as cache:
        t, lg = hf_greedy(hf, ids, 6, past_key_values=cache)
        assert cache.get_seq_length() == 6 + 5
        assert all(layer.keys is None for layer in cache.layers)  # nothing resident between steps
    assert torch.equal(t, ref_t)
    assert all(torch.equal(a, b) for a, b in zip(lg, ref_l, strict=True))


def test_cache_refuses_more_tokens_than_sized_for() -> None:
    cfg = CONFIGS["opt"]
    hf = hf_model(cfg, torch.float32)
    with _memory_cache(hf, 1, 8, torch.float32) as cache, pytest.raises(ValueError, match="max_tokens"):
        hf_greedy(hf, prompt(cfg, 1, 6), 6, past_key_values=cache)


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
        t, lg = hf_greedy(hf, ids, 5, past_key_values=cache)
    finally:
        cache.close()
    assert torch.equal(t, ref_t)
    assert all(torch.equal(a, b) for a, b in zip(lg, ref_l, strict=True))
