#!/usr/bin/env python3
"""`bladectl bench vllm` from this checkout: bench/bladed_bench/studies/vllm.py."""
import _bench

if __name__ == "__main__":
    _bench.study("vllm", "tools/bench_vllm.py")
