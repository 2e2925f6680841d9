"""Eq. 7-11 (MDTS chunking): the one implementation (the C engine's
``bd_chunk_cap``/``bd_chunk_at``, wrapped by ``bladed.io.chunking``) against
the paper's closed forms, its limits at the edges of the 64-bit space, and the
invariants on the paper's two drives."""

from __future__ import annotations

import errno
import itertools

import pytest
from bladed._uring import lib
from hypothesis import given
from hypothesis import strategies as st

from bladed.io.chunking import Chunk, chunk_bytes, chunk_cap, command_chunk, plan_chunks, planning_target
from bladed.io.errors import AlignmentError, InvalidRequestError, TargetRangeError
from bladed.io.uring import Op

SSD_A = (4096, 256 << 10)   # 4 KiB LBA, 256 KiB MDTS
SSD_B = (512, 2 << 20)      # 512 B LBA, 2 MiB MDTS
U64 = 1 << 64


def eq_7_to_11(slba: int, req_bytes: int, lba: int, mdts: int) -> list[Chunk]:
    """The paper's equations written out, as the oracle."""
    chunk = mdts // lba * lba                                  # Eq. 7
    max_blocks = chunk // lba                                  # Eq. 8, n_maxBlocks
    n_chunks = -(-req_bytes // chunk)                          # Eq. 8
    remains = req_bytes // lba
    out = []
    for i in range(n_chunks):                                  # N = i + 1
        blocks = min(max_blocks, remains)
        out.append(Chunk(slba=slba + i * max_blocks, nlb=blocks - 1, buf_offset=i * chunk))   # Eq. 9-11
        remains -= blocks
    return out


devices = st.sampled_from([SSD_A, SSD_B])
kinds = st.sampled_from([lib.BD_KIND_FILE, lib.BD_KIND_BLOCK, lib.BD_KIND_NVME])


@given(dev=devices, kind=kinds, slba=st.integers(0, 1 << 40), blocks=st.integers(1, 40_000))
def test_engine_chunking_follows_eq_7_to_11(dev: tuple[int, int], kind: int, slba: int, blocks: int) -> None:
    lba, mdts = dev
    assert plan_chunks(slba, blocks * lba, lba, mdts, kind=kind) == eq_7_to_11(slba, blocks * lba, lba, mdts)
    _, count = command_chunk(planning_target(lba, mdts, kind), Op.READ, slba, blocks * lba)
    assert count == -(-blocks * lba // chunk_bytes(mdts, lba))                  # Eq. 8 without walking


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
        with pytest.raises(InvalidRequestError, match=f"max_chunk_bytes={limit} is smaller than one {lba}-byte"):
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
    with pytest.raises(AlignmentError, match="length 1000 is not a multiple of the 512-byte LBA"):
        plan_chunks(0, 1000, 512, 4096)


# ---------------------------------------------------------------- edges ---

def test_request_of_2_64_minus_4096_bytes_counts_without_wrapping() -> None:
    """(nbytes + chunk - 1) / chunk would wrap to 0 chunks here."""
    nbytes = U64 - 4096
    t = planning_target(4096, 1 << 20, lib.BD_KIND_NVME)
    first, count = command_chunk(t, Op.READ, 0, nbytes)
    assert count == 1 << 44                                     # ceil((2^64 - 4096) / 2^20)
    assert first == Chunk(slba=0, nlb=255, buf_offset=0)
    last, _ = command_chunk(t, Op.READ, 0, nbytes, offset=(count - 1) << 20)
    assert last == Chunk(slba=(count - 1) * 256, nlb=254, buf_offset=(count - 1) << 20)   # one block short
    # a file or block device takes a byte offset (loff_t): the same request does not fit 63 bits
    with pytest.raises(TargetRangeError, match=f"of {nbytes} bytes.*ends past 63-bit byte offsets") as e:
        command_chunk(planning_target(4096, 1 << 20, lib.BD_KIND_FILE), Op.READ, 0, nbytes)
    assert e.value.errno == errno.EOVERFLOW


def test_slba_near_2_64_is_refused_not_wrapped() -> None:
    t = planning_target(4096, 1 << 20, lib.BD_KIND_NVME)
    assert command_chunk(t, Op.READ, U64 - 2, 4096)[0].slba == U64 - 2        # the last block that fits
    for slba, nbytes in ((U64 - 1, 4096), (U64 - 1, 8192), (U64 - 256, 2 << 20)):
        with pytest.raises(TargetRangeError, match=f"from LBA {slba} ends past the 64-bit LBA space") as e:
            command_chunk(t, Op.WRITE, slba, nbytes)
        assert e.value.errno == errno.EOVERFLOW
    f = planning_target(4096, 1 << 20, lib.BD_KIND_FILE)
    last = (2**63 - 1) >> 12                                   # (slba + blocks) * 4096 must stay below 2^63
    assert command_chunk(f, Op.READ, last - 1, 4096)[0].slba == last - 1
    with pytest.raises(TargetRangeError, match=f"slba \\+ LBAs must be at most {last}\\)"):
        command_chunk(f, Op.READ, last, 4096)


@pytest.mark.parametrize("shift", [0, 8, 17, 63, 64, 65, 200, 2**31, 2**32 - 1])
def test_absurd_lba_shift_is_refused(shift: int) -> None:
    t = planning_target(4096, 1 << 20, lib.BD_KIND_NVME)
    t.lba_shift = shift
    assert lib.bd_chunk_cap(t, Op.READ) == 0
    for op in Op:
        with pytest.raises(InvalidRequestError, match=f"lba_shift {shift} is outside 9..16") as e:
            command_chunk(t, op, 0, 4096)
        assert e.value.errno == errno.EINVAL


def test_zero_command_limit_is_refused_for_reads_and_writes_only() -> None:
    t = planning_target(4096, 0, lib.BD_KIND_NVME)
    for op in (Op.READ, Op.WRITE):
        with pytest.raises(InvalidRequestError, match="max_chunk_bytes=0 is smaller than one 4096-byte LBA"):
            chunk_cap(t, op)
    assert chunk_cap(t, Op.DISCARD) > 0 and chunk_cap(t, Op.WRITE_ZEROES) > 0   # they carry no payload


def test_bad_offsets_and_ops_are_refused() -> None:
    t = planning_target(4096, 1 << 20)
    for offset in (1, 4096 * 3, U64 - 4096):
        with pytest.raises(InvalidRequestError, match=f"chunk offset {offset} is not an LBA multiple below 12288"):
            command_chunk(t, Op.READ, 0, 12288, offset)
    with pytest.raises(InvalidRequestError, match="op 7 is not read"):
        command_chunk(t, 7, 0, 4096)  # type: ignore[arg-type]
    t.kind = 9
    with pytest.raises(InvalidRequestError, match="target kind 9 is not file"):
        chunk_cap(t)


def test_nvme_commands_never_exceed_the_16_bit_nlb() -> None:
    """An MDTS above 65536 blocks (here 64 MiB of 512-byte LBAs) must not
    reach CDW12: Read, Write and Write Zeroes are cut at 65536 blocks."""
    lba, mdts, n = 512, 64 << 20, 200_000
    for op in (Op.READ, Op.WRITE, Op.WRITE_ZEROES):
        chunks = plan_chunks(0, n * lba, lba, mdts, kind=lib.BD_KIND_NVME, op=op)
        assert [c.nlb for c in chunks] == [65535, 65535, 65535, n - 3 * 65536 - 1]
    assert chunk_bytes(mdts, lba, kind=lib.BD_KIND_NVME) == 65536 * lba
    # the same limit on a file or block device is one command: the kernel splits bios itself
    assert len(plan_chunks(0, n * lba, lba, mdts)) == 2
    # DSM ranges carry a 32-bit, 1-based NLB: 2^32 blocks take two ranges
    dsm = plan_chunks(0, (1 << 32) * lba, lba, mdts, kind=lib.BD_KIND_NVME, op=Op.DISCARD)
    assert [(c.slba, c.blocks) for c in dsm] == [(0, 2**32 - 1), (2**32 - 1, 1)]


def test_file_and_block_reads_stay_within_max_rw_count() -> None:
    """The kernel moves at most MAX_RW_COUNT (2 GiB - 4 KiB) per read/write
    and cqe->res is an int: a larger command would come back short."""
    assert chunk_bytes(2**32 - 1, 4096) == 2**31 - 4096 == lib.BD_RW_MAX_BYTES
    assert chunk_bytes(2**32 - 1, 65536) == 2**31 - 65536
    assert chunk_bytes(2**40, 4096, kind=lib.BD_KIND_NVME) == 65536 * 4096   # NVMe: the NLB cap instead
