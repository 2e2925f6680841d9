"""Decoder models for the runner: OPT and LLaMA-style (grouped-query attention).

The layer maths follows transformers' ``sdpa`` attention path of the decoder
families (its default) operation by operation, so with the same weights the
runner gives transformers' greedy tokens and its logits to within a few ulp
(not bit for bit: matmul kernels differ by CPU and by call shape). Weights
are kept in a flat dict keyed by the Hugging Face parameter names, so a
checkpoint directory, a converted GGUF file and an in-memory HF model all
load the same way. The runner owns the KV cache: a layer's forward takes the
past K/V (``[batch, kv_heads, past, head_dim]``) and returns the new tokens'
K/V alongside the hidden states.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F

Arch = Literal["opt", "llama"]

_ACTS: dict[str, Callable[..., torch.Tensor]] = {
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
}


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder. ``num_kv_heads < num_heads`` is grouped-query attention."""

    arch: Arch
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    max_positions: int = 2048
    activation: str = "relu"
    # OPT
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int | None = None
    enable_bias: bool = True
    layer_norm_eps: float = 1e-5
    # LLaMA
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        """K+V bytes of one token of one sequence across all layers, per dtype byte."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def weight_bytes(self, dtype_bytes: int) -> int:
        h, f, v = self.hidden_size, self.ffn_dim, self.vocab_size
        kvh = self.num_kv_heads * self.head_dim
        per_layer = 2 * h * h + 2 * h * kvh + (2 if self.arch == "opt" else 3) * h * f
        return dtype_bytes * (self.num_layers * per_layer + v * h * (1 if self.tie_word_embeddings else 2))

    @classmethod
    def from_hf(cls, cfg: Any, name: str | None = None) -> ModelConfig:
        """From a transformers ``PretrainedConfig`` (or anything with the same attributes)."""
        mt = getattr(cfg, "model_type", "")
        label = name or getattr(cfg, "_name_or_path", "") or mt
        if mt == "opt":
            heads = cfg.num_attention_heads
            return cls(
                arch="opt", name=label, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                num_layers=cfg.num_hidden_layers, num_heads=heads, num_kv_heads=heads,
                head_dim=cfg.hidden_size // heads, ffn_dim=cfg.ffn_dim,
                max_positions=cfg.max_position_embeddings, activation=cfg.activation_function,
                do_layer_norm_before=cfg.do_layer_norm_before,
                word_embed_proj_dim=(cfg.word_embed_proj_dim
                                     if cfg.word_embed_proj_dim != cfg.hidden_size else None),
                enable_bias=getattr(cfg, "enable_bias", True),
                bos_token_id=cfg.bos_token_id, eos_token_id=_first(cfg.eos_token_id),
            )
        if mt in ("llama", "mistral", "qwen2") or hasattr(cfg, "rms_norm_eps"):
            rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
            rope_type = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
            if rope_type != "default":
                raise ValueError(f"rope type {rope_type!r} is not supported by the runner")
            theta = rope.get("rope_theta") if rope else None
            if theta is None:
                theta = getattr(cfg, "rope_theta", 10000.0)
            heads = cfg.num_attention_heads
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
            return cls(
                arch="llama", name=label, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                num_layers=cfg.num_hidden_layers, num_heads=heads,
                num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads, head_dim=head_dim,
                ffn_dim=cfg.intermediate_size, max_positions=cfg.max_position_embeddings,
                activation=cfg.hidden_act, rms_norm_eps=cfg.rms_norm_eps, rope_theta=float(theta or 10000.0),
                attention_bias=getattr(cfg, "attention_bias", False),
                mlp_bias=getattr(cfg, "mlp_bias", False),
                tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
                bos_token_id=cfg.bos_token_id, eos_token_id=_first(cfg.eos_token_id),
            )
        raise ValueError(f"model type {mt!r} is not supported (OPT and LLaMA-style decoders are)")


def _first(x: Any) -> int | None:
    if isinstance(x, list | tuple):
        return int(x[0]) if x else None
    return None if x is None else int(x)


# FlexLLMGen's OPT family (dummy weights for any of these sizes).
OPT_SIZES: dict[str, tuple[int, int, int]] = {  # hidden, layers, heads
    "opt-125m": (768, 12, 12),
    "opt-1.3b": (2048, 24, 32),
    "opt-2.7b": (2560, 32, 32),
    "opt-6.7b": (4096, 32, 32),
    "opt-13b": (5120, 40, 40),
    "opt-30b": (7168, 48, 56),
    "opt-66b": (9216, 64, 72),
}


def opt_config(name: str) -> ModelConfig:
    """The shape of a published OPT size (``facebook/opt-6.7b`` or ``opt-6.7b``)."""
    key = name.split("/")[-1].lower()
    if key not in OPT_SIZES:
        raise KeyError(f"unknown OPT size {name!r}; known: {', '.join(OPT_SIZES)}")
    h, layers, heads = OPT_SIZES[key]
    return ModelConfig(arch="opt", name=f"facebook/{key}", vocab_size=50272, hidden_size=h,
                       num_layers=layers, num_heads=heads, num_kv_heads=heads, head_dim=h // heads,
                       ffn_dim=4 * h, max_positions=2048, bos_token_id=2, eos_token_id=2)


def dummy_weights(cfg: ModelConfig, dtype: torch.dtype, seed: int = 0,
                  device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Random weights for any size (FlexLLMGen's dummy-weights idea): normal(0, 0.02), norms at 1.

    Made on ``device`` (default: the CPU) by a generator of that device seeded with ``seed``: the same weights
    for the same seed, device type and torch version. On CUDA a model of billions of parameters is made in place,
    not drawn by the CPU's generator and copied over; the values differ from the CPU's."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    gen = torch.Generator(device=dev).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=dev) * 0.02).to(dtype)

    h, f, kvh = cfg.hidden_size, cfg.ffn_dim, cfg.num_kv_heads * cfg.head_dim
    qh = cfg.num_heads * cfg.head_dim
    if cfg.arch == "opt":
        p = "model.decoder."
        emb = cfg.word_embed_proj_dim or h
        out[p + "embed_tokens.weight"] = rnd(cfg.vocab_size, emb)
        out[p + "embed_positions.weight"] = rnd(cfg.max_positions + 2, h)
        if cfg.word_embed_proj_dim:
            out[p + "project_in.weight"] = rnd(h, emb)
            out[p + "project_out.weight"] = rnd(emb, h)
        for i in range(cfg.num_layers):
            q = f"{p}layers.{i}."
            for n, (o, ii) in {"q_proj": (qh, h), "k_proj": (kvh, h), "v_proj": (kvh, h),
                               "out_proj": (h, qh), "fc1": (f, h), "fc2": (h, f)}.items():
                out[f"{q}self_attn.{n}.weight" if n.endswith("proj") else f"{q}{n}.weight"] = rnd(o, ii)
                if cfg.enable_bias:
                    out[f"{q}self_attn.{n}.bias" if n.endswith("proj") else f"{q}{n}.bias"] = rnd(o)
            for n in ("self_attn_layer_norm", "final_layer_norm"):
                out[f"{q}{n}.weight"] = torch.ones(h, dtype=dtype, device=dev)
                out[f"{q}{n}.bias"] = torch.zeros(h, dtype=dtype, device=dev)
        if cfg.do_layer_norm_before:
            out[p + "final_layer_norm.weight"] = torch.ones(h, dtype=dtype, device=dev)
            out[p + "final_layer_norm.bias"] = torch.zeros(h, dtype=dtype, device=dev)
        out["lm_head.weight"] = out[p + "embed_tokens.weight"]
    else:
        out["model.embed_tokens.weight"] = rnd(cfg.vocab_size, h)
        for i in range(cfg.num_layers):
            q = f"model.layers.{i}."
            for n, (o, ii) in {"q_proj": (qh, h), "k_proj": (kvh, h), "v_proj": (kvh, h),
                               "o_proj": (h, qh)}.items():
                out[f"{q}self_attn.{n}.weight"] = rnd(o, ii)
            for n, (o, ii) in {"gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}.items():
                out[f"{q}mlp.{n}.weight"] = rnd(o, ii)
            out[f"{q}input_layernorm.weight"] = torch.ones(h, dtype=dtype, device=dev)
            out[f"{q}post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype, device=dev)
        out["model.norm.weight"] = torch.ones(h, dtype=dtype, device=dev)
        out["lm_head.weight"] = out["model.embed_tokens.weight"] if cfg.tie_word_embeddings \
            else rnd(cfg.vocab_size, h)
    return out


def _lin(x: torch.Tensor, w: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    return F.linear(x, w[name + ".weight"], w.get(name + ".bias"))


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    in_dtype = x.dtype
    x = x.to(torch.float32)
    var = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(var + eps)
    return weight * x.to(in_dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the ``s`` newest positions ``q`` (``[batch, heads, s, head_dim]``) over ``keys`` /
    ``values`` (``[batch, kv_heads, total, head_dim]``, any strides: the KV read back is tokens-first),
    as transformers' ``sdpa`` attention computes it (``scaled_dot_product_attention``, the query heads of a
    KV head attending to it without a copy of the KV per query head, ``enable_gqa``).

    A decode step (``s == 1``) and a prefill from position 0 (``s == total``, ``is_causal``) take no mask,
    as transformers passes none there; a prefill after a reused prefix masks each new position to the
    positions up to its own (bottom-right aligned). The eager form (``matmul``, mask, ``softmax``) with the
    KV repeated per query head spent 54% of a SmolLM2 decode step (batch 8, 1024 tokens) copying the KV,
    and a prefill materialises ``[batch, heads, s, total]`` scores several times over.
    """
    s, total = q.shape[2], keys.shape[2]
    gqa = q.shape[1] != keys.shape[1]
    if s == 1 or s == total:
        return F.scaled_dot_product_attention(q, keys, values, is_causal=s > 1, scale=scale, enable_gqa=gqa)
    allowed = torch.ones(s, total, dtype=torch.bool, device=q.device).tril(diagonal=total - s)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=scale, enable_gqa=gqa)


