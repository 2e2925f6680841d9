#!/usr/bin/env python3
"""`bladectl bench copy-limit` from this checkout: bench/bladed_bench/studies/copy_limit.py."""
import _bench

if __name__ == "__main__":
    _bench.study("copy-limit", "tools/bench_copy_limit.py")
