"""The reference twin of every op (strata.ops.registry): pure torch, the CPU path and the test oracle. A kernel
must agree with its twin over parametrized shapes (tests/ops, tests/layers, tests/experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from strata.ops.registry import reference
from strata.quant import QTensor
from strata.quant.dequant import dequantize_blocks_torch, dequantize_flat
from strata.quant.matmul import reference_qmatmul

# One query token: SDPA backends that do not re-plan for every KV length (cuDNN's does, at a host cost per call
# comparable to the attention itself)
_ONE_QUERY_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# Dequantized elements per batch of pairs (the gathered expert FFN): bounds the temporaries (the reference
# dequantizers make ~20 bytes of them per element) while keeping decode (k pairs of a B1-sized expert) in one or
# two batches.
MAX_ELEMENTS = 1 << 24


@reference("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] in x's dtype, computed in float32."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def rope(x: torch.Tensor, pos: torch.Tensor, cos_t: torch.Tensor, sin_t: torch.Tensor, dim: int,
         neox: bool) -> torch.Tensor:
    """x [N, H, D]: the first `dim` of D rotated by the tables' rows at pos [N] (neox: halves; else adjacent
    pairs), computed in float32."""
    cos = cos_t[pos].unsqueeze(1)  # [N, 1, dim/2]
    sin = sin_t[pos].unsqueeze(1)
    xr, xp = x[..., :dim].float(), x[..., dim:]
    if neox:
        x1, x2 = xr.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    out = out.to(x.dtype)
    return torch.cat([out, xp], dim=-1) if xp.shape[-1] else out


@reference("qk_norm_rope")
def qk_norm_rope(q: torch.Tensor, k: torch.Tensor | None, pos: torch.Tensor, cos_t: torch.Tensor,
                 sin_t: torch.Tensor, dim: int, neox: bool, q_norm: torch.Tensor | None = None,
                 k_norm: torch.Tensor | None = None, eps: float = 0.0):
    """Per-head RMSNorm of q and k (when q_norm/k_norm [D] are given), then rotary: (q, k) (k None: (q, None))."""
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps)
        if k is not None:
            k = rms_norm(k, k_norm, eps)
    return rope(q, pos, cos_t, sin_t, dim, neox), (rope(k, pos, cos_t, sin_t, dim, neox) if k is not None else None)


def gqa_attention(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, mask: torch.Tensor | None,
                  scale: float) -> torch.Tensor:
    """One segment: q [n, H, D] against ks [L, Hkv, D], vs [L, Hkv, Dv] -> [n, H, Dv] (a view where possible)."""
    n, H, D = q.shape
    hkv = ks.shape[1]
    if n == 1:
        # One token: each KV head is a batch entry of one head whose queries are the G = H/Hkv query heads
        # sharing it ([Hkv, 1, G, D]). That is GQA exactly (query head h reads KV head h // G, as enable_gqa's
        # repeat_interleave does) without enable_gqa, which rules out the memory-efficient kernel (the one that
        # takes the static step's mask: flash takes none); and the output [Hkv, 1, G, Dv] is laid out head by
        # head as wo wants it (no copy).
        qs = q.reshape(hkv, 1, H // hkv, D)
        kt = ks.transpose(0, 1).unsqueeze(1)  # [Hkv, 1, L, D]: strided views of the cache, no copy
        vt = vs.transpose(0, 1).unsqueeze(1)
        if q.is_cuda:
            with sdpa_kernel(_ONE_QUERY_BACKENDS):
                o = F.scaled_dot_product_attention(qs, kt, vt, attn_mask=mask, scale=scale)
        else:
            o = F.scaled_dot_product_attention(qs, kt, vt, attn_mask=mask, scale=scale)
        return o.reshape(1, H, o.shape[-1])  # [Hkv, 1, G, Dv] -> [1, H, Dv]
    qs = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    kt = ks.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
    vt = vs.transpose(0, 1).unsqueeze(0)
    o = F.scaled_dot_product_attention(qs, kt, vt, attn_mask=mask, scale=scale, enable_gqa=H != hkv)
    return o[0].transpose(0, 1)  # [n, H, Dv]


@reference("one_query_attention")
def one_query_attention(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, mask: torch.Tensor | None, pos_t,
                        scale: float) -> torch.Tensor:
    """One query q [1, H, D] of a static decode step against ks/vs [L, Hkv, D] (mask: its window's, pos_t: its
    position on the device, which the split kernel reads instead) -> [1, H, Dv]."""
    return gqa_attention(q, ks, vs, mask, scale)


reference("dequantize_blocks")(dequantize_blocks_torch)
reference("qmatmul")(reference_qmatmul)


def _gather(w: QTensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Experts at `slots` of a stacked QTensor [S, out, in] -> [P, out, in] in dtype."""
    raw = w.raw.index_select(0, slots)  # [P, out, row_bytes]
    return dequantize_flat(raw, w.qtype, dtype).view(slots.numel(), *w.shape[1:])


@reference("gather_expert_ffn")
def gather_expert_ffn(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor,
                      slots: torch.Tensor) -> torch.Tensor:
    """x [P, d], pools [S, ff, d] / [S, ff, d] / [S, d, ff], slots [P] int64 (negative: a miss, output 0)
    -> [P, d] float32: the pairs' experts gathered, dequantized and multiplied in batches (torch)."""
    y = torch_gather_ffn(x, gate, up, down, slots.clamp(min=0))
    return torch.where((slots >= 0).unsqueeze(1), y, 0.0)


def torch_gather_ffn(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor,
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
