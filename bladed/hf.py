"""Hugging Face transformers integration: a ``Cache`` whose layers live in bladed.

::

    cache = BladedCache.open(model.config, batch_size=1, max_tokens=512, dtype=torch.float32)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=64)
    cache.close()

Every layer's K/V is written to bladed as it is produced (prefill: all
tokens; decode: the new token at its offset). Only the layer being computed
is resident: after a layer's update its tensors are dropped, and the next
layer's K/V is read back ahead of use on the copy threads (layer-ahead
prefetch), through the staging slots shared with the daemon.

The cache talks to anything with the KV-backend shape (``geometry``,
``channels``, ``slot(ch)``, ``read``/``write(layer, kind, ch, token_start,
ntokens)``, ``group(layer, kind)``; see ``bladed.runner.kvstore``) or opens a
``bladed.client`` session itself. One small shim covers the transformers
4.57+ and 5.x layer/cache APIs (``lazy_initialization`` arity, the
``get_mask_sizes`` argument, the ``Cache`` constructor).
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from bladed.pipeline import AdaptivePipeline, CopyThreadPool, LoadHandle, LoadJob, PipelineMode, TorchDma
from bladed.residency.geometry import Geometry
from bladed.runner.kvstore import BladedKV

_DTYPE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


def geometry_for(config: Any, batch_size: int, max_tokens: int, dtype: torch.dtype) -> Geometry:
    """The KV geometry of a transformers decoder config."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = cfg.num_attention_heads
    kvh = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return Geometry(layers=cfg.num_hidden_layers, batch=batch_size, kv_heads=kvh, head_dim=head_dim,
                         dtype_bytes=_DTYPE_BYTES[dtype], max_tokens=max_tokens)


class _Transfer:
    """Copy threads + staging-slot views + the pipeline, shared by all layers of a cache."""

    def __init__(self, backend: Any, dtype: torch.dtype, device: torch.device, copy_threads: int,
                 pipeline: PipelineMode) -> None:
        g = backend.geometry
        self.backend, self.geometry, self.device = backend, g, device
        self.cuda = device.type == "cuda"
        self.pool = CopyThreadPool(copy_threads, name="bladed-hf-copy")
        self.pipe = AdaptivePipeline(self.pool, pipeline)
        self.dma = TorchDma(device)
        self.ch = {"k": 0, "v": 1 % copy_threads}
        self.views = []
        for ch in range(min(copy_threads, backend.channels)):
            raw = torch.frombuffer(backend.slot(ch), dtype=torch.uint8)[: g.kpu_bytes]
            self.views.append(raw.view(dtype).view(g.max_tokens, g.batch, g.kv_heads, g.head_dim))
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()

    def write(self, layer: int, kind: str, t0: int, x: torch.Tensor) -> None:
        ch = self.ch[kind]
        view = self.views[ch]

        def job() -> Any:
            self.dma.run(lambda: view[t0:t0 + x.shape[2]].copy_(x.permute(2, 0, 1, 3)))
            return self.backend.write(layer, kind, ch, t0, x.shape[2])

        fut = self.pool.submit(ch, job)
        fut.add_done_callback(self._check)

    def _check(self, fut: Any) -> None:
        exc = fut.exception()
        if exc is not None:
            with self._lock:
                self.errors.append(exc)

    def load(self, layer: int, ntok: int) -> LoadHandle:
        jobs = []
        for kind in ("k", "v"):
            ch = self.ch[kind]
            view = self.views[ch]

            def rd(kind: str = kind, ch: int = ch) -> Any:
                return self.backend.read(layer, kind, ch, 0, ntok)

            def dm(view: torch.Tensor = view) -> torch.Tensor:
                def cp() -> torch.Tensor:
                    src = view[:ntok]
                    dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
                    dst.copy_(src, non_blocking=self.cuda)
                    return dst.permute(1, 2, 0, 3)
                return self.dma.run(cp)

            jobs.append(LoadJob(read=rd, dma=dm, nbytes=ntok * self.geometry.token_bytes))
        return self.pipe.load(jobs, self.backend.group(layer, "k"))

    def raise_errors(self) -> None:
        if self.errors:
            raise RuntimeError("bladed KV write failed") from self.errors[0]

    def close(self) -> None:
        self.pool.drain()
        self.pool.close()
        self.views.clear()
        self.raise_errors()


def _init_layer(layer: DynamicLayer) -> None:
    try:
        DynamicLayer.__init__(layer)
    except TypeError:  # pragma: no cover - other transformers signatures
        DynamicLayer.__init__(layer, None)  # type: ignore[call-arg]


