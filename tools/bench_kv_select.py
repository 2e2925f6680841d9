#!/usr/bin/env python3
"""`bladectl bench select` from this checkout: bench/bladed_bench/studies/kv_select.py."""
import _bench

if __name__ == "__main__":
    _bench.study("select", "tools/bench_kv_select.py")
