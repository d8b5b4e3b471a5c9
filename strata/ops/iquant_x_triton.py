"""Triton lookup tiles of IQ2_XS, IQ3_S, IQ1_S and IQ1_M (llama.cpp's IQ2_XS, IQ3_S / IQ3_M and IQ1_S / IQ1_M files,
Unsloth's lowest UD mixes) for the fused expert kernels and the decode GEMV (`strata.ops.expert_triton`), the way
`strata.ops.iquant_triton`'s lookup tiles read IQ2_S and IQ3_XXS: a sub-block's 32 weights as one axis t = 8 l + j in
[BN, NB, 8, 32] tensors (the rank that compiles right on the H200), each weight's grid value and sign gathered from
the codebook table (`iquant_triton.table`: gguf-py's grids, T_IQ2XS / T_IQ3S / T_IQ1S). Block layouts, as gguf-py
dequantizes them:

    IQ2_XS   74 bytes / 256: f16 d, 32 u16 (a 9-bit grid index and a 7-bit sign index, 8 weights each), 8 scale
             bytes (low nibble: the sub-block's first 16 weights, high: the last 16); weight = d (0.5 + s) / 4 grid sign
    IQ3_S   110 bytes / 256: f16 d, 64 index bytes (4 weights each), 8 qh bytes (bit l of qh[ib]: the 9th bit of
             index 8 ib + l), 32 sign bytes (bit k of byte i: weight 8 i + k), 4 scale bytes (nibbles: sub-blocks
             2 i, 2 i + 1); weight = d (1 + 2 s) grid sign
    IQ1_S    50 bytes / 256: f16 d, 32 index bytes, 8 u16 qh (sub-block ib: index tops at bits 3 l, the scale at bits
             12-14, the delta's sign at 15); weight = d (2 s + 1) (grid + delta), grid in {-1, 0, 1}, delta +-1/8
    IQ1_M    56 bytes / 256: 32 index bytes, 16 qh bytes (a nibble per group of 8: 3 index bits and the delta's
             sign), 4 u16 of four 3-bit scales (one per 16 weights) whose top nibbles make up the f16 d

All four are only 2-byte aligned. Reference twins: the torch dequantizers of `strata.quant.iquants`
(tests/experts/test_expert_triton.py runs these tiles in Triton's interpreter). A GPU takes them once their GPU test
has passed there (`expert_triton.IQX_GPU_TESTED`).
"""

from __future__ import annotations

from strata.ops import iquant_triton

triton = iquant_triton.triton

