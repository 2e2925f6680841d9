"""FlexLLMGen's disk offload (``bladed.torchdisk``) and the runner's ``--backend mmap`` over it: a real owner
process, real ``.npy`` memmaps, a real memory cgroup.

The yardstick must be right before anything is measured against it: what is written comes back, a bad range is
refused, nothing is left behind (files, processes), its page cache is charged to the cgroup it was put in and
not to the inference process, and the runner's tokens and logits over it are bit for bit those of the in-memory
KV (the same arithmetic).
"""

from __future__ import annotations

import errno
import os
import pathlib

import pytest
import torch
from cgroup_util import ChildCgroup, read_stat
from runner_util import CONFIGS, assert_same, prompt, run

from bladed.residency.geometry import Geometry
from bladed.runner.main import main
from bladed.runner.mmapkv import MmapKV, start_owner
from bladed.runner.models import DecoderModel, dummy_weights
from bladed.spawn import cgroup_launcher
from bladed.torchdisk import OP_READ, OP_WRITE, TorchDiskClient, npy_paths

GEOMETRY = Geometry(layers=2, batch=2, kv_heads=2, head_dim=64, dtype_bytes=4, max_tokens=64)


def memory_cgroup_of(pid: int) -> str:
    with open(f"/proc/{pid}/cgroup") as f:
        lines = f.read().splitlines()
    v1 = [ln.split(":", 2)[2] for ln in lines if "memory" in ln.split(":", 2)[1].split(",")]
    return v1[0] if v1 else next(ln.split(":", 2)[2] for ln in lines if ln.startswith("0::"))


def test_what_is_written_comes_back_and_nothing_is_left_behind(tmp_path: pathlib.Path) -> None:
    client = TorchDiskClient().open(str(tmp_path), GEOMETRY, channels=2)
    files = list(npy_paths(str(tmp_path), GEOMETRY.layers).values())
    try:
        assert all(os.path.getsize(p) >= GEOMETRY.kpu_bytes for p in files)
        tb = GEOMETRY.token_bytes
        pattern = bytes(range(256)) * (5 * tb // 256 + 1)
        client.slot(0)[3 * tb:8 * tb] = pattern[:5 * tb]
        nbytes, _ns, hit = client.io(OP_WRITE, 1, "v", 0, 3, 5)
        assert nbytes == 5 * tb and hit is None
        client.slot(1)[:] = b"\0" * GEOMETRY.kpu_bytes
        nbytes, _ns, hit = client.io(OP_READ, 1, "v", 1, 3, 5)   # the other channel's copy thread reads it
        assert nbytes == 5 * tb and bytes(client.slot(1)[3 * tb:8 * tb]) == pattern[:5 * tb]
        assert hit == 1.0                     # just written: in the page cache, nothing read from the disk
        counters = client.io_counters()
        assert counters is not None and set(counters) >= {"read_bytes", "write_bytes"}
        with pytest.raises(OSError) as err:
            client.io(OP_READ, 1, "k", 0, 60, 10)                 # past the KPU's 64 tokens
        assert err.value.errno == errno.EINVAL and "tokens [60, 70)" in str(err.value)
        pid = client.pid
    finally:
        client.close()
    assert not any(os.path.exists(p) for p in files)
    assert client.proc.returncode == 0 and not os.path.exists(f"/proc/{pid}/status")


def test_an_owner_killed_mid_run_fails_the_next_copy_and_leaves_no_files(tmp_path: pathlib.Path) -> None:
    client = TorchDiskClient().open(str(tmp_path), GEOMETRY, channels=2)
    client.proc.kill()
    client.proc.wait()
    with pytest.raises(ConnectionError):
        client.io(OP_READ, 0, "k", 0, 0, 4)
    client.close()
    assert not list(tmp_path.iterdir())


def test_an_owner_that_never_opened_a_store_exits_with_the_run() -> None:
    owner = start_owner()
    owner.wait_started()
    owner.close()
    assert owner.proc.returncode == 0


@pytest.mark.root
def test_its_page_cache_is_charged_to_the_cgroup_it_joined(tmp_path: pathlib.Path) -> None:
    """The reason the owner is a process of its own: the limit holds the KV's page cache, not the inference
    process's memory (the weights)."""
    cg = ChildCgroup(None)
    try:
        g = Geometry(layers=2, batch=4, kv_heads=4, head_dim=128, dtype_bytes=4, max_tokens=2048)  # 16 MiB a KPU
        client = TorchDiskClient(cgroup_launcher(cg.path)).open(str(tmp_path), g, channels=2)
        try:
            assert memory_cgroup_of(client.pid).rstrip("/").endswith(os.path.basename(cg.path))
            assert memory_cgroup_of(os.getpid()) != memory_cgroup_of(client.pid)
            client.slot(0)[:] = b"\x01" * g.kpu_bytes
            for layer in range(g.layers):
                for kind in "kv":
                    client.io(OP_WRITE, layer, kind, 0, 0, g.max_tokens)
            stat = read_stat(cg.path)
            page_cache = stat.get("cache", stat.get("file", 0)) - stat.get("shmem", 0)
            assert page_cache >= 4 * g.kpu_bytes   # the four KPUs' pages, dirty in the cgroup's page cache
        finally:
            client.close()
    finally:
        cg.remove()


@pytest.fixture(scope="module")
def tiny() -> tuple[DecoderModel, torch.Tensor]:
    cfg = CONFIGS["llama-gqa"]
    return DecoderModel(cfg, dummy_weights(cfg, torch.float32, seed=3)), prompt(cfg, 2, 9)


@pytest.mark.parametrize("kv_format", ["", "q8:16"])
def test_the_runner_over_mmap_equals_in_memory_kv_bit_for_bit(tiny: tuple[DecoderModel, torch.Tensor],
                                                              kv_format: str) -> None:
    model, ids = tiny
    opened: list[MmapKV] = []

    def factory(g: Geometry) -> MmapKV:
        opened.append(MmapKV(g, channels=2))
        return opened[-1]

    assert_same(run(model, ids, 5, factory, kv_format=kv_format), run(model, ids, 5, kv_format=kv_format))
    assert opened and all(not os.path.exists(kv.directory) for kv in opened)  # its temporary directory is gone


def test_runner_cli_mmap_reports_its_owner_and_refuses_flags_that_do_not_apply(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    common = ["--model", "tiny-llama", "--prompt-len", "12", "--gen-len", "4", "--gpu-batch-size", "2", "--json"]
    assert main([*common, "--backend", "mmap", "--kv-dir", str(tmp_path / "kv")]) == 0
    mmap_run = json.loads(capsys.readouterr().out)
    assert main([*common, "--backend", "memory"]) == 0
    memory_run = json.loads(capsys.readouterr().out)
    assert mmap_run["tokens"] == memory_run["tokens"]
    (owner,) = mmap_run["info"]["kv_owner"]
    assert owner["what"] == "torchdisk" and owner["io"]["write_bytes"] >= 0
    assert mmap_run["stats"]["mmap"]["read_ops"] > 0 and not list((tmp_path / "kv").rglob("*.npy"))
    assert len(mmap_run["steps"]) == 4 and mmap_run["steps"][1]["read_bytes"] > 0

    for argv, needle in (
            (["--backend", "memory", "--kv-dir", str(tmp_path)], "--kv-dir: the .npy files are --backend mmap's"),
            (["--backend", "memory", "--kv-cgroup", str(tmp_path)], "--kv-cgroup: the KV is in this process"),
            (["--backend", "mmap", "--kv-cgroup", str(tmp_path)], "is not a cgroup directory")):
        assert main([*common, *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err
