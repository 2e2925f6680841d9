"""Query-aware sparse decode reads: which pages of the past KV a decode step attends to (issue 47).

A decode step at position ``pos`` attends to tokens ``[0, pos)`` read back from bladed. With a selection
(:class:`SelectSpec`, the runner's ``--kv-select``, ``BladedCache(select=...)``) each offloaded layer past the
first ``dense_layers`` reads only some *pages* of ``page`` tokens: the first ``sinks`` pages, the last
``window`` pages (the newest, partial one among them: it is being appended to) and, up to the budget, the
pages a *selector* ranks highest for this step's query. bladed's rows are token-major, so a page is one
contiguous range of each KPU, and a run of consecutive pages one read.

Selectors (:data:`SELECTORS`):

* ``keys``: approximate attention scores from a compact copy of K kept in this process (:class:`KeyCopy`,
  ``q4`` rows through ``bladed.kvformat``'s codec by default): ``softmax(q . k~ * scale)`` over every past token,
  summed per page (the page's estimated attention mass), combined over the query heads (``heads``).
* ``quest``: Quest's bound per page and query head, ``sum_d max(q_d min_d, q_d max_d)`` over the page's
  element-wise key minimum and maximum (:class:`PageSummaries`), as a softmax over the pages per head,
  combined over the query heads.
* ``window``: the sinks and the newest pages only (StreamingLLM), for the comparison.
* ``random``: as many pages at random (besides the sinks and the window), for the comparison.

Reads are of whole token rows, which hold every KV head (and every sequence of a batch), so a layer reads one
set of pages for all its heads: the heads' page scores are combined (``heads=max``: the most any head gives
a page; ``sum``: the total) before the top pages are taken. With a batch, each sequence ranks its own pages
and attends to them; the union is read (one row holds every sequence).

The budget is the share of the pages read, sinks and window included (``fraction``, or ``tokens``): at a
context of ``n`` pages a step reads ``max(sinks + window, ceil(fraction * n))`` of them, at most ``n``. A
budget that covers every page is the dense read, bit for bit.

Memory kept in the inference process (on the model's device), per cache: for ``quest`` the page summaries,
``2 / page`` of K's elements (min and max per page; 1/8 at the default pages of 16) in the model's dtype; for
``keys`` the key copy (``q4``: 5 bits a value, 0.16 of K in float32, 0.31 in fp16); with ``reuse`` the reuse
buffers (a step's pages of K and V, in the model's dtype). :meth:`SelectionState.nbytes` says what is held.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal

import torch

from bladed.kvformat import KVFormat, kv_format

SelectorName = Literal["keys", "quest", "window", "random"]
#: the selectors; the first is the default (the accuracy table of docs/kv-select.md chose it)
SELECTORS: tuple[SelectorName, ...] = ("keys", "quest", "window", "random")
HeadsRule = Literal["max", "sum"]
HEADS_RULES: tuple[HeadsRule, ...] = ("max", "sum")
#: the key copy's formats (``exact``: the model's dtype, i.e. the true attention mass: the oracle)
KEY_FORMATS = ("q4", "q8", "fp16", "exact")


class SelectError(ValueError):
    """A bad selection option: one line naming the option and the accepted range."""


@dataclass(frozen=True)
class SelectSpec:
    """What a sparse decode step reads (the module doc). Build it with :func:`parse_select`."""

    selector: SelectorName = "keys"
    #: the share of the pages read, in (0, 1] (None when ``tokens`` is given)
    fraction: float | None = 0.25
    #: the budget as a token count instead (whole pages, rounded up)
    tokens: int | None = None
    sinks: int = 1
    window: int = 2
    page: int = 16
    dense_layers: int = 2
    heads: HeadsRule = "max"
    #: the ``keys`` selector's copy of K (:data:`KEY_FORMATS`)
    keys: str = "q4"
    #: keep the pages a layer read in the previous step and read only the others (:class:`ReuseBuffer`)
    reuse: bool = True
    #: the ``random`` selector's seed
    seed: int = 0
    #: read the fewest pages whose estimated attention mass (combined over the heads) reaches this share, at most
    #: the budget (None: always the budget)
    mass: float | None = None

    def pages_read(self, npages: int) -> int:
        """How many of ``npages`` pages a step reads: the budget, at least sinks + window, at most all."""
        if self.tokens is not None:
            k = -(-self.tokens // self.page)
        else:
            assert self.fraction is not None
            k = math.ceil(self.fraction * npages - 1e-9)
        return max(0, min(npages, max(k, self.sinks + self.window)))

    def is_dense(self, ntokens: int) -> bool:
        """Whether a step over ``ntokens`` past tokens reads all of them (the dense path, bit for bit)."""
        n = pages_of(ntokens, self.page)
        return self.pages_read(n) >= n

    def layer_selects(self, layer: int) -> bool:
        """Whether ``layer`` (the model's index) reads a selection; the first ``dense_layers`` read all."""
        return layer >= self.dense_layers

    def check_context(self, max_tokens: int, layers: int, option: str = "--kv-select") -> None:
        """Refuse a window longer than the context or more dense layers than the model has (one line)."""
        if self.window * self.page > max_tokens:
            most = max(1, max_tokens // self.page)
            raise SelectError(f"{option}: window={self.window} pages of {self.page} tokens exceed the context of "
                              f"{max_tokens} tokens; accepted window=1..{most}")
        self.check_layers(layers, option)

    def check_layers(self, layers: int, option: str = "--kv-select") -> None:
        """Refuse more dense layers than the model has (one line)."""
        if self.dense_layers > layers:
            raise SelectError(f"{option}: dense-layers={self.dense_layers} is more than the model's {layers} "
                              f"layers; accepted 0..{layers}")

    def key_format(self, head_dim: int | None = None) -> KVFormat | None:
        """The key copy's format (None: the model's own dtype, ``keys=exact``); for a ``head_dim`` the format's
        blocks of 32 do not divide, the same format in the largest block that does (``q4:16`` for 16)."""
        if self.keys == "exact":
            return None
        fmt = kv_format(self.keys)
        block = getattr(fmt, "block", 0)
        if head_dim is not None and block and head_dim % block:
            block = math.gcd(block, head_dim)
            fmt = kv_format(f"{self.keys}:{block}") if block >= 2 else kv_format("fp16")
        return fmt

    def describe(self) -> str:
        """The spec in the option's own syntax (what :func:`parse_select` reads back)."""
        budget = f"{self.tokens}t" if self.tokens is not None else f"{self.fraction:g}"
        out = (f"{self.selector}:{budget},sinks={self.sinks},window={self.window},page={self.page},"
               f"dense-layers={self.dense_layers},heads={self.heads}")
        if self.selector == "keys":
            out += f",keys={self.keys}"
        if self.selector == "random":
            out += f",seed={self.seed}"
        if self.mass is not None:
            out += f",mass={self.mass:g}"
        return out + f",reuse={'on' if self.reuse else 'off'}"


SYNTAX = ("SELECTOR:BUDGET[,sinks=N][,window=N][,page=N][,dense-layers=N][,heads=max|sum][,keys=q4|q8|fp16|exact]"
          "[,mass=M][,reuse=on|off][,seed=N]")


def parse_select(text: str | SelectSpec, option: str = "--kv-select") -> SelectSpec:
    """``SELECTOR:BUDGET[,name=value...]`` (:data:`SYNTAX`); BUDGET is a fraction of the pages in (0, 1] or a
    token count ``Nt``. Every bad value is a :class:`SelectError` of one line naming it and the accepted range."""
    if isinstance(text, SelectSpec):
        return text
    head, *opts = [part.strip() for part in str(text).split(",")]
    name, sep, budget = head.partition(":")
    if name not in SELECTORS:
        raise SelectError(f"{option}: unknown selector {name!r}; accepted: {', '.join(SELECTORS)} "
                          f"(syntax {SYNTAX})")
    if not sep or not budget:
        raise SelectError(f"{option}: {text!r} has no budget; give {name}:FRACTION with FRACTION in (0, 1] "
                          f"(e.g. {name}:0.25) or {name}:Nt for N tokens")
    spec = SelectSpec(selector=name)
    if budget.endswith("t"):
        spec = replace(spec, fraction=None, tokens=_int(option, "the token budget", budget[:-1], 1))
    else:
        try:
            f = float(budget)
        except ValueError:
            raise SelectError(f"{option}: budget {budget!r} is not a number; accepted a fraction in (0, 1] or "
                              "Nt (a token count, N >= 1)") from None
        if not 0 < f <= 1 or math.isnan(f):
            raise SelectError(f"{option}: fraction {budget} is outside (0, 1]; accepted (0, 1], e.g. {name}:0.25")
        spec = replace(spec, fraction=f)
    for opt in opts:
        key, eq, value = opt.partition("=")
        if not eq:
            raise SelectError(f"{option}: {opt!r} is not name=value (syntax {SYNTAX})")
        if key == "sinks":
            spec = replace(spec, sinks=_int(option, "sinks", value, 0))
        elif key == "window":
            spec = replace(spec, window=_int(option, "window", value, 1))
        elif key == "page":
            spec = replace(spec, page=_int(option, "page", value, 1))
        elif key in ("dense-layers", "dense_layers"):
            spec = replace(spec, dense_layers=_int(option, "dense-layers", value, 0))
        elif key == "heads":
            if value not in HEADS_RULES:
                raise SelectError(f"{option}: heads={value!r}; accepted: {', '.join(HEADS_RULES)}")
            spec = replace(spec, heads=value)
        elif key == "keys":
            if value not in KEY_FORMATS:
                raise SelectError(f"{option}: keys={value!r}; accepted: {', '.join(KEY_FORMATS)}")
            spec = replace(spec, keys=value)
        elif key == "reuse":
            if value not in ("on", "off"):
                raise SelectError(f"{option}: reuse={value!r}; accepted: on, off")
            spec = replace(spec, reuse=value == "on")
        elif key == "seed":
            spec = replace(spec, seed=_int(option, "seed", value, 0))
        elif key == "mass":
            try:
                m = float(value)
            except ValueError:
                m = math.nan
            if not 0 < m <= 1:
                raise SelectError(f"{option}: mass={value!r} is outside (0, 1]; accepted (0, 1], e.g. mass=0.9")
            spec = replace(spec, mass=m)
        else:
            raise SelectError(f"{option}: unknown option {key!r}; accepted: sinks, window, page, dense-layers, "
                              "heads, keys, mass, reuse, seed")
    return spec


def _int(option: str, what: str, value: str, least: int) -> int:
    try:
        n = int(value)
    except ValueError:
        n = least - 1
    if n < least:
        raise SelectError(f"{option}: {what}={value!r} is not an integer >= {least}; accepted {least} or more")
    return n


def pages_of(ntokens: int, page: int) -> int:
    """Pages of ``page`` tokens that hold ``ntokens`` tokens (the last one may be partial)."""
    return -(-ntokens // page)


# -- what is kept per page / per token ---------------------------------------------------------------------
def summarise(keys: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The element-wise min and max of tokens-first ``keys`` (``[n, ...]``) per page of ``page`` tokens from
    token 0 (the last page may be partial): two ``[pages_of(n), ...]`` tensors of ``keys``' dtype."""
    n = keys.shape[0]
    full = n // page * page
    lo = keys[:full].unflatten(0, (-1, page)).amin(dim=1)
    hi = keys[:full].unflatten(0, (-1, page)).amax(dim=1)
    if full < n:
        lo = torch.cat([lo, keys[full:].amin(dim=0, keepdim=True)])
        hi = torch.cat([hi, keys[full:].amax(dim=0, keepdim=True)])
    return lo, hi


class PageSummaries:
    """Per layer and page, the element-wise min and max of K (``[pages, batch, kv_heads, head_dim]``), kept up
    to date as K is written (:meth:`update`; the partial last page too). ``2 / page`` of K's elements."""

    def __init__(self, layers: int, max_tokens: int, page: int) -> None:
        self.page = page
        self.max_pages = pages_of(max_tokens, page)
        self.kmin: list[torch.Tensor | None] = [None] * layers
        self.kmax: list[torch.Tensor | None] = [None] * layers

    def update(self, layer: int, token_start: int, keys: torch.Tensor) -> None:
        """Fold tokens-first ``keys`` (tokens ``[token_start, token_start + n)``) into their pages' summaries.

        Appends in order (what every writer does) fold in exactly; the caller resets a page it rewrites
        (:meth:`forget`)."""
        n, p = keys.shape[0], self.page
        if n == 0:
            return
        first = token_start // p
        lead = token_start - first * p          # tokens of the first page before this write
        lo_t, hi_t = self.kmin[layer], self.kmax[layer]
        if lo_t is None or hi_t is None:
            shape = (self.max_pages, *keys.shape[1:])
            lo_t = self.kmin[layer] = torch.full(shape, math.inf, dtype=keys.dtype, device=keys.device)
            hi_t = self.kmax[layer] = torch.full(shape, -math.inf, dtype=keys.dtype, device=keys.device)
        if lead:                                # pad to whole pages: +inf for the min, -inf for the max
            pad = keys.new_full((lead, *keys.shape[1:]), math.inf)
            lo, _ = summarise(torch.cat([pad, keys]), p)
            _, hi = summarise(torch.cat([-pad, keys]), p)
        else:
            lo, hi = summarise(keys, p)
        end = first + lo.shape[0]
        torch.minimum(lo_t[first:end], lo, out=lo_t[first:end])
        torch.maximum(hi_t[first:end], hi, out=hi_t[first:end])

    def forget(self, layer: int, token_start: int) -> None:
        """Drop what is known of the pages from the one holding ``token_start`` on (before a rewrite)."""
        lo_t, hi_t = self.kmin[layer], self.kmax[layer]
        if lo_t is not None and hi_t is not None:
            lo_t[token_start // self.page:] = math.inf
            hi_t[token_start // self.page:] = -math.inf

    def get(self, layer: int, npages: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = self.kmin[layer], self.kmax[layer]
        assert lo is not None and hi is not None, f"layer {layer} has no page summaries"
        return lo[:npages], hi[:npages]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.kmin, *self.kmax) if t is not None)


class KeyCopy:
    """Per layer, a compact copy of K's token rows (``fmt``; None: K itself) kept in memory for scoring."""

    def __init__(self, layers: int, max_tokens: int, spec: SelectSpec) -> None:
        self.spec = spec
        self.fmt: KVFormat | None = None
        self.max_tokens = max_tokens
        self.rows: list[torch.Tensor | None] = [None] * layers
        self.shape: tuple[int, ...] = ()
        self.dtype = torch.float32

    def update(self, layer: int, token_start: int, keys: torch.Tensor) -> None:
        """Keep tokens-first ``keys`` (tokens ``[token_start, token_start + n)``) in the copy."""
        n = keys.shape[0]
        rows = self.rows[layer]
        if rows is None:
            self.shape, self.dtype = tuple(keys.shape[1:]), keys.dtype
            self.fmt = self.spec.key_format(self.shape[-1])
            if self.fmt is None:
                rows = torch.empty((self.max_tokens, *self.shape), dtype=keys.dtype, device=keys.device)
            else:
                heads, hd = math.prod(self.shape[:-1]), self.shape[-1]
                rows = torch.empty((self.max_tokens, self.fmt.row_bytes(heads, hd)), dtype=torch.uint8,
                                   device=keys.device)
            self.rows[layer] = rows
        dst = rows[token_start:token_start + n]
        if self.fmt is None:
            dst.copy_(keys)
        else:
            self.fmt.encode(keys, out=dst)

    def keys(self, layer: int, ntokens: int) -> torch.Tensor:
        """Tokens ``[0, ntokens)`` of the copy, decoded (tokens-first, ``[ntokens, batch, kv_heads, head_dim]``)."""
        rows = self.rows[layer]
        assert rows is not None, f"layer {layer} has no key copy"
        if self.fmt is None:
            return rows[:ntokens]
        return self.fmt.decode(rows[:ntokens], self.dtype, self.shape)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.rows if t is not None)


# -- scoring and choosing ------------------------------------------------------------------------------------
def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, Hq, Q, D]`` queries as ``[B, kv_heads, group, Q, D]`` (query head h reads KV head h // group)."""
    b, hq, nq, d = q.shape
    return q.float().view(b, kv_heads, hq // kv_heads, nq, d)


def quest_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, positions: torch.Tensor, page: int,
                 scale: float) -> torch.Tensor:
    """Quest: per page and query head the bound ``sum_d max(q_d min_d, q_d max_d)`` (an upper bound of ``q . k``
    over the page), as a softmax over the query's candidate pages: ``[B, Hq, Q, n]``.

    ``q``: ``[B, Hq, Q, D]``; ``kmin`` / ``kmax``: ``[n, B, H, D]``; ``positions``: ``[Q]`` past tokens of each
    query (pages at or past ``pages_of(position)`` are not candidates)."""
    n, _, h, _ = kmin.shape
    g = _grouped(q, h)
    lo, hi = kmin.float().permute(1, 2, 0, 3), kmax.float().permute(1, 2, 0, 3)   # [B, H, n, D]
    bound = torch.einsum("bhgqd,bhnd->bhgqn", g.clamp(min=0), hi) + torch.einsum("bhgqd,bhnd->bhgqn",
                                                                                g.clamp(max=0), lo)
    bound = bound * scale
    valid = _candidates(positions, n, page)                                      # [Q, n]
    bound = bound.masked_fill(~valid, -math.inf)
    return torch.softmax(bound, dim=-1).flatten(1, 2)


def key_scores(q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, page: int, scale: float) -> torch.Tensor:
    """Estimated attention mass per page and query head: ``softmax(q . k * scale)`` over each query's past
    tokens, summed per page: ``[B, Hq, Q, n]``. ``keys``: tokens-first ``[T, B, H, D]`` (T past tokens)."""
    t, b, h, d = keys.shape
    n = pages_of(t, page)
    hq, nq = q.shape[1], q.shape[2]
    # one GEMM per KV head, its query heads' rows stacked; the keys as a transposed view of the tokens-first rows
    # (a permuted copy of them cost more than the rest of the selection on the CPU)
    qs = (q.float() * scale).reshape(b * h, (hq // h) * nq, d)
    k = keys.float().permute(1, 2, 3, 0).reshape(b * h, d, t)
    logits = torch.bmm(qs, k).view(b, hq, nq, t)
    if bool((positions < t).any()):              # queries that see only part of the keys (the harness's)
        past = torch.arange(t, device=q.device)[None, :] < positions[:, None].to(q.device)   # [Q, T]
        logits = logits.masked_fill(~past, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if n * page != t:
        probs = torch.nn.functional.pad(probs, (0, n * page - t))
    return probs.unflatten(-1, (n, page)).sum(dim=-1)


def _candidates(positions: torch.Tensor, npages: int, page: int) -> torch.Tensor:
    """``[Q, n]``: whether page j holds any of query q's past tokens."""
    have = (positions.to(torch.long) + page - 1) // page
    return torch.arange(npages, device=positions.device)[None, :] < have[:, None]


def choose_pages(spec: SelectSpec, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The pages each sequence and query reads (``[B, Q, n]`` bool): its sinks and window, then the pages the
    per-head ``scores`` (``[B, Hq, Q, n]``, combined by ``spec.heads``) rank highest, up to
    :meth:`SelectSpec.pages_read` of its ``pages_of(position)`` pages; with ``spec.mass``, only until every
    head's pages taken hold that share of its estimated mass."""
    b, _, nq, n = scores.shape
    dev = scores.device
    have = ((positions.to(torch.long) + spec.page - 1) // spec.page).to(dev)            # [Q]
    idx = torch.arange(n, device=dev)[None, :]
    valid = idx < have[:, None]
    forced = valid & ((idx < spec.sinks) | (idx >= have[:, None] - spec.window))
    per_head = scores.float()
    combined = per_head.amax(dim=1) if spec.heads == "max" else per_head.mean(dim=1)    # [B, Q, n]
    ranked = combined.masked_fill(forced, math.inf).masked_fill(~valid, -math.inf)
    want = torch.tensor([spec.pages_read(int(h)) for h in have.tolist()], device=dev)   # [Q]
    kmax = int(want.max()) if nq else 0
    top = ranked.topk(kmax, dim=-1).indices                                              # [B, Q, kmax]
    keep = (torch.arange(kmax, device=dev)[None, :] < want[:, None]).expand(b, nq, kmax)  # [B, Q, kmax]
    if spec.mass is not None:               # stop once every head's pages taken (forced first) hold the mass
        taken = per_head.gather(-1, top[:, None].expand(-1, per_head.shape[1], -1, -1))   # [B, Hq, Q, kmax]
        before = (taken.cumsum(-1) - taken).amin(dim=1)                                   # [B, Q, kmax]
        forced_n = forced.sum(-1)[None, :, None]
        keep = keep & ((before < spec.mass) | (torch.arange(kmax, device=dev) < forced_n))
    out = torch.zeros((b, nq, n), dtype=torch.bool, device=dev)
    out.scatter_(-1, top, keep)
    return out & valid


def baseline_scores(spec: SelectSpec, shape: tuple[int, int, int], device: torch.device | str,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """Scores of the comparison selectors (``[B, 1, Q, n]``): ``window`` ranks newer pages higher, ``random`` at
    random."""
    b, nq, n = shape
    if spec.selector == "window":
        return torch.arange(n, dtype=torch.float32, device=device).expand(b, 1, nq, n)
    return torch.rand((b, 1, nq, n), generator=generator, device=device)


# -- the state a cache keeps ------------------------------------------------------------------------------
class SelectionState:
    """What one cache (a runner GPU batch, a ``BladedCache``) keeps to select pages: the page summaries
    (``quest``), the key copy (``keys``) and a version per page (bumped when a page's rows are written, so a
    :class:`ReuseBuffer` never serves a page changed since it was read). Updated from K as it is written
    (:meth:`on_write`) and from K read back that this process never wrote (a reused prefix: :meth:`on_read`,
    "recomputed from K at load")."""

    def __init__(self, spec: SelectSpec, layers: int, max_tokens: int, scale: float,
                 selecting: Iterable[int] | None = None) -> None:
        self.spec = spec
        self.scale = scale
        self.max_tokens = max_tokens
        #: the layers (of this cache's indexing) that select: only they keep a key copy or summaries
        self.selecting = frozenset(range(layers) if selecting is None else selecting)
        self.summaries = PageSummaries(layers, max_tokens, spec.page) if spec.selector == "quest" else None
        self.key_copy = KeyCopy(layers, max_tokens, spec) if spec.selector == "keys" else None
        #: per layer, the tokens [0, known) whose K the selector has
        self.known = [0] * layers
        self.versions = torch.zeros((layers, pages_of(max_tokens, spec.page)), dtype=torch.long)
        self._gen = torch.Generator().manual_seed(spec.seed)
        #: seconds spent scoring and choosing, and keeping summaries up to date
        self.select_s = 0.0
        self.update_s = 0.0

    def on_write(self, layer: int, token_start: int, keys: torch.Tensor) -> None:
        """K of tokens ``[token_start, token_start + n)`` written (tokens-first ``[n, B, H, D]``)."""
        started = time.perf_counter()
        try:
            self._on_write(layer, token_start, keys)
        finally:
            self.update_s += time.perf_counter() - started

    def _on_write(self, layer: int, token_start: int, keys: torch.Tensor) -> None:
        n = keys.shape[0]
        if n == 0:
            return
        p = self.spec.page
        self.versions[layer, token_start // p:pages_of(token_start + n, p)] += 1
        if token_start > self.known[layer]:
            return                               # a gap: those tokens come from on_read later, in order
        if token_start < self.known[layer]:      # a rewrite: what was folded in of its pages is gone
            if self.summaries is not None:
                self.summaries.forget(layer, token_start)
            keep = token_start // p * p
            if keep < token_start:
                self.known[layer] = keep         # the page's earlier tokens must come back by on_read
                return
        self._fold(layer, token_start, keys)

    def on_read(self, layer: int, keys: torch.Tensor) -> None:
        """K of tokens ``[0, n)`` read back (tokens-first): fold in the tokens the selector lacks."""
        start = self.known[layer]
        if keys.shape[0] > start:
            self._fold(layer, start, keys[start:])

    def _fold(self, layer: int, token_start: int, keys: torch.Tensor) -> None:
        if layer not in self.selecting:
            return
        if self.summaries is not None:
            self.summaries.update(layer, token_start, keys)
        if self.key_copy is not None:
            self.key_copy.update(layer, token_start, keys)
        self.known[layer] = max(self.known[layer], token_start + keys.shape[0])

    def ready(self, layer: int, ntokens: int) -> bool:
        """Whether the selector knows the K of tokens ``[0, ntokens)`` of a selecting layer (else the step reads
        them all)."""
        return layer in self.selecting and self.known[layer] >= ntokens

    def select(self, layer: int, q: torch.Tensor, ntokens: int, scale: float | None = None) -> torch.Tensor:
        """The pages of tokens ``[0, ntokens)`` each sequence attends to (``[B, n]`` bool), for one decode
        query ``q`` (``[B, Hq, 1, D]``; ``scale``: of ``q . k``, None: the state's)."""
        spec = self.spec
        started = time.perf_counter()
        scale = self.scale if scale is None else scale
        n = pages_of(ntokens, spec.page)
        pos = torch.tensor([ntokens], device=q.device)
        if spec.selector == "keys":
            assert self.key_copy is not None
            scores = key_scores(q, self.key_copy.keys(layer, ntokens), pos, spec.page, scale)
        elif spec.selector == "quest":
            assert self.summaries is not None
            lo, hi = self.summaries.get(layer, n)
            scores = quest_scores(q, lo, hi, pos, spec.page, scale)
        else:
            scores = baseline_scores(spec, (q.shape[0], 1, n), "cpu", self._gen).to(q.device)
        out = choose_pages(spec, scores, pos)[:, 0]
        self.select_s += time.perf_counter() - started
        return out

    def nbytes(self) -> int:
        """Bytes held for selection: the summaries and the key copy."""
        return (self.summaries.nbytes() if self.summaries is not None else 0) + \
            (self.key_copy.nbytes() if self.key_copy is not None else 0)


def runs_of(pages: torch.Tensor) -> list[tuple[int, int]]:
    """Sorted page ids as runs of consecutive pages: ``[(first, count), ...]`` (one read each)."""
    if pages.numel() == 0:
        return []
    p = pages.tolist()
    starts = [0] + [i for i in range(1, len(p)) if p[i] != p[i - 1] + 1]
    ends = [*starts[1:], len(p)]
    return [(p[s], e - s) for s, e in zip(starts, ends, strict=True)]


class ReuseBuffer:
    """The pages of one KPU a layer read in the previous steps, kept so a step reads only the pages it lacks.

    ``capacity`` pages of ``page`` token rows (``[capacity * page, batch, kv_heads, head_dim]`` of the model's
    dtype on its device). A page is served from the buffer only while its version (:attr:`SelectionState.
    versions`) is the one it was read at: a page written since (the partial last page, at every append) is
    read again. :meth:`plan` says which pages to read and where they go, :meth:`fill` puts them in,
    :meth:`gather` gives the selected pages' rows in page order."""

    def __init__(self, capacity: int, page: int, max_pages: int) -> None:
        self.capacity, self.page = capacity, page
        self.buf: torch.Tensor | None = None
        self.held = torch.full((capacity,), -1, dtype=torch.long)      # page id in each buffer slot
        self.held_version = torch.zeros(capacity, dtype=torch.long)
        self.where = torch.full((max_pages,), -1, dtype=torch.long)    # buffer slot of each page
        self.hits = 0
        self.lookups = 0

    def plan(self, pages: torch.Tensor, versions: torch.Tensor, fresh_from: int | None = None,
             partial_from: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """For the sorted ``pages`` to attend to: the pages to read and the buffer slots they go to. Pages from
        ``fresh_from`` on are read whatever the buffer holds; pages from ``partial_from`` on (not yet whole: the
        rows after the step's tokens are not read) are kept for this step only."""
        at = self.where[pages]
        hit = (at >= 0) & (self.held_version[at.clamp(min=0)] == versions[pages])
        if fresh_from is not None:
            hit &= pages < fresh_from
        miss = pages[~hit]
        # a page read again leaves the slot it was in: else that slot, reused later for another page, would unmap
        # the page from the slot it holds then
        moved = at[~hit]
        self.held[moved[moved >= 0]] = -1
        keep = torch.zeros(self.capacity, dtype=torch.bool)
        keep[at[hit]] = True
        free = (~keep).nonzero().flatten()[:miss.numel()]
        if free.numel() < miss.numel():
            raise ValueError(f"{pages.numel()} pages do not fit a reuse buffer of {self.capacity}")
        old = self.held[free]
        self.where[old[old >= 0]] = -1
        self.held[free] = miss
        kept = versions[miss]
        if partial_from is not None:
            kept = kept.masked_fill(miss >= partial_from, -1)
        self.held_version[free] = kept
        self.where[miss] = free
        self.hits += int(hit.sum())
        self.lookups += pages.numel()
        return miss, free

    def fill(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Put ``rows`` (tokens-first, ``page`` rows per slot of ``slots``, in order) into the buffer."""
        if self.buf is None:
            self.buf = torch.empty((self.capacity * self.page, *rows.shape[1:]), dtype=rows.dtype,
                                   device=rows.device)
        self.buf.index_copy_(0, token_index(slots, self.page).to(rows.device), rows)

    def gather(self, pages: torch.Tensor, out: torch.Tensor) -> None:
        """The rows of ``pages`` (sorted), page after page, into ``out[:len(pages) * page]``."""
        assert self.buf is not None
        idx = token_index(self.where[pages], self.page).to(self.buf.device)
        torch.index_select(self.buf, 0, idx, out=out[:idx.numel()])

    def nbytes(self) -> int:
        return 0 if self.buf is None else self.buf.numel() * self.buf.element_size()


def token_index(pages: torch.Tensor, page: int) -> torch.Tensor:
    """The token ids of ``pages`` (in their order), ``page`` per page."""
    return (pages[:, None] * page + torch.arange(page)[None, :]).flatten()


__all__ = ["HEADS_RULES", "KEY_FORMATS", "SELECTORS", "SYNTAX", "KeyCopy", "PageSummaries", "ReuseBuffer",
           "SelectError", "SelectSpec", "SelectionState", "baseline_scores", "choose_pages", "key_scores",
           "pages_of", "parse_select", "quest_scores", "runs_of", "summarise", "token_index"]
