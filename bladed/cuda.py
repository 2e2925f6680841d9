"""The CUDA runtime calls bladed makes itself: page-locking host memory for DMA (``cudaHostRegister``) and the
error they leave behind. Through ``torch.cuda.cudart()``, only where torch is imported and CUDA is there: on a
CPU-only box nothing here touches CUDA, and nothing here imports torch on its own."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from typing import Any

_CUDART: list[Any] = []


def available() -> bool:
    """Whether torch is imported and has a CUDA device (never raises: a broken CUDA install must not break CPU
    use)."""
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_available())
    except Exception:
        return False


def clear_error() -> None:
    """Reset this thread's last CUDA runtime error (``cudaGetLastError``) after a failed call through
    ``torch.cuda.cudart()``: torch's bindings return the error and leave it set, and torch's next kernel
    launch check would raise it as its own. Through the libcudart this process mapped (torch's); nothing
    when there is none (a runtime linked statically keeps its error to itself)."""
    if not _CUDART:
        path = None
        with contextlib.suppress(OSError), open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and os.path.basename(parts[-1]).startswith("libcudart.so"):
                    path = parts[-1]
                    break
        try:
            _CUDART.append(ctypes.CDLL(path) if path else None)
        except OSError:
            _CUDART.append(None)
    if _CUDART[0] is not None:
        _CUDART[0].cudaGetLastError()


def error_code(rc: Any) -> int:
    """A ``cudaError_t`` from ``torch.cuda.cudart()`` as an int (an enum member or an int, by torch version)."""
    return int(rc.value) if hasattr(rc, "value") else int(rc)


def host_register(address: int, nbytes: int) -> int:
    """Page-lock ``nbytes`` of host memory at ``address`` for DMA: 0, or the CUDA error (cleared, so torch's next
    call does not raise it). Raises where CUDA cannot be reached at all (e.g. initialised before a fork)."""
    import torch

    rc = error_code(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0))
    if rc != 0:
        clear_error()
    return rc


def host_unregister(address: int) -> int:
    """Undo :func:`host_register` of the memory at ``address``: 0, or the CUDA error (cleared)."""
    import torch

    rc = error_code(torch.cuda.cudart().cudaHostUnregister(address))
    if rc != 0:
        clear_error()
    return rc


__all__ = ["available", "clear_error", "error_code", "host_register", "host_unregister"]
