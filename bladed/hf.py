"""Hugging Face transformers integration: a ``Cache`` whose layers live in bladed.

::

    cache = BladedCache.open(model.config, batch_size=1, max_tokens=512, dtype=torch.float32)
    out = model.generate(ids, **generate_kwargs(cache), max_new_tokens=64)
    cache.close()

``generate_kwargs(cache)`` passes the cache under the name the installed transformers takes it by
(:func:`cache_kwarg_name`: ``cache=`` from 5.24, ``past_key_values=`` before).

Prefix reuse (bladed keeps the KV of earlier prompts; docs/transformers.md)::

    cache = BladedCache.open(model.config, 1, max_tokens, dtype=torch.float32, prompt_ids=ids, model_id="org/name")
    out = model.generate(ids, **generate_kwargs(cache), ...)  # prefills only ids[:, cache.prefix_tokens:]
    cache.retain(out[0], close=True)                          # keep this request's KV for the next

Every layer's K/V is written to bladed as it is produced (prefill: all
tokens; decode: the new token at its offset). Only the layer being computed
is resident: after a layer's update its tensors are dropped, and the next
layer's K/V is read back ahead of use on the copy threads (layer-ahead
prefetch), through the staging slots shared with the daemon.

KV formats: ``BladedCache.open(..., kv_format="q8")`` (or a backend whose geometry has a
``kv_format``, :func:`geometry_for`) stores the K/V rows in that format (``bladed.kvformat``:
``fp16``/``bf16``/``fp32`` elements, ``q8``/``q4`` quantized in this process, on the model's
device); what is read back is decoded into the cache's dtype. The bytes are the format's
whatever the backend, so a cache over bladed equals one over ``MemoryKV`` of the same format bit
for bit. The format's full-precision tail (``q4``: the newest 128 tokens; ``kv_tail=`` overrides it,
0 turns it off) is attended to from the cache's own full-precision copy, not from the decoded rows
(``bladed.slots.SlotTensors``).

Sparse decode reads (``bladed.kvselect``; docs/kv-select.md)::

    cache = BladedCache.open(model.config, 1, max_tokens, dtype=torch.float32, select="keys:0.25")
    cache.attach(model)                       # the model's attention goes through the cache's selection
    out = model.generate(ids, **generate_kwargs(cache), ...)

A decode step of a selecting layer reads only the pages its query selects (the cache needs the query, which
transformers hands to the attention function, not to the cache: :meth:`BladedCache.attach` sets the model's
attention to :data:`SELECT_ATTENTION`, which is ``sdpa`` wherever no selection applies).

The cache talks to anything with the KV-backend shape (``geometry``,
``channels``, ``slot(ch)``, ``read``/``write(layer, kind, ch, token_start,
ntokens)``, ``group(layer, kind)``; see ``bladed.kvstore``) or opens a
``bladed.client`` session itself. One small shim covers the transformers
4.57+ and 5.x layer/cache APIs (``lazy_initialization`` arity, the
``get_mask_sizes`` argument, the ``Cache`` constructor).
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from bladed.kvformat import KVFormat
from bladed.kvformat import kv_format as parse_kv_format
from bladed.kvselect import SelectionState, SelectSpec, parse_select, token_index
from bladed.kvstore import BladedKV, full_precision_tail, kv_geometry, prefix_key_fields
from bladed.pipeline import AdaptivePipeline, CopyThreadPool, LoadHandle, LoadJob, PipelineMode, TorchDma
from bladed.residency.geometry import Geometry
from bladed.slots import PageReader, SlotTensors


def geometry_for(config: Any, batch_size: int, max_tokens: int, dtype: torch.dtype,
                 kv_format: str | KVFormat | None = None) -> Geometry:
    """The KV geometry of a transformers decoder config, its rows stored as ``kv_format`` (None: ``dtype``'s own
    elements; ``bladed.kvstore.kv_geometry``)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = cfg.num_attention_heads
    kvh = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return kv_geometry(layers=cfg.num_hidden_layers, batch=batch_size, kv_heads=kvh, head_dim=head_dim,
                       max_tokens=max_tokens, dtype=dtype, kv_format=kv_format)


