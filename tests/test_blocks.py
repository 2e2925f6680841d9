"""Block pools against a real daemon (bladed.server.blocks; docs/vllm.md), driven through the engine-free offload
core (bladed.integrations.offload) with torch tensors standing in for an engine's KV cache.

Blocks come back bit for bit from both paths, across a clean stop and a SIGKILL of the daemon and from another
client (a second engine); a full pool evicts its least recently used blocks or refuses a store, never waits;
a block that does not match its checksum, or that changed since it was pinned, fails to load (the engine
recomputes it) and is never handed over; with no daemon every lookup is a miss, every load fails, and one
warning says so; what a pool drops is TRIMmed and its files go.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from daemon_util import DaemonProcess, short_tmpdir

from bladed.blocks import PoolAttachment, PoolControl, PoolKey
from bladed.client import Client
from bladed.integrations.offload import BlockManager, BlockWorker
from bladed.protocol import BadRequestError, BusyError, FrameReader, IOOp, send_frame

PAGES, PAGE = 4, 8192
BLOCK_BYTES = PAGES * PAGE
CAPACITY = 16
KEY = PoolKey("blocks-test-model", "bfloat16", PAGES, PAGE, 32, CAPACITY * BLOCK_BYTES)
#: the engine's cache: 64 blocks of each of 4 pages
ENGINE_BLOCKS = 64


def config(pagecache: int) -> dict[str, dict[str, object]]:
    return {"budget": {"override": 64 << 20}, "blocks": {"max_bytes": "1M", "pagecache_bytes": pagecache}}


@pytest.fixture(params=["both", "device"])
def daemon(request: pytest.FixtureRequest) -> Iterator[DaemonProcess]:
    # page 0 (K and V KPUs of "layer" 0) in the page cache and page 2-3 on the extent, or everything on the extent
    pc = 2 * CAPACITY * PAGE if request.param == "both" else 0
    with short_tmpdir() as d, DaemonProcess(d, config(pc)).start() as dp:
        yield dp


def caches(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-128, 128, (ENGINE_BLOCKS, PAGE), dtype=torch.int8, generator=g) for _ in range(PAGES)]


def keys(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}{i:04d}".encode().ljust(36, b"\0") for i in range(n)]


def store(mgr: BlockManager, wk: BlockWorker, ks: list[bytes], block_ids: list[int], job: int = 1) -> list[bytes]:
    r = mgr.prepare_store(ks)
    assert r is not None
    by = {k: (s, g) for k, s, g in r.store}
    wk.submit(job, IOOp.WRITE, [b for k, b in zip(ks, block_ids, strict=True) if k in by],
              [by[k] for k in ks if k in by])
    wk.wait([job])
    wk.get_finished()
    return mgr.complete_store([k for k in ks if k in by])


def load(mgr: BlockManager, wk: BlockWorker, ks: list[bytes], block_ids: list[int], job: int = 2) -> list[int]:
    slots = mgr.prepare_load(ks)
    wk.submit(job, IOOp.READ, block_ids, slots)
    wk.wait([job])
    (done,) = wk.get_finished()
    mgr.complete_load(ks)
    return done.failed


def test_blocks_come_back_bit_for_bit_and_survive_restarts(daemon: DaemonProcess) -> None:
    src, dst = caches(1), caches(2)
    ks = keys(6)
    mgr = BlockManager(KEY, daemon.socket_path)
    wk = BlockWorker(KEY, src, slot_blocks=4, socket_path=daemon.socket_path)   # 6 blocks: two slot loads
    try:
        assert mgr.lookup(ks) == ["miss"] * 6
        assert store(mgr, wk, ks, [5, 9, 10, 11, 40, 2]) == ks
        assert mgr.lookup(ks + keys(1, "other")) == ["ready"] * 6 + ["miss"]
        # a store of blocks already held reserves nothing
        r = mgr.prepare_store(ks)
        assert r is not None and r.store == []
    finally:
        wk.shutdown()
        mgr.close()

    for how in ("clean", "sigkill"):
        if how == "clean":
            daemon.stop()
        else:
            os.kill(daemon.pid, signal.SIGKILL)
            daemon.kill()
        daemon.start()
        # another client (a second engine, or the same one restarted) finds them
        mgr2 = BlockManager(KEY, daemon.socket_path)
        wk2 = BlockWorker(KEY, dst, slot_blocks=4, socket_path=daemon.socket_path)
        try:
            assert mgr2.lookup(ks) == ["ready"] * 6
            assert load(mgr2, wk2, ks, [0, 1, 2, 3, 4, 5]) == []
        finally:
            wk2.shutdown()
            mgr2.close()
        for p in range(PAGES):
            assert torch.equal(dst[p][:6], src[p][[5, 9, 10, 11, 40, 2]])
        for p in range(PAGES):
            dst[p][:6] = 0
    with Client(daemon.socket_path) as c:
        assert c.stats()["blocks_stored"] == 0     # counted since this start: nothing stored in it


def test_a_full_pool_evicts_the_least_recently_used_or_refuses(daemon: DaemonProcess) -> None:
    src = caches(3)
    mgr = BlockManager(KEY, daemon.socket_path)
    wk = BlockWorker(KEY, src, slot_blocks=8, socket_path=daemon.socket_path)
    try:
        old = keys(CAPACITY, "old")
        store(mgr, wk, old[:8], list(range(8)))
        store(mgr, wk, old[8:], list(range(8, 16)), job=3)
        mgr.touch(old[:2])                        # the first two are the most recent now
        r = mgr.prepare_store(keys(3, "new"))
        assert r is not None and len(r.store) == 3
        assert r.evicted == old[2:5]
        mgr.complete_store(keys(3, "new"))        # the worker never wrote them: freed, not loadable
        assert mgr.lookup(keys(3, "new")) == ["miss"] * 3
        # every block pinned by a load: only the 3 free slots are reserved, the rest refused at once
        pinned = mgr.prepare_load(old[:2] + old[5:])
        assert all(x is not None for x in pinned)
        r = mgr.prepare_store(keys(CAPACITY, "more"))
        assert r is not None and (len(r.store), r.evicted, r.refused) == (3, [], CAPACITY - 3)
        # every slot pinned or being stored: nothing can be stored, and nothing waits
        assert mgr.prepare_store(keys(2, "extra")) is None
        mgr.complete_store(keys(CAPACITY, "more"))
        mgr.complete_load(old[:2] + old[5:])
        with Client(daemon.socket_path) as c:
            st = c.stats()
            assert st["blocks_evicted"] == 3 and st["blocks_refused"] == CAPACITY - 3 + 2
    finally:
        wk.shutdown()
        mgr.close()


def test_a_corrupt_or_replaced_block_fails_to_load(daemon: DaemonProcess) -> None:
    src, dst = caches(4), caches(5)
    ks = keys(3)
    mgr = BlockManager(KEY, daemon.socket_path)
    wk = BlockWorker(KEY, src, slot_blocks=4, socket_path=daemon.socket_path)
    try:
        store(mgr, wk, ks, [1, 2, 3])
        slots = mgr.prepare_load(ks)
        mgr.complete_load(ks)
        with Client(daemon.socket_path) as c:
            (pool,) = c.call("blocks", action="pools")["pools"]
        s1 = slots[1]
        assert s1 is not None
        # damage block 1's last page where it lies: the store file on the extent, at its row of KPU 3
        store_file = os.path.join(daemon.state_dir, "kv-store.img")
        with Client(daemon.socket_path) as c:
            start = c.call("blocks", action="pools")["pools"][0]
        assert start["pool"] == pool["pool"]
        damage_row(daemon, pool["pool"], 3, s1[0], store_file)
        wk2 = BlockWorker(KEY, dst, slot_blocks=4, socket_path=daemon.socket_path)
        try:
            assert sorted(load(mgr, wk2, ks, [10, 11, 12])) == [11]
            for p in range(PAGES):                # the other two are there; block 11 keeps what it had
                assert torch.equal(dst[p][[10, 12]], src[p][[1, 3]])
            assert not torch.equal(dst[3][11], src[3][2])
            # a block evicted and replaced after the pin is refused too (its generation changed)
            pins = mgr.prepare_load(ks[:1])
            ctl = PoolControl(Client(daemon.socket_path), KEY)
            assert ctl.verify([pins[0]]) == [True]  # type: ignore[list-item]
            mgr.complete_load(ks[:1])
            assert ctl.evict(ks[:1]) == ks[:1]
            assert ctl.verify([pins[0]]) == [False]  # type: ignore[list-item]
            ctl.client.close()
        finally:
            wk2.shutdown()
    finally:
        wk.shutdown()
        mgr.close()


def damage_row(daemon: DaemonProcess, pool_id: str, kpu: int, slot: int, store_file: str) -> None:
    """Flip the bytes of one KPU's row of ``slot``: in its page-cache file, or on the extent of the store."""
    pc = os.path.join(daemon.state_dir, "pagecache", f"prefix-{pool_id}", f"{'kv'[kpu % 2]}{kpu // 2}.kv")
    if os.path.exists(pc):
        path, off = pc, slot * PAGE
    else:
        (rec,) = [r for r in journal(daemon)["retained"] if r["id"] == pool_id]
        start = rec["extents"][0][0]
        direct = [t for t in range(PAGES) if not os.path.exists(
            os.path.join(daemon.state_dir, "pagecache", f"prefix-{pool_id}", f"{'kv'[t % 2]}{t // 2}.kv"))]
        path = store_file
        off = start * 4096 + direct.index(kpu) * CAPACITY * PAGE + slot * PAGE
    fd = os.open(path, os.O_RDWR)
    try:
        row = bytearray(os.pread(fd, PAGE, off))
        os.pwrite(fd, bytes(b ^ 0xFF for b in row), off)
        os.fsync(fd)
    finally:
        os.close(fd)


