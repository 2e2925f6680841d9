"""Faults against a real daemon: clients SIGKILLed at random points (1000 times),
the daemon SIGKILLed during heavy writes and restarted, device I/O errors (a
loop device whose backing file sits on a filesystem that fills up, and a file
store on a full filesystem), region full / quota exceeded, and memory pressure.

After every fault: zero sessions, zero extents in use, every freed extent
TRIMmed (file store: punched holes, so ``st_blocks`` is back where it was), no
page-cache files, the journal empty, the daemon's RSS and descriptor count
stable, and the daemon still serving.

The kills are cheap: a single-threaded *spawner* process (this file run as a
script) forks one client per round; the child reports each step on a pipe
before doing it, and the spawner SIGKILLs it right after the step it drew.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import psutil
import pytest
from daemon_util import ROOT, ClientProcess, DaemonProcess, env_with_repo, short_tmpdir, wait_connections

from bladed.client import Client, DaemonLostError, NoMemoryError, NoSpaceError, QuotaExceededError, RemoteIOError

# on both engines, io_uring and the portable one (issue 29)
pytestmark = pytest.mark.usefixtures("io_engine")

KILLS = int(os.environ.get("BLADED_FAULT_KILLS", "1000"))
#: 4096-byte tokens (aligned) and 768-byte tokens (padded rows on the extent)
GEOMETRIES = [
    {"layers": 4, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 16},
    {"layers": 3, "batch": 1, "kv_heads": 3, "head_dim": 64, "dtype_bytes": 4, "max_tokens": 20},
    {"layers": 2, "batch": 1, "kv_heads": 2, "head_dim": 64, "dtype_bytes": 2, "max_tokens": 64},
]
MODES = ["dualblade", "direct", "baseline", "cachepolicy"]
STEPS = ["connect", "open", "write", "write", "read", "write_async", "read", "close", "open", "write", "exit"]


@pytest.fixture
def tmp() -> Iterator[str]:
    with short_tmpdir() as d:
        yield d


def journal_sessions(state_dir: str) -> list[dict]:
    with open(os.path.join(state_dir, "journal.json")) as f:
        return list(json.load(f)["sessions"])


def wait_idle(c: Client, timeout: float = 60.0) -> dict:
    """Stats once every connection but ``c`` is torn down, those of clients killed right after they connected
    too (:func:`wait_connections` with ``queued``); a connection goes after its sessions, so these are closed."""
    st = wait_connections(c, 1, timeout, queued=True)
    assert st["sessions"] == 0 and st["extents"]["used_blocks"] == 0 \
        and st["sessions_opened"] == st["sessions_closed"], f"sessions not released: {st}"
    return st


def assert_clean(d: DaemonProcess, c: Client, store: str | None, baseline_blocks: int | None) -> dict:
    st = wait_idle(c)
    assert journal_sessions(d.state_dir) == []
    pc = os.path.join(d.state_dir, "pagecache")
    assert not os.path.isdir(pc) or os.listdir(pc) == [], os.listdir(pc)
    if store is not None and baseline_blocks is not None:
        # every freed extent was TRIMmed: a punched hole allocates nothing
        assert os.stat(store).st_blocks <= baseline_blocks, (os.stat(store).st_blocks, baseline_blocks)
    return st


# -- 1000 client kills ---------------------------------------------------------------------------
def child_main(sock_path: str, seed: int, wfd: int) -> None:  # pragma: no cover - runs in the forked child
    """One client's life; reports step i on the pipe before doing it."""
    rng = random.Random(seed)
    client: Client | None = None
    sess = None
    geo = rng.choice(GEOMETRIES)
    kpu = geo["max_tokens"] * geo["batch"] * geo["kv_heads"] * geo["head_dim"] * geo["dtype_bytes"]
    for i, step in enumerate(STEPS):
        os.write(wfd, bytes([i]))
        if step == "connect":
            client = Client(sock_path, timeout=30)
        elif step == "open":
            assert client is not None
            sess = client.open_session(geo, mode=rng.choice(MODES), channels=rng.choice([1, 2]))
        elif step in ("write", "read", "write_async"):
            assert sess is not None
            layer, kind = rng.randrange(geo["layers"]), rng.choice("kv")
            if step == "write_async":
                futs = [sess.write_async(x % geo["layers"], "kv"[x % 2], 0) for x in range(2 * geo["layers"])]
                for f in futs:
                    f.result(30)
                continue
            sess.slot(0)[:kpu] = rng.randbytes(kpu)
            (sess.write if step == "write" else sess.read)(layer, kind, 0)
        elif step == "close":
            assert sess is not None
            sess.close()
        elif step == "exit":
            assert client is not None
            client.close()
    os._exit(0)


