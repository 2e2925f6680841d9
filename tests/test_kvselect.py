"""bladed.kvselect: the selection finds the pages that hold the attention, always keeps the sinks and the window,
never lets the reuse buffer serve a stale page, and refuses bad options with one line (docs/kv-select.md)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bladed.kvselect import (
    SelectError,
    SelectionState,
    SelectSpec,
    choose_pages,
    key_scores,
    pages_of,
    parse_select,
    quest_scores,
    runs_of,
    summarise,
)
from bladed.kvstore import MemoryKV, kv_geometry
from bladed.slots import PageReader, SlotTensors

B, H, G, D = 1, 2, 2, 32          # batch, KV heads, query heads per KV head, head_dim
PAGE = 16


def constructed(ntokens: int, hot: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A query and tokens-first keys where the pages ``hot`` hold the keys most aligned with the query (and
    every other key is small noise): the true top pages are ``hot``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H * G, 1, D, generator=g)
    keys = 0.05 * torch.randn(ntokens, B, H, D, generator=g)
    for head in range(H):
        direction = q[0, head * G:(head + 1) * G, 0].mean(0)
        for p in hot:
            keys[p * PAGE:(p + 1) * PAGE, 0, head] += 3 * direction / direction.norm()
    return q, keys


@pytest.mark.parametrize("selector", ["keys", "quest"])
@pytest.mark.parametrize("heads", ["max", "sum"])
def test_the_selection_finds_the_true_top_pages_on_constructed_keys(selector: str, heads: str) -> None:
    ntokens, hot = 40 * PAGE + 5, [4, 11, 23, 30]
    q, keys = constructed(ntokens, hot)
    spec = parse_select(f"{selector}:{(len(hot) + 3) / pages_of(ntokens, PAGE)},heads={heads}")
    state = SelectionState(spec, layers=1, max_tokens=ntokens + 1, scale=D ** -0.5)
    state.on_write(0, 0, keys)
    chosen = state.select(0, q, ntokens)[0].nonzero().flatten().tolist()
    n = pages_of(ntokens, PAGE)
    assert chosen == sorted([0, *hot, n - 2, n - 1])        # the sink, the hot pages, the window of 2


def test_the_sinks_and_the_window_are_always_read() -> None:
    g = torch.Generator().manual_seed(3)
    for selector in ("keys", "quest", "window", "random"):
        for sinks, window in ((1, 2), (3, 1), (0, 4)):
            spec = parse_select(f"{selector}:0.1,sinks={sinks},window={window},seed=5")
            positions = torch.arange(300, 700, 37)
            q = torch.randn(2, H * G, len(positions), D, generator=g)
            keys = torch.randn(700, 2, H, D, generator=g)
            if selector == "keys":
                scores = key_scores(q, keys, positions, PAGE, 1.0)
            elif selector == "quest":
                lo, hi = summarise(keys, PAGE)
                scores = quest_scores(q, lo, hi, positions, PAGE, 1.0)
            else:
                scores = torch.rand(2, 1, len(positions), pages_of(700, PAGE), generator=g)
            mask = choose_pages(spec, scores, positions)
            for i, pos in enumerate(positions.tolist()):
                n = pages_of(pos, PAGE)
                want = set(range(sinks)) | set(range(n - window, n))
                for b in range(2):
                    got = set(mask[b, i].nonzero().flatten().tolist())
                    assert want <= got, (selector, sinks, window, pos)
                    assert max(got) < n                                     # never a page of the future
                    assert len(got) == spec.pages_read(n)


def test_the_budget_counts_pages_with_the_sinks_and_window_and_a_whole_budget_is_dense() -> None:
    spec = parse_select("keys:0.25")
    assert [spec.pages_read(n) for n in (1, 3, 8, 12, 13, 100)] == [1, 3, 3, 3, 4, 25]
    assert not spec.is_dense(100 * PAGE) and spec.is_dense(3 * PAGE)
    assert parse_select("keys:1").is_dense(10_000)
    tokens = parse_select("quest:100t")
    assert tokens.pages_read(64) == 7 and tokens.tokens == 100
    assert parse_select("keys:0.5,page=32,window=1,sinks=0,dense-layers=0,heads=sum,keys=q8,reuse=off") == \
        SelectSpec(selector="keys", fraction=0.5, page=32, window=1, sinks=0, dense_layers=0, heads="sum",
                   keys="q8", reuse=False)
    spec = parse_select("keys:0.25,mass=0.9")
    assert parse_select(spec.describe()) == spec


def test_mass_coverage_stops_once_every_head_holds_it() -> None:
    # two heads, 8 candidate pages (no sinks, one window page, 7 chosen), masses by construction
    head0 = torch.tensor([0.0, 0.5, 0.3, 0.1, 0.05, 0.03, 0.02, 0.0])
    head1 = torch.tensor([0.0, 0.1, 0.1, 0.6, 0.1, 0.05, 0.05, 0.0])
    scores = torch.stack([head0, head1])[None, :, None, :]                  # [B, Hq, Q, n]
    spec = parse_select("keys:1,sinks=0,window=1,mass=0.85")
    chosen = choose_pages(spec, scores, torch.tensor([8 * PAGE]))[0, 0].nonzero().flatten().tolist()
    assert chosen == [1, 2, 3, 4, 7]       # ranked by max: 3, 1, 2, 4 bring both heads to 0.9 and 0.85


@pytest.mark.parametrize("text, message", [
    ("keys:1.5", "--kv-select: fraction 1.5 is outside (0, 1]; accepted (0, 1], e.g. keys:0.25"),
    ("keys:0", "--kv-select: fraction 0 is outside (0, 1]; accepted (0, 1], e.g. keys:0.25"),
    ("keys:x", "--kv-select: budget 'x' is not a number; accepted a fraction in (0, 1] or Nt (a token count, N >= 1)"),
    ("keys:0.2,page=0", "--kv-select: page='0' is not an integer >= 1; accepted 1 or more"),
    ("keys:0.2,page=1.5", "--kv-select: page='1.5' is not an integer >= 1; accepted 1 or more"),
    ("keys:0.2,window=0", "--kv-select: window='0' is not an integer >= 1; accepted 1 or more"),
    ("keys:0.2,sinks=-1", "--kv-select: sinks='-1' is not an integer >= 0; accepted 0 or more"),
    ("keys:0.2,heads=vote", "--kv-select: heads='vote'; accepted: max, sum"),
    ("keys:0.2,mass=0", "--kv-select: mass='0' is outside (0, 1]; accepted (0, 1], e.g. mass=0.9"),
    ("keys:0.2,depth=3", "--kv-select: unknown option 'depth'; accepted: sinks, window, page, dense-layers, heads, "
                         "keys, mass, reuse, seed"),
    ("keys", "--kv-select: 'keys' has no budget; give keys:FRACTION with FRACTION in (0, 1] (e.g. keys:0.25) or "
             "keys:Nt for N tokens"),
])
def test_a_bad_option_is_one_line_naming_it_and_the_accepted_range(text: str, message: str) -> None:
    with pytest.raises(SelectError) as e:
        parse_select(text)
    assert str(e.value) == message


def test_a_window_longer_than_the_context_or_too_many_dense_layers_is_refused() -> None:
    spec = parse_select("keys:0.25,window=20", "select=")
    with pytest.raises(SelectError, match=r"^select=: window=20 pages of 16 tokens exceed the context of 300 tokens; "
                                          r"accepted window=1\.\.18$"):
        spec.check_context(300, 4, "select=")
    with pytest.raises(SelectError, match=r"^--kv-select: dense-layers=5 is more than the model's 4 layers; "
                                          r"accepted 0\.\.4$"):
        parse_select("keys:0.25,dense-layers=5").check_layers(4)


@pytest.mark.parametrize("selector", ["keys", "quest"])
def test_what_appends_fold_in_equals_what_reading_the_keys_back_gives(selector: str) -> None:
    """A reused prefix's K is summarised from what is read back: the same summaries and key copy as appending."""
    g = torch.Generator().manual_seed(7)
    keys = torch.randn(203, B, H, D, generator=g)
    spec = parse_select(f"{selector}:0.25")
    appended = SelectionState(spec, 1, 256, 1.0)
    appended.on_write(0, 0, keys[:37])
    for t in range(37, 203):
        appended.on_write(0, t, keys[t:t + 1])
    read = SelectionState(spec, 1, 256, 1.0)
    read.on_read(0, keys)
    assert read.known == appended.known == [203]
    if selector == "keys":
        assert read.key_copy is not None and appended.key_copy is not None
        assert torch.equal(read.key_copy.keys(0, 203), appended.key_copy.keys(0, 203))
    else:
        assert read.summaries is not None and appended.summaries is not None
        for a, b in zip(read.summaries.get(0, 13), appended.summaries.get(0, 13), strict=True):
            assert torch.equal(a, b)
    q = torch.randn(B, H * G, 1, D, generator=g)
    assert torch.equal(read.select(0, q, 203), appended.select(0, q, 203))


