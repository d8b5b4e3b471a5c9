"""The gated delta rule: the chunked form (prefill) equals the one-token recurrence (decode), from any start
state and for any split of a run, and both equal transformers' reference functions; the causal conv's state
carries a split run exactly."""

import pytest
import torch

from strata.layers.deltanet import causal_conv, delta_chunked, delta_step, l2norm


def _inputs(t, h, dk, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(t, h, dk, generator=g)) * dk ** -0.5
    k = l2norm(torch.randn(t, h, dk, generator=g))
    v = torch.randn(t, h, dv, generator=g)
    decay = -torch.rand(t, h, generator=g) * 2.0  # log decays <= 0
    beta = torch.rand(t, h, generator=g)
    s0 = torch.randn(h, dk, dv, generator=g) * 0.3
    return q, k, v, decay, beta, s0


def _sequential(q, k, v, g, beta, s0):
    s = s0.clone()
    outs = [delta_step(q[t], k[t], v[t], g[t], beta[t], s) for t in range(q.shape[0])]
    return torch.stack(outs), s


@pytest.mark.parametrize("t,chunk", [(1, 64), (7, 64), (64, 64), (70, 16), (33, 5)])
@pytest.mark.parametrize("h,dk,dv", [(3, 12, 20), (2, 7, 5)])
def test_chunked_equals_recurrent(t, chunk, h, dk, dv):
    q, k, v, g, beta, s0 = _inputs(t, h, dk, dv)
    o_ref, s_ref = _sequential(q, k, v, g, beta, s0)
    o, s = delta_chunked(q, k, v, g, beta, s0, chunk=chunk)
    assert torch.allclose(o, o_ref, atol=1e-5, rtol=1e-5)
    assert torch.allclose(s, s_ref, atol=1e-5, rtol=1e-5)
    assert o.shape == (t, h, dv)


def test_split_run_equals_whole_run():
    q, k, v, g, beta, s0 = _inputs(50, 2, 12, 20, seed=3)
    o_all, s_all = delta_chunked(q, k, v, g, beta, s0)
    o1, s1 = delta_chunked(q[:19], k[:19], v[:19], g[:19], beta[:19], s0)
    o2, s2 = delta_chunked(q[19:], k[19:], v[19:], g[19:], beta[19:], s1)
    assert torch.allclose(torch.cat([o1, o2]), o_all, atol=1e-5)
    assert torch.allclose(s2, s_all, atol=1e-5)


def test_matches_transformers_reference():
    mod = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    t, hk, r, dk, dv = 40, 2, 2, 12, 20
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, t, hk, dk, generator=gen), torch.randn(1, t, hk, dk, generator=gen)
    v = torch.randn(1, t, hk * r, dv, generator=gen)
    decay, beta = -torch.rand(1, t, hk * r, generator=gen), torch.rand(1, t, hk * r, generator=gen)
    ref, ref_state = mod.torch_chunk_gated_delta_rule(q, k, v, decay, beta, chunk_size=16, output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True)
    qq = (l2norm(q[0]) * dk ** -0.5).repeat_interleave(r, dim=1)
    kk = l2norm(k[0]).repeat_interleave(r, dim=1)
    o, s = delta_chunked(qq, kk, v[0], decay[0], beta[0], torch.zeros(hk * r, dk, dv))
    assert torch.allclose(o, ref[0], atol=1e-5)
    assert torch.allclose(s, ref_state[0], atol=1e-5)


def test_causal_conv_state_carries_a_split_run():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(11, 6, generator=gen), torch.randn(6, 4, generator=gen)
    whole, end = causal_conv(x, torch.zeros(3, 6), w)
    a, mid = causal_conv(x[:5], torch.zeros(3, 6), w)
    b, end2 = causal_conv(x[5:], mid, w)
    assert torch.allclose(torch.cat([a, b]), whole, atol=1e-6) and torch.equal(end, end2)
    # against torch's depthwise conv1d (left zero padding = causal)
    ref = torch.nn.functional.conv1d(x.T.unsqueeze(0), w.unsqueeze(1), padding=3, groups=6)[0, :, :11].T
    assert torch.allclose(whole, torch.nn.functional.silu(ref), atol=1e-6)
