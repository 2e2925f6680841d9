"""Live demotion onto a real NVMe namespace (QEMU's controller, inside the NVMe VM): sessions that open
with every KPU in the page cache -- whole-LBA rows and 256-byte rows packed on the namespace -- are
demoted by a SIGHUP that lowers ``budget.override``, and every byte reads back on every channel, before
and after more writes.  The packed session's edge LBAs go through the channels' edge scratch, which is
not registered with the rings: plain (unregistered) passthrough commands.

Four sessions of 192/768/6144/4096-byte rows without reserved room (issue 27: a session opened without
an extent once bound its demoted KPUs from LBA 0, on top of other sessions' and below the region): each
reads back its own bytes, the extents are disjoint and inside the region, and the namespace holds no byte
outside them -- read back through the block device, bypassing its page cache.

One daemon start (under TCG every Python start-up costs seconds); the client runs in the pytest process.
"""

from __future__ import annotations

import itertools
import mmap
import os
import random
import signal
import sys

import pytest
from nvmevm import NG_PATH, NS_NAME, VMConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from daemon_util import DaemonProcess, short_tmpdir

from bladed.client import Client, Session

pytestmark = pytest.mark.nvme_vm

TIMEOUT = 600.0
GEOMETRIES = [
    {"layers": 2, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 24},  # 4096-byte rows
    {"layers": 2, "batch": 1, "kv_heads": 1, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 40},  # 256-byte rows
]


def check(s: Session, want: dict[tuple[int, str], bytearray]) -> set[str]:
    """Read every KPU whole on every channel, compare every byte; the paths served."""
    paths = set()
    for (layer, kind), data in want.items():
        for ch in range(s.channels):
            s.slot(ch)[:] = b"\xa5" * s.kpu_bytes
            paths.add(s.read(layer, kind, ch).path)
            assert bytes(s.slot(ch)) == data, f"{kind}{layer} on channel {ch}"
    return paths


def write(s: Session, want: dict[tuple[int, str], bytearray], rng: random.Random, start: int, n: int) -> set[str]:
    paths = set()
    tb = s.token_bytes
    for i, (layer, kind) in enumerate(want):
        data = rng.randbytes(n * tb)
        ch = i % s.channels
        s.slot(ch)[start * tb:(start + n) * tb] = data
        paths.add(s.write(layer, kind, ch, start, n).path)
        want[(layer, kind)][start * tb:(start + n) * tb] = data
    return paths


