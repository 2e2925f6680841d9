#!/usr/bin/env python3
"""The GPU half of bladed, checked in one command on a machine with an NVIDIA GPU and no network (issue 32).

::

    python3 tools/gpu/gpu_check.py --prepare                  # here (network): fill .gpu-carry/ for the GPU box
    python3 tools/gpu/gpu_check.py --rehearse --out /tmp/gc   # here (CPU): the same steps, CUDA parts not run
    python3 tools/gpu/gpu_check.py --out "$OUT"               # on the GPU box, from the repository root

On the GPU box it installs the carried wheels into a private ``--target`` directory, unpacks Debian's
liburing with ``dpkg -x`` into a private prefix (both under ``var/gpu-check``, git-ignored), builds the cffi
extension (``bladed._uring``) against it,
probes io_uring, starts a private daemon (file-backed store in a temporary directory), finds where memory
cgroups with a hard limit can be made (``cgroups``), installs the carried FlexGen into a private directory with a
local stand-in for OPT's tokenizer (``flexgen``, ``tools/gpu/gpu_flexgen.py``), runs the ``cuda`` tests
(``tests/test_cuda.py``) and the measurements (staging-slot bandwidth and copy/kernel overlap, runner tokens/s
with KV through bladed against KV kept in GPU memory, one KV sweep point with real DMA and real per-layer compute
at two memory limits, a per-layer profile of the runner with KV through bladed against KV on the GPU at batch 1
and 8 (``profile``, ``tools/gpu/gpu_profile.py``), and the end-to-end benchmark on OPT-6.7B's shape at three memory
limits with real FlexGen at the same points (``e2e``, issue 41)), and writes ``gpu-check.json``,
``gpu-check.log``, ``gpu-check-e2e.json`` (the benchmark's own JSON) and the profile's traces to ``--out``.

Every step runs in a child process of its own (process group) with a timeout, inside one overall budget
(``--budget-s``): a step that hangs is killed with whatever it started, reported as ``timeout``, and the
steps after it still run. A step's status is ``passed``, ``failed``, ``timeout`` or ``not_run`` (with the
reason: no CUDA, no io_uring, an earlier step failed). Where the kernel has no io_uring (a gVisor sandbox),
the daemon's parts are reported not runnable with the reason and the pure-CUDA parts still run. The ``e2e`` step
gets what the budget leaves (``RESERVE`` keeps time for it while earlier steps run) and starts no run that would
end past it (the step is then ``timeout``, its JSON's ``budget`` saying how many ran); ``--skip`` leaves
measurements out to give it more.

``--rehearse`` runs the same steps on the CPU (``CUDA_VISIBLE_DEVICES=""`` for every step, so on a GPU box too):
the CUDA parts are reported ``not_run`` ("no CUDA"),
the runner, the sweep point, the profile and the end-to-end benchmark run on the CPU with small models (plumbing
and the JSON's shape; FlexGen under its ``cpu-shim``, opt-125m), the
extension is built into the work directory (the one in ``bladed/`` that this checkout's environment uses
is left alone), and the carry is installed into a temporary ``--target`` (laid out for Python 3.12 when
this interpreter is another). CI runs it (``tests/test_gpu_check.py``).

This file uses the standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as dt
import errno
import glob
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import gpu_flexgen  # tools/gpu/: standard library only at import

HERE = os.path.dirname(os.path.abspath(__file__))  # tools/gpu
ROOT = os.path.dirname(os.path.dirname(HERE))
CARRY = os.path.join(ROOT, ".gpu-carry")
SCHEMA = "bladed.gpu_check/1"
JSON_NAME = "gpu-check.json"
LOG_NAME = "gpu-check.log"

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
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
#: what the box has that a bare Python 3.12 here lacks (for --prepare's simulation only: never carried)
BOX_STANDIN = ("setuptools", "numpy", "click", "psutil", "prometheus-client", "tqdm", "pyyaml", "requests")
#: the carry must stay well under the device's 64 MiB working-tree limit (the tree itself takes ~20 MiB)
CARRY_LIMIT = 24 << 20

#: per-step timeouts (s) on the GPU box and in a rehearsal (the e2e step: what the budget leaves)
TIMEOUTS = {
    "environment": (60, 60), "install": (90, 120), "liburing": (30, 30), "build": (150, 150),
    "uring": (30, 30), "daemon": (60, 60), "cgroups": (30, 30), "flexgen": (90, 240), "cuda_tests": (240, 120),
    "bandwidth": (90, 60), "runner": (120, 90), "sparse": (150, 60), "sweep": (150, 90), "profile": (150, 150),
    "e2e": (3600, 600),
}
#: seconds kept for a later step while an earlier one runs (a slow early step cannot starve the issue-41 parts)
RESERVE = {"profile": 45, "e2e": 150}
#: the CUDA parts: not run without CUDA
CUDA_STEPS = ("cuda_tests", "bandwidth", "runner", "sparse", "sweep", "profile", "e2e")
#: the steps --skip may leave out (the measurements; the set-up they need always runs)
SKIPPABLE = ("flexgen", *CUDA_STEPS)


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


# -- the log ---------------------------------------------------------------------------------------

class Log:
    """Lines to stdout (short) and to the log file (everything, children's output too)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._f = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115 - closed in close()
        self.t0 = time.monotonic()

    def __call__(self, msg: str, *, echo: bool = True) -> None:
        line = f"[{time.monotonic() - self.t0:6.1f}s] {msg}"
        if echo:
            print(line, flush=True)
        if self._f is not None:
            self._f.write(line + "\n")
            self._f.flush()

    def raw(self, text: str) -> None:
        if self._f is not None:
            self._f.write(text if text.endswith("\n") else text + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


# -- running children --------------------------------------------------------------------------------

@dataclass
class Child:
    rc: int | None          # None: killed at its timeout
    out: str
    seconds: float


def run_child(argv: Sequence[str], *, timeout: float, env: dict[str, str] | None = None, cwd: str = ROOT,
              log: Log | None = None, what: str = "") -> Child:
    """Run ``argv`` in a process group of its own; on timeout SIGTERM the group, SIGKILL it 5 s later.

    Everything the child (and what it started in its group: daemons) printed goes to the log."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as out:
        proc = subprocess.Popen(list(argv), cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            rc = None
            _kill_group(proc)
        finally:
            if proc.poll() is None:
                _kill_group(proc)
        # a daemon the child left in its group (it did not stop it): end it too, by the group we made
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        out.seek(0)
        text = out.read()
    secs = time.monotonic() - t0
    if log is not None:
        log.raw(f"----- {what or argv[0]}: {' '.join(argv)}\n{text}----- rc={rc} in {secs:.1f}s")
    return Child(rc, text, secs)


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def tail(text: str, n: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


# -- probes that need nothing installed ------------------------------------------------------------------

def io_uring_syscall() -> dict[str, Any]:
    """Does this kernel give this process an io_uring? (``io_uring_setup(2)`` with 1 entry, then closed)."""
    out: dict[str, Any] = {"kernel": platform.release()}
    with contextlib.suppress(OSError), open("/proc/sys/kernel/io_uring_disabled") as f:
        out["io_uring_disabled_sysctl"] = int(f.read().strip())
    if platform.machine() != "x86_64":
        out.update(available=None, reason=f"probe written for x86_64, this is {platform.machine()}")
        return out
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)  # struct io_uring_params
    fd = libc.syscall(425, 1, params)  # __NR_io_uring_setup on x86_64
    if fd >= 0:
        os.close(fd)
        out.update(available=True, reason=None)
    else:
        e = ctypes.get_errno()
        out.update(available=False, errno=errno.errorcode.get(e, str(e)),
                   reason=f"io_uring_setup: {os.strerror(e)} ({errno.errorcode.get(e, e)})")
    return out


def supports_o_direct(d: str) -> bool:
    # bladed.io.file.supports_o_direct, which this script cannot import before it has built the extension
    path = os.path.join(d, ".odirect-probe")
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(path)
    return True


def first_line(argv: Sequence[str]) -> str | None:
    try:
        r = subprocess.run(list(argv), capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (r.stdout or r.stderr).strip()
    return text.splitlines()[0] if r.returncode == 0 and text else None


def nvidia_smi() -> dict[str, Any] | None:
    q = "name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current"
    line = first_line(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"])
    if line is None:
        return None
    keys = ("name", "driver", "memory", "pcie_gen", "pcie_width")
    out: dict[str, Any] = dict(zip(keys, [x.strip() for x in line.split(",")], strict=False))
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        banner = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
        m = re.search(r"CUDA Version:\s*([\d.]+)", banner)
        out["driver_cuda"] = m.group(1) if m else None
    return out


def nvcc_version() -> str | None:
    try:
        r = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"release ([\d.]+)", r.stdout)
    return m.group(1) if m else None


def python_include() -> str:
    return sysconfig.get_paths()["include"]


def cgroup_info() -> dict[str, Any]:
    out: dict[str, Any] = {"root": os.geteuid() == 0}
    try:
        with open("/proc/self/cgroup") as f:
            out["self"] = f.read().strip().splitlines()
    except OSError:
        out["self"] = None
    out["v2_controllers"] = None
    with contextlib.suppress(OSError), open("/sys/fs/cgroup/cgroup.controllers") as f:
        out["v2_controllers"] = f.read().split()
    return out


# -- the check ------------------------------------------------------------------------------------------

@dataclass
class E2EOptions:
    """The end-to-end plan on CUDA (``tools/gpu/gpu_check_steps.py``'s defaults: the issue's smallest)."""

    prompt_len: int = 512
    batch: int = 8
    limits: str = "0.333,0.667,1"
    reps: int = 2

    def args(self) -> list[str]:
        return ["--e2e-prompt-len", str(self.prompt_len), "--e2e-batch", str(self.batch), "--e2e-limits", self.limits,
                "--e2e-reps", str(self.reps)]


@dataclass
class Ctx:
    mode: str                        # "gpu" or "rehearse"
    out_dir: str
    work: str
    carry: str
    log: Log
    deadline: float
    env: dict[str, str] = field(default_factory=dict)
    skip: frozenset[str] = frozenset()  # --skip
    e2e: E2EOptions = field(default_factory=E2EOptions)
    no_flexgen: str | None = None    # why FlexGen cannot run here (None: it can)
    no_cgroups: str | None = None    # why no memory limit can be applied here
    #: where the steps make memory cgroups, with the entries there before they ran (cleaned at the end)
    cgroup_parents: dict[str, set[str]] = field(default_factory=dict)
    site: str | None = None          # the --target the carried wheels went to
    prefix: str | None = None        # where liburing was unpacked
    extension: str | None = None     # the built (or prebuilt) bladed._uring
    no_daemon: str | None = None     # why the daemon cannot run here (None: it can)
    cuda: bool | None = None
    torch: bool | None = None
    assume_no_io_uring: bool = False  # rehearse a kernel without io_uring (a gVisor sandbox)

    @property
    def rehearse(self) -> bool:
        return self.mode == "rehearse"

    @property
    def installs(self) -> str:
        """Where the wheels, liburing and the build go: for good on the GPU box (``var/gpu-check``, git-ignored:
        the extension installed into ``bladed/`` keeps finding liburing by its rpath), in the work directory in a
        rehearsal."""
        return self.work if self.rehearse else os.path.join(ROOT, "var", "gpu-check")

    def timeout(self, step: str) -> float:
        base = TIMEOUTS[step][1 if self.rehearse else 0]
        names = [n for n, _ in STEPS]
        later = names[names.index(step) + 1:] if step in names else []
        reserve = sum(RESERVE.get(n, 0) for n in later if n not in self.skip)
        return max(5.0, min(float(base), self.deadline - time.monotonic() - 10.0 - reserve))

    def child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        paths = [p for p in (self.site, ROOT, os.path.join(ROOT, "bench")) if p]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env["PYTHONUNBUFFERED"] = "1"
        env.pop("NOTIFY_SOCKET", None)
        env.pop("BLADED_SOCKET", None)
        if self.rehearse:
            env["CUDA_VISIBLE_DEVICES"] = ""  # a rehearsal runs on the CPU, on a GPU box too
        env.update(self.env)
        return env


Result = dict[str, Any]


def step_environment(ctx: Ctx) -> Result:
    env: Result = {
        "python": sys.version.split()[0], "python_executable": sys.executable,
        "python_include_has_Python_h": os.path.exists(os.path.join(python_include(), "Python.h")),
        "kernel": platform.release(), "kernel_version": platform.version(), "machine": platform.machine(),
        "cpus": os.cpu_count(), "io_uring": io_uring_syscall(), "gcc": first_line(["gcc", "--version"]),
        "nvidia_smi": nvidia_smi(), "nvcc": nvcc_version(), "cgroup": cgroup_info(), "dpkg": shutil.which("dpkg"),
        "work_dir": ctx.work, "work_dir_o_direct": supports_o_direct(ctx.work),
    }
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        env["mem_total_kib"] = int(f.readline().split()[1])
    probe = ("import json, sys\nout = {}\ntry:\n    import torch\nexcept Exception as e:\n"
             "    print(json.dumps({'torch': None, 'why': repr(e)})); sys.exit(0)\n"
             "out['torch'] = torch.__version__; out['torch_cuda'] = torch.version.cuda\n"
             "out['cuda_available'] = torch.cuda.is_available()\n"
             "if out['cuda_available']:\n    p = torch.cuda.get_device_properties(0)\n"
             "    out.update(gpu=p.name, capability=f'{p.major}.{p.minor}', gpu_memory=p.total_memory,\n"
             "               multiprocessors=p.multi_processor_count, cudnn=torch.backends.cudnn.version())\n"
             "try:\n    import transformers\n    out['transformers'] = transformers.__version__\n"
             "except Exception as e:\n    out['transformers'] = None\n"
             "print(json.dumps(out))\n")
    c = run_child([sys.executable, "-c", probe], timeout=ctx.timeout("environment"), env=ctx.child_env(),
                  log=ctx.log, what="environment: torch")
    torch_info: Result = {}
    if c.rc == 0:
        with contextlib.suppress(ValueError, IndexError):
            torch_info = json.loads(c.out.strip().splitlines()[-1])
    env.update(torch_info)
    ctx.torch = bool(torch_info.get("torch"))
    ctx.cuda = bool(torch_info.get("cuda_available"))
    env["gpu_name"] = (env.get("nvidia_smi") or {}).get("name") or torch_info.get("gpu")
    env["driver"] = (env.get("nvidia_smi") or {}).get("driver")
    return {"status": "passed", "data": env}


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
    lib_dir = _libdir(prefix)
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


def _libdir(prefix: str) -> str:
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
        lib = _libdir(prefix)
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


def _copy_with_wire(uring: str, dest_dir: str, name: str | None = None) -> str:
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
            _copy_with_wire(built, os.path.dirname(target), os.path.basename(target))
            data["installed_as"] = target
        else:
            data["installed_as"] = None
            data["note"] = (f"rehearsal: {', '.join(os.path.relpath(h, ROOT) for h in have)} exists and is left as "
                            "it is")
        ctx.extension = target if data["installed_as"] else built
    return {"status": status, "reason": reason, "data": data}


def _step_child(ctx: Ctx, step: str, extra: Sequence[str] = ()) -> Result:
    """Run ``tools/gpu/gpu_check_steps.py STEP`` and read the result it wrote."""
    res_path = os.path.join(ctx.work, f"step-{step}.json")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(res_path)
    argv = [sys.executable, os.path.join(HERE, "gpu_check_steps.py"), step, "--work", ctx.work, "--result",
            res_path, "--out", ctx.out_dir, "--carry", ctx.carry, "--installs", ctx.installs,
            *(["--rehearse"] if ctx.rehearse else []), *extra]
    for flag, why in (("--no-daemon", ctx.no_daemon), ("--no-flexgen", ctx.no_flexgen),
                      ("--no-cgroups", ctx.no_cgroups)):
        if why:
            argv += [flag, why]
    c = run_child(argv, timeout=ctx.timeout(step), env=ctx.child_env(), log=ctx.log, what=f"step {step}")
    if c.rc is None:
        return {"status": "timeout", "reason": f"killed after {ctx.timeout(step):.0f} s; last output:\n"
                                               f"{tail(c.out, 10)}"}
    try:
        with open(res_path) as f:
            res: Result = json.load(f)
    except (OSError, ValueError):
        return {"status": "failed", "reason": f"exit {c.rc}, no result; last output:\n{tail(c.out, 15)}"}
    if c.rc != 0 and res.get("status") == "passed":
        res.update(status="failed", reason=f"exit {c.rc}")
    return res


def step_uring(ctx: Ctx) -> Result:
    if ctx.extension is None:
        ctx.no_daemon = "bladed._uring did not build"
        return {"status": "not_run", "reason": "no extension (the build failed)"}
    res = _step_child(ctx, "uring", ["--extension", ctx.extension])
    if res.get("status") != "passed":
        ctx.no_daemon = f"bladed._uring does not load: {_short(str(res.get('reason')))}"
    elif not res.get("data", {}).get("io_uring"):
        ctx.no_daemon = f"no io_uring: {res['data'].get('reason')}"
    elif ctx.assume_no_io_uring:
        ctx.no_daemon = "no io_uring: assumed (--assume-no-io-uring)"
    return res


def step_daemon(ctx: Ctx) -> Result:
    return _step_child(ctx, "daemon")


def step_cuda_tests(ctx: Ctx) -> Result:
    """``pytest -m cuda tests/test_cuda.py`` (without the daemon's tests where there is no io_uring)."""
    junit = os.path.join(ctx.work, "junit-cuda.xml")
    argv = [sys.executable, "-m", "pytest", "-m", "cuda", "tests/test_cuda.py", "-p", "no:cacheprovider", "-q",
            "-rA", f"--junitxml={junit}"]
    if ctx.no_daemon:
        argv += ["-k", "not bladed"]
    c = run_child(argv, timeout=ctx.timeout("cuda_tests"), env=ctx.child_env(), log=ctx.log, what="cuda tests")
    tests = parse_junit(junit)
    data: Result = {"tests": tests, "counts": _counts(tests), "exit": c.rc,
                    "deselected": "the daemon's tests (-k 'not bladed'): " + ctx.no_daemon if ctx.no_daemon else None}
    if c.rc is None:
        return {"status": "timeout", "reason": f"pytest killed; last output:\n{tail(c.out, 10)}", "data": data}
    n = data["counts"]
    if not tests:
        return {"status": "failed", "reason": f"pytest exit {c.rc}, no test report: {tail(c.out, 10)}", "data": data}
    if not ctx.cuda:
        reasons = {t.get("message", "") for t in tests if t["outcome"] == "skipped"}
        ok = n["skipped"] == len(tests) and all("torch.cuda.is_available() is false" in r for r in reasons)
        return {"status": "not_run" if ok else "failed",
                "reason": f"no CUDA: all {len(tests)} cuda tests skipped" if ok else
                          f"without CUDA every cuda test must skip for that reason; got {n} {sorted(reasons)}",
                "data": data}
    failed = n["failed"] + n["error"] + n["skipped"]  # on CUDA nothing may skip
    return {"status": "passed" if c.rc == 0 and not failed else "failed",
            "reason": None if c.rc == 0 and not failed else f"{n}; {tail(c.out, 20)}", "data": data}


def parse_junit(path: str) -> list[Result]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return []
    out = []
    for tc in root.iter("testcase"):
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (el.get("message") or el.text or "")[:2000]
                break
        out.append({"name": tc.get("name"), "class": tc.get("classname"), "outcome": outcome,
                    "seconds": float(tc.get("time") or 0.0), **({"message": message} if message else {})})
    return out


def _counts(tests: list[Result]) -> dict[str, int]:
    keys = ("passed", "failed", "error", "skipped")
    return {k: sum(1 for t in tests if t["outcome"] == k) for k in keys}


def step_measure(name: str) -> Callable[[Ctx], Result]:
    def run(ctx: Ctx) -> Result:
        return _step_child(ctx, name)
    return run


#: how tools/gpu/gpu_check_steps.py is told where to make memory cgroups (its CGROUP_PARENT_ENV)
CGROUP_PARENT_ENV = "BLADED_GPU_CHECK_CGROUP_PARENT"
#: the prefixes of the memory cgroups the steps make (removed at the end if a killed step left one)
CGROUP_PREFIXES = ("bladed-e2e-", "bladed-gpu-check-")


def step_cgroups(ctx: Ctx) -> Result:
    """Where a KV owner's memory can be limited (``gpu_check_steps.py cgroups``); every later step is told."""
    res = _step_child(ctx, "cgroups")
    data = res.get("data") or {}
    if res.get("status") == "passed":
        with contextlib.suppress(OSError):
            ctx.cgroup_parents[data["parent"]] = set(os.listdir(data["parent"]))
        if not data.get("below_own"):
            ctx.env[CGROUP_PARENT_ENV] = data["parent"]
    elif res.get("status") != "not_run":     # not root: the harness runs without limits and says so
        ctx.no_cgroups = _short(str(res.get("reason")))
    return res


def step_flexgen(ctx: Ctx) -> Result:
    """FlexGen installed from the carry, its tokenizer, its import; a rehearsal runs it on the CPU."""
    if "flexgen" in ctx.skip:
        ctx.no_flexgen = "skipped (--skip flexgen)"
        return {"status": "not_run", "reason": ctx.no_flexgen}
    res = _step_child(ctx, "flexgen")
    if res.get("status") != "passed":
        ctx.no_flexgen = f"the flexgen step did not pass: {_short(str(res.get('reason')))}"
    return res


def step_e2e(ctx: Ctx) -> Result:
    """The end-to-end benchmark and FlexGen, inside what the budget leaves (the child stops itself before it)."""
    budget = ctx.timeout("e2e")
    return _step_child(ctx, "e2e", ["--budget-s", f"{budget:.0f}", *ctx.e2e.args()])


def cleanup_cgroups(parents: dict[str, set[str]], log: Log) -> None:
    """On the GPU box, remove what a killed step left of its memory cgroups (their processes killed through the
    cgroup, then the directory): the ones of the steps' prefixes made since ``parents`` was noted. Never in a
    rehearsal, where another benchmark may have cgroups of the same prefixes below the same parent."""
    for parent, before in parents.items():
        for d in sorted(glob.glob(os.path.join(parent, "*"))):
            name = os.path.basename(d)
            if name in before or not name.startswith(CGROUP_PREFIXES) or not os.path.isdir(d):
                continue
            with contextlib.suppress(OSError), open(os.path.join(d, "cgroup.kill"), "w") as f:
                f.write("1")                    # v2 (5.14+): every process in it
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    os.rmdir(d)
                    log(f"cgroups: removed {d}, left by a step")
                    break
                except OSError:
                    time.sleep(0.2)


STEPS: tuple[tuple[str, Callable[[Ctx], Result]], ...] = (
    ("environment", step_environment), ("install", step_install), ("liburing", step_liburing),
    ("build", step_build), ("uring", step_uring), ("daemon", step_daemon), ("cgroups", step_cgroups),
    ("flexgen", step_flexgen), ("cuda_tests", step_cuda_tests), ("bandwidth", step_measure("bandwidth")),
    ("runner", step_measure("runner")), ("sparse", step_measure("sparse")), ("sweep", step_measure("sweep")),
    ("profile", step_measure("profile")),
    ("e2e", step_e2e),
)


def check(mode: str, out_dir: str, carry: str, budget_s: float, keep: bool, no_io_uring: bool = False,
          skip: Sequence[str] = (), e2e: E2EOptions | None = None) -> int:
    os.makedirs(out_dir, exist_ok=True)
    log = Log(os.path.join(out_dir, LOG_NAME))
    started = time.monotonic()
    work = _work_dir(mode)
    ctx = Ctx(mode=mode, out_dir=out_dir, work=work, carry=carry, log=log, deadline=started + budget_s,
              assume_no_io_uring=no_io_uring, skip=frozenset(skip), e2e=e2e or E2EOptions())
    doc: Result = {"schema": SCHEMA, "mode": mode, "started": now(), "root": ROOT, "carry": carry,
                   "budget_s": budget_s, "skip": sorted(ctx.skip), "e2e_plan": asdict(ctx.e2e),
                   "steps": {}}
    log(f"gpu_check {mode}: work {work}, carry {carry}, out {out_dir}, budget {budget_s:.0f} s"
        + (f", skipping {','.join(sorted(ctx.skip))}" if ctx.skip else ""))
    try:
        for name, fn in STEPS:
            t0 = time.monotonic()
            if time.monotonic() > ctx.deadline - 15:
                res: Result = {"status": "not_run", "reason": "the overall budget (--budget-s) ran out"}
            elif name in ctx.skip and name != "flexgen":
                res = {"status": "not_run", "reason": f"skipped (--skip {name})"}
            elif name in CUDA_STEPS and ctx.torch is False:
                res = {"status": "not_run", "reason": "no torch in this Python"}
            else:
                try:
                    res = fn(ctx)
                except Exception as e:  # a bug here must not lose the other steps
                    res = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
            res.setdefault("reason", None)
            res["seconds"] = round(time.monotonic() - t0, 1)
            res["cuda_part"] = name in CUDA_STEPS
            doc["steps"][name] = res
            log(f"{name}: {res['status']} ({res['seconds']} s)" + (f": {_short(res['reason'])}"
                                                                    if res["reason"] else ""))
            if res["status"] in ("failed", "timeout") and res.get("reason"):
                log.raw(f"{name} reason:\n{res['reason']}")
            _save(doc, out_dir)
    finally:
        if not ctx.rehearse:
            cleanup_cgroups(ctx.cgroup_parents, log)
        doc["environment"] = doc["steps"].get("environment", {}).get("data", {})
        doc["figures"] = figures(doc)
        doc["wall_s"] = round(time.monotonic() - started, 1)
        doc["ok"] = verdict(doc)
        doc["finished"] = now()
        _save(doc, out_dir)
        for line in summary_lines(doc):
            log(line)
        junit = os.path.join(work, "junit-cuda.xml")
        if os.path.exists(junit):
            shutil.copy2(junit, os.path.join(out_dir, "junit-cuda.xml"))
        log.close()
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if doc["ok"] else 1


def _short(reason: str) -> str:
    lines = reason.strip().splitlines()
    return lines[0][:300] + (" ..." if len(lines) > 1 or len(lines[0]) > 300 else "")


def _work_dir(mode: str) -> str:
    """A short directory (socket paths are limited to 107 bytes) on a filesystem with O_DIRECT (the file store)."""
    for base in ("/tmp", "/var/tmp", os.path.join(ROOT, "var")):
        with contextlib.suppress(OSError):
            os.makedirs(base, exist_ok=True)
            d = tempfile.mkdtemp(prefix="gc-", dir=base)
            if supports_o_direct(d) and len(d) < 60:
                os.chmod(d, 0o755)
                return d
            shutil.rmtree(d, ignore_errors=True)
    d = tempfile.mkdtemp(prefix="gc-", dir="/tmp")
    os.chmod(d, 0o755)
    return d


def _save(doc: Result, out_dir: str) -> None:
    path = os.path.join(out_dir, JSON_NAME)
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def figures(doc: Result) -> Result:
    """The headline numbers, pulled out of the steps' data (None where a step did not produce them)."""
    st = doc["steps"]
    bw = (st.get("bandwidth") or {}).get("data") or {}
    rn = (st.get("runner") or {}).get("data") or {}
    sw = (st.get("sweep") or {}).get("data") or {}
    env = (st.get("environment") or {}).get("data") or {}
    pr = (st.get("profile") or {}).get("data") or {}
    e2e = (st.get("e2e") or {}).get("data") or {}
    fg = (st.get("flexgen") or {}).get("data") or {}
    return {
        "gpu": env.get("gpu_name"), "driver": env.get("driver"), "cuda": env.get("torch_cuda"),
        "driver_cuda": (env.get("nvidia_smi") or {}).get("driver_cuda"), "nvcc": env.get("nvcc"),
        "torch": env.get("torch"), "transformers": env.get("transformers"), "kernel": env.get("kernel"),
        "io_uring": (env.get("io_uring") or {}).get("available"),
        "staging_bandwidth": bw.get("summary"), "runner_tokens_per_s": rn.get("summary"),
        "sparse_reads": ((st.get("sparse") or {}).get("data") or {}).get("summary"),
        "kv_sweep_point": sw.get("summary"),
        "cgroup_parent": ((st.get("cgroups") or {}).get("data") or {}).get("parent"),
        "flexgen": {"wheels": fg.get("wheels"), "tokenizer": (fg.get("tokenizer") or {}).get("class"),
                    "patches": sorted(fg.get("patches") or {})} if fg else None,
        "runner_profile": pr.get("summary"),
        "e2e": e2e_figures(e2e) if e2e else None,
    }


def e2e_figures(e2e: Result) -> Result:
    """The e2e step's headline: decode tokens/s per limit and side (medians), FlexGen's, and the issue's ratios."""
    out: Result = {"kv_bytes": e2e.get("kv_bytes"), "budget": e2e.get("budget"), "by_fraction": {}}
    fg = (e2e.get("flexgen") or {}).get("by_fraction") or {}
    for row in (e2e.get("summary") or {}).get("by_limit", []):
        cell: Result = {side: (v.get("decode_tok_s") or {}).get("median") for side, v in row["sides"].items()}
        f = fg.get(f"{row['fraction']:g}") or {}
        cell["flexgen"] = (f.get("decode_tok_s") or {}).get("median")
        for key, m in (("dualblade/mmap decode time", (row["ratios"].get("dualblade/mmap") or {}).get("decode_time")),
                       ("dualblade/flexgen decode time", f.get("dualblade/flexgen_decode_time")),
                       ("dualblade/flexgen ttft", f.get("dualblade/flexgen_ttft_time"))):
            cell[key] = (m or {}).get("median")
        out["by_fraction"][f"{row['fraction']:g}"] = cell
    return out


def verdict(doc: Result) -> bool:
    """Every step passed or was skipped (``--skip``); in a rehearsal the CUDA parts may be ``not_run`` for want of
    CUDA (or torch)."""
    for name, res in doc["steps"].items():
        status = res.get("status")
        reason = str(res.get("reason", ""))
        if status == "passed" or (status == "not_run" and reason.startswith("skipped (--skip")):
            continue
        if status == "not_run" and doc["mode"] == "rehearse" and (
                (name in CUDA_STEPS and reason.startswith(("no CUDA", "no torch")))
                or (name == "cgroups" and reason.startswith("not root"))):
            continue
        return False
    return len(doc["steps"]) == len(STEPS)


def summary_lines(doc: Result) -> Iterator[str]:
    f = doc["figures"]
    yield (f"summary: {doc['mode']} ok={doc['ok']} in {doc['wall_s']} s; gpu {f['gpu']}, driver {f['driver']}, "
           f"CUDA {f['cuda']}, torch {f['torch']}, transformers {f['transformers']}, kernel {f['kernel']}, "
           f"io_uring {f['io_uring']}")
    for name, res in doc["steps"].items():
        yield f"  {name:12s} {res['status']:8s} {res.get('seconds', 0):6.1f} s" + (
            f"  {_short(res['reason'])}" if res.get("reason") else "")
    for key in ("staging_bandwidth", "runner_tokens_per_s", "sparse_reads", "kv_sweep_point", "runner_profile", "e2e"):
        if f.get(key):
            yield f"  {key}: {json.dumps(f[key], default=str)}"


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
        dest = _copy_with_wire(built, os.path.join(carry, "prebuilt"))
        log(f"prebuilt {os.path.basename(built)} carried ({os.path.getsize(dest)} bytes; rpath "
            f"{_libdir(prefix)} is not on the box: it finds the unpacked liburing through LD_LIBRARY_PATH)")
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
        r = subprocess.run([py312, os.path.abspath(__file__), "--rehearse", "--out", out, "--carry", carry,
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


# -- main --------------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prepare", action="store_true", help="fill the carry folder (needs PyPI and Debian's archive)")
    g.add_argument("--rehearse", action="store_true", help="the GPU box's steps on this machine, CUDA parts not run")
    p.add_argument("--out", default=None,
                   help="where gpu-check.json and gpu-check.log go (default: $OUT, else ./gpu-check)")
    p.add_argument("--carry", default=CARRY, help="the carry folder (default: .gpu-carry in the checkout)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="overall time budget in seconds (default: 420 on the GPU box, 240 in a rehearsal)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--assume-no-io-uring", action="store_true",
                   help="behave as on a kernel without io_uring (the daemon's parts not run): rehearses a sandbox")
    p.add_argument("--no-simulate", action="store_true",
                   help="--prepare: do not simulate the box with a local Python 3.12")
    p.add_argument("--skip", type=_skip_list, default=[], metavar="STEP,...",
                   help=f"leave these measurements out (reported not_run, 'skipped'): {', '.join(SKIPPABLE)}; e.g. "
                        "cuda_tests,bandwidth,runner,sweep gives the end-to-end benchmark their ~80 s")
    e = E2EOptions()
    p.add_argument("--e2e-prompt-len", type=int, default=e.prompt_len, metavar="N",
                   help=f"the end-to-end benchmark's prompt on CUDA, 512..2048 (default: {e.prompt_len})")
    p.add_argument("--e2e-batch", type=int, default=e.batch, metavar="N",
                   help=f"its batch, at least 8 (default: {e.batch})")
    p.add_argument("--e2e-limits", default=e.limits, metavar="F,...",
                   help=f"its limits as fractions of the KV set, ascending (default: {e.limits})")
    p.add_argument("--e2e-reps", type=int, default=e.reps, metavar="N", help=f"its repetitions (default: {e.reps})")
    a = p.parse_args(argv)
    carry = os.path.abspath(a.carry)
    if a.prepare:
        return prepare(carry, simulate=not a.no_simulate)
    opts = E2EOptions(a.e2e_prompt_len, a.e2e_batch, a.e2e_limits, a.e2e_reps)
    problem = e2e_problem(opts)
    if problem:
        p.error(problem)
    mode = "rehearse" if a.rehearse else "gpu"
    out = os.path.abspath(a.out or os.environ.get("OUT") or "gpu-check")
    budget = a.budget_s if a.budget_s is not None else (600.0 if a.rehearse else 420.0)
    return check(mode, out, carry, budget, a.keep, a.assume_no_io_uring, a.skip, opts)


def _skip_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in SKIPPABLE]
    if bad:
        raise argparse.ArgumentTypeError(f"cannot skip {', '.join(bad)}; the steps --skip takes: "
                                         f"{', '.join(SKIPPABLE)}")
    return names


def e2e_problem(o: E2EOptions) -> str | None:
    """What is wrong with the end-to-end plan (issue 41's bounds), in one line with the fix; None if nothing."""
    try:
        fracs = [float(x) for x in o.limits.split(",") if x.strip()]
    except ValueError:
        return f"--e2e-limits {o.limits!r}: not a comma-separated list of numbers; e.g. 0.333,0.667,1"
    if len(fracs) < 1 or any(f <= 0 for f in fracs) or fracs != sorted(fracs):
        return f"--e2e-limits {o.limits}: give positive fractions of the KV set in ascending order, e.g. 0.333,0.667,1"
    if not 512 <= o.prompt_len <= 2048:
        return f"--e2e-prompt-len {o.prompt_len}: the issue's prompts are 512..2048 tokens; give one in that range"
    if o.batch < 8:
        return f"--e2e-batch {o.batch}: the issue's batch is at least 8; give --e2e-batch 8 or more"
    if o.reps < 1:
        return f"--e2e-reps {o.reps}: give at least 1 repetition"
    return None


if __name__ == "__main__":
    sys.exit(main())
