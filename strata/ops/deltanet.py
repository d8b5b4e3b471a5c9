"""A gated delta-net layer's decode recurrence in two launches (`delta_decode`), where torch spends ~25 small
kernels a layer (the conv's cat / unfold / product / sum / silu and its state's gather and scatter, two L2 norms,
the gates' sigmoid and softplus, the delta rule's decay, two contractions, the write, the state's gather and
scatter). Qwen3-Next runs 36 such layers a token, so in a graphed decode step their launches, not their bytes
(the state is 2 MB a layer), set the time.

`delta_decode(qkv [B, C] f32, ba [B, Hk*2r] f32 (rows may be strided), conv_all [S, K-1, C], conv_w [C, K], ssm_all [S, Hv, Dk, Dv],
slots [B] int64, dt_bias [Hv], a [Hv], hk, dk, dv) -> o [B, Hv, Dv] f32`, the slots' rows of both states
updated in place (no gather or scatter copies):

    _conv_kernel    (B, C / BLOCK_C)       the causal conv of each channel over its K-1 kept inputs and the new
                                           one, silu; the kept inputs shifted by one (each channel is one
                                           program's: no other reads it)
    _delta_kernel   (B, Hv, Dv / BLOCK_V)  the gates (beta = sigmoid, g = a * softplus(alpha + dt_bias)), q and k
                                           L2-normalised (q scaled by 1/sqrt(Dk)), then on a [Dk, BLOCK_V] tile
                                           of the state: decay, prediction, delta write, o = S^T q

The conv runs first because the value heads sharing a key head read the same q and k channels. The layer's output
norm, rms_norm(o) * w * silu(z) in the out projection's dtype, is one more launch (`gated_rms_norm`, where torch
spends four), for prompt chunks too. Reference twin:
`strata.ops.reference.delta_decode` (the layer's torch math). Tests run both kernels in Triton's interpreter on
the CPU (tests/ops/test_deltanet_interpret.py); a GPU takes them once their GPU test has passed there
(GPU_TESTED).
"""

from __future__ import annotations

import torch

from strata.config import triton_interpreting
from strata.ops import registry

try:  # Triton is optional: without it (or without a GPU) the torch twin runs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# taken on a GPU once tests/ops/test_deltanet_interpret.py's GPU test has passed there (tools/gpu/gated.sh)
GPU_TESTED = True
BLOCK_C = 256
BLOCK_V = 32


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _conv_kernel(QKV, CONV, W, SLOTS, MIXED, C, sq, K1: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        cc = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cc < C
        slot = tl.load(SLOTS + b).to(tl.int64)
        row = CONV + slot * K1 * C
        x = tl.load(QKV + b * sq + cc, mask=m, other=0.0).to(tl.float32)
        acc = x * tl.load(W + cc * (K1 + 1) + K1, mask=m, other=0.0).to(tl.float32)  # the newest input's tap
        for j in tl.static_range(K1):
            acc += tl.load(row + j * C + cc, mask=m, other=0.0) * tl.load(W + cc * (K1 + 1) + j, mask=m, other=0.0)
        tl.store(MIXED + b * C + cc, acc / (1.0 + tl.exp(-acc)), mask=m)  # silu
        for j in tl.static_range(K1 - 1):  # kept inputs shift by one (read j + 1 before it is overwritten)
            tl.store(row + j * C + cc, tl.load(row + (j + 1) * C + cc, mask=m, other=0.0), mask=m)
        tl.store(row + (K1 - 1) * C + cc, x, mask=m)

    @triton.jit
    def _delta_kernel(MIXED, BA, SSM, SLOTS, DTB, A, O, HK, HV, R, C, sba, scale, DK: tl.constexpr,
                      DV: tl.constexpr, BV: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        slot = tl.load(SLOTS + b).to(tl.int64)
        kh = h // R
        j = h % R
        ba = BA + b * sba + kh * 2 * R
        beta = 1.0 / (1.0 + tl.exp(-tl.load(ba + j).to(tl.float32)))
        x = tl.load(ba + R + j).to(tl.float32) + tl.load(DTB + h).to(tl.float32)
        soft = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's softplus threshold
        decay = tl.exp(tl.load(A + h).to(tl.float32) * soft)
        kk = tl.arange(0, DK)
        q = tl.load(MIXED + b * C + kh * DK + kk)
        k = tl.load(MIXED + b * C + HK * DK + kh * DK + kk)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)) * scale
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6))
        vv = vb * BV + tl.arange(0, BV)
        v = tl.load(MIXED + b * C + 2 * HK * DK + h * DV + vv)
        ptr = SSM + ((slot * HV + h) * DK + kk[:, None]) * DV + vv[None, :]
        s = tl.load(ptr) * decay  # [DK, BV]
        pred = tl.sum(k[:, None] * s, axis=0)  # [BV]
        s = s + k[:, None] * ((v - pred) * beta)[None, :]
        tl.store(ptr, s)
        tl.store(O + (b * HV + h) * DV + vv, tl.sum(q[:, None] * s, axis=0))


