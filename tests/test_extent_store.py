"""The extent store's packed layout, against a real O_DIRECT file: every byte lands where reads find it.

Token rows that are not whole LBAs are stored back to back; the store
completes the edge LBAs of each range (from the KPU's tail copy, from zeroes
past the fill mark, or by reading the LBA back).  A model of the KPUs as plain
byte arrays is the oracle for any sequence of appends, overwrites and reads,
with mirrored or shifted slot offsets and several ranges per request (one KPU's among them, its tokens
apart: a sparse read's runs, or a write beside them, which share edge LBAs), on a
session's store (which keeps an append's last, partly filled LBA in memory
until it is full: issue 39, no write amplification of bladed's own) and on a
retained prefix's (which writes everything at once).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bladed.io import Engine, Op, StagingBuffer
from bladed.io.file import FileDevice
from bladed.protocol import IOOp
from bladed.residency import ExtentAllocator, Geometry, Mode, plan_session
from bladed.server.storage import Access, ExtentKPUStore

# on both engines, io_uring and the portable one (issue 29)
pytestmark = pytest.mark.usefixtures("io_engine")


@dataclass
class Chan:
    index: int
    engine: Engine
    slot: StagingBuffer


class CountingEngine:
    """An engine that counts the bytes it is asked to write (what the device is made to write)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.written = 0

    def transfer(self, op: Op, slba: int, buf: StagingBuffer, **kw: int) -> object:
        x = self.engine.transfer(op, slba, buf, **kw)
        if op is Op.WRITE:
            self.written += x.nbytes
        return x

    def write(self, slba: int, buf: StagingBuffer, **kw: int) -> object:
        self.written += kw["nbytes"]
        return self.engine.write(slba, buf, **kw)

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield str(tmp_path_factory.mktemp("extent-store"))


