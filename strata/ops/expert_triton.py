"""Fused expert FFN over a slot pool in Triton: Q4_K / Q6_K / Q8_0 blocks read straight from the slots, no
dequantized copy, two launches per MoE layer.

For each (pair p, block of output rows) a program reads the slot `slots[p]` (negative = a miss: the pair's
output is zero and no weight is read), walks the reduction dimension block by block, decodes the GGML blocks in registers and
accumulates in float32:

    kernel 1:  a[p] = silu(x[p] @ gate[slot].T) * (x[p] @ up[slot].T)      [P, ff]
    kernel 2:  y[p] = a[p] @ down[slot].T                                  [P, d]

Reference twin: `strata.ops.expert_gather.gather_expert_ffn` (tests run these kernels in Triton's
interpreter on the CPU; see tests/experts/test_expert_triton.py). Q4_K block (144 bytes / 256 weights): f16 d,
f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles (byte c of the 128: low nibble = weight
64*(c//32) + c%32, high nibble = that + 32). Q6_K block (210 bytes / 256 weights): 128 bytes ql of low
nibbles, 64 bytes qh of 2-bit high parts, 16 int8 scales (one per 16 weights), f16 d;
weight = d * scale * (q - 32). Q8_0 block (34 bytes / 32 weights): f16 d, 32 int8.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

Q = GGMLQuantizationType

try:  # Triton is optional: without it (or without a GPU) the torch grouped path runs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

SUPPORTED = frozenset({Q.Q4_K, Q.Q6_K, Q.Q8_0})
BLOCK_N = 16  # output rows per program


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _f16_at(base, off):
        """The little-endian f16 at byte pointer base + off (any alignment) as float32."""
        lo = tl.load(base + off).to(tl.uint16)
        hi = tl.load(base + off + 1).to(tl.uint16)
        return ((hi << 8) | lo).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _q4k_dot(row, xp, K, BN: tl.constexpr):
        """row: [BN] byte pointers to rows of Q4_K blocks; xp: pointer to x (float) of length K -> [BN] float32."""
        c = tl.arange(0, 128)
        i = c // 32  # pair of sub-blocks: low nibbles are sub-block 2i, high nibbles 2i+1
        l = c % 32
        acc = tl.zeros([BN], dtype=tl.float32)
        for sb in range(0, K // 256):
            blk = row + sb * 144  # [BN]
            d = _f16_at(blk, 0)  # [BN]
            dmin = _f16_at(blk, 2)
            b2 = blk[:, None] + 4  # scales start at byte 4
            lo_sub = 2 * i  # [128] in 0..6
            hi_sub = 2 * i + 1  # in 1..7
            # 6-bit scale/min of sub-block j: j < 4: s[j] & 63, s[j+4] & 63; else (s[j+4] & 15) | (s[j-4] >> 6) << 4,
            # (s[j+4] >> 4) | (s[j] >> 6) << 4  (llama.cpp's get_scale_min_k4)
            sj_lo = tl.load(b2 + lo_sub[None, :]).to(tl.int32)
            sj4_lo = tl.load(b2 + lo_sub[None, :] + 4).to(tl.int32)
            sjm4_lo = tl.load(b2 + tl.maximum(lo_sub - 4, 0)[None, :]).to(tl.int32)
            small_lo = (lo_sub < 4)[None, :]
            sc_lo = tl.where(small_lo, sj_lo & 63, (sj4_lo & 15) | ((sjm4_lo >> 6) << 4))
            mn_lo = tl.where(small_lo, sj4_lo & 63, (sj4_lo >> 4) | ((sj_lo >> 6) << 4))
            sj_hi = tl.load(b2 + hi_sub[None, :]).to(tl.int32)
            sj4_hi = tl.load(b2 + hi_sub[None, :] + 4).to(tl.int32)
            sjm4_hi = tl.load(b2 + tl.maximum(hi_sub - 4, 0)[None, :]).to(tl.int32)
            small_hi = (hi_sub < 4)[None, :]
            sc_hi = tl.where(small_hi, sj_hi & 63, (sj4_hi & 15) | ((sjm4_hi >> 6) << 4))
            mn_hi = tl.where(small_hi, sj4_hi & 63, (sj4_hi >> 4) | ((sj_hi >> 6) << 4))
            q = tl.load(blk[:, None] + 16 + c[None, :]).to(tl.int32)  # [BN, 128]
            ql = (q & 15).to(tl.float32)
            qh = (q >> 4).to(tl.float32)
            xl = tl.load(xp + sb * 256 + 64 * i + l).to(tl.float32)  # [128]
            xh = tl.load(xp + sb * 256 + 64 * i + 32 + l).to(tl.float32)
            wl = d[:, None] * sc_lo.to(tl.float32) * ql - dmin[:, None] * mn_lo.to(tl.float32)
            wh = d[:, None] * sc_hi.to(tl.float32) * qh - dmin[:, None] * mn_hi.to(tl.float32)
            acc += tl.sum(wl * xl[None, :] + wh * xh[None, :], axis=1)
        return acc

    @triton.jit
    def _q6k_dot(row, xp, K, BN: tl.constexpr):
        """row: [BN] byte pointers to rows of Q6_K blocks; xp: pointer to x (float) of length K -> [BN] float32.

        Byte c of ql (c = 64h + 32j + l; llama.cpp's dequantize_row_q6_K): low nibble = weight
        128h + 32j + l, high nibble = that + 64; their 2 high bits sit in qh byte 32h + l at bits 2j and 2j + 4.
        """
        c = tl.arange(0, 128)
        h = c // 64  # half of the block
        j = (c // 32) % 2
        l = c % 32
        w_lo = 128 * h + 32 * j + l  # [128] weight index of the low nibble; the high nibble's is w_lo + 64
        sh = 2 * j  # [128] shift of the low nibble's 2 high bits in qh
        acc = tl.zeros([BN], dtype=tl.float32)
        for sb in range(0, K // 256):
            blk = row[:, None] + sb * 210  # [BN, 1]
            d = _f16_at(row + sb * 210, 208)  # [BN]
            ql = tl.load(blk + c[None, :]).to(tl.int32)  # [BN, 128]
            qh = tl.load(blk + 128 + (32 * h + l)[None, :]).to(tl.int32)  # [BN, 128], each qh byte twice
            q_lo = ((ql & 15) | (((qh >> sh[None, :]) & 3) << 4)) - 32  # [BN, 128] in -32..31
            q_hi = ((ql >> 4) | (((qh >> (sh + 4)[None, :]) & 3) << 4)) - 32
            # one int8 scale per 16 weights
            sc_lo = tl.load(blk + 192 + (w_lo // 16)[None, :]).to(tl.int8, bitcast=True).to(tl.int32)
            sc_hi = tl.load(blk + 192 + (w_lo // 16 + 4)[None, :]).to(tl.int8, bitcast=True).to(tl.int32)
            xl = tl.load(xp + sb * 256 + w_lo).to(tl.float32)  # [128]
            xh = tl.load(xp + sb * 256 + w_lo + 64).to(tl.float32)
            # scale * q is an exact integer (|.| <= 128 * 32), so float32 loses nothing before d
            s = (sc_lo * q_lo).to(tl.float32) * xl[None, :] + (sc_hi * q_hi).to(tl.float32) * xh[None, :]
            acc += d * tl.sum(s, axis=1)
        return acc

    @triton.jit
    def _q8_0_dot(row, xp, K, BN: tl.constexpr):
        c = tl.arange(0, 32)
        acc = tl.zeros([BN], dtype=tl.float32)
        for b in range(0, K // 32):
            blk = row + b * 34
            d = _f16_at(blk, 0)
            q = tl.load(blk[:, None] + 2 + c[None, :]).to(tl.int8, bitcast=True).to(tl.float32)  # [BN, 32]
            xv = tl.load(xp + b * 32 + c).to(tl.float32)
            acc += d * tl.sum(q * xv[None, :], axis=1)
        return acc

    @triton.jit
    def _dot(row, xp, K, QT: tl.constexpr, BN: tl.constexpr):
        if QT == 12:  # Q4_K
            return _q4k_dot(row, xp, K, BN)
        elif QT == 14:  # Q6_K
            return _q6k_dot(row, xp, K, BN)
        else:  # Q8_0
            return _q8_0_dot(row, xp, K, BN)

    @triton.jit
    def _glu_kernel(x, gate, up, slots, out, N, K, g_slot_bytes, u_slot_bytes, g_row_bytes, u_row_bytes,
                    QG: tl.constexpr, QU: tl.constexpr, BN: tl.constexpr):
        p = tl.program_id(0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nm = n < N
        n = tl.minimum(n, N - 1)
        s = tl.load(slots + p).to(tl.int64)
        if s >= 0:
            xp = x + p * K
            g = _dot(gate + s * g_slot_bytes + n.to(tl.int64) * g_row_bytes, xp, K, QG, BN)
            u = _dot(up + s * u_slot_bytes + n.to(tl.int64) * u_row_bytes, xp, K, QU, BN)
            tl.store(out + p * N + n, g / (1.0 + tl.exp(-g)) * u, mask=nm)
        else:  # a miss: no weight is read
            tl.store(out + p * N + n, tl.zeros([BN], dtype=tl.float32), mask=nm)

    @triton.jit
    def _gemv_kernel(x, w, slots, out, N, K, slot_bytes, row_bytes, QT: tl.constexpr, BN: tl.constexpr):
        p = tl.program_id(0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nm = n < N
        n = tl.minimum(n, N - 1)
        s = tl.load(slots + p).to(tl.int64)
        if s >= 0:
            y = _dot(w + s * slot_bytes + n.to(tl.int64) * row_bytes, x + p * K, K, QT, BN)
            tl.store(out + p * N + n, y, mask=nm)
        else:
            tl.store(out + p * N + n, tl.zeros([BN], dtype=tl.float32), mask=nm)


def block_len(qtype) -> int:
    """Weights per block of a supported format (Q4_K and Q6_K: 256, Q8_0: 32)."""
    return 256 if qtype in (Q.Q4_K, Q.Q6_K) else 32


def supports(gate, up, down) -> bool:
    """Triton is importable and the pool's formats have kernels (K a whole number of blocks)."""
    if triton is None:
        return False
    for t in (gate, up, down):
        if t.qtype not in SUPPORTED or t.shape[-1] % block_len(t.qtype):
            return False
    return True


def triton_expert_ffn(x: torch.Tensor, gate, up, down, slots: torch.Tensor, block_n: int = BLOCK_N) -> torch.Tensor:
    """x [P, d], pools (QTensor [S, ff, d], [S, ff, d], [S, d, ff]), slots [P] (negative: output 0)
    -> [P, d] float32."""
    P, d = x.shape
    ff = gate.shape[1]
    x = x.contiguous()
    slots = slots.contiguous()
    a = torch.empty(P, ff, dtype=torch.float32, device=x.device)
    y = torch.empty(P, d, dtype=torch.float32, device=x.device)
    if P == 0:
        return y
    g, u, dn = gate.raw, up.raw, down.raw
    _glu_kernel[(P, triton.cdiv(ff, block_n))](
        x, g, u, slots, a, ff, d, g[0].numel(), u[0].numel(), g.shape[-1], u.shape[-1],
        QG=int(gate.qtype), QU=int(up.qtype), BN=block_n)
    _gemv_kernel[(P, triton.cdiv(d, block_n))](
        a, dn, slots, y, d, ff, dn[0].numel(), dn.shape[-1], QT=int(down.qtype), BN=block_n)
    return y
