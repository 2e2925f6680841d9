"""Eq. 7-11 (MDTS chunking): the C engine's math against the Python reference,
and the invariants on the paper's two drives."""

from __future__ import annotations

import itertools

import pytest
from bladed._uring import ffi, lib
from hypothesis import given
from hypothesis import strategies as st

from bladed.io.chunking import chunk_bytes, plan_chunks

SSD_A = (4096, 256 << 10)   # 4 KiB LBA, 256 KiB MDTS
SSD_B = (512, 2 << 20)      # 512 B LBA, 2 MiB MDTS


def c_plan(slba: int, nbytes: int, lba: int, limit: int) -> list[tuple[int, int, int]]:
    cap = 1 << 16
    slbas, nlbs, offs = ffi.new("uint64_t[]", cap), ffi.new("uint32_t[]", cap), ffi.new("uint64_t[]", cap)
    n = lib.bd_chunk_plan(slba, nbytes, lba.bit_length() - 1, limit, slbas, nlbs, offs, cap)
    assert n >= 0
    return [(int(slbas[i]), int(nlbs[i]), int(offs[i])) for i in range(n)]


devices = st.sampled_from([SSD_A, SSD_B])


@given(dev=devices, slba=st.integers(0, 1 << 40), blocks=st.integers(1, 40_000))
def test_engine_chunking_equals_reference(dev: tuple[int, int], slba: int, blocks: int) -> None:
    lba, mdts = dev
    ref = plan_chunks(slba, blocks * lba, lba, mdts)
    assert c_plan(slba, blocks * lba, lba, mdts) == [(c.slba, c.nlb, c.buf_offset) for c in ref]


@given(dev=devices, slba=st.integers(0, 1 << 40), blocks=st.integers(1, 40_000))
def test_chunks_tile_the_request_exactly(dev: tuple[int, int], slba: int, blocks: int) -> None:
    lba, mdts = dev
    chunks = plan_chunks(slba, blocks * lba, lba, mdts)
    max_blocks = chunk_bytes(mdts, lba) // lba
    assert len(chunks) == -(-blocks // max_blocks)                       # Eq. 8
    assert sum(c.blocks for c in chunks) == blocks                        # nothing lost or doubled
    for prev, nxt in itertools.pairwise(chunks):
        assert nxt.slba == prev.slba + prev.blocks                        # Eq. 9: contiguous LBAs
        assert nxt.buf_offset == prev.buf_offset + prev.blocks * lba      # Eq. 11: contiguous dbuf
        assert prev.blocks == max_blocks                                  # only the last may be short
    assert all(0 <= c.nlb < max_blocks for c in chunks)                   # Eq. 10: 0-based nlb
    assert all(c.blocks * lba <= mdts for c in chunks)


@given(limit=st.integers(1, 1 << 24), lba=st.sampled_from([512, 4096]))
def test_chunk_is_largest_lba_multiple_within_limit(limit: int, lba: int) -> None:
    if limit < lba:
        with pytest.raises(ValueError, match="smaller than one"):
            chunk_bytes(limit, lba)
        return
    c = chunk_bytes(limit, lba)                                           # Eq. 7
    assert c % lba == 0 and c <= limit < c + lba


def test_paper_examples() -> None:
    # a 128 MiB prefill write on SSD A: 512 commands of 64 blocks
    a = plan_chunks(2048, 128 << 20, *SSD_A)
    assert len(a) == 512 and a[0].nlb == 63 and a[-1].slba == 2048 + 511 * 64
    # a 256 KiB decode append on SSD B fits one command of 512 blocks
    b = plan_chunks(0, 256 << 10, *SSD_B)
    assert [(c.slba, c.nlb, c.buf_offset) for c in b] == [(0, 511, 0)]


def test_unaligned_request_is_refused() -> None:
    with pytest.raises(ValueError, match="not a multiple"):
        plan_chunks(0, 1000, 512, 4096)
    slbas, nlbs, offs = ffi.new("uint64_t[1]"), ffi.new("uint32_t[1]"), ffi.new("uint64_t[1]")
    assert lib.bd_chunk_plan(0, 1000, 9, 4096, slbas, nlbs, offs, 1) < 0
