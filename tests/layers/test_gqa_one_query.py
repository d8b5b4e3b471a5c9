"""GQA attention of one segment (`strata.layers.attention._gqa`): the one-token path regroups the query heads
per KV head instead of asking SDPA for enable_gqa; it must equal SDPA's own GQA (repeat_interleave semantics),
with and without the fixed-window mask of the static decode step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strata.layers.attention import _gqa, _window_mask


def _reference(q, ks, vs, mask, scale):
    """q [n, H, D], ks/vs [L, Hkv, D] -> [n, H, Dv] in float64 through SDPA's math (enable_gqa)."""
    qs, kt, vt = (t.double().transpose(0, 1).unsqueeze(0) for t in (q, ks, vs))
    o = F.scaled_dot_product_attention(qs, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def _case(n, H, hkv, L, D, Dv, dev, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, H, D, generator=g).to(dev, dtype)
    ks = torch.randn(L, hkv, D, generator=g).to(dev, dtype)
    vs = torch.randn(L, hkv, Dv, generator=g).to(dev, dtype)
    return q, ks, vs


@pytest.mark.parametrize("H,hkv", [(8, 2), (6, 6), (5, 1)])
@pytest.mark.parametrize("masked", [False, True])
def test_one_token_regrouped_equals_sdpa_gqa(H, hkv, masked):
    q, ks, vs = _case(1, H, hkv, 37, 16, 12, "cpu", torch.float32, H * 10 + hkv)
    # the static decode step's mask [1, L]: keys past position 20 are stale
    mask = _window_mask(37, torch.tensor([20]), torch.float32) if masked else None
    out = _gqa(q, ks, vs, mask, 0.25)
    ref = _reference(q, ks, vs, (torch.arange(37) <= 20).unsqueeze(0) if masked else None, 0.25)
    assert out.shape == (1, H, 12)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    if masked:  # the stale keys really are ignored
        ks2, vs2 = ks.clone(), vs.clone()
        ks2[21:], vs2[21:] = 100.0, -100.0
        torch.testing.assert_close(_gqa(q, ks2, vs2, mask, 0.25), out)


def test_several_tokens_keep_the_causal_path():
    q, ks, vs = _case(4, 8, 2, 9, 16, 16, "cpu", torch.float32, 3)
    mask = torch.arange(9).unsqueeze(0) <= torch.arange(5, 9).unsqueeze(1)  # [4, 9]
    torch.testing.assert_close(_gqa(q, ks, vs, mask, 0.25).double(), _reference(q, ks, vs, mask, 0.25),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True])
def test_one_token_on_cuda_bf16(masked):
    """Qwen3-30B-A3B shapes: 32 query heads over 4 KV heads of 128, a 1,000-key prefix."""
    q, ks, vs = _case(1, 32, 4, 1000, 128, 128, "cuda", torch.bfloat16, 7)
    pos = torch.tensor([700], device="cuda")
    out = _gqa(q, ks, vs, _window_mask(1000, pos, torch.bfloat16) if masked else None, 128 ** -0.5)
    ref = _reference(q, ks, vs, (torch.arange(1000, device="cuda") <= pos).unsqueeze(0) if masked else None,
                     128 ** -0.5)
    assert out.dtype == torch.bfloat16
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 2 ** -7
