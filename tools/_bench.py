"""What the ``tools/bench_*.py`` shims share: run the benchmark harness (``bench/bladed_bench``) from this
checkout without installing it, this checkout's ``bladed`` and harness first on ``sys.path``."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _path() -> None:
    sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]


def study(name: str, tool: str) -> None:
    """``tools/bench_X.py ARGS``: ``bladectl bench NAME ARGS``, its messages as ``tool``."""
    _path()
    from bladed_bench.studies import shim

    shim(name, tool)


def main(tool: str) -> None:
    """``tools/bench_kv.py STUDY ARGS``: ``bladectl bench STUDY ARGS``."""
    _path()
    from bladed_bench.main import main as bench_main

    sys.exit(bench_main(sys.argv[1:], prog=tool))