class BladedLayer(DynamicLayer):
    """One decoder layer's K/V, resident only while the layer is in use."""

    def __init__(self, transfer: _Transfer, index: int) -> None:
        _init_layer(self)
        self._t = transfer
        self.index = index
        self._len = 0
        self._pending: LoadHandle | None = None

    # -- shim: 4.57 calls lazy_initialization(key_states), 5.x (key_states, value_states)
    def lazy_initialization(self, key_states: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = self.values = None
        self.is_initialized = True

    def _resident(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self._len == 0:
            return None
        if self.keys is not None and self.values is not None and self.keys.shape[-2] == self._len:
            return self.keys, self.values
        h = self._pending or self._t.load(self.index, self._len)
        self._pending = None
        k, v = h.result()
        return k.to(self.device), v.to(self.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t0, n = self._len, key_states.shape[-2]
        if t0 + n > self._t.geometry.max_tokens:
            raise ValueError(f"KV of {t0 + n} tokens exceeds the cache's max_tokens {self._t.geometry.max_tokens}")
        past = self._resident()
        keys = key_states if past is None else torch.cat([past[0], key_states], dim=-2)
        values = value_states if past is None else torch.cat([past[1], value_states], dim=-2)
        self._t.write(self.index, "k", t0, key_states)
        self._t.write(self.index, "v", t0, value_states)
        self._len = t0 + n
        self.keys, self.values = keys, values
        return keys, values

    def offload(self) -> None:
        """Drop the resident tensors; the K/V lives in bladed."""
        self.keys = self.values = None

    def prefetch(self) -> None:
        """Start reading this layer's K/V back (copy threads), unless resident or already under way."""
        if self._len and self.keys is None and self._pending is None:
            self._pending = self._t.load(self.index, self._len)

    def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
        return self._len

    # -- shim: 4.57 passes cache_position (tensor), 5.x query_length (int)
    def get_mask_sizes(self, query: Any, *args: Any, **kwargs: Any) -> tuple[int, int]:  # type: ignore[override]
        q = int(query.shape[0]) if isinstance(query, torch.Tensor) else int(query)
        return self._len + q, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        raise NotImplementedError("BladedCache cannot be reset; open a new one")

    def crop(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("BladedCache does not support cropping")

    def reorder_cache(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("BladedCache does not support beam search")

    def batch_repeat_interleave(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("BladedCache has a fixed batch")

    def batch_select_indices(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("BladedCache has a fixed batch")


def _init_cache(cache: Cache, layers: list[BladedLayer]) -> None:
    params = inspect.signature(Cache.__init__).parameters
    if "layers" in params:
        Cache.__init__(cache, layers=list(layers))  # type: ignore[arg-type,unused-ignore]
    else:  # pragma: no cover - pre-layered API
        Cache.__init__(cache)
        cache.layers = layers  # type: ignore[assignment]


class BladedCache(Cache):
    """A transformers ``Cache`` keeping every layer's K/V in bladed (or any KV backend).

    ``prefetch`` reads layer ``j+1`` while layer ``j`` computes; ``pipeline``
    picks the copy-thread strategy (``adaptive`` as in Dual-Blade §IV-C).
    """

    def __init__(self, backend: Any, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 copy_threads: int = 2, prefetch: bool = True, pipeline: PipelineMode = "adaptive") -> None:
        self.backend = backend
        self.geometry = backend.geometry
        self._transfer = _Transfer(backend, dtype, torch.device(device), copy_threads, pipeline)
        self.prefetch_enabled = prefetch
        self._iteration = -1
        self._blayers = [BladedLayer(self._transfer, j) for j in range(self.geometry.layers)]
        _init_cache(self, self._blayers)

    @classmethod
    def open(cls, config: Any, batch_size: int, max_tokens: int, dtype: torch.dtype = torch.float32,
             mode: str = "dualblade", socket_path: str | None = None, client: Any = None,
             channels: int = 2, **kw: Any) -> BladedCache:
        """Open a bladed session sized for ``config`` and wrap it."""
        geo = geometry_for(config, batch_size, max_tokens, dtype)
        backend = BladedKV.open(geo, mode=mode, channels=channels, socket_path=socket_path, client=client)
        return cls(backend, dtype=dtype, copy_threads=channels, **kw)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self._transfer.raise_errors()
        if layer_idx == 0:
            if self._iteration >= 0:
                self._transfer.pipe.end_iteration()
            self._iteration += 1
            self._transfer.pipe.begin_iteration(self._iteration)
        layer = self._blayers[layer_idx]
        keys, values = layer.update(key_states, value_states, *args, **kwargs)
        layer.offload()
        if self.prefetch_enabled:
            self._blayers[(layer_idx + 1) % len(self._blayers)].prefetch()
        return keys, values

    def get_seq_length(self, layer_idx: int = 0, *args: Any, **kwargs: Any) -> int:
        if layer_idx >= len(self._blayers):
            return 0
        return self._blayers[layer_idx].get_seq_length()

    @property
    def pipeline_report(self) -> dict[str, Any]:
        return self._transfer.pipe.report()

    def close(self) -> None:
        """Wait for outstanding writes, stop the copy threads, close the backend."""
        try:
            self._transfer.close()
        finally:
            self.backend.close()

    def __enter__(self) -> BladedCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["BladedCache", "BladedLayer", "Geometry", "geometry_for"]
