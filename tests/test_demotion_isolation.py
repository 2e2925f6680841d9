"""Live demotion keeps every session inside its own extent (issue 27).

Four ``dualblade`` sessions of different row sizes (192, 768, 6144 and 4096 bytes: packed and whole-LBA
rows) hold known bytes; a SIGHUP that lowers ``budget.override`` to 0 demotes every page-cache KPU of all
of them in the same pass.  Each session must then read back its own bytes (never another session's), the
extents the daemon reports must be disjoint and inside the region, and no byte of the store may lie outside
a live extent -- neither below ``region_start_lba`` nor in another session's extent.  Raising the budget
again moves nothing; closing TRIMs every extent.

Three ways in: sessions opened with no extent (the default: a demotion allocates the session's room),
sessions that reserved room for every KPU at open (``budget.reserve_extent``), and sessions that opened
with some KPUs already on the extent (its room must grow).  On the file store and on a loop device; the
NVMe namespace runs the same scenario inside the VM (tests/vm/test_replan_in_vm.py).
"""

from __future__ import annotations

import itertools
import os
import signal
from typing import Any

import pytest
from daemon_util import DaemonProcess
from test_daemon import has_data
from test_replan_live import Model, close_and_check_clean, pc_files, shrink

from bladed.client import Client

# on both engines, io_uring and the portable one (issue 29)
pytestmark = pytest.mark.usefixtures("io_engine")

#: the four geometries of the report: layers 2, batch 1, rows of 192 / 768 / 6144 / 4096 bytes
FOUR = [
    {"layers": 2, "batch": 1, "kv_heads": 1, "head_dim": 96, "dtype_bytes": 2, "max_tokens": 12},
    {"layers": 2, "batch": 1, "kv_heads": 3, "head_dim": 64, "dtype_bytes": 4, "max_tokens": 40},
    {"layers": 2, "batch": 1, "kv_heads": 3, "head_dim": 1024, "dtype_bytes": 2, "max_tokens": 17},
    {"layers": 2, "batch": 1, "kv_heads": 1, "head_dim": 2048, "dtype_bytes": 2, "max_tokens": 33},
]
BIG = 1 << 30
#: the region starts past LBA 0 (4096-byte LBAs on both local backends): a KPU written below it is caught
REGION_START = 16


def row_bytes(g: dict[str, int]) -> int:
    return g["batch"] * g["kv_heads"] * g["head_dim"] * g["dtype_bytes"]


def kpu_bytes(g: dict[str, int]) -> int:
    return row_bytes(g) * g["max_tokens"]


def assert_store_confined(store: str, lba: int, extents: dict[str, dict[str, int] | None]) -> None:
    """No byte of the store outside the live extents, and the extents pairwise disjoint."""
    spans = sorted((e["start"], e["start"] + e["nblocks"]) for e in extents.values() if e)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start, f"extents overlap: {spans}"
    assert all(s >= REGION_START for s, _ in spans), f"an extent below region_start_lba {REGION_START}: {spans}"
    pos = 0
    for s, e in [*spans, (os.path.getsize(store) // lba, 0)]:
        if s > pos:
            assert not has_data(store, pos * lba, (s - pos) * lba), \
                f"bytes outside every live extent in LBA [{pos}, {s}) of the store (extents {spans})"
        pos = max(pos, e)


def write_everything(models: list[Model]) -> None:
    """Every KPU whole, then v of layer 1 again partly (a fill mark inside the KPU)."""
    for m in models:
        for layer, kind in m.kv:
            m.write(layer, kind, 0, m.sess.max_tokens, 0)
        m.write(1, "v", 1, 3, 1)


def kpus_on(plan: dict[str, Any], path: str) -> list[str]:
    return [f"{k['kind']}{k['layer']}" for k in plan["kpus"] if k["path"] == path]


@pytest.mark.root
@pytest.mark.parametrize("room", ["none", "reserved", "partial"])
def test_four_sessions_demoted_in_one_pass_stay_in_their_extents(
        tmp: str, device: tuple[dict[str, Any], str], room: str) -> None:
    dev_cfg, store = device
    # "partial": a budget that holds the largest session's first layer, the next one nothing, the two smallest
    # whole: sessions open with and without an extent, one of them with KPUs on both paths
    open_budget = {"none": BIG, "reserved": BIG, "partial": 400_000}[room]
    geometries = FOUR[::-1] if room == "partial" else FOUR
    cfg = {"device": {**dev_cfg, "region_start_lba": REGION_START},
           "budget": {"override": open_budget, "reserve_extent": room == "reserved"}}
    with DaemonProcess(tmp, cfg).start() as d, Client(d.socket_path) as c:
        lba = c.stats()["lba_size"]
        models = [Model(c.open_session(geo, channels=2), f"isolation/{room}/{i}") for i, geo in enumerate(geometries)]
        to_demote = {m.sess.id: kpus_on(m.sess.plan, "pagecache") for m in models}
        opened = {r["session"]: r["extent"] for r in c.sessions()}
        if room == "partial":
            mixed = [m for m in models if to_demote[m.sess.id] and kpus_on(m.sess.plan, "direct")]
            assert mixed and opened[mixed[0].sess.id] is not None, [m.sess.plan for m in models]
            assert any(opened[sid] is None for sid in opened), opened
        else:
            assert all(len(to_demote[m.sess.id]) == len(m.kv) for m in models)
            assert all((e is None) == (room == "none") for e in opened.values()), opened
        write_everything(models)
        for m in models:
            m.check()

        shrunk = shrink(d, 0)
        for m in models:
            for name in to_demote[m.sess.id]:
                d.wait_event("kpu_demoted", session=m.sess.id, kpu=name, after=shrunk)
        for m in models:
            assert set(m.check().values()) == {"direct"}
        rows = {r["session"]: r for r in c.sessions()}
        for m in models:
            row = rows[m.sess.id]
            assert row["demotions_failed"] == 0 and row["pending_demotions"] == 0, row
            assert row["demoted_kpus"] == len(to_demote[m.sess.id]), row
            ext = row["extent"]
            # the extent holds every KPU of the session, packed back to back (Eq. 3-6)
            assert ext is not None and ext["nblocks"] * lba >= sum(k["padded_bytes"] for k in m.sess.plan["kpus"])
        assert pc_files(tmp) == set()
        moved = c.stats()["replan"]["extents_moved"]
        if room == "partial":
            # the mixed session's extent had a neighbour: it moved to a run with room, and its old run is scrubbed
            assert moved >= 1 and len(d.events("extent_moved")) == moved
        else:
            assert moved == 0
        extents = {sid: r["extent"] for sid, r in rows.items()}
        os.sync()
        assert_store_confined(store, lba, extents)

        # more writes on the direct path, then the budget back up: nothing moves, every byte reads back
        for m in models:
            assert m.more() == {"direct"}
        d.config["budget"].update(override=BIG)
        d.write_config()
        d.wait_event("reload", after=d.signal(signal.SIGHUP))
        for m in models:
            assert set(m.check().values()) == {"direct"}
        assert {r["session"]: r["extent"] for r in c.sessions()} == extents
        os.sync()
        assert_store_confined(store, lba, extents)
        close_and_check_clean(d, c, models, store)
        assert not has_data(store, 0, os.path.getsize(store)), "bytes left in the store after every session closed"
