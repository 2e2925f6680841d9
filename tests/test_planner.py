"""Geometry (Table II), Algorithm 1 and the Table III modes, rankers, re-planning."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bladed.residency import (
    BudgetLedger,
    Geometry,
    KpuFillRanker,
    KVPath,
    LayerOrderRanker,
    Mode,
    Plan,
    get_ranker,
    plan_session,
    replan,
)
from bladed.sizes import PAGE_SIZE

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

geometries = st.builds(
    Geometry,
    layers=st.integers(1, 48), batch=st.integers(1, 64), kv_heads=st.sampled_from([1, 2, 3, 8, 32, 40]),
    head_dim=st.sampled_from([64, 80, 96, 128]), dtype_bytes=st.sampled_from([1, 2, 4]),
    max_tokens=st.integers(1, 4096),
)
lba_sizes = st.sampled_from([512, 4096])
modes = st.sampled_from(list(Mode))


# -- geometry ---------------------------------------------------------------------------------

@given(batch=st.integers(1, 256))
def test_table2_token_sizes(batch: int) -> None:
    assert Geometry.for_model("opt-1.3b", batch=batch, max_tokens=1).token_bytes == 4 * KiB * batch
    assert Geometry.for_model("opt-6.7b", batch=batch, max_tokens=1).token_bytes == 8 * KiB * batch
    assert Geometry.for_model("OPT-13B", batch=batch, max_tokens=1).token_bytes == 10 * KiB * batch


def test_worked_example_sizes() -> None:
    # OPT-6.7B, B=32, 512 prompt + 32 generated tokens (paper §III-A, §V-A)
    g = Geometry.for_model("opt-6.7b", batch=32, max_tokens=512 + 32)
    assert g.token_bytes == 256 * KiB                  # the 256 KB decode write of Table IV
    assert g.token_bytes * 512 == 128 * MiB            # the 128 MB prefill write
    assert g.kpu_bytes == 136 * MiB                    # the 128-135 MB decode reads end here
    assert g.kv_bytes == 8704 * MiB                    # 8.5 GiB = 9.13 GB for 32 layers
    assert g.shape == (544, 1024, 128)


@pytest.mark.parametrize("field,value,err", [
    ("layers", 0, ValueError), ("batch", -1, ValueError), ("kv_heads", 2.0, TypeError),
    ("head_dim", True, TypeError), ("dtype_bytes", 3, ValueError), ("max_tokens", 0, ValueError),
])
def test_geometry_rejects_bad_fields(field: str, value: object, err: type) -> None:
    args: dict[str, object] = {"layers": 2, "batch": 1, "kv_heads": 1, "head_dim": 64, "dtype_bytes": 2,
                               "max_tokens": 8}
    args[field] = value
    with pytest.raises(err, match=field):
        Geometry(**args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown model"):
        Geometry.for_model("gpt-5", batch=1, max_tokens=1)


# -- Algorithm 1 ---------------------------------------------------------------------------------

@settings(max_examples=300)
@given(g=geometries, lba=lba_sizes, budget=st.integers(0, 64 * GiB), frac=st.floats(0, 1))
def test_algorithm1_layer_order(g: Geometry, lba: int, budget: int, frac: float) -> None:
    x = int(budget * frac)
    p = plan_session(g, Mode.DUALBLADE, budget, lba, group1_limit_bytes=x)
    s_kpu = -(-g.kpu_bytes // PAGE_SIZE) * PAGE_SIZE             # as the page cache holds it
    n1 = min(x // (2 * s_kpu), g.layers)                          # line 1
    assert p.group1_layers == n1 and p.group1_limit_bytes == x
    assert [k.tensor_id for k in p.kpus] == list(range(2 * g.layers))
    for k in p.kpus:                                              # lines 2-4
        assert k.tensor_id == 2 * k.layer + (k.kind == "v")
        assert (k.group == 1) == (k.layer < n1)
        assert k.path is (KVPath.PAGECACHE if k.group == 1 else KVPath.DIRECT)
    assert p.group1_bytes <= x
    assert len(p.group1()) + len(p.group2()) == 2 * g.layers
    assert p.direct_bytes == p.extent_blocks * lba
    assert p.hit_fraction_bound() == pytest.approx(n1 / g.layers)


@settings(max_examples=200)
@given(g=geometries, lba=lba_sizes, budget=st.integers(0, 64 * GiB), mode=modes)
def test_modes_of_table3(g: Geometry, lba: int, budget: int, mode: Mode) -> None:
    p = plan_session(g, mode.value, budget, lba)
    assert p.mode is mode
    by_layer_order = plan_session(g, Mode.DUALBLADE, budget, lba)
    if mode is Mode.BASELINE:
        assert all(k.group == 1 and k.path is KVPath.PAGECACHE and not k.drop_after_use for k in p.kpus)
        assert p.direct_kpus() == () and p.extent_blocks == 0 and p.group1_layers == g.layers
    elif mode is Mode.DIRECT:
        assert p.group1_limit_bytes == 0 and p.group1_layers == 0
        assert all(k.group == 2 and k.path is KVPath.DIRECT for k in p.kpus)
    elif mode is Mode.DUALBLADE:
        assert p.group1_limit_bytes == budget
        assert all(k.path is (KVPath.PAGECACHE if k.group == 1 else KVPath.DIRECT) for k in p.kpus)
    else:  # CachePolicy-Only: same split as Dual-Blade, Group 2 stays on the page cache and is dropped
        assert p.group1_limit_bytes == budget and p.group1_layers == by_layer_order.group1_layers
        assert all(k.path is KVPath.PAGECACHE for k in p.kpus)
        assert all(k.drop_after_use == (k.group == 2) for k in p.kpus)
        assert p.direct_kpus() == () and p.group1_bytes == by_layer_order.group1_bytes
    json.dumps(p.to_dict())


def test_mode_names_and_labels() -> None:
    assert Mode("dualblade") is Mode.DUALBLADE
    for label, mode in (("Dual-Blade", Mode.DUALBLADE), ("NVMe-direct-Only", Mode.DIRECT),
                        ("CachePolicy-Only", Mode.CACHEPOLICY), ("Baseline", Mode.BASELINE)):
        assert Mode.parse(label) is mode
    with pytest.raises(ValueError, match="choose one of"):
        Mode.parse("turbo")


def test_knob_limits() -> None:
    g = Geometry.for_model("opt-1.3b", batch=4, max_tokens=128)
    with pytest.raises(ValueError, match=r"group1_limit_bytes \(X\) must be an int in \[0, budget_bytes="):
        plan_session(g, Mode.DUALBLADE, GiB, 4096, group1_limit_bytes=GiB + 1)
    with pytest.raises(ValueError, match="fixes X"):
        plan_session(g, Mode.DIRECT, GiB, 4096, group1_limit_bytes=0)
    with pytest.raises(ValueError, match="budget"):
        plan_session(g, Mode.DUALBLADE, -1, 4096)
    with pytest.raises(ValueError, match="LBA size"):
        plan_session(g, Mode.DUALBLADE, GiB, 1000)


def test_worked_example_plan() -> None:
    g = Geometry.for_model("opt-6.7b", batch=32, max_tokens=544)
    p = plan_session(g, Mode.DUALBLADE, 4 * GiB, 4096)
    assert p.group1_layers == 15                                    # floor(4096 MiB / 272 MiB)
    assert p.group1_bytes == 30 * 136 * MiB              # 4080 MiB in Group 1
    assert len(p.direct_kpus()) == 34 and p.extent_blocks == 34 * 34816
    assert p.aligned and p.padding_bytes == 0


# -- alignment precondition and padding ----------------------------------------------------------

def test_opt13b_odd_batch_packs_rows_even_batch_is_aligned() -> None:
    odd = plan_session(Geometry.for_model("opt-13b", batch=1, max_tokens=100), Mode.DIRECT, 0, 4096)
    assert not odd.aligned                                            # 10 KiB rows on 4 KiB LBAs
    assert odd.padding_bytes == 0                                     # 100 rows x 10 KiB = 250 whole LBAs
    assert all(k.padded_bytes == k.nbytes == 10 * KiB * 100 for k in odd.kpus)
    even = plan_session(Geometry.for_model("opt-13b", batch=2, max_tokens=100), Mode.DIRECT, 0, 4096)
    assert even.aligned and even.padding_bytes == 0                  # the paper's "pick an even B"
    small_lba = plan_session(Geometry.for_model("opt-13b", batch=1, max_tokens=100), Mode.DIRECT, 0, 512)
    assert small_lba.aligned                                          # 10 KiB is 20 x 512 B


def test_smollm2_rows_are_packed_within_one_lba_of_their_bytes() -> None:
    """768-byte token rows (SmolLM2: 3 KV heads x 64 x fp32) on 4 KiB LBAs: 5.3x padded per row before."""
    g = Geometry(layers=30, batch=1, kv_heads=3, head_dim=64, dtype_bytes=4, max_tokens=301)
    p = plan_session(g, Mode.DIRECT, 0, 4096)
    assert not p.aligned and g.token_bytes == 768
    assert all(k.padded_bytes == 57 * 4096 for k in p.kpus)          # ceil(301 * 768 / 4096) = 57 blocks
    assert p.padding_bytes == 60 * (57 * 4096 - 301 * 768)


@given(g=geometries, lba=lba_sizes)
def test_packed_kpus_take_their_bytes_rounded_up_to_one_lba(g: Geometry, lba: int) -> None:
    p = plan_session(g, Mode.DIRECT, 0, lba)
    assert p.aligned == (g.token_bytes % lba == 0)
    for k in p.kpus:
        assert k.padded_bytes % lba == 0 and 0 <= k.padded_bytes - k.nbytes < lba
    assert p.padding_bytes == sum(k.padded_bytes - k.nbytes for k in p.kpus)
    assert p.extent_blocks * lba == p.direct_bytes
    # page-cache files are never padded: padding only applies on the extent
    dual = plan_session(g, Mode.BASELINE, 0, lba)
    assert dual.padding_bytes == 0


# -- rankers -----------------------------------------------------------------------------------------

@settings(max_examples=200)
@given(g=geometries, budget=st.integers(0, 64 * GiB))
def test_kpu_fill_uses_the_remainder(g: Geometry, budget: int) -> None:
    pair = plan_session(g, Mode.DUALBLADE, budget, 4096)
    fill = plan_session(g, Mode.DUALBLADE, budget, 4096, "kpu-fill")
    s = -(-g.kpu_bytes // PAGE_SIZE) * PAGE_SIZE
    assert len(fill.group1()) == min(budget // s, 2 * g.layers)
    assert fill.group1_bytes <= budget
    assert {k.tensor_id for k in pair.group1()} <= {k.tensor_id for k in fill.group1()}
    if budget % (2 * s) >= s and pair.group1_layers < g.layers:
        # exactly the case it exists for: one more KPU (the next layer's K) resident
        extra = {k.tensor_id for k in fill.group1()} - {k.tensor_id for k in pair.group1()}
        assert extra == {2 * pair.group1_layers}
        assert fill.hit_fraction_bound() > pair.hit_fraction_bound()
    else:
        assert fill.group1() == pair.group1()


def test_worked_example_kpu_fill_gain() -> None:
    # OPT-6.7B, B=32, 544 tokens with B_pc = 2 GiB: Algorithm 1 leaves 144 MiB of the budget idle
    g = Geometry.for_model("opt-6.7b", batch=32, max_tokens=544)
    pair = plan_session(g, Mode.DUALBLADE, 2 * GiB, 4096, LayerOrderRanker())
    fill = plan_session(g, Mode.DUALBLADE, 2 * GiB, 4096, KpuFillRanker())
    assert (pair.group1_layers, len(pair.group1()), pair.group1_bytes) == (7, 14, 1904 * MiB)
    assert (len(fill.group1()), fill.group1_bytes) == (15, 2040 * MiB)
    assert fill.hit_fraction_bound() - pair.hit_fraction_bound() == pytest.approx(1 / 64)


class ReverseRanker:
    """Last layers first (e.g. for a runner that walks layers backwards)."""

    name = "reverse"

    def units(self, geometry: Geometry) -> Sequence[tuple[int, ...]]:
        return [(2 * i, 2 * i + 1) for i in reversed(range(geometry.layers))]


def test_custom_rankers() -> None:
    g = Geometry(layers=4, batch=1, kv_heads=1, head_dim=1024, dtype_bytes=2, max_tokens=512)   # 1 MiB KPUs
    p = plan_session(g, Mode.DUALBLADE, 4 * MiB, 4096, ReverseRanker())
    assert [k.layer for k in p.group1()] == [2, 2, 3, 3] and p.ranker == "reverse" and p.group1_layers == 2

    class Broken:
        name = "broken"

        def units(self, geometry: Geometry) -> Sequence[tuple[int, ...]]:
            return [(0, 1), (1, 2)]

    with pytest.raises(ValueError, match="exactly once"):
        plan_session(g, Mode.DUALBLADE, 4 * MiB, 4096, Broken())
    with pytest.raises(ValueError, match="unknown ranker"):
        get_ranker("best")


# -- re-planning ------------------------------------------------------------------------------------

@settings(max_examples=200)
@given(g=geometries, budget=st.integers(0, 16 * GiB), shrink=st.floats(0, 1.5), mode=modes,
       ranker=st.sampled_from(["layer-order", "kpu-fill"]))
def test_replan_only_demotes_and_fits(g: Geometry, budget: int, shrink: float, mode: Mode, ranker: str) -> None:
    old = plan_session(g, mode, budget, 4096, ranker)
    new_budget = int(budget * shrink)
    r = replan(old, new_budget)
    new = r.new
    old_g1 = {k.tensor_id for k in old.group1()}
    new_g1 = {k.tensor_id for k in new.group1()}
    assert new_g1 <= old_g1                                         # never promoted
    assert {k.tensor_id for k in r.demoted} == old_g1 - new_g1
    if mode in (Mode.BASELINE, Mode.DIRECT):
        assert not r.changed and new is old
    else:
        assert new.group1_bytes <= old.group1_bytes
        if new_budget < old.group1_bytes:
            assert new.group1_bytes <= new_budget
            # and only as much as needed: the ranker's prefix for the new budget stays
            target = plan_session(g, mode, new_budget, 4096, ranker)
            assert new_g1 == {k.tensor_id for k in target.group1()}
        for k in r.demoted:
            assert k.group == 2
            assert k.path is (KVPath.DIRECT if mode is Mode.DUALBLADE else KVPath.PAGECACHE)
            assert k.drop_after_use == (mode is Mode.CACHEPOLICY)
    assert new.kpu(0).tensor_id == 0


def test_replan_move_bytes() -> None:
    g = Geometry.for_model("opt-6.7b", batch=32, max_tokens=544)
    old = plan_session(g, Mode.DUALBLADE, 4 * GiB, 4096)
    r = replan(old, 3 * GiB)
    assert (old.group1_layers, r.new.group1_layers) == (15, 11) and len(r.demoted) == 8
    assert r.move_bytes(520) == 8 * 520 * 256 * KiB      # what is copied at token 520
    assert r.new.extent_blocks == old.extent_blocks + 8 * 34816
    assert old.reserve_blocks == 64 * 34816               # reserve this and demotions always fit
    with pytest.raises(ValueError):
        r.move_bytes(545)
    assert not replan(old, 8 * GiB).changed              # growth is for new sessions


def test_ledger_shares_the_budget_newest_first() -> None:
    g = Geometry(layers=8, batch=1, kv_heads=1, head_dim=1024, dtype_bytes=2, max_tokens=512)   # 1 MiB KPUs
    ledger = BudgetLedger()
    b_pc = 10 * MiB
    a = plan_session(g, Mode.DUALBLADE, ledger.available(b_pc), 4096)
    ledger.admit("a", a)
    assert a.group1_bytes == 10 * MiB and ledger.available(b_pc) == 0
    base = plan_session(g, Mode.BASELINE, ledger.available(b_pc), 4096)
    ledger.admit("base", base)
    b = plan_session(g, Mode.DUALBLADE, ledger.available(b_pc + 8 * MiB), 4096)
    assert b.group1_bytes == 0                           # baseline's 16 MiB page cache counts against it
    ledger.admit("b", b)
    ledger.release("base")
    b_pc = 22 * MiB
    c = plan_session(g, Mode.DUALBLADE, ledger.available(b_pc), 4096)
    ledger.admit("c", c)
    assert c.group1_bytes == 12 * MiB and ledger.held_bytes == 22 * MiB
    # the budget halves: the newest session gives back first
    grants = ledger.shrink(11 * MiB)
    assert grants == {"c": 1 * MiB}
    for sid, grant in grants.items():
        r = replan(c, grant)
        assert r.new.group1_bytes <= grant
        ledger.admit(sid, r.new)
    assert ledger.held_bytes == 10 * MiB
    assert json.loads(json.dumps(ledger.to_dict()))["held_bytes"] == 10 * MiB


def test_a_holder_that_cannot_demote_leaves_the_shrink_to_the_others() -> None:
    """A block pool holds page cache it cannot demote (fixed): a shrink takes its whole excess from the sessions,
    even where the pool is the newest holder, so the memory files that can move do."""
    g = Geometry(layers=8, batch=1, kv_heads=1, head_dim=1024, dtype_bytes=2, max_tokens=512)   # 1 MiB KPUs
    ledger = BudgetLedger()
    a = plan_session(g, Mode.DUALBLADE, 8 * MiB, 4096)
    ledger.admit("a", a)
    pool = plan_session(g, Mode.DUALBLADE, 4 * MiB, 4096)
    ledger.admit("pool", pool, fixed=True)
    assert ledger.held_bytes == 12 * MiB
    assert ledger.shrink(8 * MiB) == {"a": 4 * MiB}      # all 4 MiB of the excess from "a"
    ledger.release("pool")
    ledger.admit("pool", pool)                           # admitted again without fixed: an ordinary holder
    assert ledger.shrink(8 * MiB) == {"pool": 0}


def test_plan_lookup_and_dict() -> None:
    g = Geometry(layers=2, batch=1, kv_heads=2, head_dim=64, dtype_bytes=2, max_tokens=16)
    p: Plan = plan_session(g, Mode.DUALBLADE, 0, 512)
    assert p.kpu(3).name == "v1"
    with pytest.raises(KeyError):
        p.kpu(4)
    d = p.to_dict()
    assert d["group2"] == [0, 1, 2, 3] and d["mode"] == "dualblade" and d["geometry"]["token_bytes"] == 256