def spawner_main(sock_path: str, rounds: int, seed: int) -> None:  # pragma: no cover - its own process
    """Fork ``rounds`` clients and SIGKILL each at a random step; prints one JSON summary line."""
    rng = random.Random(seed)
    killed, finished, failed = 0, 0, 0
    where: dict[str, int] = {}
    for n in range(rounds):
        at = rng.randrange(len(STEPS) + 1)   # len(STEPS): let it run to the end
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                child_main(sock_path, seed * 100003 + n, w)
            except BaseException:
                os._exit(3)
        os.close(w)
        reached = -1
        while reached < at:
            b = os.read(r, 1)
            if not b:
                break
            reached = b[0]
        if reached >= at and at < len(STEPS):
            # a little random spin: the kill lands before, during or after the step's request
            for _ in range(rng.choice([0, 0, 10, 1000, 20000])):
                pass
            os.kill(pid, signal.SIGKILL)
        os.close(r)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            killed += 1
            where[STEPS[min(at, len(STEPS) - 1)]] = where.get(STEPS[min(at, len(STEPS) - 1)], 0) + 1
        elif os.WEXITSTATUS(status) == 0:
            finished += 1
        else:
            failed += 1
    print(json.dumps({"killed": killed, "finished": finished, "failed": failed, "where": where}), flush=True)


def run_kills(sock_path: str, rounds: int, seed: int) -> dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--spawner", sock_path, str(rounds),
                          str(seed)], cwd=ROOT, env=env_with_repo(), capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-4000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.slow
