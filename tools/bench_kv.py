#!/usr/bin/env python3
"""`bladectl bench STUDY` from this checkout (bench/bladed_bench/main.py): `tools/bench_kv.py sweep|run|report ...`,
or any study of `tools/bench_kv.py --help`."""
import _bench

if __name__ == "__main__":
    _bench.main("tools/bench_kv.py")
