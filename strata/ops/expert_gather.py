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

import weakref

import torch

from strata.ops import expert_triton, registry
from strata.ops.reference import torch_gather_ffn as _torch_gather_ffn  # noqa: F401 - the batched torch path
from strata.quant import QTensor


def _triton_when(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor, slots: torch.Tensor,
                 repeat: int = 1) -> bool:
    return x.is_cuda and expert_triton.supports(gate, up, down)


registry.op("gather_expert_ffn").register("triton", expert_triton.triton_expert_ffn, _triton_when)
# x [P, d], pools [S, ff, d] / [S, ff, d] / [S, d, ff], slots [P] int64 (negative: a miss, output 0) -> [P, d]
# float32. On CUDA, formats with a fused Triton kernel (Q4_K, Q8_0) take it: two launches. repeat=r (keyword): x
# holds P / r rows, pair p reading row p // r (a token's k choices without a repeated copy of x).
gather_expert_ffn = registry.op("gather_expert_ffn")


# host stack -> pinned, asked once per tensor (the stacks live as long as the model; the question is a driver call,
# and the kernel choice is also made while a decode step is being captured)
_PINNED: dict[int, bool] = {}  # id(tensor) -> pinned, dropped with the tensor


def _pinned(t: torch.Tensor) -> bool:
    k = id(t)
    got = _PINNED.get(k)
    if got is None:
        got = _PINNED[k] = bool(t.is_pinned())
        weakref.finalize(t, _PINNED.pop, k, None)
    return got


def _two_tier_when(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor, slots: torch.Tensor, host,
                   eids: torch.Tensor, repeat: int = 1) -> bool:
    # the host stack must be mapped into the GPU's address space (pinned) for the kernel to read it over the bus
    return (x.is_cuda and expert_triton.supports(gate, up, down) and expert_triton.supports(*host)
            and all(_pinned(t.raw) for t in host))


def two_tier_fast(gate: QTensor, up: QTensor, down: QTensor) -> bool:
    """Whether the fused kernel reads experts of these stacks' formats and shapes (a GPU-side check before a
    decode path is chosen; the stacks must also be pinned, which the caller knows)."""
    return expert_triton.supports(gate, up, down)


def expert_formats_fast(qtypes) -> bool:
    """Whether the fused expert kernel reads these formats on a GPU (a load-time check: one warning per format
    that runs on the reference path)."""
    return expert_triton.available() and all(
        qt in expert_triton.LOOKUP_ON_GPU or qt in expert_triton.K_ON_GPU for qt in qtypes)


def stage_fast(stacks) -> bool:
    """Whether `stage_misses`'s copy kernel takes these stacks (checked before a GPU decode path stages misses
    inside a captured step, where the op's torch twin cannot run)."""
    from strata.ops.host_stage import stageable

    return stageable(stacks)


def _two_tier_triton(x, gate, up, down, slots, host, eids, repeat: int = 1):
    return expert_triton.triton_expert_ffn(x, gate, up, down, slots, host=host, eids=eids, repeat=repeat)


registry.op("two_tier_expert_ffn").register("triton", _two_tier_triton, _two_tier_when)
# x [P, d], a layer's pool stacks and slots [P] as above, host: the layer's expert stacks where they lie (pinned
# host memory on CUDA), eids [P] -> [P, d] float32: a pair with a slot from the pool, a miss read from the host
# stack by its expert id (over the bus, inside the kernel: no copy, no host involvement). repeat as above.
two_tier_expert_ffn = registry.op("two_tier_expert_ffn")
