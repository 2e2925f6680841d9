"""FlexLLMGen-style runner: a PyTorch decoder (OPT, LLaMA/GQA) with its KV cache in bladed.

Entry point: ``python -m bladed.runner`` (console script ``bladed-runner`` =
``bladed.runner.main:main``).  The names below are imported on first use, so
that ``bladed-runner --help`` and its usage errors do not wait for torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "GenerationResult": "bladed.runner.generation", "Policy": "bladed.runner.generation",
    "Runner": "bladed.runner.generation",
    "BladedKV": "bladed.kvstore", "Geometry": "bladed.kvstore", "KVBackend": "bladed.kvstore",
    "MemoryKV": "bladed.kvstore",
    "DecoderModel": "bladed.runner.models", "ModelConfig": "bladed.runner.models",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'bladed.runner' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


__all__ = sorted(_HOMES)
