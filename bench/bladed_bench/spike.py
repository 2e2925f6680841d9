"""A neighbour's memory spike beside bladed's KV in memory: who survives (issue 46, docs/reliability.md, "Memory
spikes").

One memory cgroup ``P`` with a hard limit (a container, a systemd slice) holds the daemon and a *neighbour*: in
``sibling`` placement each is in a child cgroup of its own below ``P`` (the limit binds on the parent, as a
Kubernetes pod's or a slice's does); in ``own`` placement both are in ``P`` itself.  For each case:

1. a fresh daemon (its embedded defaults, a file store, and the backing asked for) starts in its cgroup;
2. a Dual-Blade session writes ``kv_bytes`` of KV, every KPU stamped so a read proves its bytes;
3. the neighbour (a process of its own) allocates ``neighbour_bytes`` at ``rate`` bytes/s, touching every page,
   and holds them for ``hold_s``;
4. the session reads every KPU back and checks every word;
5. the record: did the neighbour live (its exit status, the cgroup's OOM-kill count), was every KPU exact, what
   bladed demoted (KPUs, bytes) and how fast it reacted (its own ``memory_watch`` figures), the budget's terms.

The KV's owner (this harness, the inference process's stand-in) is outside ``P``: its staging is not the
neighbour's competition.  Needs root (cgroups).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime as dt
import json
import mmap
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from bladed.residency.cgroups import locate_memory_cgroup
from bladed.residency.geometry import Geometry, tensor_id
from bladed.spawn import cgroup_launcher
from bladed_bench import trials
from bladed_bench.cgroup import read_file, write_file
from bladed_bench.environment import git_info, machine_info
from bladed_bench.repo import REPO, repo_env
from bladed_bench.workload import BenchDaemon

MiB = 1 << 20
PLACEMENTS = ("sibling", "own")
BACKINGS = ("memory", "disk")


@dataclass(frozen=True)
class SpikeSpec:
    """One table of cases; the defaults are issue 46's."""

    limit_bytes: int = 1 << 30
    #: the session's KV: 24 layers x K/V of 1632 tokens x 8 KiB rows = 612 MiB
    layers: int = 24
    batch: int = 4
    kv_heads: int = 8
    head_dim: int = 128
    max_tokens: int = 1632
    neighbour_bytes: int = 360 * MiB
    rates: tuple[int, ...] = (50 * MiB, 400 * MiB, 4000 * MiB)
    placements: tuple[str, ...] = PLACEMENTS
    backings: tuple[str, ...] = BACKINGS
    hold_s: float = 3.0
    repeat: int = 1
    #: the idle-wear run's idle time (0: none)
    idle_s: float = 0.0
    #: extra daemon configuration, per section (e.g. {"budget": {"headroom": 0.05}})
    daemon: dict[str, dict[str, Any]] = field(default_factory=dict)

    def geometry(self) -> Geometry:
        return Geometry(layers=self.layers, batch=self.batch, kv_heads=self.kv_heads, head_dim=self.head_dim,
                        dtype_bytes=2, max_tokens=self.max_tokens)


# -- cgroups ------------------------------------------------------------------------------------------------------

class Tree:
    """A limited cgroup below ours and, for ``sibling``, two children in it; removed on exit."""

    def __init__(self, limit: int, placement: str) -> None:
        info = locate_memory_cgroup()
        if info.version == "none":
            raise RuntimeError("this host has no memory cgroup controller")
        self.version = info.version
        self.base = info.path
        self.parent = os.path.join(info.path, f"bladed-spike-{uuid.uuid4().hex[:8]}")
        self.dirs = [self.parent]
        self._mkdir(self.parent)
        limit_name = "memory.limit_in_bytes" if self.version == "v1" else "memory.max"
        write_file(os.path.join(self.parent, limit_name), str(limit))
        if placement == "sibling":
            self.daemon_dir = os.path.join(self.parent, "daemon")
            self.neighbour_dir = os.path.join(self.parent, "neighbour")
            for d in (self.daemon_dir, self.neighbour_dir):
                self._mkdir(d)
                self.dirs.append(d)
        else:
            self.daemon_dir = self.neighbour_dir = self.parent

    def _mkdir(self, path: str) -> None:
        if self.version == "v2":
            with contextlib.suppress(OSError):
                write_file(os.path.join(os.path.dirname(path), "cgroup.subtree_control"), "+memory")
        os.mkdir(path)

    def oom_kills(self) -> int:
        """OOM kills in the tree (v1 counts a kill in the victim's own cgroup only, v2 up the hierarchy)."""
        name, dirs = ("memory.oom_control", self.dirs) if self.version == "v1" else ("memory.events", [self.parent])
        n = 0
        for d in dirs:
            for line in read_file(os.path.join(d, name)).splitlines():
                k, _, v = line.partition(" ")
                if k == "oom_kill":
                    n += int(v)
        return n

    def usage(self, path: str | None = None) -> int:
        name = "memory.usage_in_bytes" if self.version == "v1" else "memory.current"
        return int(read_file(os.path.join(path or self.parent, name)))

    def peak(self) -> int | None:
        name = "memory.max_usage_in_bytes" if self.version == "v1" else "memory.peak"
        with contextlib.suppress(OSError, ValueError):
            return int(read_file(os.path.join(self.parent, name)))
        return None

    def remove(self) -> None:
        for d in reversed(self.dirs):
            if not os.path.isdir(d):
                continue
            for pid in read_file(os.path.join(d, "cgroup.procs")).split():
                with contextlib.suppress(OSError):
                    write_file(os.path.join(self.base, "cgroup.procs"), pid)
            deadline = time.monotonic() + 30
            while os.path.isdir(d):
                try:
                    os.rmdir(d)
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)       # an exiting task is still listed: the kernel finishes on its own


