"""Appends pass bulk reads: a channel's ring reads through a window (issue 13, item 3; docs/engine.md).

A device serves its queue in order, so a one-token write submitted while
another ring has a multi-MiB read queued waits for all of it.  Under a read
window a ring keeps at most the window of reads in flight, in pieces of half
of it, so a write finds at most the window ahead of it.  These tests pin the
mechanism against real O_DIRECT files (what a user sees is the latency,
measured by ``tools/bench_requests.py``, not here) and that every byte still
lands where it should, through the engine, the extent store and the daemon.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from daemon_util import DaemonProcess, short_tmpdir
from test_extent_store import Harness

from bladed.client import Client
from bladed.io import Engine, ShortTransferError, StagingBuffer
from bladed.io.chunking import plan_chunks
from bladed.io.file import FileDevice
from bladed.protocol import IOOp
from bladed.residency import Geometry
from bladed.server.storage.channel import READ_WINDOW_BYTES, Channel

# on both engines, io_uring and the portable one (issue 29)
pytestmark = pytest.mark.usefixtures("io_engine")

MiB = 1 << 20
KiB = 1 << 10


@pytest.fixture
def dev(store_dir: str) -> Iterator[FileDevice]:
    d = FileDevice(os.path.join(store_dir, "w.img"), 32 * MiB, max_command_bytes=MiB)
    yield d
    d.close()


def fill(buf: StagingBuffer, n: int) -> bytes:
    data = os.urandom(n)
    buf.view(0, n)[:] = data
    return data


@pytest.mark.parametrize("nbytes", [8 * MiB, 8 * MiB + 3 * 4096, 4096])
def test_a_windowed_read_goes_in_pieces_with_at_most_the_window_in_flight(dev: FileDevice, nbytes: int) -> None:
    with StagingBuffer(9 * MiB) as buf:
        data = fill(buf, nbytes)
        with Engine(dev, 32, [buf]) as eng:
            eng.write(16, buf, nbytes=nbytes)
        buf.view()[:] = bytes(buf.nbytes)
        with Engine(dev, 32, [buf]) as eng:
            eng.ring.read_window = 256 * KiB
            assert eng.ring.read_window == 256 * KiB
            x = eng.read(16, buf, nbytes=nbytes)
            stats = eng.ring.stats()
        assert buf.view(0, nbytes).tobytes() == data
    assert x.chunks == stats["submitted"] == -(-nbytes // (128 * KiB))     # pieces of half the window
    assert stats["max_inflight"] == min(2, x.chunks)                       # the next piece is always queued


def test_writes_and_rings_without_a_window_keep_the_eq7_commands(dev: FileDevice) -> None:
    with StagingBuffer(8 * MiB) as buf:
        data = fill(buf, 8 * MiB)
        with Engine(dev, 32, [buf]) as eng:
            eng.ring.read_window = 256 * KiB
            w = eng.write(0, buf)                                          # writes are never windowed
        assert w.chunks == len(plan_chunks(0, 8 * MiB, dev.lba_size, MiB)) == 8
        buf.view()[:] = bytes(buf.nbytes)
        with Engine(dev, 32, [buf]) as eng:
            assert eng.ring.read_window == 0                               # the engine's default
            r = eng.read(0, buf)
            assert r.chunks == 8 and eng.ring.stats()["max_inflight"] == 8
        assert buf.view().tobytes() == data


def test_a_window_below_two_lbas_moves_one_lba_at_a_time(dev: FileDevice) -> None:
    with StagingBuffer(MiB) as buf:
        data = fill(buf, 64 * 4096)
        with Engine(dev, 32, [buf]) as eng:
            eng.write(0, buf, nbytes=64 * 4096)
        buf.view()[:] = bytes(buf.nbytes)
        with Engine(dev, 32, [buf]) as eng:
            eng.ring.read_window = 4096 + 100
            x = eng.read(0, buf, nbytes=64 * 4096)
            assert x.chunks == 64 and eng.ring.stats()["max_inflight"] == 1
        assert buf.view(0, 64 * 4096).tobytes() == data
        with Engine(dev, 32, [buf]) as eng, pytest.raises(ValueError, match=r"0 \(no limit\) or positive"):
            eng.ring.read_window = -1


def test_a_short_read_under_a_window_leaves_the_ring_usable(dev: FileDevice) -> None:
    """The file shrinks under the ring: the windowed read that runs past its end fails alone, the next one works."""
    with StagingBuffer(4 * MiB) as buf, Engine(dev, 32, [buf]) as eng:
        data = fill(buf, 4 * MiB)
        eng.write(0, buf)
        os.truncate(dev.path, 6 * MiB)
        eng.ring.read_window = 512 * KiB
        with pytest.raises(ShortTransferError, match="short transfer"):
            eng.read((5 * MiB) // dev.lba_size, buf, nbytes=2 * MiB)
        buf.view()[:] = bytes(buf.nbytes)
        assert eng.read(0, buf).chunks == 16
        assert buf.view().tobytes() == data
        assert eng.outstanding == 0


def test_the_daemon_channels_read_through_the_window(dev: FileDevice) -> None:
    with StagingBuffer(MiB) as buf:
        ch = Channel(0, Engine(dev, 32, [buf]), buf)
        try:
            assert ch.engine.ring.read_window == READ_WINDOW_BYTES > 0
        finally:
            ch.close()


@pytest.mark.parametrize("row", [4096, 768])
def test_a_batch_of_bulk_reads_and_appends_through_a_windowed_channel(store_dir: str, row: int) -> None:
    """The extent store under a small window: appends (sorted before the reads), whole-KPU reads, shifted reads."""
    g = Geometry(layers=4, batch=1, kv_heads=1, head_dim=row // 2, dtype_bytes=2, max_tokens=512)
    h = Harness(store_dir, g, 4096)
    h.ch = Channel(0, h.ch.engine, h.slot)
    h.ch.engine.ring.read_window = 3 * 4096
    n = g.max_tokens
    try:
        h.run([h.access(IOOp.WRITE, t, 0, n - 8) for t in range(2 * g.layers)])      # prefill
        for step in range(n - 8, n):                                                   # decode steps
            h.run([h.access(IOOp.READ, 0, 0, step), h.access(IOOp.WRITE, 1, step, 1),
                   h.access(IOOp.READ, 2, 0, step, shift=100), h.access(IOOp.WRITE, 3, step, 1),
                   h.access(IOOp.READ, 4, 1, step - 1)])
        h.run([h.access(IOOp.READ, t, 0, n) for t in range(2 * g.layers)])
        h.check_device()
    finally:
        h.close()


#: 4 KiB token rows; 8 MiB KPUs on the bulk session, 1 MiB on the appending one
BIG = {"layers": 1, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 2048}
SMALL = dict(BIG, layers=2, max_tokens=256)


def test_appends_complete_and_read_back_while_another_channel_reads_8_mib_again_and_again() -> None:
    with short_tmpdir() as d, DaemonProcess(d, {"device": {"size": "96M"}}).start() as dp, \
            Client(dp.socket_path) as c:
        bulk = c.open_session(BIG, mode="direct", channels=1)
        small = c.open_session(SMALL, mode="direct", channels=1)
        big = os.urandom(len(bulk.slot(0)))
        bulk.slot(0)[:] = big
        bulk.write(0, "k", 0)
        stop = threading.Event()
        reads: list[bool] = []

        def reader() -> None:
            while not stop.is_set():
                bulk.slot(0)[:8] = bytes(8)
                bulk.read(0, "k", 0)
                reads.append(bytes(bulk.slot(0)) == big)

        t = threading.Thread(target=reader)
        t.start()
        try:
            tokens = np.random.default_rng(3).integers(0, 256, (256, 4096), np.uint8)
            slot = small.slot(0)
            for i in range(256):
                slot[i * 4096:(i + 1) * 4096] = tokens[i].tobytes()
                small.submit(0, [small.range("write", 1, "v", i, 1)])
        finally:
            stop.set()
            t.join()
        slot[:] = bytes(len(slot))
        small.read(1, "v", 0)
        assert bytes(slot[:256 * 4096]) == tokens.tobytes()
        assert reads and all(reads)
