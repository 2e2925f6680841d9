"""What a Dual-Blade session's daemon costs while its memory cgroup sits at its limit, full of a neighbour's page
cache (the usage past the memory watch's threshold, unable to grow): the daemon's CPU over 10 s with no requests
(docs/operations.md, "Memory").

    python -m bladed_bench.at_limit [--json FILE]        # as root: real cgroups, a real daemon
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

from bladed_bench import trials
from bladed_bench.environment import git_info, machine_info

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]     # the suite's at-limit set-up (real cgroups, daemon)

WINDOW_S = 10.0


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        st = f.read().rsplit(")", 1)[1].split()
    return (int(st[11]) + int(st[12])) / os.sysconf("SC_CLK_TCK")


def measure() -> dict[str, Any]:
    from test_pagecache_memory import at_limit_full_of_cache

    with at_limit_full_of_cache(tempfile.mkdtemp(prefix="bladed-at-limit-")) as (_, d, c, _):
        before, cpu0, t0 = c.stats()["replan"]["budget_samples"], cpu_seconds(d.pid), time.monotonic()
        time.sleep(WINDOW_S)        # the measured window: nothing is waited for
        after, cpu1, t1 = c.stats()["replan"]["budget_samples"], cpu_seconds(d.pid), time.monotonic()
        (lc,) = c.budget()["sample"]["limits"]
    return {"daemon_cpu_cores": round((cpu1 - cpu0) / (t1 - t0), 4),
            "budget_samples": {k: int(after.get(k, 0)) - int(before.get(k, 0)) for k in after},
            "usage_bytes": lc["usage_bytes"], "limit_bytes": lc["limit_bytes"], "window_s": round(t1 - t0, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bladed_bench.at_limit", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--json", help="write the result here (default: stdout only)")
    ap.add_argument("--note", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    doc = {"study": "at_limit", "machine": machine_info(), "git": git_info(REPO, ["bladed"]),
           "notes": dict(n.split("=", 1) for n in args.note), "result": measure()}
    print(json.dumps(doc["result"]))
    if args.json:
        trials.write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