def test_demotion_onto_the_namespace_keeps_every_byte(vm_config: VMConfig) -> None:
    lba = vm_config.lba_size
    region_start = 8 * 4096 // lba
    cfg = {"device": {"backend": "nvme", "path": NG_PATH, "region_start_lba": region_start,
                      "region_blocks": (32 << 20) // lba, "lba_size": lba},
           # two sessions demote at once: each reserves its room at open (docs/architecture.md, re-planning)
           "budget": {"override": 1 << 30, "reserve_extent": True}}
    rng = random.Random(f"replan-vm-{lba}")
    with short_tmpdir() as tmp, DaemonProcess(tmp, cfg) as d:
        d.start(timeout=TIMEOUT)
        with Client(d.socket_path, timeout=TIMEOUT) as c:
            sessions = []
            for geo in GEOMETRIES:
                s = c.open_session(geo, channels=2)
                assert {k["path"] for k in s.plan["kpus"]} == {"pagecache"}
                want = {(layer, kind): bytearray(s.kpu_bytes) for layer in range(geo["layers"]) for kind in "kv"}
                assert write(s, want, rng, 0, s.max_tokens - 3) == {"pagecache"}
                sessions.append((s, want))
            assert [s.plan["aligned"] for s, _ in sessions] == [True, False]

            d.config["budget"]["override"] = 0
            d.write_config()
            shrunk = d.signal(signal.SIGHUP)
            for s, want in sessions:
                for layer, kind in want:
                    d.wait_event("kpu_demoted", TIMEOUT, session=s.id, kpu=f"{kind}{layer}", after=shrunk)
            for s, want in sessions:
                assert check(s, want) == {"direct"}
                assert write(s, want, rng, s.max_tokens - 5, 5) == {"direct"}   # across the old fill mark
                check(s, want)
            assert c.stats()["replan"]["demotions_failed"] == 0
            extents = {r["session"]: r["extent"] for r in c.sessions()}
            for s, _ in sessions:
                closing = d.mark()
                s.close()
                closed = d.wait_event("session_close", TIMEOUT, session=s.id, after=closing)
                assert int(closed["trimmed_bytes"]) == extents[s.id]["nblocks"] * lba
        assert d.stop(TIMEOUT) == 0


#: the four geometries of issue 27, largest first: under a 400 kB budget the first opens with its second
#: layer on the extent (room to find later), the second all direct, the last two with no extent
FOUR = [
    {"layers": 2, "batch": 1, "kv_heads": 1, "head_dim": 2048, "dtype_bytes": 2, "max_tokens": 33},
    {"layers": 2, "batch": 1, "kv_heads": 3, "head_dim": 1024, "dtype_bytes": 2, "max_tokens": 17},
    {"layers": 2, "batch": 1, "kv_heads": 3, "head_dim": 64, "dtype_bytes": 4, "max_tokens": 40},
    {"layers": 2, "batch": 1, "kv_heads": 1, "head_dim": 96, "dtype_bytes": 2, "max_tokens": 12},
]


def namespace_bytes(offset: int, nbytes: int) -> bytes:
    """What the namespace holds, read with O_DIRECT through its block device (no stale page cache)."""
    fd = os.open(f"/dev/{NS_NAME}", os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, nbytes)
        with buf:
            assert os.preadv(fd, [buf], offset) == nbytes
            return bytes(buf)
    finally:
        os.close(fd)


def test_sessions_demoted_together_stay_inside_their_extents(vm_config: VMConfig) -> None:
    lba = vm_config.lba_size
    region_start, region_bytes = (1 << 20) // lba, 8 << 20
    cfg = {"device": {"backend": "nvme", "path": NG_PATH, "region_start_lba": region_start,
                      "region_blocks": region_bytes // lba, "lba_size": lba},
           "budget": {"override": 400_000}}
    rng = random.Random(f"isolation-vm-{lba}")
    below = namespace_bytes(0, region_start * lba)
    with short_tmpdir() as tmp, DaemonProcess(tmp, cfg) as d:
        d.start(timeout=TIMEOUT)
        with Client(d.socket_path, timeout=TIMEOUT) as c:
            sessions = []
            for geo in FOUR:
                s = c.open_session(geo, channels=2)
                want = {(layer, kind): bytearray(s.kpu_bytes) for layer in range(geo["layers"]) for kind in "kv"}
                write(s, want, rng, 0, s.max_tokens)
                sessions.append((s, want, [f"{k['kind']}{k['layer']}" for k in s.plan["kpus"]
                                           if k["path"] == "pagecache"]))
            opened = {r["session"]: r["extent"] for r in c.sessions()}
            assert any(e is None for e in opened.values()), opened
            assert any(names and opened[s.id] is not None for s, _, names in sessions), opened

            d.config["budget"]["override"] = 0
            d.write_config()
            shrunk = d.signal(signal.SIGHUP)
            for s, _, names in sessions:
                for name in names:
                    d.wait_event("kpu_demoted", TIMEOUT, session=s.id, kpu=name, after=shrunk)
            for s, want, _ in sessions:
                assert check(s, want) == {"direct"}
            stats = c.stats()["replan"]
            assert stats["demotions_failed"] == 0 and stats["extents_moved"] >= 1, stats
            extents = {r["session"]: r["extent"] for r in c.sessions()}
            spans = sorted((e["start"], e["start"] + e["nblocks"]) for e in extents.values())
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans
            assert spans[0][0] >= region_start and spans[-1][1] <= region_start + region_bytes // lba, spans
            held = namespace_bytes(region_start * lba, region_bytes)
            pos = region_start
            for start, end in [*spans, (region_start + region_bytes // lba, 0)]:
                gap = held[(pos - region_start) * lba:(start - region_start) * lba]
                assert gap.count(0) == len(gap), f"bytes outside every live extent in LBA [{pos}, {start})"
                pos = max(pos, end)
            for s, _, _ in sessions:
                closing = d.mark()
                s.close()
                d.wait_event("session_close", TIMEOUT, session=s.id, after=closing)
        assert d.stop(TIMEOUT) == 0
    assert namespace_bytes(region_start * lba, region_bytes).count(0) == region_bytes, "bytes left after close"
    assert namespace_bytes(0, region_start * lba) == below, "the daemon wrote below its region"
