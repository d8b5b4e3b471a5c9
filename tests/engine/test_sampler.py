"""Sampler semantics against direct reference computations."""

import math

import pytest
import torch

from strata.engine.sampler import SamplingParams, apply_penalties, sample


def _dist(logits, p, n=4000, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(logits.shape[0])
    for _ in range(n):
        counts[sample(logits, p, generator=g)] += 1
    return counts / n


def test_greedy_is_argmax():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    assert sample(logits, SamplingParams(temperature=0)).item() == logits.argmax().item()


def test_top_k_only_top_tokens():
    logits = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])
    d = _dist(logits, SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0))
    assert d[2:].sum() == 0 and d[0] > d[1] > 0
    # the kept mass is renormalised exactly as softmax over the top 2
    ref = torch.softmax(logits[:2], 0)
    assert abs(d[0].item() - ref[0].item()) < 0.03


def test_top_p_keeps_smallest_prefix():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    d = _dist(logits, SamplingParams(temperature=1.0, top_k=0, top_p=0.75, min_p=0.0))
    assert d[2] == 0 and d[3] == 0  # 0.5 + 0.3 reaches 0.75
    d = _dist(logits, SamplingParams(temperature=1.0, top_k=0, top_p=0.85, min_p=0.0))
    assert d[2] > 0 and d[3] == 0


def test_min_p_relative_to_max():
    probs = torch.tensor([0.6, 0.3, 0.07, 0.03])
    d = _dist(probs.log(), SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1))
    assert d[3] == 0 and d[2] > 0  # 0.03 < 0.06 <= 0.07


def test_temperature_sharpens():
    logits = torch.tensor([1.0, 0.0])
    hot = _dist(logits, SamplingParams(temperature=2.0, top_k=0, top_p=1.0, min_p=0.0))
    cold = _dist(logits, SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0))
    assert abs(hot[0].item() - 1 / (1 + math.exp(-0.5))) < 0.03
    assert abs(cold[0].item() - 1 / (1 + math.exp(-2.0))) < 0.03


def test_penalties_match_formulas():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    recent = torch.tensor([0, 1, 1])
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, recent, p)
    # llama.cpp: positive logits divided, negative multiplied; then OpenAI presence/frequency
    expect = torch.tensor([2.0 / 2 - 0.25 - 0.5, -1.0 * 2 - 0.5 - 0.5, 0.5, 3.0])
    assert torch.allclose(out, expect)


def test_same_seed_same_tokens():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(3))
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    a = [sample(logits, p, generator=torch.Generator().manual_seed(7)).item() for _ in range(1)]
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    a = [sample(logits, p, generator=g1).item() for _ in range(20)]
    b = [sample(logits, p, generator=g2).item() for _ in range(20)]
    assert a == b and len(set(a)) > 1


def test_invalid_params():
    from strata import StrataError

    with pytest.raises(StrataError):
        SamplingParams(top_p=0.0).validate()


def test_the_draws_uniform_is_the_same_bits_on_the_device():
    """position_uniform (host integers) and position_uniform_t (int64 tensors, wrapping products) agree bit for
    bit, over seeds and positions near the int64 limits; the values lie in [0, 1) and look uniform."""
    from strata.engine.sampler import position_uniform, position_uniform_t

    seeds = [0, 1, 7, 2**62 - 1, 123456789, 2**40 + 3]
    pos = list(range(0, 50)) + [2**31 - 1, 10**9]
    host = torch.tensor([[position_uniform(s, p) for p in pos] for s in seeds], dtype=torch.float64)
    dev = position_uniform_t(torch.tensor(seeds)[:, None], torch.tensor(pos)[None, :])
    assert torch.equal(host, dev)
    u = torch.tensor([position_uniform(5, p) for p in range(20000)])
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01
    assert abs((u < 0.1).float().mean().item() - 0.1) < 0.01


def test_draws_at_uniform_numbers_follow_the_kept_distribution():
    """The inverse-CDF draw at u: every u gives a kept token, the tokens in proportion to their kept mass, the
    same token for the same u, and a row drawn in a batch equals it drawn alone."""
    from strata.engine.sampler import sample_rows

    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)) * 2
    p = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05)
    u = torch.rand(3, 4000, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for r in range(3):
        toks = torch.stack([sample_rows(logits[r:r + 1].expand(500, -1), p, u[r, i:i + 500])
                            for i in range(0, 4000, 500)]).view(-1)
        kept = torch.softmax(logits[r] / 0.9, 0)
        kth = torch.topk(kept, 20).values[-1]
        kept = torch.where(kept >= kth, kept, torch.zeros(()))
        sp, si = kept.sort(descending=True)
        kept = kept.scatter(0, si, sp.masked_fill((sp.cumsum(0) - sp) > 0.9, 0.0))
        kept = kept.masked_fill(kept < kept.max() * 0.05, 0.0)
        kept = kept / kept.sum()
        freq = torch.bincount(toks, minlength=64).double() / toks.numel()
        assert freq[kept == 0].sum() == 0
        assert (freq - kept.double()).abs().max() < 0.03
        one = sample(logits[r], p, u=float(u[r, 7]))
        assert one.item() == toks[7].item()