def test_runs_of_consecutive_pages() -> None:
    assert runs_of(torch.tensor([0, 1, 2, 5, 7, 8])) == [(0, 3), (5, 1), (7, 2)]
    assert runs_of(torch.tensor([], dtype=torch.long)) == []


def test_the_reuse_buffer_never_serves_a_stale_page() -> None:
    """Pages read in one step are served from the buffer in the next only while their rows are unchanged: the
    page an append went to, a page rewritten, and rows of the staging slot that another layer's read overwrote
    in between are all read again; what the reader gives is always what the store holds."""
    geometry = kv_geometry(layers=2, batch=B, kv_heads=H, head_dim=D, max_tokens=200, dtype=torch.float32)
    backend = MemoryKV(geometry)
    slots = SlotTensors(backend, torch.float32)
    spec = parse_select("keys:0.5")
    state = SelectionState(spec, 2, 200, 1.0)
    reader = PageReader(backend, slots, state)
    g = torch.Generator().manual_seed(11)
    truth = torch.zeros(200, B, H, D)

    def write(layer: int, start: int, n: int) -> None:
        rows = torch.randn(n, B, H, D, generator=g)
        if layer == 0:
            truth[start:start + n] = rows
            state.on_write(0, start, rows)
        slots.put(0, start, rows.permute(1, 2, 0, 3))
        backend.write(layer, "k", 0, start, n)

    def check(pages: list[int], ntokens: int) -> int:
        sel = torch.tensor(pages)
        _, read = reader.read(0, "k", 0, sel, ntokens)
        got = reader.take(0, "k", 0, sel, ntokens)
        want = torch.cat([truth[p * PAGE:min((p + 1) * PAGE, ntokens)] for p in pages])
        assert torch.equal(got.permute(2, 0, 1, 3), want)
        return read

    write(0, 0, 70)                           # pages 0-3 whole, page 4 holds tokens 64..69
    write(1, 0, 70)
    assert check([0, 2, 4], 70) == 3          # nothing in the buffer yet
    assert check([0, 2, 4], 70) == 1          # the partial page 4 is read again, pages 0 and 2 are served
    write(0, 70, 1)                           # an append to page 4
    backend.read(1, "k", 0, 0, 71)            # another layer's read overwrites the staging slot's rows
    assert check([0, 1, 4], 71) == 2          # page 1 is new, page 4 changed
    write(0, 32, 16)                          # page 2 rewritten while out of the selection
    assert check([0, 2, 4], 71) == 2
    assert check([2, 3], 71) == 1
    hits, lookups = reader.reuse()
    assert (hits, lookups) == (5, 14)


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.lists(st.integers(0, 11), min_size=1, max_size=6), st.booleans()),
                      min_size=1, max_size=40))
