#!/usr/bin/env python3
"""`bladectl bench codec` from this checkout: bench/bladed_bench/studies/codec.py."""
import _bench

if __name__ == "__main__":
    _bench.study("codec", "tools/bench_codec.py")
