"""One-launch GGML dequantization in Triton (IQ2_XS, IQ3_S, IQ1_S and IQ1_M in `strata.ops.dequant_iqx_triton`): Q4_0,
Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_0, IQ2_XXS, IQ2_S, IQ3_XXS, IQ4_NL, IQ4_XS and
MXFP4 blocks (uint8) -> float32, bfloat16 or float16, bit-identical in float32 to the torch reference in
`strata.quant.dequant`.

The reference builds each chunk with ~15-20 elementwise torch ops (shifts, masks, casts, products), each a
kernel launch and a pass over memory; here one program decodes BB whole blocks in registers and writes them
once. `strata.quant.dequant.dequantize_flat` takes this path on CUDA for these formats.

Bit-exactness: the float math is the reference's, step for step -- f16 scales widened to float32, products
with the small quant integers (exact in float32) taken in the same order, e.g. Q4_K's (d * sc) * q - dmin * m
-- and launches disable FMA contraction (`enable_fp_fusion=False`), which would otherwise fuse a*b - c into
one rounding where torch rounds twice. Narrower outputs are the float32 values rounded to nearest even, as
torch's copy_ does. f16 fields are assembled from two byte loads, so any byte alignment of the input works.
Tests run these kernels in Triton's interpreter on the CPU (tests/ops/test_dequant_triton_interpret.py).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from strata.ops import registry

Q = GGMLQuantizationType

try:  # Triton is optional: without it (or without a GPU) the torch reference runs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NUM_WARPS = 4


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _u8(p, m):
        """The bytes at p as int32 (0 where m is false)."""
        return tl.load(p, mask=m, other=0).to(tl.int32)

    @triton.jit
    def _f16(p, m):
        """The little-endian f16 at byte pointers p (any alignment) as float32, exactly."""
        bits = _u8(p, m) | (_u8(p + 1, m) << 8)
        return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _store(p, y, m):
        """y (float32) into p in p's dtype, rounded to nearest even. bfloat16 is rounded by hand on the bits
        (what torch does; Triton's interpreter rounds bf16 differently from the GPU, this agrees on both)."""
        if p.dtype.element_ty == tl.bfloat16:
            bits = y.to(tl.uint32, bitcast=True)
            r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            r = tl.where(y != y, 0x7FC0, r)  # NaN stays NaN (rounding could carry it into inf)
            tl.store(p.to(tl.pointer_type(tl.uint16)), r.to(tl.uint16), mask=m)
        else:
            tl.store(p, y.to(p.dtype.element_ty), mask=m)

    @triton.jit
    def _k_scales(b, m, sub):
        """Q4_K/Q5_K 6-bit scale and min of sub-blocks `sub` [8] for block pointers b [BB, 1] -> [BB, 8] int32.
        Bytes 4..7 hold scales 0..3 (+ top bits of 4..7), 8..11 mins 0..3 (+ top bits), 12..15 the low
        nibbles of scales 4..7 and, high, of mins 4..7."""
        j = (sub % 4)[None, :]
        lo = (sub < 4)[None, :]
        sd = _u8(b + 4 + j, m)
        sm = _u8(b + 8 + j, m)
        smd = _u8(b + 12 + j, m)
        sc = tl.where(lo, sd & 0x3F, (smd & 0x0F) | ((sd >> 2) & 0x30))
        mn = tl.where(lo, sm & 0x3F, (smd >> 4) | ((sm >> 2) & 0x30))
        return sc, mn

    @triton.jit
    def _q8_0_kernel(src, dst, n_blocks, BB: tl.constexpr):
        # block (34 bytes / 32 weights): f16 d, 32 int8; w = q * d
        pid = tl.program_id(0).to(tl.int64)  # 64-bit program bases, 32-bit offsets within a program
        blk = tl.arange(0, BB)  # [BB]
        m = (pid * BB + blk < n_blocks)[:, None]  # [BB, 1]
        b = (src + pid * (BB * 34) + blk * 34)[:, None]
        c = tl.arange(0, 32)[None, :]  # [1, 32]
        d = _f16(b, m)  # [BB, 1]
        q = tl.load(b + 2 + c, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)  # [BB, 32]
        y = q * d
        _store(dst + pid * (BB * 32) + blk[:, None] * 32 + c, y, m)

    @triton.jit
    def _q4_0_kernel(src, dst, n_blocks, BB: tl.constexpr):
        # block (18 bytes / 32 weights): f16 d, 16 bytes; weight j is nibble j // 16 of byte j % 16
        pid = tl.program_id(0).to(tl.int64)
        blk = tl.arange(0, BB)
        m = (pid * BB + blk < n_blocks)[:, None]
        b = (src + pid * (BB * 18) + blk * 18)[:, None]
        j = tl.arange(0, 32)[None, :]
        d = _f16(b, m)
        q = (_u8(b + 2 + j % 16, m) >> (4 * (j // 16))) & 0x0F
        y = d * (q.to(tl.float32) - 8.0)
        _store(dst + pid * (BB * 32) + blk[:, None] * 32 + j, y, m)

    @triton.jit
    def _q32(src, dst, n_blocks, BB: tl.constexpr, FMT: tl.constexpr):
        # Q4_1 (FMT 1, 20 bytes: f16 d, f16 m, 16 nibble bytes; w = d * q + m), Q5_0 (2, 22 bytes: f16 d, u32 qh of
        # fifth bits, the nibbles; w = d * (q - 16)), Q5_1 (3, 24 bytes: d, m, qh, nibbles; w = d * q + m); weight
        # j is nibble j // 16 of byte j % 16, its fifth bit bit j of qh
        size = 18 + 2 * FMT
        pid = tl.program_id(0).to(tl.int64)
        blk = tl.arange(0, BB)
        m = (pid * BB + blk < n_blocks)[:, None]
        b = (src + pid * (BB * size) + blk * size)[:, None]
        j = tl.arange(0, 32)[None, :]
        d = _f16(b, m)
        qo = 2 + 2 * (FMT % 2) + 4 * (FMT // 2)  # the nibbles past d, [m] and [qh]
        q = (_u8(b + qo + j % 16, m) >> (4 * (j // 16))) & 0x0F
        if FMT >= 2:
            q = q | (((_u8(b + 2 + 2 * (FMT % 2) + j // 8, m) >> (j % 8)) & 1) << 4)
        if FMT == 2:
            y = d * (q.to(tl.float32) - 16.0)
        else:
            y = d * q.to(tl.float32) + _f16(b + 2, m)
        _store(dst + pid * (BB * 32) + blk[:, None] * 32 + j, y, m)

    @triton.jit
    def _q4_1_kernel(src, dst, n_blocks, BB: tl.constexpr):
        _q32(src, dst, n_blocks, BB, 1)

    @triton.jit
    def _q5_0_kernel(src, dst, n_blocks, BB: tl.constexpr):
        _q32(src, dst, n_blocks, BB, 2)

    @triton.jit
    def _q5_1_kernel(src, dst, n_blocks, BB: tl.constexpr):
        _q32(src, dst, n_blocks, BB, 3)

    @triton.jit
    def _q4_k_kernel(src, dst, n_blocks, BB: tl.constexpr):
        # block (144 bytes / 256 weights): f16 d, f16 dmin, 12 bytes of scales/mins, 128 bytes of nibbles;
        # sub-block g (32 weights) is nibble g % 2 of bytes 16 + 32 * (g // 2) + c; w = (d*sc) * q - dmin*mn
        pid = tl.program_id(0).to(tl.int64)
        blk = tl.arange(0, BB)
        m2 = (pid * BB + blk < n_blocks)[:, None]  # [BB, 1]
        b2 = (src + pid * (BB * 144) + blk * 144)[:, None]
        g = tl.arange(0, 8)
        c = tl.arange(0, 32)
        d = _f16(b2, m2)
        dmin = _f16(b2 + 2, m2)
        sc, mn = _k_scales(b2, m2, g)  # [BB, 8]
        dl = (d * sc.to(tl.float32))[:, :, None]  # [BB, 8, 1]
        ml = (dmin * mn.to(tl.float32))[:, :, None]
        m3 = m2[:, :, None]
        b3 = b2[:, :, None]
        off = (16 + 32 * (g // 2))[:, None] + c[None, :]  # [8, 32]
        q = (_u8(b3 + off[None], m3) >> (4 * (g % 2))[None, :, None]) & 0x0F  # [BB, 8, 32]
        y = dl * q.to(tl.float32) - ml
        o = (g * 32)[:, None] + c[None, :]
        _store(dst + pid * (BB * 256) + blk[:, None, None] * 256 + o[None], y, m3)

    @triton.jit
    def _q5_k_kernel(src, dst, n_blocks, BB: tl.constexpr):
        # block (176 bytes / 256 weights): as Q4_K, plus 32 bytes qh (bit g of byte c: the 5th bit of weight
        # 32*g + c) before the 128 bytes of nibbles
        pid = tl.program_id(0).to(tl.int64)
        blk = tl.arange(0, BB)
        m2 = (pid * BB + blk < n_blocks)[:, None]
        b2 = (src + pid * (BB * 176) + blk * 176)[:, None]
        g = tl.arange(0, 8)
        c = tl.arange(0, 32)
        d = _f16(b2, m2)
        dmin = _f16(b2 + 2, m2)
        sc, mn = _k_scales(b2, m2, g)
        dl = (d * sc.to(tl.float32))[:, :, None]
        ml = (dmin * mn.to(tl.float32))[:, :, None]
        m3 = m2[:, :, None]
        b3 = b2[:, :, None]
        off = (48 + 32 * (g // 2))[:, None] + c[None, :]  # [8, 32]
        ql = (_u8(b3 + off[None], m3) >> (4 * (g % 2))[None, :, None]) & 0x0F
        qh = (_u8(b3 + 16 + c[None, None, :], m3) >> g[None, :, None]) & 1
        y = dl * (ql | (qh << 4)).to(tl.float32) - ml
        o = (g * 32)[:, None] + c[None, :]
        _store(dst + pid * (BB * 256) + blk[:, None, None] * 256 + o[None], y, m3)

    @triton.jit
    def _q2_k_kernel(src, dst, n_blocks, BB: tl.constexpr):
        # block (84 bytes / 256 weights): 16 bytes scale | min << 4 (group g = weights 16g..16g+15), 64 bytes of
        # 2-bit values (weight 128n + 32j + l: bits 2j of byte 16 + 32n + l), f16 d, f16 dmin;
        # w = (d * sc) * q - dmin * mn
        pid = tl.program_id(0).to(tl.int64)
        blk = tl.arange(0, BB)
        m2 = (pid * BB + blk < n_blocks)[:, None]
        b2 = (src + pid * (BB * 84) + blk * 84)[:, None]
        g = tl.arange(0, 16)
        w = (16 * g)[:, None] + tl.arange(0, 16)[None, :]  # [16, 16] weight index
        d = _f16(b2 + 80, m2)
        dmin = _f16(b2 + 82, m2)
        s = _u8(b2 + g[None, :], m2)  # [BB, 16]
        dl = (d * (s & 15).to(tl.float32))[:, :, None]
        ml = (dmin * (s >> 4).to(tl.float32))[:, :, None]
        m3 = m2[:, :, None]
        b3 = b2[:, :, None]
        q = (_u8(b3 + (16 + 32 * (w // 128) + w % 32)[None], m3) >> (2 * ((w % 128) // 32))[None]) & 3
        y = dl * q.to(tl.float32) - ml
        _store(dst + pid * (BB * 256) + blk[:, None, None] * 256 + w[None], y, m3)

    @triton.jit
    def _q3_k_kernel(src, dst, n_blocks, BB: tl.constexpr):
        # block (110 bytes / 256 weights): 32 bytes hmask (weight 32k + l: bit k of byte l), 64 bytes of 2-bit
        # values (as Q2_K's, at 32), 12 bytes of 6-bit scales (group g: nibble g // 8 of byte 96 + g % 8, high
        # bits 2 (g // 4) of byte 104 + g % 4), f16 d; w = (d * (s - 32)) * (q - 4 * (1 - h))
        pid = tl.program_id(0).to(tl.int64)
        blk = tl.arange(0, BB)
        m2 = (pid * BB + blk < n_blocks)[:, None]
        b2 = (src + pid * (BB * 110) + blk * 110)[:, None]
        g = tl.arange(0, 16)
        w = (16 * g)[:, None] + tl.arange(0, 16)[None, :]
        d = _f16(b2 + 108, m2)
        lo = (_u8(b2 + 96 + (g % 8)[None, :], m2) >> (4 * (g // 8))[None, :]) & 15  # [BB, 16]
        hi = (_u8(b2 + 104 + (g % 4)[None, :], m2) >> (2 * (g // 4))[None, :]) & 3
        dl = (d * ((lo | (hi << 4)).to(tl.float32) - 32.0))[:, :, None]
        m3 = m2[:, :, None]
        b3 = b2[:, :, None]
        ql = (_u8(b3 + (32 + 32 * (w // 128) + w % 32)[None], m3) >> (2 * ((w % 128) // 32))[None]) & 3
        h = (_u8(b3 + (w % 32)[None], m3) >> (w // 32)[None]) & 1
        y = dl * (ql.to(tl.float32) - (h ^ 1).to(tl.float32) * 4.0)
        _store(dst + pid * (BB * 256) + blk[:, None, None] * 256 + w[None], y, m3)

    @triton.jit
    def _q6_k_kernel(src, dst, n_blocks, BB: tl.constexpr):
        # block (210 bytes / 256 weights): 128 bytes ql, 64 bytes qh, 16 int8 scales, f16 d. Weight
        # j = 128*h + 32*s + c (h half, s 0..3, c 0..31): low 4 bits = nibble s // 2 of ql[64*h + 32*(s%2) + c],
        # high 2 bits = bits 2s of qh[32*h + c]; scale j // 16; w = (d * scale) * (q - 32)
        pid = tl.program_id(0).to(tl.int64)
        blk = tl.arange(0, BB)
        m2 = (pid * BB + blk < n_blocks)[:, None]
        b2 = (src + pid * (BB * 210) + blk * 210)[:, None]
        t = tl.arange(0, 16)  # group of 16 weights: one scale each
        u = tl.arange(0, 16)
        d = _f16(b2 + 208, m2)
        sc = tl.load(b2 + 192 + t[None, :], mask=m2, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        dl = (d * sc)[:, :, None]  # [BB, 16, 1]
        j = (t * 16)[:, None] + u[None, :]  # [16, 16] weight index in the block
        h = j // 128
        s = (j % 128) // 32
        c = j % 32
        m3 = m2[:, :, None]
        b3 = b2[:, :, None]
        lo = (_u8(b3 + (64 * h + 32 * (s % 2) + c)[None], m3) >> (4 * (s // 2))[None]) & 0x0F
        hi = (_u8(b3 + (128 + 32 * h + c)[None], m3) >> (2 * s)[None]) & 0x03
        y = dl * ((lo | (hi << 4)).to(tl.float32) - 32.0)
        _store(dst + pid * (BB * 256) + blk[:, None, None] * 256 + j[None], y, m3)

    # The 16-value formats index a table (gguf-py's, as float32 on the device: strata.quant.iquants) with 4-bit
    # codes; the table is a kernel argument, read through L1 like the blocks.

    @triton.jit
    def _iq4_nl_kernel(src, dst, n_blocks, tab, BB: tl.constexpr):
        # block (18 bytes / 32 weights): f16 d, 16 bytes; weight j is code nibble j // 16 of byte j % 16;
        # w = d * tab[code]
        pid = tl.program_id(0).to(tl.int64)
        blk = tl.arange(0, BB)
        m = (pid * BB + blk < n_blocks)[:, None]
        b = (src + pid * (BB * 18) + blk * 18)[:, None]
        j = tl.arange(0, 32)[None, :]
        d = _f16(b, m)
        q = (_u8(b + 2 + j % 16, m) >> (4 * (j // 16))) & 0x0F
        y = d * tl.load(tab + q)
        _store(dst + pid * (BB * 32) + blk[:, None] * 32 + j, y, m)

    @triton.jit
    def _iq4_xs_kernel(src, dst, n_blocks, tab, BB: tl.constexpr):
        # block (136 bytes / 256 weights): f16 d, a uint16 of 2-bit high scales, 4 bytes of 4-bit low scales,
        # 128 bytes of codes. Sub-block g (32 weights): scale = (nibble g % 2 of byte 4 + g // 2
        # | bits 2g of the uint16 << 4) - 32; weight c is code nibble c // 16 of byte 8 + 16 g + c % 16;
        # w = (d * scale) * tab[code]
        pid = tl.program_id(0).to(tl.int64)
        blk = tl.arange(0, BB)
        m2 = (pid * BB + blk < n_blocks)[:, None]
        b2 = (src + pid * (BB * 136) + blk * 136)[:, None]
        g = tl.arange(0, 8)[None, :]
        c = tl.arange(0, 32)
        d = _f16(b2, m2)
        sh = (_u8(b2 + 2, m2) | (_u8(b2 + 3, m2) << 8)) >> (2 * g) & 0x03  # [BB, 8]
        sl = (_u8(b2 + 4 + g // 2, m2) >> (4 * (g % 2))) & 0x0F
        dl = (d * ((sl | (sh << 4)) - 32).to(tl.float32))[:, :, None]  # [BB, 8, 1]
        m3 = m2[:, :, None]
        off = (8 + 16 * g)[:, :, None] + (c % 16)[None, None, :]  # [1, 8, 32]
        q = (_u8(b2[:, :, None] + off, m3) >> (4 * (c // 16))[None, None, :]) & 0x0F
        y = dl * tl.load(tab + q)
        o = (g * 32)[:, :, None] + c[None, None, :]
        _store(dst + pid * (BB * 256) + blk[:, None, None] * 256 + o, y, m3)

    @triton.jit
    def _mxfp4_kernel(src, dst, n_blocks, tab, BB: tl.constexpr):
        # block (17 bytes / 32 weights): an E8M0 exponent e, 16 bytes of E2M1 codes (weight j: nibble j // 16
        # of byte 1 + j % 16); w = 2^(e-128) * tab[code] (the table is doubled), subnormal for e < 2
        pid = tl.program_id(0).to(tl.int64)
        blk = tl.arange(0, BB)
        m = (pid * BB + blk < n_blocks)[:, None]
        b = (src + pid * (BB * 17) + blk * 17)[:, None]
        j = tl.arange(0, 32)[None, :]
        e = _u8(b, m)
        bits = tl.where(e < 2, 0x00200000 << tl.minimum(e, 1), tl.maximum(e - 1, 0) << 23)
        d = bits.to(tl.float32, bitcast=True)
        q = (_u8(b + 1 + j % 16, m) >> (4 * (j // 16))) & 0x0F
        y = d * tl.load(tab + q)
        _store(dst + pid * (BB * 32) + blk[:, None] * 32 + j, y, m)

    @triton.jit
    def _u32(p, m):
        """The little-endian u32 at byte pointers p (any alignment), as int64 (its bits, never negative)."""
        return (_u8(p, m) | (_u8(p + 1, m) << 8) | (_u8(p + 2, m) << 16)).to(tl.int64) | (
            _u8(p + 3, m).to(tl.int64) << 24)

    @triton.jit
    def _iqxxs(src, dst, n_blocks, grid, signs, BB: tl.constexpr, THREE: tl.constexpr):
        # IQ2_XXS (66 bytes / 256 weights): f16 d, then per group g of 32 weights two u32: 4 grid indices (bytes,
        # 8 weights each) and 4 x 7-bit sign indices + a 4-bit scale (bits 28-31); w = ((d * (0.5 + scale)) *
        # 0.25 * grid) * sign. IQ3_XXS (98 bytes): f16 d, 64 grid index bytes (4 weights each, 8 a group), then per
        # group a u32 of sign indices and scale; factor 0.5. Weight t of g: sign ksigns[index t // 8][t % 8]
        pid = tl.program_id(0).to(tl.int64)
        blk = tl.arange(0, BB)
        m2 = (pid * BB + blk < n_blocks)[:, None]
        if THREE:
            b2 = (src + pid * (BB * 98) + blk * 98)[:, None]
        else:
            b2 = (src + pid * (BB * 66) + blk * 66)[:, None]
        g = tl.arange(0, 8)[None, :]
        t = tl.arange(0, 32)[None, None, :]
        d = _f16(b2, m2)
        if THREE:  # the group's sign indices and scale: after the 64 grid index bytes
            w1 = _u32(b2 + 66 + 4 * g, m2)  # [BB, 8]
            db = ((d * (0.5 + (w1 >> 28).to(tl.float32))) * 0.5)[:, :, None]
        else:  # the second u32 of the group's pair
            w1 = _u32(b2 + 2 + 8 * g + 4, m2)
            db = ((d * (0.5 + (w1 >> 28).to(tl.float32))) * 0.25)[:, :, None]
        m3 = m2[:, :, None]
        si = ((w1[:, :, None] >> (7 * (t // 8))) & 127).to(tl.int32)
        if THREE:  # a grid index byte a 4 weights
            gi = _u8(b2[:, :, None] + 2 + 8 * g[:, :, None] + t // 4, m3)  # [BB, 8, 32]
            y = (db * tl.load(grid + gi * 4 + t % 4)) * tl.load(signs + si * 8 + t % 8)
        else:  # a grid index byte a 8 weights
            gi = _u8(b2[:, :, None] + 2 + 8 * g[:, :, None] + t // 8, m3)
            y = (db * tl.load(grid + gi * 8 + t % 8)) * tl.load(signs + si * 8 + t % 8)
        o = (g * 32)[:, :, None] + t
        _store(dst + pid * (BB * 256) + blk[:, None, None] * 256 + o, y, m3)

    @triton.jit
    def _iq2_xxs_kernel(src, dst, n_blocks, grid, signs, BB: tl.constexpr):
        _iqxxs(src, dst, n_blocks, grid, signs, BB, False)

    @triton.jit
    def _iq3_xxs_kernel(src, dst, n_blocks, grid, signs, BB: tl.constexpr):
        _iqxxs(src, dst, n_blocks, grid, signs, BB, True)

    @triton.jit
    def _iq2_s_kernel(src, dst, n_blocks, grid, signs, BB: tl.constexpr):
        # block (82 bytes / 256 weights): f16 d, 32 grid index low bytes, 32 sign bytes, 8 bytes of index high
        # bits (2 a group of 8), 8 bytes of 4-bit scales (16 weights each, low nibble first). Weight w (group
        # w // 8): grid[low | high << 8][w % 8], sign bit w % 8 of sign byte w // 8;
        # w = ((d * (0.5 + scale)) * 0.25 * grid) * sign
        pid = tl.program_id(0).to(tl.int64)
        blk = tl.arange(0, BB)
        m2 = (pid * BB + blk < n_blocks)[:, None]
        b2 = (src + pid * (BB * 82) + blk * 82)[:, None]
        g = tl.arange(0, 8)[None, :, None]
        t = tl.arange(0, 32)[None, None, :]
        d = _f16(b2, m2)[:, :, None]
        m3 = m2[:, :, None]
        b3 = b2[:, :, None]
        gi = 4 * g + t // 8  # [1, 8, 32] the weight's group of 8
        idx = _u8(b3 + 2 + gi, m3) | (((_u8(b3 + 66 + gi // 4, m3) >> (2 * (gi % 4))) & 3) << 8)
        si = 2 * g + t // 16  # its scale's index
        nib = (_u8(b3 + 74 + si // 2, m3) >> (4 * (si % 2))) & 0x0F
        db = (d * (0.5 + nib.to(tl.float32))) * 0.25
        y = (db * tl.load(grid + idx * 8 + t % 8)) * tl.load(signs + _u8(b3 + 34 + gi, m3) * 8 + t % 8)
        o = g * 32 + t
        _store(dst + pid * (BB * 256) + blk[:, None, None] * 256 + o, y, m3)

    # qtype -> (kernel, bytes per block, weights per block, blocks per program): ~4K weights per program
    KERNELS = {
        Q.Q8_0: (_q8_0_kernel, 34, 32, 128),
        Q.Q4_0: (_q4_0_kernel, 18, 32, 128),
        Q.Q4_1: (_q4_1_kernel, 20, 32, 128),
        Q.Q5_0: (_q5_0_kernel, 22, 32, 128),
        Q.Q5_1: (_q5_1_kernel, 24, 32, 128),
        Q.Q2_K: (_q2_k_kernel, 84, 256, 16),
        Q.Q3_K: (_q3_k_kernel, 110, 256, 16),
        Q.Q4_K: (_q4_k_kernel, 144, 256, 16),
        Q.Q5_K: (_q5_k_kernel, 176, 256, 16),
        Q.Q6_K: (_q6_k_kernel, 210, 256, 16),
        Q.IQ4_NL: (_iq4_nl_kernel, 18, 32, 128),
        Q.IQ4_XS: (_iq4_xs_kernel, 136, 256, 16),
        Q.MXFP4: (_mxfp4_kernel, 17, 32, 128),
        Q.IQ2_XXS: (_iq2_xxs_kernel, 66, 256, 16),
        Q.IQ3_XXS: (_iq3_xxs_kernel, 98, 256, 16),
        Q.IQ2_S: (_iq2_s_kernel, 82, 256, 16),
    }
else:  # pragma: no cover
    KERNELS = {}

# formats whose kernel takes value tables (strata.quant.iquants' names for them) after n_blocks
TABLES = {Q.IQ4_NL: ("iq4nl",), Q.IQ4_XS: ("iq4nl",), Q.MXFP4: ("mxfp4",), Q.IQ2_XXS: ("IQ2_XXS", "ksigns"),
          Q.IQ3_XXS: ("IQ3_XXS", "ksigns"), Q.IQ2_S: ("IQ2_S", "bytesigns")}

from strata.ops import dequant_iqx_triton  # noqa: E402,F401  (IQ2_XS, IQ3_S, IQ1_S, IQ1_M: into KERNELS, TABLES)

SUPPORTED = frozenset(KERNELS)


# the IQ2_XXS, IQ3_XXS and IQ2_S kernels (a prompt chunk's i-quant experts, B3's recipe) are taken on a GPU once their GPU
# test has passed there (tests/ops/test_prefill_ops_gpu.py; tools/gpu/gated.sh); the interpreter runs them
IQ_GPU_TESTED = True
# likewise the Q2_K and Q3_K kernels, Q4_1 / Q5_0 / Q5_1's, and those of strata.ops.dequant_iqx_triton
K23_GPU_TESTED = True
Q32_GPU_TESTED = True
IQX_GPU_TESTED = True
_GATED = frozenset({Q.IQ2_XXS, Q.IQ3_XXS, Q.IQ2_S} if not IQ_GPU_TESTED else ()) | frozenset(
    {Q.Q2_K, Q.Q3_K} if not K23_GPU_TESTED else ()) | frozenset(
    {Q.Q4_1, Q.Q5_0, Q.Q5_1} if not Q32_GPU_TESTED else ()) | frozenset(
    {Q.IQ2_XS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M} if not IQX_GPU_TESTED else ())


def supports(qtype, dtype: torch.dtype, cuda: bool = False) -> bool:
    """Whether a kernel dequantizes `qtype` into `dtype` (cuda: on a GPU, where the gated ones wait for their
    GPU test)."""
    if cuda and qtype in _GATED:
        from strata.config import triton_interpreting

        return triton_interpreting()
    return qtype in KERNELS and dtype in OUT_DTYPES


def dequantize_blocks(blocks: torch.Tensor, qtype, out: torch.Tensor | None = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Raw blocks (uint8, any shape holding whole blocks, read in memory order) -> 1-D tensor of their weights
    in out's dtype (or a new `dtype` tensor), in one launch."""
    kernel, size, block, bb = KERNELS[qtype]
    flat = blocks.reshape(-1)
    if flat.dtype != torch.uint8 or flat.numel() % size:
        raise ValueError(f"{qtype.name} blocks must be uint8 and a multiple of {size} bytes")
    n_blocks = flat.numel() // size
    if out is None:
        out = torch.empty(n_blocks * block, dtype=dtype, device=flat.device)
    if out.numel() != n_blocks * block or out.dtype not in OUT_DTYPES:
        raise ValueError(f"out must be {n_blocks * block} float32/bfloat16/float16 elements")
    dst = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    if n_blocks:
        args = (flat, dst, n_blocks)
        if qtype in TABLES:
            from strata.quant.iquants import table

            args += tuple(table(name, flat.device) for name in TABLES[qtype])
        kernel[(triton.cdiv(n_blocks, bb),)](*args, BB=bb, num_warps=NUM_WARPS, enable_fp_fusion=False)
    if dst is not out:
        out.copy_(dst)
    return out


registry.op("dequantize_blocks").register(
    "triton", dequantize_blocks,
    lambda flat, qt, out: flat.is_cuda and available() and supports(qt, out.dtype, cuda=True))