def test_the_reuse_buffer_gives_the_stores_rows_over_many_steps(steps: list[tuple[list[int], bool]]) -> None:
    """Any run of steps (selections of up to 6 of 12 pages, a one-token append after some): what the reader gives
    is what the store holds. Found by a 64-token decode: a partial page read again each step left its old buffer
    slot mapped to it, and reusing that slot unmapped the page from the slot it had moved to."""
    max_tokens = 12 * PAGE + 40
    geometry = kv_geometry(layers=1, batch=B, kv_heads=H, head_dim=D, max_tokens=max_tokens, dtype=torch.float32)
    backend = MemoryKV(geometry)
    slots = SlotTensors(backend, torch.float32)
    state = SelectionState(parse_select("keys:0.5"), 1, max_tokens, 1.0)
    reader = PageReader(backend, slots, state)
    g = torch.Generator().manual_seed(5)
    truth = torch.randn(max_tokens, B, H, D, generator=g)
    ntokens = 12 * PAGE - 3                   # the last page partial
    slots.put(0, 0, truth[:ntokens].permute(1, 2, 0, 3))
    backend.write(0, "k", 0, 0, ntokens)
    state.on_write(0, 0, truth[:ntokens])
    for chosen, append in steps:
        pages = torch.tensor(sorted(set(chosen)))
        reader.read(0, "k", 0, pages, ntokens)
        got = reader.take(0, "k", 0, pages, ntokens)
        want = torch.cat([truth[p * PAGE:min((p + 1) * PAGE, ntokens)] for p in pages.tolist()])
        assert torch.equal(got.permute(2, 0, 1, 3), want)
        if append and ntokens < max_tokens:
            slots.put(0, ntokens, truth[ntokens:ntokens + 1].permute(1, 2, 0, 3))
            backend.write(0, "k", 0, ntokens, 1)
            state.on_write(0, ntokens, truth[ntokens:ntokens + 1])
            ntokens += 1


def test_the_page_summaries_are_min_and_max_per_page() -> None:
    keys = torch.arange(40.0).reshape(40, 1, 1, 1).repeat(1, 1, 1, 2)
    lo, hi = summarise(keys, PAGE)
    assert lo[:, 0, 0, 0].tolist() == [0, 16, 32] and hi[:, 0, 0, 0].tolist() == [15, 31, 39]
    assert math.isclose(float(lo.numel() + hi.numel()) / keys.numel(), 2 * 3 / 40)
