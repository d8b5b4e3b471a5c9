"""strata vs transformers on tiny random-weight models of each family (float32, no downloads)."""

import pytest
import torch

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.loader import forward_all, load_model
from strata.engine.sampler import SamplingParams

FAMILIES = ["qwen3moe", "qwen3", "mixtral", "llama", "deepseek_v3", "deepseek_v3_noqlora", "glm4moe",
            "glm4moe_noqknorm", "gpt_oss", "qwen3next"]
CPU32 = dict(device="cpu", dtype="float32")


def _hf(hf_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def _prompt(n=64, vocab=1001, seed=1):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, hf_and_gguf):
    hf_dir, path = hf_and_gguf(family)
    lm = load_model(str(path), EngineConfig(**CPU32))
    ids = _prompt()
    ours = forward_all(lm, ids)
    with torch.no_grad():
        ref = _hf(hf_dir)(torch.tensor([ids])).logits[0].float()
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-4, f"{family}: max relative error {rel:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers(family, hf_and_gguf):
    hf_dir, path = hf_and_gguf(family)
    lm = load_model(str(path), EngineConfig(**CPU32))
    ids = _prompt(16, seed=2)
    # small prefill chunks so the chunked path and the decode path are both exercised
    ours = list(Engine(lm, prefill_chunk=5).generate(ids, SamplingParams(temperature=0), max_tokens=32))
    with torch.no_grad():
        out = _hf(hf_dir).generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                                   eos_token_id=None, pad_token_id=0)
    assert ours == out[0, len(ids):].tolist()


def test_chunked_prefill_equals_one_shot(hf_and_gguf):
    _, path = hf_and_gguf("qwen3moe")
    lm = load_model(str(path), EngineConfig(**CPU32))
    ids = _prompt(40, seed=3)
    a = list(Engine(lm, prefill_chunk=7).generate(ids, SamplingParams(temperature=0), max_tokens=8))
    b = list(Engine(lm, prefill_chunk=4096).generate(ids, SamplingParams(temperature=0), max_tokens=8))
    assert a == b
