#!/usr/bin/env python3
"""`bladectl bench wear` from this checkout: bench/bladed_bench/studies/wear.py."""
import _bench

if __name__ == "__main__":
    _bench.study("wear", "tools/bench_wear.py")
