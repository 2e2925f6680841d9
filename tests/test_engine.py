"""The I/O engine against real files (O_DIRECT io_uring) and real loop devices."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading

import pytest
from bladed._uring import ffi, lib

from bladed.io import (
    AlignmentError,
    BladedIOError,
    Engine,
    Op,
    ShortTransferError,
    StagingBuffer,
    TargetRangeError,
    Transfer,
    open_device,
)
from bladed.io.chunking import plan_chunks
from bladed.io.errors import InvalidRequestError
from bladed.io.file import FileDevice
from bladed.io.uring import HugePages, Ring
from bladed.sizes import PAGE_SIZE

# on both engines, io_uring and the portable one (issue 29)
pytestmark = pytest.mark.usefixtures("io_engine")

MiB = 1 << 20


def fill_random(buf: StagingBuffer, nbytes: int | None = None, seed: int = 0) -> bytes:
    n = buf.nbytes if nbytes is None else nbytes
    data = os.urandom(n) if seed == 0 else bytes((seed * 7 + i) & 0xFF for i in range(256)) * (n // 256)
    buf.view(0, n)[:] = data
    return data


@pytest.fixture
def file_dev(store_dir: str):
    dev = FileDevice(os.path.join(store_dir, "store.img"), 64 * MiB, max_command_bytes=128 << 10)
    yield dev
    dev.close()


def test_file_round_trip_with_registered_buffers(file_dev: FileDevice, staging: StagingBuffer,
                                                 io_engine: str) -> None:
    data = fill_random(staging)
    with Engine(file_dev, 32, [staging]) as eng:
        # fixed buffers are io_uring's; the portable engine's threads pass the same memory by address
        assert eng.registered == (io_engine == "uring")
        w = eng.write(256, staging)
        assert w.registered == eng.registered and w.ok and w.service_ns > 0
        staging.view()[:] = bytes(staging.nbytes)
        eng.read(256, staging)
    assert staging.view().tobytes() == data


def test_file_round_trip_unregistered(file_dev: FileDevice) -> None:
    buf = StagingBuffer(3 * MiB)
    data = fill_random(buf)
    with Engine(file_dev, 8) as eng:
        assert not eng.registered
        assert not eng.write(0, buf).registered
        other = StagingBuffer(3 * MiB)
        eng.read(0, other)
    assert other.view().tobytes() == data


@pytest.mark.parametrize("max_cmd", [4096, 128 << 10, 1 << 20, (128 << 10) + 100])
@pytest.mark.parametrize("nblocks", [1, 31, 32, 33, 257])
def test_chunk_count_matches_eq8(store_dir: str, staging: StagingBuffer, max_cmd: int, nblocks: int) -> None:
    dev = FileDevice(os.path.join(store_dir, "c.img"), 16 * MiB, max_command_bytes=max_cmd)
    nbytes = nblocks * dev.lba_size
    data = fill_random(staging, nbytes)
    with dev, Engine(dev, 32, [staging]) as eng:
        w = eng.write(7, staging, nbytes=nbytes)
        assert w.chunks == len(plan_chunks(7, nbytes, dev.lba_size, max_cmd))
        staging.view()[:] = bytes(staging.nbytes)
        eng.read(7, staging, nbytes=nbytes)
    assert staging.view(0, nbytes).tobytes() == data


def test_queue_stays_full_across_consecutive_tensors(file_dev: FileDevice, staging: StagingBuffer) -> None:
    """Eight 1 MiB tensors of eight 128 KiB commands each, QD 32: chunks of
    several tensors must be in flight together, i.e. no drain between tensors."""
    fill_random(staging)
    with Engine(file_dev, 32, [staging]) as eng:
        xs = [eng.transfer(Op.WRITE, i * 256, staging, offset=i * MiB, nbytes=MiB) for i in range(8)]
        eng.run(xs)
        stats = eng.ring.stats()
    assert all(x.chunks == 8 for x in xs)
    assert stats["submitted"] == stats["completed"] == 64
    assert stats["max_inflight"] == 32


def test_streaming_submit_and_wait(file_dev: FileDevice, staging: StagingBuffer) -> None:
    data = fill_random(staging)
    with Engine(file_dev, 16, [staging]) as eng:
        tags = set()
        for i in range(8):
            eng.submit(Op.WRITE, i * 256, staging, offset=i * MiB, nbytes=MiB, tag=i)
        while eng.outstanding:
            tags |= {x.raise_for_status().tag for x in eng.wait(1)}
        assert tags == set(range(8))
        staging.view()[:] = bytes(staging.nbytes)
        eng.run([eng.transfer(Op.READ, i * 256, staging, offset=i * MiB, nbytes=MiB) for i in range(8)])
    assert staging.view().tobytes() == data


def test_misaligned_address_and_length_are_refused(file_dev: FileDevice, staging: StagingBuffer) -> None:
    with Engine(file_dev, 4, [staging]) as eng:
        with pytest.raises(AlignmentError, match="not aligned"):
            eng.read(0, staging, offset=512, nbytes=4096)
        with pytest.raises(AlignmentError, match="multiple of the 4096-byte LBA"):
            eng.write(0, staging, nbytes=1000)
        with pytest.raises(AlignmentError):
            eng.read(0, bytearray(8192))  # ordinary heap memory is not LBA aligned in general
        assert eng.outstanding == 0


def test_out_of_range_is_refused(file_dev: FileDevice, staging: StagingBuffer) -> None:
    with Engine(file_dev, 4, [staging]) as eng:
        with pytest.raises(TargetRangeError, match="past the end"):
            eng.read(file_dev.capacity_blocks - 1, staging, nbytes=8192)
        with pytest.raises(TargetRangeError, match="past the end"):
            eng.discard(file_dev.capacity_blocks, 1)


def test_short_transfer_raises(file_dev: FileDevice, staging: StagingBuffer) -> None:
    """The backing file shrinks under the engine: the read comes back short."""
    os.truncate(file_dev.path, 8 * MiB)
    with Engine(file_dev, 4, [staging]) as eng, pytest.raises(ShortTransferError, match="short transfer"):
        eng.read((8 * MiB) // file_dev.lba_size - 1, staging, nbytes=2 * file_dev.lba_size)


def test_file_discard_punches_holes_that_read_zero(file_dev: FileDevice, staging: StagingBuffer) -> None:
    fill_random(staging)
    with Engine(file_dev, 8, [staging]) as eng:
        eng.write(0, staging)
        allocated = os.stat(file_dev.path).st_blocks
        eng.discard(0, staging.nbytes // file_dev.lba_size)
        assert os.stat(file_dev.path).st_blocks <= allocated - staging.nbytes // 512
        eng.read(0, staging)
    assert staging.view().tobytes() == bytes(staging.nbytes)


def test_write_zeroes(file_dev: FileDevice, staging: StagingBuffer) -> None:
    fill_random(staging)
    with Engine(file_dev, 8, [staging]) as eng:
        eng.write(0, staging)
        eng.write_zeroes(16, 32)
        eng.read(0, staging)
    view = staging.view()
    assert view[16 * 4096:48 * 4096].tobytes() == bytes(32 * 4096)
    assert view[:16 * 4096].tobytes() != bytes(16 * 4096)


def test_channels_run_in_parallel_threads(file_dev: FileDevice) -> None:
    """Two engines (one per channel) on one device, each in its own thread."""
    bufs = [StagingBuffer(4 * MiB) for _ in range(2)]
    datas = [fill_random(b) for b in bufs]
    errors: list[BaseException] = []

    def channel(i: int) -> None:
        try:
            with Engine(file_dev, 16, [bufs[i]]) as eng:
                for rep in range(4):
                    eng.write(i * 1024 + rep, bufs[i], nbytes=MiB)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=channel, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    with Engine(file_dev, 4) as eng:
        for i in range(2):
            out = StagingBuffer(MiB)
            eng.read(i * 1024 + 3, out)
            assert out.view().tobytes() == datas[i][:MiB]


def test_staging_memory_is_aligned_for_huge_pages() -> None:
    with StagingBuffer(4 * MiB) as big, StagingBuffer(12 * 1024) as small:
        assert big.address % (2 * MiB) == 0
        assert big.huge in (HugePages.THP, HugePages.HUGETLB)
        # whole pages of the kernel's size (16 or 64 KiB on some arm64 kernels)
        assert small.address % PAGE_SIZE == 0 and small.nbytes == -(-12 * 1024 // PAGE_SIZE) * PAGE_SIZE


def test_failure_in_the_middle_of_a_batch_spares_the_others(file_dev: FileDevice, staging: StagingBuffer) -> None:
    """Three reads queued back to back at queue depth 2; the middle one runs
    past the end of the backing file, so its commands from there on come back
    with 0 bytes. The first and last reads complete with their data, the
    middle one reports the short transfer and stops issuing commands, and the
    ring goes on working."""
    lba, cap = file_dev.lba_size, file_dev.capacity_blocks
    chunk_blocks = (128 << 10) // lba                   # the fixture's command limit
    tail = 4 * chunk_blocks                             # the middle read: 4 commands inside, 4 past the end
    data = fill_random(staging, 3 * MiB)
    with Engine(file_dev, 2, [staging]) as eng:
        eng.write(0, staging, nbytes=MiB)
        eng.write(cap - tail, staging, offset=MiB, nbytes=tail * lba)
        eng.write(1024, staging, offset=2 * MiB, nbytes=MiB)
        staging.view()[:] = bytes(staging.nbytes)
        first = eng.transfer(Op.READ, 0, staging, nbytes=MiB)
        middle = Transfer(eng.target, Op.READ, cap - tail, 2 * tail * lba, staging.address + MiB, staging.memory())
        last = eng.transfer(Op.READ, 1024, staging, offset=2 * MiB, nbytes=MiB)
        eng.run([first, middle, last], check=False)
        assert first.ok and last.ok
        assert staging.view(0, MiB) == data[:MiB]
        assert staging.view(2 * MiB, MiB) == data[2 * MiB:]
        assert staging.view(MiB, tail * lba) == data[MiB:MiB + tail * lba]     # its chunks inside the file
        with pytest.raises(ShortTransferError, match=f"read of {2 * tail * lba} bytes at LBA {cap - tail}"):
            middle.raise_for_status()
        # the first failure stops further commands: at most the one beside it was in flight
        assert 5 <= middle.chunks <= 6
        assert eng.outstanding == 0
        stats = eng.ring.stats()
        assert stats["submitted"] == stats["completed"]
        assert eng.read(1024, staging, nbytes=MiB).ok
        assert staging.view(0, MiB) == data[2 * MiB:]


def test_failed_write_in_the_middle_of_a_batch_on_a_loop_device(loop_device: str, staging: StagingBuffer) -> None:
    """The same on a block device, where the kernel fails the middle write's
    commands past the end of the device with ENOSPC (an errno, not a short count)."""
    dev = open_device("block", loop_device)
    data = fill_random(staging)
    with dev, Engine(dev, 2, [staging]) as eng:
        lba, cap = dev.lba_size, dev.capacity_blocks
        chunk_blocks = eng.max_chunk_bytes // lba
        tail = 2 * chunk_blocks
        first = eng.transfer(Op.WRITE, 0, staging, nbytes=MiB)
        middle = Transfer(eng.target, Op.WRITE, cap - tail, 3 * tail * lba, staging.address + MiB, staging.memory())
        last = eng.transfer(Op.WRITE, 4096, staging, offset=4 * MiB, nbytes=MiB)
        eng.run([first, middle, last], check=False)
        assert first.ok and last.ok
        err = middle.error()
        assert isinstance(err, BladedIOError) and err.errno == errno.ENOSPC
        assert f"write of {3 * tail * lba} bytes at LBA {cap - tail}" in str(err)
        staging.view()[:] = bytes(staging.nbytes)
        eng.read(0, staging, nbytes=MiB)
        eng.read(cap - tail, staging, offset=MiB, nbytes=tail * lba)
        eng.read(4096, staging, offset=4 * MiB, nbytes=MiB)
    assert staging.view(0, MiB) == data[:MiB]
    assert staging.view(MiB, tail * lba) == data[MiB:MiB + tail * lba]
    assert staging.view(4 * MiB, MiB) == data[4 * MiB:5 * MiB]


U64 = 1 << 64

REFUSED = [
    # (target field, value, op, slba, nbytes, buffer address (None: the staging buffer), exception, errno, message)
    ("lba_shift", 64, Op.READ, 0, 4096, None, InvalidRequestError, errno.EINVAL, "lba_shift 64 is outside 9..16"),
    ("lba_shift", 2**32 - 1, Op.DISCARD, 0, 4096, None, InvalidRequestError, errno.EINVAL,
     "lba_shift 4294967295 is outside"),
    ("max_chunk_bytes", 0, Op.WRITE, 0, 4096, None, InvalidRequestError, errno.EINVAL,
     "max_chunk_bytes=0 is smaller than one 4096-byte LBA"),
    (None, None, Op.READ, 0, U64 - 4096, None, TargetRangeError, errno.EOVERFLOW,
     f"read of {U64 - 4096} bytes at LBA 0.*ends past 63-bit byte offsets"),
    (None, None, Op.WRITE_ZEROES, U64 - 1, 4096, None, TargetRangeError, errno.EOVERFLOW,
     f"a range of 1 LBAs from LBA {U64 - 1} ends past 63-bit"),
    (None, None, Op.READ, 0, 1000, None, AlignmentError, errno.EINVAL, "length 1000 is not a multiple of the 4096"),
    (None, None, Op.READ, 0, 8192, U64 - 4096, InvalidRequestError, errno.EOVERFLOW,
     "buffer at 0xfffffffffffff000 of 8192 bytes would end past the top"),
    (None, None, Op.WRITE, 0, 4096, 0, InvalidRequestError, errno.EINVAL, "buffer address is NULL"),
]


@pytest.mark.parametrize(("field", "value", "op", "slba", "nbytes", "address", "exc", "err", "match"), REFUSED)
def test_engine_refuses_extreme_values_before_submitting(
        file_dev: FileDevice, staging: StagingBuffer, field: str | None, value: int, op: Op, slba: int,
        nbytes: int, address: int | None, exc: type[Exception], err: int, match: str) -> None:
    """The C engine validates shifts, sizes and ranges itself (no wrap, no
    undefined shift); the refusal is one exception naming the value."""
    with Engine(file_dev, 4, [staging]) as eng:
        target = file_dev.make_target()
        if field:
            setattr(target, field, value)
        x = Transfer(target, op, slba, nbytes, staging.address if address is None else address, staging.memory())
        with pytest.raises(exc, match=match) as e:
            eng.ring.submit(x)
        assert e.value.errno == err
        assert isinstance(x.error(), exc) and not x.ok
        assert eng.outstanding == 0 and eng.ring.stats()["submitted"] == 0
        data = fill_random(staging, 4096)
        eng.write(0, staging, nbytes=4096)                      # the ring is untouched
        staging.view(0, 4096)[:] = bytes(4096)
        eng.read(0, staging, nbytes=4096)
        assert staging.view(0, 4096) == data


def test_a_queued_transfer_cannot_be_queued_again(file_dev: FileDevice, staging: StagingBuffer) -> None:
    with Engine(file_dev, 4, [staging]) as eng:
        x = eng.submit(Op.WRITE, 0, staging, nbytes=MiB)
        with pytest.raises(BladedIOError, match="already queued") as e:
            eng.ring.submit(x)
        assert e.value.errno == errno.EBUSY
        assert eng.wait(1) == [x] and x.ok and x.chunks == 8


def test_engine_cuts_nvme_commands_at_the_16_bit_nlb(store_dir: str) -> None:
    """A 64 MiB limit with 512-byte LBAs would allow one command of 131072
    blocks, but NVMe's NLB field is 16 bits. The target here is an NVMe target
    over a plain file, so the kernel refuses every command (EOPNOTSUPP); the
    engine's own command count shows where it cut."""
    fd = os.open(os.path.join(store_dir, "nlb.img"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with StagingBuffer(64 * MiB) as buf, Ring(4, big_sqe=True) as ring:
            t = ffi.new("struct bd_target *")
            t.fd, t.kind, t.nsid, t.lba_shift, t.max_chunk_bytes = fd, lib.BD_KIND_NVME, 1, 9, 64 * MiB
            x = Transfer(t, Op.READ, 0, 64 * MiB, buf.address, buf.memory())
            ring.run([x])
            assert x.chunks == 2 == len(plan_chunks(0, 64 * MiB, 512, 64 * MiB, kind=lib.BD_KIND_NVME))
            err = x.error()
            assert isinstance(err, BladedIOError) and err.errno == errno.EOPNOTSUPP
    finally:
        os.close(fd)


VIEW_AFTER_CLOSE = """
import mmap, sys
import numpy as np
from bladed.io import Engine, Op, StagingBuffer
from bladed.io.file import FileDevice

def mapped(addr):
    with open("/proc/self/maps") as f:
        spans = [line.split()[0].split("-") for line in f]
    return any(int(lo, 16) <= addr < int(hi, 16) for lo, hi in spans)

buf = StagingBuffer(4 << 20)
addr = buf.address
view = buf.view(4096, 8192)
arr = np.frombuffer(buf.view(), np.uint8)
buf.close()
view[:] = b"v" * 8192                     # a write through a dangling pointer before the fix: SIGSEGV
print("view after close", bytes(view[:2]), arr[4096])
for name, use in (("view", buf.view), ("address", lambda: buf.address)):
    try:
        use()
    except ValueError as e:
        print("refused", name, e)
print("mapped while a view lives", mapped(addr))
del view
print("mapped while an array lives", mapped(addr))
del arr
print("mapped after the last view", mapped(addr))

m = mmap.mmap(-1, 1 << 20)
w = StagingBuffer.wrap(m)
wv = w.view()
w.close()
try:
    m.close()
except BufferError:
    print("memfd-style mapping pinned by its view")
wv[0] = 1
del wv
m.close()
print("mapping closed after the view")

dev = FileDevice(sys.argv[1], 16 << 20)
src, dst = StagingBuffer(1 << 20), StagingBuffer(1 << 20)
src.view()[:] = b"s" * (1 << 20)
with Engine(dev, 8) as eng:
    x = eng.submit(Op.WRITE, 0, src, nbytes=1 << 20)
    addr = src.address
    src.close()                          # while the write is in flight
    print("in-flight write", [t.ok for t in eng.wait(1)], "mapped", mapped(addr))
    del x
    print("mapped after the transfer", mapped(addr))
    eng.read(0, dst)
print("data", dst.view().tobytes() == b"s" * (1 << 20))

reg = StagingBuffer(1 << 20)
addr = reg.address
with Engine(dev, 8, [reg]) as eng:
    reg.close()
    print("registered", eng.registered, "mapped", mapped(addr))
print("mapped after the ring", mapped(addr))
"""


def test_staging_views_outlive_close_without_crashing(store_dir: str) -> None:
    """In a child process, since the failure this guards against is a segfault:
    views, transfers in flight and ring registrations keep the memory mapped
    after close(); the closed buffer refuses new views with ValueError; the
    memory goes with the last holder."""
    proc = subprocess.run([sys.executable, "-c", VIEW_AFTER_CLOSE, os.path.join(store_dir, "v.img")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert out[0] == "view after close b'vv' 118"
    assert out[1].startswith("refused view staging buffer of 4194304 bytes is closed")
    assert out[2].startswith("refused address staging buffer of 4194304 bytes is closed")
    assert out[3:6] == ["mapped while a view lives True", "mapped while an array lives True",
                        "mapped after the last view False"]
    assert out[6:8] == ["memfd-style mapping pinned by its view", "mapping closed after the view"]
    assert out[8:11] == ["in-flight write [True] mapped True", "mapped after the transfer False", "data True"]
    assert out[11:] == ["registered True mapped True", "mapped after the ring False"]


GARBAGE_CYCLES = """
import gc, mmap, sys
from bladed.io import Engine, Op, StagingBuffer
from bladed.io.file import FileDevice

class Holder:
    pass

dev = FileDevice(sys.argv[1], 16 << 20)
gc.disable()
for i in range(50):
    m = mmap.mmap(-1, 1 << 20)                      # what the daemon does with a client's memfd
    whole = memoryview(m)
    wrapped = StagingBuffer.wrap(whole[:65536])
    whole.release()
    owned = StagingBuffer(65536)
    h = Holder()
    h.me = h                                        # a reference cycle, as a traceback makes
    h.views = [wrapped.view(), owned.view(4096, 4096), wrapped, owned]
    with Engine(dev, 4, [wrapped, owned]) as eng:
        h.xfers = [eng.write(0, wrapped, nbytes=4096), eng.write(16, owned, nbytes=4096)]
    wrapped.close()
    owned.close()
    del m, whole, wrapped, owned, h, eng
    gc.collect()
print("collected")
"""


def test_views_in_garbage_cycles_are_collected_without_crashing(store_dir: str) -> None:
    """Views and transfers of wrapped (memfd-style) and owned buffers, left in
    reference cycles after close(): the cyclic collector frees them in any
    order without crashing (a cffi object holding a buffer export of a
    memoryview would make CPython dereference a cleared view here)."""
    proc = subprocess.run([sys.executable, "-c", GARBAGE_CYCLES, os.path.join(store_dir, "g.img")],
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout.strip()) == (0, "collected"), proc.stderr
    assert "BufferError" not in proc.stderr, proc.stderr


def test_file_device_errors_are_clear(store_dir: str) -> None:
    with pytest.raises(FileNotFoundError):
        FileDevice(os.path.join(store_dir, "absent.img"), create=False)
    with pytest.raises(ValueError, match="multiple of the 4096-byte LBA"):
        FileDevice(os.path.join(store_dir, "odd.img"), 4096 * 10 + 1)
    with pytest.raises(ValueError, match="unknown backend"):
        open_device("tape", "/dev/st0")


# ------------------------------------------------------------------ block ---

def test_loop_device_round_trip_and_discard(loop_device: str, staging: StagingBuffer) -> None:
    data = fill_random(staging)
    dev = open_device("block", loop_device)
    with dev, Engine(dev, 32, [staging]) as eng:
        assert dev.lba_size in (512, 4096)
        assert dev.capacity_bytes == 64 * MiB
        nblocks = staging.nbytes // dev.lba_size
        eng.write(2048, staging)
        staging.view()[:] = bytes(staging.nbytes)
        eng.read(2048, staging)
        assert staging.view().tobytes() == data
        eng.discard(2048, nblocks)             # io_uring block discard command (6.12+)
        eng.read(2048, staging)
        assert staging.view().tobytes() == bytes(staging.nbytes)
        assert dev.zeroes_after_discard


def test_loop_device_blkdiscard_fallback(loop_device: str, staging: StagingBuffer) -> None:
    from bladed._uring import lib

    fill_random(staging)
    dev = open_device("block", loop_device)
    with dev, Engine(dev, 8, [staging]) as eng:
        eng.write(0, staging)
        eng.target.discard_mode = lib.BD_DISCARD_IOCTL
        eng.discard(0, staging.nbytes // dev.lba_size)
        eng.read(0, staging)
    assert staging.view().tobytes() == bytes(staging.nbytes)


def test_block_device_is_claimed_exclusively(loop_device: str) -> None:
    from bladed.io.errors import BladedIOError

    with open_device("block", loop_device), pytest.raises(BladedIOError, match="in use"):
        open_device("block", loop_device)


def test_block_backend_refuses_a_regular_file(store_dir: str) -> None:
    from bladed.io.errors import BladedIOError

    path = os.path.join(store_dir, "plain")
    open(path, "wb").close()
    with pytest.raises(BladedIOError, match="not a block device"):
        open_device("block", path)


MEMLOCK_PROBE = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(message)s")
from bladed.io import Engine, StagingBuffer
from bladed.io.file import FileDevice
dev = FileDevice(sys.argv[1], 16 << 20)
bufs = [StagingBuffer(8 << 20), StagingBuffer(8 << 20)]
bufs[0].view()[:] = b"x" * (8 << 20)
for _ in range(2):
    with Engine(dev, 8, bufs) as eng:
        print("registered", eng.registered)
        eng.write(0, bufs[0])
        eng.read(0, bufs[1])
print("round trip", bufs[1].view().tobytes() == bufs[0].view().tobytes())
"""


def test_registration_refused_by_memlock_falls_back_and_logs_once(store_dir: str) -> None:
    """Without CAP_IPC_LOCK and with a 64 KiB RLIMIT_MEMLOCK the kernel refuses
    fixed buffers: the engine must keep working unregistered and say so once."""
    import subprocess
    import sys

    out = subprocess.run(
        ["setpriv", "--bounding-set=-ipc_lock", "prlimit", "--memlock=65536",
         sys.executable, "-c", MEMLOCK_PROBE, os.path.join(store_dir, "ml.img")],
        check=True, capture_output=True, text=True,
    ).stdout
    assert out.count("fixed-buffer registration failed (ENOMEM)") == 1
    assert out.count("registered False") == 2
    assert "round trip True" in out
