"""What the GPU check learns of the machine before anything is installed (its ``environment`` step).

io_uring (the syscall itself), O_DIRECT on the work directory, the GPU (``nvidia-smi``, ``nvcc``), Python's
headers, cgroups, and what torch sees, asked in a child. Standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from typing import Any

from gpu_run import Ctx, Result, run_child


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
