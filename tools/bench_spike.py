#!/usr/bin/env python3
"""A neighbour's memory spike beside bladed's KV in memory: who survives (docs/reliability.md, "Memory spikes").

::

    sudo tools/bench_spike.py --repeat 3 --idle 45        # issue 46's table, 3 runs each, and the idle wear: ~25 min
    sudo tools/bench_spike.py --placements sibling --rates 400 --backings memory   # one case

One memory cgroup with a limit (1 GiB) holds the daemon and a neighbour (``sibling``: each in a child cgroup of the
limited one; ``own``: both in it); a Dual-Blade session writes 612 MiB of KV; the neighbour grows by 360 MiB at
each rate; the record says whether it lived, whether every KPU read back exact, what bladed demoted and how fast it
reacted. The harness is ``bench/bladed_bench/spike.py``. Needs root (cgroups, loop devices).
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]  # this checkout's bladed and its harness

from bladed_bench.spike import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
