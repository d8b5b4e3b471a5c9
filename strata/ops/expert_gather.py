"""Grouped expert FFN over a slot pool: many (slot, token) pairs in a few batched calls, no per-expert launches.

`gather_expert_ffn(x, gate, up, down, slots)` computes, for each pair p, the expert held in `slots[p]` of the
pool applied to `x[p]`: the pairs' expert blocks are gathered with one index_select per projection,
dequantized in one batched call, and multiplied with `torch.bmm`. On the GPU this replaces a Python loop of
per-expert matmuls (launch-bound: ~0.4 TB/s) with a constant number of launches per layer. It still writes the
dequantized weights once (in the activation dtype) and reads them back; a fused kernel reading the blocks
directly saves that traffic: `strata.ops.expert_triton` (Q4_K, Q8_0), taken on CUDA when Triton is present.
Reference twins: `strata.ops.reference.gather_expert_ffn` (the batched torch path, the CPU path) and
`strata.experts.resident.expert_ffn` per pair.
"""

from __future__ import annotations

import torch

from strata.ops import expert_triton, registry
from strata.ops.reference import torch_gather_ffn as _torch_gather_ffn  # noqa: F401 - the batched torch path
from strata.quant import QTensor


def _triton_when(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor, slots: torch.Tensor) -> bool:
    return x.is_cuda and expert_triton.supports(gate, up, down)


registry.op("gather_expert_ffn").register("triton", expert_triton.triton_expert_ffn, _triton_when)
# x [P, d], pools [S, ff, d] / [S, ff, d] / [S, d, ff], slots [P] int64 (negative: a miss, output 0) -> [P, d]
# float32. On CUDA, formats with a fused Triton kernel (Q4_K, Q8_0) take it: two launches.
gather_expert_ffn = registry.op("gather_expert_ffn")
