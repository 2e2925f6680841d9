#!/usr/bin/env python3
"""`bladectl bench pagecache-write` from this checkout: bench/bladed_bench/studies/pagecache_write.py."""
import _bench

if __name__ == "__main__":
    _bench.study("pagecache-write", "tools/bench_pagecache_write.py")
