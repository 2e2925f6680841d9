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
        exec .venv/bin/python -m bladed.demo "$@"
        ;;
    test)
        tools/setup.sh
        exec .venv/bin/python -m pytest tests "$@"
        ;;
    *)
        echo "usage: tools/run.sh demo|test [args...]" >&2
        exit 2
        ;;
esac
