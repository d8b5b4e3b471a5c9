"""IQ2_XXS, IQ2_S and IQ3_XXS tiles that multiply four weights at a time (`dp4a`) against int8 activations.

The lookup and packed tiles of `strata.ops.iquant_triton` decode each weight to a float: a grid value, a sign and a
multiply-add per weight, 2.6-3.1x Q4_K's time for fewer bytes (docs/BENCHMARKS.md, "The GPU lane per weight
format"). Here a tile element is a 32-bit word of four weights: the grid entry's magnitudes come as bytes in one
word (the packed codebooks, one load per four weights), the four signs are applied to the bytes with integer
operations (no carry crosses a byte: every magnitude is at least 4), and one `dp4a` multiplies the four signed
bytes by four int8 activations and adds them. The activations are rounded to int8 per sub-block of 32 (scale
max|x| / 127, round half away from zero) inside the tile, as llama.cpp's CUDA kernels do (its q8_1), so the result is
the float product with x rounded that way: `quantize_x` is the torch twin of that rounding, and the tests hold the
tiles to W @ quantize_x(x) in float64.

`dp4a` is inline PTX on a GPU; Triton's interpreter cannot run PTX, so there it is the same sum byte by byte
(`_dp4a`). A GPU takes these tiles once their GPU test passes there (DP4A_GPU_TESTED; `tools/gpu/gated.sh`).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from strata.config import triton_interpreting
# the dp4a tiles on a GPU: their GPU test (tests/experts/test_iquant_dp4a.py) passes there, and they were timed
# against the lookup tiles (`tools/bench_kernels.py --iq-tiles dp4a`); until then a GPU keeps the lookup tiles
DP4A_GPU_TESTED = False

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def rounds_activations(qtype) -> bool:
    """Whether a GPU's tiles of `qtype` round the activations to int8 (the dp4a tiles, where taken): their results
    then differ from the float product by that rounding (~1% of an expert's output, two roundings deep)."""
    on = bool(C_DP4A) if triton is not None else False
    return on and qtype in (GGMLQuantizationType.IQ2_XXS, GGMLQuantizationType.IQ2_S, GGMLQuantizationType.IQ3_XXS)


def quantize_x(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) -> float32 x rounded as the tiles round it: int8 per 32 with scale
    max|x| / 127, half away from zero, then multiplied back."""
    xf = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = xf * inv
    q = torch.trunc(q + torch.where(q >= 0, 0.5, -0.5))
    return (q * (amax * (1.0 / 127.0))).reshape(x.shape)  # (the scale as the kernel stores it)


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [R, K] (K a multiple of 32, on the GPU or in the interpreter) -> int32 [R, K / 32 * 9]: what the dp4a
    tiles read, each sub-block of 32 as 8 words of four int8 and its scale's bits (`quantize_x` is its float twin)."""
    R, K = x.shape
    out = torch.empty(R, K // 32 * 9, dtype=torch.int32, device=x.device)
    if R:
        _quantize_kernel[(R, triton.cdiv(K // 32, 32))](x, out, K, BS=32)
    return out


def int8_rows(x: torch.Tensor, qtypes) -> torch.Tensor:
    """`quantize_rows(x)` where a tile of one of `qtypes` reads it, else x itself (a pointer the kernels take but do
    not read)."""
    return quantize_rows(x) if any(rounds_activations(q) for q in qtypes) else x


if triton is not None:
    # (the interpreter keeps the float tiles unless a test asks for these: the other tests compare with float products)
    C_DP4A = tl.constexpr(DP4A_GPU_TESTED and not triton_interpreting())
    C_INTERP = tl.constexpr(triton_interpreting())
    from strata.ops.iquant_triton import C_P2S, C_P2XXS, C_P3XXS, C_PONES, _f16v, _subblocks, _u16, _u32h
    from strata.ops.iquant_triton import iq2s_tile as _iq2s_other
    from strata.ops.iquant_triton import iq2xxs_tile as _iq2xxs_other
    from strata.ops.iquant_triton import iq3xxs_tile as _iq3xxs_other

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
    def _quantize_kernel(x, out, K, BS: tl.constexpr):
        """Row pid(0) of x [R, K], sub-blocks pid(1) * BS .. of 32: int8 per 32 (scale max|x| / 127, half away from
        zero) as 8 int32 words of four (weight 4 k + r in byte r of word k) and the scale's bits, 9 words each."""
        row = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1) * BS + tl.arange(0, BS)
        sm = s < K // 32
        k = tl.arange(0, 8)
        r = tl.arange(0, 4)
        xo = row * K + s[:, None, None] * 32 + (4 * k)[None, :, None] + r[None, None, :]
        v = tl.load(x + xo, mask=sm[:, None, None], other=0.0).to(tl.float32)  # [BS, 8, 4]
        amax = tl.max(tl.max(tl.abs(v), axis=2), axis=1)  # [BS]
        inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
        q = v * inv[:, None, None]
        qi = (q + tl.where(q >= 0, 0.5, -0.5)).to(tl.int32)  # (to int: toward zero)
        # packed in uint32: a byte shifted into bit 31 of an int32 is undefined in compiled code
        w = tl.sum((qi & 255).to(tl.uint32) << (8 * r).to(tl.uint32)[None, None, :], axis=2)  # [BS, 8]
        o = row * (K // 32 * 9) + s.to(tl.int64) * 9
        tl.store(out + o[:, None] + k[None, :], w.to(tl.int32, bitcast=True), mask=sm[:, None])
        tl.store(out + o + 8, (amax * (1.0 / 127.0)).to(tl.int32, bitcast=True), mask=sm)

    @triton.jit
    def _xq2(xq, sb, ib, sm):
        """The tile's activations from `quantize_rows`'s 9 words a sub-block: its int8 words as [S sub-blocks, 4
        groups of 8 weights] for each half of a group (words 2 g and 2 g + 1), and the sub-blocks' scales [S]."""
        o = ((sb * 8 + ib) * 9)[:, None] + 2 * tl.arange(0, 4)[None, :]
        x0 = tl.load(xq + o, mask=sm[:, None], other=0)
        x1 = tl.load(xq + o + 1, mask=sm[:, None], other=0)
        return x0, x1, tl.load(xq + (sb * 8 + ib) * 9 + 8, mask=sm, other=0).to(tl.float32, bitcast=True)

    @triton.jit
    def _signed(mag, ones):
        """Int32 words of four magnitude bytes (each 1..127) negated where `ones` has a 1 in their byte."""
        o = ones.to(tl.uint32)
        return ((mag.to(tl.uint32) ^ (o * 255)) + o).to(tl.int32, bitcast=True)

    @triton.jit
    def _ones(nib):
        """Bits 0-3 of nib as a word with 1 in byte r where bit r is set."""
        return (nib.to(tl.uint32) * 0x00204081) & 0x01010101

    @triton.jit
    def _iq2xxs(row, xq, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        # group g of a sub-block (weights 8 g .. 8 g + 7): grid index byte g, sign index g; its two halves are
        # words 2 g, 2 g + 1 of the grid entry, of the activations and of the sign table's entry pair
        itab = tab.to(tl.pointer_type(tl.int32))
        sb, ib, sm = _subblocks(b0, nsb, NB, EVEN)
        m2 = sm[None, :]
        g = tl.arange(0, 4)[None, None, :]
        blk = row[:, None] + sb[None, :] * 66  # [BN, S]
        d = _f16v(blk, m2)
        w0 = _u32h(blk + 2 + 8 * ib[None, :], m2)  # the sub-block's 4 grid index bytes
        w1 = _u32h(blk + 6 + 8 * ib[None, :], m2)  # 4 x 7-bit sign indices, the 4-bit scale
        gi = ((w0[:, :, None] >> (8 * g).to(tl.uint32)) & 255).to(tl.int32)  # [BN, S, 4]
        si = ((w1[:, :, None] >> (7 * g).to(tl.uint32)) & 127).to(tl.int32)
        gp = itab + C_P2XXS + 2 * gi
        sp = itab + C_PONES + 2 * si
        x0, x1, xs = _xq2(xq, sb, ib, sm)
        dot = _dp4a(_signed(tl.load(gp), tl.load(sp)), x0[None]) + _dp4a(_signed(tl.load(gp + 1), tl.load(sp + 1)),
                                                                         x1[None])
        db = d * (0.5 + (w1 >> 28).to(tl.float32)) * 0.25
        return tl.sum(tl.sum(dot, axis=2).to(tl.float32) * db * xs[None, :], axis=1)

    @triton.jit
    def _iq2s(row, xq, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        # group g (weights 8 g ..): index byte qs[4 ib + g] and 2 bits of qh[ib], its own sign byte; groups 0-1 take
        # the low scale nibble of scales[ib], 2-3 the high; its halves as in _iq2xxs
        itab = tab.to(tl.pointer_type(tl.int32))
        sb, ib, sm = _subblocks(b0, nsb, NB, EVEN)
        m2 = sm[None, :]
        m3 = m2[:, :, None]
        g = tl.arange(0, 4)[None, None, :]
        blk = row[:, None] + sb[None, :] * 82
        d = _f16v(blk, m2)
        gb = blk[:, :, None] + 2 + 4 * ib[None, :, None] + g.to(tl.int64)  # [BN, S, 4]
        lo8 = tl.load(gb, mask=m3, other=0, eviction_policy="evict_first").to(tl.int32)
        sgb = tl.load(gb + 32, mask=m3, other=0, eviction_policy="evict_first").to(tl.int32)
        qh = tl.load(blk + 66 + ib[None, :], mask=m2, other=0).to(tl.int32)  # [BN, S]
        sc = tl.load(blk + 74 + ib[None, :], mask=m2, other=0).to(tl.int32)
        gp = itab + C_P2S + 2 * (lo8 | (((qh[:, :, None] >> (2 * g)) & 3) << 8))
        x0, x1, xs = _xq2(xq, sb, ib, sm)
        dot = _dp4a(_signed(tl.load(gp), _ones(sgb & 15)), x0[None]) + _dp4a(_signed(tl.load(gp + 1), _ones(sgb >> 4)),
                                                                            x1[None])
        odd = 2 * ((sc[:, :, None] >> (4 * (g // 2))) & 15) + 1  # [BN, S, 4] the group's half's 2 s + 1
        return tl.sum(tl.sum(dot * odd, axis=2).to(tl.float32) * (d * 0.125) * xs[None, :], axis=1)

    @triton.jit
    def _iq3xxs(row, xq, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        # group g of a sub-block (weights 8 g ..): grid index bytes 2 g, 2 g + 1 (one entry is four weights: its
        # halves), sign index g
        itab = tab.to(tl.pointer_type(tl.int32))
        sb, ib, sm = _subblocks(b0, nsb, NB, EVEN)
        m2 = sm[None, :]
        g = tl.arange(0, 4)[None, None, :]
        blk = row[:, None] + sb[None, :] * 98
        d = _f16v(blk, m2)
        sc = _u32h(blk + 66 + 4 * ib[None, :], m2)  # [BN, S]
        gi = _u16(blk[:, :, None] + 2 + 8 * ib[None, :, None] + 2 * g.to(tl.int64), m2[:, :, None])  # [BN, S, 4]
        si = ((sc[:, :, None] >> (7 * g).to(tl.uint32)) & 127).to(tl.int32)
        sp = itab + C_PONES + 2 * si
        x0, x1, xs = _xq2(xq, sb, ib, sm)
        dot = _dp4a(_signed(tl.load(itab + C_P3XXS + (gi & 255)), tl.load(sp)), x0[None]) \
            + _dp4a(_signed(tl.load(itab + C_P3XXS + (gi >> 8)), tl.load(sp + 1)), x1[None])
        db = d * (0.5 + (sc >> 28).to(tl.float32)) * 0.5
        return tl.sum(tl.sum(dot, axis=2).to(tl.float32) * db * xs[None, :], axis=1)

    # What the fused expert kernels call for these formats: the dp4a tiles where taken (xq: the row's words from
    # `quantize_rows`), else iquant_triton's (xp: the row of x).

    @triton.jit
    def iq2xxs_tile(row, xp, xq, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        if C_DP4A:
            return _iq2xxs(row, xq, tab, b0, nsb, BN, NB, EVEN)
        else:
            return _iq2xxs_other(row, xp, tab, b0, nsb, BN, NB, EVEN)

    @triton.jit
    def iq2s_tile(row, xp, xq, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        if C_DP4A:
            return _iq2s(row, xq, tab, b0, nsb, BN, NB, EVEN)
        else:
            return _iq2s_other(row, xp, tab, b0, nsb, BN, NB, EVEN)

    @triton.jit
    def iq3xxs_tile(row, xp, xq, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        if C_DP4A:
            return _iq3xxs(row, xq, tab, b0, nsb, BN, NB, EVEN)
        else:
            return _iq3xxs_other(row, xp, tab, b0, nsb, BN, NB, EVEN)
