#!/usr/bin/env python3
"""`bladectl bench spike` from this checkout: bench/bladed_bench/studies/spike.py."""
import _bench

if __name__ == "__main__":
    _bench.study("spike", "tools/bench_spike.py")
