"""The code stays ruff-clean and the package and the benchmark harness mypy-clean (what reviewers rely on)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_clean() -> None:
    r = run("ruff", "check", "bladed", "bench", "tests", "tools", "cffi_build", "setup.py")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_clean() -> None:
    r = run("mypy", "bladed", "bench/bladed_bench")
    assert r.returncode == 0, r.stdout + r.stderr
