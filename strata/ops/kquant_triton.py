"""Triton tiles of Q8_0, the K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and the older Q4_0 / Q4_1 / Q5_0 / Q5_1 for the fused expert kernels and the decode GEMV
(`strata.ops.expert_triton`), read in place from the GGML blocks, no dequantized copy.

Each tile takes BN rows (byte pointers) of NB consecutive blocks, decodes them in registers and returns the BN dot
products with x (xp: a pointer to the row's K activations). Block layouts, as gguf-py dequantizes them:

    Q8_0    34 bytes / 32: f16 d, 32 int8; weight = d q
    Q2_K    84 bytes / 256: 16 bytes of 4-bit scale | 4-bit min (one per 16 weights), 64 bytes of 2-bit values,
           f16 d, f16 dmin; weight = d sc q - dmin m
    Q3_K   110 bytes / 256: 32 bytes hmask (a third bit per weight), 64 bytes of 2-bit values, 12 bytes of 6-bit
           scales, f16 d; weight = d (s - 32) (q + 4 h - 4)
    Q4_0, Q4_1, Q5_0, Q5_1   18 / 20 / 22 / 24 bytes / 32: f16 d, [f16 m], [u32 fifth bits], 16 nibble bytes (q32_tile)
    Q4_K   144 bytes / 256: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles (byte c: low
           nibble = weight 64 (c // 32) + c % 32, high nibble = that + 32); weight = d sc q - dmin m
    Q5_K   176 bytes / 256: Q4_K's header, 32 bytes qh of fifth bits, then the 128 nibble bytes; q += 16 fifth bit
    Q6_K   210 bytes / 256: 128 bytes ql of low nibbles, 64 bytes qh of 2-bit high parts, 16 int8 scales (one per
           16 weights), f16 d; weight = d scale (q - 32)

Integers become floats through the exponent bits (the bits 0x4B000000 | v are the float 2^23 + v, exact), never an
I2F instruction, which sm_90 issues at 16 per clock per SM against 128 FMAs (strata.ops.expert_triton says why the
tiles look as they do). Reference twins: gguf-py's dequantizers (tests/experts/test_expert_triton.py and
tests/ops/test_qgemv_interpret.py run these tiles in Triton's interpreter against them).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:

    @triton.jit
    def _f16(p, m):
        """The f16 at 2-byte aligned byte pointers p as float32 (0 where m is false)."""
        return tl.load(p.to(tl.pointer_type(tl.float16)), mask=m, other=0.0).to(tl.float32)

    @triton.jit
    def _u32(p, m):
        """The little-endian u32 at 4-byte aligned byte pointers p (0 where m is false)."""
        return tl.load(p.to(tl.pointer_type(tl.uint32)), mask=m, other=0)

    @triton.jit
    def q8_0_tile(row, xp, b0, nblk, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        """Blocks b0 .. b0+NB (those < nblk) of BN rows of Q8_0 blocks (row: [BN] byte pointers) against x
        (xp: pointer to K floats) -> [BN] float32.

        The 32 quants of a block are read as 16 byte pairs [.., 16, 2]: a thread holds a pair (its 2-byte load),
        sums it, scales the pair by d and accumulates over blocks in registers; lanes are reduced once at the end.
        """
        k = tl.arange(0, 2).to(tl.int64)
        c = (2 * tl.arange(0, 16).to(tl.int64))[:, None] + k[None, :]  # [16, 2] quant index in the block
        j = (b0 + tl.arange(0, NB)).to(tl.int64)  # [NB] block index (int64: addresses fold into immediates)
        if EVEN:
            jm = tl.full([NB], 1, tl.int1)
        else:
            jm = j < nblk
        blk = row[:, None] + j[None, :] * 34  # [BN, NB] byte pointers to the blocks
        d = _f16(blk, jm[None, :])  # [BN, NB]
        q = tl.load(blk[:, :, None, None] + 2 + c[None, None], mask=jm[None, :, None, None], other=0,
                    eviction_policy="evict_first")  # [BN, NB, 16, 2] the int8 as bytes
        xv = tl.load(xp + j[:, None, None] * 32 + c[None], mask=jm[:, None, None], other=0.0).to(tl.float32)
        # the sign-extended int8 plus the bits of 1.5 * 2^23 is the float 1.5 * 2^23 + q (exact)
        qs = (q.to(tl.int8, bitcast=True).to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
        t = tl.sum(qs * xv[None], axis=3) * d[:, :, None]  # [BN, NB, 16]
        return tl.sum(tl.sum(t, axis=1), axis=1)

    @triton.jit
    def q4k_tile(row, xp, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        """Superblocks b0 .. b0+NB (those < nsb) of BN rows of Q4_K blocks against x -> [BN] float32."""
        return _k45_tile(row, xp, b0, nsb, BN, NB, EVEN, False)

    @triton.jit
    def q5k_tile(row, xp, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        """Superblocks b0 .. b0+NB (those < nsb) of BN rows of Q5_K blocks against x -> [BN] float32."""
        return _k45_tile(row, xp, b0, nsb, BN, NB, EVEN, True)

    @triton.jit
    def k4_scale_words(blk, m2):
        """Q4_K's / Q5_K's 12 scale bytes (at blk + 4) -> (scale word, min word [BN, NB, 4], shift [1, 1, 4]): the
        6-bit scale / min of sub-block 2 g at bit sh of group g's words, of 2 g + 1 at sh + 8 (llama.cpp's
        get_scale_min_k4, 4 at a time: j < 4: s[j] & 63, s[j+4] & 63; j >= 4: (s[j+4] & 15) | (s[j-4] >> 6) << 4,
        (s[j+4] >> 4) | (s[j] >> 6) << 4)."""
        g = tl.arange(0, 4)
        s0 = _u32(blk + 4, m2)  # [BN, NB] scale bytes 0-3
        s1 = _u32(blk + 8, m2)  # 4-7
        s2 = _u32(blk + 12, m2)  # 8-11
        sc_a = s0 & 0x3F3F3F3F
        mn_a = s1 & 0x3F3F3F3F
        sc_b = (s2 & 0x0F0F0F0F) | ((s0 >> 2) & 0x30303030)
        mn_b = ((s2 >> 4) & 0x0F0F0F0F) | ((s1 >> 2) & 0x30303030)
        first = (g < 2)[None, None, :]  # groups 0, 1 hold sub-blocks 0-3 (word a), groups 2, 3 sub-blocks 4-7
        scw = tl.where(first, sc_a[:, :, None], sc_b[:, :, None])  # [BN, NB, 4]
        mnw = tl.where(first, mn_a[:, :, None], mn_b[:, :, None])
        return scw, mnw, (16 * (g % 2))[None, None, :]

    @triton.jit
    def _k45_tile(row, xp, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr, FIVE: tl.constexpr):
        """Q4_K (FIVE false) or Q5_K superblocks against x -> [BN] float32.

        The 128 quant bytes are read as u32 words [.., 4 groups, 8 words] (16-byte loads). Byte k of a word holds
        lane 4w + k of its group: low nibble = sub-block 2g, high nibble = 2g + 1. A nibble is turned into a float
        where it lies: (W & 0xF << 8k) | 0x4B000000 is the float 2^23 + q * 256^k (bytes 2 and 3 are first moved
        down two bytes, one shift per word), so one logic op and one add per weight; the power of two goes into x.
        Q5_K is Q4_K (the same header and 12 scale bytes) with a fifth bit per weight: 32 bytes qh at 16, then the
        nibbles at 48. Nibble byte c = 32g + 4w + k holds weights 64g + 4w + k and that + 32; their fifth bits are
        bits 2g and 2g + 1 of qh byte 4w + k (qh word w, byte k), each adding 16 to its weight's q.
        """
        g = tl.arange(0, 4)
        g64 = g.to(tl.int64)
        wd = tl.arange(0, 8).to(tl.int64)
        sb = (b0 + tl.arange(0, NB)).to(tl.int64)  # [NB] superblock index
        if EVEN:
            sm = tl.full([NB], 1, tl.int1)
        else:
            sm = sb < nsb
        m2 = sm[None, :]
        if FIVE:
            blk = row[:, None] + sb[None, :] * 176  # [BN, NB]
        else:
            blk = row[:, None] + sb[None, :] * 144
        d = _f16(blk, m2)[:, :, None]  # [BN, NB, 1]
        dmin = _f16(blk + 2, m2)[:, :, None]
        scw, mnw, sh = k4_scale_words(blk, m2)
        a_lo = d * ((scw >> sh) & 63).to(tl.float32)  # [BN, NB, 4] d * scale of sub-block 2g
        a_hi = d * ((scw >> (sh + 8)) & 63).to(tl.float32)  # of sub-block 2g+1
        b_lo = dmin * ((mnw >> sh) & 63).to(tl.float32)
        b_hi = dmin * ((mnw >> (sh + 8)) & 63).to(tl.float32)
        if FIVE:
            qp = (blk + 48).to(tl.pointer_type(tl.uint32))
            hp = (blk + 16).to(tl.pointer_type(tl.uint32))
            H = tl.load(hp[:, :, None] + wd[None, None, :], mask=m2[:, :, None], other=0,
                        eviction_policy="evict_first")[:, :, None, :]  # [BN, NB, 1, 8] qh words
        else:
            qp = (blk + 16).to(tl.pointer_type(tl.uint32))  # [BN, NB] word pointers to the quants
        g2 = (2 * g)[None, None, :, None]  # [1, 1, 4, 1] the low nibble's bit in a qh byte
        W = tl.load(qp[:, :, None, None] + (8 * g64)[None, None, :, None] + wd[None, None, None, :],
                    mask=m2[:, :, None, None], other=0, eviction_policy="evict_first")  # [BN, NB, 4, 8]
        xo = sb[:, None, None] * 256 + (64 * g64)[None, :, None] + 4 * wd[None, None, :]  # [NB, 4, 8] lane 4w
        xm = sm[:, None, None]
        dl = tl.zeros([BN, NB, 4, 8], dtype=tl.float32)  # sum over the word's 4 lanes of q * x, sub-block 2g
        dh = tl.zeros([BN, NB, 4, 8], dtype=tl.float32)  # the same for sub-block 2g+1
        sl = tl.zeros([NB, 4, 8], dtype=tl.float32)  # sum of x, shared by the rows
        shs = tl.zeros([NB, 4, 8], dtype=tl.float32)
        for kq in tl.static_range(4):
            # bytes 2, 3 moved to 0, 1 (a high nibble must stay below bit 23), OR-ed with the exponent bits once
            Wk = (W >> (16 * (kq // 2))) | 0x4B000000
            sft = 8 * (kq % 2)  # bit position of the byte in Wk
            xl = tl.load(xp + xo + kq, mask=xm, other=0.0).to(tl.float32)  # [NB, 4, 8]
            xh = tl.load(xp + xo + (kq + 32), mask=xm, other=0.0).to(tl.float32)
            sl += xl
            shs += xh
            # one AND with a single immediate per weight (no second constant held in a register)
            lo = (Wk & ((15 << sft) | 0x4B000000)).to(tl.float32, bitcast=True) - 8388608.0  # q * 2^sft
            hi = (Wk & ((240 << sft) | 0x4B000000)).to(tl.float32, bitcast=True) - 8388608.0  # q * 2^(sft+4)
            if FIVE:
                hb = H >> (8 * kq + g2)  # bit 0: the low nibble's fifth bit, bit 1: the high nibble's
                dl += (lo * (1.0 / (1 << sft)) + ((hb & 1) * 16).to(tl.float32)) * xl[None]
                dh += (hi * (1.0 / (16 << sft)) + (hb & 2).to(tl.float32) * 8.0) * xh[None]
            else:
                dl += lo * (xl * (1.0 / (1 << sft)))[None]
                dh += hi * (xh * (1.0 / (16 << sft)))[None]
        sl3 = tl.sum(sl, axis=2)[None]  # [1, NB, 4]
        sh3 = tl.sum(shs, axis=2)[None]
        part = a_lo * tl.sum(dl, axis=3) + a_hi * tl.sum(dh, axis=3) - (b_lo * sl3 + b_hi * sh3)  # [BN, NB, 4]
        return tl.sum(tl.sum(part, axis=2), axis=1)

    @triton.jit
    def q6k_tile(row, xp, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        """Superblocks b0 .. b0+NB (those < nsb) of BN rows of Q6_K blocks against x -> [BN] float32.

        ql byte c = 64h + 32j + l (llama.cpp's dequantize_row_q6_K): low nibble = weight 128h + 32j + l, high
        nibble = that + 64; their 2 high bits sit in qh byte 32h + l at bits 2j and 2j + 4. Here c = 16G + 2w + k
        (G = 4h + 2j + half, l = 16 half + 2w + k): a thread holds the byte pair k. The low nibble's scale (one per
        16 weights) is G + 4h, the high nibble's G + 4h + 4. T = qh << (4 - 2j) puts the low nibble's 2 bits at
        bits 4-5 and the high nibble's at bits 8-9, next to (ql & 0xF) and (ql & 0xF0): two logic ops make each
        6-bit value in place (the high one times 16).
        """
        G = tl.arange(0, 8)
        h = G // 4
        jj = (G // 2) % 2
        half = G % 2
        wk = (2 * tl.arange(0, 8))[:, None] + tl.arange(0, 2)[None, :]  # [8, 2] byte within the 16 of G
        sb = (b0 + tl.arange(0, NB)).to(tl.int64)
        if EVEN:
            sm = tl.full([NB], 1, tl.int1)
        else:
            sm = sb < nsb
        m2 = sm[None, :]
        blk = row[:, None] + sb[None, :] * 210  # [BN, NB]
        d = _f16(blk + 208, m2)[:, :, None]  # [BN, NB, 1]
        sidx = (G + 4 * h).to(tl.int64)[None, None, :]  # [1, 1, 8] scale of the low nibbles of G
        m3 = m2[:, :, None]
        sc_lo = d * tl.load(blk[:, :, None] + 192 + sidx, mask=m3, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        sc_hi = d * tl.load(blk[:, :, None] + 196 + sidx, mask=m3, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        qlo = ((16 * G)[:, None, None] + wk[None]).to(tl.int64)  # [8, 8, 2] ql byte
        qho = (128 + (32 * h + 16 * half)[:, None, None] + wk[None]).to(tl.int64)  # its qh byte
        m5 = m2[:, :, None, None, None]
        b5 = blk[:, :, None, None, None]
        ql = tl.load(b5 + qlo[None, None], mask=m5, other=0, eviction_policy="evict_first").to(tl.int32)
        qh = tl.load(b5 + qho[None, None], mask=m5, other=0, eviction_policy="evict_first").to(tl.int32)
        T = qh << (4 - 2 * jj)[None, None, :, None, None]  # [BN, NB, 8, 8, 2]
        lo = ((ql & 15) | (T & 0x30) | 0x4B000000).to(tl.float32, bitcast=True) - 8388640.0  # q - 32
        hi = ((ql & 0xF0) | (T & 0x300) | 0x4B000000).to(tl.float32, bitcast=True) - 8389120.0  # 16 (q - 32)
        wlo = ((128 * h + 32 * jj + 16 * half)[:, None, None] + wk[None]).to(tl.int64)  # [8, 8, 2] low nibble's x
        xo = sb[:, None, None, None] * 256 + wlo[None]
        xm = sm[:, None, None, None]
        xl = tl.load(xp + xo, mask=xm, other=0.0).to(tl.float32)  # [NB, 8, 8, 2]
        xh = tl.load(xp + xo + 64, mask=xm, other=0.0).to(tl.float32) * 0.0625
        # scale * q and its product with d are exact in float32 (|.| <= 128 * 32 * d)
        part = tl.sum(lo * xl[None], axis=4) * sc_lo[:, :, :, None] \
            + tl.sum(hi * xh[None], axis=4) * sc_hi[:, :, :, None]  # [BN, NB, 8, 8]
        return tl.sum(tl.sum(tl.sum(part, axis=1), axis=1), axis=1)

    @triton.jit
    def q2k_tile(row, xp, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        """Superblocks b0 .. b0+NB (those < nsb) of BN rows of Q2_K blocks against x -> [BN] float32."""
        return _k23_tile(row, xp, b0, nsb, BN, NB, EVEN, False)

    @triton.jit
    def q3k_tile(row, xp, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        """Superblocks b0 .. b0+NB (those < nsb) of BN rows of Q3_K blocks against x -> [BN] float32."""
        return _k23_tile(row, xp, b0, nsb, BN, NB, EVEN, True)

    @triton.jit
    def _k23_tile(row, xp, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr, THREE: tl.constexpr):
        """Q2_K (THREE false) or Q3_K superblocks against x -> [BN] float32.

        Both formats' 2-bit values: byte 32n + l (l = 0..31) of the 64 feeds weights 128n + 32j + l through bits
        2j, 2j + 1 (j = 0..3); the 16 groups of 16 weights are g = 8n + 2j + half (half = l // 16). Here a thread
        holds a byte pair of one c = 2n + half ([.., 4, 8, 2]: Q3_K's 110-byte blocks are only 2-byte aligned) and
        walks the four shifts j, each a group per c. Q2_K: w = d (sc & 15) q - dmin (sc >> 4) with byte g of the
        16 scale bytes, the mins times the group's sum of x. Q3_K: w = d (s - 32) (q + 4 h - 4), h bit 4n + j of
        hmask byte 16 half + l % 16, s 6-bit (low 4 bits: nibble g // 8 of byte 96 + g % 8, high 2: bits
        2 (g // 4) of byte 104 + g % 4). The 3-bit value q + 4h is OR-ed into the exponent bits of 2^23 (exact).
        """
        c = tl.arange(0, 4)
        n = c // 2
        half = c % 2
        wk = (2 * tl.arange(0, 8))[:, None] + tl.arange(0, 2)[None, :]  # [8, 2] l % 16
        sb = (b0 + tl.arange(0, NB)).to(tl.int64)
        if EVEN:
            sm = tl.full([NB], 1, tl.int1)
        else:
            sm = sb < nsb
        m2 = sm[None, :]
        m3 = m2[:, :, None]
        m5 = m2[:, :, None, None, None]
        if THREE:
            blk = row[:, None] + sb[None, :] * 110  # [BN, NB]
            qoff = 32
        else:
            blk = row[:, None] + sb[None, :] * 84
            qoff = 16
        b5 = blk[:, :, None, None, None]
        qo = (qoff + (16 * c)[:, None, None] + wk[None]).to(tl.int64)  # [4, 8, 2] its 2-bit byte
        Q = tl.load(b5 + qo[None, None], mask=m5, other=0, eviction_policy="evict_first").to(tl.int32)
        if THREE:
            d = _f16(blk + 108, m2)[:, :, None]  # [BN, NB, 1]
            ho = ((16 * half)[:, None, None] + wk[None]).to(tl.int64)
            H = tl.load(b5 + ho[None, None], mask=m5, other=0, eviction_policy="evict_first").to(tl.int32)
            H4 = (H >> (4 * n)[None, None, :, None, None]) << 2  # bit 4n + j at bit 2 + j
        else:
            d = _f16(blk + 80, m2)[:, :, None]
            dmin = _f16(blk + 82, m2)[:, :, None]
        xo = sb[:, None, None, None] * 256 + ((128 * n + 16 * half)[:, None, None] + wk[None]).to(tl.int64)[None]
        xm = sm[:, None, None, None]  # [NB, 1, 1, 1]
        acc = tl.zeros([BN, NB, 4], dtype=tl.float32)
        for j in tl.static_range(4):
            xj = tl.load(xp + xo + 32 * j, mask=xm, other=0.0).to(tl.float32)  # [NB, 4, 8, 2]
            g = (8 * n + 2 * j + half)[None, None, :]  # [1, 1, 4] each c's group
            if THREE:
                v = ((Q >> (2 * j)) & 3) | ((H4 >> j) & 4) | 0x4B000000
                q = v.to(tl.float32, bitcast=True) - 8388612.0  # q + 4h - 4
                dot = tl.sum(tl.sum(q * xj[None], axis=4), axis=3)  # [BN, NB, 4]
                lo = tl.load(blk[:, :, None] + 96 + g % 8, mask=m3, other=0).to(tl.int32)
                hi = tl.load(blk[:, :, None] + 104 + g % 4, mask=m3, other=0).to(tl.int32)
                s = ((lo >> (4 * (g // 8))) & 15) | (((hi >> (2 * (g // 4))) & 3) << 4)
                acc += (s - 32).to(tl.float32) * dot
            else:
                q = (((Q >> (2 * j)) & 3) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                dot = tl.sum(tl.sum(q * xj[None], axis=4), axis=3)
                sx = tl.sum(tl.sum(xj, axis=3), axis=2)[None]  # [1, NB, 4] the group's sum of x
                sc = tl.load(blk[:, :, None] + g, mask=m3, other=0).to(tl.int32)
                acc += d * (sc & 15).to(tl.float32) * dot - dmin * (sc >> 4).to(tl.float32) * sx
        if THREE:
            acc = acc * d
        return tl.sum(tl.sum(acc, axis=2), axis=1)

    @triton.jit
    def q32_tile(row, xp, b0, nblk, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr, FMT: tl.constexpr):
        """Blocks b0 .. b0+NB (those < nblk) of BN rows of Q4_0 (FMT 0), Q4_1 (1), Q5_0 (2) or Q5_1 (3) blocks
        against x -> [BN] float32.

        The 32-weight formats llama.cpp writes where 256-blocks do not fit a row (GLM-4.5-Air's 1,408-wide expert
        downs: Q5_0 in Q4_K_M files, Q5_1 in Q5_K_M ones, Q4_0 in Q2_K / Q3_K ones). Block: f16 d, [f16 m], [u32 qh
        of fifth bits], 16 nibble bytes (byte l: weights l (low) and l + 16 (high)); w = d (q - 8), d q + m,
        d (q - 16), d q + m. A thread holds one nibble byte of a block (both its weights); the offset (-8, -16)
        and m go through the block's sum of x. The blocks (18-24 bytes) are 2-byte aligned: qh is read as two u16.
        """
        # (arithmetic on the constexpr FMT: the block's size and the nibbles' offset past d, [m] and [qh])
        SIZE = 18 + 2 * FMT
        QOFF = 2 + 2 * (FMT % 2) + 4 * (FMT // 2)
        k = tl.arange(0, 16)
        j = (b0 + tl.arange(0, NB)).to(tl.int64)
        if EVEN:
            jm = tl.full([NB], 1, tl.int1)
        else:
            jm = j < nblk
        m2 = jm[None, :]
        blk = row[:, None] + j[None, :] * SIZE  # [BN, NB]
        d = _f16(blk, m2)
        q = tl.load(blk[:, :, None] + QOFF + k.to(tl.int64)[None, None, :], mask=m2[:, :, None], other=0,
                    eviction_policy="evict_first").to(tl.int32)  # [BN, NB, 16]
        lo = q & 15
        hi = q >> 4
        if FMT >= 2:  # Q5_0, Q5_1: the fifth bits
            hp = (blk + 2 + 2 * (FMT % 2)).to(tl.pointer_type(tl.uint16))
            h0 = tl.load(hp, mask=m2, other=0).to(tl.int32)[:, :, None]  # bits of weights 0-15
            h1 = tl.load(hp + 1, mask=m2, other=0).to(tl.int32)[:, :, None]  # 16-31
            lo = lo | (((h0 >> k[None, None, :]) & 1) << 4)
            hi = hi | (((h1 >> k[None, None, :]) & 1) << 4)
        xo = j[:, None] * 32 + k.to(tl.int64)[None, :]  # [NB, 16]
        xl = tl.load(xp + xo, mask=jm[:, None], other=0.0).to(tl.float32)
        xh = tl.load(xp + xo + 16, mask=jm[:, None], other=0.0).to(tl.float32)
        # the small integers as floats through the exponent bits (exact)
        fl = (lo | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        fh = (hi | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        s = tl.sum(fl * xl[None] + fh * xh[None], axis=2)  # [BN, NB]
        sx = tl.sum(xl + xh, axis=1)[None, :]  # [1, NB] the block's sum of x
        if FMT % 2 == 1:  # Q4_1, Q5_1: + m
            part = d * s + _f16(blk + 2, m2) * sx
        elif FMT == 2:
            part = d * (s - 16.0 * sx)
        else:
            part = d * (s - 8.0 * sx)
        return tl.sum(part, axis=1)