if triton is not None:

    @triton.jit
    def _gated_norm_kernel(O, Z, W, OUT, H, D, so0, so1, sz0, sz1, eps, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        dd = tl.arange(0, BLOCK)
        m = dd < D
        o = tl.load(O + i * so0 + h * so1 + dd, mask=m, other=0.0).to(tl.float32)
        z = tl.load(Z + i * sz0 + h * sz1 + dd, mask=m, other=0.0).to(tl.float32)
        w = tl.load(W + dd, mask=m, other=0.0).to(tl.float32)
        y = o / tl.sqrt(tl.sum(o * o, axis=0) / D + eps) * w * (z / (1.0 + tl.exp(-z)))
        tl.store(OUT + (i * H + h) * D + dd, y.to(OUT.dtype.element_ty), mask=m)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   dtype: torch.dtype) -> torch.Tensor:
    n, H, D = o.shape
    out = torch.empty(n, H * D, dtype=dtype, device=o.device)
    if n:
        _gated_norm_kernel[(n, H)](o, z, weight, out, H, D, o.stride(0), o.stride(1), z.stride(0), z.stride(1), float(eps),
                                   BLOCK=triton.next_power_of_2(D), num_warps=1 if D <= 256 else 4)
    return out


def _takes_norm(o, z, weight, eps, dtype) -> bool:
    return (triton is not None and o.is_cuda and (GPU_TESTED or triton_interpreting()) and o.dim() == 3
            and o.dtype == torch.float32 and o.stride(-1) == 1 and z.shape == o.shape and z.stride(-1) == 1
            and z.dtype == torch.float32 and weight.is_contiguous() and weight.numel() == o.shape[-1]
            and dtype in (torch.float32, torch.bfloat16, torch.float16))


def delta_decode(qkv: torch.Tensor, ba: torch.Tensor, conv_all: torch.Tensor, conv_w: torch.Tensor,
                 ssm_all: torch.Tensor, slots: torch.Tensor, dt_bias: torch.Tensor, a: torch.Tensor, hk: int,
                 dk: int, dv: int) -> torch.Tensor:
    B, C = qkv.shape
    hv = ssm_all.shape[1]
    k1 = conv_all.shape[1]
    mixed = torch.empty(B, C, dtype=torch.float32, device=qkv.device)
    o = torch.empty(B, hv, dv, dtype=torch.float32, device=qkv.device)
    if B == 0:
        return o
    _conv_kernel[(B, triton.cdiv(C, BLOCK_C))](qkv, conv_all, conv_w, slots, mixed, C, qkv.stride(0), K1=k1,
                                               BLOCK=BLOCK_C, num_warps=4)
    bv = min(BLOCK_V, dv)
    _delta_kernel[(B, hv, dv // bv)](mixed, ba, ssm_all, slots, dt_bias, a, o, hk, hv, hv // hk, C, ba.stride(0),
                                     float(dk) ** -0.5, DK=dk, DV=dv, BV=bv, num_warps=4)
    return o


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _takes(qkv, ba, conv_all, conv_w, ssm_all, slots, dt_bias, a, hk, dk, dv) -> bool:
    if triton is None or not qkv.is_cuda or not (GPU_TESTED or triton_interpreting()):
        return False
    ts = (conv_all, conv_w, ssm_all, dt_bias, a)
    rows = (qkv, ba)  # (column views of one fused projection: rows strided, each row contiguous)
    return (all(t.dtype == torch.float32 and t.is_contiguous() and t.is_cuda for t in ts)
            and all(t.dtype == torch.float32 and t.is_cuda and t.dim() == 2 and t.stride(-1) == 1 for t in rows)
            and slots.is_cuda and conv_all.shape[1] >= 1 and _pow2(dk) and _pow2(dv) and dk <= 256
            and ssm_all.shape[1] % hk == 0)


if triton is not None:
    registry.op("delta_decode").register("triton", delta_decode, _takes)
    registry.op("gated_rms_norm").register("triton", gated_rms_norm, _takes_norm)
