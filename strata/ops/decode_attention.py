"""One query token's grouped-query attention over a KV window, split along the keys (flash-decoding), in Triton.

A decode step's attention is one query per sequence against up to the whole context. SDPA's kernels parallelise
over (batch, heads, query blocks): for one query and 4 KV heads that is a handful of thread blocks walking 2,048+
keys each, while the rest of the GPU idles (attention time grows steeply with the window: docs/BENCHMARKS.md).
Here the window is cut into S splits per KV head, each program computes a
partial softmax (max, sum, weighted values) of the G = H / Hkv query heads sharing that KV head over its split,
and a second kernel merges the S partials exactly (log-sum-exp rescaling).

Keys past the device-side position `pos` (the static window of a captured step) are masked; the split count
depends on the window only, so shapes are static and the step can be captured. Math in float32 (the products on
tensor cores in TF32); bf16/f16 activations only (float32 runs keep SDPA, exact).
Reference twin: `torch.nn.functional.scaled_dot_product_attention` with the window mask
(`strata.ops.reference.gqa_attention`). Tests run the kernels in Triton's interpreter on the CPU against it.
"""

from __future__ import annotations

import torch

from strata.config import decode_attention_backend
from strata.ops import registry

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK_N = 64  # keys per inner step
MAX_ROWS = 64  # queries x query heads per KV head in one program (a verify step's queries share each key read)
TARGET_PROGRAMS = 256  # Hkv x splits: enough programs to spread one query's keys over an H100/H200's SMs
# The grid is fixed by the window (a captured graph replays it at every position); with dynamic splits each program
# takes its share of the keys up to the position read on the device, so a short context in a long window spreads
# over every split instead of running in the first few. On since its GPU tests passed on an H200
# (tests/ops/test_decode_attention.py, tests/ops/test_decode_attention_kv.py, kept in tools/gpu/gated.sh).
DYNAMIC_SPLITS_GPU_TESTED = True
# The lean tiles: dot operands in 16 bits (the cache's own dtype here; f16 from q8_0 / q4_0 blocks, each block scale
# loaded once for its 32 values) with float32 sums, as flash attention's, where the other form widens every tile
# to float32 (twice the registers and shared memory). On since its GPU tests passed on an H200 and
# tools/bench_attention.py timed them faster than the float32 tiles (docs/BENCHMARKS.md, "Long context at a budget").
LEAN_GPU_TESTED = True


def dynamic_splits(device: torch.device) -> bool:
    from strata.config import triton_interpreting

    return device.type != "cuda" or DYNAMIC_SPLITS_GPU_TESTED or triton_interpreting()


def lean_tiles(device: torch.device, dtype: torch.dtype = torch.float16) -> bool:
    from strata.config import triton_interpreting

    if triton_interpreting():  # (the interpreter's dot multiplies bf16 operands wrongly: f16 checks the path)
        return dtype != torch.bfloat16
    return device.type != "cuda" or LEAN_GPU_TESTED


def available() -> bool:
    return triton is not None and decode_attention_backend() != "sdpa"  # sdpa: the A/B baseline


