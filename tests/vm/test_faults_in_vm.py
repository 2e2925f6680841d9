"""Faults and data remanence on real NVMe (QEMU's controller, inside the VM).

* Remanence on the passthrough path: a session that reads blocks an earlier
  session wrote gets zeroes, both where the namespace promises zeroes after a
  deallocate (DLFEAT, the default ``zero_freed = "auto"``: no Write Zeroes)
  and with ``zero_freed = "always"`` (Write Zeroes after the TRIM: what a
  drive without DLFEAT gets).
* Commands that fail: the VM has a second, faulty namespace on which every
  command touching one sector fails (``run-in-nvme-vm.sh --faulty-sector``,
  QEMU's blkdebug driver; the controller answers Write Fault, Unrecovered
  Read Error, or Internal Error for a deallocate).  The error reaches the
  client of the affected operation, naming the NVMe status; the session
  closes cleanly; a bystander session and the daemon carry on; the blocks
  that could not be scrubbed are kept out of use, across a restart too; and
  a start-up that would have to scrub the whole region refuses to serve.

Daemon starts are few: under TCG each costs seconds.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from nvmevm import NG_PATH, VMConfig, ng_path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from daemon_util import DaemonProcess, pattern, short_tmpdir
from remanence import GEO, KPU, remanence_round

from bladed.client import Client
from bladed.protocol import RemoteIOError

pytestmark = pytest.mark.nvme_vm

TIMEOUT = 600.0   # TCG: a daemon start or a request can take many seconds
REGION_KPUS = 32  # each test's region: 2 MiB


def region_cfg(path: str, lba: int, start_byte: int, zero_freed: str) -> dict:
    return {"device": {"backend": "nvme", "path": path, "lba_size": lba, "region_start_lba": start_byte // lba,
                       "region_blocks": REGION_KPUS * KPU // lba, "zero_freed": zero_freed},
            "budget": {"override": 0}}


@pytest.fixture(scope="module")
def faulty() -> tuple[str, int]:
    """The faulty namespace's char device and the byte offset of its bad sector."""
    nsid, sector = os.environ.get("NVMEVM_FAULTY_NSID"), os.environ.get("NVMEVM_FAULTY_SECTOR")
    assert nsid and sector, ("boot the VM with run-in-nvme-vm.sh --faulty-sector S "
                             "(tests/test_nvme_vm.py does) for the failing-command tests")
    return ng_path(int(nsid)), int(sector) * 512


@pytest.mark.parametrize("zero_freed", ["auto", "always"])
def test_new_session_never_reads_an_earlier_sessions_blocks(vm_config: VMConfig, zero_freed: str) -> None:
    lba = vm_config.lba_size
    start = (64 if zero_freed == "auto" else 80) << 20   # away from what the other VM tests write
    with short_tmpdir() as tmp, DaemonProcess(tmp, region_cfg(NG_PATH, lba, start, zero_freed)) as d:
        d.start(timeout=TIMEOUT)
        scrub = d.wait_event("region_scrub", TIMEOUT)      # first start, no journal: the start scrubs the region
        assert scrub["reason"] == "no_journal" and int(scrub["trimmed_bytes"]) == REGION_KPUS * KPU
        st = remanence_round(d, "direct")
        assert st["trimmed_bytes"] == 2 * 4 * KPU          # both sessions' extents deallocated
        if zero_freed == "auto":
            # QEMU's namespace reports DLFEAT = 001b: a deallocated block reads zeroes, no Write Zeroes
            assert st["zeroed_bytes"] == 0
        else:
            assert st["zeroed_bytes"] == 2 * 4 * KPU
        assert st["quarantined_bytes"] == 0
        assert d.stop(TIMEOUT) == 0