class Harness:
    """One session's extent store on a file device, plus the byte-array model of its KPUs."""

    def __init__(self, directory: str, g: Geometry, lba: int, defer: bool = False) -> None:
        self.g, self.lba = g, lba
        self.plan = plan_session(g, Mode.DIRECT, 0, lba)
        self.alloc = ExtentAllocator(64, (self.plan.extent_blocks + 64) * 2)
        self.dev = FileDevice(os.path.join(directory, f"kv-{lba}-{random.getrandbits(32):x}.img"),
                              (self.alloc.start_lba + self.alloc.nblocks) * lba, lba_size=lba)
        self.extent = self.alloc.allocate(self.plan.extent_blocks, "s")
        self.store = ExtentKPUStore(self.plan, self.extent, 1, defer_tail=defer)
        # one region per KPU, so the ranges of one request never share slot bytes (the daemon refuses that)
        self.region = -(-g.kpu_bytes // 4096) * 4096
        self.slot = StagingBuffer(2 * g.layers * self.region)
        self.ch = Chan(0, CountingEngine(Engine(self.dev, 8, [self.slot])), self.slot)  # type: ignore[arg-type]
        self.model = {k.tensor_id: np.zeros(g.kpu_bytes, np.uint8) for k in self.plan.kpus}
        self.rng = np.random.default_rng(1)

    def access(self, op: IOOp, tid: int, t0: int, n: int, shift: int | None = None) -> Access:
        """Tokens [t0, t0 + n) of tensor ``tid``; in the slot mirrored inside the tensor's region, or at
        ``shift`` bytes into the region (any alignment: such ranges go through the bounce buffer)."""
        tb = self.g.token_bytes
        so = tid * self.region + (t0 * tb if shift is None else min(shift, self.region - n * tb))
        return Access(op, self.plan.kpu(tid), t0, n, t0 * tb, n * tb, so)

    def run(self, accesses: list[Access]) -> None:
        slot = np.frombuffer(self.slot.view(), np.uint8)
        for a in accesses:
            if a.write:
                data = self.rng.integers(0, 256, a.nbytes, np.uint8)
                slot[a.slot_offset:a.slot_offset + a.nbytes] = data
                self.model[a.kpu.tensor_id][a.offset:a.offset + a.nbytes] = data
            else:
                slot[a.slot_offset:a.slot_offset + a.nbytes] = 0xEE   # must be overwritten
        self.store.run(self.ch, accesses)
        for a in accesses:
            assert a.result.ok, a.result.message
            if not a.write:
                got = slot[a.slot_offset:a.slot_offset + a.nbytes]
                want = self.model[a.kpu.tensor_id][a.offset:a.offset + a.nbytes]
                assert np.array_equal(got, want), f"{a.kpu.name} tokens {a.token_start}+{a.ntokens}"

    def device_bytes(self, tid: int) -> np.ndarray:
        start, n = self.store.map.lookup(tid)
        with StagingBuffer(n * self.lba) as buf:
            self.ch.engine.read(start, buf, nbytes=n * self.lba)
            return np.frombuffer(buf.view(), np.uint8).copy()

    def check_device(self) -> None:
        """The extent holds exactly the model's bytes, and zeroes past each KPU's bytes; but a tail LBA kept in
        memory (a session's deferred append), which the copy holds instead."""
        L = self.lba
        for tid, want in self.model.items():
            got = self.device_bytes(tid)
            tail = self.store._tails[tid]
            if tail.dirty:
                lo, hi = tail.block * L, min((tail.block + 1) * L, want.size)
                assert np.array_equal(np.frombuffer(tail.data, np.uint8)[:hi - lo], want[lo:hi])
                got[lo:lo + L] = np.frombuffer(tail.data, np.uint8)
            assert np.array_equal(got[:want.size], want)
            assert not got[want.size:].any()

    def close(self) -> None:
        self.ch.engine.close()
        self.slot.close()
        self.store.close()
        self.dev.close()
        os.unlink(self.dev.path)


ROWS = [768, 256, 1000, 4096 + 512, 8192]


@pytest.mark.parametrize("defer", [True, False], ids=["session", "prefix"])
@pytest.mark.parametrize("lba", [512, 4096])
@pytest.mark.parametrize("row", ROWS)
def test_prefill_then_appends_then_reads(store_dir: str, lba: int, row: int, defer: bool) -> None:
    """The runner's pattern: a prefill, one-token appends of every KPU, whole-KPU reads."""
    g = Geometry(layers=2, batch=1, kv_heads=1, head_dim=row // 4, dtype_bytes=4, max_tokens=37)
    h = Harness(store_dir, g, lba, defer)
    try:
        h.run([h.access(IOOp.WRITE, t, 0, 20) for t in range(4)])
        for tok in range(20, 37):
            h.run([h.access(IOOp.WRITE, t, tok, 1) for t in range(4)])
            h.run([h.access(IOOp.READ, t, 0, tok + 1) for t in range(4)])
        h.check_device()
        if row % lba:
            assert h.store.rmw_reads == 0, "appends must not read back"
            assert h.store.tail_hits > 0
    finally:
        h.close()


def test_smollm2_rows_take_a_lba_more_than_their_bytes_at_most(store_dir: str) -> None:
    g = Geometry(layers=30, batch=1, kv_heads=3, head_dim=64, dtype_bytes=4, max_tokens=301)
    h = Harness(store_dir, g, 4096)
    try:
        assert h.extent.nblocks == 60 * 57                  # ceil(301 * 768 / 4096) blocks per KPU
        assert h.extent.nblocks * 4096 <= 1.01 * 60 * g.kpu_bytes + 60 * 4096
    finally:
        h.close()


ops = st.lists(st.tuples(st.sampled_from(["write", "read"]), st.integers(0, 3), st.integers(0, 30),
                         st.integers(1, 12), st.booleans()), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(lba=st.sampled_from([512, 4096]), row=st.sampled_from(ROWS), steps=ops, seed=st.integers(0, 2**16),
       defer=st.booleans())
def test_any_sequence_of_ranges_reads_back_what_was_written(store_dir: str, lba: int, row: int,
                                                            steps: list[tuple[str, int, int, int, bool]],
                                                            seed: int, defer: bool) -> None:
    g = Geometry(layers=2, batch=1, kv_heads=1, head_dim=row // 4, dtype_bytes=4, max_tokens=40)
    h = Harness(store_dir, g, lba, defer)
    rnd = random.Random(seed)
    try:
        # a request may name a KPU again with its tokens apart (protocol 6), mirrored in the slot (a shifted
        # range could overlap the other's slot bytes, which the daemon refuses)
        batch: list = []
        spans: dict[int, list[tuple[int, int, bool]]] = {}
        for op, tid, t0, n, shifted in steps:
            n = min(n, g.max_tokens - t0)
            shift = rnd.randrange(0, h.region) if shifted else None
            mine = spans.get(tid, [])
            if mine and (shifted or any(sh or (t0 < e and s < t0 + n) for s, e, sh in mine)):
                h.run(batch)
                batch, spans, mine = [], {}, []
            batch.append(h.access(IOOp.WRITE if op == "write" else IOOp.READ, tid, t0, n, shift))
            spans[tid] = [*mine, (t0, t0 + n, shifted)]
        if batch:
            h.run(batch)
        h.run([h.access(IOOp.READ, t, 0, g.max_tokens) for t in range(4)])
        h.check_device()
    finally:
        h.close()


@pytest.mark.parametrize("row", [768, 4096 + 512])
def test_a_session_writes_each_lba_of_its_appends_once(store_dir: str, row: int) -> None:
    """Issue 39's "no write amplification of our own": a prefill and one-token appends of rows smaller than (or
    not a multiple of) the LBA make the device write no more than the KV's bytes (each LBA once, when full; the
    last, partly filled one never); a retained prefix's store, which writes at once, writes each LBA again at
    every append into it."""
    g = Geometry(layers=2, batch=1, kv_heads=1, head_dim=row // 4, dtype_bytes=4, max_tokens=120)
    written = {}
    for defer in (True, False):
        h = Harness(store_dir, g, 4096, defer)
        try:
            h.run([h.access(IOOp.WRITE, t, 0, 10) for t in range(4)])
            for tok in range(10, 120):
                h.run([h.access(IOOp.WRITE, t, tok, 1) for t in range(4)])
                if tok % 17 == 0:
                    h.run([h.access(IOOp.READ, t, 0, tok + 1) for t in range(4)])
            h.run([h.access(IOOp.READ, t, 0, g.max_tokens) for t in range(4)])
            h.check_device()
            written[defer] = h.ch.engine.written
        finally:
            h.close()
    kv = 4 * g.kpu_bytes
    assert written[True] <= 1.02 * kv
    assert written[False] > 1.2 * kv


def test_a_gap_past_a_deferred_tail_writes_that_tail_first(store_dir: str) -> None:
    """An append that starts past the LBA its KPU's deferred tail is in (tokens skipped) sends that LBA to the
    device before the copy moves on, so no byte kept only in memory is lost."""
    g = Geometry(layers=1, batch=1, kv_heads=1, head_dim=192, dtype_bytes=4, max_tokens=40)   # 768-byte rows
    h = Harness(store_dir, g, 4096, defer=True)
    try:
        h.run([h.access(IOOp.WRITE, 0, 0, 3)])          # bytes [0, 2304): LBA 0 kept in memory
        assert h.store._tails[0].dirty and h.store._tails[0].block == 0
        h.run([h.access(IOOp.WRITE, 0, 12, 2)])         # bytes [9216, 10752): LBA 2; LBA 0 must go first
        h.run([h.access(IOOp.READ, 0, 0, 14)])
        h.check_device()
        got = h.device_bytes(0)
        assert np.array_equal(got[:2304], h.model[0][:2304])   # on the device now, not only in memory
    finally:
        h.close()


def test_a_failed_write_is_reported_and_the_next_one_reads_back(store_dir: str) -> None:
    """A write the device refuses fails that range alone; the tail copy is dropped, later writes complete it."""
    g = Geometry(layers=1, batch=1, kv_heads=1, head_dim=192, dtype_bytes=4, max_tokens=16)   # 768-byte rows
    h = Harness(store_dir, g, 4096)
    try:
        h.run([h.access(IOOp.WRITE, 0, 0, 3)])
        h.dev.close()                                  # the device goes away under the store
        bad = h.access(IOOp.WRITE, 0, 3, 1)
        h.store.run(h.ch, [bad])
        assert not bad.result.ok and "direct write of k0" in bad.result.message
    finally:
        h.ch.engine.close()
        h.slot.close()
        h.store.close()
        os.unlink(h.dev.path)


@pytest.mark.parametrize("defer", [True, False], ids=["session", "prefix"])
def test_two_writes_of_one_kpu_that_share_an_lba_in_one_request_both_land(store_dir: str, defer: bool) -> None:
    """A request naming one KPU twice, its tokens apart (protocol 6), with rows that are not whole LBAs: the two
    ranges share an edge LBA, and neither write may undo the other (they run one after the other)."""
    g = Geometry(layers=1, batch=1, kv_heads=1, head_dim=192, dtype_bytes=4, max_tokens=40)   # 768-byte rows
    h = Harness(store_dir, g, 4096, defer)
    try:
        h.run([h.access(IOOp.WRITE, 0, 0, 8)])
        h.run([h.access(IOOp.WRITE, 0, 8, 3), h.access(IOOp.WRITE, 0, 11, 4), h.access(IOOp.READ, 0, 0, 8),
               h.access(IOOp.WRITE, 1, 0, 15)])
        h.run([h.access(IOOp.READ, 0, 0, 15), h.access(IOOp.READ, 1, 0, 15)])
        h.run([h.access(IOOp.READ, 0, 0, 5), h.access(IOOp.READ, 0, 5, 6), h.access(IOOp.READ, 0, 12, 3)])
        h.check_device()
    finally:
        h.close()