def journal(daemon: DaemonProcess) -> dict[str, Any]:
    with open(os.path.join(daemon.state_dir, "journal.json")) as f:
        return json.load(f)


def test_no_daemon_is_a_miss_and_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with short_tmpdir() as d:
        sock = os.path.join(d, "nothing.sock")
        log = logging.getLogger("bladed.test.offload")
        mgr = BlockManager(KEY, sock, log)
        wk = BlockWorker(KEY, caches(6), slot_blocks=4, socket_path=sock, log=log)
        try:
            with caplog.at_level(logging.WARNING, logger="bladed.test.offload"):
                assert mgr.lookup(keys(2)) == ["miss", "miss"]
                assert mgr.prepare_store(keys(2)) is None
                assert load(mgr, wk, keys(2), [0, 1]) == [0, 1]
                assert mgr.lookup(keys(2)) == ["miss", "miss"]
            warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
            # one line per side (the scheduler's and the worker's connection), not one per call
            assert len(warnings) == 2 and all("bladed unreachable" in r.getMessage() for r in warnings)
        finally:
            wk.shutdown()
            mgr.close()


def test_dropped_blocks_are_trimmed_and_a_dropped_pool_leaves_nothing(daemon: DaemonProcess) -> None:
    mgr = BlockManager(KEY, daemon.socket_path)
    wk = BlockWorker(KEY, caches(7), slot_blocks=8, socket_path=daemon.socket_path)
    try:
        with Client(daemon.socket_path) as c:
            wear0 = c.wear()["today"]["direct_bytes"]
        store(mgr, wk, keys(8), list(range(8)))
        with Client(daemon.socket_path) as c:
            # the blocks' direct-path pages are in the wear ledger, as bladed's own writes of today
            (pool,) = c.call("blocks", action="pools")["pools"]
            assert c.wear()["today"]["direct_bytes"] - wear0 == 8 * (PAGES - pool["group1_kpus"]) * PAGE
            before = c.stats()["trimmed_bytes"]
            gone = mgr.evict_all()
            assert sorted(gone) == sorted(keys(8))
            after = c.stats()["trimmed_bytes"]
            (pool,) = c.call("blocks", action="pools")["pools"]
            # the extent's share of 8 blocks is deallocated (the page-cache rows are punched)
            direct_pages = PAGES - pool["group1_kpus"]
            assert after - before == 8 * direct_pages * PAGE
    finally:
        wk.shutdown()
        mgr.close()
    with Client(daemon.socket_path) as c:
        used = c.status()["extents"]["used_blocks"]
        c.call("blocks", action="drop_pool", pool=pool["pool"])
        assert c.call("blocks", action="pools")["pools"] == []
        assert c.status()["extents"]["used_blocks"] == used - pool["device_bytes"] // 4096
    assert not os.path.exists(os.path.join(daemon.state_dir, "pagecache", f"prefix-{pool['pool']}"))
    assert not os.path.exists(os.path.join(daemon.state_dir, "blocks", f"{pool['pool']}.idx"))
    assert [r for r in journal(daemon)["retained"] if r["id"] == pool["pool"]] == []


