"""``python -m bladed_bench STUDY [ARGS ...]``: what ``bladectl bench`` runs (:mod:`bladed_bench.main`)."""

from __future__ import annotations

import sys

from bladed_bench.main import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="python -m bladed_bench"))
