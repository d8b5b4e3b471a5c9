"""The parity tests on CUDA (run on the GPU machine): float32 on the GPU matches transformers on the CPU."""

import pytest
import torch

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.loader import forward_all, load_model
from strata.engine.sampler import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["qwen3moe", "mixtral", "deepseek_v3", "glm4moe", "qwen3next"])
def test_cuda_logits_match_transformers(family, hf_and_gguf):
    from transformers import AutoModelForCausalLM

    hf_dir, path = hf_and_gguf(family)
    lm = load_model(str(path), EngineConfig(device="cuda", dtype="float32"))
    ids = torch.randint(0, 1001, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = forward_all(lm, ids).cpu()
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)(torch.tensor([ids])).logits[0]
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-4, rel
    cpu = list(Engine(load_model(str(path), EngineConfig(device="cpu", dtype="float32"))).generate(
        ids[:16], SamplingParams(temperature=0), 32))
    gpu = list(Engine(lm).generate(ids[:16], SamplingParams(temperature=0), 32))
    assert cpu == gpu


@pytest.mark.parametrize("fmt", ["q8_0", "bf16"])
def test_cuda_bf16_compute_close_to_float32(fmt, hf_and_gguf):
    _, path = hf_and_gguf("qwen3moe", fmt)
    ids = list(range(1, 49))
    a = forward_all(load_model(str(path), EngineConfig(device="cuda", dtype="bfloat16")), ids).float().cpu()
    b = forward_all(load_model(str(path), EngineConfig(device="cpu", dtype="float32")), ids)
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    assert top1 >= 0.9, top1
