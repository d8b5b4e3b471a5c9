"""Grouped expert FFN over a slot pool: many (slot, token) pairs in a few batched calls, no per-expert launches.

`gather_expert_ffn(x, gate, up, down, slots)` computes, for each pair p, the expert held in `slots[p]` of the
pool applied to `x[p]`: the pairs' expert blocks are gathered with one index_select per projection,
dequantized in one batched call, and multiplied with `torch.bmm`. On the GPU this replaces a Python loop of
per-expert matmuls (launch-bound: ~0.4 TB/s) with a constant number of launches per layer. It still writes the
dequantized weights once (in the activation dtype) and reads them back; a fused kernel reading the blocks
directly saves that traffic: `strata.ops.expert_triton` (Q4_K, Q8_0), taken on CUDA when Triton is present.
Reference twin: `strata.experts.resident.expert_ffn` per pair.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.ops import expert_triton
from strata.quant import QTensor
from strata.quant.dequant import dequantize_flat

# Dequantized elements per batch of pairs: bounds the temporaries (the reference dequantizers make ~20 bytes
# of them per element) while keeping decode (k pairs of a B1-sized expert) in one or two batches.
MAX_ELEMENTS = 1 << 24


def _gather(w: QTensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Experts at `slots` of a stacked QTensor [S, out, in] -> [P, out, in] in dtype."""
    raw = w.raw.index_select(0, slots)  # [P, out, row_bytes]
    return dequantize_flat(raw, w.qtype, dtype).view(slots.numel(), *w.shape[1:])


def gather_expert_ffn(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor,
                      slots: torch.Tensor) -> torch.Tensor:
    """x [P, d], pools [S, ff, d] / [S, ff, d] / [S, d, ff], slots [P] int64 (negative: a miss, output 0)
    -> [P, d] float32. On CUDA, formats with a fused Triton kernel (Q4_K, Q8_0) take it: two launches."""
    if x.is_cuda and expert_triton.supports(gate, up, down):
        return expert_triton.triton_expert_ffn(x, gate, up, down, slots)
    y = _torch_gather_ffn(x, gate, up, down, slots.clamp(min=0))
    return torch.where((slots >= 0).unsqueeze(1), y, 0.0)


def _torch_gather_ffn(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor,
                      slots: torch.Tensor) -> torch.Tensor:
    P, d = x.shape
    dtype = x.dtype if x.dtype.is_floating_point else torch.float32
    ff = gate.shape[1]
    out = torch.empty(P, d, dtype=torch.float32, device=x.device)
    step = max(1, MAX_ELEMENTS // (ff * d))
    for a in range(0, P, step):
        s = slots[a:a + step]
        xa = x[a:a + step].to(dtype).unsqueeze(1)  # [p, 1, d]
        g = _gather(gate, s, dtype)  # [p, ff, d]
        h = torch.bmm(xa, g.transpose(1, 2))  # [p, 1, ff]
        del g
        u = _gather(up, s, dtype)
        h = F.silu(h) * torch.bmm(xa, u.transpose(1, 2))
        del u
        dn = _gather(down, s, dtype)  # [p, d, ff]
        out[a:a + step] = torch.bmm(h, dn.transpose(1, 2)).squeeze(1).float()
    return out
