"""The decode GEMV for a few rows of x at once (a verify step's 2-8 tokens, a batch of decoding sequences): Q8_0,
Q4_K and Q6_K weights decoded once per program and dotted with every row, where `qgemv`'s one-row kernel runs a
program per row of x and each one decodes the same blocks again (the repeated bytes come from L2; the decoding,
~8-13 instructions a weight, is paid per row: docs/BENCHMARKS.md, "Speculative decoding", has the measurement).

The tiles mirror `strata.ops.kquant_triton`'s (same block layouts, same float tricks) with the rows of x as a
static loop over the decoded weights: each row's partial dot product ([BN]) is added into its row of an [RP, BN]
accumulator. Taken on a GPU once tests/ops/test_qgemv.py's rows test has passed there (ROWS_GPU_TESTED, through
`qgemv._gemv`); the interpreter runs it on the CPU against gguf-py's dequantizer and the one-row kernel
(tests/ops/test_qgemv_interpret.py). Reference twin: `strata.quant.matmul.reference_qmatmul`.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from strata.quant.qtensor import QTensor

Q = GGMLQuantizationType

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

FORMATS = frozenset({Q.Q8_0, Q.Q4_K, Q.Q6_K})
ROWS_MIN, ROWS_MAX = 2, 8
# weights of all rows one program decodes per iteration (BN x KW): the decoded tile stays in registers across the
# rows' loop, so it is held smaller than the one-row kernel's
TILE = 4096
KW = 256  # weights of a row per iteration

if triton is not None:
    from strata.ops.kquant_triton import _f16, _u32

    @triton.jit
    def _add_row(acc, part, r: tl.constexpr, RP: tl.constexpr):
        """acc [RP, BN] with part [BN] added to its row r."""
        return tl.where((tl.arange(0, RP) == r)[:, None], acc + part[None, :], acc)

    @triton.jit
    def q8_0_rows(acc, row, xp, K, b0, nblk, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr,
                  R: tl.constexpr, RP: tl.constexpr):
        """Blocks b0 .. b0+NB of BN rows of Q8_0 blocks against R rows of x (xp: row 0; row r at xp + r K)."""
        k = tl.arange(0, 2).to(tl.int64)
        c = (2 * tl.arange(0, 16).to(tl.int64))[:, None] + k[None, :]  # [16, 2]
        j = (b0 + tl.arange(0, NB)).to(tl.int64)
        if EVEN:
            jm = tl.full([NB], 1, tl.int1)
        else:
            jm = j < nblk
        blk = row[:, None] + j[None, :] * 34  # [BN, NB]
        d = _f16(blk, jm[None, :])
        q = tl.load(blk[:, :, None, None] + 2 + c[None, None], mask=jm[None, :, None, None], other=0,
                    eviction_policy="evict_first")  # [BN, NB, 16, 2]
        qs = (q.to(tl.int8, bitcast=True).to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
        xo = j[:, None, None] * 32 + c[None]  # [NB, 16, 2]
        for r in tl.static_range(R):
            xv = tl.load(xp + r * K + xo, mask=jm[:, None, None], other=0.0).to(tl.float32)
            t = tl.sum(qs * xv[None], axis=3) * d[:, :, None]  # [BN, NB, 16]
            acc = _add_row(acc, tl.sum(tl.sum(t, axis=1), axis=1), r, RP)
        return acc

    @triton.jit
    def q4k_rows(acc, row, xp, K, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr,
                 R: tl.constexpr, RP: tl.constexpr):
        """Superblocks b0 .. b0+NB of BN rows of Q4_K blocks against R rows of x (kquant_triton._k45_tile's
        decoding: each nibble made a float where it lies, its power of two moved into x)."""
        g = tl.arange(0, 4)
        g64 = g.to(tl.int64)
        wd = tl.arange(0, 8).to(tl.int64)
        sb = (b0 + tl.arange(0, NB)).to(tl.int64)
        if EVEN:
            sm = tl.full([NB], 1, tl.int1)
        else:
            sm = sb < nsb
        m2 = sm[None, :]
        blk = row[:, None] + sb[None, :] * 144
        d = _f16(blk, m2)[:, :, None]
        dmin = _f16(blk + 2, m2)[:, :, None]
        s0 = _u32(blk + 4, m2)
        s1 = _u32(blk + 8, m2)
        s2 = _u32(blk + 12, m2)
        sc_a = s0 & 0x3F3F3F3F
        mn_a = s1 & 0x3F3F3F3F
        sc_b = (s2 & 0x0F0F0F0F) | ((s0 >> 2) & 0x30303030)
        mn_b = ((s2 >> 4) & 0x0F0F0F0F) | ((s1 >> 2) & 0x30303030)
        first = (g < 2)[None, None, :]
        sh = (16 * (g % 2))[None, None, :]
        scw = tl.where(first, sc_a[:, :, None], sc_b[:, :, None])  # [BN, NB, 4]
        mnw = tl.where(first, mn_a[:, :, None], mn_b[:, :, None])
        a_lo = d * ((scw >> sh) & 63).to(tl.float32)
        a_hi = d * ((scw >> (sh + 8)) & 63).to(tl.float32)
        b_lo = dmin * ((mnw >> sh) & 63).to(tl.float32)
        b_hi = dmin * ((mnw >> (sh + 8)) & 63).to(tl.float32)
        qp = (blk + 16).to(tl.pointer_type(tl.uint32))
        W = tl.load(qp[:, :, None, None] + (8 * g64)[None, None, :, None] + wd[None, None, None, :],
                    mask=m2[:, :, None, None], other=0, eviction_policy="evict_first")  # [BN, NB, 4, 8]
        xo = sb[:, None, None] * 256 + (64 * g64)[None, :, None] + 4 * wd[None, None, :]  # [NB, 4, 8]
        xm = sm[:, None, None]
        for kq in tl.static_range(4):
            Wk = (W >> (16 * (kq // 2))) | 0x4B000000
            sft = 8 * (kq % 2)
            lo = (Wk & ((15 << sft) | 0x4B000000)).to(tl.float32, bitcast=True) - 8388608.0  # q * 2^sft
            hi = (Wk & ((240 << sft) | 0x4B000000)).to(tl.float32, bitcast=True) - 8388608.0
            for r in tl.static_range(R):
                xl = tl.load(xp + r * K + xo + kq, mask=xm, other=0.0).to(tl.float32)  # [NB, 4, 8]
                xh = tl.load(xp + r * K + xo + (kq + 32), mask=xm, other=0.0).to(tl.float32)
                dl = tl.sum(lo * (xl * (1.0 / (1 << sft)))[None], axis=3)  # [BN, NB, 4]
                dh = tl.sum(hi * (xh * (1.0 / (16 << sft)))[None], axis=3)
                part = a_lo * dl + a_hi * dh - (b_lo * tl.sum(xl, axis=2)[None] + b_hi * tl.sum(xh, axis=2)[None])
                acc = _add_row(acc, tl.sum(tl.sum(part, axis=2), axis=1), r, RP)
        return acc

    @triton.jit
    def q6k_rows(acc, row, xp, K, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr,
                 R: tl.constexpr, RP: tl.constexpr):
        """Superblocks b0 .. b0+NB of BN rows of Q6_K blocks against R rows of x (kquant_triton.q6k_tile's
        decoding, once for all rows)."""
        G = tl.arange(0, 8)
        h = G // 4
        jj = (G // 2) % 2
        half = G % 2
        wk = (2 * tl.arange(0, 8))[:, None] + tl.arange(0, 2)[None, :]
        sb = (b0 + tl.arange(0, NB)).to(tl.int64)
        if EVEN:
            sm = tl.full([NB], 1, tl.int1)
        else:
            sm = sb < nsb
        m2 = sm[None, :]
        blk = row[:, None] + sb[None, :] * 210
        d = _f16(blk + 208, m2)[:, :, None]
        sidx = (G + 4 * h).to(tl.int64)[None, None, :]
        m3 = m2[:, :, None]
        sc_lo = d * tl.load(blk[:, :, None] + 192 + sidx, mask=m3, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        sc_hi = d * tl.load(blk[:, :, None] + 196 + sidx, mask=m3, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        qlo = ((16 * G)[:, None, None] + wk[None]).to(tl.int64)
        qho = (128 + (32 * h + 16 * half)[:, None, None] + wk[None]).to(tl.int64)
        m5 = m2[:, :, None, None, None]
        b5 = blk[:, :, None, None, None]
        ql = tl.load(b5 + qlo[None, None], mask=m5, other=0, eviction_policy="evict_first").to(tl.int32)
        qh = tl.load(b5 + qho[None, None], mask=m5, other=0, eviction_policy="evict_first").to(tl.int32)
        T = qh << (4 - 2 * jj)[None, None, :, None, None]
        lo = ((ql & 15) | (T & 0x30) | 0x4B000000).to(tl.float32, bitcast=True) - 8388640.0
        hi = ((ql & 0xF0) | (T & 0x300) | 0x4B000000).to(tl.float32, bitcast=True) - 8389120.0
        wlo = ((128 * h + 32 * jj + 16 * half)[:, None, None] + wk[None]).to(tl.int64)
        xo = sb[:, None, None, None] * 256 + wlo[None]
        xm = sm[:, None, None, None]
        for r in tl.static_range(R):
            xl = tl.load(xp + r * K + xo, mask=xm, other=0.0).to(tl.float32)
            xh = tl.load(xp + r * K + xo + 64, mask=xm, other=0.0).to(tl.float32) * 0.0625
            part = tl.sum(lo * xl[None], axis=4) * sc_lo[:, :, :, None] \
                + tl.sum(hi * xh[None], axis=4) * sc_hi[:, :, :, None]  # [BN, NB, 8, 8]
            acc = _add_row(acc, tl.sum(tl.sum(tl.sum(part, axis=1), axis=1), axis=1), r, RP)
        return acc

    @triton.jit
    def _gemv_rows_kernel(x, w, out, N, K, row_bytes, QT: tl.constexpr, BN: tl.constexpr, KW: tl.constexpr,
                          EVEN: tl.constexpr, R: tl.constexpr, RP: tl.constexpr):
        """out[r] = x[r] @ W.T for the R rows of x, BN rows of W a program."""
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nm = n < N
        n = tl.minimum(n, N - 1).to(tl.int64)
        row = w + n * row_bytes  # [BN]
        acc = tl.zeros([RP, BN], dtype=tl.float32)
        for it in range(0, tl.cdiv(K, KW)):
            if QT == 12:  # Q4_K
                acc = q4k_rows(acc, row, x, K, it * (KW // 256), K // 256, BN, KW // 256, EVEN, R, RP)
            elif QT == 14:  # Q6_K
                acc = q6k_rows(acc, row, x, K, it * (KW // 256), K // 256, BN, KW // 256, EVEN, R, RP)
            else:  # Q8_0
                acc = q8_0_rows(acc, row, x, K, it * (KW // 32), K // 32, BN, KW // 32, EVEN, R, RP)
        r = tl.arange(0, RP).to(tl.int64)
        tl.store(out + r[:, None] * N + n[None, :], acc.to(out.dtype.element_ty), mask=(r < R)[:, None] & nm[None, :])


def usable(T: int, qtype, K: int) -> bool:
    """Whether gemv_rows takes T rows of x against a weight of this format and row length."""
    return triton is not None and ROWS_MIN <= T <= ROWS_MAX and qtype in FORMATS \
        and K % (32 if qtype == Q.Q8_0 else 256) == 0


def plan(N: int, K: int, device: torch.device, block_n: int | None = None) -> tuple[int, int, bool]:
    """(BN rows of W a program, KW weights a row per iteration, EVEN: KW divides K): one-warp programs as the
    one-row kernel's plan (`expert_triton.plan`), BN halved from 8 until the launch has PROGRAMS_PER_SM programs
    per SM (the rows of x no longer multiply the programs), and within TILE weights decoded at a time."""
    from strata.ops import expert_triton

    kw = min(KW, K & -K)
    if block_n:
        return block_n, kw, K % kw == 0
    sms = expert_triton._sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 1
    bn = 8
    while bn > 1 and (bn * kw > TILE or triton.cdiv(N, bn) < expert_triton.PROGRAMS_PER_SM * sms):
        bn //= 2
    return bn, kw, K % kw == 0


def gemv_rows(x2d: torch.Tensor, w: QTensor, block_n: int | None = None) -> torch.Tensor:
    """x2d [T, K] (contiguous, 2 <= T <= ROWS_MAX) @ W.T -> [T, N] in x2d's dtype (float32 for integer x), W's
    blocks decoded once for the T rows."""
    T, K = x2d.shape
    N = w.shape[0]
    out = torch.empty(T, N, dtype=x2d.dtype if x2d.dtype.is_floating_point else torch.float32, device=x2d.device)
    bn, kw, even = plan(N, K, x2d.device, block_n)
    _gemv_rows_kernel[(triton.cdiv(N, bn),)](x2d, w.raw, out, N, K, w.raw.shape[-1], QT=int(w.qtype), BN=bn, KW=kw,
                                              EVEN=even, R=T, RP=triton.next_power_of_2(T), num_warps=1)
    return out
