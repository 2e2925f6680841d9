#!/usr/bin/env python3
"""Long reliability runs: the code of the CI-sized suites beside this file (tests/test_fuzz_protocol.py,
tests/test_faults.py, tests/test_soak.py, tests/test_stateful_daemon.py), run longer. Not a test module
(pytest does not collect it):

    tests/reliability.py fuzz  --cases 1000000 [--seed N]
    tests/reliability.py kills --kills 10000
    tests/reliability.py soak  --seconds 600
    tests/reliability.py stateful --examples 200 --steps 60 [--seed N]

Each starts its own daemon on a file store in a temporary directory and prints
one JSON line of figures (for docs/reliability.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from daemon_util import DaemonProcess, short_tmpdir  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    f = sub.add_parser("fuzz")
    f.add_argument("--cases", type=int, default=1_000_000)
    f.add_argument("--seed", type=int, default=int(time.time()))
    k = sub.add_parser("kills")
    k.add_argument("--kills", type=int, default=10_000)
    k.add_argument("--seed", type=int, default=int(time.time()))
    s = sub.add_parser("soak")
    s.add_argument("--seconds", type=float, default=600.0)
    s.add_argument("--sessions", type=int, default=8)
    s.add_argument("--seed", type=int, default=0)
    m = sub.add_parser("stateful", help="the daemon state machine of tests/test_stateful_daemon.py, longer")
    m.add_argument("--examples", type=int, default=200)
    m.add_argument("--steps", type=int, default=60)
    m.add_argument("--seed", type=int, default=int(time.time()))
    a = p.parse_args(argv)
    if a.what == "fuzz":
        from test_fuzz_protocol import fuzz_daemon, run_fuzz

        with fuzz_daemon() as d:
            out = run_fuzz(d, a.cases, a.seed)
        out["seed"] = a.seed
    elif a.what == "kills":
        import psutil
        from test_faults import assert_clean, run_kills

        from bladed.client import Client

        with short_tmpdir() as tmp, DaemonProcess(tmp, {"budget": {"override": 6 * 64 * 1024}}).start() as d, \
                Client(d.socket_path) as c:
            rss0 = psutil.Process(d.pid).memory_info().rss
            t0 = time.monotonic()
            out = run_kills(d.socket_path, a.kills, a.seed)
            out["seconds"] = time.monotonic() - t0
            st = assert_clean(d, c, None, None)
            out.update(sessions_opened=st["sessions_opened"], trimmed_bytes=st["trimmed_bytes"],
                       rss_before=rss0, rss_after=psutil.Process(d.pid).memory_info().rss)
    elif a.what == "stateful":
        from hypothesis import seed, settings
        from test_stateful_daemon import CI_SETTINGS, DaemonMachine

        DaemonMachine.totals.clear()
        DaemonMachine.TestCase.settings = settings(CI_SETTINGS, max_examples=a.examples,
                                                   stateful_step_count=a.steps, database=None)
        t0 = time.monotonic()
        seed(a.seed)(DaemonMachine.TestCase)("runTest").runTest()
        out = {"examples": a.examples, "max_steps": a.steps, "seed": a.seed,
               "seconds": round(time.monotonic() - t0, 1), **DaemonMachine.totals}
    else:
        from test_soak import SOAK_CONFIG, run_soak

        with short_tmpdir() as tmp, DaemonProcess(tmp, SOAK_CONFIG).start() as d:
            out = run_soak(d.socket_path, a.seconds, a.seed, a.sessions)
        assert out["mismatches"] == [], out["mismatches"][:5]
    print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
