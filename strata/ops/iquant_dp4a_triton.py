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
    return (q * (amax / 127.0)).reshape(x.shape)


if triton is not None:
    # (the interpreter keeps the float tiles unless a test asks for these: the other tests compare with float products)
    C_DP4A = tl.constexpr(DP4A_GPU_TESTED and not triton_interpreting())
    C_INTERP = tl.constexpr(triton_interpreting())
    from strata.ops.iquant_triton import C_P2S, C_P2XXS, C_P3XXS, C_PSIGN, _f16v, _subblocks, _u32h
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
    def _xq(xp, sb, ib, sm):
        """The tile's activations [S sub-blocks, 8 words] as int32 words of four int8 (weight 4 k + r of a
        sub-block in byte r of word k), and each sub-block's scale [S]."""
        k = tl.arange(0, 8)
        r = tl.arange(0, 4)
        xo = sb[:, None, None] * 256 + 32 * ib[:, None, None] + (4 * k)[None, :, None] + r[None, None, :]
        x = tl.load(xp + xo, mask=sm[:, None, None], other=0.0).to(tl.float32)  # [S, 8, 4]
        amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)  # [S]
        inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
        q = x * inv[:, None, None]
        qi = (q + tl.where(q >= 0, 0.5, -0.5)).to(tl.int32)  # (to int: toward zero)
        # packed in uint32: a byte shifted into bit 31 of an int32 is undefined in compiled code
        w = tl.sum((qi & 255).to(tl.uint32) << (8 * r).to(tl.uint32)[None, None, :], axis=2)  # [S, 8]
        return w.to(tl.int32, bitcast=True), amax * (1.0 / 127.0)

    @triton.jit
    def _signed(mag, nib):
        """Int32 words of four magnitude bytes (each 1..127) negated where bits 0-3 of nib are set."""
        ones = ((nib.to(tl.uint32) * 0x00204081) & 0x01010101)  # bit r of nib -> 1 in byte r
        return ((mag.to(tl.uint32) ^ (ones * 255)) + ones).to(tl.int32, bitcast=True)

    @triton.jit
    def _iq2xxs(row, xp, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        # word k of a sub-block: weights 4 k .. 4 k + 3, group k // 2 (its grid index byte and sign index), half
        # k % 2 of the group's grid entry and of its sign byte
        itab = tab.to(tl.pointer_type(tl.int32))
        sb, ib, sm = _subblocks(b0, nsb, NB, EVEN)
        m2 = sm[None, :]
        k = tl.arange(0, 8)
        lg = (k // 2)[None, None, :]
        h = (k % 2)[None, None, :]
        blk = row[:, None] + sb[None, :] * 66  # [BN, S]
        d = _f16v(blk, m2)
        w0 = _u32h(blk + 2 + 8 * ib[None, :], m2)  # the sub-block's 4 grid index bytes
        w1 = _u32h(blk + 6 + 8 * ib[None, :], m2)  # 4 x 7-bit sign indices, the 4-bit scale
        gi = ((w0[:, :, None] >> (8 * lg).to(tl.uint32)) & 255).to(tl.int32)  # [BN, S, 8]
        si = ((w1[:, :, None] >> (7 * lg).to(tl.uint32)) & 127).to(tl.int32)
        mag = tl.load(itab + C_P2XXS + 2 * gi + h)
        nib = (tl.load(itab + C_PSIGN + si) >> (4 * h)) & 15
        xw, xs = _xq(xp, sb, ib, sm)
        isum = tl.sum(_dp4a(_signed(mag, nib), xw[None]), axis=2)  # [BN, S]
        db = d * (0.5 + (w1 >> 28).to(tl.float32)) * 0.25
        return tl.sum(isum.to(tl.float32) * db * xs[None, :], axis=1)

    @triton.jit
    def _iq2s(row, xp, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        # word k: group lg = k // 2 (index byte qs[4 ib + lg] and 2 bits of qh[ib]; its own sign byte), half k % 2;
        # groups 0-1 take the low scale nibble of scales[ib], 2-3 the high
        itab = tab.to(tl.pointer_type(tl.int32))
        sb, ib, sm = _subblocks(b0, nsb, NB, EVEN)
        m2 = sm[None, :]
        m3 = m2[:, :, None]
        k = tl.arange(0, 8)
        lg = (k // 2)[None, None, :]
        h = (k % 2)[None, None, :]
        blk = row[:, None] + sb[None, :] * 82
        d = _f16v(blk, m2)
        g = blk[:, :, None] + 2 + 4 * ib[None, :, None] + lg.to(tl.int64)  # [BN, S, 8]
        lo8 = tl.load(g, mask=m3, other=0, eviction_policy="evict_first").to(tl.int32)
        sgb = tl.load(g + 32, mask=m3, other=0, eviction_policy="evict_first").to(tl.int32)
        qh = tl.load(blk + 66 + ib[None, :], mask=m2, other=0).to(tl.int32)  # [BN, S]
        sc = tl.load(blk + 74 + ib[None, :], mask=m2, other=0).to(tl.int32)
        gi = lo8 | (((qh[:, :, None] >> (2 * lg)) & 3) << 8)
        mag = tl.load(itab + C_P2S + 2 * gi + h)
        nib = (sgb >> (4 * h)) & 15
        odd = 2 * ((sc[:, :, None] >> (4 * (lg // 2))) & 15) + 1  # [BN, S, 8] the half's 2 s + 1
        xw, xs = _xq(xp, sb, ib, sm)
        isum = tl.sum(_dp4a(_signed(mag, nib), xw[None]) * odd, axis=2)  # [BN, S]
        return tl.sum(isum.to(tl.float32) * (d * 0.125) * xs[None, :], axis=1)

    @triton.jit
    def _iq3xxs(row, xp, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        # word k: grid index byte k of the sub-block (one entry is four weights), signs from sign index k // 2,
        # half k % 2 of its byte
        itab = tab.to(tl.pointer_type(tl.int32))
        sb, ib, sm = _subblocks(b0, nsb, NB, EVEN)
        m2 = sm[None, :]
        m3 = m2[:, :, None]
        k = tl.arange(0, 8)
        blk = row[:, None] + sb[None, :] * 98
        d = _f16v(blk, m2)
        sc = _u32h(blk + 66 + 4 * ib[None, :], m2)  # [BN, S]
        gi = tl.load(blk[:, :, None] + 2 + 8 * ib[None, :, None] + k.to(tl.int64)[None, None, :], mask=m3, other=0,
                     eviction_policy="evict_first").to(tl.int32)  # [BN, S, 8]
        si = ((sc[:, :, None] >> (7 * (k // 2)).to(tl.uint32)[None, None, :]) & 127).to(tl.int32)
        mag = tl.load(itab + C_P3XXS + gi)
        nib = (tl.load(itab + C_PSIGN + si) >> (4 * (k % 2))[None, None, :]) & 15
        xw, xs = _xq(xp, sb, ib, sm)
        isum = tl.sum(_dp4a(_signed(mag, nib), xw[None]), axis=2)
        db = d * (0.5 + (sc >> 28).to(tl.float32)) * 0.5
        return tl.sum(isum.to(tl.float32) * db * xs[None, :], axis=1)

    # What the fused expert kernels call for these formats: the dp4a tiles where taken, else iquant_triton's.

    @triton.jit
    def iq2xxs_tile(row, xp, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        if C_DP4A:
            return _iq2xxs(row, xp, tab, b0, nsb, BN, NB, EVEN)
        else:
            return _iq2xxs_other(row, xp, tab, b0, nsb, BN, NB, EVEN)

    @triton.jit
    def iq2s_tile(row, xp, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        if C_DP4A:
            return _iq2s(row, xp, tab, b0, nsb, BN, NB, EVEN)
        else:
            return _iq2s_other(row, xp, tab, b0, nsb, BN, NB, EVEN)

    @triton.jit
    def iq3xxs_tile(row, xp, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        if C_DP4A:
            return _iq3xxs(row, xp, tab, b0, nsb, BN, NB, EVEN)
        else:
            return _iq3xxs_other(row, xp, tab, b0, nsb, BN, NB, EVEN)