# -- the neighbour -------------------------------------------------------------------------------------------------

def neighbour_main(nbytes: int, rate: float, step: int) -> int:
    """The neighbour process: on ``go`` allocate ``nbytes`` at ``rate`` bytes/s in ``step``s, touching every page;
    print ``held SECONDS``; exit on ``exit`` (or EOF)."""
    libc = ctypes.CDLL(None)
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 0
    t0 = time.perf_counter()
    done = 0
    while done < nbytes:
        n = min(step, nbytes - done)
        libc.memset(ctypes.c_void_p(addr + done), 1, ctypes.c_size_t(n))
        done += n
        ahead = t0 + done / rate - time.perf_counter()
        if ahead > 0:
            time.sleep(ahead)     # pacing the allocation, not synchronising with anyone
    print(f"held {time.perf_counter() - t0:.4f}", flush=True)
    sys.stdin.readline()
    return 0


class Neighbour:
    """The neighbour process, started in its cgroup."""

    def __init__(self, cgroup_dir: str, nbytes: int, rate: float) -> None:
        step = max(256 << 10, min(8 * MiB, int(rate / 200)))        # ~200 steps a second at most
        argv = [sys.executable, "-m", "bladed_bench.spike", "neighbour", str(nbytes), str(rate), str(step)]
        self.proc = subprocess.Popen(cgroup_launcher(cgroup_dir)(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=repo_env(), cwd=REPO)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"the neighbour did not start: {line!r}")

    def run(self, timeout_s: float) -> float | None:
        """Allocate; the seconds it took, or None if it died first."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.started = time.time()
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline().strip() if ready else ""
        return float(line.split()[1]) if line.startswith("held ") else None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int | None:
        """Tell it to exit; its exit status (-9: killed, by the OOM killer here)."""
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.write("exit\n")
            self.proc.stdin.close()
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


# -- the KV --------------------------------------------------------------------------------------------------------

def stamp(geometry: Geometry, tid: int) -> np.ndarray:
    """The words KPU ``tid`` holds: a different 32-bit value at every position of every KPU."""
    n = geometry.kpu_bytes // 4
    idx = np.arange(n, dtype=np.uint32)
    return idx * np.uint32(2654435761) + np.uint32((tid * 40503 + 12345) & 0xFFFFFFFF)


def write_kv(sess: Any, geometry: Geometry) -> None:
    for layer in range(geometry.layers):
        for ch, kind in enumerate("kv"):
            tid = tensor_id(layer, kind)
            slot = np.frombuffer(sess.slot(ch), dtype=np.uint32, count=geometry.kpu_bytes // 4)
            slot[:] = stamp(geometry, tid)
            sess.submit(ch, [sess.range("write", layer, kind)])


def check_kv(sess: Any, geometry: Geometry) -> dict[str, Any]:
    """Read every KPU back: how many are exact, and the path each was served from."""
    exact = 0
    paths: dict[str, int] = {}
    for layer in range(geometry.layers):
        for ch, kind in enumerate("kv"):
            tid = tensor_id(layer, kind)
            (r,) = sess.submit(ch, [sess.range("read", layer, kind)])
            paths[r.path] = paths.get(r.path, 0) + 1
            slot = np.frombuffer(sess.slot(ch), dtype=np.uint32, count=geometry.kpu_bytes // 4)
            exact += bool(np.array_equal(slot, stamp(geometry, tid)))
    return {"kpus": 2 * geometry.layers, "exact": exact, "paths": paths}


def wait_no_pending(client: Any, timeout_s: float = 120.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if all(r.get("pending_demotions", 0) == 0 for r in client.sessions()):
            return True
        time.sleep(0.05)      # the demotion worker has no event a client can wait on
    return False


# -- one case ------------------------------------------------------------------------------------------------------

def run_case(spec: SpikeSpec, placement: str, rate: int, backing: str, workdir: str,
             say: Callable[[str], None]) -> dict[str, Any]:
    from bladed.client import Client

    g = spec.geometry()
    kv = 2 * g.layers * g.kpu_bytes
    rec: dict[str, Any] = {"placement": placement, "rate_bytes_per_s": rate, "backing": backing,
                           "limit_bytes": spec.limit_bytes, "kv_bytes": kv, "neighbour_bytes": spec.neighbour_bytes}
    state = os.path.join(workdir, f"{placement}-{rate // MiB}-{backing}")
    shutil.rmtree(state, ignore_errors=True)
    tree = Tree(spec.limit_bytes, placement)
    daemon: BenchDaemon | None = None
    neighbour: Neighbour | None = None
    try:
        extra: dict[str, dict[str, Any]] = {"budget": {"interval_s": 5.0}, "pagecache": {"backing": backing},
                                            "log": {"level": "info"}}
        for section, keys in spec.daemon.items():
            extra.setdefault(section, {}).update(keys)
        daemon = BenchDaemon(state, kv + 128 * MiB, cgroup_launcher(tree.daemon_dir), extra)
        with Client(daemon.socket_path, timeout=600.0, name="bladed-bench-spike") as c:
            sess = c.open_session(g.to_dict(), mode="dualblade", channels=2)
            rec["planned_pagecache_kpus"] = sum(1 for k in sess.plan["kpus"] if k["path"] == "pagecache")
            write_kv(sess, g)
            wait_no_pending(c)
            before = c.stats()["replan"]
            rec["budget_before"] = c.budget()["sample"]
            rec["usage_before_bytes"] = tree.usage()
            neighbour = Neighbour(tree.neighbour_dir, spec.neighbour_bytes, rate)
            took = neighbour.run(timeout_s=60 + spec.neighbour_bytes / rate)
            rec["neighbour_alloc_s"] = took
            if took is not None:
                # held: does it stay alive while bladed finishes what the spike started?
                deadline = time.monotonic() + spec.hold_s
                while neighbour.alive() and time.monotonic() < deadline:
                    time.sleep(0.05)
            rec["settled"] = wait_no_pending(c)
            # a neighbour that never said "held" died growing (its exit may still be under way)
            rec["neighbour_alive"] = took is not None and neighbour.alive()
            rec["neighbour_rate_bytes_per_s"] = spec.neighbour_bytes / took if took else None
            rec["kv"] = check_kv(sess, g)
            after = c.stats()
            rep = after["replan"]
            rec["demoted_kpus"] = rep["demoted_kpus"] - before["demoted_kpus"]
            rec["demoted_bytes"] = rep["demoted_bytes"] - before["demoted_bytes"]
            rec["demotions_failed"] = rep["demotions_failed"] - before["demotions_failed"]
            rec["replan"] = rep
            rec["demotion_rate_bytes_per_s"] = (rec["demoted_bytes"] / rep["demoted_seconds"]
                                                if rep.get("demoted_seconds") else None)
            rec["budget_after"] = c.budget()["sample"]
            sess.close()
        rec["neighbour_exit"] = neighbour.stop()
        rec["oom_kills"] = tree.oom_kills()
        rec["peak_bytes"] = tree.peak()
        rec["daemon_log_tail"] = daemon.log_tail(40)
        daemon.stop()
        daemon = None
    finally:
        if neighbour is not None and neighbour.alive():
            neighbour.stop()
        if daemon is not None:
            rec["daemon_log_tail"] = daemon.log_tail(40)
            daemon.stop()
        tree.remove()
        shutil.rmtree(state, ignore_errors=True)
    rec["ok"] = bool(rec.get("neighbour_alive")) and rec.get("oom_kills") == 0 and \
        rec["kv"]["exact"] == rec["kv"]["kpus"]
    say(f"{placement:7s} {rate // MiB:5d} MiB/s {backing:6s}: neighbour "
        f"{'alive' if rec.get('neighbour_alive') else 'KILLED'}, oom_kills {rec.get('oom_kills')}, "
        f"KV exact {rec['kv']['exact']}/{rec['kv']['kpus']}, demoted {rec.get('demoted_kpus')} KPUs "
        f"({(rec.get('demoted_bytes') or 0) / MiB:.0f} MiB)")
    return rec


def run_spike(spec: SpikeSpec, out_path: str | None, workdir: str = "/var/tmp/bladed-spike",
              say: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    os.makedirs(workdir, exist_ok=True)
    doc: dict[str, Any] = {"study": "spike", "spec": asdict(spec), "argv": sys.argv,
                           "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                           "machine": machine_info(), "git": git_info(REPO, ["bladed"]), "cases": []}
    for rep in range(spec.repeat):
        for placement in spec.placements:
            for rate in spec.rates:
                for backing in spec.backings:
                    doc["cases"].append(run_case(spec, placement, rate, backing, workdir, say) | {"rep": rep})
                    if out_path:
                        trials.write_json(out_path, doc)
    if spec.idle_s:
        doc["idle"] = run_idle(spec.backings, spec.idle_s, workdir, say)
    doc["finished"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    if out_path:
        trials.write_json(out_path, doc)
    return doc


def run_idle(backings: tuple[str, ...], idle_s: float, workdir: str, say: Callable[[str], None],
             kv_layers: int = 16) -> list[dict[str, Any]]:
    """Idle wear: a 512 MiB Dual-Blade session that fits, written once, then idle ``idle_s`` with no neighbour
    (past the kernel's 30 s writeback of dirty pages): the bytes its device wrote from the session's open to the
    end of the idle time (the kernel's own writeback, no sync) per byte of KV. Each backing on an ext4 loop
    device of its own, the store file on it too."""
    from bladed.client import Client
    from bladed_bench.wear import loop_filesystem

    g = Geometry(layers=kv_layers, batch=4, kv_heads=8, head_dim=128, dtype_bytes=2, max_tokens=2048)
    kv = 2 * g.layers * g.kpu_bytes
    out = []
    for backing in backings:
        side = os.path.join(workdir, f"idle-{backing}")
        shutil.rmtree(side, ignore_errors=True)
        os.makedirs(side)
        with loop_filesystem(side, 2 * kv + 512 * MiB) as (mnt, device):
            daemon = BenchDaemon(os.path.join(mnt, "state"), kv + 128 * MiB, None,
                                 {"budget": {"interval_s": 5.0}, "pagecache": {"backing": backing}})
            try:
                os.sync()                       # the store file and the daemon's start-up, on disk
                before = device.written_bytes()
                with Client(daemon.socket_path, timeout=600.0, name="bladed-bench-idle") as c:
                    sess = c.open_session(g.to_dict(), mode="dualblade", channels=2)
                    paths = {k["path"] for k in sess.plan["kpus"]}
                    write_kv(sess, g)
                    time.sleep(idle_s)          # the idle time is the measurement, not a synchronisation
                    written = device.written_bytes() - before
                    exact = check_kv(sess, g)
                    replan = c.stats()["replan"]
                    sess.close()
            finally:
                daemon.stop()
        rec = {"backing": backing, "kv_bytes": kv, "idle_s": idle_s, "planned_paths": sorted(paths),
               "device_written_bytes": written, "written_per_kv_byte": written / kv, "kv": exact,
               "demoted_kpus": replan["demoted_kpus"]}
        say(f"idle {idle_s:g} s, backing {backing}: device wrote {written / MiB:.1f} MiB = "
            f"{written / kv:.4f} of the {kv / MiB:.0f} MiB KV, {replan['demoted_kpus']} KPUs demoted")
        out.append(rec)
    return out


def _write_override_config(path: str, override: int) -> None:
    """A minimal daemon config with a fixed B_pc, written by hand on purpose (the one bench config that is not
    ``bladed.config.Config.to_toml``'s, as :class:`bladed_bench.workload.BenchDaemon`'s is): every checkout
    compared reads it, older ones too. ``to_toml`` writes every key the writing checkout knows, and a daemon
    refuses a key it does not know; and in :func:`demotion_one`, which runs on the compared checkout's
    ``bladed``, it would tie this harness to that checkout's config API. Three keys every checkout knows, the
    rest each checkout's own defaults."""
    with open(path, "w") as f:
        f.write(f'[device]\nsize = {1 << 30}\n[budget]\noverride = {override}\n[log]\nformat = "text"\n')


def demotion_rate(checkouts: list[str], pairs: int, workdir: str, say: Callable[[str], None]) -> list[dict[str, Any]]:
    """How fast a re-plan's demotions give memory back: a 612 MiB session in memory files, then ``budget.override``
    cut to 360 MiB by a SIGHUP (20 KPUs, 255 MiB, demoted at once), each checkout's daemon and client in turn
    (a process of its own with that checkout first on its path), ``pairs`` times alternated; the seconds from the
    ``replan`` event to the last ``kpu_demoted``."""
    out: list[dict[str, Any]] = []
    for rep in range(pairs):
        for repo in trials.abba(checkouts, rep):
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.path.dirname(os.path.dirname(__file__))]))
            r = subprocess.run([sys.executable, "-m", "bladed_bench.spike", "demotion-one", repo, workdir],
                               env=env, cwd=repo, capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                raise RuntimeError(f"{repo}: the demotion run failed:\n{r.stderr[-2000:]}")
            rec = json.loads(r.stdout.strip().splitlines()[-1]) | {"checkout": repo, "rep": rep,
                                                                    "git": git_info(repo, ["bladed"])}
            say(f"{repo}: {rec['demoted_bytes'] / MiB:.0f} MiB demoted in {rec['seconds'] * 1e3:.0f} ms, "
                f"{rec['bytes_per_s'] / 1e9:.2f} GB/s")
            out.append(rec)
    return out


def demotion_one(repo: str, workdir: str) -> dict[str, Any]:
    """One run of :func:`demotion_rate` with this process's bladed (its client and daemon)."""
    from bladed.client import Client
    from bladed.spawn import PrivateDaemon

    g = SpikeSpec().geometry()
    state = os.path.join(workdir, "demotion-rate")
    shutil.rmtree(state, ignore_errors=True)
    os.makedirs(state)
    cfg, log_path = os.path.join(state, "bladed.toml"), os.path.join(state, "bladed.log")
    _write_override_config(cfg, 2 << 30)
    daemon = PrivateDaemon(["--config", cfg, "--state-dir", state], env=dict(os.environ), cwd=repo,
                           log_path=log_path, log_mode="w", notify_path=os.path.join(state, "notify.sock")).start()
    try:
        daemon.wait_ready(120)
        with Client(os.path.join(state, "bladed.sock"), timeout=600.0) as c:
            sess = c.open_session(g.to_dict(), mode="dualblade", channels=2)
            write_kv(sess, g)
            _write_override_config(cfg, 360 << 20)
            os.kill(daemon.pid, signal.SIGHUP)
            deadline = time.monotonic() + 60
            while c.stats()["replan"]["demoted_kpus"] < 20 or any(r.get("pending_demotions") for r in c.sessions()):
                if time.monotonic() > deadline:
                    raise RuntimeError("the demotions did not finish within 60 s")
                time.sleep(0.01)      # polled: the daemon's log is the record, read below
            demoted = c.stats()["replan"]["demoted_bytes"]
            sess.close()
    finally:
        daemon.stop()
    stamps: dict[str, list[float]] = {"replan": [], "kpu_demoted": []}
    with open(log_path) as f:
        for line in f:
            for name, got in stamps.items():
                if f"event={name} " in line:
                    got.append(dt.datetime.strptime(line.split()[0][3:], "%Y-%m-%dT%H:%M:%S.%fZ").timestamp())
    took = stamps["kpu_demoted"][-1] - stamps["replan"][0]
    return {"demoted_bytes": demoted, "seconds": took, "first_kpu_s": stamps["kpu_demoted"][0] - stamps["replan"][0],
            "bytes_per_s": demoted / took}


def markdown(doc: dict[str, Any]) -> str:
    """The spike table: one row per placement and rate, one column per backing."""
    cases = doc["cases"]
    backings = list(dict.fromkeys(c["backing"] for c in cases))
    lines = ["| neighbour's place | its rate | " + " | ".join(f"`backing = \"{b}\"`" for b in backings) + " |",
             "| --- | --- | " + " | ".join("---" for _ in backings) + " |"]
    rows: dict[tuple[str, int], dict[str, list[dict[str, Any]]]] = {}
    for c in cases:
        rows.setdefault((c["placement"], c["rate_bytes_per_s"]), {}).setdefault(c["backing"], []).append(c)
    for (placement, rate), by in rows.items():
        cells = []
        for b in backings:
            runs = by.get(b)
            if not runs:
                cells.append("—")
                continue
            alive = sum(1 for c in runs if c.get("neighbour_alive") and not c.get("oom_kills"))
            exact = sum(1 for c in runs if c["kv"]["exact"] == c["kv"]["kpus"])
            n = len(runs)
            who = f"neighbour alive {alive}/{n}" if alive == n else f"**neighbour OOM-killed {n - alive}/{n}**"
            demoted = sorted((c.get("demoted_bytes") or 0) / MiB for c in runs)
            react = [c["replan"].get("reaction_max_s") for c in runs if c.get("replan", {}).get("reaction_max_s")]
            cells.append(f"{who}, KV exact {exact}/{n}, demoted {demoted[0]:.0f}-{demoted[-1]:.0f} MiB"
                         + (f", reaction ≤ {max(react) * 1e3:.0f} ms" if react else ""))
        got = sorted(c["neighbour_rate_bytes_per_s"] / MiB for b in by.values() for c in b
                     if c.get("neighbour_rate_bytes_per_s"))
        rate_s = f"{rate // MiB} MiB/s" + (f" (grew at {got[0]:.0f}-{got[-1]:.0f})" if got else "")
        lines.append(f"| {placement} | {rate_s} | " + " | ".join(cells) + " |")
    for r in doc.get("idle", []):
        lines.append(f"\nidle {r['idle_s']:g} s, backing {r['backing']}: the device wrote "
                     f"{r['written_per_kv_byte']:.4f} of the {r['kv_bytes'] / MiB:.0f} MiB KV")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["neighbour"]:
        return neighbour_main(int(args[1]), float(args[2]), int(args[3]))
    if args[:1] == ["demotion-one"]:
        print(json.dumps(demotion_one(args[1], args[2])))
        return 0
    d = SpikeSpec()
    p = argparse.ArgumentParser(prog=prog or "tools/bench_spike.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--placements", default=",".join(d.placements))
    p.add_argument("--rates", default=",".join(str(r // MiB) for r in d.rates), help="MiB/s, comma-separated")
    p.add_argument("--backings", default=",".join(d.backings))
    p.add_argument("--limit-mib", type=int, default=d.limit_bytes // MiB)
    p.add_argument("--neighbour-mib", type=int, default=d.neighbour_bytes // MiB)
    p.add_argument("--daemon", default="{}", help='extra daemon config as JSON: {"budget": {"headroom": 0.05}}')
    p.add_argument("--repeat", type=int, default=1, help="runs of every case, one after another (default 1)")
    p.add_argument("--idle", type=float, default=0.0,
                   help="also the idle-wear run: a 512 MiB session that fits, idle this many seconds (0: none)")
    p.add_argument("--idle-only", action="store_true", help="the idle-wear run alone")
    p.add_argument("--demotion-rate", default="", metavar="CHECKOUT,...",
                   help="instead: how fast a re-plan's demotions give memory back, the daemon of each checkout (a "
                        "directory holding bladed/, built) alternated --repeat times")
    p.add_argument("--json", default=None, help="default: docs/bench/spike-<UTC time>.json")
    a = p.parse_args(args)
    if os.geteuid() != 0:
        p.error("needs root: memory cgroups")
    spec = SpikeSpec(limit_bytes=a.limit_mib * MiB, neighbour_bytes=a.neighbour_mib * MiB,
                     rates=tuple(int(float(r) * MiB) for r in a.rates.split(",")),
                     placements=tuple(a.placements.split(",")), backings=tuple(a.backings.split(",")),
                     daemon=json.loads(a.daemon), repeat=a.repeat, idle_s=a.idle)
    out = a.json or os.path.join(REPO, "docs", "bench", time.strftime("spike-%Y-%m-%dT%H%MZ.json", time.gmtime()))
    if a.demotion_rate:
        doc = {"study": "demotion-rate", "argv": sys.argv, "machine": machine_info(),
               "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
               "runs": demotion_rate(a.demotion_rate.split(","), a.repeat, "/var/tmp/bladed-spike",
                                     lambda m: print(m, file=sys.stderr, flush=True))}
        trials.write_json(out, doc)
        print(f"JSON: {out}", file=sys.stderr)
        return 0
    if a.idle_only:
        spec = dataclasses.replace(spec, placements=(), rates=())
    doc = run_spike(spec, out, say=lambda m: print(m, file=sys.stderr, flush=True))
    print(markdown(doc))
    print(f"JSON: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
