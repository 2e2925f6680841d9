"""The code stays ruff-clean and the package and the benchmark harness mypy-clean (what reviewers rely on)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: mypy's incremental cache, once per machine like the VM kernels. Keyed by the sources' paths: a checkout (with its
#: .venv) where the cache was made checks again in 3 s what takes 53 s from nothing; a fresh clone at another path
#: reads torch's stubs from its own .venv again (43 s measured); a changed module is checked again (its hash)
MYPY_CACHE = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "bladed" / "mypy"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_clean() -> None:
    r = run("ruff", "check", "bladed", "bench", "tests", "tools", "cffi_build", "setup.py")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_clean() -> None:
    r = run("mypy", "--cache-dir", str(MYPY_CACHE), "bladed", "bench/bladed_bench")
    assert r.returncode == 0, r.stdout + r.stderr
