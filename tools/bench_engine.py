#!/usr/bin/env python3
"""`bladectl bench engine` from this checkout: bench/bladed_bench/studies/engine.py."""
import _bench

if __name__ == "__main__":
    _bench.study("engine", "tools/bench_engine.py")
