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


@reference("add_rms_norm")
def add_rms_norm(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float):
    """(h, y): the residual h = x + a and the op rms_norm of it (the fused one-row kernel where it runs)."""
    from strata.ops.registry import op

    h = x + a
    return h, op("rms_norm")(h, weight, eps)


@reference("silu_mul")
def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SwiGLU's middle: silu(g) * u (two kernels in torch; g and u may be views of one gate|up output)."""
    return F.silu(g) * u


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


@reference("router_logits")
def router_logits(x: torch.Tensor, w: QTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A MoE router's logits [N, E] float32 from x [N, d] and the router w [E, d] (+ bias [E], gpt-oss)."""
    from strata.quant import qmatmul  # (the format layer's dispatch: a float router is torch's matmul)

    logits = qmatmul(x.float(), w)
    return logits if bias is None else logits + bias


@reference("qk_norm_rope_kv")
def qk_norm_rope_kv(q, k, v, pos, cos_t, sin_t, dim: int, neox: bool, q_norm, k_norm, eps: float,
                    k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """qk_norm_rope, then token t's k' and v written into k_cache / v_cache [slots, positions, ...] at (slot t,
    pos[t]) (a decode step's sequences in slots 0 .. N-1); returns q'. Caches whose slot stride is 0 (one slot's
    rows expanded N times: a verify step's tokens, all in one slot) get every token in that slot."""
    qo, ko = qk_norm_rope(q, k, pos, cos_t, sin_t, dim, neox, q_norm, k_norm, eps)
    if k_cache.stride(0) == 0 and v_cache.stride(0) == 0:
        k_cache[0].index_copy_(0, pos, ko.to(k_cache.dtype))
        v_cache[0].index_copy_(0, pos, v.to(v_cache.dtype))
        return qo
    t = torch.arange(q.shape[0], device=q.device)
    k_cache.index_put_((t, pos), ko.to(k_cache.dtype))
    v_cache.index_put_((t, pos), v.to(v_cache.dtype))
    return qo


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


@reference("rows_attention")
def rows_attention(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """A step's n queries of one sequence, query j [H, D] over keys 0 .. start + j of ks [L, Hkv, D] / vs [L, Hkv,
    Dv], each as a one-query step computes it -> [n, H, Dv]."""
    return torch.cat([gqa_attention(q[j:j + 1], ks[:start + j + 1], vs[:start + j + 1], None, scale)
                      for j in range(q.shape[0])])


@reference("one_query_attention")
def one_query_attention(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, mask: torch.Tensor | None, pos_t,
                        scale: float) -> torch.Tensor:
    """One query q [1, H, D] of a static decode step against ks/vs [L, Hkv, D] (mask: its window's, pos_t: its
    position on the device, which the split kernel reads instead) -> [1, H, Dv]."""
    return gqa_attention(q, ks, vs, mask, scale)


@reference("one_query_attention_blocks")
def one_query_blocks(q: torch.Tensor, ks, vs, pos_t: torch.Tensor, scale: float) -> torch.Tensor:
    """One query q [1, H, D] of a static decode step against a window whose K and V are tensor views or
    strata.kv.quant.Blocks: both dequantized to q's dtype, keys past the device-side position pos_t [1] masked
    -> [1, H, Dv]."""
    from strata.kv.quant import Blocks

    ks, vs = (x.dequantize(q.dtype) if isinstance(x, Blocks) else x.to(q.dtype) for x in (ks, vs))
    L = ks.shape[0]
    mask = torch.zeros(1, L, dtype=q.dtype, device=q.device)
    mask.masked_fill_(torch.arange(L, device=q.device)[None, :] > pos_t[:, None], float("-inf"))
    return gqa_attention(q, ks, vs, mask, scale)


# Score elements per batch of query rows in `sink_attention` (bounds its [Hkv, G, n, L] temporaries)
SINK_SCORES = 1 << 25


def sink_attention(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, mask: torch.Tensor | None, scale: float,
                   sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a learned per-head sink logit in the softmax's denominator (gpt-oss): q [n, H, D] against
    ks [L, Hkv, D], vs [L, Hkv, Dv]; mask additive [n or 1, L] float (-inf: not seen) or None; sinks [H]
    -> [n, H, Dv] in q's dtype, computed in float32. The sink takes probability mass and gives no value:
    softmax over [scores, sink], the sink's column dropped."""
    n, H, D = q.shape
    L, hkv, dv = ks.shape[0], ks.shape[1], vs.shape[-1]
    G = H // hkv
    kt = ks.float().permute(1, 2, 0).unsqueeze(1)  # [Hkv, 1, D, L]
    vt = vs.float().transpose(0, 1).unsqueeze(1)  # [Hkv, 1, L, Dv]
    sk = sinks.float().view(hkv, G, 1, 1)
    out = torch.empty(n, H, dv, dtype=q.dtype, device=q.device)
    step = max(1, SINK_SCORES // max(1, H * L))
    for a in range(0, n, step):
        qs = q[a:a + step].float()
        m = qs.shape[0]
        s = torch.matmul(qs.view(m, hkv, G, D).permute(1, 2, 0, 3), kt) * scale  # [Hkv, G, m, L]
        if mask is not None:
            s = s + (mask[a:a + step] if mask.shape[0] == n and n > 1 else mask)
        top = torch.maximum(s.amax(-1, keepdim=True), sk)  # [Hkv, G, m, 1]
        p = torch.exp(s - top)
        den = p.sum(-1, keepdim=True) + torch.exp(sk - top)
        o = torch.matmul(p, vt) / den  # [Hkv, G, m, Dv]
        out[a:a + step] = o.permute(2, 0, 1, 3).reshape(m, H, dv).to(q.dtype)
    return out


reference("dequantize_blocks")(dequantize_blocks_torch)
reference("qmatmul")(reference_qmatmul)


COMBINE_ELEMENTS = 1 << 24  # (token, choice, dim) products formed at a time: a prefill chunk's are summed in parts


@reference("combine_choices")
def combine_choices(y: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y [N, k, d] per-choice expert outputs, w [N, k] -> [N, d] in dtype, summed in float32 (a large N in slices
    of tokens: the products are a float32 temporary as large as y)."""
    N, k, d = y.shape
    if not y.is_cuda:
        # choice by choice, a product then a sum (no fused multiply-add): elementwise, so a token's sum is the
        # same whatever tokens are beside it (a reduction over the choices' axis is blocked by the batch's shape)
        wf = w.float()
        acc = y[:, 0].float() * wf[:, 0:1]
        for j in range(1, k):
            acc = acc + y[:, j].float() * wf[:, j:j + 1]
        return acc.to(dtype)
    step = max(1, COMBINE_ELEMENTS // max(k * d, 1))
    if N <= step:
        return (y.float() * w.unsqueeze(-1).float()).sum(1).to(dtype)
    out = torch.empty(N, d, dtype=dtype, device=y.device)
    for a in range(0, N, step):
        out[a:a + step] = (y[a:a + step].float() * w[a:a + step].unsqueeze(-1).float()).sum(1)
    return out


@reference("gather_rows")
def gather_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [n] of `table` [V, B] (where it lies) -> [n, B] on the ids' device."""
    return table.index_select(0, ids.to(table.device)).to(ids.device)


def sigmoid_rows(x: torch.Tensor) -> torch.Tensor:
    """sigmoid of x [N, E] whose row's bits do not depend on N. torch's CPU kernel runs over the flattened tensor in
    vectors and the elements past the last whole pair of vectors with another exp, so with E not a multiple of the
    vectors' width an element's bits depended on where its row fell (a verify step's rows against a one-token
    step's): on the CPU the rows are padded to a multiple of 64 so that every element is in a vector."""
    E = x.shape[-1]
    if x.is_cuda or x.dim() != 2 or E % 64 == 0:
        return torch.sigmoid(x)
    pad = x.new_zeros(x.shape[0], -(-E // 64) * 64)
    pad[:, :E] = x
    return torch.sigmoid(pad)[:, :E]


@reference("route_topk")
def route_topk(logits: torch.Tensor, k: int, sigmoid: bool, norm: bool, scale: float,
               bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's choice: logits [N, E] float32 -> (ids [N, k] int64, weights [N, k] float32). Scores are the
    softmax (or sigmoid) of the logits; `bias` [E] is added for the choice only; the chosen scores are
    renormalized to sum 1 (norm; + 1e-20 under sigmoid) and multiplied by `scale`."""
    probs = sigmoid_rows(logits) if sigmoid else torch.softmax(logits, dim=-1)
    choose = probs + bias if bias is not None else probs
    ids = choose.topk(k, dim=-1).indices
    w = probs.gather(1, ids)
    if norm:
        w = w / (w.sum(-1, keepdim=True) + (1e-20 if sigmoid else 0.0))
    if scale != 1.0:
        w = w * scale
    return ids, w


def _gather(w: QTensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Experts at `slots` of a stacked QTensor [S, out, in] -> [P, out, in] in dtype."""
    raw = w.raw.index_select(0, slots)  # [P, out, row_bytes]
    return dequantize_flat(raw, w.qtype, dtype).view(slots.numel(), *w.shape[1:])


@reference("gather_expert_ffn")
def gather_expert_ffn(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor,
                      slots: torch.Tensor, repeat: int = 1) -> torch.Tensor:
    """x [P, d] (or [P / repeat, d]: pair p reads row p // repeat), pools [S, ff, d] / [S, ff, d] / [S, d, ff],
    slots [P] int64 (negative: a miss, output 0) -> [P, d] float32: the pairs' experts gathered, dequantized and
    multiplied in batches (torch)."""
    if repeat > 1:
        x = x.repeat_interleave(repeat, 0)
    y = torch_gather_ffn(x, gate, up, down, slots.clamp(min=0))
    return torch.where((slots >= 0).unsqueeze(1), y, 0.0)


@reference("two_tier_expert_ffn")
def two_tier_expert_ffn(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor, slots: torch.Tensor,
                        host: tuple[QTensor, QTensor, QTensor], eids: torch.Tensor, repeat: int = 1) -> torch.Tensor:
    """x [P, d], pools as gather_expert_ffn's, slots [P], host: the layer's experts where they lie ([E, ff, d],
    [E, ff, d], [E, d, ff]), eids [P] each pair's expert -> [P, d] float32: a pair with a slot (>= 0) from the
    pool, any other from the host stack by its expert id. (Computed where `host` lies and brought back: a
    reference, not capturable on a GPU.) repeat: as gather_expert_ffn's."""
    if repeat > 1:
        x = x.repeat_interleave(repeat, 0)
    y = torch_gather_ffn(x, gate, up, down, slots.clamp(min=0))
    dev = host[0].raw.device
    ym = torch_gather_ffn(x.to(dev), *host, eids.to(dev)).to(y.device)
    return torch.where((slots >= 0).unsqueeze(1), y, ym)


@reference("stage_misses")
def stage_misses(slots: torch.Tensor, eids: torch.Tensor, host, pool, base: int, n: int,
                 programs: int = 0) -> torch.Tensor:
    """slots [P] (negative: a miss), eids [P], host / pool: three expert stacks each ([E, ...] where the experts
    lie, [S, ...] the slot pool) -> slots [P]: the distinct missed experts, numbered in order of first
    occurrence, the first n copied into pool slots base .. base+n-1 and their pairs pointed there. (programs:
    how the kernel spreads the copies; nothing here.)"""
    out = slots.clone()
    order: dict[int, int] = {}
    for p, (s, e) in enumerate(zip(slots.tolist(), eids.tolist())):
        if s >= 0:
            continue
        j = order.setdefault(e, len(order))
        if j < n:
            out[p] = base + j
    for e, j in order.items():
        if j < n:
            for src, dst in zip(host, pool):
                dst.raw[base + j].copy_(src.raw[e])
    return out


@reference("lookup_slots")
def lookup_slots(flat: torch.Tensor, slot_map: torch.Tensor, rec: torch.Tensor, pmap: torch.Tensor | None = None,
                 fill: bool = False) -> torch.Tensor:
    """A MoE layer's pairs in the expert cache: flat [P] each pair's expert, slot_map [E] the layer's slot of each
    expert (-1: not cached) -> slots [P]; rec [3, P] (the step's record of the layer) gets the experts in row 0 and
    their cached slots in row 1; with pmap [E] (the slots a prefetch staged the layer's predicted misses in, -1
    elsewhere) a pair the cache misses takes its prefetched slot; fill: row 2 (what a prefetch staged) set to -1."""
    slots = slot_map.index_select(0, flat)
    rec[0].copy_(flat)
    rec[1].copy_(slots)
    if pmap is not None:
        slots = torch.where(slots >= 0, slots, pmap.index_select(0, flat))
    elif fill:
        rec[2].fill_(-1)
    return slots


@reference("commit_prefetch")
def commit_prefetch(pid: torch.Tensor, cached: torch.Tensor, staged: torch.Tensor, pmap: torch.Tensor,
                    rec2: torch.Tensor) -> None:
    """After a prefetch staged the next layer's predicted experts pid [P] (cached [P]: their slots in the cache,
    staged [P]: stage_misses' output): pmap [E] holds the staging slot of each expert it staged (-1 elsewhere,
    hits included), and rec2 [P] (the record's row 2) each pair's expert where it was staged, else -1."""
    got = torch.where(cached < 0, staged, torch.full_like(staged, -1))  # (a miss past the region: still negative)
    pmap.fill_(-1)
    pmap.index_copy_(0, pid, got)
    rec2.copy_(torch.where(got >= 0, pid, torch.full_like(pid, -1)))


def torch_gather_ffn(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor,
                     slots: torch.Tensor, act=None, eids: torch.Tensor | None = None) -> torch.Tensor:
    """The batched torch gathered FFN; with `act` (strata.experts.resident.ExpertAct) each pair's biases, by
    its expert id eids [P], and the act's activation."""
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
        if act is None:
            h = F.silu(h) * torch.bmm(xa, u.transpose(1, 2))
        else:
            e = eids[a:a + step]
            h = _bias(h, act.bias("gate_b", e, dtype))
            h = act.glu(h, _bias(torch.bmm(xa, u.transpose(1, 2)), act.bias("up_b", e, dtype))).to(dtype)
        del u
        dn = _gather(down, s, dtype)  # [p, d, ff]
        o = torch.bmm(h, dn.transpose(1, 2))
        if act is not None:
            o = _bias(o, act.bias("down_b", eids[a:a + step], dtype))
        out[a:a + step] = o.squeeze(1).float()
    return out


def _bias(y: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return y if b is None else y + b.unsqueeze(1)  # y [p, 1, n], b [p, n]


@reference("delta_decode")
def delta_decode(qkv: torch.Tensor, ba: torch.Tensor, conv_all: torch.Tensor, conv_w: torch.Tensor,
                 ssm_all: torch.Tensor, slots: torch.Tensor, dt_bias: torch.Tensor, a: torch.Tensor, hk: int,
                 dk: int, dv: int) -> torch.Tensor:
    """One decode token of B sequences through a gated delta-net layer's recurrence (strata.layers.deltanet):
    qkv [B, C] float32 (the projections before the causal conv), ba [B, Hk * 2r] (per key head its r betas, then
    its r alphas), conv_all [S, K-1, C] and ssm_all [S, Hv, Dk, Dv] (every slot's state; rows `slots` [B] are
    read and written in place), conv_w [C, K], dt_bias and a [Hv] -> o [B, Hv, Dv] float32."""
    b, hv = qkv.shape[0], ssm_all.shape[1]
    r = hv // hk
    ba = ba.view(b, hk, 2 * r)
    beta = ba[..., :r].reshape(b, hv).sigmoid()
    g = a * F.softplus(ba[..., r:].reshape(b, hv) + dt_bias)  # [B, Hv], <= 0
    full = torch.cat([conv_all.index_select(0, slots), qkv.unsqueeze(1)], dim=1)  # [B, K, C]
    mixed = F.silu((full * conv_w.T).sum(1))  # [B, C]
    conv_all.index_copy_(0, slots, full[:, 1:])
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)

    def heads(x):  # [B, Hk*Dk] -> [B, Hv, Dk], L2-normalised, each key head serving its r value heads
        x = x.reshape(b, hk, dk)
        x = x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
        return x.unsqueeze(2).expand(b, hk, r, dk).reshape(b, hv, dk)

    q, k, v = heads(q) * dk ** -0.5, heads(k), v.reshape(b, hv, dv)
    s = ssm_all.index_select(0, slots) * g.exp()[..., None, None]  # [B, Hv, Dk, Dv]
    predicted = torch.einsum("bhk,bhkv->bhv", k, s)
    s = s + k.unsqueeze(-1) * ((v - predicted) * beta.unsqueeze(-1)).unsqueeze(-2)
    ssm_all.index_copy_(0, slots, s)
    return torch.einsum("bhk,bhkv->bhv", q, s)


@reference("gated_rms_norm")
def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   dtype: torch.dtype) -> torch.Tensor:
    """A delta-net layer's output norm: o, z [n, H, D] float32 (z's rows may be strided) -> rms_norm(o) * weight *
    silu(z) as [n, H * D] in `dtype` (the out projection's input)."""
    of = o.float()
    y = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * F.silu(z.float())).reshape(o.shape[0], -1).to(dtype)
