"""Tiles that multiply four weights at a time (`dp4a`) against int8 activations: Q8_0 and the K-quants Q2_K-Q6_K
(the dense weights, experts and LM heads of most files), IQ2_XXS, IQ2_S and IQ3_XXS (the 2- and 3-bit i-quants).

The float tiles (`strata.ops.kquant_triton`, `strata.ops.iquant_triton`) turn every weight into a float and
multiply-add it: ~8 instructions a weight for Q4_K and Q8_0, 26-38 for the lookup tiles of the i-quants, which set
their speed (docs/BENCHMARKS.md, "The GPU lane per weight format"). Here a tile element is a 32-bit word of four
weights and one `dp4a` multiplies its four bytes by four int8 activations and adds them. Q8_0's words are its
quants; Q4_K's a word of nibbles masked (low) or shifted and masked (high), Q5_K's with their fifth bits OR-ed in;
Q6_K's nibbles with their 2-bit tops OR-ed in (value - 32); Q2_K's / Q3_K's a word's 2-bit fields, Q3_K's third bits
OR-ed in (value - 4); an i-quant's its grid entry's magnitudes as bytes (one table load per four weights) with its
four signs applied at once (a word from a table of 1-bytes s, then `(m ^ 255 s) + s`: no carry crosses a byte, every
magnitude being at least 4). The activations are rounded to int8 per 32 once per call (`quantize_rows`: scale
max|x| / 127, half away from zero, as llama.cpp's CUDA kernels round theirs), so a result is the float product with
x rounded that way; `quantize_x` is the rounding's torch twin and the tests hold the tiles to it.

`dp4a` is inline PTX on a GPU; Triton's interpreter cannot run PTX, so there it is the same sum byte by byte
(`_dp4a`). A GPU takes these tiles once their GPU test passes there: DP4A_GPU_TESTED (the i-quants),
KQ_DP4A_GPU_TESTED (Q8_0, Q2_K-Q6_K), and their variants WIDE_GPU_TESTED and ARITH_SIGNS_GPU_TESTED;
`tools/gpu/gated.sh`.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from strata.config import triton_interpreting

Q = GGMLQuantizationType

# the dp4a tiles on a GPU: their GPU test (tests/experts/test_dp4a.py) passes there, and they were timed
# against the lookup tiles (`tools/bench_kernels.py --iq-tiles dp4a`); until then a GPU keeps the lookup tiles
DP4A_GPU_TESTED = True
# Q8_0's and the K-quants' dp4a tiles on a GPU (every dense GEMV and expert of most files then rounds its activations to
# int8): their GPU test passes there and they were timed against the float tiles (`--kq-tiles dp4a`)
KQ_DP4A_GPU_TESTED = True
# the i-quant dp4a tiles' table reads of a word pair (a grid entry's two halves, a sign byte's two sign words) as one
# 64-bit load instead of two 32-bit gathers: on a GPU once its GPU test passes there (tests/experts/test_dp4a.py,
# kind "wide") and it was timed against the two loads (`tools/bench_kernels.py --iq-tiles dp4a-wide`)
WIDE_GPU_TESTED = True
# IQ2_XXS's and IQ3_XXS's signs computed from their 7-bit index (the eighth sign is the index's parity, as gguf-py's
# ksigns table holds it) instead of gathered from a table: one table gather a group of 8 weights where there were
# two, for ~10 integer instructions; the tiles are bound by their gathers' latency, not by instructions. On a GPU once
# its GPU test passes there (tests/experts/test_dp4a.py, kind "signs") and it was timed against the gathered signs
# (`tools/bench_kernels.py --iq-tiles dp4a-signs` against `dp4a-wide`): both done on an H100, the expert FFN
# 1.13-1.28x faster (docs/BENCHMARKS.md, 'The GPU lane per weight format')
ARITH_SIGNS_GPU_TESTED = True
# Q8_0's and the i-quants' dp4a tiles summed over their sub-blocks once after a program's loop, not in every iteration
# (each such sum is a tree of warp shuffles: ~15% of the IQ2_XXS loop's instructions): `parts` below. Its GPU tests
# passed on an H100 (tests/experts/test_dp4a.py kind "parts", tests/ops/test_qgemv.py, the expert kernels' and the
# MTP / graphed verify tests with it on) and it was timed (`tools/bench_kernels.py --parts on` against `off`)
PARTS_GPU_TESTED = True
# IQ2_XXS's and IQ2_S's weights made by byte permutes (`_prmt`): a grid entry as 8 nibble selectors (a table half
# the size of the magnitudes') OR-ed with its signs' selector bits (IQ2_XXS: a 512-byte table by sign index; IQ2_S:
# 1 KB by sign byte) picks each weight's signed byte from 8 constants, two `prmt` for 8 weights where the computed
# signs took ~20 integer instructions (IQ2_S's ~10). IQ2_XXS's 64-bit grid gather of 32 lanes touches ~14 of the
# 2 KB table's 16 cache lines (one L1 wavefront each), the two 32-bit gathers ~8 + 4. Its GPU test passed on an
# H100 (tests/experts/test_dp4a.py, kind "sel") and it was timed against the computed signs there
# (`tools/bench_kernels.py --iq-tiles dp4a-sel` against `dp4a-signs`: the expert FFN 1.00-1.05x faster)
SEL_GPU_TESTED = True
IQ_FORMATS = frozenset({Q.IQ2_XXS, Q.IQ2_S, Q.IQ3_XXS})
KQ_FORMATS = frozenset({Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K})

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


# Float32 activations keep the float tiles: float32 is the exact path by choice (the tests' oracles, `--dtype f32`),
# as on the CPU lane, whose int8 kernels take bf16/f16 activations only; half-precision activations (the GPU's
# default compute dtype) take the dp4a tiles, rounded to int8 per 32 as llama.cpp's CUDA kernels round them.
EXACT_DTYPES = (torch.float32, torch.float64)


def rounds_activations(qtype, dtype: torch.dtype | None = None) -> bool:
    """Whether a GPU's tiles of `qtype` round activations of `dtype` (None: a half-precision one) to int8 (the dp4a
    tiles, where taken): their results then differ from the float product by that rounding (~1% of an expert's
    output, two roundings deep)."""
    if triton is None or dtype in EXACT_DTYPES:
        return False
    return (bool(C_DP4A) and qtype in IQ_FORMATS) or (bool(C_KQ) and qtype in KQ_FORMATS)


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


def parted(qtypes, xq: torch.Tensor) -> bool:
    """The kernels' PARTS: the tiles of `qtypes` run as `parts` (their sums after the loop) for activations `xq` (the
    words of `int8_rows`, where a dp4a tile takes them). A launch's constexpr, so a compiled kernel holds it."""
    if triton is None or not C_PARTS or xq.dtype != torch.int32:
        return False
    return all((C_DP4A and qt in IQ_FORMATS) or (C_KQ and qt == Q.Q8_0) for qt in qtypes)


