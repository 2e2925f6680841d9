"""The I/O engine against real files (O_DIRECT io_uring) and real loop devices."""

from __future__ import annotations

import os
import threading

import pytest

from bladed.io import (
    AlignmentError,
    Engine,
    Op,
    OutOfRangeError,
    ShortTransferError,
    StagingBuffer,
    open_device,
)
from bladed.io.chunking import plan_chunks
from bladed.io.file import FileDevice
from bladed.io.uring import HugePages

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


def test_file_round_trip_with_registered_buffers(file_dev: FileDevice, staging: StagingBuffer) -> None:
    data = fill_random(staging)
    with Engine(file_dev, 32, [staging]) as eng:
        assert eng.registered
        w = eng.write(256, staging)
        assert w.registered and w.ok and w.service_ns > 0
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
        with pytest.raises(OutOfRangeError, match="past the end"):
            eng.read(file_dev.capacity_blocks - 1, staging, nbytes=8192)
        with pytest.raises(OutOfRangeError, match="past the end"):
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
        assert small.address % 4096 == 0 and small.nbytes == 12 * 1024


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
