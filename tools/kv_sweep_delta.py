#!/usr/bin/env python3
"""`bladectl bench delta` from this checkout: bench/bladed_bench/studies/delta.py."""
import _bench

if __name__ == "__main__":
    _bench.study("delta", "tools/kv_sweep_delta.py")
