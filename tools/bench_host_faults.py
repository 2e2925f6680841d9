#!/usr/bin/env python3
"""`bladectl bench host-faults` from this checkout: bench/bladed_bench/studies/host_faults.py."""
import _bench

if __name__ == "__main__":
    _bench.study("host-faults", "tools/bench_host_faults.py")