@functools.cache
def cache_kwarg_name() -> str:
    """The keyword the installed transformers takes a cache by, in ``generate`` and in a model's forward.

    ``"cache"`` from transformers 5.24.0 on: 5.24 renamed ``past_key_values`` to ``cache`` (``generate``
    and every model's forward) and warns (FutureWarning) at the old name, which 6.0 removes.
    ``"past_key_values"`` before (4.57 to 5.23 have no ``cache``). Told by feature, not by version:
    ``cache`` among the names generation holds the cache under (``generation.utils.ALL_CACHE_NAMES``:
    4.57 to 5.23 ``["past_key_values", "cache_params", ...]``, 5.24 ``["cache", "state", ...]``).
    The one place bladed decides it: the docs and tests pass the cache through :func:`generate_kwargs`
    (the runner computes its own attention and hands transformers no cache).
    """
    from transformers.generation import utils as generation

    return "cache" if "cache" in getattr(generation, "ALL_CACHE_NAMES", ()) else "past_key_values"


def generate_kwargs(cache: Cache) -> dict[str, Cache]:
    """``model.generate(ids, **generate_kwargs(cache), ...)``: the cache under :func:`cache_kwarg_name`."""
    return {cache_kwarg_name(): cache}


class _Transfer:
    """Copy threads + staging-slot views + the pipeline, shared by all layers of a cache."""

    def __init__(self, backend: Any, dtype: torch.dtype, device: torch.device, copy_threads: int,
                 pipeline: PipelineMode, lossy_dtype: bool = False, kv_tail: int | None = None,
                 select: SelectSpec | None = None) -> None:
        g = backend.geometry
        self.backend, self.geometry, self.device, self.dtype = backend, g, device, dtype
        self.cuda = device.type == "cuda"
        self.pool = CopyThreadPool(copy_threads, name="bladed-hf-copy")
        self.pipe = AdaptivePipeline(self.pool, pipeline)
        self.dma = TorchDma(device)
        self.ch = {"k": 0, "v": 1 % copy_threads}
        # the slots as K/V tensors: encoded to / decoded from the geometry's KV format, if it has one
        # and the newest ``tail`` tokens of each KPU kept at full precision here (kv_tail None: the backend's)
        self.slots = SlotTensors(backend, dtype, tail=kv_tail)
        self.lossy_dtype = lossy_dtype
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        #: sparse decode reads: the spec, the selector's state and the reader of the selected pages
        self.select = select
        self.state = SelectionState(select, g.layers, g.max_tokens, 1.0,
                                    [j for j in range(g.layers) if select.layer_selects(j)]) \
            if select is not None else None
        self.reader = PageReader(backend, self.slots, self.state) if self.state is not None else None
        #: whether a model's attention goes through the selection (:meth:`BladedCache.attach`)
        self.attached = False

    def selects(self, layer: int, past: int, new: int) -> bool:
        """Whether this update of ``layer`` (``new`` tokens after ``past``) is a decode step through the selection."""
        return (self.state is not None and self.select is not None and new == 1 and past > 0
                and self.select.layer_selects(layer) and not self.select.is_dense(past)
                and self.state.ready(layer, past))

    def note_keys(self, layer: int, t0: int, key_states: torch.Tensor) -> None:
        """The selector's copy of K and the pages' versions, for K written at ``t0`` (heads-first)."""
        if self.state is not None:
            self.state.on_write(layer, t0, key_states.permute(2, 0, 1, 3))

    def sparse_attention(self, layer: int, query: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor,
                         past: int, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Attention of one decode query (``[B, Hq, 1, D]``) over the pages it selects of the ``past`` tokens and the
        new token: each sequence its own pages of the union read (``[B, Hq, 1, D]`` out)."""
        assert self.state is not None and self.reader is not None and self.select is not None
        chosen = self.state.select(layer, query, past, scale=scaling)            # [B, pages]
        pages = chosen.any(dim=0).nonzero().flatten().cpu()
        reader = self.reader
        jobs = []
        for kind in ("k", "v"):
            ch = self.ch[kind]

            def rd(kind: str = kind, ch: int = ch) -> Any:
                return reader.read(layer, kind, ch, pages, past)[0]              # type: ignore[arg-type]

            def dm(kind: str = kind, ch: int = ch) -> torch.Tensor:
                return self.dma.run(lambda: reader.take(layer, kind, ch, pages, past, self.device,  # type: ignore
                                                        self.cuda, room=1), independent=True)

            jobs.append(LoadJob(read=rd, dma=dm, nbytes=int(pages.numel()) * reader.page * self.geometry.token_bytes))
        keys, values = self.pipe.load(jobs, self.backend.group(layer, "k")).result()
        n = keys.shape[2] - 1
        keys[:, :, n:].copy_(new_keys)
        values[:, :, n:].copy_(new_values)
        keys, values = keys.to(query.dtype), values.to(query.dtype)
        allowed = None
        token_pages = pages.repeat_interleave(reader.page)[:n].to(chosen.device)
        if chosen.shape[0] > 1 and not bool(chosen[:, pages.to(chosen.device)].all()):
            allowed = torch.cat([chosen[:, token_pages], chosen.new_ones((chosen.shape[0], 1))], dim=1)[:, None, None]
        if mask is not None:                     # the model's own mask (padding), on the tokens gathered
            cols = torch.cat([token_index(pages, reader.page)[:n], torch.tensor([past])]).to(mask.device)
            picked = mask[..., cols]
            picked = picked if picked.dtype == torch.bool else picked > torch.finfo(picked.dtype).min / 2
            allowed = picked if allowed is None else allowed & picked.to(allowed.device)
        return torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=allowed, scale=scaling, enable_gqa=query.shape[1] != keys.shape[1])

    def check(self, key_states: torch.Tensor, value_states: torch.Tensor, cached: int) -> None:
        """Refuse K/V this cache cannot hold, before anything of it is written (ValueError, one line)."""
        g = self.geometry
        want = (g.batch, g.kv_heads, "tokens", g.head_dim)
        for name, x in (("key", key_states), ("value", value_states)):
            if x.dim() != 4 or (x.shape[0], x.shape[1], x.shape[3]) != (g.batch, g.kv_heads, g.head_dim):
                what = "batch size" if x.dim() == 4 and x.shape[0] != g.batch else "shape"
                raise ValueError(
                    f"{name} states of shape {tuple(x.shape)} do not fit a BladedCache opened for "
                    f"[batch, kv_heads, tokens, head_dim] = {list(want)} ({what} differs); open the cache with "
                    f"batch_size={x.shape[0] if x.dim() == 4 else '?'} and the model's own config")
            if torch.promote_types(x.dtype, self.dtype) != self.dtype and not self.lossy_dtype:
                raise ValueError(
                    f"the model's {name} states are {_dtype_name(x.dtype)} but the cache stores "
                    f"{_dtype_name(self.dtype)}, which would round the KV; open the cache with "
                    f"dtype={x.dtype} (or lossy_dtype=True to accept the rounding)")
        n = key_states.shape[-2]
        if cached + n > g.max_tokens:
            raise ValueError(f"KV of {cached + n} tokens exceeds the cache's max_tokens {g.max_tokens}; "
                             "open the cache with a larger max_tokens")

    def write(self, layer: int, kind: str, t0: int, x: torch.Tensor) -> None:
        ch = self.ch[kind]

        def job() -> Any:
            self.dma.run(lambda: self.slots.put(ch, t0, x, layer=layer, kind=kind))
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

            def rd(kind: str = kind, ch: int = ch) -> Any:
                return self.backend.read(layer, kind, ch, 0, ntok)

            def dm(kind: str = kind, ch: int = ch) -> torch.Tensor:
                return self.dma.run(lambda: self.slots.take(ch, ntok, self.device, non_blocking=self.cuda,
                                                            layer=layer, kind=kind))

            jobs.append(LoadJob(read=rd, dma=dm, nbytes=ntok * self.geometry.token_bytes))
        return self.pipe.load(jobs, self.backend.group(layer, "k"))

    def raise_errors(self) -> None:
        if self.errors:
            first = self.errors[0]
            raise RuntimeError(f"bladed KV write failed: {type(first).__name__}: {first}") from first

    def close(self) -> None:
        self.pool.drain()
        self.pool.close()
        self.slots.close()
        self.raise_errors()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dynamic_lazy_init(layer: DynamicLayer, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """transformers' own empty-cache initialisation (4.57 takes the key states only, 5.x both)."""
    if len(inspect.signature(DynamicLayer.lazy_initialization).parameters) > 2:
        DynamicLayer.lazy_initialization(layer, key_states, value_states)
    else:  # pragma: no cover - transformers 4.57
        DynamicLayer.lazy_initialization(layer, key_states)  # type: ignore[call-arg]


def _init_layer(layer: DynamicLayer) -> None:
    try:
        DynamicLayer.__init__(layer)
    except TypeError:  # pragma: no cover - other transformers signatures
        DynamicLayer.__init__(layer, None)  # type: ignore[call-arg]


#: the attention implementation :meth:`BladedCache.attach` gives a model: ``sdpa``, but where a selecting cache
#: deferred the layer's past to the attention (a decode step through the selection)
SELECT_ATTENTION = "bladed_select"
_DEFERRED = threading.local()


def select_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """:data:`SELECT_ATTENTION`: the selected pages' attention where the layer's cache update deferred it to here,
    else transformers' ``sdpa``."""
    pending = getattr(_DEFERRED, "pending", None)
    _DEFERRED.pending = None
    if pending is None or pending[1] != getattr(module, "layer_idx", None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    transfer, layer, past = pending
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = transfer.sparse_attention(layer, query, key, value, past, attention_mask, scale)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(SELECT_ATTENTION, select_attention)
AttentionMaskInterface.register(SELECT_ATTENTION, sdpa_mask)


class BladedLayer(DynamicLayer):
    """One decoder layer's K/V, resident only while the layer is in use."""

    def __init__(self, transfer: _Transfer, index: int, cached_tokens: int = 0) -> None:
        _init_layer(self)
        self._t = transfer
        self.index = index
        # tokens whose K/V the backend already holds (a retained prefix): read back at the first update
        self._len = cached_tokens
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
        state = self._t.state
        if state is not None and self.index in state.selecting and not state.ready(self.index, self._len):
            # a reused prefix: its K folded into the selector's state
            state.on_read(self.index, k.permute(2, 0, 1, 3))
        # a cache dtype other than the model's (wider, or narrower with lossy_dtype) converts back here
        return k.to(self.device, self.dtype), v.to(self.device, self.dtype)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self._t.check(key_states, value_states, self._len)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t0, n = self._len, key_states.shape[-2]
        if self._t.selects(self.index, t0, n):
            # the attention (SELECT_ATTENTION) reads the pages this step's query selects: hand it the new K/V
            if not self._t.attached:
                raise ValueError("BladedCache(select=...) reads the pages the query selects, and transformers gives "
                                 "the query to the attention, not to the cache: call cache.attach(model) before "
                                 "generate")
            self._t.note_keys(self.index, t0, key_states)
            self._t.write(self.index, "k", t0, key_states)
            self._t.write(self.index, "v", t0, value_states)
            self._len = t0 + 1
            _DEFERRED.pending = (self._t, self.index, t0)
            return key_states, value_states
        past = self._resident()
        if past is None:
            _dynamic_lazy_init(self, key_states, value_states)
        else:
            self.keys, self.values = past
        # transformers' own DynamicLayer joins past and new: the attention then sees tensors of the same
        # values, shapes and strides as with the default cache, so it runs the same kernels (same bits)
        keys, values = DynamicLayer.update(self, key_states, value_states, *args, **kwargs)
        self._t.note_keys(self.index, t0, key_states)
        self._t.write(self.index, "k", t0, key_states)
        self._t.write(self.index, "v", t0, value_states)
        self._len = t0 + n
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

    ``dtype`` is what the cache stores: the model's K/V dtype or a wider one; a narrower one (which
    rounds the KV) is refused unless ``lossy_dtype``. ``prefetch`` reads layer ``j+1`` while layer
    ``j`` computes; ``pipeline`` picks the copy-thread strategy (``adaptive``: the per-group choice
    between overlap-intra and overlap-cross of Dual-Blade §IV-C). ``cached_tokens``: the backend
    already holds the K/V of that many leading tokens of every layer (a reused prefix, see :meth:`open`);
    ``model_id`` names the model for :meth:`retain`; ``prompt_tokens`` (the prompt's length given at open)
    makes the first forward check that it brings the rest of that prompt.

    KV formats: the backend's geometry says how the K/V rows are stored (``kv_format``, ``bladed.kvformat``;
    :func:`geometry_for` and :meth:`open` take ``kv_format=``): the copy threads encode each update's K/V into
    the format's rows and decode them back into ``dtype`` on ``device``. ``q8`` / ``q4`` (and a plain format
    narrower than the model's dtype) round the KV: that is what was asked for, ``lossy_dtype`` is about
    ``dtype`` only. ``kv_format`` given here must name the backend geometry's format (a check, no second
    meaning).

    ``kv_tail``: the newest tokens of each layer's K/V attended to at full precision from a copy the cache
    keeps in memory (``dtype``, on the model's device), not from their decoded rows, which are written all
    the same. None: the backend's ``kv_tail``, else the format's ``full_precision_tail`` (``q4``: 128, the
    others 0); 0 turns it off (to measure the format alone). It costs ``2 * layers * tail * batch * kv_heads
    * head_dim * dtype size`` bytes (:attr:`kv_tail`).

    ``select``: sparse decode reads (``bladed.kvselect``: ``"keys:0.25"``, a :class:`~bladed.kvselect.SelectSpec`;
    None, the default: every step reads all of its past). A decode step of a selecting layer reads only the pages
    its query selects; the model's attention must go through the cache (:meth:`attach`). A bad spec is a
    ``SelectError`` (a ValueError), one line.
    """

    def __init__(self, backend: Any, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 copy_threads: int = 2, prefetch: bool = True, pipeline: PipelineMode = "adaptive",
                 lossy_dtype: bool = False, cached_tokens: int = 0, model_id: str | None = None,
                 prompt_tokens: int | None = None, kv_format: str | KVFormat | None = None,
                 kv_tail: int | None = None, select: str | SelectSpec | None = None) -> None:
        spec = parse_select(select, "select=") if select else None
        if spec is not None:
            spec.check_context(backend.geometry.max_tokens, backend.geometry.layers, "select=")
        if kv_format is not None:
            want = parse_kv_format(kv_format).name if kv_format != "" else ""
            have = backend.geometry.kv_format
            if want != have:
                raise ValueError(f"kv_format={want or ''!r} but the backend stores "
                                 f"{repr(have) + ' rows' if have else 'plain rows (no kv_format)'}; open the backend "
                                 f"with geometry_for(..., kv_format={want or None!r}), or leave kv_format out")
        full_precision_tail(None, kv_tail)      # a negative kv_tail: ValueError, before any thread starts
        self.backend = backend
        self.geometry = backend.geometry
        self._transfer = _Transfer(backend, dtype, torch.device(device), copy_threads, pipeline, lossy_dtype,
                                   kv_tail, spec)
        #: the sparse decode reads (None: dense)
        self.select = spec
        #: the newest tokens of each layer's K/V attended to at full precision from memory (0: none)
        self.kv_tail = self._transfer.slots.tail
        self.prefetch_enabled = prefetch
        self._iteration = -1
        #: leading prompt tokens whose K/V came from a retained prefix: ``generate`` does not compute them
        self.prefix_tokens = cached_tokens
        #: the retained prefix they came from (None: a miss, or no prompt given at open)
        self.prefix_entry: str | None = None
        self._model_id = model_id
        self._prompt_tokens = prompt_tokens
        self._closed = False
        self._blayers = [BladedLayer(self._transfer, j, cached_tokens) for j in range(self.geometry.layers)]
        _init_cache(self, self._blayers)

    @classmethod
    def open(cls, config: Any, batch_size: int, max_tokens: int, dtype: torch.dtype = torch.float32,
             mode: str = "dualblade", socket_path: str | None = None, client: Any = None,
             channels: int = 2, *, prompt_ids: Any = None, model_id: str | None = None,
             kv_format: str | KVFormat | None = None, kv_tail: int | None = None, **kw: Any) -> BladedCache:
        """Open a bladed session sized for ``config`` and wrap it.

        ``socket_path`` None: the socket :func:`bladed.config.find_socket` finds, as ``bladectl`` does.

        ``kv_format``: how the session stores the K/V rows (``fp16``, ``bf16``, ``fp32``, ``q8``, ``q4``, ...;
        None: ``dtype``'s own elements, as always). The daemon sizes the session by the format's rows; the
        cache quantizes and dequantizes in this process. ``KVFormatError`` (a ValueError) names a format the
        model's ``head_dim`` does not fit. ``kv_tail``: the full-precision tail (None: the format's; 0: off).

        ``prompt_ids`` (batch 1: a tensor ``[1, n]`` or ``[n]``, or a list): reuse a prefix bladed retained
        for the same model (``model_id``, default ``config.name_or_path``), dtype and KV shape. The daemon
        copies the K/V of the longest retained prefix of the prompt (whole blocks) into the session, and
        the cache reports those tokens as already there (:attr:`prefix_tokens`, at most ``n - 1``: the
        last prompt token is always computed, for its logits), so ``generate`` with the same prompt
        prefills only the rest. :meth:`retain` keeps a request's K/V for the next one.
        """
        from bladed.client import PrefixKey  # floor 2: only the client library

        geo = geometry_for(config, batch_size, max_tokens, dtype, kv_format)
        model = model_id or getattr(config, "name_or_path", "") or None
        key, tokens = None, []
        if prompt_ids is not None:
            tokens = _token_ids(prompt_ids)
            if batch_size != 1:
                raise ValueError(f"prefix reuse (prompt_ids=) needs batch_size=1, got {batch_size}; open one cache "
                                 "per sequence")
            if not tokens:
                raise ValueError("prompt_ids is empty; pass the prompt's token ids")
            if model is None:
                raise ValueError("prefix reuse needs the model's identity and config.name_or_path is empty; pass "
                                 "model_id= (a name that tells the model's weights apart)")
            key = PrefixKey(*prefix_key_fields(model, dtype, geo.kv_format), tokens)
        # refuses (and closes) a session whose rows are not geo's
        backend = BladedKV.open(geo, mode=mode, channels=channels, socket_path=socket_path, client=client,
                                prefix=key, kv_tail=kv_tail)
        # a whole-prompt match still recomputes the last token: generate needs its logits to sample from
        cached = min(backend.prefix_tokens, len(tokens) - 1) if key is not None else 0
        cache = cls(backend, dtype=dtype, copy_threads=channels, cached_tokens=cached, model_id=model,
                    prompt_tokens=len(tokens) if key is not None else None, kv_tail=kv_tail, **kw)
        cache.prefix_entry = backend.session.prefix_entry
        return cache

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self._transfer.raise_errors()
        if layer_idx == 0:
            if self._iteration < 0 and self._prompt_tokens is not None:
                self._check_prompt(key_states.shape[-2])
            if self._iteration >= 0:
                self._transfer.pipe.end_iteration()
            self._iteration += 1
            self._transfer.pipe.begin_iteration(self._iteration)
        layer = self._blayers[layer_idx]
        keys, values = layer.update(key_states, value_states, *args, **kwargs)
        layer.offload()
        if self.prefetch_enabled:
            nxt = self._blayers[(layer_idx + 1) % len(self._blayers)]
            # a layer whose next update reads a selection has nothing to read before its query is known
            if not self._transfer.selects(nxt.index, nxt.get_seq_length(), key_states.shape[-2]):
                nxt.prefetch()
        return keys, values

    def attach(self, model: Any) -> Any:
        """Route ``model``'s attention through this cache's selection (:data:`SELECT_ATTENTION`: transformers'
        ``sdpa`` wherever no selection applies); needed for ``select=``, harmless without. Returns ``model``.
        A model on another attention than ``sdpa`` is refused with one line (the dense steps would change)."""
        have = getattr(model.config, "_attn_implementation", None)
        if have not in ("sdpa", SELECT_ATTENTION):
            raise ValueError(f"BladedCache.attach: the model's attention is {have!r}; the selection runs on sdpa's, "
                             "load the model with attn_implementation='sdpa'")
        model.set_attn_implementation(SELECT_ATTENTION)
        self._transfer.attached = True
        return model

    def select_report(self) -> dict[str, Any]:
        """With ``select``: the spec, the bytes held for it (the selector's K copy or page summaries, the reuse
        buffers) and the reuse buffers' hits; ``{}`` without."""
        t = self._transfer
        if t.state is None or t.reader is None or self.select is None:
            return {}
        hits, lookups = t.reader.reuse()
        return {"spec": self.select.describe(), "selector_bytes": t.state.nbytes(),
                "reuse_buffer_bytes": t.reader.nbytes(), "pages_selected": lookups, "reuse_hits": hits,
                "reuse_hit_rate": round(hits / lookups, 4) if lookups else None}

    def _check_prompt(self, n: int) -> None:
        """The first forward must bring the rest of the prompt given at open (else the reused K/V is another's)."""
        if self.prefix_tokens + n != self._prompt_tokens:
            raise ValueError(f"the first forward brings {n} tokens after the {self.prefix_tokens} reused ones, but "
                             f"the cache was opened for a prompt of {self._prompt_tokens} tokens; pass the same ids "
                             "to BladedCache.open(prompt_ids=) and to generate")

    def get_seq_length(self, layer_idx: int = 0, *args: Any, **kwargs: Any) -> int:
        if layer_idx >= len(self._blayers):
            return 0
        return self._blayers[layer_idx].get_seq_length()

    @property
    def pipeline_report(self) -> dict[str, Any]:
        return self._transfer.pipe.report()

    def retain(self, tokens: Any, *, close: bool = False) -> dict[str, Any]:
        """Keep the K/V this cache holds as a retained prefix, for later caches opened with a prompt starting so.

        ``tokens``: the sequence's ids (``generate``'s output row, or a ``[1, n]`` tensor, or a list); ids past
        :meth:`get_seq_length` are left out (the last generated token was never fed, so it has no K/V). bladed
        keeps the whole blocks of ``prefix.block_tokens``. ``close``: close the cache with it (the end of a
        request; the entry may then take the session's page-cache budget). Returns ``{"entry", "tokens",
        "new"}``; bladed's refusals (retention off or over quota, less than one block) raise its error.
        """
        from bladed.client import PrefixKey

        session = getattr(self.backend, "session", None)
        if session is None or not hasattr(session, "retain"):
            raise ValueError("retain needs a cache on a bladed session; open it with BladedCache.open")
        if self._model_id is None:
            raise ValueError("retain needs the model's identity and config.name_or_path is empty; open the cache "
                             "with model_id= (a name that tells the model's weights apart)")
        ids = _token_ids(tokens)[: self.get_seq_length()]
        self._transfer.pool.drain()             # the daemon keeps what it has: every write must be there
        self._transfer.raise_errors()
        key = PrefixKey(*prefix_key_fields(self._model_id, self._transfer.dtype, self.geometry.kv_format))
        out: dict[str, Any] = session.retain(ids, key, close=close)
        if close:
            self.close()
        return out

    def close(self) -> None:
        """Wait for outstanding writes, stop the copy threads, close the backend (once; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._transfer.close()
        finally:
            self.backend.close()

    def __enter__(self) -> BladedCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _token_ids(ids: Any) -> list[int]:
    """Token ids of one sequence: a tensor ``[n]`` or ``[1, n]``, or a sequence of ints."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1:
            raise ValueError(f"token ids of shape {tuple(ids.shape)}: prefix reuse takes one sequence, [n] or [1, n]")
        return [int(t) for t in ids.tolist()]
    if isinstance(ids, Sequence) and not isinstance(ids, str | bytes):
        return [int(t) for t in ids]
    raise ValueError(f"token ids must be a tensor or a list of ints, got {type(ids).__name__}")


__all__ = ["SELECT_ATTENTION", "BladedCache", "BladedLayer", "Geometry", "cache_kwarg_name", "generate_kwargs",
           "geometry_for", "select_attention"]
