"""The GPU box's set-up steps of the check: ``install``, ``liburing`` and ``build``.

What is carried for them (:data:`CARRIED`, :data:`DEBS`, for :data:`BOX_PY`; ``gpu_carry.py`` fills the carry):
the wheels are installed with pip into a private ``--target``, Debian's liburing is unpacked with ``dpkg -x``
(or, without dpkg, by :func:`unpack_deb`), and the cffi extension is built against it (:func:`build_extension`,
which ``--prepare`` also uses for the prebuilt fallback). Standard library only.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import sys
import sysconfig
import tarfile

from gpu_probe import python_include
from gpu_run import ROOT, Ctx, Log, Result, run_child, tail

#: the Python the GPU box runs (the carried wheels are built for it)
BOX_PY = (3, 12)
#: what bladed imports that the GPU box lacks (pip name, version, import name); the box has torch,
#: transformers, numpy, click, psutil, prometheus-client, tqdm, safetensors, accelerate, pyyaml, requests
CARRIED: tuple[tuple[str, str, str], ...] = (
    ("cffi", "2.1.1", "cffi"),
    ("pycparser", "3.12", "pycparser"),
    ("pyudev", "0.24.5", "pyudev"),
    ("cgroupspy", "0.2.3", "cgroupspy"),
    ("crc32c", "2.9.post0", "crc32c"),
    ("gguf", "0.19.0", "gguf"),
)
#: packages published as a source distribution only: built into a (pure-Python) wheel here
SDIST_ONLY = ("cgroupspy",)
#: Debian bookworm's liburing (bladed's C engine links it), unpacked with dpkg -x on the box
DEBS = ("liburing2", "liburing-dev")
#: the platform tags of the wheels pip may take for the box (CPython 3.12, x86-64 Linux)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")


def _wheels(ctx: Ctx) -> list[str]:
    return sorted(glob.glob(os.path.join(ctx.carry, "wheels", "*.whl")))


def step_install(ctx: Ctx) -> Result:
    """pip install --no-index --no-deps --target of the carried wheels, then an import check in a child."""
    wheels = _wheels(ctx)
    names = [n for n, _, _ in CARRIED]
    if not wheels:
        if not ctx.rehearse:
            return {"status": "failed", "reason": f"no wheels in {ctx.carry}/wheels: run tools/gpu/gpu_check.py "
                                                  "--prepare where pip can reach PyPI, and carry .gpu-carry"}
        imp = _import_check(ctx, [m for _, _, m in CARRIED], None)
        return {"status": "passed" if imp["ok"] else "failed", "reason": None if imp["ok"] else imp["error"],
                "data": {"carry": None, "note": "no carry here: the local environment provides the packages",
                         "imports": imp}}
    missing = [n for n in names if not any(os.path.basename(w).lower().startswith(n.replace("-", "_") + "-")
                                           for w in wheels)]
    site = os.path.join(ctx.installs, "site")
    shutil.rmtree(site, ignore_errors=True)
    match = sys.version_info[:2] == BOX_PY
    argv = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
            "--no-cache-dir", "--disable-pip-version-check", "--target", site]
    if not match:  # lay the cp312 wheels out as the box's pip would (this interpreter cannot import them)
        argv += ["--only-binary=:all:", "--python-version", "".join(map(str, BOX_PY)), "--implementation", "cp"]
        argv += [x for p in PLATFORMS for x in ("--platform", p)]
    c = run_child([*argv, *wheels], timeout=ctx.timeout("install"), log=ctx.log, what="install: pip")
    data: Result = {"wheels": [os.path.basename(w) for w in wheels], "target": site, "missing": missing,
                    "interpreter_matches_wheels": match}
    if c.rc != 0:
        return {"status": "failed" if c.rc is not None else "timeout", "reason": f"pip: {tail(c.out, 5)}",
                "data": data}
    data["installed"] = sorted(os.listdir(site))
    if missing:
        return {"status": "failed", "reason": f"the carry lacks wheels of {', '.join(missing)}", "data": data}
    if match:
        ctx.site = site
        data["imports"] = imp = _import_check(ctx, [m for _, _, m in CARRIED] + ["_cffi_backend"], site)
        if not imp["ok"]:
            return {"status": "failed", "reason": imp["error"], "data": data}
    else:
        data["imports"] = {"ok": None, "note": f"this is Python {sys.version_info[0]}.{sys.version_info[1]}: "
                                              "the cp312 layout was checked, not imported"}
        data["local_imports"] = imp = _import_check(ctx, [m for _, _, m in CARRIED], None)
        if not imp["ok"]:
            return {"status": "failed", "reason": imp["error"], "data": data}
    return {"status": "passed", "data": data}


def _import_check(ctx: Ctx, modules: list[str], site: str | None) -> Result:
    env = ctx.child_env()
    if site is not None:
        env["PYTHONPATH"] = site + os.pathsep + env["PYTHONPATH"]
    code = (f"import importlib, json\nout = {{}}\nfor m in {modules!r}:\n    mod = importlib.import_module(m)\n"
            "    out[m] = getattr(mod, '__file__', None)\nprint(json.dumps(out))\n")
    c = run_child([sys.executable, "-c", code], timeout=60, env=env, log=ctx.log, what="install: import check")
    if c.rc != 0:
        return {"ok": False, "error": tail(c.out, 3)}
    return {"ok": True, "modules": json.loads(c.out.strip().splitlines()[-1])}


def step_liburing(ctx: Ctx) -> Result:
    debs = sorted(glob.glob(os.path.join(ctx.carry, "debs", "*.deb")))
    if not debs:
        if not ctx.rehearse:
            return {"status": "failed", "reason": f"no .deb in {ctx.carry}/debs: run --prepare and carry .gpu-carry"}
        if os.path.exists("/usr/include/liburing.h"):
            return {"status": "passed", "data": {"prefix": None, "note": "no carry here: the system's liburing-dev"}}
        return {"status": "failed", "reason": "no carried liburing and no /usr/include/liburing.h"}
    prefix = os.path.join(ctx.installs, "liburing")
    shutil.rmtree(prefix, ignore_errors=True)
    os.makedirs(prefix)
    how = "dpkg -x"
    for deb in debs:
        c = run_child(["dpkg", "-x", deb, prefix], timeout=ctx.timeout("liburing"), log=ctx.log, what="dpkg -x") \
            if shutil.which("dpkg") else None
        if c is None or c.rc != 0:
            # no dpkg (or a broken one): a .deb is an ar archive holding data.tar.*; unpack that here
            why = "no dpkg" if c is None else f"dpkg -x failed: {tail(c.out, 2)}"
            try:
                unpack_deb(deb, prefix)
            except (OSError, ValueError, tarfile.TarError) as e:
                return {"status": "failed", "reason": f"{os.path.basename(deb)}: {why}; unpacking it here: {e}"}
            how = f"unpacked by gpu_check ({why})"
            ctx.log(f"liburing: {os.path.basename(deb)} {how}")
    lib = glob.glob(os.path.join(prefix, "usr", "lib", "*", "liburing.so.2*"))
    hdr = os.path.join(prefix, "usr", "include", "liburing.h")
    if not lib or not os.path.exists(hdr):
        return {"status": "failed", "reason": f"the unpacked debs lack liburing.so.2 or liburing.h under {prefix}"}
    ctx.prefix = prefix
    # the built extension finds it by its rpath; the prebuilt one (a fallback) through this
    lib_dir = libdir(prefix)
    ctx.env["LD_LIBRARY_PATH"] = os.pathsep.join(x for x in (lib_dir, os.environ.get("LD_LIBRARY_PATH")) if x)
    return {"status": "passed", "data": {"prefix": prefix, "how": how, "debs": [os.path.basename(d) for d in debs],
                                         "lib": sorted(os.path.basename(x) for x in lib)}}


def unpack_deb(deb: str, dest: str) -> None:
    """``dpkg -x DEB DEST`` without dpkg: the ``data.tar.{xz,gz,bz2,}`` member of the ar archive, extracted."""
    with open(deb, "rb") as f:
        if f.read(8) != b"!<arch>\n":
            raise ValueError("not an ar archive")
        while True:
            header = f.read(60)
            if len(header) < 60:
                raise ValueError("no data.tar member")
            name = header[:16].decode().strip().rstrip("/")
            size = int(header[48:58].decode().strip())
            body = f.read(size)
            if size % 2:
                f.read(1)
            if name.startswith("data.tar"):
                import io

                with tarfile.open(fileobj=io.BytesIO(body)) as t:
                    t.extractall(dest, filter="data")
                return


def libdir(prefix: str) -> str:
    return os.path.dirname(glob.glob(os.path.join(prefix, "usr", "lib", "*", "liburing.so.2*"))[0])


def build_extension(build_dir: str, prefix: str | None, python: str, env: dict[str, str], timeout: float,
                    log: Log | None, extra_include: str | None = None) -> tuple[str | None, str]:
    """Compile ``bladed._uring`` (cffi API mode, ``cffi_build/build_uring.py``) in ``build_dir`` with ``python``,
    against liburing unpacked at ``prefix`` (None: the system's), linked with an rpath to it, and beside it
    ``bladed._wire`` (``build_wire.py``), which ``bladed._uring`` imports. Returns the built ``_uring``'s path
    (None on failure; :func:`with_wire` names both) and the compiler's output."""
    shutil.rmtree(build_dir, ignore_errors=True)
    os.makedirs(build_dir)
    shutil.copytree(os.path.join(ROOT, "cffi_build"), os.path.join(build_dir, "cffi_build"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    # the wire's layouts: the build generates the C header from this file's WIRE-LAYOUT section
    os.makedirs(os.path.join(build_dir, "bladed"))
    shutil.copy2(os.path.join(ROOT, "bladed", "protocol.py"), os.path.join(build_dir, "bladed", "protocol.py"))
    env = dict(env)
    cflags, ldflags = [], []
    if prefix is not None:
        cflags.append(f"-I{os.path.join(prefix, 'usr', 'include')}")
        lib = libdir(prefix)
        ldflags += [f"-L{lib}", f"-Wl,-rpath,{lib}"]
    if extra_include:
        cflags.append(f"-I{extra_include}")
    if cflags:
        env["CFLAGS"] = " ".join([*cflags, env.get("CFLAGS", "")]).strip()
        env["CPPFLAGS"] = " ".join([*cflags, env.get("CPPFLAGS", "")]).strip()
    if ldflags:
        env["LDFLAGS"] = " ".join([*ldflags, env.get("LDFLAGS", "")]).strip()
    code = ("import sys\nsys.path.insert(0, 'cffi_build')\nimport build_uring\n"
            "print('BUILT_WIRE', build_uring.wire.ffibuilder.compile(tmpdir='.', verbose=True))\n"
            "print('BUILT', build_uring.ffibuilder.compile(tmpdir='.', verbose=True))\n")
    c = run_child([python, "-c", code], timeout=timeout, env=env, cwd=build_dir, log=log, what="build: cffi")
    m = re.search(r"^BUILT (.+)$", c.out, re.M)
    if c.rc != 0 or m is None:
        return None, c.out if c.rc is not None else c.out + "\n(timed out)"
    path = m.group(1).strip()
    path = path if os.path.isabs(path) else os.path.join(build_dir, path)
    if not os.path.exists(with_wire(path)[1]):
        return None, c.out + "\n(bladed._wire was not built beside bladed._uring)"
    return path, c.out


def with_wire(uring: str) -> tuple[str, str]:
    """A built ``_uring`` and the ``_wire`` built (or carried) beside it, which it imports."""
    head, name = os.path.split(uring)
    return uring, os.path.join(head, name.replace("_uring", "_wire", 1))


def copy_with_wire(uring: str, dest_dir: str, name: str | None = None) -> str:
    """Copy a built ``_uring`` (as ``name``) and its ``_wire`` into ``dest_dir``; the ``_uring`` copy's path."""
    dest = os.path.join(dest_dir, name or os.path.basename(uring))
    for src, dst in zip(with_wire(uring), with_wire(dest), strict=True):
        shutil.copy2(src, dst)
    return dest


def step_build(ctx: Ctx) -> Result:
    gcc = shutil.which("gcc") or shutil.which("cc")
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    data: Result = {"compiler": gcc, "ext_suffix": suffix}
    include = None
    if not os.path.exists(os.path.join(python_include(), "Python.h")):
        carried = os.path.join(ctx.installs, "pyinclude")
        tgz = os.path.join(ctx.carry, "pyinclude.tar.gz")
        if os.path.exists(tgz):
            with tarfile.open(tgz) as t:
                t.extractall(carried, filter="data")
            include = os.path.join(carried, f"python{BOX_PY[0]}.{BOX_PY[1]}")
            data["python_headers"] = "carried (this Python has no Python.h)"
    built, out = (None, "no C compiler (gcc/cc) on PATH") if gcc is None else build_extension(
        os.path.join(ctx.installs, "build"), ctx.prefix, sys.executable, ctx.child_env(), ctx.timeout("build"), ctx.log,
        include)
    target = os.path.join(ROOT, "bladed", "_uring" + suffix)
    status, reason = "passed", None
    if built is None:
        status, reason = "failed", f"the extension did not build: {tail(out, 8)}"
        prebuilt = os.path.join(ctx.carry, "prebuilt", "_uring" + suffix)
        if os.path.exists(prebuilt) and not ctx.rehearse:
            built = prebuilt
            data["fallback"] = f"using the extension prebuilt by --prepare ({prebuilt})"
    data["built"] = built
    if built is not None:
        # any build of it (pip's is _uring.abi3.so): a copy under this Python's own suffix would shadow it
        have = glob.glob(os.path.join(ROOT, "bladed", "_uring.*so"))
        if not ctx.rehearse or not have:
            # on the box (a throw-away copy of the tree) the package's own; in a rehearsal only where this
            # Python has none yet (the checkout's environment keeps the one it built, and nothing is left there
            # to shadow a later rebuild)
            copy_with_wire(built, os.path.dirname(target), os.path.basename(target))
            data["installed_as"] = target
        else:
            data["installed_as"] = None
            data["note"] = (f"rehearsal: {', '.join(os.path.relpath(h, ROOT) for h in have)} exists and is left as "
                            "it is")
        ctx.extension = target if data["installed_as"] else built
    return {"status": status, "reason": reason, "data": data}
