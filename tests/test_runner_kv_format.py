"""The runner's ``--kv-format`` (issue 31, "Clients"): the offloaded KV stored as fp16/bf16/fp32/q8/q4 rows.

The copy threads quantize and dequantize in the runner's process; bladed stores rows of bytes. So the runner
over bladed with a format is bit for bit the runner over the in-process ``MemoryKV`` with the same format
(bladed adds no error of its own), the stored bytes are the format's (fewer of them), and without the flag
nothing changes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from daemon_util import ROOT, env_with_repo, short_tmpdir
from runner_util import CONFIGS, assert_same, hf_model, prompt, run, runner_model

from bladed.client import Client
from bladed.kvformat import KVFormatError, kv_format
from bladed.kvstore import BladedKV, Geometry, MemoryKV
from bladed.runner.generation import Policy, Runner
from bladed.runner.main import spawned_daemon
from bladed.runner.models import DecoderModel

PROG = "bladed-runner"
TINY = ["--model", "tiny-llama", "--prompt-len", "8", "--gen-len", "6", "--json"]
TIMEOUT = 180.0


def runner(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bladed.runner", *args], cwd=ROOT, env=env_with_repo(),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT)


# -- the command line -------------------------------------------------------------------------------------

def test_q8_over_a_spawned_daemon_generates_what_the_memory_backend_with_q8_does() -> None:
    with short_tmpdir("bdr-") as tmp:
        bladed = runner(*TINY, "--kv-format", "q8", "--spawn-daemon", "--state-dir", tmp)
    memory = runner(*TINY, "--kv-format", "q8", "--backend", "memory")
    plain = runner(*TINY, "--backend", "memory")
    for r in (bladed, memory, plain):
        assert (r.returncode, r.stderr) == (0, ""), r.stderr
    b, m, p = (json.loads(r.stdout) for r in (bladed, memory, plain))
    assert b["tokens"] == m["tokens"] and len(b["tokens"][0]) == 6
    assert (b["info"]["kv_format"], m["info"]["kv_format"], p["info"]["kv_format"]) == ("q8", "q8", "fp32")
    # tiny-llama on CPU: float32 KV, 1 x 2 KV heads x 32 per token: 256-byte rows, 68 in q8 (2 x {fp16, 32 x int8})
    assert m["stats"]["memory"]["read_bytes"] * 256 == p["stats"]["memory"]["read_bytes"] * 68
    assert sum(s["read_bytes"] for s in b["stats"].values()) == m["stats"]["memory"]["read_bytes"]
    assert {k["nbytes"] for k in b["plans"][0]["kpus"]} == {68 * (8 + 6)}   # the daemon sized the KPUs by q8 rows


@pytest.mark.parametrize(("args", "message"), [
    (["--kv-format", "q3"], "argument --kv-format: unknown KV format 'q3'; known are fp16, bf16, fp32, q8, q4 "
                            "(q8:<block>, q4:<block> for another block size); see bladed-runner --help"),
    (["--kv-format", "q8:7"], "argument --kv-format: block size of KV format 'q8:7' must be an even number from 2 "
                              "to 4096, got '7'; see bladed-runner --help"),
], ids=["unknown", "odd-block"])
def test_a_bad_kv_format_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    r = runner("--model", "tiny-llama", "--backend", "memory", *args)
    assert (r.returncode, r.stderr, r.stdout) == (2, f"{PROG}: error: {message}\n", "")


def test_q4_shows_its_full_precision_tail_and_kv_tail_turns_it_off() -> None:
    q4 = runner(*TINY, "--kv-format", "q4", "--backend", "memory")
    off = runner(*TINY, "--kv-format", "q4", "--kv-tail", "0", "--backend", "memory")
    plain = runner(*TINY, "--backend", "memory")
    for r in (q4, off, plain):
        assert (r.returncode, r.stderr) == (0, ""), r.stderr
    a, b, p = (json.loads(r.stdout) for r in (q4, off, plain))
    assert [x["info"]["kv_full_precision_tail"] for x in (a, b, p)] == [128, 0, 0]
    assert a["info"]["kv_format"] == b["info"]["kv_format"] == "q4"
    # 8 + 6 tokens, all within q4's 128: attended to as computed, so the tokens are the unquantized run's
    assert a["tokens"] == p["tokens"]
    counts = ("read_ops", "read_bytes", "write_ops", "write_bytes")   # the q4 rows are written and read all the same
    assert [a["stats"]["memory"][c] for c in counts] == [b["stats"]["memory"][c] for c in counts]


def test_a_negative_kv_tail_is_one_line_and_exit_2() -> None:
    r = runner("--model", "tiny-llama", "--backend", "memory", "--kv-format", "q4", "--kv-tail", "-1")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == (f"{PROG}: error: --kv-tail -1: the full-precision tail is a number of tokens; give "
                        "--kv-tail 0 (off) or more, or leave it out for the --kv-format's own\n")


def test_a_kv_format_the_models_head_dim_does_not_fit_is_one_line_and_exit_2() -> None:
    r = runner("--model", "tiny-llama", "--backend", "memory", "--kv-format", "q8:64", "--json")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(f"{PROG}: error: --kv-format q8:64: KV format q8:64 quantizes head_dim in blocks of "
                               "64, which do not divide head_dim 32; ") and r.stderr.count("\n") == 1, r.stderr


# -- the engine: bit for bit against the same quantized arithmetic in memory ---------------------------------

@pytest.fixture(scope="module")
def model() -> DecoderModel:
    return runner_model(hf_model(CONFIGS["llama-gqa"], torch.float32))   # head_dim 16: blocks of 16


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with spawned_daemon(str(tmp_path_factory.mktemp("bladed-kvfmt"))) as sock:
        yield sock


@pytest.mark.parametrize(("fmt", "mode", "defer", "tail"), [
    ("q8:16", "dualblade", True, None), ("q8:16", "direct", False, None), ("q4:16", "baseline", True, 0),
    ("q4:16", "dualblade", True, 4), ("fp16", "dualblade", True, None),
], ids=str)
def test_the_runner_over_bladed_equals_memory_kv_of_the_same_format(model: DecoderModel, daemon: str, fmt: str,
                                                                   mode: str, defer: bool, tail: int | None) -> None:
    ids = prompt(model.cfg, 2, 7)
    ref = run(model, ids, 6, kv_format=fmt, kv_tail=tail)
    with Client(socket_path=daemon) as client:
        def factory(g: Geometry) -> BladedKV:
            assert g.kv_format == kv_format(fmt).name
            return BladedKV.open(g, mode=mode, channels=2, client=client, defer_writes=defer)

        res = run(model, ids, 6, factory=factory, kv_format=fmt, kv_tail=tail)
    assert_same(res, ref)                                  # tokens and logits, bit for bit
    plain = run(model, ids, 6)
    # the format is applied: the decode steps attend to the rounded KV (the prefill to the new KV itself)
    assert torch.equal(ref.logits[0], plain.logits[0])
    assert max(float((a - b).abs().max()) for a, b in zip(ref.logits[1:], plain.logits[1:], strict=True)) > 0


def test_q4_with_a_tail_longer_than_the_sequence_attends_to_the_kv_as_computed(model: DecoderModel) -> None:
    """7 + 6 tokens within q4's 128-token tail: every past token comes from the full-precision copy, so the run
    is the unquantized one bit for bit; a shorter tail quantizes the older tokens, and the runner says which."""
    ids = prompt(model.cfg, 2, 7)
    plain = run(model, ids, 6)
    assert Runner(model, Policy(kv_format="q4:16"), kv_factory=MemoryKV).kv_tail == 128
    assert_same(run(model, ids, 6, kv_format="q4:16"), plain)
    short = run(model, ids, 6, kv_format="q4:16", kv_tail=3)
    assert not torch.equal(short.logits[-1], plain.logits[-1])
    with pytest.raises(ValueError, match="kv_tail=-2: the full-precision tail is a number of tokens"):
        Runner(model, Policy(kv_format="q4:16", kv_tail=-2), kv_factory=MemoryKV)


def test_a_plain_format_of_the_runs_own_dtype_changes_nothing(model: DecoderModel) -> None:
    ids = prompt(model.cfg, 2, 7)
    assert_same(run(model, ids, 6, kv_format="fp32"), run(model, ids, 6))


def test_the_format_applies_to_the_offloaded_layers_only(model: DecoderModel) -> None:
    ids = prompt(model.cfg, 2, 7)
    seen: list[Geometry] = []

    def factory(g: Geometry) -> MemoryKV:
        seen.append(g)
        return MemoryKV(g)

    run(model, ids, 4, factory=factory, kv_format="q4:16", cache_gpu_percent=50)
    assert [(g.layers, g.kv_format, g.dtype_bytes) for g in seen] == [(2, "q4:16", 4)]


def test_the_runner_refuses_a_format_the_head_dim_does_not_fit(model: DecoderModel) -> None:
    with pytest.raises(KVFormatError, match="head_dim 16"):
        Runner(model, Policy(kv_format="q8"), kv_factory=MemoryKV)
