"""The runner's sparse decode reads (``--kv-select``, docs/kv-select.md): off by default and exact at a whole
budget, the same arithmetic with or without the reuse buffer and through bladed on either path, reading less,
and working from a retained prefix after a daemon restart.

Comparisons between two runs of the same arithmetic are bit for bit (``assert_same``); a batch against its
sequences run one at a time compares tokens exactly and logits within a few float32 ulp (matmuls of other
shapes)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from daemon_util import DaemonProcess, short_tmpdir
from runner_util import CONFIGS, assert_same, hf_model, prompt, run, runner_model
from test_runner_prefix import PrefilledKV

from bladed.client import Client, PrefixKey
from bladed.kvstore import BladedKV, Geometry, MemoryKV
from bladed.runner.main import main
from bladed.runner.models import DecoderModel, tiny_config

MIB = 1 << 20
GEN = 8
SPARSE = "keys:0.25,page=8"           # pages of 8: a 160-token prompt is 20 pages, 5 of them read


@pytest.fixture(scope="module", params=["llama-gqa", "opt"])
def model(request: pytest.FixtureRequest) -> DecoderModel:
    return runner_model(hf_model(CONFIGS[request.param], torch.float32))


def test_a_budget_of_every_page_is_the_dense_run_bit_for_bit(model: DecoderModel) -> None:
    ids = prompt(model.cfg, 2, 160)
    dense = run(model, ids, GEN)
    assert dense.select == {}
    for spec in ("keys:1", "quest:1,page=8", "random:1"):
        assert_same(run(model, ids, GEN, kv_select=spec), dense)


def test_a_sparse_step_reads_its_selection_and_the_reuse_buffer_changes_nothing(model: DecoderModel) -> None:
    ids = prompt(model.cfg, 1, 160)
    dense = run(model, ids, GEN)
    on = run(model, ids, GEN, kv_select=SPARSE)
    off = run(model, ids, GEN, kv_select=SPARSE + ",reuse=off")
    assert_same(on, off)
    sel = on.select
    layers = model.cfg.num_layers - 2                          # the first two read all of their past
    pages = [math.ceil((160 + i) / 8) for i in range(GEN - 1)]  # the past of decode steps 1..GEN-1
    assert sel["pages_total"] == layers * sum(pages)
    assert sel["pages_selected"] == layers * sum(max(3, math.ceil(n / 4)) for n in pages)
    assert 0 < sel["pages_read"] < sel["pages_selected"] == off.select["pages_read"]
    assert sel["selector_bytes"] > 0 and sel["reuse_buffer_bytes"] > 0 and off.select["reuse_buffer_bytes"] == 0
    decode_read = sum(s["read_bytes"] for s in on.step_times[1:])     # a selecting layer reads under 0.6 of its KV
    assert decode_read < sum(s["read_bytes"] for s in dense.step_times[1:]) * (2 + 0.6 * layers) / (2 + layers)
    assert all(s["select_s"] > 0 for s in on.step_times[1:])


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_kv_formats_and_their_full_precision_tail_go_through_the_reuse_buffer_unchanged(fmt: str) -> None:
    cfg = tiny_config("llama", layers=3, hidden=128, heads=4, kv_heads=2)     # head_dim 32: q4's blocks
    model = runner_model(hf_model(cfg, torch.float32))
    ids = prompt(cfg, 1, 150)
    a = run(model, ids, GEN, kv_select="keys:0.25,page=8,dense-layers=1", kv_format=fmt, kv_tail=24)
    b = run(model, ids, GEN, kv_select="keys:0.25,page=8,dense-layers=1,reuse=off", kv_format=fmt, kv_tail=24)
    assert_same(a, b)
    assert a.select["pages_read"] < b.select["pages_read"]


def test_each_sequence_of_a_batch_attends_to_its_own_selection(model: DecoderModel) -> None:
    ids = prompt(model.cfg, 3, 160, seed=5)
    batch = run(model, ids, GEN, kv_select=SPARSE)
    eps = torch.finfo(torch.float32).eps
    for b in range(3):
        one = run(model, ids[b:b + 1], GEN, kv_select=SPARSE)
        assert torch.equal(batch.tokens[b], one.tokens[0])
        for x, y in zip(batch.logits, one.logits, strict=True):
            assert float((x[b] - y[0]).abs().max()) <= 16 * eps * max(1.0, float(y.abs().max()))


@pytest.fixture(scope="module", params=["pagecache", "direct"])
def daemon(request: pytest.FixtureRequest) -> Iterator[tuple[DaemonProcess, str]]:
    """A daemon whose sessions and retained prefixes are all on one path."""
    path = request.param
    budget, entries = (64 * MIB, 8 * MIB) if path == "pagecache" else (0, 0)
    config = {"budget": {"override": budget},
              "prefix": {"block_tokens": 16, "pagecache_bytes": entries, "device_bytes": 8 * MIB}}
    with short_tmpdir() as d, DaemonProcess(d, config) as dp:
        dp.start()
        yield dp, path


def test_through_bladed_on_either_path_the_sparse_run_is_the_in_memory_one_and_survives_a_restart(
        daemon: tuple[DaemonProcess, str]) -> None:
    """The sparse reads of a session equal MemoryKV's bit for bit; a prefix retained by a sparse run is found
    after the daemon restarts, its keys summarised from what is read back, and the run from it equals the run
    from an in-process copy of the same bytes."""
    dp, path = daemon
    model = runner_model(hf_model(CONFIGS["llama-gqa"], torch.float32))
    ids = prompt(model.cfg, 1, 150, seed=9)
    name = f"select-{path}"
    from bladed.runner.generation import Policy, Runner

    def generate(factory: Any, ids: torch.Tensor, retain: bool = False) -> Any:
        return Runner(model, Policy(kv_select=SPARSE), kv_factory=factory).generate(ids, GEN, retain_prefix=retain)

    kept: list[PrefilledKV] = []

    def recording(g: Geometry) -> PrefilledKV:
        kept.append(PrefilledKV(g))
        return kept[-1]

    with Client(socket_path=dp.socket_path) as c:
        c.evict_prefixes()
        key = PrefixKey(name, "float32", ids[0].tolist())
        first = generate(lambda g: BladedKV.open(g, channels=2, client=c, defer_writes=True, prefix=key), ids,
                         retain=True)
        assert {k["path"] for k in first.plans[0]["kpus"]} == {path}
    assert_same(first, generate(recording, ids, retain=True))
    assert first.select["pages_read"] < first.select["pages_selected"]
    assert dp.stop() == 0
    later = torch.cat([ids, first.tokens[:, :-1], prompt(model.cfg, 1, 20, seed=10)], dim=1)
    with dp.start(), Client(socket_path=dp.socket_path) as c:
        key = PrefixKey(name, "float32", later[0].tolist())
        second = generate(lambda g: BladedKV.open(g, channels=2, client=c, prefix=key), later)
    assert second.prefix_tokens == 144
    assert_same(second, generate(lambda g: PrefilledKV(g, kept[0].kept, 144), later))
    assert 0 < second.select["pages_selected"] < second.select["pages_total"]


# -- the command line --------------------------------------------------------------------------------------------
TINY = ["--model", "tiny-llama", "--backend", "memory", "--json", "--prompt-len", "100", "--gen-len", "5"]


def test_kv_select_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(TINY) == 0
    dense = json.loads(capsys.readouterr().out)
    assert main([*TINY, "--kv-select", "keys:0.25,page=8"]) == 0
    sparse = json.loads(capsys.readouterr().out)
    assert dense["info"]["kv_select"] is None and dense["select"] is None
    assert sparse["info"]["kv_select"] == "keys:0.25,sinks=1,window=2,page=8,dense-layers=2,heads=max,keys=q4,reuse=on"
    assert sparse["select"]["pages_selected"] < sparse["select"]["pages_total"]
    assert all("select_s" in s and "pages_read" in s for s in sparse["steps"])
    assert main([*TINY, "--kv-select", "keys:1"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == dense["tokens"]


@pytest.mark.parametrize("value, message", [
    ("keys:2", "--kv-select: fraction 2 is outside (0, 1]; accepted (0, 1], e.g. keys:0.25"),
    ("keys:0.25,page=-4", "--kv-select: page='-4' is not an integer >= 1; accepted 1 or more"),
    ("keys:0.25,window=50", "--kv-select: window=50 pages of 16 tokens exceed the context of 105 tokens; accepted "
                            "window=1..6"),
    ("keys:0.25,dense-layers=7", "--kv-select: dense-layers=7 is more than the model's 4 layers; accepted 0..4"),
])
def test_a_bad_kv_select_is_one_line_and_exit_2(value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*TINY, "--kv-select", value]) == 2
    assert capsys.readouterr().err == f"bladed-runner: error: {message}\n"


def test_memory_kv_reads_the_runs_it_is_asked_for() -> None:
    g = Geometry(layers=1, batch=1, kv_heads=1, head_dim=4, dtype_bytes=4, max_tokens=32)
    kv = MemoryKV(g)
    kv.slot(0)[:] = bytes(range(256)) * 2
    kv.write(0, "k", 0)
    kv.slot(0)[:] = bytes(512)
    op = kv.read_runs(0, "k", 0, [(0, 2), (10, 3)])
    assert op.nbytes == 5 * 16
    got = bytes(kv.slot(0))
    want = bytes(range(256)) * 2
    assert got[:32] == want[:32] and got[160:208] == want[160:208] and got[32:160] == bytes(128)
