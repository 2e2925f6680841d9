"""Two extensions: a client process needs ``bladed._wire`` only, never liburing (``bladed._uring``).

The child process here runs with ``python -S`` (no site: no editable-install finder that could fetch
``bladed._uring`` from the checkout) on a copy of the package without ``_uring*.so``, ``bladed/server/``
and ``bladed/io/``, with a finder in front of every other that refuses, and records, any import of them.
It opens a session on a real daemon started normally, moves data through both connections (JSON and a
data channel, pipelined), reads it back, and reports what its memory maps hold: ``bladed._wire``, and no
liburing.  The daemon, for contrast, has liburing mapped.

import-linter cannot name ``bladed._uring`` in a contract (it sees Python sources only), so the same rule
is also checked statically here: no module of the client side (the ``client-side`` contract's modules and
everything they import) imports it.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib

import grimp
from daemon_util import DaemonProcess, short_tmpdir

ROOT = pathlib.Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent("""
    import importlib.abc, json, os, sys

    BLOCKED = ("bladed._uring", "bladed.server", "bladed.io")
    tried = []

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.startswith(BLOCKED):
                tried.append(name)
                raise ImportError(f"{name} is not available to a client")
            return None

    sys.meta_path.insert(0, Refuse())

    import bladed
    from bladed.client import Client
    from bladed.protocol import IOOp, IORange

    out = {"bladed": bladed.__file__}
    try:
        __import__("bladed._uring")
        out["uring_importable"] = True
    except ImportError:
        out["uring_importable"] = False
    tried.clear()

    geo = {"layers": 2, "batch": 1, "kv_heads": 2, "head_dim": 64, "dtype_bytes": 2, "max_tokens": 16}
    tb = 2 * 64 * 2
    with Client(sys.argv[1]) as c, c.open_session(geo, channels=2) as s:
        kpu = tb * 16
        want = {}
        for ch in range(2):                                 # one whole KPU a channel, through each data channel
            data = os.urandom(kpu)
            s.slot(ch)[:kpu] = data
            s.submit(ch, [IORange(IOOp.WRITE, ch, 0, 16)])    # raises if refused or failed
            want[ch] = data
        row = os.urandom(tb)                                # a one-token append of layer 0's V (tensor 1)
        s.slot(1)[3 * tb:4 * tb] = row
        s.write(0, "v", 1, 3, 1)
        want[1] = want[1][:3 * tb] + row + want[1][4 * tb:]
        dc = s.channel(0)                                   # two reads of tensor 0 pipelined on channel 0
        s.slot(0)[:kpu] = bytes(kpu)
        dc.send([IORange(IOOp.READ, 0, 0, 8)])
        dc.send([IORange(IOOp.READ, 0, 8, 8)])
        assert all(r.ok for r in dc.receive() + dc.receive())
        out["read_back"] = [bytes(s.slot(0)[:kpu]) == want[0]]
        s.slot(1)[:kpu] = bytes(kpu)
        s.read(0, "v", 1)
        out["read_back"].append(bytes(s.slot(1)[:kpu]) == want[1])
        s.slot(1)[:kpu] = bytes(kpu)
        s.submit(1, [IORange(IOOp.READ, 1, 0, 16)])
        out["read_back"].append(bytes(s.slot(1)[:kpu]) == want[1])
    maps = open("/proc/self/maps").read()
    out["liburing_mapped"] = "liburing" in maps
    out["uring_mapped"] = "_uring" in maps
    out["wire_mapped"] = "_wire" in maps
    out["tried"] = tried
    out["loaded"] = sorted(m for m in sys.modules if m.startswith("bladed"))
    print(json.dumps(out))
""")


def client_tree(dest: pathlib.Path) -> pathlib.Path:
    """The package as a client box could have it: no daemon side, no daemon extension."""
    shutil.copytree(ROOT / "bladed", dest / "bladed",
                    ignore=shutil.ignore_patterns("__pycache__", "_uring*", "server", "io"))
    assert list((dest / "bladed").glob("_wire*.so")), "bladed._wire is not built in place (pip install -e .)"
    return dest


def test_a_client_round_trips_without_liburing(tmp_path: pathlib.Path) -> None:
    tree = client_tree(tmp_path)
    site = sysconfig.get_paths()["purelib"]      # cffi's backend and the rest, without site's .pth files
    with short_tmpdir() as d, DaemonProcess(d).start() as dp:
        env = {"PYTHONPATH": f"{tree}:{site}", "PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"}
        r = subprocess.run([sys.executable, "-S", "-c", CHILD, dp.socket_path], env=env, cwd=tree,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert dp.pid is not None
        daemon_maps = pathlib.Path(f"/proc/{dp.pid}/maps").read_text()
    assert out["bladed"].startswith(str(tree)), out
    assert out["uring_importable"] is False
    assert out["read_back"] == [True, True, True], out
    assert out["tried"] == [], f"the client tried to import {out['tried']}"
    assert (out["liburing_mapped"], out["uring_mapped"], out["wire_mapped"]) == (False, False, True), out
    assert not {m for m in out["loaded"] if m.startswith(("bladed.server", "bladed.io", "bladed._uring"))}
    assert "liburing" in daemon_maps and "_uring" in daemon_maps     # the daemon's side links it


def client_side() -> set[str]:
    """What an inference process may import: every module of the package but the ``client-side`` contract's
    protected modules (the daemon's) and the importers it allows (the operator's commands) (pyproject.toml)."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (contract,) = (c for c in contracts if c["id"] == "client-side")
    daemon_side = set(contract["protected_modules"]) | set(contract["allowed_importers"])
    graph = grimp.build_graph("bladed", cache_dir=None)
    return {m for m in graph.modules if not any(m == d or m.startswith(f"{d}.") for d in daemon_side)}


def imports_of(module: str) -> set[str]:
    """What ``module``'s source imports, with ``from bladed import _uring`` as ``bladed._uring``."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    names: set[str] = set()
    for node in ast.walk(ast.parse(pathlib.Path(spec.origin).read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_no_client_side_module_imports_the_daemon_extension() -> None:
    modules = client_side()
    assert {"bladed.client", "bladed.datachannel", "bladed.protocol", "bladed.config"} <= modules
    offenders = sorted(m for m in modules if any(n == "bladed._uring" or n.startswith("bladed._uring.")
                                                 for n in imports_of(m)))
    assert offenders == [], f"client-side modules import bladed._uring (liburing): {offenders}"
    assert "bladed._wire" in imports_of("bladed.protocol")
