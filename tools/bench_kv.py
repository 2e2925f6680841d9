#!/usr/bin/env python3
"""KV-cache offloading benchmark: the Dual-Blade evaluation on this machine (also ``bladectl bench``).

::

    sudo python3 tools/bench_kv.py sweep --report docs/bench/kv-report.md     # full sweep, ~2 GiB KV set
    sudo python3 tools/bench_kv.py run --config baseline --limit 1.0           # one run, summary to stdout
    python3 tools/bench_kv.py report docs/bench/kv-sweep-*.json                # tables + plots from JSON

The harness is ``bench/bladed_bench/`` (the driver, the Baseline - FlexLLMGen
TorchDisk-style mmap path - and the sweep); run from the source checkout, this
script needs nothing installed but bladed's dependencies and the ``bench`` extra.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]  # this checkout's bladed and its harness

from bladed_bench import main  # noqa: E402  (after the checkout is on sys.path)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
