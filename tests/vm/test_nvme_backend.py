"""The NVMe-direct backend against a real NVMe controller (QEMU's, inside the VM).

Everything here goes through the kernel's passthrough path for real:
io_uring ``IORING_OP_URING_CMD`` on ``/dev/ng0n1``, Identify ioctls, DSM
deallocate and Write Zeroes, NVMe completion statuses.  The host's
``tests/test_nvme_vm.py`` runs this module in several device configurations
(LBA size, MDTS); the expectations below are derived from the configuration
the VM was booted with (``vm_config``) and from the kernel's own limits in
``/sys/block/nvme0n1/queue``, never hard-coded to one configuration.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import itertools
import mmap
import random
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bladed._uring import ffi
from nvmevm import GENERIC_NODES, NG_PATH, NS_NAME, VMConfig

from bladed.io import (
    BladedIOError,
    Engine,
    NVMeStatusError,
    Op,
    StagingBuffer,
    TargetRangeError,
    Transfer,
    features,
    open_device,
)
from bladed.io.chunking import chunk_bytes, plan_chunks
from bladed.io.nvme import NvmeDevice, identify
from bladed.io.uring import HugePages

pytestmark = pytest.mark.nvme_vm

PAGE = 4096
MiB = 1 << 20
NVME_IOCTL_ADMIN_CMD = 0xC0484E41
NVME_WZ_MAX_BLOCKS = 65536          # Write Zeroes NLB is a 16-bit, 0-based field

# --------------------------------------------------------------------------- helpers


def pattern(nbytes: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def put(buf: StagingBuffer, data: bytes, offset: int = 0) -> None:
    buf.view(offset, len(data))[:] = data


def get(buf: StagingBuffer, nbytes: int, offset: int = 0) -> bytes:
    return bytes(buf.view(offset, nbytes))


def poison(buf: StagingBuffer, nbytes: int, offset: int = 0) -> None:
    """Fill with a byte no test writes, so a read that moved nothing shows."""
    buf.view(offset, nbytes)[:] = b"\xee" * nbytes


def queue_limits(dev: NvmeDevice) -> dict[str, int]:
    assert dev.sysfs_block, f"no /sys/block/{NS_NAME} for {NG_PATH}"
    q = Path(dev.sysfs_block) / "queue"
    names = ("max_hw_sectors_kb", "max_segments", "logical_block_size", "discard_max_hw_bytes")
    return {n: int((q / n).read_text()) for n in names}


def single_command(eng: Engine, op: Op, slba: int, nbytes: int, address: int, keep: Any) -> Transfer:
    """Issue ``nbytes`` as ONE NVMe command, whatever the device's Eq. 7 limit says."""
    target = eng.device.make_target()
    target.max_chunk_bytes = nbytes
    x = Transfer(target, op, slba, nbytes, address, (keep, target))
    eng.ring.run([x])
    assert x.chunks == 1
    return x


