"""One run of the GPU check (``tools/gpu/gpu_check.py``): what every step is handed.

:class:`Ctx` (the run's mode, budget and paths, and what the earlier steps found), the end-to-end plan
(:class:`E2EOptions`, checked by :func:`e2e_problem`), the steps' time limits, the log (:class:`Log`), and
:func:`run_child`: a child process in a process group of its own, killed with whatever it started at its
timeout.

Standard library only: the check runs before anything is installed.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))  # tools/gpu
ROOT = os.path.dirname(os.path.dirname(HERE))

Result = dict[str, Any]

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


def short(reason: str) -> str:
    lines = reason.strip().splitlines()
    return lines[0][:300] + (" ..." if len(lines) > 1 or len(lines[0]) > 300 else "")


# -- the run's context ------------------------------------------------------------------------------

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


@dataclass
class Ctx:
    mode: str                        # "gpu" or "rehearse"
    out_dir: str
    work: str
    carry: str
    log: Log
    deadline: float
    #: the run's steps in order (``gpu_check.STEPS``' names): what is kept for the later ones (RESERVE)
    steps: tuple[str, ...] = ()
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
        later = self.steps[self.steps.index(step) + 1:] if step in self.steps else ()
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
