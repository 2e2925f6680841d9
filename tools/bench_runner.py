#!/usr/bin/env python3
"""`bladectl bench runner` from this checkout: bench/bladed_bench/studies/runner.py."""
import _bench

if __name__ == "__main__":
    _bench.study("runner", "tools/bench_runner.py")
