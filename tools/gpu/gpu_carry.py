"""``gpu_check.py --prepare``: the carry (``.gpu-carry/``) filled here, for a GPU box without network.

Here pip reaches PyPI and apt Debian's archive: bladed's wheels that the box lacks (``gpu_install.CARRIED``,
for CPython 3.12 on x86-64), real FlexGen's (``gpu_flexgen.py``), Debian's liburing, Python's headers and an
extension prebuilt for 3.12 (the box's fallback), with a manifest. Then, where this machine has a Python 3.12,
the box is simulated (:func:`simulate_box`: the check's rehearsal on the carry, on a bare 3.12 with the box's
packages). Standard library only.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence

import gpu_flexgen  # standard library only at import
from gpu_install import BOX_PY, CARRIED, DEBS, PLATFORMS, SDIST_ONLY, build_extension, copy_with_wire, libdir, with_wire
from gpu_report import JSON_NAME
from gpu_run import HERE, ROOT, Log, Result, now, tail

CARRY = os.path.join(ROOT, ".gpu-carry")
#: what the box has that a bare Python 3.12 here lacks (for --prepare's simulation only: never carried)
BOX_STANDIN = ("setuptools", "numpy", "click", "psutil", "prometheus-client", "tqdm", "pyyaml", "requests")
#: the carry must stay well under the device's 64 MiB working-tree limit (the tree itself takes ~20 MiB)
CARRY_LIMIT = 24 << 20


# -- --prepare: fill the carry -------------------------------------------------------------------------

def prepare(carry: str, simulate: bool) -> int:
    log = Log(None)
    os.makedirs(carry, exist_ok=True)
    _exclude_from_git(carry, log)
    wheels = os.path.join(carry, "wheels")
    shutil.rmtree(wheels, ignore_errors=True)
    os.makedirs(wheels)
    binary = [f"{n}=={v}" for n, v, _ in CARRIED if n not in SDIST_ONLY]
    argv = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
            "".join(map(str, BOX_PY)), "--implementation", "cp", *[x for p in PLATFORMS for x in ("--platform", p)],
            "-d", wheels, *binary]
    log(f"pip download {' '.join(binary)}")
    subprocess.run(argv, check=True)
    for n, v, _ in CARRIED:
        if n in SDIST_ONLY:
            log(f"pip wheel {n}=={v} (source only on PyPI: a pure-Python wheel built here)")
            subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", f"{n}=={v}", "-w", wheels],
                           check=True)
    flexgen = os.path.join(carry, "flexgen")
    shutil.rmtree(flexgen, ignore_errors=True)
    log(f"pip download {' '.join(f'{n}=={v}' for n, v, _ in gpu_flexgen.WHEELS)} (real FlexGen, issue 41)")
    gpu_flexgen.fetch(flexgen)
    for w in glob.glob(os.path.join(wheels, "*.whl")) + glob.glob(os.path.join(flexgen, "*.whl")):
        if not re.search(r"-(py3-none-any|cp312-cp312-[^/]*x86_64)\.whl$", w):
            raise SystemExit(f"{w}: not a wheel the box's CPython 3.12 on x86-64 can install")
    debs = os.path.join(carry, "debs")
    shutil.rmtree(debs, ignore_errors=True)
    os.makedirs(debs)
    log(f"apt-get download {' '.join(DEBS)} (this machine: {_os_release()}, {platform.machine()})")
    subprocess.run(["apt-get", "download", *DEBS], cwd=debs, check=True, stdout=subprocess.DEVNULL)
    py312 = find_python312()
    prebuilt = os.path.join(carry, "prebuilt")
    shutil.rmtree(prebuilt, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(carry, "pyinclude.tar.gz"))
    if py312 is None:
        log("no Python 3.12 here: no Python headers and no prebuilt extension carried (the box builds its own)")
    else:
        _carry_headers(py312, carry, log)
        _carry_prebuilt(py312, carry, log)
    manifest = write_manifest(carry)
    log(f"carry {carry}: {len(manifest['files'])} files, {manifest['bytes'] / 2**20:.2f} MiB "
        f"(limit {CARRY_LIMIT >> 20} MiB)")
    for f in manifest["files"]:
        log(f"  {f['bytes']:>9}  {f['path']}")
    if manifest["bytes"] > CARRY_LIMIT:
        log("the carry is too large")
        return 1
    if simulate:
        if py312 is None:
            log("no Python 3.12 here: the GPU box's install and build are not simulated")
        else:
            return simulate_box(py312, carry, log)
    return 0


def _os_release() -> str:
    with contextlib.suppress(OSError), open("/etc/os-release") as f:
        for line in f:
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"')
    return "?"


def _exclude_from_git(carry: str, log: Log) -> None:
    rel = os.path.relpath(carry, ROOT)
    if rel.startswith(".."):
        return
    r = subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        return
    path = os.path.join(ROOT, r.stdout.strip())
    line = f"/{rel}/"
    have: list[str] = []
    if os.path.exists(path):
        with open(path) as f:
            have = f.read().splitlines()
    if line not in have:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a") as f:
            f.write(line + "\n")
        log(f"{line} added to {os.path.relpath(path, ROOT)}")


def find_python312() -> str | None:
    """A CPython 3.12 here (the GPU box's version), for the headers, the prebuilt extension and the simulation."""
    pyenv = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12")))
    cands = [shutil.which("python3.12"), *pyenv]
    for c in cands:
        if not c:
            continue
        r = subprocess.run([c, "-c", "import sys; print(sys.version_info[:2] == (3, 12), sys.executable)"],
                           capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.startswith("True"):
            return r.stdout.split()[1]
    return None


def _py_paths(python: str) -> dict[str, str]:
    r = subprocess.run([python, "-c", "import json, sysconfig; print(json.dumps({'include': "
                        "sysconfig.get_paths()['include'], 'suffix': sysconfig.get_config_var('EXT_SUFFIX')}))"],
                       capture_output=True, text=True, check=True)
    return dict(json.loads(r.stdout))


def _carry_headers(python: str, carry: str, log: Log) -> None:
    inc = _py_paths(python)["include"]
    if not os.path.exists(os.path.join(inc, "Python.h")):
        log(f"{python} has no Python.h: none carried")
        return
    dest = os.path.join(carry, "pyinclude.tar.gz")
    with tarfile.open(dest, "w:gz") as t:
        t.add(inc, arcname=f"python{BOX_PY[0]}.{BOX_PY[1]}")
    log(f"Python headers of {python} carried ({os.path.getsize(dest)} bytes): for a box without Python.h")


def _site_for(python: str, wheels: Sequence[str], dest: str) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", dest,
                    *wheels], check=True, env={**os.environ, "PIP_FIND_LINKS": ""})


