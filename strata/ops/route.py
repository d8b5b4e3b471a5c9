"""A MoE router's choice in one launch: softmax or sigmoid scores, an optional choice bias, top-k, the chosen
weights renormalized and scaled, where torch spends ~8 kernels (softmax, top-k with its sort, gather, sum,
divide, scale) per layer of a decode step.

`route_topk(logits [N, E] float32, k, sigmoid, norm, scale, bias [E] | None) -> (ids [N, k] int64, weights
[N, k] float32)`: one program per token holds the E scores in registers and takes the maximum k times (ties to
the lowest expert id; torch.topk leaves their order unspecified), so the ids come out in descending score as
torch.topk's do. Reference twin: `strata.ops.reference.route_topk` (what `strata.layers.moe.route` computed
before). Tests run the kernel in Triton's interpreter on the CPU (tests/ops/test_route_interpret.py).
"""

from __future__ import annotations

import torch

from strata.ops import registry

try:  # Triton is optional: without it (or without a GPU) the torch twin runs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

MAX_EXPERTS = 1024  # scores held in one program's registers (Qwen3-Next's 512 fit; more takes the twin)
MAX_K = 32


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _route_kernel(L, BIAS, IDS, W, E, stride, scale, eps, K: tl.constexpr, KP: tl.constexpr,
                      BLOCK_E: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_E)
        m = offs < E
        x = tl.load(L + t * stride + offs, mask=m, other=float("-inf")).to(tl.float32)
        if SIGMOID:
            p = tl.where(m, 1.0 / (1.0 + tl.exp(-x)), 0.0)
        else:
            e = tl.where(m, tl.exp(x - tl.max(x, axis=0)), 0.0)
            p = e / tl.sum(e, axis=0)
        if HAS_BIAS:  # the correction bias steers the choice, not the weights
            c = p + tl.load(BIAS + offs, mask=m, other=0.0).to(tl.float32)
        else:
            c = p
        c = tl.where(m, c, float("-inf"))
        ks = tl.arange(0, KP)
        ids = tl.zeros([KP], dtype=tl.int32)
        ws = tl.zeros([KP], dtype=tl.float32)
        for j in tl.static_range(K):
            best = tl.max(c, axis=0)
            idx = tl.min(tl.where(c == best, offs, BLOCK_E), axis=0)  # the lowest id among equal maxima
            w = tl.sum(tl.where(offs == idx, p, 0.0), axis=0)
            ids = tl.where(ks == j, idx, ids)
            ws = tl.where(ks == j, w, ws)
            c = tl.where(offs == idx, float("-inf"), c)
        if NORM:
            ws = ws / (tl.sum(ws, axis=0) + eps)
        ws = ws * scale
        km = ks < K
        tl.store(IDS + t * K + ks, ids.to(tl.int64), mask=km)
        tl.store(W + t * K + ks, ws, mask=km)


def route_topk(logits: torch.Tensor, k: int, sigmoid: bool, norm: bool, scale: float,
               bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    N, E = logits.shape
    ids = torch.empty(N, k, dtype=torch.int64, device=logits.device)
    w = torch.empty(N, k, dtype=torch.float32, device=logits.device)
    if N == 0:
        return ids, w
    lg = logits if logits.stride(-1) == 1 else logits.contiguous()
    block = triton.next_power_of_2(E)
    _route_kernel[(N,)](lg, bias if bias is not None else lg, ids, w, E, lg.stride(0), float(scale),
                        1e-20 if sigmoid else 0.0, K=k, KP=triton.next_power_of_2(k), BLOCK_E=block,
                        SIGMOID=bool(sigmoid), HAS_BIAS=bias is not None, NORM=bool(norm),
                        num_warps=4 if block >= 512 else 2 if block >= 128 else 1)
    return ids, w


def _takes(logits, k, sigmoid, norm, scale, bias=None) -> bool:
    return (logits.is_cuda and triton is not None and logits.dim() == 2 and logits.dtype == torch.float32
            and logits.shape[1] <= MAX_EXPERTS and 1 <= k <= min(MAX_K, logits.shape[1])
            and (bias is None or (bias.is_cuda and bias.is_contiguous() and bias.numel() == logits.shape[1])))


registry.op("route_topk").register("triton", route_topk, _takes)
