"""The package's floors are a contract: import-linter keeps them, and docs/architecture.md's table shows them.

The contracts live in ``[tool.importlinter]`` of pyproject.toml; ``lint-imports`` (import-linter's
console script, installed with the test extras) checks them on the real source tree.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINT_IMPORTS = pathlib.Path(sys.executable).with_name("lint-imports")


def lint_imports(tree: pathlib.Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the package under ``tree`` (it puts its cwd first on sys.path)."""
    assert LINT_IMPORTS.exists(), f"{LINT_IMPORTS} is missing; install the test extras: pip install -e '.[test]'"
    env = {**os.environ, "COLUMNS": "200"}  # one line per contract in the summary
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=tree, env=env, capture_output=True, text=True)


def contracts() -> list[dict[str, Any]]:
    return list(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"])


def contract_name(contract_id: str) -> str:
    (name,) = (c["name"] for c in contracts() if c["id"] == contract_id)
    return str(name)


def test_contracts_kept() -> None:
    r = lint_imports(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    for c in contracts():
        assert f"{c['name']} KEPT" in r.stdout, r.stdout


@pytest.fixture
def tree_copy(tmp_path: pathlib.Path) -> pathlib.Path:
    """The package's sources and pyproject.toml, to break on purpose."""
    shutil.copytree(ROOT / "bladed", tmp_path / "bladed", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


@pytest.mark.parametrize(("module", "line", "contract", "report"), [
    pytest.param("bladed/io/file.py", "from bladed.server.storage import journal", "floors",
                 "bladed.io.file -> bladed.server.storage.journal", id="floor-imports-above"),
    pytest.param("bladed/residency/planner.py", "import bladed.config", "floors",
                 "bladed.residency.planner -> bladed.config", id="same-floor"),
    pytest.param("bladed/extra.py", "", "floors", "- bladed.extra", id="module-on-no-floor"),
    pytest.param("bladed/kvstore.py", "import bladed.io.file", "client-side",
                 "bladed.kvstore -> bladed.io.file", id="client-imports-io"),
    # the indirect way goes through an allowed importer (the CLI, the demo), on the top floor: the floors refuse it
    pytest.param("bladed/runner/main.py", "import bladed.demo", "floors",
                 "bladed.runner.main -> bladed.demo", id="client-reaches-io-indirectly"),
    pytest.param("bladed/server/events.py", "import bladed.server.daemon.core", "acyclic",
                 "No cycles are allowed in bladed.server.", id="cycle-in-package"),
])
def test_contracts_catch(tree_copy: pathlib.Path, module: str, line: str, contract: str, report: str) -> None:
    """Each contract fails on the import it is there to refuse, and its report names that import."""
    path = tree_copy / module
    path.write_text((path.read_text() if path.exists() else "") + f"\n{line}\n")
    r = lint_imports(tree_copy)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert f"{contract_name(contract)} BROKEN" in out, out
    assert report in out, out


def contract_floors() -> dict[int, set[str]]:
    """The ``floors`` layers contract: floor number (bottom 0) -> module names under ``bladed``."""
    (floors,) = (c for c in contracts() if c["id"] == "floors")
    assert floors["type"] == "layers" and floors["containers"] == ["bladed"], floors
    out = {}
    for n, layer in enumerate(reversed(floors["layers"])):
        # the table says the modules of one floor do not import each other: import-linter's "|", not ":"
        assert ":" not in layer, f"floor {layer!r} is not independent; docs/architecture.md says it is"
        out[n] = {name.strip() for name in layer.split("|")}
    return out


def docs_floors(doc: str) -> dict[int, set[str]]:
    """The floor table of architecture.md's "## Floors": floor number -> module names under ``bladed``."""
    section = doc.split("\n## Floors\n", 1)[1].split("\n## ", 1)[0]
    floors: dict[int, set[str]] = {}
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if row.startswith("|") and cells[0].isdigit():
            floors.setdefault(int(cells[0]), set()).update(re.findall(r"`bladed/(\w+)(?:/|\.py)`", cells[1]))
    return floors


def stale_table(doc: str) -> str | None:
    """None when the doc's floor table is the contract's; else the rows it should have."""
    want = contract_floors()
    if docs_floors(doc) == want:
        return None
    rows = "\n".join(f"| {n} | {as_row(names)} |" for n, names in sorted(want.items(), reverse=True))
    return f"docs/architecture.md's floor table differs from [tool.importlinter] (pyproject.toml); its floors:\n{rows}"


def as_row(names: set[str]) -> str:
    return ", ".join(f"`bladed/{n}/`" if (ROOT / "bladed" / n).is_dir() else f"`bladed/{n}.py`" for n in sorted(names))


def test_docs_floor_table_matches_contract() -> None:
    problem = stale_table((ROOT / "docs" / "architecture.md").read_text())
    assert problem is None, problem


def test_stale_docs_floor_table_is_caught() -> None:
    """A table that puts ``bladed/hf.py`` a floor below where the contract has it (as it once stood) fails."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    (floor,) = (n for n, names in contract_floors().items() if "hf" in names)
    rows = doc.splitlines()
    at = next(i for i, r in enumerate(rows) if r.startswith(f"| {floor} |") and "`bladed/hf.py`" in r)
    below = next(i for i, r in enumerate(rows) if r.startswith(f"| {floor - 1} |"))
    rows[at] = rows[at].replace("`bladed/hf.py`, ", "").replace(", `bladed/hf.py`", "")
    cells = rows[below].split(" | ")
    cells[1] += ", `bladed/hf.py`"
    rows[below] = " | ".join(cells)
    stale = "\n".join(rows)
    assert "hf" in docs_floors(stale)[floor - 1] and "hf" not in docs_floors(stale)[floor]
    problem = stale_table(stale)
    assert problem is not None
    assert f"| {floor} | {as_row(contract_floors()[floor])} |" in problem, problem


def test_the_daemon_and_the_client_run_without_torch() -> None:
    """The daemon (and a client that sizes quantized rows) never loads torch: a box or container that stores KV
    needs none (the Containerfile's daemon image has none). A geometry of a quantized format is sized without it."""
    code = ("import sys, bladed.server.daemon.main, bladed.client, bladed.cli.bladectl\n"
            "from bladed.residency.geometry import Geometry\n"
            "g = Geometry(layers=2, batch=1, kv_heads=3, head_dim=64, dtype_bytes=2, max_tokens=8, kv_format='q4')\n"
            "assert g.token_bytes == 120, g.token_bytes\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
