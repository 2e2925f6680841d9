"""The daemon's one budget reading (bladed/server/sessions/budget_reading.py): readers share one measurement
within their freshness bound, a session's staging terms are applied to it without reading /proc again, and
Eq. 2 on a shared reading is what a Budgeter with the session's terms computes from the same figures."""

from __future__ import annotations

import dataclasses
import pathlib
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bladed.config import Config
from bladed.residency.budget import BudgetBreakdown, Budgeter
from bladed.server.sessions.budget_reading import BudgetSampler

MiB = 1 << 20
GiB = 1 << 30


def _fake_v2(root: pathlib.Path, limit: int, anon: int, shmem: int) -> str:
    """A /proc and a cgroup v2 tree whose figures never move: the daemon's cgroup at ``limit``."""
    cg = root / "cg2"
    leaf = cg / "bladed.service"
    leaf.mkdir(parents=True, exist_ok=True)
    (cg / "cgroup.procs").write_text("")
    (cg / "cgroup.controllers").write_text("memory\n")
    for name, text in {"cgroup.procs": "1\n", "cgroup.controllers": "memory\n", "memory.max": f"{limit}\n",
                       "memory.high": "max\n", "memory.stat": f"anon {anon}\nfile {anon}\nshmem {shmem}\n"}.items():
        (leaf / name).write_text(text)
    proc = root / "proc"
    (proc / "self").mkdir(parents=True, exist_ok=True)
    (proc / "self" / "cgroup").write_text("0::/bladed.service\n")
    (proc / "self" / "mountinfo").write_text(f"30 1 0:26 / {cg} rw,nosuid - cgroup2 cgroup2 rw\n")
    (proc / "meminfo").write_text("MemTotal: 16777216 kB\nAnonPages: 1048576 kB\nShmem: 65536 kB\n")
    return str(proc)


FIGURES = st.tuples(st.integers(64 * MiB, 8 * GiB), st.integers(0, 512 * MiB), st.integers(0, 256 * MiB))
TERMS = st.tuples(st.integers(0, 64), st.integers(0, 256 * MiB), st.integers(0, 2 * GiB))
KNOBS = st.tuples(st.none() | st.integers(0, 4 * GiB), st.none() | st.integers(0, 4 * GiB),
                  st.sampled_from([0.0, 0.03, 0.5]))


@settings(max_examples=60, deadline=None)
@given(figures=FIGURES, shared=TERMS, session=TERMS, knobs=KNOBS)
def test_eq2_on_a_shared_reading_is_a_budgeter_with_the_sessions_terms(
        tmp_path_factory: pytest.TempPathFactory, figures: tuple[int, int, int], shared: tuple[int, int, int],
        session: tuple[int, int, int], knobs: tuple[int | None, int | None, float]) -> None:
    limit, anon, shmem = figures
    override, cap, k = knobs
    proc = _fake_v2(tmp_path_factory.mktemp("tree"), limit, anon, shmem)

    def budgeter(terms: tuple[int, int, int]) -> Budgeter:
        return Budgeter(terms[0], terms[1], override, cap, proc_root=proc, mem_available=lambda: 6 * GiB,
                        mem_total=lambda: 16 * GiB, pinned_elsewhere_bytes=terms[2], kernel_overhead=k)

    derived = budgeter(shared).sample().with_staging(*session)
    direct = budgeter(session).sample()
    assert dataclasses.replace(derived, sampled_at=0) == dataclasses.replace(direct, sampled_at=0)


class Staging:
    """The open sessions' staging, as the manager answers it."""

    def __init__(self) -> None:
        self.nbytes = 0

    def __call__(self) -> int:
        return self.nbytes


def test_readers_within_the_bound_share_one_measurement_and_see_staging_move() -> None:
    staging = Staging()
    sampler = BudgetSampler(Config(), staging)
    first = sampler.reading(3600)
    assert first.reason == "demand" and first.copy_threads == 0 and first.pinned_elsewhere_bytes == 0
    staging.nbytes = 48 * MiB                     # a session opened since: its staging, not a new measurement
    again = sampler.reading(3600)
    assert again.sampled_at == first.sampled_at and again.pinned_elsewhere_bytes == 48 * MiB
    assert again == first.with_staging(0, 0, 48 * MiB)
    opening = sampler.for_session(2, 8 * MiB, 3600)
    assert opening == first.with_staging(2, 8 * MiB, 48 * MiB) and opening.pinned_bytes == 64 * MiB
    counts = sampler.to_dict()["samples"]
    assert (counts["samples"], counts["demand"]) == (1, 1)
    assert sampler.report(3600)["sampled_at"] == first.sampled_at     # gauges and status read the same one


def test_a_zero_bound_measures_anew_and_the_new_reading_is_the_shared_one() -> None:
    sampler = BudgetSampler(Config(), Staging())
    a = sampler.reading(0)
    b = sampler.for_session(1, MiB, 0)
    assert b.sampled_at >= a.sampled_at and sampler.last is not None
    assert sampler.last.sampled_at == b.sampled_at
    assert sampler.to_dict()["samples"]["demand"] == 2


def test_a_reload_drops_the_reading_and_the_counters_never_go_back() -> None:
    cfg = Config()
    sampler = BudgetSampler(cfg, Staging())
    sampler.reading(0)
    sampler.reading(0)
    cfg.budget.override = 7 * MiB
    sampler.reconfigure()
    assert sampler.last is None
    assert sampler.reading(3600).pagecache_budget_bytes == 7 * MiB
    counts = sampler.to_dict()["samples"]
    assert (counts["samples"], counts["demand"]) == (3, 3)


def test_the_schedule_keeps_the_shared_reading_fresh_and_reports_changes() -> None:
    cfg = Config()
    cfg.budget.interval_s = 0.02
    sampler = BudgetSampler(cfg, Staging())
    changes: list[BudgetBreakdown] = []
    sampled = threading.Event()
    first = sampler.start(changes.append)
    try:
        assert first.reason == "start" and sampler.to_dict()["running"]
        for _ in range(500):
            last = sampler.last
            if last is not None and last.reason == "periodic":
                sampled.set()
                break
            sampled.wait(0.01)
        assert sampled.is_set(), "no periodic sample reached the shared reading"
        assert sampler.reading(3600).reason == "periodic"          # read, not measured
    finally:
        sampler.stop()
    counts = sampler.to_dict()
    assert not counts["running"] and counts["sources"] == []
    assert counts["samples"]["periodic"] >= 1 and counts["samples"]["demand"] == 0
