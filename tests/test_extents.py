"""The LBA region allocator, the extent map (Eq. 3-6) and Algorithm 2, including
real I/O through the engine on a store file (TRIM on teardown, token appends)."""

from __future__ import annotations

import itertools
import os
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from bladed.io import Engine, StagingBuffer
from bladed.io.file import FileDevice
from bladed.residency import (
    Extent,
    ExtentAllocator,
    ExtentMap,
    Geometry,
    IndexOutOfRangeError,
    MisalignedRequestError,
    Mode,
    RegionFullError,
    TranslationError,
    plan_session,
    replan,
)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


# -- the allocator ----------------------------------------------------------------------------

class AllocatorMachine(RuleBasedStateMachine):
    """Any sequence of session opens and closes keeps the region consistent and leak-free."""

    extents = Bundle("extents")

    def __init__(self) -> None:
        super().__init__()
        self.alloc = ExtentAllocator(2048, 1000)
        self.live: dict[int, Extent] = {}

    @rule(target=extents, n=st.integers(1, 400), owner=st.integers(0, 10**6))
    def open_session(self, n: int, owner: int) -> Extent | None:
        largest = self.alloc.largest_free
        try:
            ext = self.alloc.allocate(n, owner)
        except RegionFullError as e:
            assert n > largest and e.largest_free == largest and e.requested == n
            return None
        assert n <= largest and ext.nblocks == n and ext.owner == owner
        assert ext.start >= 2048 and ext.end <= 3048
        for other in self.live.values():                       # disjoint from every live extent
            assert ext.end <= other.start or other.end <= ext.start
        self.live[ext.start] = ext
        return ext

    @rule(target=extents, start=st.integers(2000, 3100), n=st.integers(1, 200))
    def reserve_range(self, start: int, n: int) -> Extent | None:
        """Start-up quarantine: exactly this range, only if every block of it is free."""
        free = start >= 2048 and start + n <= 3048 and all(
            start + n <= e.start or e.end <= start for e in self.live.values())
        try:
            ext = self.alloc.reserve(start, n, "quarantined")
        except ValueError:
            assert not free
            return None
        assert free and (ext.start, ext.nblocks) == (start, n)
        self.live[ext.start] = ext
        return ext

    @rule(ext=consumes(extents))
    def close_session(self, ext: Extent | None) -> None:
        if ext is None:
            return
        self.alloc.free(ext)
        del self.live[ext.start]

    @invariant()
    def consistent(self) -> None:
        self.alloc.check()          # runs tile the region, free neighbours merged
        assert self.alloc.used_blocks == sum(e.nblocks for e in self.live.values())
        assert self.alloc.used_blocks + self.alloc.free_blocks == 1000
        assert self.alloc.extents == sorted(self.live.values(), key=lambda e: e.start)

    def teardown(self) -> None:
        for ext in list(self.live.values()):
            self.alloc.free(ext)
        # no fragmentation leak: the whole region is one free run again
        assert self.alloc.free_runs == [(2048, 1000)]


TestAllocator = AllocatorMachine.TestCase
TestAllocator.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_region_full_errors_say_why() -> None:
    a = ExtentAllocator(0, 100, lba_size=4096)
    x = a.allocate(40, "s1")
    a.allocate(20, "s2")
    z = a.allocate(40, "s3")
    with pytest.raises(RegionFullError, match="only 0 of 100 blocks are free"):
        a.allocate(1)
    a.free(x)
    a.free(z)
    with pytest.raises(RegionFullError, match="80 blocks are free but the largest contiguous run is 40") as exc:
        a.allocate(41)
    assert exc.value.free_blocks == 80 and exc.value.largest_free == 40
    with pytest.raises(ValueError, match="double free"):
        a.free(x)
    with pytest.raises(ValueError):
        a.allocate(0)
    with pytest.raises(RegionFullError, match=r"0\.2 MiB"):
        a.allocate(50)


