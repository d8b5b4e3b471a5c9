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
