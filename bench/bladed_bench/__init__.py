"""``bladectl bench`` / ``tools/bench_kv.py``: reproduce the Dual-Blade evaluation.

The ``bladed-bench`` distribution (``bench/`` of the source checkout), not part of the ``bladed`` package:
it imports bladed, never the reverse (docs/benchmarks.md, "The harness").

* :mod:`bladed_bench.main`, :mod:`bladed_bench.studies` - the command line: ``bladectl bench STUDY`` /
  ``python -m bladed_bench STUDY``, every study by name (``tools/bench_*.py`` are shims that run one)
* :mod:`bladed_bench.stats` - medians with their spread, paired ratios, the runs that ended, sizes
* :mod:`bladed_bench.workload` - the FlexLLMGen-pattern KV workload driver and its targets (the Baseline:
  :mod:`bladed.torchdisk`, FlexLLMGen's ``TorchDisk`` mmap path, which ``bladed-runner --backend mmap`` runs too)
* :mod:`bladed_bench.e2e` - real inference under memory limits: ``bladed-runner`` with every KV backend
  (``tools/bench_e2e.py``)
* :mod:`bladed_bench.sweep` - memory-limit sweep (cgroups, cold caches, alternation, repetition)
* :mod:`bladed_bench.metrics`, :mod:`bladed_bench.probes` - counters, statistics, fio and reference probes
* :mod:`bladed_bench.report` - JSON to Markdown tables and matplotlib figures
* :mod:`bladed_bench.repo` - where the checkout is; the environment of the processes the harness starts
"""

from __future__ import annotations


def main(argv: list[str] | None = None, prog: str = "bench_kv") -> int:
    from bladed_bench.main import main as _main

    return _main(argv, prog)


__all__ = ["main"]