def test_best_fit_keeps_room_for_large_sessions() -> None:
    a = ExtentAllocator(0, 100)
    s1, s2, s3 = a.allocate(10), a.allocate(50), a.allocate(10)
    a.free(s1)                      # hole of 10 at 0
    a.free(s3)                      # tail of 40 at 60 (merged with the free end)
    assert a.free_runs == [(0, 10), (60, 40)]
    assert a.allocate(8).start == 0             # the small hole, not the big tail
    assert a.allocate(40).start == 60
    a.free(s2)


def test_grow_in_place() -> None:
    a = ExtentAllocator(0, 100)
    e = a.allocate(30, "s")
    e2 = a.grow(e, 20)
    assert (e2.start, e2.nblocks) == (0, 50) and a.free_runs == [(50, 50)]
    b = a.allocate(50)
    with pytest.raises(RegionFullError):
        a.grow(e2, 1)
    a.free(b)
    a.free(e2)
    assert a.free_runs == [(0, 100)]


def test_trim_on_free_and_trim_failures() -> None:
    a = ExtentAllocator(2048, 1 << 20)
    e = a.allocate(4096, "s")
    trimmed: list[tuple[int, int]] = []
    a.free(e, trim=lambda s, n: trimmed.append((s, n)))
    assert trimmed == [(2048, 4096)]

    def broken(s: int, n: int) -> None:
        raise OSError(5, "I/O error")

    e = a.allocate(10)
    a.free(e, trim=broken)               # logged and counted, the blocks are not leaked
    assert a.trim_failures == 1 and a.free_blocks == 1 << 20


# -- the extent map (Eq. 3-6) -------------------------------------------------------------------

geometries = st.builds(
    Geometry, layers=st.integers(1, 16), batch=st.integers(1, 8), kv_heads=st.sampled_from([1, 3, 8, 40]),
    head_dim=st.sampled_from([64, 128]), dtype_bytes=st.sampled_from([2, 4]), max_tokens=st.integers(1, 300))


@settings(max_examples=200)
@given(g=geometries, lba=st.sampled_from([512, 4096]), frac=st.floats(0, 1), start=st.integers(0, 10**9))
def test_map_invariants(g: Geometry, lba: int, frac: float, start: int) -> None:
    plan = plan_session(g, Mode.DUALBLADE, int(g.kv_bytes * frac), lba)
    ext = Extent(start, plan.extent_blocks, "s")
    m = ExtentMap(plan, ext)
    m.check()
    direct = plan.direct_kpus()
    assert list(m) == [k.tensor_id for k in direct]
    pos = start                                        # only the first lba_start is configured
    for k in direct:
        s, n = m.lookup(k.tensor_id)
        assert s == pos                                # Eq. 6: contiguity
        assert n * lba == k.padded_bytes               # Eq. 5: alignment
        assert m.extent_of(k.tensor_id) == (s, s + n)  # Eq. 4
        pos += n
    assert pos == ext.end == m.end_lba                 # one extent, fully used
    spans = sorted(m.lookup(t) for t in m)
    assert all(a[0] + a[1] <= b[0] for a, b in itertools.pairwise(spans))   # disjointness


def test_paper_example_starts_at_lba_2048() -> None:
    g = Geometry.for_model("opt-6.7b", batch=32, max_tokens=544)
    plan = plan_session(g, Mode.DIRECT, 0, 4096)
    alloc = ExtentAllocator(2048, 64 * 34816 + 100)
    m = ExtentMap(plan, alloc.allocate(plan.extent_blocks, "s1"))
    assert m.lookup(0) == (2048, 34816)               # K of layer 1: 136 MiB = 34816 blocks
    assert m.lookup(1) == (2048 + 34816, 34816)       # V of layer 1 right after it
    assert m.lookup(2) == (2048 + 2 * 34816, 34816)
    assert m.end_lba == 2048 + 64 * 34816
    assert m.materialized == frozenset({0, 1, 2})      # bound at creation, materialized on first access


