"""A real bladed process on a file-backed store and on a loop device, driven
by client processes: bytes round-trip on both paths, teardown TRIMs, a killed
client or daemon is cleaned up, and peers only reach what they may."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from daemon_util import ClientProcess, DaemonProcess, short_tmpdir

from bladed.client import Client

# on both engines, io_uring and the portable one (issue 29)
pytestmark = pytest.mark.usefixtures("io_engine")

#: token = 2*8*128*2 = 4096 bytes: the §IV-B alignment precondition holds
ALIGNED = {"layers": 4, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 32}
KPU = 32 * 4096
#: token = 3*64*4 = 768 bytes (SmolLM2-like, fp32): padded rows on the extent
UNALIGNED = {"layers": 3, "batch": 1, "kv_heads": 3, "head_dim": 64, "dtype_bytes": 4, "max_tokens": 20}


@pytest.fixture
def tmp():
    with short_tmpdir() as d:
        yield d


def allocated_bytes(path: str) -> int:
    return os.stat(path).st_blocks * 512


def has_data(path: str, start: int, nbytes: int) -> bool:
    """True if ``[start, start + nbytes)`` of a file holds a non-zero byte; punched holes read as zeroes.

    A TRIM punches holes in whole filesystem blocks and zeroes the partial ones at its edges, so
    only the allocated pieces are read.
    """
    end = start + nbytes
    fd = os.open(path, os.O_RDONLY)
    try:
        pos = start
        while pos < end:
            try:
                pos = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after pos
                return False
            if pos >= end:
                return False
            hole = min(os.lseek(fd, pos, os.SEEK_HOLE), end)
            while pos < hole:
                chunk = os.pread(fd, min(hole - pos, 1 << 20), pos)
                if chunk.strip(b"\0"):
                    return True
                pos += len(chunk)
        return False
    finally:
        os.close(fd)


def test_two_client_processes_round_trip_on_both_paths(tmp: str) -> None:
    # B_pc fixed at two layers' K+V: Algorithm 1 puts layers 0-1 on the page-cache path
    with DaemonProcess(tmp, {"budget": {"override": 4 * KPU}}).start() as d, \
            ClientProcess(d.socket_path) as a, ClientProcess(d.socket_path) as b:
        for c in (a, b):
            c.call("connect")
        opened_a = a.call("open", geometry=ALIGNED)
        pa = opened_a["plan"]
        pb = b.call("open", geometry=ALIGNED)["plan"]
        # the page-cache budget is shared: the second session gets what the first left
        assert (pa["group1_layers"], pb["group1_layers"]) == (2, 0)
        a.send("write_all", seed=1)
        b.send("write_all", seed=2)
        assert a.expect()["paths"] == ["pagecache"] * 4 + ["direct"] * 4
        assert b.expect()["paths"] == ["direct"] * 8
        a.send("check_all", seed=1)
        b.send("check_all", seed=2)
        assert a.expect()["bad"] == [] and b.expect()["bad"] == []
        # Algorithm 2: one token in the middle of a direct-path KPU, then the range around it
        w = a.call("write", layer=3, kind="v", token_start=5, ntokens=1, seed=9)
        assert (w["path"], w["nbytes"]) == ("direct", 4096) and w["service_ns"] > 0
        assert a.call("read_check", layer=3, kind="v", token_start=5, ntokens=1, seed=9)["match"]
        assert a.call("read_check", layer=3, kind="v", token_start=0, ntokens=5, seed=1)["match"]
        assert a.call("read_check", layer=3, kind="v", token_start=6, seed=1)["match"]
        r = a.call("read_check", layer=0, kind="k", token_start=3, ntokens=4, seed=1)
        assert r["match"] and r["path"] == "pagecache" and r["hit_ratio"] == 1.0
        close = d.mark()
        a.call("close")
        closed = d.wait_event("session_close", after=close, session=opened_a["session"], reason="closed")
        assert int(closed["trimmed_bytes"]) == 4 * KPU
        assert not os.listdir(os.path.join(tmp, "pagecache")), "page-cache files left after close"
        assert b.call("check_all", seed=2)["bad"] == []


def test_unaligned_tokens_use_packed_rows_and_exact_bytes(tmp: str) -> None:
    with DaemonProcess(tmp, {"budget": {"override": 0}}).start() as d, ClientProcess(d.socket_path) as c:
        c.call("connect")
        plan = c.call("open", geometry=UNALIGNED)["plan"]
        assert not plan["aligned"] and "token_stride" not in plan
        assert all(k["padded_bytes"] - k["nbytes"] < 4096 for k in plan["kpus"])
        assert c.call("write_all", seed=3)["paths"] == ["direct"] * 6
        assert c.call("check_all", seed=3)["bad"] == []
        c.call("write", layer=1, kind="k", token_start=7, ntokens=2, seed=4)
        assert c.call("read_check", layer=1, kind="k", token_start=7, ntokens=2, seed=4)["match"]
        assert c.call("read_check", layer=1, kind="k", token_start=0, ntokens=7, seed=3)["match"]
        assert c.call("read_check", layer=1, kind="k", token_start=9, seed=3)["match"]


@pytest.mark.parametrize("mode", ["baseline", "cachepolicy", "direct"])
def test_modes_of_table_iii(tmp: str, mode: str) -> None:
    with DaemonProcess(tmp, {"budget": {"override": 4 * KPU}}).start() as d, ClientProcess(d.socket_path) as c:
        c.call("connect")
        c.call("open", geometry=ALIGNED, mode=mode)
        paths = c.call("write_all", seed=5)["paths"]
        assert c.call("check_all", seed=5)["bad"] == []
        if mode == "direct":
            assert paths == ["direct"] * 8
            return
        assert paths == ["pagecache"] * 8
        g1 = c.call("read_check", layer=0, kind="k", seed=5)
        g2 = c.call("read_check", layer=3, kind="k", seed=5)
        assert g1["match"] and g2["match"] and g1["hit_ratio"] == 1.0
        if mode == "cachepolicy":
            # Group 2 is dropped from the page cache after every use (Table III)
            assert g2["hit_ratio"] < 0.5
        else:
            assert g2["hit_ratio"] == 1.0


@pytest.mark.root
def test_loop_device_backend_round_trip_and_trim(tmp: str, loop_device: str) -> None:
    backing = subprocess.run(["losetup", "-n", "-O", "BACK-FILE", loop_device], check=True,
                             capture_output=True, text=True).stdout.strip()
    cfg = {"device": {"backend": "block", "path": loop_device, "region_start_lba": 2048},
           "budget": {"override": 0}}
    with DaemonProcess(tmp, cfg).start() as d, ClientProcess(d.socket_path) as c:
        assert c.call("connect")["server"]["lba_size"] == 512
        sid = c.call("open", geometry=ALIGNED)["session"]
        before = allocated_bytes(backing)
        assert c.call("write_all", seed=6)["paths"] == ["direct"] * 8
        assert c.call("check_all", seed=6)["bad"] == []
        assert allocated_bytes(backing) >= before + 8 * KPU
        close = d.mark()
        c.call("close")
        assert int(d.wait_event("session_close", after=close, session=sid)["trimmed_bytes"]) == 8 * KPU
        # block discard on a loop device punches holes in its backing file
        assert not has_data(backing, 2048 * 512, 8 * KPU)


def test_sigkill_client_mid_transfer_frees_its_extent(tmp: str) -> None:
    with DaemonProcess(tmp, {"budget": {"override": 0}}).start() as d, \
            ClientProcess(d.socket_path) as victim, ClientProcess(d.socket_path) as bystander:
        store = os.path.join(tmp, "kv-store.img")
        bystander.call("connect")
        bystander.call("open", geometry=ALIGNED)
        bystander.call("write_all", seed=7)
        victim.call("connect")
        opened = victim.call("open", geometry=ALIGNED, channels=2)
        ext = opened["extent"]
        victim.call("write_all", seed=8)
        assert has_data(store, ext["start"] * 4096, ext["nblocks"] * 4096)
        assert victim.call("write_loop")["looping"]
        kill = d.mark()
        victim.kill()
        gone = d.wait_event("session_close", after=kill, session=opened["session"])
        assert gone["reason"] == "client_gone"
        assert int(gone["trimmed_bytes"]) == ext["nblocks"] * 4096
        assert not has_data(store, ext["start"] * 4096, ext["nblocks"] * 4096)
        # the other session is unaffected, and the freed extent is handed out again
        assert bystander.call("check_all", seed=7)["bad"] == []
        with ClientProcess(d.socket_path) as again:
            again.call("connect")
            assert again.call("open", geometry=ALIGNED)["extent"] == ext
            again.call("write_all", seed=9)
            assert again.call("check_all", seed=9)["bad"] == []


def test_sigkill_daemon_then_restart_reclaims_and_clients_reconnect(tmp: str) -> None:
    # Group 1 on disk files: a killed daemon leaves them behind for the next start to remove (memory files go
    # with the process)
    cfg = {"budget": {"override": 2 * KPU}, "pagecache": {"backing": "disk"}}
    store = os.path.join(tmp, "kv-store.img")
    with DaemonProcess(tmp, cfg).start() as d, ClientProcess(d.socket_path) as c:
        c.call("connect")
        opened = c.call("open", geometry=ALIGNED)
        ext = opened["extent"]
        assert c.call("write_all", seed=10)["paths"] == ["pagecache"] * 2 + ["direct"] * 6
        stale_dir = os.path.join(tmp, "pagecache", f"session-{opened['session']}")
        assert os.listdir(stale_dir)
        d.kill()
        lost = c.call("read", layer=3, kind="k", expect_error=True)
        assert lost["exception"] == "DaemonLostError" and "lost connection" in lost["message"]
        assert has_data(store, ext["start"] * 4096, ext["nblocks"] * 4096)

        with DaemonProcess(tmp, cfg).start() as d2:
            # what the start itself does, once: the run's lines since its start
            ev = d2.wait_event("session_reclaim", session=opened["session"])
            assert ev["extents"] == "1"
            assert int(d2.wait_event("reclaim")["trimmed_bytes"]) == ext["nblocks"] * 4096
            assert not has_data(store, ext["start"] * 4096, ext["nblocks"] * 4096)
            assert not os.path.exists(stale_dir)
            # the same client process reconnects and works
            c.call("connect")
            assert c.call("open", geometry=ALIGNED)["extent"] == ext
            c.call("write_all", seed=11)
            assert c.call("check_all", seed=11)["bad"] == []


def test_sigterm_drains_in_flight_requests_trims_and_notifies(tmp: str) -> None:
    with DaemonProcess(tmp, {"budget": {"override": 0}}).start() as d, ClientProcess(d.socket_path) as c:
        c.call("connect")
        opened = c.call("open", geometry=ALIGNED)
        ext = opened["extent"]
        c.call("write_all", seed=12)
        assert c.call("write_loop")["looping"]
        term = d.signal(signal.SIGTERM)
        assert d.stop() == 0  # every line and notification is in once it returns
        assert "STOPPING=1" in d.notifications_after(term)
        stop = d.wait_event("daemon_stop", after=term)
        assert int(stop["trimmed_bytes"]) == ext["nblocks"] * 4096
        assert d.wait_event("session_close", after=term, session=opened["session"])["reason"] == "shutdown"
        assert not has_data(os.path.join(tmp, "kv-store.img"), 0, 64 << 20)
        assert not os.path.exists(d.socket_path)


def test_second_daemon_on_the_same_state_dir_is_refused(tmp: str) -> None:
    with DaemonProcess(tmp).start() as first:
        with DaemonProcess(tmp).start(wait=False) as second:
            assert second.proc is not None and second.proc.wait(60) == 1
            # what its start caused: its run's only lines
            second.wait_line(f"another bladed (pid {first.pid}) is using the state directory")
        assert first.proc is not None and first.proc.poll() is None


@pytest.mark.parametrize("journal", ["torn", "deleted", "other_region"])
def test_start_up_without_a_usable_journal_scrubs_the_whole_region(tmp: str, journal: str) -> None:
    """A torn or deleted journal, or one of another region, cannot say which blocks hold a crashed
    session's KV cache: all of them are scrubbed before the daemon serves."""
    with DaemonProcess(tmp, {"budget": {"override": 0}}).start() as d, ClientProcess(d.socket_path) as c:
        c.call("connect")
        c.call("open", geometry=ALIGNED)
        c.call("write_all", seed=13)
        d.kill()
    assert has_data(os.path.join(tmp, "kv-store.img"), 0, 64 << 20)
    cfg = {}
    if journal == "torn":
        with open(os.path.join(tmp, "journal.json"), "w") as f:
            f.write("{ torn write")
    elif journal == "deleted":
        os.unlink(os.path.join(tmp, "journal.json"))
    else:
        cfg = {"device": {"region_blocks": 8192}}
    region = (32 if journal == "other_region" else 64) << 20
    with DaemonProcess(tmp, cfg).start() as d2, Client(d2.socket_path) as c2:
        # what the start itself does, once: the run's lines since its start
        if journal == "torn":
            d2.wait_line("unreadable journal")
        ev = d2.wait_event("region_scrub")
        assert ev["reason"] == {"torn": "unreadable_journal", "deleted": "no_journal",
                                "other_region": "journal_of_another_device_or_region"}[journal]
        assert int(ev["trimmed_bytes"]) == region and ev["region"] == f"0+{region // 4096}"
        assert not has_data(os.path.join(tmp, "kv-store.img"), 0, region)
        assert c2.stats()["region_scrubbed_bytes"] == region
        # systemd is told why start-up takes longer, and given more time for it
        assert "EXTEND_TIMEOUT_USEC=1800000000" in d2.notifications
        assert any(n.startswith("STATUS=scrubbing the region") for n in d2.notifications)
    # the journal is back: a clean restart scrubs nothing
    with DaemonProcess(tmp, cfg).start() as d3, Client(d3.socket_path) as c3:
        assert c3.stats()["region_scrubbed_bytes"] == 0


def test_embedded_default_needs_no_config_file(tmp: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m bladed.server`` with no options: file store, page cache and socket in ./var/bladed,
    where a client with no socket path finds it."""
    with DaemonProcess(tmp, embedded=True).start():
        base = os.path.join(tmp, "var", "bladed")
        assert set(os.listdir(base)) >= {"bladed.lock", "bladed.sock", "journal.json", "kv-store.img", "pagecache"}
        assert os.path.getsize(os.path.join(base, "kv-store.img")) == 1 << 30
        monkeypatch.chdir(tmp)
        monkeypatch.delenv("BLADED_SOCKET", raising=False)
        with Client() as c, c.open_session(ALIGNED, channels=1) as s:
            assert c.status()["config"] == "embedded-default"
            s.slot(0)[:] = b"x" * KPU
            assert s.write(0, "k", 0).nbytes == KPU