def test_failing_nvme_commands_reach_the_client_and_nothing_else(vm_config: VMConfig, faulty: tuple[str, int]) -> None:
    path, bad_byte = faulty
    lba = vm_config.lba_size
    # the bystander's extent ends 128 KiB before the bad sector, the victim's (4 KPUs) covers it
    start = bad_byte - 4 * KPU - 2 * KPU
    cfg = region_cfg(path, lba, start, "auto")
    region = [start // lba, REGION_KPUS * KPU // lba]
    with short_tmpdir() as tmp:
        # no journal: the whole region must be scrubbed first, and the bad sector's deallocate and
        # Write Zeroes fail, so the daemon refuses to serve blocks that may hold someone's KV cache
        with DaemonProcess(tmp, cfg).start(wait=False) as refused:
            assert refused.proc is not None and refused.proc.wait(TIMEOUT) != 0
            refused.wait_line("refusing to serve", TIMEOUT)     # what its start caused: the run's only lines

        # the journal a previous clean instance leaves (empty, this region): no whole-region scrub
        with open(os.path.join(tmp, "journal.json"), "w") as f:
            json.dump({"version": 1, "pid": 1, "sessions": [],
                       "device": {"path": path, "kind": "nvme", "lba_size": lba, "region": region}}, f)
        with DaemonProcess(tmp, cfg) as d:
            d.start(timeout=TIMEOUT)
            d.wait_event("daemon_start", TIMEOUT)              # its start-up's last line: every earlier one is in
            assert not d.events("region_scrub")
            with Client(d.socket_path, timeout=TIMEOUT) as c:
                victim_ext = run_victim_and_bystander(c, start // lba)
                st = c.stats()
                assert st["quarantined_bytes"] == 4 * KPU
                assert st["io"]["direct"]["write"]["errors"] >= 1 and st["io"]["direct"]["read"]["errors"] >= 1
                # the daemon carries on, and never hands out the quarantined blocks
                after = fresh_session_round_trip(c)
                assert disjoint(after, victim_ext)
            assert d.stop(TIMEOUT) == 0

        # the quarantined extent stays in the journal; the next start-up tries again, fails again,
        # and keeps it out of use
        with open(os.path.join(tmp, "journal.json")) as f:
            kept = json.load(f)["sessions"]
        assert [(r["mode"], [list(e) for e in r["extents"]]) for r in kept] == \
            [("quarantined", [[victim_ext["start"], victim_ext["nblocks"]]])]
        with DaemonProcess(tmp, cfg) as d2:
            d2.start(timeout=TIMEOUT)
            with Client(d2.socket_path, timeout=TIMEOUT) as c2:
                assert c2.stats()["quarantined_bytes"] == 4 * KPU
                assert disjoint(fresh_session_round_trip(c2), victim_ext)
            assert d2.stop(TIMEOUT) == 0


def run_victim_and_bystander(c: Client, region_start: int) -> dict:
    """Bystander and victim sessions side by side; the victim's extent holds the bad sector."""
    kpus = [(layer, kind) for layer in range(GEO["layers"]) for kind in "kv"]
    bystander = c.open_session(GEO, mode="direct", channels=1)
    victim = c.open_session(GEO, mode="direct", channels=1, slot_bytes=len(kpus) * KPU)
    exts = {x["session"]: x["extent"] for x in c.sessions()}
    assert exts[bystander.id]["start"] == region_start
    victim_ext = exts[victim.id]
    for layer, kind in kpus:
        bystander.slot(0)[:] = pattern("bystander", layer, kind, KPU)
        bystander.write(layer, kind, 0)

    failed = []
    for layer, kind in kpus:
        victim.slot(0)[:KPU] = pattern("victim", layer, kind, KPU)
        try:
            victim.write(layer, kind, 0)
        except RemoteIOError as e:
            assert "write fault" in str(e) and "NVMe write" in str(e), e
            failed.append((layer, kind))
    assert len(failed) == 1, f"exactly one KPU holds the bad sector, {failed} failed"
    for layer, kind in kpus:
        if (layer, kind) in failed:
            with pytest.raises(RemoteIOError, match="unrecovered read error"):
                victim.read(layer, kind, 0)
        else:
            victim.read(layer, kind, 0)
            assert bytes(victim.slot(0)[:KPU]) == pattern("victim", layer, kind, KPU)
    # one batched request reading every KPU at its own slot offset: the bad one fails alone, the rest are served
    victim.slot(0)[:] = bytes(len(kpus) * KPU)
    results = victim.submit(0, [victim.range("read", layer, kind, slot_offset=i * KPU)
                                for i, (layer, kind) in enumerate(kpus)], check=False)
    for i, ((layer, kind), r) in enumerate(zip(kpus, results, strict=True)):
        if (layer, kind) in failed:
            assert isinstance(r.error, RemoteIOError) and "unrecovered read error" in str(r.error), r
        else:
            assert r.error is None and r.path == "direct" and r.nbytes == KPU, r
            assert bytes(victim.slot(0)[i * KPU:(i + 1) * KPU]) == pattern("victim", layer, kind, KPU)
    victim.close()      # cleanly, although its extent can be neither deallocated nor zeroed

    for layer, kind in kpus:
        bystander.read(layer, kind, 0)
        assert bytes(bystander.slot(0)) == pattern("bystander", layer, kind, KPU), f"bystander {kind}{layer}"
    bystander.close()
    return dict(victim_ext)


def fresh_session_round_trip(c: Client) -> dict:
    with c.open_session(GEO, mode="direct", channels=1) as s:
        ext = next(x for x in c.sessions() if x["session"] == s.id)["extent"]
        s.slot(0)[:] = pattern("fresh", 1, "v", KPU)
        s.write(1, "v", 0)
        s.slot(0)[:] = bytes(KPU)
        s.read(1, "v", 0)
        assert bytes(s.slot(0)) == pattern("fresh", 1, "v", KPU)
    return dict(ext)


def disjoint(a: dict, b: dict) -> bool:
    return bool(a["start"] + a["nblocks"] <= b["start"] or b["start"] + b["nblocks"] <= a["start"])