def test_map_rejects_small_extents_and_unknown_tensors() -> None:
    g = Geometry(layers=2, batch=1, kv_heads=1, head_dim=64, dtype_bytes=2, max_tokens=64)
    plan = plan_session(g, Mode.DIRECT, 0, 512)
    with pytest.raises(ValueError, match="need"):
        ExtentMap(plan, Extent(0, plan.extent_blocks - 1))
    with pytest.raises(ValueError, match="no extent"):
        ExtentMap(plan, None)
    dual = plan_session(g, Mode.BASELINE, 0, 512)
    m = ExtentMap(dual, None)                          # nothing on the direct path: no extent needed
    with pytest.raises(KeyError, match="not on this session's NVMe-direct path"):
        m.lookup(0)


def test_demotion_appends_after_the_last_tensor() -> None:
    g = Geometry(layers=4, batch=1, kv_heads=2, head_dim=1024, dtype_bytes=2, max_tokens=512)   # 2 MiB KPUs
    plan = plan_session(g, Mode.DUALBLADE, 8 * MiB, 4096)                 # layers 0-1 in Group 1
    alloc = ExtentAllocator(2048, 10_000)
    ext = alloc.allocate(plan.reserve_blocks, "s")                        # room for every KPU
    m = ExtentMap(plan, ext)
    assert list(m) == [4, 5, 6, 7] and m.end_lba == 2048 + 4 * 512
    r = replan(plan, 4 * MiB)
    assert [k.tensor_id for k in r.demoted] == [2, 3]
    for k in r.demoted:
        m.add(k)
    assert m.lookup(2) == (2048 + 4 * 512, 512) and m.lookup(3) == (2048 + 5 * 512, 512)
    m.check()
    with pytest.raises(ValueError, match="already bound"):
        m.add(r.new.kpu(2))
    tight = ExtentMap(plan, alloc.allocate(plan.extent_blocks, "t"))
    with pytest.raises(ValueError, match="does not fit"):
        tight.add(r.demoted[0])


@settings(max_examples=200)
@given(g=geometries, lba=st.sampled_from([512, 4096]), frac=st.floats(0, 1), start=st.integers(1, 10**6),
       moved_to=st.integers(0, 10**6), data=st.data())
