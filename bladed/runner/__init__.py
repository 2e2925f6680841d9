"""FlexLLMGen-style runner: a PyTorch decoder (OPT, LLaMA/GQA) with its KV cache in bladed.

Entry point: ``python -m bladed.runner`` (console script ``bladed-runner`` =
``bladed.runner.cli:main``).
"""

from bladed.runner.engine import GenerationResult, Policy, Runner
from bladed.runner.kvstore import BladedKV, Geometry, KVBackend, MemoryKV
from bladed.runner.models import DecoderModel, ModelConfig

__all__ = [
           "BladedKV",
           "DecoderModel",
           "GenerationResult",
           "Geometry",
           "KVBackend",
           "MemoryKV",
           "ModelConfig",
           "Policy",
           "Runner",
]