if triton is not None:
    import triton.language as tl

    from strata.ops.iquant_triton import C_IQ1S, C_IQ2XS, C_IQ3S, C_KSIGNS, _blocks, _f16v, _u16

    @triton.jit
    def _x(xp, sb, sm, ib, t):
        """The activations of NB blocks as [NB, 8, 32] (sub-block ib, weight t) float32."""
        xo = sb[:, None, None] * 256 + 32 * ib[None, :, None] + t.to(tl.int64)[None, None, :]
        return tl.load(xp + xo, mask=sm[:, None, None], other=0.0).to(tl.float32)

    @triton.jit
    def iq2xs_tile(row, xp, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        ib = tl.arange(0, 8).to(tl.int64)
        t = tl.arange(0, 32)
        lg = t // 8
        j = t % 8
        sb, sm = _blocks(b0, nsb, NB, EVEN)
        m2 = sm[None, :]
        m3 = m2[:, :, None]
        m4 = m3[:, :, :, None]
        blk = row[:, None] + sb[None, :] * 74
        d = _f16v(blk, m2)
        q = _u16(blk[:, :, None, None] + 2 + 8 * ib[None, None, :, None] + 2 * lg.to(tl.int64)[None, None, None, :],
                 m4)  # [BN, NB, 8, 32] each weight's group word
        grid = tl.load(tab + C_IQ2XS + (q & 511) * 8 + j[None, None, None, :])
        sg = tl.load(tab + C_KSIGNS + (q >> 9) * 8 + j[None, None, None, :])
        sc = tl.load(blk[:, :, None] + 66 + ib[None, None, :], mask=m3, other=0).to(tl.int32)  # [BN, NB, 8]
        nib = (sc[:, :, :, None] >> (4 * (lg // 2))[None, None, None, :]) & 15
        db = d[:, :, None, None] * (0.5 + nib.to(tl.float32)) * 0.25
        part = tl.sum(grid * sg * db * _x(xp, sb, sm, ib, t)[None], axis=3)  # [BN, NB, 8]
        return tl.sum(tl.sum(part, axis=2), axis=1)

    @triton.jit
    def iq3s_tile(row, xp, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        ib = tl.arange(0, 8).to(tl.int64)
        t = tl.arange(0, 32)
        sb, sm = _blocks(b0, nsb, NB, EVEN)
        m2 = sm[None, :]
        m3 = m2[:, :, None]
        m4 = m3[:, :, :, None]
        blk = row[:, None] + sb[None, :] * 110
        d = _f16v(blk, m2)
        b4 = blk[:, :, None, None]
        lo = tl.load(b4 + 2 + 8 * ib[None, None, :, None] + (t // 4).to(tl.int64)[None, None, None, :], mask=m4,
                     other=0, eviction_policy="evict_first").to(tl.int32)  # [BN, NB, 8, 32] the index byte
        qh = tl.load(blk[:, :, None] + 66 + ib[None, None, :], mask=m3, other=0).to(tl.int32)  # [BN, NB, 8]
        gi = lo | (((qh[:, :, :, None] >> (t // 4)[None, None, None, :]) & 1) << 8)
        grid = tl.load(tab + C_IQ3S + gi * 4 + (t % 4)[None, None, None, :])
        sgb = tl.load(b4 + 74 + 4 * ib[None, None, :, None] + (t // 8).to(tl.int64)[None, None, None, :], mask=m4,
                      other=0, eviction_policy="evict_first").to(tl.int32)
        sg = 1.0 - 2.0 * ((sgb >> (t % 8)[None, None, None, :]) & 1).to(tl.float32)
        sc = tl.load(blk[:, :, None] + 106 + ib[None, None, :] // 2, mask=m3, other=0).to(tl.int32)
        db = d[:, :, None] * (1 + 2 * ((sc >> (4 * (ib % 2))[None, None, :]) & 15)).to(tl.float32)  # [BN, NB, 8]
        part = tl.sum(grid * sg * _x(xp, sb, sm, ib, t)[None], axis=3) * db
        return tl.sum(tl.sum(part, axis=2), axis=1)

    @triton.jit
    def iq1s_tile(row, xp, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        ib = tl.arange(0, 8).to(tl.int64)
        t = tl.arange(0, 32)
        lg = t // 8
        j = t % 8
        sb, sm = _blocks(b0, nsb, NB, EVEN)
        m2 = sm[None, :]
        m3 = m2[:, :, None]
        m4 = m3[:, :, :, None]
        blk = row[:, None] + sb[None, :] * 50
        d = _f16v(blk, m2)
        qh = _u16(blk[:, :, None] + 34 + 2 * ib[None, None, :], m3)  # [BN, NB, 8]
        lo = tl.load(blk[:, :, None, None] + 2 + 4 * ib[None, None, :, None] + lg.to(tl.int64)[None, None, None, :],
                     mask=m4, other=0, eviction_policy="evict_first").to(tl.int32)
        gi = lo | (((qh[:, :, :, None] >> (3 * lg)[None, None, None, :]) & 7) << 8)
        grid = tl.load(tab + C_IQ1S + gi * 8 + j[None, None, None, :])  # -1, 0, 1
        delta = tl.where((qh & 0x8000) != 0, -0.125, 0.125)[:, :, :, None]
        dl = d[:, :, None] * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)  # [BN, NB, 8]
        part = tl.sum((grid + delta) * _x(xp, sb, sm, ib, t)[None], axis=3) * dl
        return tl.sum(tl.sum(part, axis=2), axis=1)

    @triton.jit
    def iq1m_tile(row, xp, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        ib = tl.arange(0, 8).to(tl.int64)
        t = tl.arange(0, 32)
        lg = t // 8
        j = t % 8
        sb, sm = _blocks(b0, nsb, NB, EVEN)
        m2 = sm[None, :]
        m3 = m2[:, :, None]
        m4 = m3[:, :, :, None]
        blk = row[:, None] + sb[None, :] * 56
        s0, s1, s2, s3 = _u16(blk + 48, m2), _u16(blk + 50, m2), _u16(blk + 52, m2), _u16(blk + 54, m2)
        bits = (s0 >> 12) | ((s1 >> 8) & 0xF0) | ((s2 >> 4) & 0xF00) | (s3 & 0xF000)
        d = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)  # [BN, NB]
        k = (4 * ib[None, None, :, None] + lg.to(tl.int64)[None, None, None, :])  # [1, 1, 8, 32] the group
        b4 = blk[:, :, None, None]
        lo = tl.load(b4 + k, mask=m4, other=0, eviction_policy="evict_first").to(tl.int32)
        nib = (tl.load(b4 + 32 + k // 2, mask=m4, other=0, eviction_policy="evict_first").to(tl.int32)
               >> (4 * (k % 2)).to(tl.int32)) & 15
        grid = tl.load(tab + C_IQ1S + (lo | ((nib & 7) << 8)) * 8 + j[None, None, None, :])
        delta = tl.where((nib & 8) != 0, -0.125, 0.125)
        sw = _u16(blk[:, :, None] + 48 + 2 * (ib // 2)[None, None, :], m3)  # [BN, NB, 8]
        sh = (6 * (ib % 2))[None, None, :, None].to(tl.int32) + (3 * (lg // 2))[None, None, None, :]
        dl = d[:, :, None, None] * (2 * ((sw[:, :, :, None] >> sh) & 7) + 1).to(tl.float32)
        part = tl.sum((grid + delta) * dl * _x(xp, sb, sm, ib, t)[None], axis=3)
        return tl.sum(tl.sum(part, axis=2), axis=1)
