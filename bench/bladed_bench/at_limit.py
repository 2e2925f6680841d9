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

from bladed_bench.environment import git_info, machine_info

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]     # the suite's real-cgroup and daemon helpers

#: 8 layers of 1 MiB KPUs (16 MiB of KV): all on the page-cache path
GEOMETRY = {"layers": 8, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 256}
WINDOW_S = 10.0


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        st = f.read().rsplit(")", 1)[1].split()
    return (int(st[11]) + int(st[12])) / os.sysconf("SC_CLK_TCK")


def measure() -> dict[str, Any]:
    from cgroup_util import ChildCgroup, Worker
    from daemon_util import DaemonProcess
    from test_replan_live import open_models

    from bladed.client import Client

    tmp = tempfile.mkdtemp(prefix="bladed-at-limit-")
    with ChildCgroup(None) as cg:
        cfg = {"budget": {"cgroup": cg.path}, "device": {"size": "128M"}}
        with DaemonProcess(tmp, cfg).start() as d, Client(d.socket_path) as c:
            assert d.pid is not None
            cg.add(d.pid)
            s = c.budget()["sample"]
            cg.set_limit(s["anon_shmem_bytes"] + s["file_bytes"] + (96 << 20))
            (m,) = open_models(c, [GEOMETRY])
            with Worker(cg) as neighbour:
                neighbour.call("write_file", path=os.path.join(tmp, "cache.bin"), nbytes=256 << 20)
                before, cpu0, t0 = c.stats()["replan"]["budget_samples"], cpu_seconds(d.pid), time.monotonic()
                time.sleep(WINDOW_S)        # the measured window: nothing is waited for
                after, cpu1, t1 = c.stats()["replan"]["budget_samples"], cpu_seconds(d.pid), time.monotonic()
                (lc,) = c.budget()["sample"]["limits"]
            m.sess.close()
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
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
