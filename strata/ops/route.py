"""A MoE router's logits and its choice in two launches: softmax or sigmoid scores, an optional choice bias, top-k, the chosen
weights renormalized and scaled, where torch spends ~8 kernels (softmax, top-k with its sort, gather, sum,
divide, scale) per layer of a decode step.

`route_topk(logits [N, E] float32, k, sigmoid, norm, scale, bias [E] | None) -> (ids [N, k] int64, weights
[N, k] float32)`: one program per token holds the E scores in registers and takes the maximum k times (ties to
the lowest expert id; torch.topk leaves their order unspecified), so the ids come out in descending score as
torch.topk's do. Reference twin: `strata.ops.reference.route_topk` (what `strata.layers.moe.route` computed
before). Tests run the kernel in Triton's interpreter on the CPU (tests/ops/test_route_interpret.py).

`router_logits(x [N, d] in the activations' dtype, w [E, d] a float router as stored (F32 / F16 / BF16), bias [E]
| None) -> [N, E] float32`: the logits without a float32 copy of x first (torch: a cast, then cuBLAS's dot and its
reduction, three launches a layer). Programs of ROWS experts each walk d in BLOCK_D steps, float32 products.
Reference twin: `strata.ops.reference.router_logits` (x.float() @ w.T, + bias).
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
ROWS = 4  # router rows (experts) per program of router_logits: E / 4 programs a token (B1: 32)
BLOCK_D = 512
# router_logits is taken on a GPU once its GPU test (tests/ops/test_route_interpret.py, marked gpu) has passed there
LOGITS_GPU_TESTED = True
_FLOAT = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


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


if triton is not None:

    @triton.jit
    def _logits_kernel(X, Wt, B, OUT, E, D, sx, sw, HAS_BIAS: tl.constexpr, ROWS_: tl.constexpr,
                       BD: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        r = tl.program_id(1) * ROWS_ + tl.arange(0, ROWS_)
        rm = r < E
        acc = tl.zeros([ROWS_, BD], dtype=tl.float32)
        for d0 in range(0, D, BD):
            dd = d0 + tl.arange(0, BD)
            dm = dd < D
            xv = tl.load(X + t * sx + dd, mask=dm, other=0.0).to(tl.float32)
            wv = tl.load(Wt + r[:, None].to(tl.int64) * sw + dd[None, :], mask=rm[:, None] & dm[None, :],
                         other=0.0).to(tl.float32)
            acc += wv * xv[None, :]
        out = tl.sum(acc, axis=1)
        if HAS_BIAS:
            out += tl.load(B + r, mask=rm, other=0.0).to(tl.float32)
        tl.store(OUT + t * E + r, out, mask=rm)


def router_logits(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    N, D = x.shape
    wt = w.raw.view(_FLOAT[w.qtype.name])  # a float QTensor's stored rows (uint8) as its floats, [E, d]
    E = wt.shape[0]
    out = torch.empty(N, E, dtype=torch.float32, device=x.device)
    if N == 0:
        return out
    xx = x if x.stride(-1) == 1 else x.contiguous()
    _logits_kernel[(N, triton.cdiv(E, ROWS))](xx, wt, bias if bias is not None else out, out, E, D, xx.stride(0),
                                               wt.stride(0), HAS_BIAS=bias is not None, ROWS_=ROWS, BD=BLOCK_D,
                                               num_warps=4)
    return out


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


def _float_router(w) -> bool:
    from strata.quant.formats import FLOAT_TYPES

    return getattr(w, "qtype", None) in FLOAT_TYPES and w.raw.is_cuda and w.raw.is_contiguous() and len(w.shape) == 2


registry.op("route_topk").register("triton", route_topk, _takes)
registry.op("router_logits").register(
    "triton", router_logits,
    lambda x, w, bias=None: (LOGITS_GPU_TESTED and triton is not None and x.is_cuda and x.dim() == 2
                             and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and _float_router(w)
                             and (bias is None or (bias.is_contiguous() and bias.dtype == torch.float32))))
