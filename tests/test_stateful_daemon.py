"""A stateful property test against a real daemon (hypothesis ``RuleBasedStateMachine``, issue 27).

Rules open and close sessions of random geometries (packed and whole-LBA rows), modes, channel counts and
checksum settings; write and read random token ranges on random channels; change the page-cache budget
(``budget.override`` + SIGHUP, or no override) and put the daemon's memory cgroup under pressure (its limit
cut to a few MiB above what it must keep, then given back).  Live re-planning demotes, grows and moves
extents under the sessions meanwhile.

Invariants, after every step:

* every byte read equals the model's (never-written bytes read as zero) -- checked by the read rule;
* the extents the daemon reports are disjoint and inside its region;
* the store itself, read directly: every non-zero byte lies inside the extent of the live session that
  wrote it.  Each session's bytes carry the session's tag in their high nibble, so a byte of another
  session, of a closed one (extents are scrubbed on close), or below ``region_start_lba`` is caught.

CI runs a bounded number of steps (:data:`CI_SETTINGS`); ``tests/reliability.py stateful`` runs longer and
prints its figures (docs/reliability.md).
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
from cgroup_util import ChildCgroup
from daemon_util import DaemonProcess, short_tmpdir
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
)
from test_faults import journal_sessions

from bladed.client import Client, NoMemoryError, Session

# on both engines, io_uring and the portable one (issue 29)
pytestmark = pytest.mark.usefixtures("io_engine")

LBA = 4096
REGION_START = 8                     # LBAs below the region must never be written
STORE_BYTES = 48 << 20
CGROUP_LIMIT = 512 << 20
MAX_SESSIONS = 4
#: token rows of 192, 256, 768 (packed on 4 KiB LBAs), 4096 and 8192 bytes (whole LBAs); up to ~1.5 MiB a KPU,
#: so that a memory cut of a few MiB demotes
GEOMETRIES = [
    {"layers": 2, "batch": 1, "kv_heads": 1, "head_dim": 96, "dtype_bytes": 2, "max_tokens": 24},
    {"layers": 3, "batch": 1, "kv_heads": 1, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 96},
    {"layers": 2, "batch": 1, "kv_heads": 3, "head_dim": 64, "dtype_bytes": 4, "max_tokens": 700},
    {"layers": 2, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 200},
    {"layers": 1, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 4, "max_tokens": 96},
]
MODES = ["dualblade", "dualblade", "dualblade", "direct", "cachepolicy", "baseline"]   # the two-path mode most
BIG = 1 << 30
SETTLE_S = float(os.environ.get("SETTLE_S", "120"))


def tagged(rng: random.Random, nbytes: int, tag: int) -> bytes:
    """Random bytes whose high nibble is ``tag`` (1-15): never zero, and whose session they are is visible."""
    low = np.frombuffer(rng.randbytes(nbytes), dtype=np.uint8) & 0x0F
    return (low | (tag << 4)).astype(np.uint8).tobytes()


class LiveSession:
    """A session of the machine and what each byte of each of its KPUs must read back as."""

    def __init__(self, sess: Session, tag: int, geometry: dict[str, int]) -> None:
        self.sess = sess
        self.tag = tag
        self.geometry = geometry
        self.kv = {(layer, kind): bytearray(sess.kpu_bytes) for layer in range(geometry["layers"]) for kind in "kv"}


class DaemonMachine(RuleBasedStateMachine):
    """One daemon per example, on a file store, in a memory cgroup of its own."""

    sessions = Bundle("sessions")
    #: what every example did, summed (``tests/reliability.py stateful`` prints it)
    totals: ClassVar[dict[str, int]] = {}

    def __init__(self) -> None:
        super().__init__()
        self._stack: list[Any] = []
        self.tmp_cm = short_tmpdir()
        self.tmp = self.tmp_cm.__enter__()
        self.cg = ChildCgroup(CGROUP_LIMIT)
        self.cg_limit = CGROUP_LIMIT
        cfg = {"device": {"size": STORE_BYTES, "region_start_lba": REGION_START},
               # sessions open with part of their KV on each path, as on a box whose memory is short
               "budget": {"override": 64 << 10, "interval_s": 0.2, "cgroup": self.cg.path}}
        self.d = DaemonProcess(self.tmp, cfg).start()
        self.cg.add(self.d.pid)
        self.c = Client(self.d.socket_path)
        self.store = os.path.join(self.tmp, "kv-store.img")
        self.rng = random.Random(0)
        self.free_tags = list(range(1, 16))
        self.live: dict[str, LiveSession] = {}
        self.steps = {"opens": 0, "writes": 0, "reads": 0, "budget_changes": 0, "memory_cuts": 0}

    def dump_daemon(self) -> None:
        """The daemon's thread stacks on stderr (py-spy, where installed): what a hang shows."""
        import shutil
        import subprocess
        import sys
        spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        if self.d.proc is not None and self.d.proc.poll() is None and os.path.exists(spy):
            subprocess.run([spy, "dump", "--pid", str(self.d.pid)], check=False, timeout=60)

    def teardown(self) -> None:
        try:
            if getattr(self, "c", None) is not None and self.d.proc is not None and self.d.proc.poll() is None:
                for s in list(self.live.values()):
                    s.sess.close()
                self.live.clear()
                st = self.c.stats()
                assert st["sessions"] == 0 and st["extents"]["used_blocks"] == 0, st
                assert journal_sessions(self.tmp) == []
                pc = os.path.join(self.tmp, "pagecache")
                assert not os.path.isdir(pc) or os.listdir(pc) == [], os.listdir(pc)
                self.check_store()
                replan = st["replan"]
                done = {**self.steps, "examples": 1, "demoted_kpus": replan["demoted_kpus"],
                        "demotions_failed": replan["demotions_failed"], "extents_moved": replan["extents_moved"],
                        "sessions_opened": st["sessions_opened"], "trimmed_bytes": st["trimmed_bytes"]}
                for k, v in done.items():
                    DaemonMachine.totals[k] = DaemonMachine.totals.get(k, 0) + int(v)
                self.c.close()
                assert self.d.stop() == 0
        finally:
            if self.d.proc is not None and self.d.proc.poll() is None:
                self.d.kill()
            self.cg.remove()
            self.tmp_cm.__exit__(None, None, None)

    # -- rules ----------------------------------------------------------------------------------------------
    @precondition(lambda self: len(self.live) < MAX_SESSIONS)
    @rule(target=sessions, geo=st.sampled_from(GEOMETRIES), mode=st.sampled_from(MODES),
          channels=st.integers(1, 2), checksums=st.booleans())
    def open_session(self, geo: dict[str, int], mode: str, channels: int,
                     checksums: bool) -> str | MultipleResults[str]:
        try:
            sess = self.c.open_session(geo, mode=mode, channels=channels, checksums=checksums)
        except NoMemoryError:
            # the cut limit cannot hold this session's staging: refused (not an OOM kill of the daemon)
            assert self.cg_limit < CGROUP_LIMIT, "no_memory without a memory cut"
            return multiple()
        tag = self.free_tags.pop(0)
        self.live[sess.id] = LiveSession(sess, tag, geo)
        self.steps["opens"] += 1
        return sess.id

    @rule(sid=consumes(sessions))
    def close_session(self, sid: str) -> None:
        s = self.live.pop(sid)
        s.sess.close()
        self.free_tags.append(s.tag)    # least recently freed last: a tag comes back as late as it can

    @rule(sid=sessions, data=st.data())
    def write(self, sid: str, data: st.DataObject) -> None:
        s = self.live[sid]
        layer, kind, start, n, ch = self._range(s, data)
        tb = s.sess.token_bytes
        payload = tagged(self.rng, n * tb, s.tag)
        s.sess.slot(ch)[start * tb:(start + n) * tb] = payload
        s.sess.write(layer, kind, ch, start, n)
        s.kv[(layer, kind)][start * tb:(start + n) * tb] = payload
        self.steps["writes"] += 1

    @rule(sid=sessions, data=st.data())
    def read(self, sid: str, data: st.DataObject) -> None:
        s = self.live[sid]
        layer, kind, start, n, ch = self._range(s, data)
        tb = s.sess.token_bytes
        s.sess.slot(ch)[start * tb:(start + n) * tb] = b"\xa5" * (n * tb)
        r = s.sess.read(layer, kind, ch, start, n)
        got = bytes(s.sess.slot(ch)[start * tb:(start + n) * tb])
        want = bytes(s.kv[(layer, kind)][start * tb:(start + n) * tb])
        if got != want:
            bad = next(i for i in range(len(want)) if got[i] != want[i])
            owner = [o.sess.id for o in self.live.values() if o.tag == got[bad] >> 4]
            raise AssertionError(f"session {sid} {kind}{layer} tokens [{start}, {start + n}) on channel {ch} "
                                 f"({r.path}): byte {bad} is {got[bad]:#04x}, want {want[bad]:#04x} "
                                 f"(the byte's tag names {owner or 'no live session'})")
        self.steps["reads"] += 1

    # 64 KiB and 2 MiB leave sessions of 256- and 768-byte rows with KPUs on both paths (an extent that a
    # later demotion must grow or move), 0 demotes everything, BIG nothing, None measures the cgroup
    @rule(override=st.sampled_from([None, 0, 64 << 10, 2 << 20, BIG]))
    def set_budget(self, override: int | None) -> None:
        """``budget.override`` (None: measured from the cgroup) and a reload; waits for its re-plan."""
        budget = self.d.config["budget"]
        if override is None:
            budget.pop("override", None)
        else:
            budget["override"] = override
        self.d.write_config()
        mark = self.d.signal(signal.SIGHUP)
        try:
            self.d.wait_event("reload", after=mark)      # re-planned (live sessions' demotions scheduled) by now
        except AssertionError:
            self.dump_daemon()
            raise
        self.settle()
        self.steps["budget_changes"] += 1

    @precondition(lambda self: "override" not in self.d.config["budget"])   # an override replaces B_pc
    @rule(cut=st.booleans())
    def memory_pressure(self, cut: bool) -> None:
        """Cut the daemon's memory limit to 16 MiB above what it must keep (less than the KV of the larger
        sessions; a session's staging and the daemon's working reserve still fit), or give it back; waits for
        the budget change to be applied to the live sessions and their demotions to be done."""
        if cut == (self.cg_limit < CGROUP_LIMIT):
            return                    # no change: the budget would not move
        if cut:
            sample = self.c.budget()["sample"]
            limit = sample["anon_shmem_bytes"] + sample["pinned_bytes"] + (16 << 20)
        else:
            limit = CGROUP_LIMIT
        os.sync()                     # written-back pages are what the kernel reclaims to fit the new limit
        mark = self.d.mark()
        self.cg.set_limit(limit)
        self.cg_limit = limit
        self.d.wait_event("budget_applied", timeout=SETTLE_S, after=mark)
        self.settle()
        self.steps["memory_cuts"] += 1

    # -- invariants -----------------------------------------------------------------------------------------
    @invariant()
    def extents_disjoint_and_store_confined(self) -> None:
        self.check_store()

    # -- helpers --------------------------------------------------------------------------------------------
    def _range(self, s: LiveSession, data: st.DataObject) -> tuple[int, str, int, int, int]:
        layer = data.draw(st.integers(0, s.geometry["layers"] - 1), label="layer")
        kind = data.draw(st.sampled_from("kv"), label="kind")
        t = s.sess.max_tokens
        start = data.draw(st.integers(0, t - 1), label="token_start")
        n = data.draw(st.integers(1, t - start), label="ntokens")
        ch = data.draw(st.integers(0, s.sess.channels - 1), label="channel")
        return layer, kind, start, n, ch

    def settle(self) -> None:
        """Wait until no live session has a demotion pending (each one carried out or refused logs an event)."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            mark = self.d.mark()
            if all(r["pending_demotions"] == 0 for r in self.c.sessions()):
                return
            assert time.monotonic() < deadline, f"demotions still pending after {SETTLE_S} s"
            self.d.wait_fields(lambda f: f.get("event") in ("kpu_demoted", "kpu_demotion_failed"),
                               timeout=deadline - time.monotonic(), after=mark)

    def check_store(self) -> None:
        """The extents disjoint and in the region; every non-zero byte of the store inside its session's extent."""
        rows = {r["session"]: r for r in self.c.sessions()}
        assert rows.keys() == self.live.keys(), (sorted(rows), sorted(self.live))
        status = self.c.status()
        region = status.get("region") or {}
        end = REGION_START + int(region.get("nblocks", STORE_BYTES // LBA - REGION_START))
        spans = sorted((r["extent"]["start"], r["extent"]["start"] + r["extent"]["nblocks"], sid)
                       for sid, r in rows.items() if r["extent"])
        for a, b in itertools.pairwise(spans):
            assert a[1] <= b[0], f"extents overlap: {spans}"
        assert all(s >= REGION_START and e <= end for s, e, _ in spans), f"an extent outside the region: {spans}"
        with open(self.store, "rb") as f:
            store = np.frombuffer(f.read(), dtype=np.uint8)
        owner = np.zeros(len(store) // LBA, dtype=np.uint8)      # the tag each LBA may hold (0: none)
        for s, e, sid in spans:
            owner[s:e] = self.live[sid].tag
        tags = (store >> 4).reshape(-1, LBA)
        bad = np.nonzero((tags != 0) & (tags != owner[:, None]))
        if len(bad[0]):
            lba, off = int(bad[0][0]), int(bad[1][0])
            tag = int(tags[lba, off])
            who = [sid for sid, s in self.live.items() if s.tag == tag] or ["a closed session"]
            raise AssertionError(f"store LBA {lba} (byte {off}) holds a byte of {who[0]} (tag {tag}); the LBA "
                                 f"belongs to {[sid for s, e, sid in spans if s <= lba < e] or 'no live extent'}; "
                                 f"extents {spans}; {len(bad[0])} such bytes")


#: the CI-sized run; tests/reliability.py stateful runs longer
CI_SETTINGS = settings(max_examples=8, stateful_step_count=30, deadline=None,
                       suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.fixture
def machine_settings() -> Iterator[settings]:
    yield CI_SETTINGS


@pytest.mark.root
@pytest.mark.slow
def test_daemon_state_machine(machine_settings: settings) -> None:
    DaemonMachine.TestCase.settings = machine_settings
    run = DaemonMachine.TestCase("runTest")
    run.runTest()


__all__ = ["DaemonMachine"]
