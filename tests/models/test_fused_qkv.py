"""q, k and v projections of one format fused into one weight (what a GPU load does, so a decode step reads them
in one launch): the same logits and greedy text as the three separate weights, for the families built on
GQAttention, with biases (GLM-4.5, gpt-oss) and without; mixed formats stay separate."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata.config import EngineConfig, ExpertConfig
from strata.engine.engine import Engine
from strata.engine.loader import forward_all, load_model
from strata.engine.sampler import SamplingParams
from strata.layers import attention
from strata.quant import random_qtensor

IDS = [3, 17, 99, 4, 250, 31, 8, 77, 5, 600, 12, 40]


def _attns(lm):
    return [b.attn for b in lm.model.blocks if isinstance(getattr(b, "attn", None), attention.GQAttention)]


@pytest.mark.parametrize("family,qtype", [("qwen3moe", "q8_0"), ("glm4moe", "f32"), ("gpt_oss", "f32")])
def test_fused_qkv_gives_the_same_logits_and_text(hf_and_gguf, monkeypatch, family, qtype):
    _, path = hf_and_gguf(family, qtype)
    cfg = EngineConfig(device="cpu", dtype="float32", ctx_size=256, experts=ExpertConfig(mode="resident"))
    plain = load_model(str(path), cfg, with_tokenizer=False)
    assert _attns(plain) and all(a.wqkv is None for a in _attns(plain))  # a CPU load keeps them apart
    monkeypatch.setattr(attention, "FUSE_QKV_ON", ("cuda", "cpu"))
    fused = load_model(str(path), cfg, with_tokenizer=False)
    assert all(a.wqkv is not None for a in _attns(fused)), family
    a = _attns(fused)[0]
    assert a.wq.raw.data_ptr() == a.wqkv.raw.data_ptr()  # views of the one copy
    want, got = forward_all(plain, IDS), forward_all(fused, IDS)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
    sp = SamplingParams(temperature=0)
    assert list(Engine(fused, n_slots=1).generate(IDS, sp, 12)) == list(Engine(plain, n_slots=1).generate(IDS, sp, 12))


def test_weights_of_different_formats_are_not_fused(monkeypatch):
    monkeypatch.setattr(attention, "FUSE_QKV_ON", ("cpu",))
    wq, wk = random_qtensor(Q.Q8_0, (64, 64), 1), random_qtensor(Q.Q8_0, (32, 64), 2)
    assert attention.fuse_rows((wq, wk, random_qtensor(Q.Q4_K, (32, 256), 3)), (None,) * 3)[0] is None
    w, sizes = attention.fuse_rows((wq, wk, random_qtensor(Q.Q8_0, (32, 64), 3)), (None,) * 3)
    assert sizes == [64, 32, 32] and w.shape == (128, 64)
    assert attention.fuse_rows((wq, wk, random_qtensor(Q.Q8_0, (32, 64), 3)), (torch.zeros(64), None, None))[0] is None


def test_delta_net_input_projections_fused_give_the_same_logits_and_text(hf_and_gguf, monkeypatch):
    """Qwen3-Next: the recurrent layers' qkv, gate and ba as one weight, and the gated attention's q, k and v (one
    GEMV a step each on a GPU): the same logits and text."""
    from strata.layers.deltanet import GatedDeltaNet

    _, path = hf_and_gguf("qwen3next", "q8_0")
    cfg = EngineConfig(device="cpu", dtype="float32", ctx_size=256, experts=ExpertConfig(mode="resident"))

    def deltas(lm):
        return [b.attn for b in lm.model.blocks if isinstance(getattr(b, "attn", None), GatedDeltaNet)]

    plain = load_model(str(path), cfg, with_tokenizer=False)
    assert deltas(plain) and all(d.w_in is None for d in deltas(plain))
    monkeypatch.setattr(attention, "FUSE_QKV_ON", ("cuda", "cpu"))
    fused = load_model(str(path), cfg, with_tokenizer=False)
    d = deltas(fused)[0]
    assert d.w_in is not None and d.wqkv.raw.data_ptr() == d.w_in.raw.data_ptr()
    from strata.models.qwen3next import GatedAttention  # its gated attention layers: q (with gates), k, v as one

    gated = [b.attn for b in fused.model.blocks if isinstance(getattr(b, "attn", None), GatedAttention)]
    assert gated and all(a.wqkv is not None for a in gated)
    want, got = forward_all(plain, IDS), forward_all(fused, IDS)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
    sp = SamplingParams(temperature=0)
    assert list(Engine(fused, n_slots=2).generate(IDS, sp, 12)) == list(Engine(plain, n_slots=2).generate(IDS, sp, 12))


def test_swiglu_gate_and_up_fused_give_the_same_output(monkeypatch):
    """Dense layers and shared experts: gate and up as one weight (one GEMV a step on a GPU)."""
    from strata.layers.ffn import SwiGLU

    g, u, d = (random_qtensor(Q.Q8_0, s, i) for i, s in enumerate(((96, 64), (96, 64), (64, 96))))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    plain = SwiGLU(g, u, d)
    assert plain.gate_up is None
    monkeypatch.setattr(attention, "FUSE_QKV_ON", ("cpu",))
    fused = SwiGLU(g, u, d)
    assert fused.gate_up is not None and fused.sizes == [96, 96]
    assert torch.allclose(fused(x), plain(x), rtol=1e-5, atol=1e-5)
    assert SwiGLU(g, random_qtensor(Q.Q4_K, (96, 256), 4), d).gate_up is None  # (another format and width)
