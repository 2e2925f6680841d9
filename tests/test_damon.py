"""The host's DAMON pageout schemes, as bladectl ns check and the benchmarks report them."""

from __future__ import annotations

from pathlib import Path

from bladectl_util import bladectl, one_object

from bladed.residency.damon import pageout_schemes


def kdamond(root: Path, n: int, *, state: str = "on", operations: str = "paddr",
            actions: tuple[str, ...] = ("pageout",)) -> None:
    """A kdamond's sysfs directory as the kernel lays it out (Documentation/admin-guide/mm/damon/usage.rst)."""
    files = {
        "state": state,
        "contexts/0/operations": operations,
        "contexts/0/monitoring_attrs/intervals/aggr_us": "5000000",
        "contexts/0/targets/0/regions/0/start": str(4 << 30),
        "contexts/0/targets/0/regions/0/end": str(9797894144),
    }
    for i, action in enumerate(actions):
        files |= {f"contexts/0/schemes/{i}/action": action,
                  f"contexts/0/schemes/{i}/access_pattern/age/min": "12",
                  f"contexts/0/schemes/{i}/quotas/bytes": str(128 << 20),
                  f"contexts/0/schemes/{i}/quotas/reset_interval_ms": "1000",
                  f"contexts/0/schemes/{i}/ops_filters/0/type": "anon",
                  f"contexts/0/schemes/{i}/ops_filters/0/matching": "Y",
                  f"contexts/0/schemes/{i}/ops_filters/0/allow": "N",
                  f"contexts/0/schemes/{i}/ops_filters/1/type": "unmapped",
                  f"contexts/0/schemes/{i}/ops_filters/1/matching": "Y",
                  f"contexts/0/schemes/{i}/ops_filters/1/allow": "Y"}
    for rel, text in files.items():
        path = root / "kdamonds" / str(n) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    (root / "kdamonds" / "nr_kdamonds").write_text(f"{n + 1}\n")


def test_a_running_physical_pageout_scheme_is_found_with_its_idle_age_range_and_quota(tmp_path: Path) -> None:
    kdamond(tmp_path, 0, actions=("stat", "pageout"))
    [scheme] = pageout_schemes(str(tmp_path))
    assert scheme.min_idle_s == 60.0
    assert scheme.ranges == ((4 << 30, 9797894144),)
    assert scheme.quota_bytes_per_s == 128 << 20
    assert scheme.filters == ("reject anon", "allow unmapped")
    assert scheme.describe() == ("kdamond 0 pages out memory idle for 60 s (4.0-9.1 GiB, at most 128 MiB/s; "
                                 "reject anon, allow unmapped)")


def test_stopped_kdamonds_process_schemes_and_other_actions_do_not_count(tmp_path: Path) -> None:
    kdamond(tmp_path, 0, state="off")
    kdamond(tmp_path, 1, operations="vaddr")
    kdamond(tmp_path, 2, actions=("lru_prio", "stat"))
    assert pageout_schemes(str(tmp_path)) == []
    assert pageout_schemes(str(tmp_path / "absent")) == []


def test_ns_check_names_this_machines_host_pageout(tmp_path: Path) -> None:
    # whatever this machine runs: the check says so in one line, a warning exactly when a scheme runs
    r = bladectl("ns", "check", "--backend", "file", "--size", "1M", "--json", str(tmp_path / "store.bin"),
                 cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    [check] = [c for c in one_object(r)["checks"] if c["check"] == "host page-out"]
    schemes = pageout_schemes()
    assert check["status"] == ("warn" if schemes else "ok")
    assert all(s.describe() in check["detail"] for s in schemes)
