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

The check's files, beside this one in ``tools/gpu/``: ``gpu_run.py`` (what every step is handed: the
run's context, its log, child processes with timeouts), ``gpu_probe.py`` (the ``environment`` step),
``gpu_install.py`` (the ``install``, ``liburing`` and ``build`` steps), ``gpu_check_steps.py`` (the steps that
run bladed, each in a child process), ``gpu_cuda.py``, ``gpu_flexgen.py`` and ``gpu_profile.py`` (what those
steps use), ``gpu_report.py`` (``gpu-check.json``, the figures, the verdict) and ``gpu_carry.py``
(``--prepare``, and the box simulated).

This file and the ones it imports use the standard library only: the check runs before anything is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict

from gpu_carry import CARRY, prepare
from gpu_install import step_build, step_install, step_liburing
from gpu_probe import step_environment, supports_o_direct
from gpu_report import LOG_NAME, SCHEMA, counts, figures, parse_junit, save, summary_lines, verdict
from gpu_run import (
    CUDA_STEPS,
    HERE,
    ROOT,
    SKIPPABLE,
    Ctx,
    E2EOptions,
    Log,
    Result,
    e2e_problem,
    now,
    run_child,
    short,
    tail,
)

# -- the steps that run in gpu_check_steps.py --------------------------------------------------------------

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
        ctx.no_daemon = f"bladed._uring does not load: {short(str(res.get('reason')))}"
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
    data: Result = {"tests": tests, "counts": counts(tests), "exit": c.rc,
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
        ctx.no_cgroups = short(str(res.get("reason")))
    return res


def step_flexgen(ctx: Ctx) -> Result:
    """FlexGen installed from the carry, its tokenizer, its import; a rehearsal runs it on the CPU."""
    if "flexgen" in ctx.skip:
        ctx.no_flexgen = "skipped (--skip flexgen)"
        return {"status": "not_run", "reason": ctx.no_flexgen}
    res = _step_child(ctx, "flexgen")
    if res.get("status") != "passed":
        ctx.no_flexgen = f"the flexgen step did not pass: {short(str(res.get('reason')))}"
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


# -- the check ------------------------------------------------------------------------------------------

def check(mode: str, out_dir: str, carry: str, budget_s: float, keep: bool, no_io_uring: bool = False,
          skip: Sequence[str] = (), e2e: E2EOptions | None = None) -> int:
    os.makedirs(out_dir, exist_ok=True)
    log = Log(os.path.join(out_dir, LOG_NAME))
    started = time.monotonic()
    work = _work_dir(mode)
    ctx = Ctx(mode=mode, out_dir=out_dir, work=work, carry=carry, log=log, deadline=started + budget_s,
              assume_no_io_uring=no_io_uring, skip=frozenset(skip), e2e=e2e or E2EOptions(),
              steps=tuple(n for n, _ in STEPS))
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
            log(f"{name}: {res['status']} ({res['seconds']} s)" + (f": {short(res['reason'])}"
                                                                    if res["reason"] else ""))
            if res["status"] in ("failed", "timeout") and res.get("reason"):
                log.raw(f"{name} reason:\n{res['reason']}")
            save(doc, out_dir)
    finally:
        if not ctx.rehearse:
            cleanup_cgroups(ctx.cgroup_parents, log)
        doc["environment"] = doc["steps"].get("environment", {}).get("data", {})
        doc["figures"] = figures(doc)
        doc["wall_s"] = round(time.monotonic() - started, 1)
        doc["ok"] = verdict(doc, [n for n, _ in STEPS])
        doc["finished"] = now()
        save(doc, out_dir)
        for line in summary_lines(doc):
            log(line)
        junit = os.path.join(work, "junit-cuda.xml")
        if os.path.exists(junit):
            shutil.copy2(junit, os.path.join(out_dir, "junit-cuda.xml"))
        log.close()
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if doc["ok"] else 1


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


if __name__ == "__main__":
    sys.exit(main())
