#!/usr/bin/env python3
"""`bladectl bench accuracy` from this checkout: bench/bladed_bench/studies/accuracy.py."""
import _bench

if __name__ == "__main__":
    _bench.study("accuracy", "tools/bench_kv_accuracy.py")
