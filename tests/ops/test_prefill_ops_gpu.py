"""On CUDA: the Triton dequantizers bit for bit against the torch reference (run on the CPU), through
`dequantize_flat`'s dispatch; the grouped prefill expert FFN against the per-expert loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata.experts.resident import ExpertWeights, expert_loop
from strata.quant import random_qtensor
from strata.quant.dequant import dequantize_flat
from strata.quant.formats import block_geometry

pytestmark = pytest.mark.gpu
triton_dequant = pytest.importorskip("strata.ops.dequant_triton")


def _same_bits(ours: torch.Tensor, ref: torch.Tensor, what) -> None:
    ours = ours.cpu()
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(ours), nan), what
    bits = torch.int32 if ref.dtype == torch.float32 else torch.int16
    assert int((ours.view(bits) != ref.view(bits))[~nan].sum()) == 0, what


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ2_XXS, Q.IQ3_XXS, Q.IQ2_S,
                                   Q.Q2_K, Q.Q3_K, Q.IQ2_XS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M, Q.Q4_1, Q.Q5_0, Q.Q5_1],
                         ids=lambda q: q.name)
def test_triton_dequant_is_bit_exact_on_cuda(qtype):
    if not triton_dequant.available():
        pytest.skip("needs Triton")
    block, size = block_geometry(qtype)
    rng = np.random.default_rng(int(qtype))
    n = 3001  # not a multiple of any program's block count
    valid = random_qtensor(qtype, (n, block), rng).raw.reshape(-1)
    noise = torch.from_numpy(rng.integers(0, 256, n * size, dtype=np.uint8))  # infs, NaNs, subnormals
    for kind, raw in (("valid", valid), ("random", noise)):
        dev = raw.cuda()
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            ref = dequantize_flat(raw, qtype, dtype)  # the torch reference on the CPU
            _same_bits(triton_dequant.dequantize_blocks(dev, qtype, dtype=dtype), ref, (kind, dtype))
            _same_bits(dequantize_flat(dev, qtype, dtype), ref, (kind, dtype, "dispatch"))
    # an odd start (the f16 fields are read bytewise)
    buf = torch.cat([torch.zeros(1, dtype=torch.uint8), valid]).cuda()
    _same_bits(dequantize_flat(buf[1:], qtype), dequantize_flat(valid, qtype), "odd offset")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)], ids=str)
def test_grouped_expert_ffn_matches_the_loop_on_cuda(dtype, tol):
    from strata.ops.moe_prefill import grouped_expert_ffn

    E, d, ff, N, k = 16, 512, 256, 200, 4
    rng = np.random.default_rng(0)
    ew = ExpertWeights(random_qtensor(Q.Q4_K, (E, ff, d), rng), random_qtensor(Q.Q4_K, (E, ff, d), rng),
                       random_qtensor(Q.Q6_K, (E, d, ff), rng)).to("cuda")
    gen = torch.Generator().manual_seed(0)
    allowed = torch.tensor([e for e in range(E) if e not in (2, 9, 11)])  # experts 2, 9, 11: no tokens
    ids = torch.stack([allowed[torch.randperm(len(allowed) - 1, generator=gen)[:k]] for _ in range(N)])
    ids[:, 0] = allowed[-1]  # one expert takes every token
    x = torch.randn(N, d, generator=gen).to("cuda", dtype)
    ids = ids.cuda()
    y = grouped_expert_ffn(x, ew.gate, ew.up, ew.down, ids)
    ref = expert_loop(ew, x, ids)
    assert y.shape == ref.shape == (N, k, d) and y.dtype == torch.float32
    rel = ((y - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert rel < tol, rel
