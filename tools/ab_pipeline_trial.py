#!/usr/bin/env python3
"""`bladectl bench pipeline-trial` from this checkout: bench/bladed_bench/studies/pipeline_trial.py."""
import _bench

if __name__ == "__main__":
    _bench.study("pipeline-trial", "tools/ab_pipeline_trial.py")
