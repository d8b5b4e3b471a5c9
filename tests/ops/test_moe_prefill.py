"""The grouped prefill expert FFN against the per-expert loop (`resident.expert_loop`) on the CPU."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata.experts.resident import ExpertWeights, ResidentExperts, combine, expert_loop
from strata.ops import moe_prefill
from strata.ops.moe_prefill import grouped_expert_ffn
from strata.quant import random_qtensor

pytestmark = pytest.mark.exact_cpu  # float oracles: CPU qmatmul stays the float32 reference


def _experts(qg, qd, E, d, ff, seed) -> ExpertWeights:
    g, u = (random_qtensor(qg, (E, ff, d), seed + i) for i in range(2))
    return ExpertWeights(g, u, random_qtensor(qd, (E, d, ff), seed + 2))


def _ids(N, k, E, gen, *, hog: int | None = None, unused=()) -> torch.Tensor:
    """Random distinct choices per token among experts not in `unused`; `hog` (if given) is every token's
    first choice."""
    allowed = torch.tensor([e for e in range(E) if e not in unused and e != hog])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:k]] for _ in range(N)])
    if hog is not None:
        ids[:, 0] = hog
    return ids  # [N, k]


def _check(ew, x, ids):
    y = grouped_expert_ffn(x, ew.gate, ew.up, ew.down, ids)
    ref = expert_loop(ew, x, ids)
    assert y.shape == ref.shape == (*ids.shape, x.shape[1]) and y.dtype == torch.float32
    rel = ((y - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()  # worst (token, choice) pair
    assert rel < 1e-5, rel
    return y


@pytest.mark.parametrize("qg,qd", [(Q.Q4_K, Q.Q6_K), (Q.Q6_K, Q.Q4_K), (Q.Q8_0, Q.Q8_0), (Q.F32, Q.Q8_0)],
                         ids=lambda q: q.name)
def test_grouped_matches_the_loop(qg, qd):
    E, d, ff = 6, 256, 96 if qd == Q.Q8_0 else 256
    gen = torch.Generator().manual_seed(int(qg))
    ew = _experts(qg, qd, E, d, ff, int(qg) * 10)
    x = torch.randn(9, d, generator=gen)
    # expert 5 takes every token, experts 1 and 3 none
    _check(ew, x, _ids(9, 3, E, gen, hog=5, unused=(1, 3)))
    _check(ew, x[:1], _ids(1, 2, E, gen))  # one token


def test_small_budgets_split_into_batches(monkeypatch):
    E, d, ff = 16, 64, 96
    ew = _experts(Q.Q8_0, Q.Q8_0, E, d, ff, 5)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, d, generator=gen)
    ids = _ids(40, 4, E, gen, hog=3, unused=(0, 7, 9))
    full = _check(ew, x, ids)
    calls = []
    real = moe_prefill._dequant
    monkeypatch.setattr(moe_prefill, "_dequant", lambda w, e, dt: calls.append(e.numel()) or real(w, e, dt))
    # weights: at most 3 experts per batch; activations: the hog (40 tokens) alone
    monkeypatch.setattr(moe_prefill, "CPU_WEIGHT_BYTES", 3 * ff * d * 4)
    monkeypatch.setattr(moe_prefill, "ACT_BYTES", 40 * ff * 4 + 1)
    y = _check(ew, x, ids)
    assert torch.equal(y, full) or (y - full).abs().max() < 1e-6
    assert calls[:3] == [1, 1, 1], "the expert taking every token is a batch of its own"
    assert max(calls) <= 3 and sum(calls) == 3 * (E - 3)  # each used expert dequantized once per projection


def test_batches_cover_the_used_experts_once():
    counts = [0, 5, 1, 9, 0, 9, 2, 3]
    batches = moe_prefill._batches(counts, per_expert=1, itemsize=1, width=1, budget=2)
    assert sorted(e for b in batches for e in b) == [1, 2, 3, 5, 6, 7]
    assert [counts[e] for b in batches for e in b] == [9, 9, 5, 3, 2, 1]  # largest first
    assert max(len(b) for b in batches) == 2


def test_resident_chunk_path_on_the_cpu_is_the_loop():
    """The CPU keeps the per-expert loop through qmatmul (the reference; tests hook qmatmul's kernels)."""
    E, d, ff = 8, 64, 64
    ew = _experts(Q.Q8_0, Q.Q8_0, E, d, ff, 9)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(20, d, generator=gen)
    ids = _ids(20, 2, E, gen)
    w = torch.rand(20, 2, generator=gen)
    out = ResidentExperts({0: ew}).forward(0, x, ids, w)
    assert torch.equal(out, combine(expert_loop(ew, x, ids), w, x.dtype))
    grouped = combine(grouped_expert_ffn(x, ew.gate, ew.up, ew.down, ids), w, x.dtype)
    assert ((out - grouped).norm() / out.norm()).item() < 1e-5


def test_negative_ids_give_zero_and_leave_the_rest_equal():
    E, d, ff = 6, 64, 64
    ew = _experts(Q.Q8_0, Q.Q8_0, E, d, ff, 3)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(30, d, generator=gen)
    ids = _ids(30, 2, E, gen)
    masked = ids.clone()
    masked[::3, 0] = -1
    masked[5] = -1
    full = grouped_expert_ffn(x, ew.gate, ew.up, ew.down, ids)
    out = grouped_expert_ffn(x, ew.gate, ew.up, ew.down, masked)
    keep = masked >= 0
    assert (out[~keep] == 0).all()
    assert torch.allclose(out[keep], full[keep], rtol=1e-5, atol=1e-6)


def test_padded_shapes_counts_and_out_buffer(monkeypatch):
    """The CUDA shape padding (experts without tokens, zero rows) changes nothing; host counts and a shared
    output buffer give what the plain call gives (each call writes only its own pairs)."""
    import strata.ops.moe_prefill as mp

    E, d, ff = 8, 64, 64
    ew = _experts(Q.Q8_0, Q.Q8_0, E, d, ff, 4)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(37, d, generator=gen)
    ids = _ids(37, 2, E, gen)
    plain = grouped_expert_ffn(x, ew.gate, ew.up, ew.down, ids)
    monkeypatch.setattr(mp, "PAD_SHAPES", True)
    padded = grouped_expert_ffn(x, ew.gate, ew.up, ew.down, ids)
    assert torch.allclose(padded, plain, rtol=1e-5, atol=1e-6)
    low = torch.where(ids < 4, ids, -1)
    high = torch.where(ids >= 4, ids, -1)
    out = torch.full((ids.numel() + 1, d), float("nan"))
    out[:-1] = 0
    for part in (low, high):
        counts = torch.bincount(part[part >= 0], minlength=E).tolist()
        grouped_expert_ffn(x, ew.gate, ew.up, ew.down, part, counts=counts, out=out)
    assert torch.allclose(out[:-1].view(37, 2, d), plain, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="out must be"):
        grouped_expert_ffn(x, ew.gate, ew.up, ew.down, ids, out=torch.zeros(3, d))