def test_1000_clients_sigkilled_at_random_points_leave_nothing_behind(tmp: str) -> None:
    cfg = {"budget": {"override": 6 * 64 * 1024}, "device": {"size": "64M"}}
    with DaemonProcess(tmp, cfg).start() as d, Client(d.socket_path) as c:
        store = os.path.join(tmp, "kv-store.img")
        # the first session's teardown punches the fallocated store: from then on it only shrinks
        with c.open_session(GEOMETRIES[0], mode="direct", channels=1):
            pass
        baseline = os.stat(store).st_blocks
        proc = psutil.Process(d.pid)
        warm = run_kills(d.socket_path, max(1, KILLS // 10), seed=1)
        assert_clean(d, c, store, baseline)
        rss0, fds0 = proc.memory_info().rss, proc.num_fds()
        t0 = time.monotonic()
        res = run_kills(d.socket_path, KILLS - warm["killed"] - warm["finished"], seed=2)
        secs = time.monotonic() - t0
        st = assert_clean(d, c, store, baseline)
        rss1, fds1 = proc.memory_info().rss, proc.num_fds()
        total_killed = warm["killed"] + res["killed"]
        print(f"\nkills: {total_killed} killed, {warm['finished'] + res['finished']} ran to the end, "
              f"{secs:.1f} s; where {res['where']}; sessions opened {st['sessions_opened']}, "
              f"trimmed {st['trimmed_bytes']} bytes; RSS {rss0 >> 20} -> {rss1 >> 20} MiB, fds {fds0} -> {fds1}")
        assert warm["failed"] == 0 and res["failed"] == 0
        assert total_killed >= 0.8 * KILLS
        assert rss1 - rss0 < 24 << 20, f"daemon RSS grew {rss0} -> {rss1}"
        assert fds1 <= fds0 + 2
        assert st["trimmed_bytes"] > 0
        # and it still serves
        with c.open_session(GEOMETRIES[0], channels=2) as s:
            s.slot(1)[:] = b"\x77" * len(s.slot(1))
            s.write(3, "v", 1)
            s.slot(0)[:] = bytes(len(s.slot(0)))
            s.read(3, "v", 0)
            assert bytes(s.slot(0)) == b"\x77" * len(s.slot(0))


# -- daemon killed during heavy writes ---------------------------------------------------------------
@pytest.mark.slow
def test_daemon_sigkilled_during_heavy_writes_restarts_clean_and_clients_reconnect(tmp: str) -> None:
    # Group 1 on disk files too: the killed instance leaves them for the next start (memory files go with it)
    cfg = {"budget": {"override": 4 * 64 * 1024}, "pagecache": {"backing": "disk"}}
    store = os.path.join(tmp, "kv-store.img")
    geo = GEOMETRIES[0]
    for rnd in range(3):
        with DaemonProcess(tmp, cfg).start() as d, contextlib.ExitStack() as stack:
            if rnd == 0:
                with Client(d.socket_path) as c:
                    c.open_session(geo, channels=1).close()
                baseline = os.stat(store).st_blocks
            clients = [stack.enter_context(ClientProcess(d.socket_path)) for _ in range(3)]
            for i, cp in enumerate(clients):
                cp.call("connect")
                cp.call("open", geometry=geo, mode=MODES[i % 2])
                cp.call("write_all", seed=i)
                assert cp.call("write_loop")["looping"]
            with Client(d.socket_path) as c:
                assert c.stats()["sessions"] == 3
            d.kill()
            for cp in clients:
                lost = cp.call("read", layer=0, kind="k", expect_error=True)
                assert lost["exception"] == "DaemonLostError" and "reconnect" in lost["message"]
            assert len(journal_sessions(tmp)) == 3
            assert os.listdir(os.path.join(tmp, "pagecache"))  # stale files of the killed instance
            with DaemonProcess(tmp, cfg).start() as d2:
                rec = d2.wait_event("reclaim")                  # what the start itself does, once
                assert rec["sessions"] == "3"
                with Client(d2.socket_path) as c:
                    assert_clean(d2, c, store, baseline)
                for i, cp in enumerate(clients):
                    cp.call("connect")
                    cp.call("open", geometry=geo)
                    cp.call("write_all", seed=10 + i)
                    assert cp.call("check_all", seed=10 + i)["bad"] == []
                    cp.call("close")
    with pytest.raises((DaemonLostError, FileNotFoundError, ConnectionRefusedError)):
        Client(os.path.join(tmp, "bladed.sock"))


# -- region full / quota --------------------------------------------------------------------------------
def test_refused_opens_leave_nothing_half_allocated(tmp: str) -> None:
    geo = dict(GEOMETRIES[0], max_tokens=32)               # 8 KPUs of 128 KiB
    cfg = {"budget": {"override": 2 * 128 * 1024}, "device": {"size": "2M"},
           "access": {"quota_bytes": 4 << 20}}
    with DaemonProcess(tmp, cfg).start() as d, Client(d.socket_path) as c:
        first = c.open_session(geo, channels=1)             # 256 KiB page cache + 768 KiB extent
        used = c.stats()["extents"]["used_blocks"]
        for _ in range(20):
            with pytest.raises(NoSpaceError, match="region"):
                c.open_session(dict(geo, max_tokens=80), mode="direct", channels=1)
            with pytest.raises(QuotaExceededError, match=r"access\.quota_bytes"):
                c.open_session(dict(geo, layers=16), mode="baseline", channels=1)
        st = c.stats()
        assert st["sessions"] == 1 and st["extents"]["used_blocks"] == used
        assert len(journal_sessions(tmp)) == 1
        # nothing on disk: the refused sessions left no directory, and the open one's Group 1 is in memory files
        assert os.listdir(os.path.join(tmp, "pagecache")) == []
        first.close()
        assert_clean(d, c, None, None)
        c.open_session(dict(geo, max_tokens=64), mode="direct", channels=1).close()  # the whole region again


# -- I/O errors ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def small_fs(kind: str, size: str, where: str) -> Iterator[str]:
    """A small tmpfs, or an ext4 or ext2 image on a loop device, mounted at ``where`` (ext2 has no
    ``fallocate``: files there are sparse)."""
    if os.geteuid() != 0:
        pytest.fail("I/O error injection needs root (mount, losetup), as CI runs")
    os.makedirs(where, exist_ok=True)
    if kind == "tmpfs":
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", where], check=True)
    else:
        img = where + ".img"
        with open(img, "wb") as f:
            f.truncate(int(size.rstrip("M")) << 20)
        subprocess.run(["mkfs.ext2", "-q", "-F", img] if kind == "ext2" else
                       ["mkfs.ext4", "-q", "-F", "-O", "^has_journal", img], check=True)
        subprocess.run(["mount", "-o", "loop", img, where], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", where], check=False)


@contextlib.contextmanager
def loop_over(backing: str) -> Iterator[str]:
    dev = subprocess.run(["losetup", "--find", "--show", backing], check=True, capture_output=True,
                         text=True).stdout.strip()
    try:
        yield dev
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)


def fill(path: str, chunk_bytes: int = 1 << 20) -> None:
    """Write a file until the filesystem is full (to within one chunk)."""
    with open(path, "wb", buffering=0) as f, contextlib.suppress(OSError):
        chunk = b"\xee" * chunk_bytes
        while True:
            f.write(chunk)


def io_error_scenario(d: DaemonProcess, geo: dict, filler: str) -> str:
    """A victim session hits the full filesystem; a bystander and the daemon carry on."""
    kpu = geo["max_tokens"] * geo["batch"] * geo["kv_heads"] * geo["head_dim"] * geo["dtype_bytes"]
    with Client(d.socket_path) as c:
        by = c.open_session(geo, mode="direct", channels=1)
        by.slot(0)[:] = b"\x42" * kpu
        by.write(0, "k", 0)                       # stored before the filesystem fills
        fill(filler)
        victim = c.open_session(geo, mode="direct", channels=1)
        victim.slot(0)[:] = b"\x13" * kpu
        err = None
        for layer in range(geo["layers"]):
            for kind in "kv":
                try:
                    victim.write(layer, kind, 0)
                except RemoteIOError as e:
                    err = e
        assert err is not None, "no write failed on a full filesystem"
        msg = str(err)
        assert err.code.value == "io_error" and "write" in msg.lower() and "lba" in msg.lower(), msg
        victim.close()                             # the failed session still closes cleanly
        by.slot(0)[:] = bytes(kpu)
        by.read(0, "k", 0)
        assert bytes(by.slot(0)) == b"\x42" * kpu  # the other session's data is intact
        st = c.stats()
        assert st["io"]["direct"]["write"]["errors"] >= 1
        by.close()
        os.unlink(filler)
        # space is back: the daemon serves new sessions normally
        with c.open_session(geo, mode="direct", channels=1) as s:
            s.slot(0)[:] = b"\x21" * kpu
            s.write(1, "v", 0)
            s.slot(0)[:] = bytes(kpu)
            s.read(1, "v", 0)
            assert bytes(s.slot(0)) == b"\x21" * kpu
        wait_idle(c)
    return msg


@pytest.mark.root
def test_io_errors_on_a_loop_device_over_a_full_filesystem(tmp: str) -> None:
    geo = dict(GEOMETRIES[0], max_tokens=64)            # 256 KiB KPUs
    with small_fs("tmpfs", "4M", os.path.join(tmp, "fs")) as fs:
        backing = os.path.join(fs, "backing.img")
        with open(backing, "wb") as f:
            f.truncate(64 << 20)                        # sparse: bigger than the filesystem under it
        with loop_over(backing) as dev:
            cfg = {"device": {"backend": "block", "path": dev}, "budget": {"override": 0}}
            with DaemonProcess(tmp, cfg).start() as d:
                msg = io_error_scenario(d, geo, os.path.join(fs, "filler"))
                assert d.proc is not None and d.proc.poll() is None
                print(f"\nloop/tmpfs I/O error reached the client as: {msg}")


@pytest.mark.root
def test_io_errors_on_a_file_store_on_a_full_filesystem(tmp: str) -> None:
    geo = dict(GEOMETRIES[0], max_tokens=64)
    with small_fs("ext4", "24M", os.path.join(tmp, "fs")) as fs:
        cfg = {"device": {"path": os.path.join(fs, "store.img"), "size": "16M"}, "budget": {"override": 0}}
        with DaemonProcess(tmp, cfg).start() as d:
            with Client(d.socket_path) as c:
                # TRIM of a session spanning the whole store punches the fallocated file: space to lose
                c.open_session(dict(geo, max_tokens=512), mode="direct", channels=1).close()
            msg = io_error_scenario(d, geo, os.path.join(fs, "filler"))
            assert "No space" in msg or "ENOSPC" in msg or "errno 28" in msg.lower() or "28" in msg, msg


@pytest.mark.root
@pytest.mark.parametrize(("fs_kind", "fs_size", "bad_layer"), [("tmpfs", "2M", 1), ("ext2", "8M", 0)],
                         ids=["general-path", "lane"])
def test_a_page_cache_range_that_fails_fails_alone_and_the_batch_completes(tmp: str, fs_kind: str, fs_size: str,
                                                                          bad_layer: int) -> None:
    """A batch of page-cache writes on a full filesystem: the failing range fails alone, naming its KPU and the
    cause; the other range is stored, and the failure is counted.  ``general-path``: layer 1 V's file cannot be
    made.  ``lane``: both files exist, so the C loop serves the batch; ext2 has no ``fallocate``, so layer 0 V's
    file is sparse and a write into its hole fails while a rewrite of stored rows succeeds."""
    geo = dict(GEOMETRIES[0], max_tokens=64)             # 256 KiB KPUs, 4 KiB rows
    kpu, tb = 64 * 4096, 4096
    with small_fs(fs_kind, fs_size, os.path.join(tmp, "fs")) as fs:
        cfg = {"pagecache": {"directory": fs}, "budget": {"override": 64 << 20}}
        with DaemonProcess(tmp, cfg).start() as d, Client(d.socket_path) as c, \
                c.open_session(geo, mode="baseline", channels=1, slot_bytes=2 * kpu) as s:
            s.slot(0)[:kpu] = b"\x42" * kpu
            s.write(0, "k", 0)                       # layer 0 K's file exists, every row stored
            if bad_layer == 0:
                s.write(0, "v", 0, 0, 1)             # layer 0 V's file exists; token 7 is a hole
            for size in (1 << 20, 4096, 1024):       # every last block (1 MiB writes leave up to 1 MiB)
                fill(os.path.join(fs, f"filler-{size}"), size)
                os.sync()
            s.slot(0)[:2 * tb] = os.urandom(2 * tb)
            ok, bad = s.submit(0, [s.range("write", 0, "k", 7, 1, slot_offset=0),
                                   s.range("write", bad_layer, "v", 7, 1, slot_offset=tb)], check=False)
            assert ok.error is None and ok.path == "pagecache" and ok.nbytes == tb
            assert isinstance(bad.error, RemoteIOError), bad
            assert f"page-cache write of v{bad_layer}" in str(bad.error) and "No space" in str(bad.error), \
                str(bad.error)
            want = bytes(s.slot(0)[:tb])
            s.read(0, "k", 0, 7, 1)
            assert bytes(s.slot(0)[7 * tb:8 * tb]) == want
            assert c.stats()["io"]["pagecache"]["write"]["errors"] == 1


@pytest.mark.root
def test_a_direct_range_that_fails_on_the_lane_fails_alone_and_the_batch_completes(tmp: str) -> None:
    """A loop device over a sparse file on a full tmpfs: a rewrite of stored blocks succeeds, a write into fresh
    blocks fails.  Both KPUs were used already, so the lane runs the batch in C: the failing range fails alone with
    the general path's message (its KPU, the LBA), the other is stored, and the failure is counted."""
    geo = dict(GEOMETRIES[0], max_tokens=64)             # 256 KiB KPUs, 4 KiB rows: whole LBAs
    tb = 4096
    with small_fs("tmpfs", "4M", os.path.join(tmp, "fs")) as fs:
        backing = os.path.join(fs, "backing.img")
        with open(backing, "wb") as f:
            f.truncate(64 << 20)
        with loop_over(backing) as dev:
            cfg = {"device": {"backend": "block", "path": dev}, "budget": {"override": 0}}
            with DaemonProcess(tmp, cfg).start() as d, Client(d.socket_path) as c, \
                    c.open_session(geo, mode="direct", channels=1) as s:
                slot = s.slot(0)                     # the default layout: token t at slot offset t * 4096
                slot[:] = b"\x42" * len(slot)
                s.write(0, "k", 0, 0, 1)             # both KPUs used: their LBAs bound, the lane serves them
                s.write(0, "v", 0, 0, 1)
                fill(os.path.join(fs, "filler"), 4096)
                (before,) = c.sessions()
                slot[:] = os.urandom(len(slot))
                ok, bad = s.submit(0, [s.range("write", 0, "k", 0, 1), s.range("write", 0, "v", 40, 1)],
                                   check=False)
                (after,) = c.sessions()
                assert after["lane_requests"] == before["lane_requests"] + 1
                assert ok.error is None and ok.path == "direct" and ok.nbytes == tb
                assert isinstance(bad.error, RemoteIOError), bad
                assert "direct write of v0" in str(bad.error) and "LBA" in str(bad.error), str(bad.error)
                print(f"\nthe lane's failure reached the client as: {bad.error}")
                want = bytes(slot[:tb])
                slot[:] = bytes(len(slot))
                s.read(0, "k", 0, 0, 1)
                assert bytes(slot[:tb]) == want
                assert c.stats()["io"]["direct"]["write"]["errors"] == 1


def oom_kills(cgroup: str) -> int:
    for name in ("memory.oom_control", "memory.events"):
        with contextlib.suppress(FileNotFoundError), open(os.path.join(cgroup, name)) as f:
            for line in f:
                k, _, v = line.partition(" ")
                if k == "oom_kill":
                    return int(v)
    return 0


# -- memory pressure ---------------------------------------------------------------------------------
@pytest.mark.root
def test_memory_pressure_shrinks_the_budget_without_an_oom_kill(tmp: str) -> None:
    from cgroup_util import ChildCgroup

    geo = dict(GEOMETRIES[0], max_tokens=256)           # 1 MiB KPUs, 8 MiB of KV
    kpu = 1 << 20
    with ChildCgroup(512 << 20) as cg:
        # the headroom fraction alone: the limit below leaves the daemon a few MiB, which budget.absorb_rate's floor
        # for a neighbour's growth (25.6 MiB by default) would take whole (test_pagecache_memory.py tests that floor)
        cfg = {"budget": {"interval_s": 0.5, "cgroup": cg.path, "absorb_rate": 0}, "device": {"size": "64M"}}
        with DaemonProcess(tmp, cfg).start() as d:
            cg.add(d.pid)
            with Client(d.socket_path) as c:
                big = c.budget()["sample"]["pagecache_budget_bytes"]
                s1 = c.open_session(geo, channels=1)
                assert s1.plan["group1_layers"] == geo["layers"]       # everything fits at first
                for layer in range(geo["layers"]):
                    s1.slot(0)[:] = bytes([layer]) * kpu
                    s1.write(layer, "k", 0)
                # the operator lowers the limit while the session runs
                usage_file = "memory.usage_in_bytes" if cg.version == "v1" else "memory.current"
                with open(os.path.join(cg.path, usage_file)) as f:
                    usage = int(f.read())
                cg.set_limit(usage + (6 << 20))
                small = c.budget()["sample"]["pagecache_budget_bytes"]
                assert small < big and small <= usage + (6 << 20)
                s2 = c.open_session(geo, channels=1)
                assert s2.plan["group1_layers"] < geo["layers"], s2.plan  # the new plan sees the smaller budget
                for layer in range(geo["layers"]):
                    s2.slot(0)[:] = bytes([100 + layer]) * kpu
                    s2.write(layer, "v", 0)
                for layer in range(geo["layers"]):
                    s1.read(layer, "k", 0)
                    assert bytes(s1.slot(0)) == bytes([layer]) * kpu
                    s2.read(layer, "v", 0)
                    assert bytes(s2.slot(0)) == bytes([100 + layer]) * kpu
                s1.close()
                s2.close()
                assert oom_kills(cg.path) == 0
            assert d.proc is not None and d.proc.poll() is None, "the daemon was killed under memory pressure"
            assert d.stop() == 0


@pytest.mark.root
def test_a_session_whose_staging_cannot_fit_the_memory_limit_is_refused_not_oom_killed(tmp: str) -> None:
    """The limit cut to 10 MiB above what the daemon holds: a session whose staging (4 x 1 MiB slots, touched by
    the daemon as it serves) and working reserve (9 MiB) would overfill the cgroup is refused with no_memory,
    naming the fix; one with 1 MiB of staging (and 7 MiB of reserve) is served; nothing is OOM-killed (found by
    tests/test_stateful_daemon.py: the daemon was)."""
    from cgroup_util import ChildCgroup

    geo = dict(GEOMETRIES[0], max_tokens=256)           # 1 MiB KPUs: a slot of 1 MiB per channel
    with ChildCgroup(512 << 20) as cg:
        # budget.absorb_rate's floor at its default: it keeps room for a neighbour while KV is demoted, and staging
        # (never demoted) is measured without it, so 10 MiB of room still serves 1 MiB of staging
        cfg = {"budget": {"interval_s": 0.5, "cgroup": cg.path}, "device": {"size": "64M"}}
        with DaemonProcess(tmp, cfg).start() as d:
            cg.add(d.pid)
            with Client(d.socket_path) as c:
                sample = c.budget()["sample"]
                cg.set_limit(sample["anon_shmem_bytes"] + sample["pinned_bytes"] + (10 << 20))
                with pytest.raises(NoMemoryError, match=r"staging \(4 x 1048576 bytes\) does not fit in the daemon's "
                                                        r"memory: .* raise the daemon's memory limit"):
                    c.open_session(geo, channels=4)
                with c.open_session(geo, channels=1) as s:      # 1 MiB of staging fits
                    s.slot(0)[:] = b"\x5a" * (1 << 20)
                    s.write(0, "k", 0)
                    s.slot(0)[:] = bytes(1 << 20)
                    s.read(0, "k", 0)
                    assert bytes(s.slot(0)) == b"\x5a" * (1 << 20)
                assert c.stats()["sessions"] == 0
                assert oom_kills(cg.path) == 0
            assert d.stop() == 0


if __name__ == "__main__":  # pragma: no cover
    if sys.argv[1] == "--spawner":
        sys.path.insert(0, ROOT)
        threading.excepthook = lambda args: None
        spawner_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
