"""Per-chunk crc32c checksums (``checksums`` in open_session, ``io.checksums``):
verified on every read, a corrupted chunk on the device or in a page-cache
file gives a clear ``integrity_error``; off by default."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from daemon_util import DaemonProcess, short_tmpdir

from bladed.client import Client, IntegrityError
from bladed.server.storage.integrity import row_crcs

# on both engines, io_uring and the portable one (issue 29)
pytestmark = pytest.mark.usefixtures("io_engine")

GEO = {"layers": 2, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 16}
TOKEN = 4096
KPU = 16 * TOKEN


@pytest.fixture
def tmp() -> Iterator[str]:
    with short_tmpdir() as d:
        yield d


def test_row_crcs_match_the_castagnoli_check_value() -> None:
    data = b"123456789" * 2
    assert list(row_crcs(data, 0, 2, 9)) == [0xE3069283, 0xE3069283]   # the CRC-32C check value


def corrupt(path: str, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, b"\xff\x00\xff\x00", offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_corruption_on_the_device_and_in_page_cache_files_is_reported(tmp: str) -> None:
    cfg = {"budget": {"override": 2 * KPU}, "pagecache": {"backing": "disk"}}    # page-cache files to corrupt
    with DaemonProcess(tmp, cfg).start() as d, Client(d.socket_path) as c:
        s = c.open_session(GEO, channels=1, checksums=True)
        assert [k["path"] for k in s.plan["kpus"]] == ["pagecache", "pagecache", "direct", "direct"]
        for layer in range(2):
            for kind in "kv":
                s.slot(0)[:] = os.urandom(KPU)
                s.write(layer, kind, 0)
                want = bytes(s.slot(0))
                s.read(layer, kind, 0)
                assert bytes(s.slot(0)) == want
        ext = next(x for x in c.sessions() if x["session"] == s.id)["extent"]
        # layer 1 K is the first direct KPU: token 5 of it on the store file
        corrupt(os.path.join(tmp, "kv-store.img"), ext["start"] * 4096 + 5 * TOKEN + 100)
        with pytest.raises(IntegrityError, match=r"layer 1 K: 1 of 16 token rows .* token 5") as e:
            s.read(1, "k", 0)
        assert e.value.code.value == "integrity_error"
        s.read(1, "k", 0, token_start=6, ntokens=10)     # the rows around it still verify
        s.read(1, "v", 0)
        pc = os.path.join(tmp, "pagecache", f"session-{s.id}")
        for name in os.listdir(pc):
            corrupt(os.path.join(pc, name), 2 * TOKEN)
        with pytest.raises(IntegrityError, match="token 2"):
            s.read(0, "v", 0)
        s.slot(0)[:] = os.urandom(KPU)
        s.write(0, "v", 0)                                 # rewriting heals the chunk
        s.read(0, "v", 0)
        assert c.stats()["integrity_errors"] == 2
        s.close()
        # off by default: the same corruption passes silently
        t = c.open_session(GEO, mode="direct", channels=1)
        t.slot(0)[:] = b"\x01" * KPU
        t.write(0, "k", 0)
        ext = next(x for x in c.sessions() if x["session"] == t.id)["extent"]
        corrupt(os.path.join(tmp, "kv-store.img"), ext["start"] * 4096)
        t.read(0, "k", 0)
        assert bytes(t.slot(0)[:4]) == b"\xff\x00\xff\x00"
        t.close()


def test_checksums_cost(tmp: str) -> None:
    """Whole-KPU writes and reads with and without checksums: same bytes back; the service times are printed
    (best of 5, as the machine may be shared) for docs/reliability.md, not asserted."""
    geo = dict(GEO, layers=4, max_tokens=256)           # 1 MiB KPUs
    out = {}
    with DaemonProcess(tmp, {"budget": {"override": 0}}).start() as d, Client(d.socket_path) as c:
        for on in (False, True):
            with c.open_session(geo, mode="direct", channels=1, checksums=on) as s:
                data = os.urandom(1 << 20)
                best = []
                for _ in range(5):
                    ns = 0
                    for layer in range(4):
                        s.slot(0)[:] = data
                        ns += s.write(layer, "k", 0).service_ns
                        s.slot(0)[:] = bytes(1 << 20)
                        ns += s.read(layer, "k", 0).service_ns
                        assert bytes(s.slot(0)) == data
                    best.append(ns / 8 / 1e6)
                out[on] = min(best)
        assert c.stats()["integrity_errors"] == 0
    print(f"\nchecksums off: {out[False]:.2f} ms per 1 MiB op; on: {out[True]:.2f} ms "
          f"(+{out[True] - out[False]:.2f} ms)")