def test_bad_keys_and_shapes_are_one_line_errors() -> None:
    with short_tmpdir() as d, DaemonProcess(d, config(0)).start() as dp, Client(dp.socket_path) as c:
        with pytest.raises(BadRequestError, match=r"multiple of the store's 4096-byte LBA"):
            PoolControl(c, PoolKey("m", "bfloat16", 4, 1000, 32, 1 << 20))
        ctl = PoolControl(c, KEY)
        with pytest.raises(BadRequestError, match=r"not a block key"):
            c.call("blocks", action="lookup", pool=ctl.id, keys=["zz"])
        with pytest.raises(BadRequestError, match=r"no block pool 'nope'"):
            c.call("blocks", action="lookup", pool="nope", keys=[])
        att = PoolAttachment(c, KEY, slot_blocks=2)
        with pytest.raises(ValueError, match=r"do not fit a slot of 2"):
            att.move(IOOp.READ, [0, 1, 2])
        with pytest.raises(BadRequestError, match=r"attachment to a block pool"):
            c.call("retain", session=att.session.id, tokens=list(range(32)))
        att.close()
        # the pool's blocks lie on the region: a whole-region TRIM is refused until it is dropped
        with pytest.raises(BusyError, match=r"block pool\(s\) hold blocks"):
            c.trim()
        ctl.drop()
        assert c.trim()["trimmed_bytes"] > 0


