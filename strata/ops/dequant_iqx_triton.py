"""One-launch Triton dequantizers of IQ2_XS, IQ3_S, IQ1_S and IQ1_M, bit-identical in float32 to the torch reference
(`strata.quant.iquants`): the same products in the same order, as `strata.ops.dequant_triton`'s kernels (which this
module's import adds them to: `KERNELS`, `TABLES`). Layouts: `strata.ops.iquant_x_triton`. A GPU takes them once
their GPU test has passed there (`dequant_triton.IQX_GPU_TESTED`); Triton's interpreter checks them bit for bit on
the CPU (tests/ops/test_dequant_triton_interpret.py)."""

from __future__ import annotations

from gguf import GGMLQuantizationType

from strata.ops import dequant_triton as dt

Q = GGMLQuantizationType
triton = dt.triton

if triton is not None:
    import triton.language as tl

    from strata.ops.dequant_triton import _f16, _store, _u8

    @triton.jit
    def _u16(p, m):
        return _u8(p, m) | (_u8(p + 1, m) << 8)

    @triton.jit
    def _iq2_xs_kernel(src, dst, n_blocks, grid, signs, BB: tl.constexpr):
        # block (74 bytes): f16 d, 32 u16 (9-bit grid index | 7-bit sign index, a group of 8 each), 8 scale bytes
        # (16 weights a nibble, low first); w = ((d * (0.5 + scale)) * 0.25 * grid) * sign
        pid = tl.program_id(0).to(tl.int64)
        blk = tl.arange(0, BB)
        m2 = (pid * BB + blk < n_blocks)[:, None]
        b2 = (src + pid * (BB * 74) + blk * 74)[:, None]
        g = tl.arange(0, 8)[None, :, None]
        t = tl.arange(0, 32)[None, None, :]
        d = _f16(b2, m2)[:, :, None]
        m3 = m2[:, :, None]
        b3 = b2[:, :, None]
        q = _u16(b3 + 2 + 2 * (4 * g + t // 8), m3)
        si = 2 * g + t // 16
        nib = (_u8(b3 + 66 + si // 2, m3) >> (4 * (si % 2))) & 0x0F
        db = (d * (0.5 + nib.to(tl.float32))) * 0.25
        y = (db * tl.load(grid + (q & 511) * 8 + t % 8)) * tl.load(signs + (q >> 9) * 8 + t % 8)
        _store(dst + pid * (BB * 256) + blk[:, None, None] * 256 + g * 32 + t, y, m3)

    @triton.jit
    def _iq3_s_kernel(src, dst, n_blocks, grid, signs, BB: tl.constexpr):
        # block (110 bytes): f16 d, 64 index bytes, 8 qh bytes (index 8 g + l's 9th bit: bit l of qh[g]), 32 sign
        # bytes, 4 scale bytes (a nibble a sub-block); w = ((d * (1 + 2 scale)) * grid) * sign
        pid = tl.program_id(0).to(tl.int64)
        blk = tl.arange(0, BB)
        m2 = (pid * BB + blk < n_blocks)[:, None]
        b2 = (src + pid * (BB * 110) + blk * 110)[:, None]
        g = tl.arange(0, 8)[None, :, None]
        t = tl.arange(0, 32)[None, None, :]
        d = _f16(b2, m2)[:, :, None]
        m3 = m2[:, :, None]
        b3 = b2[:, :, None]
        idx = _u8(b3 + 2 + 8 * g + t // 4, m3) | (((_u8(b3 + 66 + g, m3) >> (t // 4)) & 1) << 8)
        nib = (_u8(b3 + 106 + g // 2, m3) >> (4 * (g % 2))) & 0x0F
        db = d * (1 + 2 * nib).to(tl.float32)
        y = (db * tl.load(grid + idx * 4 + t % 4)) * tl.load(signs + _u8(b3 + 74 + 4 * g + t // 8, m3) * 8 + t % 8)
        _store(dst + pid * (BB * 256) + blk[:, None, None] * 256 + g * 32 + t, y, m3)

    @triton.jit
    def _iq1_s_kernel(src, dst, n_blocks, grid, BB: tl.constexpr):
        # block (50 bytes): f16 d, 32 index low bytes, 8 u16 qh (index tops at 3 l, scale at 12, delta sign at 15);
        # w = (d * (2 scale + 1)) * (grid + delta)
        pid = tl.program_id(0).to(tl.int64)
        blk = tl.arange(0, BB)
        m2 = (pid * BB + blk < n_blocks)[:, None]
        b2 = (src + pid * (BB * 50) + blk * 50)[:, None]
        g = tl.arange(0, 8)[None, :, None]
        t = tl.arange(0, 32)[None, None, :]
        d = _f16(b2, m2)[:, :, None]
        m3 = m2[:, :, None]
        b3 = b2[:, :, None]
        qh = _u16(b3 + 34 + 2 * g, m3)  # [BB, 8, 1]
        idx = _u8(b3 + 2 + 4 * g + t // 8, m3) | (((qh >> (3 * (t // 8))) & 7) << 8)
        dl = d * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
        delta = tl.where((qh & 0x8000) == 0, 0.125, -0.125)
        y = dl * (tl.load(grid + idx * 8 + t % 8) + delta)
        _store(dst + pid * (BB * 256) + blk[:, None, None] * 256 + g * 32 + t, y, m3)

    @triton.jit
    def _iq1_m_kernel(src, dst, n_blocks, grid, BB: tl.constexpr):
        # block (56 bytes): 32 index low bytes, 16 qh bytes (a nibble a group of 8: 3 index bits, the delta sign),
        # 4 u16 of four 3-bit scales (16 weights each) whose top nibbles are the f16 d
        pid = tl.program_id(0).to(tl.int64)
        blk = tl.arange(0, BB)
        m2 = (pid * BB + blk < n_blocks)[:, None]
        b2 = (src + pid * (BB * 56) + blk * 56)[:, None]
        g = tl.arange(0, 8)[None, :, None]
        t = tl.arange(0, 32)[None, None, :]
        dbits = ((_u16(b2 + 48, m2) & 0xF000) >> 12) | ((_u16(b2 + 50, m2) & 0xF000) >> 8) \
            | ((_u16(b2 + 52, m2) & 0xF000) >> 4) | (_u16(b2 + 54, m2) & 0xF000)
        d = dbits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)[:, :, None]
        m3 = m2[:, :, None]
        b3 = b2[:, :, None]
        si = 2 * g + t // 16
        sc = (_u16(b3 + 48 + 2 * (si // 4), m3) >> (3 * (si % 4))) & 7
        dl = d * (2 * sc + 1).to(tl.float32)
        k = 4 * g + t // 8
        nib = (_u8(b3 + 32 + k // 2, m3) >> (4 * (k % 2))) & 0x0F
        idx = _u8(b3 + k, m3) | ((nib & 7) << 8)
        delta = tl.where((nib & 8) == 0, 0.125, -0.125)
        y = dl * (tl.load(grid + idx * 8 + t % 8) + delta)
        _store(dst + pid * (BB * 256) + blk[:, None, None] * 256 + g * 32 + t, y, m3)

    dt.KERNELS.update({
        Q.IQ2_XS: (_iq2_xs_kernel, 74, 256, 16),
        Q.IQ3_S: (_iq3_s_kernel, 110, 256, 16),
        Q.IQ1_S: (_iq1_s_kernel, 50, 256, 16),
        Q.IQ1_M: (_iq1_m_kernel, 56, 256, 16),
    })

dt.TABLES.update({Q.IQ2_XS: ("IQ2_XS", "ksigns"), Q.IQ3_S: ("IQ3_S", "bytesigns"), Q.IQ1_S: ("IQ1_S",),
                  Q.IQ1_M: ("IQ1_S",)})
dt.SUPPORTED = frozenset(dt.KERNELS)  # (this module imported first: dequant_triton's own line ran before the update)