def test_demotions_bind_inside_the_extent_they_are_given(g: Geometry, lba: int, frac: float, start: int,
                                                         moved_to: int, data: st.DataObject) -> None:
    """Whatever the session opened with (an extent or none), every KPU a demotion binds lies inside the
    extent the map was last given (place: allocated, grown in place; relocate: moved), back to back."""
    plan = plan_session(g, Mode.DUALBLADE, int(g.kv_bytes * frac), lba)
    opened = Extent(start, plan.extent_blocks, "s") if plan.extent_blocks else None
    m = ExtentMap(plan, opened)
    r = replan(plan, 0)
    for k in r.demoted:
        if m.blocks_short(k.padded_bytes // lba):
            ext = m.extent
            extra = m.blocks_short(k.padded_bytes // lba) + data.draw(st.integers(0, 3))
            if ext is None:
                m.place(Extent(start, extra, "s"))
            elif data.draw(st.booleans()):
                m.place(Extent(ext.start, ext.nblocks + extra, "s"))          # grown in place
            else:
                with pytest.raises(ValueError, match="does not continue"):
                    m.place(Extent(ext.start + 1, ext.nblocks + extra, "s"))
                m.relocate(Extent(moved_to, ext.nblocks + extra, "s"))        # moved to a larger run
        m.add(k)
        m.check()
        final = m.extent
        assert final is not None
        for t in m:
            s0, n = m.lookup(t)
            assert final.start <= s0 and s0 + n <= final.end, (t, s0, n, final)
    assert len(m) == len(plan.kpus)
    held = m.extent
    assert m.release() == held and m.extent is None


# -- Algorithm 2 -------------------------------------------------------------------------------------

@pytest.fixture
def opt67() -> ExtentMap:
    g = Geometry.for_model("opt-6.7b", batch=32, max_tokens=544)
    plan = plan_session(g, Mode.DIRECT, 0, 4096)
    return ExtentMap(plan, Extent(2048, plan.extent_blocks, "s"))


def paper_alg2(lba_start: int, shape_tgt: tuple[int, int, int], idx: tuple[int, int, int],
               shape_src: tuple[int, int, int], e: int, lba: int) -> tuple[int, int]:
    """Algorithm 2 exactly as printed (lines 3-6)."""
    _, d1, d2 = shape_tgt
    i0, j0, k0 = idx
    f0, f1, f2 = shape_src
    offset_elem = (i0 * d1 + j0) * d2 + k0
    return lba_start + offset_elem * e // lba, f0 * f1 * f2 * e


def test_prefill_and_decode_requests(opt67: ExtentMap) -> None:
    shape = (544, 1024, 128)
    v5 = 2 * 5 + 1
    base = 2048 + v5 * 34816
    # prefill: the whole 512-token prompt in one request
    assert opt67.translate(v5, shape, (0, 0, 0), (512, 1024, 128), 2) == (base, 128 * MiB)
    # decode: one token appended at position 512, 513, ...
    assert opt67.translate(v5, shape, (512, 0, 0), (1, 1024, 128), 2) == (base + 512 * 64, 256 * KiB)
    assert opt67.translate(v5, shape, (543, 0, 0), (1, 1024, 128), 2) == (base + 543 * 64, 256 * KiB)
    # decode read of the first 513 tokens
    assert opt67.translate(v5, shape, (0, 0, 0), (513, 1024, 128), 2) == (base, 513 * 256 * KiB)


def test_offsets_inside_a_tensor(opt67: ExtentMap) -> None:
    shape = (544, 1024, 128)
    # token 3, from head-row 16 on (batch 0, heads 16..31): one 4 KiB block per 16 rows
    slba, req = opt67.translate(0, shape, (3, 16, 0), (1, 16, 128), 2)
    assert (slba, req) == paper_alg2(2048, shape, (3, 16, 0), (1, 16, 128), 2, 4096)
    assert (slba, req) == (2048 + 3 * 64 + 1, 4096)
    # the second half of one token row
    assert opt67.translate(0, shape, (7, 512, 0), (1, 512, 128), 2) == (2048 + 7 * 64 + 32, 128 * KiB)


@settings(max_examples=300)
@given(i0=st.integers(0, 543), j0=st.integers(0, 1023), f=st.integers(1, 64))
def test_matches_the_printed_algorithm_when_aligned(i0: int, j0: int, f: int) -> None:
    g = Geometry.for_model("opt-6.7b", batch=32, max_tokens=544)
    plan = plan_session(g, Mode.DIRECT, 0, 4096)
    m = ExtentMap(plan, Extent(2048, plan.extent_blocks))
    shape = (544, 1024, 128)
    j0 -= j0 % 16                                      # 16 rows x 128 x 2 bytes = one block
    f1 = min(16 * f, 1024 - j0)
    f1 -= f1 % 16
    if f1 == 0:
        return
    got = m.translate(2, shape, (i0, j0, 0), (1, f1, 128), 2)
    assert got == paper_alg2(2048 + 2 * 34816, shape, (i0, j0, 0), (1, f1, 128), 2, 4096)


def test_rejects_bad_indices(opt67: ExtentMap) -> None:
    shape = (544, 1024, 128)
    with pytest.raises(IndexOutOfRangeError):
        opt67.translate(0, shape, (544, 0, 0), (1, 1024, 128), 2)        # past the last token
    with pytest.raises(IndexOutOfRangeError):
        opt67.translate(0, shape, (540, 0, 0), (5, 1024, 128), 2)        # box runs past the end
    with pytest.raises(IndexOutOfRangeError):
        opt67.translate(0, shape, (-1, 0, 0), (1, 1024, 128), 2)
    with pytest.raises(IndexError):                                      # also an IndexError
        opt67.translate(0, shape, (0, 1024, 0), (1, 1, 128), 2)
    with pytest.raises(MisalignedRequestError):
        opt67.translate(0, shape, (0, 1, 0), (1, 16, 128), 2)            # starts inside a block
    with pytest.raises(MisalignedRequestError):
        opt67.translate(0, shape, (0, 0, 0), (1, 3, 128), 2)             # ends inside a block
    with pytest.raises(TranslationError, match="contiguous"):
        opt67.translate(0, shape, (0, 0, 0), (2, 512, 128), 2)           # two half rows: strided
    with pytest.raises(TranslationError, match="holds"):
        opt67.translate(0, (544, 1024, 64), (0, 0, 0), (1, 1024, 64), 2)  # not this tensor's shape
    with pytest.raises(TranslationError, match="three ints"):
        opt67.translate(0, shape, (0, 0), (1, 1024, 128), 2)
    with pytest.raises(KeyError):
        opt67.translate(64, shape, (0, 0, 0), (1, 1024, 128), 2)


def test_packed_rows_for_opt13b_odd_batch() -> None:
    g = Geometry.for_model("opt-13b", batch=1, max_tokens=100)       # 10 KiB rows on a 4 KiB LBA
    plan = plan_session(g, Mode.DIRECT, 0, 4096)
    m = ExtentMap(plan, Extent(2048, plan.extent_blocks))
    shape = (100, 40, 128)
    assert m.lookup(0) == (2048, 250)                                # 100 rows packed: 1000 KiB
    assert m.lookup(1) == (2048 + 250, 250)
    # Algorithm 2 maps what is whole LBAs: two rows from an even token
    assert m.translate(1, shape, (6, 0, 0), (2, 40, 128), 2) == (2048 + 250 + 15, 20 * KiB)
    with pytest.raises(MisalignedRequestError):                      # one row from token 7: edges inside LBAs
        m.translate(1, shape, (7, 0, 0), (1, 40, 128), 2)


# -- real I/O through the engine ----------------------------------------------------------------

def test_token_appends_land_where_reads_find_them(store_dir: str) -> None:
    g = Geometry(layers=2, batch=2, kv_heads=4, head_dim=128, dtype_bytes=2, max_tokens=64)   # 2 KiB rows
    plan = plan_session(g, Mode.DIRECT, 0, 512)
    alloc = ExtentAllocator(2048, 4096)
    dev = FileDevice(os.path.join(store_dir, "kv.img"), (2048 + 4096) * 512, lba_size=512)
    m = ExtentMap(plan, alloc.allocate(plan.extent_blocks, "s"))
    rows = (g.batch * g.kv_heads, g.head_dim)
    buf = StagingBuffer(g.kpu_bytes)
    rng = random.Random(7)
    truth = {t: np.frombuffer(rng.randbytes(g.kpu_bytes), np.uint8) for t in m}
    view = np.frombuffer(buf.view(), np.uint8)
    with Engine(dev, 8, [buf]) as eng:
        for t in m:                                                  # prefill 40 tokens
            view[:40 * g.token_bytes] = truth[t][:40 * g.token_bytes]
            slba, req = m.translate(t, g.shape, (0, 0, 0), (40, *rows), 2)
            eng.write(slba, buf, nbytes=req)
        for tok in range(40, 64):                                    # decode appends, interleaved tensors
            for t in m:
                view[:g.token_bytes] = truth[t][tok * g.token_bytes:(tok + 1) * g.token_bytes]
                slba, req = m.translate(t, g.shape, (tok, 0, 0), (1, *rows), 2)
                eng.write(slba, buf, nbytes=req)
        for t in m:
            view[:] = 0
            slba, req = m.translate(t, g.shape, (0, 0, 0), (64, *rows), 2)
            eng.read(slba, buf, nbytes=req)
            assert np.array_equal(view, truth[t])
        # teardown: TRIM the session's extent through the engine, then reuse reads zeroes
        ext = alloc.extents[0]
        alloc.free(ext, trim=eng.discard)
        assert alloc.free_runs == [(2048, 4096)] and alloc.trim_failures == 0
        eng.read(ext.start, buf, nbytes=g.kpu_bytes)
        assert not view.any()
    buf.close()
    dev.close()