def int8_rows(x: torch.Tensor, qtypes, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`quantize_rows(x)` where a tile of one of `qtypes` reads it for activations of `dtype` (default x's own: the
    GLU's float32 output follows the layer's input), else x itself: the tiles take the dp4a path only when this
    pointer holds int32 words, the float path (reading x) otherwise."""
    dtype = x.dtype if dtype is None else dtype
    return quantize_rows(x) if any(rounds_activations(q, dtype) for q in qtypes) else x


if triton is not None:
    # (the interpreter keeps the float tiles unless a test asks for these: the other tests compare with float products)
    C_DP4A = tl.constexpr(DP4A_GPU_TESTED and not triton_interpreting())
    C_KQ = tl.constexpr(KQ_DP4A_GPU_TESTED and not triton_interpreting())
    C_WIDE = tl.constexpr(WIDE_GPU_TESTED and not triton_interpreting())
    C_ASIGN = tl.constexpr(ARITH_SIGNS_GPU_TESTED and not triton_interpreting())
    C_PARTS = tl.constexpr(PARTS_GPU_TESTED and not triton_interpreting())
    C_SEL = tl.constexpr(SEL_GPU_TESTED and not triton_interpreting())
    C_INTERP = tl.constexpr(triton_interpreting())
    from strata.ops.dp4a_kquant_triton import _dp4a, _k23, _k45, _q6k
    from strata.ops.iquant_triton import C_P2S, C_P2XXS, C_P3XXS, C_PONES, C_SEL2S, C_SEL2XXS, C_SELSIGN, C_SELSIGN8
    from strata.ops.iquant_triton import _blocks, _f16v, _subblocks, _u16, _u32h
    from strata.ops.kquant_triton import q2k_tile, q3k_tile, q4k_tile, q5k_tile, q6k_tile, q8_0_tile
    from strata.ops.iquant_triton import iq2s_tile as _iq2s_other
    from strata.ops.iquant_triton import iq2xxs_tile as _iq2xxs_other
    from strata.ops.iquant_triton import iq3xxs_tile as _iq3xxs_other

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
    def _pair(itab, OFF: tl.constexpr, idx):
        """Words OFF + 2 idx and OFF + 2 idx + 1 of the table (OFF even: the pair is 8-byte aligned): one 64-bit load
        where C_WIDE, else two 32-bit ones."""
        if C_WIDE:
            v = tl.load(itab.to(tl.pointer_type(tl.int64)) + OFF // 2 + idx)
            return v.to(tl.int32), (v >> 32).to(tl.int32)
        else:
            p = itab + OFF + 2 * idx
            return tl.load(p), tl.load(p + 1)

    @triton.jit
    def _ksigns(itab, si):
        """The sign words of a group of 8 weights from its 7-bit sign index si (the table's word pair C_PONES + 2 si,
        2 si + 1): computed where C_ASIGN (bit 7, the eighth weight's sign, is the parity of bits 0-6), else gathered."""
        if C_ASIGN:
            if C_INTERP:  # (no PTX there: the parity by folding)
                p = si ^ (si >> 4)
                p = p ^ (p >> 2)
                p = p ^ (p >> 1)
            else:
                p = tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [si], dtype=tl.int32, is_pure=True, pack=1)
            full = si | ((p & 1) << 7)
            return _ones(full & 15), _ones(full >> 4)
        else:
            return _pair(itab, C_PONES, si)

    @triton.jit
    def _prmt(sel):
        """Bytes of IQ2_XXS's / IQ2_S's signed magnitudes picked by the 4 nibbles of sel's low half: nibble k = level (0, 1, 2:
        8, 25, 43) + 4 where negative, from the constant bytes 8, 25, 43, 0, -8, -25, -43, 0 (one `prmt`)."""
        if C_INTERP:  # (no PTX there: each byte shifted out of the 8 constants)
            k = sel.to(tl.int64)
            lut = 0x00D5E7F8002B1908
            w = ((lut >> (8 * (k & 7))) & 255) | (((lut >> (8 * ((k >> 4) & 7))) & 255) << 8) \
                | (((lut >> (8 * ((k >> 8) & 7))) & 255) << 16) | (((lut >> (8 * ((k >> 12) & 7))) & 255) << 24)
            return w.to(tl.uint32).to(tl.int32, bitcast=True)
        else:
            return tl.inline_asm_elementwise("{ .reg .b32 a, b; mov.b32 a, 0x002B1908; mov.b32 b, 0x00D5E7F8; "
                                             "prmt.b32 $0, a, b, $1; }", "=r,r", [sel], dtype=tl.int32,
                                             is_pure=True, pack=1)

    @triton.jit
    def _sel_dot(sel, x0, x1):
        """A group of 8 weights given as selectors (its entry's levels OR its signs' bits: `_prmt`, nibbles 0-3 the
        first half, 4-7 the second) times its activation words x0, x1."""
        return _dp4a(_prmt(sel), x0[None]) + _dp4a(_prmt((sel.to(tl.uint32) >> 16).to(tl.int32)), x1[None])

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
        x0, x1, xs = _xq2(xq, sb, ib, sm)
        if C_SEL:
            dot = _sel_dot(tl.load(itab + C_SEL2XXS + gi) | tl.load(itab + C_SELSIGN + si), x0, x1)
        else:
            g0, g1 = _pair(itab, C_P2XXS, gi)
            s0, s1 = _ksigns(itab, si)
            dot = _dp4a(_signed(g0, s0), x0[None]) + _dp4a(_signed(g1, s1), x1[None])
        db = d * (0.5 + (w1 >> 28).to(tl.float32)) * 0.25
        return dot, db, xs  # (int sums [BN, S, 4] of pairs of words, their scales [BN, S] and [S]: `_fold`)

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
        gi = lo8 | (((qh[:, :, None] >> (2 * g)) & 3) << 8)
        x0, x1, xs = _xq2(xq, sb, ib, sm)
        if C_SEL:
            dot = _sel_dot(tl.load(itab + C_SEL2S + gi) | tl.load(itab + C_SELSIGN8 + sgb), x0, x1)
        else:
            g0, g1 = _pair(itab, C_P2S, gi)
            dot = _dp4a(_signed(g0, _ones(sgb & 15)), x0[None]) + _dp4a(_signed(g1, _ones(sgb >> 4)), x1[None])
        odd = 2 * ((sc[:, :, None] >> (4 * (g // 2))) & 15) + 1  # [BN, S, 4] the group's half's 2 s + 1
        return dot * odd, d * 0.125, xs

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
        s0, s1 = _ksigns(itab, si)
        x0, x1, xs = _xq2(xq, sb, ib, sm)
        dot = _dp4a(_signed(tl.load(itab + C_P3XXS + (gi & 255)), s0), x0[None]) \
            + _dp4a(_signed(tl.load(itab + C_P3XXS + (gi >> 8)), s1), x1[None])
        db = d * (0.5 + (sc >> 28).to(tl.float32)) * 0.5
        return dot, db, xs

    @triton.jit
    def _fold(parts):
        """A tile's sum from its (int sums [BN, S, 4], scales [BN, S], activation scales [S])."""
        dot, a, xs = parts
        return tl.sum(tl.sum(dot, axis=2).to(tl.float32) * a * xs[None, :], axis=1)

    @triton.jit
    def _q8_0(row, xq, b0, nblk, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        # a block is one of quantize_rows' sub-blocks: its 32 quants as 8 words (2-byte aligned: two halves each), in
        # pairs (words 2 w, 2 w + 1) as the i-quant tiles hold theirs: partial sums [BN, NB, 4]
        w = tl.arange(0, 4).to(tl.int64)
        j, jm = _blocks(b0, nblk, NB, EVEN)  # [NB]
        m2 = jm[None, :]
        m3 = m2[:, :, None]
        blk = row[:, None] + j[None, :] * 34  # [BN, NB]
        d = _f16v(blk, m2)
        q0 = _u32h(blk[:, :, None] + 2 + 8 * w[None, None, :], m3).to(tl.int32, bitcast=True)
        q1 = _u32h(blk[:, :, None] + 6 + 8 * w[None, None, :], m3).to(tl.int32, bitcast=True)
        xo = j * 9
        x0 = tl.load(xq + xo[:, None] + 2 * w[None, :], mask=jm[:, None], other=0)  # [NB, 4]
        x1 = tl.load(xq + xo[:, None] + 2 * w[None, :] + 1, mask=jm[:, None], other=0)
        xs = tl.load(xq + xo + 8, mask=jm, other=0).to(tl.float32, bitcast=True)
        dot = _dp4a(q0, x0[None]) + _dp4a(q1, x1[None])
        return dot, d, xs

    @triton.jit
    def q2k_dp4a_tile(row, xp, xq, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        if C_KQ and xq.dtype.element_ty == tl.int32:
            return _k23(row, xq, b0, nsb, BN, NB, EVEN, False)
        else:
            return q2k_tile(row, xp, b0, nsb, BN, NB, EVEN)

    @triton.jit
    def q3k_dp4a_tile(row, xp, xq, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        if C_KQ and xq.dtype.element_ty == tl.int32:
            return _k23(row, xq, b0, nsb, BN, NB, EVEN, True)
        else:
            return q3k_tile(row, xp, b0, nsb, BN, NB, EVEN)

    @triton.jit
    def q6k_dp4a_tile(row, xp, xq, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        if C_KQ and xq.dtype.element_ty == tl.int32:
            return _q6k(row, xq, b0, nsb, BN, NB, EVEN)
        else:
            return q6k_tile(row, xp, b0, nsb, BN, NB, EVEN)

    @triton.jit
    def q8_0_dp4a_tile(row, xp, xq, b0, nblk, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        if C_KQ and xq.dtype.element_ty == tl.int32:
            return _fold(_q8_0(row, xq, b0, nblk, BN, NB, EVEN))
        else:
            return q8_0_tile(row, xp, b0, nblk, BN, NB, EVEN)

    @triton.jit
    def q4k_dp4a_tile(row, xp, xq, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        if C_KQ and xq.dtype.element_ty == tl.int32:
            return _k45(row, xq, b0, nsb, BN, NB, EVEN, False)
        else:
            return q4k_tile(row, xp, b0, nsb, BN, NB, EVEN)

    @triton.jit
    def q5k_dp4a_tile(row, xp, xq, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        if C_KQ and xq.dtype.element_ty == tl.int32:
            return _k45(row, xq, b0, nsb, BN, NB, EVEN, True)
        else:
            return q5k_tile(row, xp, b0, nsb, BN, NB, EVEN)

    # What the fused expert kernels call for these formats: the dp4a tiles where taken (xq: the row's words from
    # `quantize_rows`), else iquant_triton's (xp: the row of x).

    @triton.jit
    def iq2xxs_tile(row, xp, xq, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        if C_DP4A and xq.dtype.element_ty == tl.int32:
            return _fold(_iq2xxs(row, xq, tab, b0, nsb, BN, NB, EVEN))
        else:
            return _iq2xxs_other(row, xp, tab, b0, nsb, BN, NB, EVEN)

    @triton.jit
    def iq2s_tile(row, xp, xq, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        if C_DP4A and xq.dtype.element_ty == tl.int32:
            return _fold(_iq2s(row, xq, tab, b0, nsb, BN, NB, EVEN))
        else:
            return _iq2s_other(row, xp, tab, b0, nsb, BN, NB, EVEN)

    @triton.jit
    def iq3xxs_tile(row, xp, xq, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        if C_DP4A and xq.dtype.element_ty == tl.int32:
            return _fold(_iq3xxs(row, xq, tab, b0, nsb, BN, NB, EVEN))
        else:
            return _iq3xxs_other(row, xp, tab, b0, nsb, BN, NB, EVEN)

    @triton.jit
    def parts(row, xq, tab, it, K, QT: tl.constexpr, BN: tl.constexpr, KW: tl.constexpr, EVEN: tl.constexpr):
        """Iteration `it` of a Q8_0 or i-quant dp4a tile (where `parted`) before any sum: [BN, KW / 32, 4]
        float partial sums (each of a pair of words), added up across iterations and summed once at the end."""
        if QT == 16:  # IQ2_XXS
            dot, a, xs = _iq2xxs(row, xq, tab, it * (KW // 256), K // 256, BN, KW // 256, EVEN)
        elif QT == 22:  # IQ2_S
            dot, a, xs = _iq2s(row, xq, tab, it * (KW // 256), K // 256, BN, KW // 256, EVEN)
        elif QT == 18:  # IQ3_XXS
            dot, a, xs = _iq3xxs(row, xq, tab, it * (KW // 256), K // 256, BN, KW // 256, EVEN)
        else:  # Q8_0
            dot, a, xs = _q8_0(row, xq, it * (KW // 32), K // 32, BN, KW // 32, EVEN)
        return dot.to(tl.float32) * (a * xs[None, :])[:, :, None]
