#!/usr/bin/env bash
# tools/run.sh - the two quick-start entry points.
#   tools/run.sh demo   install everything, start bladed, run the main job
#   tools/run.sh test   install everything, run the whole test suite
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=${1:-}
shift || true
case $cmd in
    demo)
        tools/setup.sh --no-vm
        # start bladed on its embedded default (file-backed store under
        # var/runner) and generate text with SmolLM2-135M, KV offloaded through it
        exec .venv/bin/python -m bladed.runner --model smollm2 --spawn-daemon --state-dir var/runner "$@"
        ;;
    test)
        # --vllm: tests/test_vllm.py runs a real vLLM engine (its environment is cached: ~1-13 min once)
        tools/setup.sh --vllm
        exec .venv/bin/python -m pytest tests "$@"
        ;;
    *)
        echo "usage: tools/run.sh demo|test [args...]" >&2
        exit 2
        ;;
esac
