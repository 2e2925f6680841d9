#!/usr/bin/env python3
"""`bladectl bench select-io` from this checkout: bench/bladed_bench/studies/select_io.py."""
import _bench

if __name__ == "__main__":
    _bench.study("select-io", "tools/bench_select_io.py")