def use_for(q: torch.Tensor, ks: torch.Tensor) -> bool:
    """Whether the split kernel takes this one-query attention (CUDA, bf16/f16, power-of-two head dims)."""
    D, DV = q.shape[-1], ks.shape[-1]
    return (available() and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and ks.dtype == q.dtype
            and D >= 16 and D & (D - 1) == 0 and DV >= 16 and DV & (DV - 1) == 0
            and q.shape[0] * (q.shape[1] // max(ks.shape[1], 1)) <= MAX_ROWS)


def splits_for(window: int, n_kv: int) -> tuple[int, int]:
    """(splits, keys per split) for a window: about TARGET_PROGRAMS programs, whole BLOCK_N steps each."""
    blocks = -(-window // BLOCK_N)
    s = max(1, min(blocks, TARGET_PROGRAMS // max(n_kv, 1)))
    per = -(-blocks // s) * BLOCK_N
    return -(-window // per), per


if triton is not None:

    @triton.jit
    def _split_kernel(Q, K, V, POS, Mo, Lo, Ao, scale, chunk,
                      sqn, sqh, sqg, skl, skh, svl, svh,
                      G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BN: tl.constexpr,
                      DYN: tl.constexpr, LEAN: tl.constexpr, NQ: tl.constexpr):
        h = tl.program_id(0)
        s = tl.program_id(1)
        S = tl.num_programs(1)
        g = tl.arange(0, GP)  # rows: query g // G's head g % G of this KV head (one query: the heads)
        d = tl.arange(0, D)
        dv = tl.arange(0, DV)
        if NQ == 1:
            q = tl.load(Q + h * sqh + g[:, None] * sqg + d[None, :], mask=g[:, None] < G, other=0.0).to(tl.float32)
            end = tl.load(POS).to(tl.int32) + 1  # keys 0..pos are valid
        else:  # a verify step's NQ queries at ascending positions: each key read once for all of them
            qi = g // G
            live = g < NQ * G
            q = tl.load(Q + qi[:, None] * sqn + h * sqh + (g % G)[:, None] * sqg + d[None, :], mask=live[:, None],
                        other=0.0).to(tl.float32)
            ends = tl.load(POS + qi, mask=live, other=0).to(tl.int32) + 1  # [GP]: each row's keys 0..its pos
            end = tl.max(ends, 0)
        if DYN:  # the keys up to the position shared by every split (whole BN steps; split 0 holds key 0)
            chunk = tl.cdiv(tl.cdiv(end, BN), S) * BN
        start = s * chunk
        stop = tl.minimum(start + chunk, end)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DV], tl.float32)
        for n0 in range(start, stop, BN):
            n = n0 + tl.arange(0, BN)
            ok = n < stop
            k = tl.load(K + n[:, None] * skl + h * skh + d[None, :], mask=ok[:, None], other=0.0)
            if LEAN:  # the cache's own 16-bit rows as the dot's operands
                qk = tl.dot(q.to(k.dtype), tl.trans(k)) * scale  # [GP, BN]
            else:
                qk = tl.dot(q, tl.trans(k.to(tl.float32))) * scale
            if NQ == 1:
                qk = tl.where(ok[None, :], qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                p = tl.exp(qk - m_new[:, None])
                alpha = tl.exp(m_i - m_new)
            else:  # a row may have no key in this block (its position before it): keep its sums at 0, not NaN
                qk = tl.where(ok[None, :] & (n[None, :] < ends[:, None]), qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(qk - m_use[:, None])
                alpha = tl.exp(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + n[:, None] * svl + h * svh + dv[None, :], mask=ok[:, None], other=0.0)
            if LEAN:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
            m_i = m_new
        row = (h * S + s) * GP + g  # partials laid out [Hkv, S, GP]
        tl.store(Mo + row, m_i)
        tl.store(Lo + row, l_i)
        tl.store(Ao + row[:, None] * DV + dv[None, :], acc)

    @triton.jit
    def _merge_kernel(Mo, Lo, Ao, O, S, son, soh, sog,
                      G: tl.constexpr, GP: tl.constexpr, DV: tl.constexpr, SP: tl.constexpr, NQ: tl.constexpr):
        h = tl.program_id(0)
        g = tl.program_id(1)
        s = tl.arange(0, SP)
        dv = tl.arange(0, DV)
        row = (h * S + s) * GP + g
        m = tl.load(Mo + row, mask=s < S, other=float("-inf"))
        mx = tl.max(m, 0)  # finite: the first split always holds key 0
        w = tl.where(s < S, tl.exp(m - mx), 0.0)  # an empty split (m = -inf) weighs 0
        den = tl.sum(w * tl.load(Lo + row, mask=s < S, other=0.0), 0)
        a = tl.load(Ao + row[:, None] * DV + dv[None, :], mask=(s < S)[:, None], other=0.0)
        out = tl.sum(w[:, None] * a, 0) / den
        if NQ == 1:
            tl.store(O + h * soh + g * sog + dv, out.to(O.dtype.element_ty))
        else:
            tl.store(O + (g // G) * son + h * soh + (g % G) * sog + dv, out.to(O.dtype.element_ty))


def decode_attention(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, pos_t: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [n, H, D]: n queries of one slot (a decode step's one; a verify step's several, at ascending positions),
    ks [L, Hkv, D], vs [L, Hkv, Dv] (strided views of the slot's cache window), pos_t [n] int64 on the device (query
    i attends keys 0..pos_t[i]) -> [n, H, Dv] in q's dtype. H must be a multiple of Hkv (query head h reads KV head
    h // (H / Hkv)); n x H / Hkv at most MAX_ROWS."""
    NQ, H, D = q.shape
    L, hkv, _ = ks.shape
    DV = vs.shape[-1]
    G = H // hkv
    if ks.stride(-1) != 1 or vs.stride(-1) != 1:
        raise ValueError("decode_attention needs the head dim contiguous in the cache")
    qg = q.reshape(NQ, hkv, G, D)
    if qg.stride(-1) != 1:
        qg = qg.contiguous()
    S, chunk = splits_for(L, hkv)
    GP = max(16, triton.next_power_of_2(NQ * G))
    dev = q.device
    m = torch.empty(hkv * S * GP, dtype=torch.float32, device=dev)
    lsum = torch.empty_like(m)
    acc = torch.empty(hkv * S * GP, DV, dtype=torch.float32, device=dev)
    _split_kernel[(hkv, S)](qg, ks, vs, pos_t, m, lsum, acc, scale, chunk,
                            qg.stride(0), qg.stride(1), qg.stride(2), ks.stride(0), ks.stride(1), vs.stride(0),
                            vs.stride(1), G=G, GP=GP, D=D, DV=DV, BN=BLOCK_N, DYN=dynamic_splits(q.device),
                            LEAN=lean_tiles(q.device, ks.dtype), NQ=NQ, num_warps=4)
    out = torch.empty(NQ, hkv, G, DV, dtype=q.dtype, device=dev)
    _merge_kernel[(hkv, NQ * G)](m, lsum, acc, out, S, out.stride(0), out.stride(1), out.stride(2),
                                 G=G, GP=GP, DV=DV, SP=max(2, triton.next_power_of_2(S)), NQ=NQ, num_warps=4)
    return out.view(NQ, H, DV)


def _one_query(q, ks, vs, mask, pos_t, scale):  # the op's signature: the kernel reads pos_t, not the mask
    return decode_attention(q, ks, vs, pos_t, scale)


registry.op("one_query_attention").register("triton", _one_query, lambda q, ks, *args: use_for(q, ks))
