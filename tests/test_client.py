"""The client library against a real daemon: the session API, futures and
callbacks from copy threads, torch views of the shared staging slot, and a
clear exception for every failure."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator

import pytest
from daemon_util import DaemonProcess, short_tmpdir

from bladed.client import (
    Client,
    DaemonLostError,
    OpResult,
    OutOfRangeError,
    geometry_dict,
)
from bladed.residency import Geometry
from bladed.residency.geometry import dtype_bytes

GEO = Geometry(layers=4, batch=2, kv_heads=8, head_dim=128, dtype_bytes=2, max_tokens=16)
KPU = GEO.kpu_bytes


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with short_tmpdir() as tmp, DaemonProcess(tmp, {"budget": {"override": 2 * KPU}}).start() as d:
        yield d


def test_geometry_from_geometry_mapping_or_dtype_name() -> None:
    want = geometry_dict(GEO)
    assert geometry_dict(GEO.to_dict()) == want
    named = {k: v for k, v in want.items() if k != "dtype_bytes"} | {"dtype": "torch.bfloat16"}
    assert geometry_dict(named) == want
    with pytest.raises(ValueError, match=r"unknown dtype 'complex32x'; known are float8, fp8, .*, or give dtype_bytes"):
        geometry_dict(dict(named, dtype="complex32x"))
    with pytest.raises(ValueError, match="lacks 'batch'"):
        geometry_dict({"layers": 1})


def test_one_dtype_table_for_names_and_torch_dtypes() -> None:
    import torch
    assert [dtype_bytes(d) for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)] == [2, 2, 4, 8]
    assert [dtype_bytes(d) for d in ("fp8", "half", "BF16", "float")] == [1, 2, 2, 4]
    with pytest.raises(ValueError, match=r"unknown dtype torch\.complex64"):
        dtype_bytes(torch.complex64)


def test_session_plan_slots_and_sync_io(daemon: DaemonProcess) -> None:
    with Client(daemon.socket_path) as c, c.open_session(GEO, channels=2) as s:
        assert s.plan["group1_layers"] == 1 and s.plan["mode"] == "dualblade"
        assert [k["path"] for k in s.plan["kpus"]] == ["pagecache"] * 2 + ["direct"] * 6
        assert s.plan["budget"]["pagecache_budget_bytes"] == 2 * KPU and "host_available_bytes" in s.plan["budget"]
        assert s.kpu(2, "v")["group"] == 2
        slot = s.slot(1)
        assert len(slot) == KPU and not slot.readonly and s.token_bytes == GEO.token_bytes
        data = os.urandom(KPU)
        slot[:] = data
        w = s.write(3, "k", 1)
        assert isinstance(w, OpResult) and (w.path, w.nbytes, w.hit_ratio) == ("direct", KPU, None)
        slot[:] = bytes(KPU)
        r = s.read(3, "k", 1, token_start=4, ntokens=2)
        tb = GEO.token_bytes
        assert r.nbytes == 2 * tb and bytes(slot[4 * tb:6 * tb]) == data[4 * tb:6 * tb]
        assert bytes(slot[:4 * tb]) == bytes(4 * tb)  # nothing outside the range was touched
        with pytest.raises(IndexError):
            s.slot(2)
        with pytest.raises(OutOfRangeError, match="layer 4"):
            s.read(4, "k", 0)
    with Client(daemon.socket_path) as other:
        assert other.sessions() == []  # the context managers closed the session


def test_async_from_copy_threads_with_callbacks(daemon: DaemonProcess) -> None:
    """Two copy threads, one per channel, keep several requests in flight each."""
    with Client(daemon.socket_path) as c, c.open_session(GEO, channels=2) as s:
        done: list[OpResult] = []
        lock = threading.Lock()
        errors: list[BaseException] = []

        def on_done(f) -> None:  # type: ignore[no-untyped-def]
            with lock:
                if f.exception():
                    errors.append(f.exception())
                else:
                    done.append(f.result())

        def copy_thread(ch: int) -> None:
            for layer in range(GEO.layers):
                kind = "kv"[ch]
                s.slot(ch)[:] = bytes([layer * 2 + ch + 1]) * KPU
                s.write(layer, kind, ch)
                s.slot(ch)[:] = bytes(KPU)
                # one token at a time, all in flight together
                futs = [s.read_async(layer, kind, ch, token_start=t, ntokens=1) for t in range(GEO.max_tokens)]
                for f in futs:
                    f.add_done_callback(on_done)
                for f in futs:
                    f.result(30)
                if bytes(s.slot(ch)) != bytes([layer * 2 + ch + 1]) * KPU:
                    errors.append(AssertionError(f"layer {layer} channel {ch}: wrong bytes"))

        threads = [threading.Thread(target=copy_thread, args=(ch,)) for ch in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        assert len(done) == 2 * GEO.layers * GEO.max_tokens
        assert {r.channel for r in done} == {0, 1} and all(r.nbytes == GEO.token_bytes for r in done)


def test_torch_tensors_over_the_shared_slot_on_cpu(daemon: DaemonProcess) -> None:
    import torch
    with Client(daemon.socket_path) as c, c.open_session(GEO, channels=1) as s:
        assert s.pinned is torch.cuda.is_available()
        view = torch.frombuffer(s.slot(0), dtype=torch.float16).view(GEO.max_tokens, GEO.batch * GEO.kv_heads, -1)
        src = torch.randn(view.shape, dtype=torch.float16)
        view.copy_(src)            # the copy thread's "GPU -> staging" step
        s.write(2, "v", 0)
        view.zero_()
        s.read(2, "v", 0)
        assert torch.equal(view, src)


def test_staging_size_is_checked(daemon: DaemonProcess) -> None:
    with Client(daemon.socket_path) as c:
        with pytest.raises(ValueError, match="hold 2 slots of"):
            c.open_session(GEO, channels=2, staging_bytes=KPU)
        with pytest.raises(ValueError, match=f"field 'slot_bytes' must be >= {KPU}, got {KPU - 1}"):
            c.open_session(GEO, channels=1, slot_bytes=KPU - 1)
        with c.open_session(GEO, channels=1, staging_bytes=3 * KPU - 1) as s:
            assert (s.slot_stride, s.staging_bytes) == (KPU, 3 * KPU)      # rounded up to staging_align
        with pytest.raises(ValueError, match="mode"):
            c.open_session(GEO, mode="fast")


def test_the_papers_mode_labels_open_the_mode_they_name(daemon: DaemonProcess) -> None:
    """Table III's labels are accepted (bladed.residency.planner.Mode.parse) and sent as the mode's name."""
    with Client(daemon.socket_path) as c:
        for label, name in (("Dual-Blade", "dualblade"), ("NVMe-direct-Only", "direct"),
                            ("CachePolicy-Only", "cachepolicy"), ("Baseline", "baseline"), ("DualBlade", "dualblade")):
            with c.open_session(GEO, mode=label, channels=1) as s:
                assert s.plan["mode"] == name, label
        with pytest.raises(ValueError, match=r"^mode: unknown residency mode 'Dual Blade': choose one of baseline, "
                                             r"cachepolicy, direct, dualblade, or the paper's Table III label"):
            c.open_session(GEO, mode="Dual Blade")


def test_no_daemon_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(DaemonLostError, match=r"^no bladed socket at .*none\.sock \(given as socket_path; "):
        Client(str(tmp_path / "none.sock"))
    stale = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(stale)  # bound, never listening: what a crashed daemon leaves
    with pytest.raises(DaemonLostError, match="refuses connections"):
        Client(stale)
    s.close()


def test_losing_the_daemon_fails_pending_and_later_requests() -> None:
    with short_tmpdir() as tmp:
        d = DaemonProcess(tmp).start()
        c = Client(d.socket_path)
        s = c.open_session(GEO, channels=1)
        s.write(0, "k", 0)
        d.kill()
        with pytest.raises(DaemonLostError, match="lost connection"):
            s.read(0, "k", 0)
        with pytest.raises(DaemonLostError):
            c.status()
        s.close()   # closing against a dead daemon only unmaps
        c.close()


def test_channels_run_concurrently() -> None:
    """Requests on channel 1 run while a long one runs on channel 0
    (one worker and ring per channel: overlap-intra, §IV-C)."""
    big = Geometry(layers=1, batch=8, kv_heads=8, head_dim=128, dtype_bytes=2, max_tokens=2048)   # 32 MiB KPU
    cfg = {"budget": {"override": 0}, "device": {"size": "128M"}}
    with short_tmpdir() as tmp, DaemonProcess(tmp, cfg).start() as d, Client(d.socket_path) as c, \
            c.open_session(big, channels=2) as s:
        s.slot(0)[:] = os.urandom(1 << 20) * 32
        s.write(0, "k", 0)
        s.write(0, "v", 0)
        long_read = s.read_async(0, "k", 0)
        shorts = []
        while not long_read.done() and len(shorts) < 10000:
            shorts.append(s.read(0, "v", 1, token_start=len(shorts) % 2048, ntokens=1))
        long = long_read.result(60)
        # one worker for both channels would run them one after the other: disjoint intervals
        overlapping = [r for r in shorts if r.started_ns < long.finished_ns and long.started_ns < r.finished_ns]
        assert overlapping, (long, shorts[:3])
