#!/usr/bin/env python3
"""`bladectl bench requests` from this checkout: bench/bladed_bench/studies/requests.py."""
import _bench

if __name__ == "__main__":
    _bench.study("requests", "tools/bench_requests.py")
