#!/usr/bin/env python3
"""`bladectl bench prefix` from this checkout: bench/bladed_bench/studies/prefix.py."""
import _bench

if __name__ == "__main__":
    _bench.study("prefix", "tools/bench_prefix.py")
