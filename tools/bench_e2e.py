#!/usr/bin/env python3
"""`bladectl bench e2e` from this checkout: bench/bladed_bench/studies/e2e.py."""
import _bench

if __name__ == "__main__":
    _bench.study("e2e", "tools/bench_e2e.py")
