"""A prompt chunk's attention with SDPA's lower-right causal bias (strata.layers.attention._causal_mask) equals the
materialized [n, L] mask it replaces: a chunk of n queries at the end of L keys, query i seeing keys 0 .. L - n + i,
with GQA (enable_gqa) and with MLA's one latent head; on the CPU (where it is off: SDPA materializes it there) and,
marked gpu, on CUDA in bf16
(where it is taken once this passes: attention.CAUSAL_BIAS_ON)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias

from strata.kv.cache import Segment
from strata.layers import attention
from strata.ops.reference import gqa_attention

CASES = [(7, 7, 8, 2, 16), (5, 40, 8, 2, 16), (300, 1000, 32, 4, 128), (64, 130, 16, 1, 64)]  # n, L, H, Hkv, D


def _bool_mask(n: int, L: int, device) -> torch.Tensor:
    q = torch.arange(L - n, L, device=device).unsqueeze(1)
    return torch.arange(L, device=device).unsqueeze(0) <= q


def _check(device, dtype, tol):
    g = torch.Generator().manual_seed(0)
    for n, L, H, hkv, D in CASES:
        q = torch.randn(n, H, D, generator=g).to(device, dtype)
        ks = torch.randn(L, hkv, D, generator=g).to(device, dtype)
        vs = torch.randn(L, hkv, D, generator=g).to(device, dtype)
        bias = attention._causal_mask(Segment(0, L - n, n), device)
        assert isinstance(bias, CausalBias)
        got = gqa_attention(q, ks, vs, bias, D ** -0.5)
        want = gqa_attention(q, ks, vs, _bool_mask(n, L, device), D ** -0.5)
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        assert err <= tol, (n, L, H, hkv, D, err)
        # MLA: one latent "head" shared by every query head, values a prefix of the keys' columns
        lat = torch.randn(1, 1, L, D, generator=g).to(device, dtype)
        qs = q.transpose(0, 1).unsqueeze(0)
        o1 = F.scaled_dot_product_attention(qs, lat, lat[..., : D // 2], attn_mask=bias, enable_gqa=True)
        o2 = F.scaled_dot_product_attention(qs, lat, lat[..., : D // 2], attn_mask=_bool_mask(n, L, device),
                                            enable_gqa=True)
        assert ((o1.float() - o2.float()).abs().max() / o2.float().abs().max()).item() <= tol


def test_the_chunk_bias_equals_the_mask_on_the_cpu(monkeypatch):
    assert "cpu" not in attention.CAUSAL_BIAS_ON  # (a materialized mask there: SDPA would make the same one)
    monkeypatch.setattr(attention, "CAUSAL_BIAS_ON", frozenset({"cpu", "cuda"}))
    _check(torch.device("cpu"), torch.float32, 1e-5)


@pytest.mark.gpu
def test_the_chunk_bias_equals_the_mask_on_cuda(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setattr(attention, "CAUSAL_BIAS_ON", frozenset({"cpu", "cuda"}))
    _check(torch.device("cuda"), torch.bfloat16, 2e-2)