def test_a_protocol_4_client_is_still_served() -> None:
    """Protocol 5 added block pools; a client of protocol 4 (prefix reuse) opens sessions as before."""
    with short_tmpdir() as d, DaemonProcess(d, config(0)).start() as dp:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(dp.socket_path)
        send_frame(sock, {"op": "hello", "id": 0, "protocol": 4, "client": "old"})
        body = FrameReader(sock).read().body
        assert body["ok"] and body["protocol"] == 4
        sock.close()


def test_a_restarted_daemon_is_found_again_at_once(daemon: DaemonProcess, caplog: pytest.LogCaptureFixture) -> None:
    """The connections of the engine's two sides die with the daemon; the next call makes a new one and is
    served (no miss, no warning): a restart between two requests costs nothing."""
    src, dst = caches(8), caches(9)
    mgr = BlockManager(KEY, daemon.socket_path)
    wk = BlockWorker(KEY, src, slot_blocks=4, socket_path=daemon.socket_path)
    wk2 = BlockWorker(KEY, dst, slot_blocks=4, socket_path=daemon.socket_path)
    try:
        store(mgr, wk, keys(2), [3, 4])
        assert load(mgr, wk2, keys(2), [0, 1]) == []     # wk2 is attached now
        daemon.stop()
        daemon.start()
        with caplog.at_level(logging.WARNING):
            assert mgr.lookup(keys(2)) == ["ready", "ready"]
            for p in range(PAGES):
                dst[p][:2] = 0
            assert load(mgr, wk2, keys(2), [0, 1], job=5) == []
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        for p in range(PAGES):
            assert torch.equal(dst[p][:2], src[p][[3, 4]])
    finally:
        wk.shutdown()
        wk2.shutdown()
        mgr.close()


def test_the_vllm_integration_imports_without_vllm() -> None:
    """The rest of bladed (and this environment) has no vLLM: the module imports, and its spec refuses to be
    made with one line naming what to install."""
    import subprocess
    import sys

    code = ("import importlib.util, sys\n"
            "assert importlib.util.find_spec('vllm') is None\n"
            "import bladed.integrations.vllm as v\n"
            "try:\n"
            "    v.BladedOffloadingSpec(None)\n"
            "except ImportError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.count("\n") == 1 and "tools/setup.sh --vllm" in out and "vLLM 0.32.0" in out, out