class ScatteredPages:
    """``npages`` virtually contiguous 4-KiB pages of which no two are
    physically adjacent, so a command over them needs one DMA segment per page
    (the worst case for an ordinary-page staging buffer).

    Built by faulting pages in, reading their frame numbers from
    /proc/self/pagemap (root), and moving them with mremap into a fresh range
    in descending frame order: a page is then never followed by its physical
    successor, whatever order the page allocator handed them out in.
    """

    MAP_PRIVATE = 0x02
    MAP_ANONYMOUS = 0x20
    MREMAP_MAYMOVE = 1
    MREMAP_FIXED = 2
    PROT_RW = 0x1 | 0x2

    def __init__(self, npages: int) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.mremap.restype = ctypes.c_void_p
        libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                                ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._libc = libc
        self.npages = npages
        self.nbytes = npages * PAGE
        self.address = 0
        self._build()
        assert self.physical_runs() == npages, f"could not lay out {npages} physically scattered pages"
        self.array = (ctypes.c_char * self.nbytes).from_address(self.address)
        self.buffer = StagingBuffer.wrap(self.array)

    def _mmap(self, nbytes: int) -> int:
        addr = self._libc.mmap(None, nbytes, self.PROT_RW, self.MAP_PRIVATE | self.MAP_ANONYMOUS, -1, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        self._libc.madvise(addr, nbytes, mmap.MADV_NOHUGEPAGE)
        return int(addr)

    def _build(self) -> None:
        src = self._mmap(self.nbytes)
        ctypes.memset(src, 0x5A, self.nbytes)      # fault every page in
        frames = self._frames(src, self.npages)
        dst = self._mmap(self.nbytes)
        order = sorted(range(self.npages), key=lambda k: -frames[k])
        for k, page in enumerate(order):
            moved = self._libc.mremap(src + page * PAGE, PAGE, PAGE,
                                      self.MREMAP_MAYMOVE | self.MREMAP_FIXED, dst + k * PAGE)
            if moved != dst + k * PAGE:
                raise OSError(ctypes.get_errno(), "mremap")
        self._libc.munmap(src, self.nbytes)        # nothing is left there; drops the range
        self.address = dst

    @staticmethod
    def _frames(address: int, npages: int) -> list[int]:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(address // PAGE * 8)
            entries = struct.unpack(f"<{npages}Q", f.read(8 * npages))
        assert all(e >> 63 for e in entries), "pages not present"
        pfns = [e & ((1 << 55) - 1) for e in entries]
        assert all(pfns), "pagemap hides PFNs (needs CAP_SYS_ADMIN)"
        return pfns

    def pfns(self) -> list[int]:
        return self._frames(self.address, self.npages)

    def physical_runs(self) -> int:
        """Physically contiguous runs of pages: the DMA segments a command over all of them needs."""
        p = self.pfns()
        return 1 + sum(1 for a, b in itertools.pairwise(p) if b != a + 1)

    def close(self) -> None:
        if self.address:
            self.buffer = None  # type: ignore[assignment]
            self.array = None   # type: ignore[assignment]
            self._libc.munmap(self.address, self.nbytes)
            self.address = 0


@pytest.fixture
def scattered() -> Iterator[Any]:
    made: list[ScatteredPages] = []

    def make(npages: int) -> ScatteredPages:
        sp = ScatteredPages(npages)
        made.append(sp)
        return sp

    yield make
    for sp in made:
        sp.close()


@pytest.fixture
def bufs() -> Iterator[tuple[StagingBuffer, StagingBuffer]]:
    """A write buffer and a read buffer, 8 MiB each (THP-backed where possible)."""
    w, r = StagingBuffer(8 * MiB), StagingBuffer(8 * MiB)
    yield w, r
    w.close()
    r.close()


@pytest.fixture
def hugetlb() -> Iterator[None]:
    """Reserve a few 2 MiB hugetlb pages in the guest for the test, then give them back."""
    vm = Path("/proc/sys/vm")
    knob = vm / "nr_hugepages"
    before = int(knob.read_text())
    # after a few tests the guest's free memory is fragmented: make 2 MiB runs first
    (vm / "drop_caches").write_text("3\n")
    (vm / "compact_memory").write_text("1\n")
    knob.write_text(f"{before + 6}\n")
    got = int(knob.read_text())
    if got < before + 6:
        knob.write_text(f"{before}\n")
        pytest.fail(f"the guest reserved only {got - before} of 6 hugetlb pages")
    yield
    knob.write_text(f"{before}\n")


# --------------------------------------------------------------------------- identify


def test_identify_reports_the_vm_namespace(nvme_dev: NvmeDevice, vm_config: VMConfig) -> None:
    ident = nvme_dev.identity
    assert nvme_dev.nsid == ident.nsid == 1
    assert nvme_dev.lba_size == vm_config.lba_size
    assert ident.lba_formats[ident.current_format] == (vm_config.lba_size, 0)
    assert ident.mdts == vm_config.mdts
    assert ident.mdts_bytes == vm_config.mdts_bytes
    assert ident.dlfeat & 0x7 == 1, "QEMU with discard=unmap reports DLFEAT=001 (deallocated reads zeroes)"
    assert nvme_dev.zeroes_after_discard
    if vm_config.ns_bytes is not None:
        assert nvme_dev.capacity_bytes == vm_config.ns_bytes
    assert nvme_dev.capacity_blocks == ident.nsze
    assert ident.serial == "nvmevm0" and ident.model
    assert queue_limits(nvme_dev)["logical_block_size"] == vm_config.lba_size


# --------------------------------------------------------------------------- limits (Eq. 7, the 512 KiB lesson)


def test_transfer_limits_follow_mdts_max_hw_sectors_and_max_segments(
        nvme_dev: NvmeDevice, vm_config: VMConfig) -> None:
    q = queue_limits(nvme_dev)
    max_hw = q["max_hw_sectors_kb"] * 1024
    segments = q["max_segments"]
    assert max_hw == vm_config.mdts_bytes, "the kernel's max_hw_sectors_kb follows MDTS"
    device_cap = min(vm_config.mdts_bytes, max_hw)
    # an ordinary-page buffer that is not page aligned touches one page more than its length
    assert nvme_dev.max_transfer_bytes == min(device_cap, (segments - 1) * PAGE)
    assert nvme_dev.max_transfer_bytes_huge == device_cap
    if device_cap >= 512 * 1024 and segments <= 128:
        # the 512 KiB lesson: MDTS and max_hw_sectors allow 512 KiB, 4 KiB pages in <= 128 segments do not
        assert nvme_dev.max_transfer_bytes < 512 * 1024
    with Engine(nvme_dev, queue_depth=4) as eng:
        assert eng.max_chunk_bytes == chunk_bytes(nvme_dev.max_transfer_bytes, nvme_dev.lba_size)


def test_kernel_refuses_one_lba_over_max_hw_sectors(nvme_dev: NvmeDevice, bufs: Any) -> None:
    """Passthrough commands are never split: the cap must be applied by bladed."""
    w, _ = bufs
    max_hw = queue_limits(nvme_dev)["max_hw_sectors_kb"] * 1024
    with Engine(nvme_dev, queue_depth=2) as eng:
        x = single_command(eng, Op.READ, 0, max_hw + nvme_dev.lba_size, w.address, w)
        err = x.error()
        assert isinstance(err, BladedIOError) and err.errno == errno.EINVAL, err


def test_ordinary_pages_command_limit_is_max_segments(nvme_dev: NvmeDevice, scattered: Any) -> None:
    """From physically scattered 4 KiB pages the kernel takes a command over at
    most ``max_segments`` pages (and ``max_hw_sectors``), one page more is
    EINVAL: with 127 segments (kernel 6.1, MDTS >= 7) a 512 KiB command is
    refused although MDTS allows it."""
    q = queue_limits(nvme_dev)
    max_pages = min(q["max_segments"], q["max_hw_sectors_kb"] * 1024 // PAGE)
    sp = scattered(max_pages + 1)
    with Engine(nvme_dev, queue_depth=2) as eng:
        ok = single_command(eng, Op.READ, 0, max_pages * PAGE, sp.address, sp.buffer)
        assert ok.ok, ok.error()
        refused = single_command(eng, Op.READ, 0, (max_pages + 1) * PAGE, sp.address, sp.buffer)
        err = refused.error()
        assert isinstance(err, BladedIOError) and err.errno == errno.EINVAL, err


def test_device_limit_is_safe_for_any_ordinary_page_buffer(nvme_dev: NvmeDevice, scattered: Any) -> None:
    """A command of exactly ``max_transfer_bytes`` works from scattered pages at
    every LBA-aligned start within a page (the worst case spans one page more)."""
    lba, limit = nvme_dev.lba_size, nvme_dev.max_transfer_bytes
    sp = scattered(limit // PAGE + 1)
    data = pattern(limit, seed=7)
    with Engine(nvme_dev, queue_depth=4) as eng:
        for start in sorted({0, lba, PAGE - lba}):
            put(sp.buffer, data, start)
            x = eng.write(100, sp.buffer, offset=start, nbytes=limit)
            assert x.chunks == 1
            poison(sp.buffer, limit, start)
            x = eng.read(100, sp.buffer, offset=start, nbytes=limit)
            assert x.chunks == 1
            assert get(sp.buffer, limit, start) == data, f"data differs for a buffer starting at +{start}"


def test_hugetlb_buffers_use_the_full_device_limit(nvme_dev: NvmeDevice, hugetlb: None,
                                                   fixed_partial_commands_ok: bool,
                                                   request: pytest.FixtureRequest) -> None:
    """2 MiB pages need no segment per 4 KiB: commands reach MDTS / max_hw_sectors."""
    with StagingBuffer(4 * MiB) as w, StagingBuffer(4 * MiB) as r:
        assert w.huge is HugePages.HUGETLB and r.huge is HugePages.HUGETLB
        lba = nvme_dev.lba_size
        with Engine(nvme_dev, queue_depth=8, buffers=[w, r]) as eng:
            assert eng.registered is fixed_partial_commands_ok
            assert eng.max_chunk_bytes_huge == chunk_bytes(nvme_dev.max_transfer_bytes_huge, lba)
            n = 4 * MiB - lba
            data = pattern(n, seed=11)
            put(w, data)
            x = eng.write(2048, w, nbytes=n)
            expected = len(plan_chunks(2048, n, lba, nvme_dev.max_transfer_bytes_huge))
            assert x.chunks == expected and x.registered == eng.registered
            poison(r, n)
            assert eng.read(2048, r, nbytes=n).chunks == expected
            assert get(r, n) == data


def test_engine_with_hugetlb_buffers_still_moves_ordinary_pages(
        nvme_dev: NvmeDevice, hugetlb: None, scattered: Any) -> None:
    """A transfer from memory outside the engine's (huge-page) buffers must be
    cut to the ordinary-page limit, not to the huge-page one."""
    with StagingBuffer(2 * MiB) as huge, Engine(nvme_dev, queue_depth=4, buffers=[huge]) as eng:
        assert huge.huge is HugePages.HUGETLB
        n = eng.max_chunk_bytes_huge          # larger than the ordinary limit unless MDTS caps both
        assert n >= eng.max_chunk_bytes
        sp = scattered(n // PAGE)
        data = pattern(n, seed=12)
        put(sp.buffer, data)
        x = eng.write(4096, sp.buffer, nbytes=n)
        assert x.chunks == len(plan_chunks(4096, n, nvme_dev.lba_size, nvme_dev.max_transfer_bytes))
        poison(sp.buffer, n)
        eng.read(4096, sp.buffer, nbytes=n)
        assert get(sp.buffer, n) == data


# --------------------------------------------------------------------------- data path


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_multi_mib_round_trip(nvme_dev: NvmeDevice, bufs: Any, where: str) -> None:
    w, r = bufs
    lba = nvme_dev.lba_size
    n = 3 * MiB + 3 * lba
    blocks = n // lba
    slba = {"first": 0,
            "middle": nvme_dev.capacity_blocks // 3 + 7,
            "last": nvme_dev.capacity_blocks - blocks}[where]
    data = pattern(n, seed=slba)
    put(w, data)
    poison(r, n)
    with Engine(nvme_dev, queue_depth=32) as eng:
        wx = eng.write(slba, w, nbytes=n)
        rx = eng.read(slba, r, nbytes=n)
    expected = len(plan_chunks(slba, n, lba, nvme_dev.max_transfer_bytes))
    assert wx.chunks == rx.chunks == expected
    assert get(r, n) == data


def _chunk_cases() -> list[tuple[int, int]]:
    return [(k, d) for k in (1, 2, 5) for d in (-1, 0, 1)]


@pytest.mark.parametrize(("k", "delta"), _chunk_cases(), ids=lambda v: str(v))
def test_chunk_boundaries(nvme_dev: NvmeDevice, bufs: Any, k: int, delta: int) -> None:
    """k*chunk and k*chunk +- 1 LBA: Eq. 8's command count, the right bytes, and
    the blocks just outside the range untouched (Eq. 10's 0-based NLB)."""
    w, r = bufs
    lba = nvme_dev.lba_size
    with Engine(nvme_dev, queue_depth=16) as eng:
        chunk = eng.max_chunk_bytes
        n = k * chunk + delta * lba
        slba = 10_000 + 37 * k           # not chunk aligned on the device
        blocks = n // lba
        guard_before, guard_after = pattern(lba, seed=1), pattern(lba, seed=2)
        put(w, guard_before)
        eng.write(slba - 1, w, nbytes=lba)
        put(w, guard_after)
        eng.write(slba + blocks, w, nbytes=lba)

        data = pattern(n, seed=k * 10 + delta)
        put(w, data)
        wx = eng.write(slba, w, nbytes=n)
        poison(r, n)
        rx = eng.read(slba, r, nbytes=n)
        plan = plan_chunks(slba, n, lba, nvme_dev.max_transfer_bytes)
        assert wx.chunks == rx.chunks == len(plan) == -(-n // chunk)
        assert get(r, n) == data

        eng.read(slba - 1, r, nbytes=lba)
        assert get(r, lba) == guard_before, "the block before the range was overwritten"
        eng.read(slba + blocks, r, nbytes=lba)
        assert get(r, lba) == guard_after, "the block after the range was overwritten"


def _overlap(xs: list[Transfer]) -> int:
    """Most transfers ever in service at once (first submission to last completion)."""
    spans = [(int(x._c.t_submit_ns), int(x._c.t_done_ns)) for x in xs]
    return max(sum(1 for s, d in spans if s <= t < d) for t, _ in spans)


@pytest.mark.parametrize("chunks_per_transfer", [1, 3])
def test_queue_stays_full_across_consecutive_transfers(nvme_dev: NvmeDevice, bufs: Any,
                                                       chunks_per_transfer: int) -> None:
    w, r = bufs
    lba, qd = nvme_dev.lba_size, 8
    with Engine(nvme_dev, queue_depth=qd) as eng:
        size = (chunks_per_transfer - 1) * eng.max_chunk_bytes + 4 * lba
        count = min(40, w.nbytes // size)
        assert count * chunks_per_transfer > 2 * qd
        stride = size // lba + 3
        data = pattern(size * count, seed=99)
        put(w, data)
        writes = [eng.submit(Op.WRITE, 50_000 + i * stride, w, offset=i * size, nbytes=size, tag=i)
                  for i in range(count)]
        assert eng.outstanding == count
        done: list[Transfer] = []
        while eng.outstanding:
            want = min(5, eng.outstanding)
            got = eng.wait(want)
            assert len(got) >= want, "wait() returned before min_done transfers completed"
            done.extend(got)
        assert sorted(x.tag for x in done) == list(range(count))
        assert all(x.ok for x in done), [x.error() for x in done if not x.ok]
        assert all(x.chunks == chunks_per_transfer for x in writes)
        # the queue is filled from the next transfers while earlier ones are in service:
        # the first fill alone puts ceil(qd / chunks) transfers in flight together
        busiest = _overlap(writes)
        if chunks_per_transfer == 1:
            assert busiest == qd
        else:
            assert -(-qd // chunks_per_transfer) <= busiest <= qd

        poison(r, size * count)
        reads = [eng.submit(Op.READ, 50_000 + i * stride, r, offset=i * size, nbytes=size, tag=i)
                 for i in range(count)]
        while eng.outstanding:
            eng.wait(eng.outstanding)
        assert all(x.ok for x in reads)
        assert get(r, size * count) == data


@pytest.mark.parametrize("registered", [True, False], ids=["fixed", "unregistered"])
def test_fixed_and_unregistered_buffers(nvme_dev: NvmeDevice, bufs: Any, registered: bool,
                                        fixed_partial_commands_ok: bool,
                                        request: pytest.FixtureRequest) -> None:
    """Multi-chunk transfers at arbitrary offsets of the staging buffers, with
    the buffers registered with the ring and without."""
    w, r = bufs
    lba = nvme_dev.lba_size
    n = 2 * MiB + 5 * lba
    data = pattern(n, seed=registered)
    put(w, data, 3 * lba)
    poison(r, n, lba)
    with Engine(nvme_dev, queue_depth=16, buffers=[w, r] if registered else []) as eng:
        # on kernels that refuse commands inside large registered buffers the
        # engine probes that and stays unregistered
        assert eng.registered is (registered and fixed_partial_commands_ok)
        slba = 300_000 % nvme_dev.capacity_blocks
        wx = eng.write(slba, w, offset=3 * lba, nbytes=n)
        rx = eng.read(slba, r, offset=lba, nbytes=n)
        assert wx.registered is eng.registered and rx.registered is eng.registered
    assert get(r, n, lba) == data


@pytest.mark.kernel_feature("io_uring_cmd", reason="fixed buffers are an io_uring_cmd path")
def test_fixed_buffers_no_larger_than_one_command(nvme_dev: NvmeDevice) -> None:
    """The IORING_URING_CMD_FIXED path itself (flag, buffer index, address):
    registered buffers no larger than one command, each moved whole, which
    every kernel with fixed-buffer passthrough (6.1+) accepts."""
    lba = nvme_dev.lba_size
    chunk = chunk_bytes(nvme_dev.max_transfer_bytes, lba)
    sizes = [chunk, chunk - PAGE, 3 * PAGE, PAGE]     # staging buffers come in whole pages
    bufs = [StagingBuffer(n) for n in sizes]
    assert [b.nbytes for b in bufs] == sizes
    try:
        with Engine(nvme_dev, queue_depth=8, buffers=bufs) as eng:
            assert eng.registered
            datas = [pattern(b.nbytes, seed=40 + i) for i, b in enumerate(bufs)]
            slbas = [20_000 + sum(b.nbytes // lba + 8 for b in bufs[:i]) for i in range(len(bufs))]
            for b, d in zip(bufs, datas, strict=True):
                put(b, d)
            xs = [eng.submit(Op.WRITE, s_, b, nbytes=b.nbytes) for s_, b in zip(slbas, bufs, strict=True)]
            while eng.outstanding:
                eng.wait(eng.outstanding)
            assert all(x.ok and x.registered and x.chunks == 1 for x in xs), [x.error() for x in xs]
            for b in bufs:
                poison(b, b.nbytes)
            xs = [eng.submit(Op.READ, s_, b, nbytes=b.nbytes) for s_, b in zip(slbas, bufs, strict=True)]
            while eng.outstanding:
                eng.wait(eng.outstanding)
            assert all(x.ok and x.registered for x in xs), [x.error() for x in xs]
            for b, d in zip(bufs, datas, strict=True):
                assert get(b, b.nbytes) == d
    finally:
        for b in bufs:
            b.close()


def test_unregistered_buffer_on_an_engine_with_fixed_buffers(nvme_dev: NvmeDevice, bufs: Any,
                                                             fixed_partial_commands_ok: bool) -> None:
    """Memory outside the registered set is still usable: it goes unregistered."""
    w, r = bufs
    n = MiB
    with StagingBuffer(n) as a, StagingBuffer(n) as b, Engine(nvme_dev, queue_depth=8, buffers=[w, r]) as eng:
        assert eng.registered is fixed_partial_commands_ok
        data = pattern(n, seed=5)
        put(a, data)
        wx = eng.write(7000, a, nbytes=n)
        poison(b, n)
        rx = eng.read(7000, b, nbytes=n)
        assert not wx.registered and not rx.registered
        assert get(b, n) == data


# --------------------------------------------------------------------------- deallocate / write zeroes


def test_deallocate_reads_back_as_zeroes(nvme_dev: NvmeDevice, bufs: Any) -> None:
    w, r = bufs
    lba = nvme_dev.lba_size
    n = 2 * MiB
    blocks = n // lba
    slba = 123_456 % (nvme_dev.capacity_blocks - blocks)
    data = pattern(n, seed=3)
    put(w, data)
    with Engine(nvme_dev, queue_depth=8) as eng:
        eng.write(slba, w, nbytes=n)
        first, count = blocks // 4 + 1, blocks // 2
        x = eng.discard(slba + first, count)
        assert x.ok
        poison(r, n)
        eng.read(slba, r, nbytes=n)
    got = get(r, n)
    lo, hi = first * lba, (first + count) * lba
    assert got[:lo] == data[:lo], "data before the deallocated range changed"
    assert got[lo:hi] == bytes(hi - lo), "deallocated blocks do not read back as zeroes"
    assert got[hi:] == data[hi:], "data after the deallocated range changed"


def test_deallocate_of_the_whole_namespace(nvme_dev: NvmeDevice, bufs: Any) -> None:
    """Teardown TRIMs whole extents: every block must read back as zeroes, also
    when the extent is larger than one DSM range may be."""
    w, r = bufs
    lba, cap = nvme_dev.lba_size, nvme_dev.capacity_blocks
    range_bytes = min(cap, nvme_dev.max_discard_blocks) * lba     # the largest DSM range bladed sends
    dmrsl_bytes = queue_limits(nvme_dev)["discard_max_hw_bytes"]   # the kernel's view of DMRSL
    # QEMU skips a range longer than DMRSL yet reports success: bladed must split
    assert range_bytes <= dmrsl_bytes
    marks = sorted({0, cap // 3, cap // 2, (cap * 4) // 5, cap - 1})
    with Engine(nvme_dev, queue_depth=8) as eng:
        for i, m in enumerate(marks):
            put(w, pattern(lba, seed=100 + i))
            eng.write(m, w, nbytes=lba)
        x = eng.discard(0, cap)
        assert x.ok
        for m in marks:
            poison(r, lba)
            eng.read(m, r, nbytes=lba)
            assert get(r, lba) == bytes(lba), f"LBA {m} still holds data after deallocating the namespace"


def test_write_zeroes_reads_back_as_zeroes(nvme_dev: NvmeDevice, bufs: Any) -> None:
    """Write Zeroes over more than 65536 blocks: split at the device's
    write-zeroes limit (never above the 16-bit NLB field), every block inside
    zeroed, the block after it untouched."""
    w, r = bufs
    lba = nvme_dev.lba_size
    nblocks = NVME_WZ_MAX_BLOCKS + 100
    slba = 5
    inside = [slba, slba + NVME_WZ_MAX_BLOCKS - 1, slba + NVME_WZ_MAX_BLOCKS, slba + nblocks - 1]
    outside = [slba - 1, slba + nblocks]
    with Engine(nvme_dev, queue_depth=8) as eng:
        for i, m in enumerate(inside + outside):
            put(w, pattern(lba, seed=200 + i))
            eng.write(m, w, nbytes=lba)
        x = eng.write_zeroes(slba, nblocks)
        assert 0 < nvme_dev.max_zeroes_blocks <= NVME_WZ_MAX_BLOCKS
        assert x.chunks == -(-nblocks // nvme_dev.max_zeroes_blocks)
        for m in inside:
            poison(r, lba)
            eng.read(m, r, nbytes=lba)
            assert get(r, lba) == bytes(lba), f"LBA {m} is not zero after Write Zeroes"
        for i, m in enumerate(outside, start=len(inside)):
            eng.read(m, r, nbytes=lba)
            assert get(r, lba) == pattern(lba, seed=200 + i), f"LBA {m} outside the range changed"


# --------------------------------------------------------------------------- NVMe statuses


def test_python_range_check_stops_requests_past_the_end(nvme_dev: NvmeDevice, bufs: Any) -> None:
    w, _ = bufs
    with Engine(nvme_dev, queue_depth=2) as eng, pytest.raises(TargetRangeError, match="past the end"):
        eng.read(nvme_dev.capacity_blocks, w, nbytes=nvme_dev.lba_size)


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_command_at_nsze_is_lba_out_of_range(nvme_dev: NvmeDevice, bufs: Any, op: Op) -> None:
    """Past the Python range check, the controller's own answer must surface as
    NVMeStatusError naming the status and the failing LBA."""
    w, _ = bufs
    lba, nsze = nvme_dev.lba_size, nvme_dev.capacity_blocks
    with Engine(nvme_dev, queue_depth=4) as eng:
        x = Transfer(eng.target, op, nsze, lba, w.address, w)
        eng.run([x], check=False)
        err = x.error()
        assert isinstance(err, NVMeStatusError)
        assert "LBA out of range" in str(err) and f"LBA {nsze}" in str(err)
        assert (err.sct, err.sc, err.dnr, err.slba) == (0, 0x80, True, nsze)
        with pytest.raises(NVMeStatusError, match="LBA out of range"):
            x.raise_for_status()
        # the ring is still good afterwards
        assert eng.read(nsze - 1, w, nbytes=lba).ok


def test_out_of_range_error_names_the_failing_chunk(nvme_dev: NvmeDevice, bufs: Any) -> None:
    """A multi-chunk transfer whose last chunk crosses the end: earlier chunks
    succeed, the error carries the LBA of the chunk that failed."""
    w, _ = bufs
    lba, nsze = nvme_dev.lba_size, nvme_dev.capacity_blocks
    with Engine(nvme_dev, queue_depth=4) as eng:
        chunk_blocks = eng.max_chunk_bytes // lba
        slba = nsze - chunk_blocks - 1          # chunk 0 fits, chunk 1 starts at nsze - 1 and crosses
        x = Transfer(eng.target, Op.READ, slba, 2 * chunk_blocks * lba, w.address, w)
        with pytest.raises(NVMeStatusError, match="LBA out of range") as exc:
            eng.run([x])
        assert x.chunks == 2
        assert exc.value.slba == nsze - 1


def _admin_identify_status(fd: int, nsid: int, cns: int) -> int:
    """Identify through NVME_IOCTL_ADMIN_CMD by hand: returns the NVMe status (ioctl's return)."""
    data = bytearray(4096)
    keep = ffi.from_buffer(data)
    cmd = bytearray(72)                       # struct nvme_admin_cmd
    struct.pack_into("<BxxxI", cmd, 0, 0x06, nsid)
    struct.pack_into("<QxxxxI", cmd, 24, int(ffi.cast("uintptr_t", keep)), len(data))
    struct.pack_into("<I", cmd, 40, cns)
    return int(fcntl.ioctl(fd, NVME_IOCTL_ADMIN_CMD, cmd))


def test_invalid_field_status_from_the_controller_is_decoded(nvme_dev: NvmeDevice) -> None:
    """A reserved CNS value makes the controller answer Invalid Field in Command."""
    status = _admin_identify_status(nvme_dev.fd, nvme_dev.nsid, 0x7F)
    err = NVMeStatusError(status, 0, "identify")
    assert (err.sct, err.sc, err.dnr) == (0, 0x02, True)
    assert "invalid field in command" in str(err)


def test_identify_surfaces_a_refused_command(nvme_dev: NvmeDevice) -> None:
    with pytest.raises(NVMeStatusError, match="invalid field in command"):
        identify(nvme_dev.fd, nvme_dev.nsid, 0x7F)


def test_wrong_nsid_is_refused_by_the_kernel(nvme_dev: NvmeDevice, bufs: Any, vm_config: VMConfig) -> None:
    """The passthrough path checks the command's NSID against the node's (6.1 and 6.12).  5.10 does not:
    the command reaches the controller with the NSID it carries, so bladed must never get it wrong."""
    w, _ = bufs
    with Engine(nvme_dev, queue_depth=2) as eng:
        eng.target.nsid = nvme_dev.nsid + 1
        x = Transfer(eng.target, Op.READ, 0, nvme_dev.lba_size, w.address, w)
        eng.run([x], check=False)
        err = x.error()
        if features.kernel_version() >= (6, 1):
            assert isinstance(err, BladedIOError) and err.errno == errno.EINVAL, err
        else:   # 5.10: the read went to namespace nsid + 1 (it exists: every busybox configuration has two)
            assert vm_config.namespaces > nvme_dev.nsid and err is None, err
        eng.target.nsid = nvme_dev.nsid
        assert eng.read(0, w, nbytes=nvme_dev.lba_size).ok


# the block node is the right one on a kernel without generic nodes (before 5.13)
WRONG_NODES = [("/dev/nvme0", "not an NVMe namespace")]
if GENERIC_NODES:
    WRONG_NODES.append((f"/dev/{NS_NAME}", f"not a character device: use {NG_PATH}"))


@pytest.mark.parametrize(("path", "words"), WRONG_NODES)
def test_opening_the_wrong_node_says_which_to_use(path: str, words: str) -> None:
    """The block node and the controller node are easy to confuse with /dev/ngXnY."""
    with pytest.raises(BladedIOError, match=words):
        open_device("nvme", path)


def test_generic_device_path(nvme_dev: NvmeDevice) -> None:
    assert nvme_dev.path == NG_PATH and nvme_dev.sysfs_block == f"/sys/block/{NS_NAME}"