def _download(python: str, names: Sequence[str], dest: str) -> list[str]:
    os.makedirs(dest, exist_ok=True)
    subprocess.run([python, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", dest, *names], check=True)
    return sorted(glob.glob(os.path.join(dest, "*.whl")))


def _carry_prebuilt(python: str, carry: str, log: Log) -> None:
    """The extension built here for CPython 3.12, against the carried liburing: used only where the box's own
    build fails (no compiler)."""
    tmp = tempfile.mkdtemp(prefix="gc-prep-")
    try:
        tools = _download(python, ["setuptools"], os.path.join(tmp, "tools"))
        _site_for(python, [*glob.glob(os.path.join(carry, "wheels", "*.whl")), *tools], os.path.join(tmp, "site"))
        prefix = os.path.join(tmp, "prefix")
        for deb in glob.glob(os.path.join(carry, "debs", "*.deb")):
            subprocess.run(["dpkg", "-x", deb, prefix], check=True)
        env = {**os.environ, "PYTHONPATH": os.path.join(tmp, "site")}
        built, out = build_extension(os.path.join(tmp, "build"), prefix, python, env, 300, None)
        if built is None:
            log(f"the prebuilt extension did not build with {python}:\n{tail(out, 10)}")
            return
        os.makedirs(os.path.join(carry, "prebuilt"), exist_ok=True)
        dest = copy_with_wire(built, os.path.join(carry, "prebuilt"))
        log(f"prebuilt {os.path.basename(built)} carried ({os.path.getsize(dest)} bytes; rpath "
            f"{libdir(prefix)} is not on the box: it finds the unpacked liburing through LD_LIBRARY_PATH)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_manifest(carry: str) -> Result:
    files: list[Result] = []
    total = 0
    for dirpath, _, names in os.walk(carry):
        for n in sorted(names):
            p = os.path.join(dirpath, n)
            rel = os.path.relpath(p, carry)
            if rel == "manifest.json":
                continue
            with open(p, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            size = os.path.getsize(p)
            total += size
            files.append({"path": rel, "bytes": size, "sha256": digest})
    doc = {"created": now(), "for": f"CPython {BOX_PY[0]}.{BOX_PY[1]} on x86-64 Linux (the GPU box)",
           "packages": [{"name": n, "version": v} for n, v, _ in CARRIED],
           "flexgen": [{"name": n, "version": v} for n, v, _ in gpu_flexgen.WHEELS], "debs": list(DEBS),
           "files": sorted(files, key=lambda x: str(x["path"])), "bytes": total}
    with open(os.path.join(carry, "manifest.json"), "w") as f:
        json.dump(doc, f, indent=1)
    return doc


# -- the GPU box, simulated here -----------------------------------------------------------------------

def simulate_box(py312: str, carry: str, log: Log) -> int:
    """The GPU box as far as this machine goes: a bare CPython 3.12 with the box's own packages but torch (from
    PyPI, into a stand-in directory that is never carried), running this check's rehearsal on the carry: the
    real install of the cp312 wheels, dpkg -x, the build against the unpacked liburing, io_uring, the daemon."""
    tmp = tempfile.mkdtemp(prefix="gc-sim-")
    try:
        log(f"simulating the GPU box with {py312}: the box's packages (but torch) from PyPI into {tmp}/standin")
        wheels = _download(py312, BOX_STANDIN, os.path.join(tmp, "dl"))
        standin = os.path.join(tmp, "standin")
        _site_for(py312, wheels, standin)
        out = os.path.join(tmp, "out")
        env = {**os.environ, "PYTHONPATH": standin, "PYTHONNOUSERSITE": "1"}
        suffix = _py_paths(py312)["suffix"]
        targets = with_wire(os.path.join(ROOT, "bladed", "_uring" + suffix))
        had = [os.path.exists(t) for t in targets]
        r = subprocess.run([py312, os.path.join(HERE, "gpu_check.py"), "--rehearse", "--out", out, "--carry", carry,
                            "--budget-s", "300"], env=env)
        for target, existed in zip(targets, had, strict=True):
            if not existed and os.path.exists(target):
                os.unlink(target)  # the simulation's, not this checkout's
        with open(os.path.join(out, JSON_NAME)) as f:
            doc = json.load(f)
        ok = all(doc["steps"][s]["status"] == "passed" for s in ("install", "liburing", "build", "uring", "daemon"))
        inst = doc["steps"]["install"].get("data", {})
        mods = sorted((inst.get("imports") or {}).get("modules", {}))
        log(f"simulation: install/liburing/build/uring/daemon {'all passed' if ok else 'NOT all passed'}; "
            f"carried modules imported from {inst.get('target')}: {mods}")
        return 0 if ok and r.returncode in (0, 1) else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
