"""The runner's prefix reuse against a real daemon: a request served from a retained prefix generates what a
cold run does (docs/runner.md, "Prefix reuse").

A run retains the KV it wrote (prompt and generated tokens fed back); a later prompt that starts with it skips
the prefill of the matched whole blocks. Two comparisons:

* against the same arithmetic, bit for bit: the run from bladed's retained prefix equals the run from an
  in-process copy of the KV bytes the first run wrote (``PrefilledKV``), and a cold run through bladed equals a
  cold run with ``MemoryKV``;
* against a cold run of the whole prompt: the same greedy tokens, logits within a tolerance. Not bit for bit:
  the reused KV was computed in the first run's prefill and decode steps (other matmul shapes than a cold
  prefill of the longer prompt), and the new tokens are computed in a shorter chunk, so the last bits of the
  float32 sums may differ; the tolerance is a few float32 ulp at the logits' magnitude, 16 here where one
  layer's rounding difference goes through every later layer.

Both KV paths are covered (a page-cache budget override of 64 MiB: every KPU on the page-cache path; 0: all
on the NVMe-direct path), with the entries in page-cache files or on the extent to match. The CLI's
``--reuse-prefix`` and ``--chat`` run as a user runs them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from daemon_util import DaemonProcess, short_tmpdir
from runner_util import CONFIGS, assert_same, hf_model, prompt, runner_model

from bladed.client import Client, PrefixKey
from bladed.kvstore import BladedKV, Geometry, MemoryKV
from bladed.runner.generation import GenerationResult, Policy, Runner
from bladed.runner.main import main
from bladed.runner.models import DecoderModel

BLOCK = 16
GEN = 6
#: float32 ulps at the logits' magnitude that a run from a retained prefix may differ from a cold run (docstring)
PREFIX_ULPS = 16
MIB = 1 << 20


class PrefilledKV(MemoryKV):
    """``MemoryKV`` that starts with the first ``prefix_tokens`` token rows of another run's KV, as bladed's
    retained prefix does, and keeps what it is asked to retain."""

    def __init__(self, geometry: Geometry, source: dict[tuple[int, str], bytes] | None = None,
                 prefix_tokens: int = 0) -> None:
        super().__init__(geometry)
        self.prefix_tokens = prefix_tokens
        n = prefix_tokens * geometry.token_bytes
        for (layer, kind), data in (source or {}).items():
            self._kpu(layer, kind)[:n] = data[:n]   # token rows are contiguous: any max_tokens
        self.kept: dict[tuple[int, str], bytes] = {}
        self.kept_tokens: list[int] = []

    def retain(self, tokens: list[int]) -> dict[str, Any]:
        self.kept = {key: bytes(buf) for key, buf in self._store.items()}
        self.kept_tokens = list(tokens)
        return {"entry": "in-memory", "tokens": len(tokens) // BLOCK * BLOCK, "new": True}


def generate(model: DecoderModel, ids: torch.Tensor, factory: Any, retain: bool = False) -> GenerationResult:
    return Runner(model, Policy(), kv_factory=factory).generate(ids, GEN, retain_prefix=retain)


def assert_close_to_cold(res: GenerationResult, cold: GenerationResult) -> None:
    """The same greedy tokens as the cold run, logits within PREFIX_ULPS float32 ulp (the module docstring)."""
    assert torch.equal(res.tokens, cold.tokens)
    eps = torch.finfo(torch.float32).eps
    for step, (x, y) in enumerate(zip(res.logits, cold.logits, strict=True)):
        tol = PREFIX_ULPS * eps * max(1.0, float(y.abs().max()))
        err = float((x - y).abs().max())
        assert err <= tol, f"step {step}: logits differ by {err:.3g} > {tol:.3g}"


@pytest.fixture(scope="module", params=["pagecache", "direct"])
def daemon(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """A daemon whose sessions and entries are all on one path."""
    path = request.param
    budget, entries = (64 * MIB, 8 * MIB) if path == "pagecache" else (0, 0)
    config = {"budget": {"override": budget},
              "prefix": {"block_tokens": BLOCK, "pagecache_bytes": entries, "device_bytes": 8 * MIB}}
    with short_tmpdir() as d, DaemonProcess(d, config).start() as dp:
        yield dp.socket_path, path


@pytest.fixture(scope="module", params=["opt", "llama-gqa"])
def model(request: pytest.FixtureRequest) -> DecoderModel:
    """OPT (learned positions) and LLaMA with GQA (rotary offsets): the prefill after a prefix starts mid-way."""
    return runner_model(hf_model(CONFIGS[request.param], torch.float32))


def test_a_request_from_a_retained_prefix_generates_what_a_cold_run_does(
        daemon: tuple[str, str], model: DecoderModel) -> None:
    sock, path = daemon
    name = f"{model.cfg.name}-{path}"
    first = prompt(model.cfg, 1, 45)
    with Client(socket_path=sock) as c:
        c.evict_prefixes()
        before = c.stats()

        def bladed(ids: torch.Tensor) -> Any:
            return lambda g: BladedKV.open(g, channels=2, client=c, defer_writes=True,
                                           prefix=PrefixKey(name, "float32", ids[0].tolist()))

        # a cold run through bladed is the in-memory run, bit for bit; it retains its 45 + 5 fed-back tokens
        kept: list[PrefilledKV] = []

        def recording(g: Geometry) -> PrefilledKV:
            kept.append(PrefilledKV(g))
            return kept[-1]

        ref1 = generate(model, first, recording, retain=True)
        run1 = generate(model, first, bladed(first), retain=True)
        assert run1.prefix_tokens == 0
        assert_same(run1, ref1)
        assert run1.retained[0]["tokens"] == 48 and run1.retained[0]["new"]
        assert kept[0].kept_tokens == first[0].tolist() + run1.tokens[0, :-1].tolist()

        # the next turn: the conversation so far and more tokens; 3 whole blocks come from the retained prefix
        second = torch.cat([first, run1.tokens[:, :-1], prompt(model.cfg, 1, 12, seed=2)], dim=1)  # 62 tokens
        run2 = generate(model, second, bladed(second), retain=True)
        assert run2.prefix_tokens == 48
        assert_same(run2, generate(model, second, lambda g: PrefilledKV(g, kept[0].kept, 48)))
        cold2 = generate(model, second, lambda g: MemoryKV(g))
        assert_close_to_cold(run2, cold2)
        assert {k["path"] for k in run2.plans[0]["kpus"]} == {path}
        listed = [e for e in c.prefixes()["prefixes"] if e["model"] == name]
        assert [e["tokens"] for e in listed] == [64]          # the longer entry superseded the shorter one
        if path == "direct":
            assert listed[0]["pagecache_bytes"] == 0 and listed[0]["device_bytes"] > 0
        else:
            assert listed[0]["pagecache_bytes"] > 0

        # a prompt that is exactly retained blocks: the last token is computed again, for its logits
        whole = second[:, :48]
        run3 = generate(model, whole, bladed(whole))
        assert run3.prefix_tokens == 47
        assert_close_to_cold(run3, generate(model, whole, lambda g: MemoryKV(g)))

        # evicted: a clean miss that computes everything and generates the cold run's tokens, bit for bit
        assert c.evict_prefixes() == [listed[0]["entry"]]
        run4 = generate(model, second, bladed(second))
        assert run4.prefix_tokens == 0
        assert_same(run4, cold2)
        after = c.stats()
    # hits: run2 and run3; misses: run1 and run4
    assert {k: after[k] - before[k] for k in ("prefix_hits", "prefix_misses", "prefix_reused_tokens")} == {
        "prefix_hits": 2, "prefix_misses": 2, "prefix_reused_tokens": 48 + 48}


def test_without_a_prefix_key_nothing_is_found_or_retained(daemon: tuple[str, str], model: DecoderModel) -> None:
    sock, _ = daemon
    ids = prompt(model.cfg, 1, 40, seed=4)
    with Client(socket_path=sock) as c:
        before = c.prefixes()["prefixes"]
        res = generate(model, ids, lambda g: BladedKV.open(g, channels=2, client=c))
        assert res.prefix_tokens == 0 and res.retained == []
        assert c.prefixes()["prefixes"] == before
    assert_same(res, generate(model, ids, lambda g: MemoryKV(g)))


# -- the command line --------------------------------------------------------------------------------------------
TINY = ["--model", "tiny-llama", "--gen-len", "5", "--json"]


def test_reuse_prefix_on_the_command_line_finds_what_the_last_run_retained(
        capsys: pytest.CaptureFixture[str]) -> None:
    with short_tmpdir() as d, DaemonProcess(d, {"budget": {"override": 64 * MIB}}).start() as dp:
        args = [*TINY, "--prompt-len", "40", "--socket", dp.socket_path]
        outs = []
        for _ in range(2):
            assert main([*args, "--reuse-prefix"]) == 0
            outs.append(json.loads(capsys.readouterr().out))
        assert main(args) == 0
        plain = json.loads(capsys.readouterr().out)
    assert [o["prefix_tokens"] for o in outs] == [0, 32]
    assert outs[0]["retained"]["tokens"] == 32 and outs[0]["retained"]["new"]
    assert outs[0]["tokens"] == outs[1]["tokens"] == plain["tokens"]
    assert plain["prefix_tokens"] == 0 and plain["retained"] is None
    assert outs[1]["ttft_s"] > 0


@pytest.mark.parametrize("flags, message", [
    (["--gpu-batch-size", "2"], "--reuse-prefix: a retained prefix is the KV of one sequence, the batch is 2 x 1; "
                                "give --gpu-batch-size 1 --num-gpu-batches 1"),
    (["--backend", "memory"], "--reuse-prefix: retained prefixes live in bladed; drop --backend memory (or "
                              "--reuse-prefix)"),
    (["--percent", "100", "0", "25", "0", "100", "0"],
     "--reuse-prefix: only the KV in bladed is retained and found again, --percent puts 25% of the layers' KV on "
     "the GPU and 0% in host memory; give --percent WG WC 0 0 AG AC"),
], ids=["batch", "memory", "percent"])
def test_reuse_prefix_with_what_it_cannot_serve_is_one_line_and_exit_2(
        flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*TINY, "--reuse-prefix", *flags]) == 2
    err = capsys.readouterr().err
    assert err == f"bladed-runner: error: {message}\n"


def test_chat_needs_a_readable_file_with_messages(capsys: pytest.CaptureFixture[str]) -> None:
    with short_tmpdir() as d:
        empty = f"{d}/empty.txt"
        open(empty, "w").close()
        assert main([*TINY, "--chat", empty]) == 2
        assert capsys.readouterr().err == (f"bladed-runner: error: --chat {empty}: no user message in it; give a text "
                                           "file with one user message per line\n")
        assert main([*TINY, "--chat", f"{d}/missing.txt"]) == 2
        assert capsys.readouterr().err == (f"bladed-runner: error: --chat {d}/missing.txt: cannot read it (No such "
                                           "file or directory); give a text file with one user message per line\n")


def test_a_chat_over_smollm2_reuses_each_turn_and_says_what_a_cold_chat_says(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Turn 2 and 3 start from the KV the turn before retained and reply what the chat without reuse replies."""
    from bladed.runner.weights import smollm2_dir

    smollm2_dir()  # converted once, cached
    with short_tmpdir() as d, DaemonProcess(d, {"budget": {"override": 64 * MIB}}).start() as dp:
        script = f"{d}/chat.txt"
        with open(script, "w") as f:
            f.write("What is the capital of France?\n\nAnd of Italy?\nWhich of the two is larger?\n")
        args = ["--model", "smollm2", "--chat", script, "--gen-len", "8", "--socket", dp.socket_path,
                "--system", "You are a terse geography tutor.", "--json"]
        assert main([*args, "--reuse-prefix"]) == 0
        reuse = json.loads(capsys.readouterr().out)
        assert main(args) == 0
        cold = json.loads(capsys.readouterr().out)
    assert [t["user"] for t in reuse["turns"]] == ["What is the capital of France?", "And of Italy?",
                                                   "Which of the two is larger?"]
    assert [t["tokens"] for t in reuse["turns"]] == [t["tokens"] for t in cold["turns"]]
    assert [t["prompt_len"] for t in reuse["turns"]] == [t["prompt_len"] for t in cold["turns"]]
    # a turn's prompt starts with the previous one's, whose whole blocks (16 tokens) it retained
    hits = [t["prefix_tokens"] for t in reuse["turns"]]
    assert hits[0] == 0
    assert all(h >= t["prompt_len"] // 16 * 16 for h, t in zip(hits[1:], reuse["turns"], strict=False))
    assert all(t["prefix_tokens"] == 0 for t in cold["turns"])
    assert len(reuse["ttft_s"]) == 3 and all(x > 0 for x in reuse["ttft_s"])
