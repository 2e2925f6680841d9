"""Live re-planning with a real daemon: when ``B_pc`` shrinks (here: the
operator lowers ``budget.override`` and sends SIGHUP), live sessions demote
whole KPUs at an operation boundary; bytes stay identical, demoted files go,
the journal follows the extent and closing TRIMs all of it.

Waits block on the daemon's structured log events (``replan``,
``kpu_demoted``) with deadlines; nothing sleeps.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import pytest
from daemon_util import ClientProcess, DaemonProcess, UnixHTTPConnection, scrape, short_tmpdir

#: token = 4096 bytes (aligned); 4 layers -> 8 KPUs of 32 tokens
ALIGNED = {"layers": 4, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 32}
KPU = 32 * 4096
#: token = 768 bytes: rows are padded to 4096 on the extent
UNALIGNED = {"layers": 3, "batch": 1, "kv_heads": 3, "head_dim": 64, "dtype_bytes": 4, "max_tokens": 20}
U_KPU = 20 * 768


@pytest.fixture
def tmp():
    with short_tmpdir() as d:
        yield d


def shrink(d: DaemonProcess, override: int) -> None:
    d.config["budget"]["override"] = override
    d.write_config()
    d.signal(signal.SIGHUP)


def session_row(c: ClientProcess, sid: str) -> dict[str, Any]:
    (row,) = [r for r in c.call("call", op="sessions")["reply"]["sessions"] if r["session"] == sid]
    return row


def pc_files(tmp: str) -> set[str]:
    out = set()
    for _root, _, files in os.walk(os.path.join(tmp, "pagecache")):
        out.update(f.split(".")[0] for f in files if not f.startswith("."))
    return out


def journal_extents(tmp: str, sid: str) -> list[list[int]]:
    with open(os.path.join(tmp, "journal.json")) as f:
        (rec,) = [r for r in json.load(f)["sessions"] if r["id"] == sid]
    return [list(e) for e in rec["extents"]]


def test_dualblade_demotes_by_growing_the_extent(tmp: str) -> None:
    cfg = {"budget": {"override": 4 * KPU}, "metrics": {"enabled": True, "listen": "unix:metrics.sock"}}
    with DaemonProcess(tmp, cfg).start() as d, ClientProcess(d.socket_path) as c:
        c.call("connect")
        opened = c.call("open", geometry=ALIGNED)
        sid, ext = opened["session"], opened["extent"]
        assert opened["plan"]["n1"] == 2 and ext["nblocks"] == 4 * KPU // 4096
        assert c.call("write_all", seed=1)["paths"] == ["pagecache"] * 4 + ["direct"] * 4
        assert pc_files(tmp) == {"k0", "v0", "k1", "v1"}

        shrink(d, 2 * KPU)
        ev = d.wait_event("replan", session=sid)
        assert ev["demoted"] == "k1,v1" and int(ev["grant"]) == 2 * KPU
        # the next op on a demoted KPU is served on the NVMe-direct path, with the same bytes
        r = c.call("read_check", layer=1, kind="v", seed=1)
        assert r["path"] == "direct" and r["match"]
        d.wait_event("kpu_demoted", session=sid, kpu="k1")
        d.wait_event("kpu_demoted", session=sid, kpu="v1")
        assert c.call("check_all", seed=1)["bad"] == []
        assert pc_files(tmp) == {"k0", "v0"}

        row = session_row(c, sid)
        assert (row["group1"], row["group2"], row["demoted_kpus"], row["demoted_bytes"]) == (2, 6, 2, 2 * KPU)
        assert row["pending_demotions"] == 0 and row["demotions_failed"] == 0
        # grown in place, and the journal says so (crash recovery TRIMs all of it)
        assert row["extent"] == {"start": ext["start"], "nblocks": 6 * KPU // 4096}
        assert journal_extents(tmp, sid) == [[ext["start"], 6 * KPU // 4096]]
        stats = c.call("call", op="stats")["reply"]
        assert stats["replan"]["demoted_kpus"] == 2 and stats["budget"]["held"] == 2 * KPU
        m = scrape(UnixHTTPConnection(os.path.join(tmp, "metrics.sock")))
        assert m[("bladed_demoted_kpus_total", ())] == 2 and m[("bladed_demoted_bytes_total", ())] == 2 * KPU
        assert m[("bladed_replans_total", ())] >= 1 and m[("bladed_demotions_failed_total", ())] == 0

        # keep going: writes and reads on a demoted KPU stay direct
        w = c.call("write", layer=1, kind="k", token_start=5, ntokens=3, seed=9)
        assert w["path"] == "direct"
        assert c.call("read_check", layer=1, kind="k", token_start=5, ntokens=3, seed=9)["match"]
        assert c.call("read_check", layer=1, kind="k", token_start=8, seed=1)["match"]
        r0 = c.call("read_check", layer=0, kind="k", seed=1)
        assert r0["path"] == "pagecache" and r0["match"]

        c.call("close")
        assert int(d.wait_event("session_close", session=sid)["trimmed_bytes"]) == 6 * KPU
        assert pc_files(tmp) == set()


def test_reserved_extent_and_padded_rows(tmp: str) -> None:
    cfg = {"budget": {"override": 8 * 4096, "reserve_extent": True}}
    with DaemonProcess(tmp, cfg).start() as d, ClientProcess(d.socket_path) as c:
        c.call("connect")
        opened = c.call("open", geometry=UNALIGNED, channels=2)
        sid, ext = opened["session"], opened["extent"]
        assert not opened["plan"]["aligned"] and opened["plan"]["n1"] == 1
        assert ext["nblocks"] == 6 * 20          # every KPU reserved: 20 padded rows of one LBA each
        assert c.call("write_all", seed=3)["paths"] == ["pagecache"] * 2 + ["direct"] * 4
        # v0 only partly filled: the demotion copies the filled rows
        c.call("write", layer=0, kind="v", token_start=0, ntokens=7, seed=4)

        shrink(d, 0)
        assert d.wait_event("replan", session=sid)["demoted"] == "k0,v0"
        d.wait_event("kpu_demoted", session=sid, kpu="k0")
        d.wait_event("kpu_demoted", session=sid, kpu="v0")
        assert pc_files(tmp) == set()
        assert c.call("read_check", layer=0, kind="v", token_start=0, ntokens=7, seed=4)["match"]
        r = c.call("read_check", layer=0, kind="k", seed=3)
        assert r["path"] == "direct" and r["match"]
        row = session_row(c, sid)
        assert row["extent"] == ext and row["group1"] == 0 and row["demoted_kpus"] == 2
        assert row["demoted_bytes"] == 2 * U_KPU
        assert journal_extents(tmp, sid) == [[ext["start"], ext["nblocks"]]]
        c.call("close")
        assert int(d.wait_event("session_close", session=sid)["trimmed_bytes"]) == 6 * 20 * 4096


def test_cachepolicy_switches_to_drop_after_use_and_direct_never_changes(tmp: str) -> None:
    with DaemonProcess(tmp, {"budget": {"override": 4 * KPU}}).start() as d, \
            ClientProcess(d.socket_path) as c, ClientProcess(d.socket_path) as o:
        o.call("connect")
        other = o.call("open", geometry=ALIGNED, mode="direct")["session"]
        c.call("connect")
        sid = c.call("open", geometry=ALIGNED, mode="cachepolicy")["session"]
        assert c.call("write_all", seed=5)["paths"] == ["pagecache"] * 8
        assert c.call("read_check", layer=1, kind="k", seed=5)["hit_ratio"] == 1.0

        shrink(d, 2 * KPU)
        assert d.wait_event("replan", session=sid)["demoted"] == "k1,v1"
        d.wait_event("kpu_demoted", session=sid, kpu="k1")
        d.wait_event("kpu_demoted", session=sid, kpu="v1")
        first = c.call("read_check", layer=1, kind="k", seed=5)
        again = c.call("read_check", layer=1, kind="k", seed=5)
        assert first["path"] == again["path"] == "pagecache" and first["match"] and again["match"]
        assert again["hit_ratio"] < 0.5           # dropped after every use now (Table III)
        assert c.call("read_check", layer=0, kind="k", seed=5)["hit_ratio"] == 1.0
        assert c.call("check_all", seed=5)["bad"] == []
        row = session_row(c, sid)
        assert (row["group1"], row["demoted_kpus"], row["pagecache_bytes"]) == (2, 2, 8 * KPU)
        assert session_row(o, other)["demoted_kpus"] == 0
        assert not d.events("replan")[1:] and d.events("replan")[0]["session"] == sid
