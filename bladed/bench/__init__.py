"""``bladectl bench`` / ``tools/bench_kv.py``: reproduce the Dual-Blade evaluation.

* :mod:`bladed.bench.workload` - the FlexLLMGen-pattern KV workload driver and its targets
* :mod:`bladed.bench.baseline` - the Baseline: a FlexLLMGen ``TorchDisk``-style mmap path
* :mod:`bladed.bench.sweep` - memory-limit sweep (cgroups, cold caches, alternation, repetition)
* :mod:`bladed.bench.metrics`, :mod:`bladed.bench.probes` - counters, statistics, fio and reference probes
* :mod:`bladed.bench.report` - JSON to Markdown tables and matplotlib figures
"""

from __future__ import annotations


def main(argv: list[str] | None = None, prog: str = "bench_kv") -> int:
    from bladed.bench.cli import main as _main

    return _main(argv, prog)


__all__ = ["main"]
