"""The benchmark harness is not part of the product (issue 16): the wheel that ``pip install .`` builds
has no benchmark module, the product imports the harness only in ``bladectl bench``'s body, and
``bladectl bench`` runs the harness where it is installed and says in one line how to get it where not.
The harness is the ``bladed-bench`` distribution in ``bench/`` (docs/benchmarks.md, "The harness")."""

from __future__ import annotations

import ast
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator

import pytest
from bladectl_util import bladectl, failure, one_line
from daemon_util import ROOT, env_with_repo, short_tmpdir

HARNESS = "bladed_bench"
#: what pip builds the product from (as tools/install.sh stages it), plus bench/: present, yet not shipped
SOURCES = ("pyproject.toml", "setup.py", "README.md", "cffi_build", "bladed", "bench")
#: runs bladectl as its console script does, with the harness made unimportable (as if not installed,
#: even in a venv where tools/setup.sh installed it)
WITHOUT_HARNESS = (f"import runpy, sys; sys.modules[{HARNESS!r}] = None; "
                   "runpy.run_module('bladed.cli.bladectl', run_name='__main__', alter_sys=True)")


def _build_wheel(src: pathlib.Path, out: pathlib.Path) -> zipfile.ZipFile:
    """``pip wheel`` of ``src`` offline (the build requirements are those of this interpreter)."""
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "--no-index", "-w", str(out), str(src)], capture_output=True, text=True, timeout=500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return zipfile.ZipFile(wheels[0])


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A copy of the sources (so that the builds leave no build/ or *.egg-info in the checkout)."""
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "_uring.c", "build", "*.egg-info")
    for name in SOURCES:
        path = pathlib.Path(ROOT, name)
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    return src


@pytest.mark.slow  # compiles the cffi extension: 5-10 s
def test_the_product_wheel_has_no_benchmark_modules(staged: pathlib.Path, tmp_path: pathlib.Path) -> None:
    names = _build_wheel(staged, tmp_path).namelist()
    assert "bladed/cli/bladectl.py" in names and "bladed/server/daemon/core.py" in names
    bench = [n for n in names if n.startswith((f"{HARNESS}/", "bladed/bench/", "bench/"))]
    assert bench == [], bench


def test_the_harness_is_its_own_distribution_and_needs_the_bench_extra(staged: pathlib.Path,
                                                                       tmp_path: pathlib.Path) -> None:
    whl = _build_wheel(staged / "bench", tmp_path)
    names = whl.namelist()
    modules = {n for n in names if n.endswith(".py")}
    assert {f"{HARNESS}/{m}.py" for m in ("main", "workload", "e2e", "sweep", "report")} <= modules
    assert not [n for n in modules if not n.startswith(f"{HARNESS}/")], modules
    meta = whl.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "Name: bladed-bench" in meta and "Requires-Dist: bladed[bench]" in meta


def _harness_imports(tree: ast.AST) -> Iterator[tuple[int, list[str]]]:
    """(line, enclosing function names) of every import of the harness in ``tree``."""
    def walk(node: ast.AST, funcs: list[str]) -> Iterator[tuple[int, list[str]]]:
        for child in ast.iter_child_nodes(node):
            inner = [*funcs, child.name] if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else funcs
            mods: list[str] = []
            if isinstance(child, ast.Import):
                mods = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                mods = [child.module]
            if any(m == HARNESS or m.startswith(HARNESS + ".") for m in mods):
                yield child.lineno, funcs
            yield from walk(child, inner)

    yield from walk(tree, [])


def test_the_product_imports_the_harness_only_in_bladectl_bench() -> None:
    found = []
    for path in sorted(pathlib.Path(ROOT, "bladed").rglob("*.py")):
        for line, funcs in _harness_imports(ast.parse(path.read_text(), str(path))):
            found.append((str(path.relative_to(ROOT)), line, funcs))
    assert found and all(funcs == ["bench"] for _, _, funcs in found), found


@pytest.fixture(scope="module")
def nowhere() -> Iterator[str]:
    """An empty working directory."""
    with short_tmpdir() as tmp:
        yield tmp


def test_bladectl_bench_without_the_harness_says_how_to_get_it(nowhere: str) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", WITHOUT_HARNESS, *args], cwd=nowhere, env=env_with_repo(),
                              capture_output=True, text=True, timeout=120)

    msg = one_line(run("bench", "sweep", "--limits", "1"), 2)
    assert "benchmark harness is not installed" in msg and "pip install ./bench" in msg, msg
    msg = failure(run("--json", "bench", "--help"), 2, "no_bench")
    assert "pip install ./bench" in msg, msg


def test_bladectl_bench_runs_the_harness_where_it_is(nowhere: str) -> None:
    """`bladectl bench --help` printed argparse usage named `bench_kv`."""
    env = {"PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "bench")])}
    r = bladectl("bench", "--help", cwd=nowhere, env=env)
    assert r.returncode == 0 and r.stdout.startswith("usage: bladectl bench ") and "bench_kv" not in r.stdout
    assert all(f"\n  {name} " in r.stdout for name in ("sweep", "run", "report"))   # every study: test_bench_cli.py
    sub = bladectl("bench", "run", "--help", cwd=nowhere, env=env)
    assert sub.returncode == 0 and sub.stdout.startswith("usage: bladectl bench run ")
