#!/usr/bin/env python3
"""KV-cache offloading benchmark: the Dual-Blade evaluation on this machine (also ``bladectl bench``).

::

    sudo python3 tools/bench_kv.py sweep --report docs/bench/kv-report.md     # full sweep, ~2 GiB KV set
    sudo python3 tools/bench_kv.py run --config baseline --limit 1.0           # one run, summary to stdout
    python3 tools/bench_kv.py report docs/bench/kv-sweep-*.json                # tables + plots from JSON

See ``bladed/bench/`` for the driver, the Baseline (FlexLLMGen TorchDisk-style
mmap path) and the sweep.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bladed.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
