"""The K-quants' and Q8_0's shared pieces of the dp4a tiles (strata.ops.dp4a_triton, which holds the flags, the
i-quants' tiles and the entry points the kernels call): the four-byte product `_dp4a` and the K-quants' tile bodies,
Q4_K / Q5_K (`_k45`), Q6_K (`_q6k`), Q2_K / Q3_K (`_k23`). What each tile computes is said in dp4a_triton's
docstring; these bodies read the activations as `quantize_rows` writes them.
"""

from __future__ import annotations

from strata.config import triton_interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    C_INTERP = tl.constexpr(triton_interpreting())
    from strata.ops.iquant_triton import _blocks, _f16v, _u32h
    from strata.ops.kquant_triton import k4_scale_words

    @triton.jit
    def _sbyte(a, sh: tl.constexpr):
        """The byte at bit sh of int32 words, sign-extended."""
        v = (a >> sh) & 255
        return v - ((v & 128) << 1)

    @triton.jit
    def _dp4a(a, b):
        """Sum of the four products of the signed bytes of int32 words a and b (PTX dp4a.s32.s32)."""
        if C_INTERP:  # the interpreter runs no PTX: the same sum byte by byte
            s = _sbyte(a, 0) * _sbyte(b, 0) + _sbyte(a, 8) * _sbyte(b, 8)
            return s + _sbyte(a, 16) * _sbyte(b, 16) + _sbyte(a, 24) * _sbyte(b, 24)
        else:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                             [a, b, tl.zeros_like(a)], dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def _k45(row, xq, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr, FIVE: tl.constexpr):
        # Q4_K, or Q5_K (FIVE). Group g of a superblock: its 32 quant bytes as 8 words, low nibbles sub-block 2 g
        # (weights 64 g + 4 w + k in byte k of word w), high nibbles sub-block 2 g + 1; quantize_rows' sub-blocks
        # 8 sb + 2 g and + 1. Q5_K: the same header, then 32 qh bytes (byte 4 w + k: bit j the fifth bit of that
        # weight of sub-block j) before the nibbles
        g = tl.arange(0, 4)
        wd = tl.arange(0, 8).to(tl.int64)
        sb, sm = _blocks(b0, nsb, NB, EVEN)
        m2 = sm[None, :]
        m4 = m2[:, :, None, None]
        if FIVE:
            blk = row[:, None] + sb[None, :] * 176  # [BN, NB]
        else:
            blk = row[:, None] + sb[None, :] * 144
        d = _f16v(blk, m2)[:, :, None]
        dmin = _f16v(blk + 2, m2)[:, :, None]
        scw, mnw, sh = k4_scale_words(blk, m2)  # [BN, NB, 4]: sub-block 2 g's at bit sh, 2 g + 1's at sh + 8
        if FIVE:
            wp = (blk + 48).to(tl.pointer_type(tl.uint32))[:, :, None, None]
        else:
            wp = (blk + 16).to(tl.pointer_type(tl.uint32))[:, :, None, None]
        W = tl.load(wp + (8 * g.to(tl.int64))[None, None, :, None] + wd[None, None, None, :], mask=m4, other=0,
                    eviction_policy="evict_first")  # [BN, NB, 4, 8]
        lo = W & 0x0F0F0F0F
        hi = (W >> 4) & 0x0F0F0F0F
        if FIVE:
            H = tl.load((blk + 16).to(tl.pointer_type(tl.uint32))[:, :, None, None] + wd[None, None, None, :],
                        mask=m4, other=0, eviction_policy="evict_first")  # [BN, NB, 1, 8] qh words
            g2 = (2 * g).to(tl.uint32)[None, None, :, None]
            lo = lo | (((H >> g2) & 0x01010101) << 4)
            hi = hi | (((H >> (g2 + 1)) & 0x01010101) << 4)
        lo = lo.to(tl.int32, bitcast=True)
        hi = hi.to(tl.int32, bitcast=True)
        xo = (sb[:, None] * 8 + 2 * g[None, :]) * 9  # [NB, 4] sub-block 2 g's words
        xm = sm[:, None, None]
        xl = tl.load(xq + xo[:, :, None] + wd[None, None, :], mask=xm, other=0)  # [NB, 4, 8]
        xh = tl.load(xq + xo[:, :, None] + 9 + wd[None, None, :], mask=xm, other=0)
        fl = tl.load(xq + xo + 8, mask=sm[:, None], other=0).to(tl.float32, bitcast=True)[None]  # [1, NB, 4]
        fh = tl.load(xq + xo + 17, mask=sm[:, None], other=0).to(tl.float32, bitcast=True)[None]
        one = tl.full([NB, 4, 8], 0x01010101, tl.int32)
        sl = tl.sum(_dp4a(one, xl), axis=2)[None].to(tl.float32) * fl  # [1, NB, 4] the sub-blocks' sums of x
        shs = tl.sum(_dp4a(one, xh), axis=2)[None].to(tl.float32) * fh
        dl = tl.sum(_dp4a(lo, xl[None]), axis=3) * ((scw >> sh) & 63).to(tl.int32)  # [BN, NB, 4] scale x sum of q x
        dh = tl.sum(_dp4a(hi, xh[None]), axis=3) * ((scw >> (sh + 8)) & 63).to(tl.int32)
        part = d * (dl.to(tl.float32) * fl + dh.to(tl.float32) * fh) \
            - dmin * (((mnw >> sh) & 63).to(tl.float32) * sl + ((mnw >> (sh + 8)) & 63).to(tl.float32) * shs)
        return tl.sum(tl.sum(part, axis=2), axis=1)

    @triton.jit
    def _q6k_part(ql, qh, SH: tl.constexpr, HS: tl.constexpr, scw, SB: tl.constexpr, xw, xsum, w):
        """One quarter j of both halves: 6-bit words from ql >> SH and qh's bits moved by HS (4 - 2 j: left if
        positive), against their x words; each word's scale is byte SB + w // 4 of scw (sign-extended)."""
        if HS >= 0:
            hb = (qh << HS) & 0x30303030
        else:
            hb = (qh >> -HS) & 0x30303030
        q = (((ql >> SH) & 0x0F0F0F0F) | hb).to(tl.int32, bitcast=True)
        sc = (((scw >> (8 * (SB + w // 4)).to(tl.uint32)) & 255).to(tl.int32) ^ 128) - 128
        return (_dp4a(q, xw[None]) - 32 * xsum[None]) * sc

    @triton.jit
    def _q6k(row, xq, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        # half h of a superblock (weights 128 h ..), word w (l = 4 w .. 4 w + 3; llama.cpp's dequantize_row_q6_K):
        # ql words A = 64 h + 4 w and B = A + 32, qh word 128 + 32 h + 4 w; quarter j (sub-block 4 h + j) takes the
        # low nibbles of A (j = 0), of B (1), the high ones of A (2), of B (3), and bits 2 j, 2 j + 1 of each qh
        # byte; value q - 32 with the int8 scale 192 + 8 h + 2 j + w // 4. 210-byte blocks: 2-byte aligned words
        hh = tl.arange(0, 2)[None, None, :, None]
        w = tl.arange(0, 8)[None, None, None, :]
        sb, sm = _blocks(b0, nsb, NB, EVEN)
        m2 = sm[None, :]
        m4 = m2[:, :, None, None]
        blk = row[:, None] + sb[None, :] * 210  # [BN, NB]
        d = _f16v(blk + 208, m2)
        b4 = blk[:, :, None, None]
        qa = _u32h(b4 + (64 * hh + 4 * w).to(tl.int64), m4)  # [BN, NB, 2, 8]
        qb = _u32h(b4 + (64 * hh + 32 + 4 * w).to(tl.int64), m4)
        qh = _u32h(b4 + (128 + 32 * hh + 4 * w).to(tl.int64), m4)
        s0 = _u32h(b4 + (192 + 8 * hh).to(tl.int64), m4)  # [BN, NB, 2, 1] scales 0-3 of the half
        s1 = _u32h(b4 + (196 + 8 * hh).to(tl.int64), m4)  # 4-7
        # quantize_rows' words of sub-block 8 sb + 4 h + j
        xo = (sb * 8)[:, None] + 4 * tl.arange(0, 2)[None, :]  # [NB, 2]
        wx = tl.arange(0, 8)[None, None, :]
        xm = sm[:, None]
        one = tl.full([NB, 2, 8], 0x01010101, tl.int32)
        x0 = tl.load(xq + (xo * 9)[:, :, None] + wx, mask=xm[:, :, None], other=0)  # [NB, 2, 8]
        x1 = tl.load(xq + ((xo + 1) * 9)[:, :, None] + wx, mask=xm[:, :, None], other=0)
        x2 = tl.load(xq + ((xo + 2) * 9)[:, :, None] + wx, mask=xm[:, :, None], other=0)
        x3 = tl.load(xq + ((xo + 3) * 9)[:, :, None] + wx, mask=xm[:, :, None], other=0)
        f0 = tl.load(xq + xo * 9 + 8, mask=xm, other=0).to(tl.float32, bitcast=True)[None]  # [1, NB, 2]
        f1 = tl.load(xq + (xo + 1) * 9 + 8, mask=xm, other=0).to(tl.float32, bitcast=True)[None]
        f2 = tl.load(xq + (xo + 2) * 9 + 8, mask=xm, other=0).to(tl.float32, bitcast=True)[None]
        f3 = tl.load(xq + (xo + 3) * 9 + 8, mask=xm, other=0).to(tl.float32, bitcast=True)[None]
        p0 = tl.sum(_q6k_part(qa, qh, 0, 4, s0, 0, x0, _dp4a(one, x0), w), axis=3).to(tl.float32) * f0
        p1 = tl.sum(_q6k_part(qb, qh, 0, 2, s0, 2, x1, _dp4a(one, x1), w), axis=3).to(tl.float32) * f1
        p2 = tl.sum(_q6k_part(qa, qh, 4, 0, s1, 0, x2, _dp4a(one, x2), w), axis=3).to(tl.float32) * f2
        p3 = tl.sum(_q6k_part(qb, qh, 4, -2, s1, 2, x3, _dp4a(one, x3), w), axis=3).to(tl.float32) * f3
        part = tl.sum(p0 + p1 + p2 + p3, axis=2) * d  # [BN, NB]
        return tl.sum(part, axis=1)

    @triton.jit
    def _k23(row, xq, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr, THREE: tl.constexpr):
        # Q2_K, or Q3_K (THREE). Half n of a superblock, word w (l = 4 w .. 4 w + 3): qs word qoff + 32 n + 4 w holds
        # weights 128 n + 32 j + l at bits 2 j, 2 j + 1 (quarter j = sub-block 4 n + j); group of 16 g = 8 n + 2 j +
        # w // 4. Q2_K: scale byte g (low nibble the scale, high the min): d sc q - dmin m. Q3_K: hmask word 4 w,
        # bit 4 n + j the third bit h; value q + 4 h - 4, scale s - 32 (6 bits: nibble g // 8 of byte 96 + g % 8,
        # bits 2 (g // 4) of byte 104 + g % 4). Both blocks read as 2-byte aligned words (Q3_K's 110 bytes)
        nn = tl.arange(0, 2)[None, None, :, None]
        w = tl.arange(0, 8)[None, None, None, :]
        sb, sm = _blocks(b0, nsb, NB, EVEN)
        m2 = sm[None, :]
        m4 = m2[:, :, None, None]
        if THREE:
            blk = row[:, None] + sb[None, :] * 110  # [BN, NB]
            d = _f16v(blk + 108, m2)[:, :, None]
            b4 = blk[:, :, None, None]
            QS = _u32h(b4 + (32 + 32 * nn + 4 * w).to(tl.int64), m4)  # [BN, NB, 2, 8]
            HM = _u32h(b4 + (4 * w).to(tl.int64), m4)  # [BN, NB, 1, 8]
        else:
            blk = row[:, None] + sb[None, :] * 84
            d = _f16v(blk + 80, m2)[:, :, None]
            dmin = _f16v(blk + 82, m2)[:, :, None]
            b4 = blk[:, :, None, None]
            QS = _u32h(b4 + (16 + 32 * nn + 4 * w).to(tl.int64), m4)
        xo = (sb * 8)[:, None] + 4 * tl.arange(0, 2)[None, :]  # [NB, 2] sub-block 4 n of quantize_rows' words
        xm = sm[:, None]
        wx = tl.arange(0, 8)[None, None, :]
        one = tl.full([NB, 2, 8], 0x01010101, tl.int32)
        acc = tl.zeros([BN, NB, 2], dtype=tl.float32)
        for j in tl.static_range(4):
            xw = tl.load(xq + ((xo + j) * 9)[:, :, None] + wx, mask=xm[:, :, None], other=0)  # [NB, 2, 8]
            xs = tl.load(xq + (xo + j) * 9 + 8, mask=xm, other=0).to(tl.float32, bitcast=True)[None]  # [1, NB, 2]
            xsum = _dp4a(one, xw)[None]  # [1, NB, 2, 8]
            q = (QS >> (2 * j)) & 0x03030303
            g = 8 * nn + 2 * j + w // 4  # [1, 1, 2, 8]
            if THREE:
                q = q | (((HM >> (4 * nn + j).to(tl.uint32)) & 0x01010101) << 2)
                dot = _dp4a(q.to(tl.int32, bitcast=True), xw[None]) - 4 * xsum
                lo = tl.load(b4 + (96 + g % 8).to(tl.int64), mask=m4, other=0).to(tl.int32)
                hi = tl.load(b4 + (104 + g % 4).to(tl.int64), mask=m4, other=0).to(tl.int32)
                sc = (((lo >> (4 * (g // 8))) & 15) | (((hi >> (2 * (g // 4))) & 3) << 4)) - 32
                acc += tl.sum(dot * sc, axis=3).to(tl.float32) * xs * d
            else:
                dot = _dp4a(q.to(tl.int32, bitcast=True), xw[None])
                sc = tl.load(b4 + g.to(tl.int64), mask=m4, other=0).to(tl.int32)  # [BN, NB, 2, 8]
                a = tl.sum(dot * (sc & 15), axis=3).to(tl.float32)
                b = tl.sum(xsum * (sc >> 4), axis=3).to(tl.float32)
                acc += (d * a - dmin * b) * xs
        return tl.sum(tl.sum(acc, axis=2), axis=1)