class DecoderModel:
    """Weights + the per-layer maths. Stateless with respect to the KV cache."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 inv_freq: torch.Tensor | None = None) -> None:
        self.cfg = cfg
        self.weights = weights
        self.dtype = next(iter(weights.values())).dtype
        if cfg.arch == "llama":
            if inv_freq is None:
                d = cfg.head_dim
                inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
            self.inv_freq = inv_freq.to(torch.float32)
        if "lm_head.weight" not in weights:
            emb = "model.decoder.embed_tokens.weight" if cfg.arch == "opt" else "model.embed_tokens.weight"
            weights["lm_head.weight"] = weights[emb]
        self._layer_prefix = "model.decoder.layers." if cfg.arch == "opt" else "model.layers."

    @classmethod
    def from_hf(cls, model: Any, name: str | None = None) -> DecoderModel:
        """Share the tensors of a loaded transformers model (no copy)."""
        cfg = ModelConfig.from_hf(model.config, name)
        weights = {k: v.detach() for k, v in model.state_dict().items()}
        inv = None
        for k, b in model.named_buffers():
            if k.endswith("rotary_emb.inv_freq"):
                inv = b.detach()
        return cls(cfg, weights, inv)

    def to(self, device: torch.device | str) -> DecoderModel:
        new = DecoderModel.__new__(DecoderModel)
        new.__dict__.update(self.__dict__)
        new.weights = {k: v.to(device) for k, v in self.weights.items()}
        if self.cfg.arch == "llama":
            new.inv_freq = self.inv_freq.to(device)
        return new

    def layer_weights(self, j: int) -> dict[str, torch.Tensor]:
        """Layer ``j``'s tensors keyed by their names inside the layer."""
        p = f"{self._layer_prefix}{j}."
        return {k[len(p):]: v for k, v in self.weights.items() if k.startswith(p)}

    # -- embeddings / head -------------------------------------------------
    def embed(self, ids: torch.Tensor, pos0: int) -> torch.Tensor:
        w = self.weights
        if self.cfg.arch == "opt":
            x = F.embedding(ids, w["model.decoder.embed_tokens.weight"])
            pos = torch.arange(pos0, pos0 + ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
            pe = F.embedding(pos + 2, w["model.decoder.embed_positions.weight"])
            if "model.decoder.project_in.weight" in w:
                x = _lin(x, w, "model.decoder.project_in")
            return x + pe
        return F.embedding(ids, w["model.embed_tokens.weight"])

    def head(self, h: torch.Tensor, *, every_position: bool = False) -> torch.Tensor:
        """Logits of the last position: ``[batch, vocab]`` (``every_position``: of each, ``[batch, s, vocab]``)."""
        w, cfg = self.weights, self.cfg
        if cfg.arch == "opt":
            if "model.decoder.final_layer_norm.weight" in w:
                h = F.layer_norm(h, (h.shape[-1],), w["model.decoder.final_layer_norm.weight"],
                                 w["model.decoder.final_layer_norm.bias"], cfg.layer_norm_eps)
            if "model.decoder.project_out.weight" in w:
                h = _lin(h, w, "model.decoder.project_out")
        else:
            h = _rms(h, w["model.norm.weight"], cfg.rms_norm_eps)
        if every_position:
            return F.linear(h, w["lm_head.weight"])
        return F.linear(h[:, -1:, :], w["lm_head.weight"])[:, -1, :]

    # -- one decoder layer -------------------------------------------------
    def qkv(self, lw: Mapping[str, torch.Tensor], h: torch.Tensor, pos0: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pre-attention half: returns (residual-input, q, k_new, v_new), heads-first layout."""
        cfg = self.cfg
        b, s, _ = h.shape
        if cfg.arch == "opt":
            x = h
            if cfg.do_layer_norm_before:
                x = F.layer_norm(x, (x.shape[-1],), lw["self_attn_layer_norm.weight"],
                                 lw["self_attn_layer_norm.bias"], cfg.layer_norm_eps)
            q = _lin(x, lw, "self_attn.q_proj") * (cfg.head_dim ** -0.5)
            q = q.view(b, -1, cfg.num_heads, cfg.head_dim).transpose(1, 2)
            k = _lin(x, lw, "self_attn.k_proj").view(b, -1, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
            v = _lin(x, lw, "self_attn.v_proj").view(b, -1, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
            return h, q, k, v
        x = _rms(h, lw["input_layernorm.weight"], cfg.rms_norm_eps)
        shape = (b, s, -1, cfg.head_dim)
        q = _lin(x, lw, "self_attn.q_proj").view(shape).transpose(1, 2)
        k = _lin(x, lw, "self_attn.k_proj").view(shape).transpose(1, 2)
        v = _lin(x, lw, "self_attn.v_proj").view(shape).transpose(1, 2)
        pos = torch.arange(pos0, pos0 + s, device=h.device)[None, :].expand(b, s)
        freqs = pos[..., None].float() * self.inv_freq.to(device=h.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(h.dtype).unsqueeze(1)
        sin = emb.sin().to(h.dtype).unsqueeze(1)
        q = (q * cos) + (_rotate_half(q) * sin)
        k = (k * cos) + (_rotate_half(k) * sin)
        return h, q, k, v

    @property
    def attention_scale(self) -> float:
        """The softmax scale of ``q . k`` (OPT folds it into its query projection)."""
        return 1.0 if self.cfg.arch == "opt" else self.cfg.head_dim ** -0.5

    def attend_mlp(self, lw: Mapping[str, torch.Tensor], h: torch.Tensor, q: torch.Tensor,
                   keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Attention over the full ``keys``/``values`` (past + new), then the MLP half."""
        return self.after_attention(lw, h, attention(q, keys, values, scale=self.attention_scale))

    def after_attention(self, lw: Mapping[str, torch.Tensor], h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The layer after its attention: ``out`` (``[batch, heads, s, head_dim]``) projected and added to the
        residual ``h``, then the MLP half."""
        cfg = self.cfg
        b, s, _ = h.shape
        out = out.transpose(1, 2).reshape(b, s, -1)
        act = _ACTS[cfg.activation]
        if cfg.arch == "opt":
            out = _lin(out, lw, "self_attn.out_proj")
            h = h + out
            if not cfg.do_layer_norm_before:
                h = F.layer_norm(h, (h.shape[-1],), lw["self_attn_layer_norm.weight"],
                                 lw["self_attn_layer_norm.bias"], cfg.layer_norm_eps)
            shape = h.shape
            h2 = h.reshape(-1, h.size(-1))
            x = h2
            if cfg.do_layer_norm_before:
                x = F.layer_norm(x, (x.shape[-1],), lw["final_layer_norm.weight"],
                                 lw["final_layer_norm.bias"], cfg.layer_norm_eps)
            x = _lin(act(_lin(x, lw, "fc1")), lw, "fc2")
            h = (h2 + x).view(shape)
            if not cfg.do_layer_norm_before:
                h = F.layer_norm(h, (h.shape[-1],), lw["final_layer_norm.weight"],
                                 lw["final_layer_norm.bias"], cfg.layer_norm_eps)
            return h
        out = _lin(out, lw, "self_attn.o_proj")
        h = h + out
        x = _rms(h, lw["post_attention_layernorm.weight"], cfg.rms_norm_eps)
        x = _lin(act(_lin(x, lw, "mlp.gate_proj")) * _lin(x, lw, "mlp.up_proj"), lw, "mlp.down_proj")
        return h + x


def tiny_config(arch: Arch, *, layers: int = 3, hidden: int = 64, heads: int = 4, kv_heads: int | None = None,
                vocab: int = 128, ffn: int | None = None, **kw: Any) -> ModelConfig:
    """A small config for tests and smoke runs."""
    kvh = kv_heads if kv_heads is not None else (heads if arch == "opt" else max(1, heads // 2))
    base = ModelConfig(arch=arch, name=f"tiny-{arch}", vocab_size=vocab, hidden_size=hidden, num_layers=layers,
                       num_heads=heads, num_kv_heads=kvh, head_dim=hidden // heads,
                       ffn_dim=ffn or 4 * hidden if arch == "opt" else ffn or 2 * hidden,
                       max_positions=512, activation="relu" if arch == "opt" else "silu",
                       bos_token_id=1, eos_token_id=None)
    return replace(base, **kw)


def hf_config(cfg: ModelConfig) -> Any:
    """The matching transformers config (for the oracle and for the HF cache)."""
    import transformers

    if cfg.arch == "opt":
        return transformers.OPTConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads, ffn_dim=cfg.ffn_dim, max_position_embeddings=cfg.max_positions,
            activation_function=cfg.activation, do_layer_norm_before=cfg.do_layer_norm_before,
            word_embed_proj_dim=cfg.word_embed_proj_dim or cfg.hidden_size, enable_bias=cfg.enable_bias,
            dropout=0.0, attention_dropout=0.0, bos_token_id=cfg.bos_token_id or 2,
            eos_token_id=cfg.eos_token_id if cfg.eos_token_id is not None else 2, pad_token_id=1,
        )
    return transformers.LlamaConfig(  # type: ignore[call-arg,unused-ignore]
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        intermediate_size=cfg.ffn_dim, max_position_embeddings=cfg.max_positions, hidden_act=cfg.activation,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, attention_bias=cfg.attention_bias,
        mlp_bias=cfg.mlp_bias, tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id or 1, eos_token_id=cfg.eos_token_id if cfg.eos_token_id is not None else 2,
    )


def kv_bytes(cfg: ModelConfig, batch: int, tokens: int, dtype_bytes: int) -> int:
    return cfg.kv_bytes_per_token * batch * tokens * dtype_bytes


def gib(n: float) -> float:
    return n / float(1 << 30)


__all__ = ["OPT_SIZES", "DecoderModel", "ModelConfig", "dummy_weights", "gib", "hf_config", "kv_bytes",
           "opt_config", "tiny_config"]
