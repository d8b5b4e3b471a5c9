"""Fused expert FFN over a slot pool in Triton: Q4_K / Q5_K / Q6_K / Q8_0 blocks (and the lookup formats IQ2_XXS,
IQ3_XXS, IQ4_XS, MXFP4, whose tiles are in `strata.ops.iquant_triton`) read straight from the slots, no
dequantized copy, two launches per MoE layer. The same tile functions serve the dense decode GEMV
(`strata.ops.qgemv`).

For each (pair p, block of BN output rows) a program reads the slot `slots[p]` (negative = a miss: the pair's
output is zero and no weight is read), walks the reduction dimension KW weights at a time, decodes the GGML
blocks in registers and accumulates in float32:

    kernel 1:  a[p] = silu(x[p] @ gate[slot].T) * (x[p] @ up[slot].T)      [P, ff]
    kernel 2:  y[p] = a[p] @ down[slot].T                                  [P, d]

Reference twin: `strata.ops.expert_gather.gather_expert_ffn` (tests run these kernels in Triton's
interpreter on the CPU; see tests/experts/test_expert_triton.py). The tiles that decode each format's blocks are in
`strata.ops.kquant_triton` (Q8_0 and the K-quants, with their block layouts) and `strata.ops.iquant_triton`.

Why the kernels look as they do. A decode GEMV reads each weight byte once, so it needs many bytes in flight
(latency) and few instructions per weight (a GPU issues only a few instructions per weight byte its HBM delivers:
docs/BENCHMARKS.md, "Measurements behind the engine's constants"):
- One loop iteration of a program decodes a whole [BN rows, KW weights] tile (KW divides K when it can, so
  tiles need no masks), not one block per row: several KB of quants per program in flight at once.
- `plan` gives each program one warp and 512 weights a row per iteration, then halves BN (from 8 rows) until
  a launch has PROGRAMS_PER_SM programs per SM (a 512-row weight gets 1-row programs, a 150K-row head 8-row
  ones); the grid is flat (pid = row block * P + p), so no grid axis limit binds.
- f16 scales and the Q4_K scale words are single aligned loads (the byte pointer cast to f16 / u32); the Q4_K
  quants are 16-byte loads of u32 words; offsets are int64 so the compiler folds them into immediates.
- The Q4_K 6-bit scales and mins are decoded from three u32 words with 4-byte-wide bit operations
  (llama.cpp's get_scale_min_k4) on a [BN, NB, 4] tensor, then broadcast; its weight math is factored per
  sub-block, d*sc * sum(q*x) - dmin*m * sum(x), the sums of x shared by the program's rows.
- Integers become floats through the exponent bits (the bits 0x4B000000 | v are the float 2^23 + v, exact),
  never an I2F instruction, which sm_90 issues at 16 per clock per SM against 128 FMAs.
All products of quant integers with f16 scales are exact in float32; sums are float32 (the grouping of the
sums differs from the dequantize-then-matmul reference only by float32 rounding).
"""

from __future__ import annotations

import functools

import torch
from gguf import GGMLQuantizationType

from strata.config import triton_interpreting
from strata.ops import iquant_triton

Q = GGMLQuantizationType

try:  # Triton is optional: without it (or without a GPU) the torch grouped path runs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

Q32 = {Q.Q4_0: 0, Q.Q4_1: 1, Q.Q5_0: 2, Q.Q5_1: 3}  # the 32-weight formats of kquant_triton.q32_tile (its FMT)
SUPPORTED = frozenset({Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, *Q32, *iquant_triton.FORMATS})
KW_MAX = 2048  # weights of a row per loop iteration, at most (block_k may ask up to this)
KW_DECODE = 512  # weights of a row per iteration by default
# the i-quants' dp4a tiles (strata.ops.dp4a_triton) in the expert GLU: 1024 weights a row per iteration, so a
# program's two 1024-weight rows put more independent table gathers in flight (the fastest point of a sweep of every
# (BN, KW, warps) of B1's expert GLU, `tools/bench_kernels.py --sweep --expert-formats`; docs/BENCHMARKS.md)
KW_DECODE_DP4A_IQ = 1024
# ... and one row a program where a row takes 4 iterations or more (GLM-4.5-Air's K = 4096), once their sums wait
# for the loop's end (dp4a_triton.parts): the sweep at that shape, 29.0 -> 26.2 us; at K = 2048 two rows stay faster
DP4A_IQ_ONE_ROW_ITERS = 4
# The GLU over Q4_K or Q8_0 gate and up where their dp4a tiles read them (strata.ops.dp4a_kquant_triton, fewer
# instructions a weight than the float tiles the rules above were measured with): twice the programs a launch
# (fewer rows each), and Q4_K 1024 weights a row per iteration where K <= 2048. A sweep of every (BN, KW, warps)
# (`tools/bench_kernels.py --sweep --expert-formats Q4_K --expert-shape D,FF,P`; docs/BENCHMARKS.md): B1's GLU
# 12.1 -> 10.1 us, B2's 11.7 -> 9.3, GLM-4.5-Air-sized (K = 4096) 31.3 -> 28.0; Q8_0 at B1's shape 18.6 -> 15.4
DP4A_KQ_GLU = frozenset({Q.Q4_K, Q.Q8_0})
DP4A_KQ_GLU_PROGRAMS = 16  # per SM
DP4A_Q4K_GLU_KW, DP4A_Q4K_GLU_KW_MAX_K = 1024, 2048
# ... and at most 4 rows a program for Q4_K's, where a launch has programs enough for 8 (four sequences' or a
# 4-token verify step's 32-40 experts): the same sweep at those P found 4 rows 1.1-1.4x faster than 8 at B1's, B2's
# and GLM-4.5-Air's shapes (docs/BENCHMARKS.md, "The 2- and 3-bit i-quants per byte")
DP4A_Q4K_GLU_ROWS_MAX = 4
ROWS_MAX = 8  # rows per program
PROGRAMS_PER_SM = 8  # fewer rows per program until a launch has this many (one-warp) programs per SM
# Per format: at most this many weights one program decodes per iteration (all weights it reads), and per
# thread (TILE[qt][1], kept for reference). From the sm_90 code Triton 3.6 / 3.9 emit (cuobjdump): a tile costs
# ~8-10 (Q4_K), ~8.5-10 (Q8_0), ~11-13 (Q6_K) instructions per weight; the kernels this replaced took ~20 (Q8_0),
# ~35 (Q6_K), ~50 (Q4_K) in loops of one block per row.
TILE = {Q.Q4_K: (16384, 128), Q.Q5_K: (8192, 128), Q.Q8_0: (8192, 128), Q.Q6_K: (8192, 128),
        Q.Q2_K: (8192, 128), Q.Q3_K: (8192, 128),  # (byte-pair loads like Q6_K's; not tuned)
        Q.Q4_0: (8192, 128), Q.Q4_1: (8192, 128), Q.Q5_0: (8192, 128), Q.Q5_1: (8192, 128),  # (not tuned)
        # the lookup-table formats (strata.ops.iquant_triton): one gathered codebook value per weight (not tuned)
        Q.IQ4_XS: (8192, 64), Q.IQ2_XXS: (4096, 64), Q.IQ3_XXS: (4096, 64), Q.MXFP4: (4096, 64),
        Q.IQ2_S: (4096, 64), Q.IQ4_NL: (4096, 64), Q.IQ2_XS: (4096, 64), Q.IQ3_S: (4096, 64), Q.IQ1_S: (4096, 64),
        Q.IQ1_M: (4096, 64)}


def available() -> bool:
    return triton is not None


if triton is not None:
    from strata.ops import dp4a_triton, iquant_x_triton
    from strata.ops.kquant_triton import q32_tile

    @triton.jit
    def _tile_dot(row, xp, xq, tab, it, K, QT: tl.constexpr, BN: tl.constexpr, KW: tl.constexpr, EVEN: tl.constexpr):
        """Iteration `it` (weights it*KW .. it*KW+KW of K) of BN rows (byte pointers) against x -> [BN].
        EVEN: KW divides K (no tile has blocks past the row's end). tab: the lookup formats' codebooks. xq: the row
        of x rounded to int8 (`dp4a_triton.quantize_rows`) where a dp4a tile reads it."""
        if QT == 12:  # Q4_K
            return dp4a_triton.q4k_dp4a_tile(row, xp, xq, it * (KW // 256), K // 256, BN, KW // 256, EVEN)
        elif QT == 13:  # Q5_K
            return dp4a_triton.q5k_dp4a_tile(row, xp, xq, it * (KW // 256), K // 256, BN, KW // 256, EVEN)
        elif QT == 14:  # Q6_K
            return dp4a_triton.q6k_dp4a_tile(row, xp, xq, it * (KW // 256), K // 256, BN, KW // 256, EVEN)
        elif QT == 10:  # Q2_K
            return dp4a_triton.q2k_dp4a_tile(row, xp, xq, it * (KW // 256), K // 256, BN, KW // 256, EVEN)
        elif QT == 11:  # Q3_K
            return dp4a_triton.q3k_dp4a_tile(row, xp, xq, it * (KW // 256), K // 256, BN, KW // 256, EVEN)
        elif QT == 23:  # IQ4_XS
            return iquant_triton.iq4xs_tile(row, xp, tab, it * (KW // 256), K // 256, BN, KW // 256, EVEN)
        elif QT == 16:  # IQ2_XXS
            return dp4a_triton.iq2xxs_tile(row, xp, xq, tab, it * (KW // 256), K // 256, BN, KW // 256, EVEN)
        elif QT == 22:  # IQ2_S
            return dp4a_triton.iq2s_tile(row, xp, xq, tab, it * (KW // 256), K // 256, BN, KW // 256, EVEN)
        elif QT == 18:  # IQ3_XXS
            return dp4a_triton.iq3xxs_tile(row, xp, xq, tab, it * (KW // 256), K // 256, BN, KW // 256, EVEN)
        elif QT == 39:  # MXFP4
            return iquant_triton.mxfp4_tile(row, xp, tab, it * (KW // 32), K // 32, BN, KW // 32, EVEN)
        elif QT == 20:  # IQ4_NL
            return iquant_triton.iq4nl_tile(row, xp, tab, it * (KW // 32), K // 32, BN, KW // 32, EVEN)
        elif QT == 2:  # Q4_0
            return q32_tile(row, xp, it * (KW // 32), K // 32, BN, KW // 32, EVEN, 0)
        elif QT == 3:  # Q4_1
            return q32_tile(row, xp, it * (KW // 32), K // 32, BN, KW // 32, EVEN, 1)
        elif QT == 6:  # Q5_0
            return q32_tile(row, xp, it * (KW // 32), K // 32, BN, KW // 32, EVEN, 2)
        elif QT == 7:  # Q5_1
            return q32_tile(row, xp, it * (KW // 32), K // 32, BN, KW // 32, EVEN, 3)
        elif QT == 17:  # IQ2_XS
            return iquant_x_triton.iq2xs_tile(row, xp, tab, it * (KW // 256), K // 256, BN, KW // 256, EVEN)
        elif QT == 21:  # IQ3_S
            return iquant_x_triton.iq3s_tile(row, xp, tab, it * (KW // 256), K // 256, BN, KW // 256, EVEN)
        elif QT == 19:  # IQ1_S
            return iquant_x_triton.iq1s_tile(row, xp, tab, it * (KW // 256), K // 256, BN, KW // 256, EVEN)
        elif QT == 29:  # IQ1_M
            return iquant_x_triton.iq1m_tile(row, xp, tab, it * (KW // 256), K // 256, BN, KW // 256, EVEN)
        else:  # Q8_0
            return dp4a_triton.q8_0_dp4a_tile(row, xp, xq, it * (KW // 32), K // 32, BN, KW // 32, EVEN)

    @triton.jit
    def _glu_kernel(x, xq, gate, up, slots, hgate, hup, eids, tab, out, P, N, K, R, g_slot_bytes, u_slot_bytes,
                    g_row_bytes, u_row_bytes, QG: tl.constexpr, QU: tl.constexpr, BN: tl.constexpr, KW: tl.constexpr,
                    EVEN: tl.constexpr, HOST: tl.constexpr, PARTS: tl.constexpr = False):
        pid = tl.program_id(0)
        p = pid % P  # pairs vary fastest: pairs sharing a slot read its rows back to back (L2)
        n = (pid // P) * BN + tl.arange(0, BN)
        nm = n < N
        n = tl.minimum(n, N - 1).to(tl.int64)
        s = tl.load(slots + p).to(tl.int64)
        gb = gate + s * g_slot_bytes
        ub = up + s * u_slot_bytes
        if HOST:  # a miss reads expert eids[p] where it lies in (mapped, pinned) host memory
            if s < 0:
                e = tl.load(eids + p).to(tl.int64)
                gb = hgate + e * g_slot_bytes
                ub = hup + e * u_slot_bytes
                s = s - s  # (keeps its int64 type: a Triton if-block may not retype it)
        if s >= 0:
            xp = x + (p // R) * K  # R pairs a row of x (a token's k choices read its one row)
            xqp = xq + (p // R) * (K // 32 * 9)
            grow = gb + n * g_row_bytes  # [BN]
            urow = ub + n * u_row_bytes
            if PARTS:  # (dp4a_triton.parted: sub-block partial sums, summed once after the loop)
                g2 = tl.zeros([BN, KW // 32, 4], dtype=tl.float32)
                u2 = tl.zeros([BN, KW // 32, 4], dtype=tl.float32)
                for it in range(0, tl.cdiv(K, KW)):
                    g2 += dp4a_triton.parts(grow, xqp, tab, it, K, QG, BN, KW, EVEN)
                    u2 += dp4a_triton.parts(urow, xqp, tab, it, K, QU, BN, KW, EVEN)
                g = tl.sum(tl.sum(g2, axis=2), axis=1)
                u = tl.sum(tl.sum(u2, axis=2), axis=1)
            else:
                g = tl.zeros([BN], dtype=tl.float32)
                u = tl.zeros([BN], dtype=tl.float32)
                for it in range(0, tl.cdiv(K, KW)):  # both tiles of an iteration in flight together
                    g += _tile_dot(grow, xp, xqp, tab, it, K, QG, BN, KW, EVEN)
                    u += _tile_dot(urow, xp, xqp, tab, it, K, QU, BN, KW, EVEN)
            tl.store(out + p * N + n, g / (1.0 + tl.exp(-g)) * u, mask=nm)
        else:  # a miss: no weight is read
            tl.store(out + p * N + n, tl.zeros([BN], dtype=tl.float32), mask=nm)

    @triton.jit
    def _gemv_kernel(x, xq, w, slots, hw, eids, tab, out, P, N, K, slot_bytes, row_bytes, QT: tl.constexpr,
                     BN: tl.constexpr, KW: tl.constexpr, EVEN: tl.constexpr, GATHER: tl.constexpr,
                     HOST: tl.constexpr, PARTS: tl.constexpr = False):
        """out[p] = x[p] @ W.T for W = slot slots[p] of w (GATHER) or w itself; out in its own dtype. HOST: a
        negative slot reads expert eids[p] of hw (the host store) instead of giving 0."""
        pid = tl.program_id(0)
        p = pid % P  # rows of x vary fastest: they read the same weight rows back to back (L2)
        n = (pid // P) * BN + tl.arange(0, BN)
        nm = n < N
        n = tl.minimum(n, N - 1).to(tl.int64)
        if GATHER:
            s = tl.load(slots + p).to(tl.int64)
        else:
            s = 0
        base = w + s * slot_bytes
        if HOST:
            if s < 0:
                base = hw + tl.load(eids + p).to(tl.int64) * slot_bytes
                s = s - s  # (keeps its int64 type: a Triton if-block may not retype it)
        if s >= 0:
            row = base + n * row_bytes  # [BN]
            if PARTS:
                acc2 = tl.zeros([BN, KW // 32, 4], dtype=tl.float32)
                for it in range(0, tl.cdiv(K, KW)):
                    acc2 += dp4a_triton.parts(row, xq + p * (K // 32 * 9), tab, it, K, QT, BN, KW, EVEN)
                acc = tl.sum(tl.sum(acc2, axis=2), axis=1)
            else:
                acc = tl.zeros([BN], dtype=tl.float32)
                for it in range(0, tl.cdiv(K, KW)):
                    acc += _tile_dot(row, x + p * K, xq + p * (K // 32 * 9), tab, it, K, QT, BN, KW, EVEN)
            tl.store(out + p * N + n, acc.to(out.dtype.element_ty), mask=nm)
        else:
            tl.store(out + p * N + n, tl.zeros([BN], dtype=out.dtype.element_ty), mask=nm)


def block_len(qtype) -> int:
    """Weights per block of a supported format (the K- and i-quants: 256, Q8_0, MXFP4, IQ4_NL and Q32's: 32)."""
    return 32 if qtype in (Q.Q8_0, Q.MXFP4, Q.IQ4_NL) or qtype in Q32 else 256


def codebooks_for(qtypes, other: torch.Tensor) -> torch.Tensor:
    """What the kernels' `tab` argument points to: the lookup formats' codebooks on `other`'s device when one of
    `qtypes` reads them, else `other` itself (never read: no table is built, nothing is copied)."""
    if any(qt in iquant_triton.FORMATS for qt in qtypes):
        return iquant_triton.table(other.device)
    return other


def aligned(raw: torch.Tensor) -> bool:
    """The kernels' u32 / f16 loads need 4-byte aligned weights laid out row after row."""
    return raw.is_contiguous() and raw.data_ptr() % 4 == 0


# The lookup formats' tiles are checked against their torch twins in Triton's interpreter; compiled for a GPU a
# format's tile is taken only once the GPU tests have passed it (tests/experts/test_expert_triton.py). (The IQ2_XXS /
# IQ3_XXS tiles once computed wrong sums compiled while the interpreter agreed: written in rank-4 tensors, with their
# scale words assembled in uint32, they pass on an H200.)
LOOKUP_ON_GPU = frozenset({Q.IQ4_XS, Q.MXFP4, Q.IQ2_XXS, Q.IQ3_XXS, Q.IQ2_S})
# IQ4_NL (the rows of an i-quant mix that are not whole 256-blocks: GLM-4.5-Air's 1,408-wide down projections)
# joins once its GPU test has passed (tools/gpu/gated.sh)
IQ4NL_GPU_TESTED = True
if IQ4NL_GPU_TESTED:
    LOOKUP_ON_GPU = LOOKUP_ON_GPU | {Q.IQ4_NL}
# IQ2_XS, IQ3_S, IQ1_S and IQ1_M (strata.ops.iquant_x_triton) likewise (tools/gpu/gated.sh)
IQX_GPU_TESTED = True
if IQX_GPU_TESTED:
    LOOKUP_ON_GPU = LOOKUP_ON_GPU | {Q.IQ2_XS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M}
# The same for the block formats of strata.ops.kquant_triton: Q5_K (llama.cpp's _M and Unsloth's _XL mixes keep
# some experts and projections in it) joins once tests/experts/test_expert_triton.py and tests/ops/test_qgemv.py
# have passed it on a GPU.
K_ON_GPU = frozenset({Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K})
# Q2_K and Q3_K (the experts of llama.cpp's Q2_K and Q3_K_* files and of Unsloth's low-bit UD mixes) join likewise
# (tools/gpu/gated.sh)
K23_GPU_TESTED = True
if K23_GPU_TESTED:
    K_ON_GPU = K_ON_GPU | {Q.Q2_K, Q.Q3_K}
# and Q4_0 / Q4_1 / Q5_0 / Q5_1 (a K-quant file's rows that are not whole 256-blocks: GLM-4.5-Air's expert downs)
Q32_GPU_TESTED = True
if Q32_GPU_TESTED:
    K_ON_GPU = K_ON_GPU | set(Q32)


def supports(gate, up, down) -> bool:
    """Triton is importable and the pool's formats have kernels (K a whole number of blocks)."""
    if triton is None:
        return False
    interp = triton_interpreting()
    for t in (gate, up, down):
        if t.qtype not in SUPPORTED or t.shape[-1] % block_len(t.qtype) or not aligned(t.raw):
            return False
        if t.qtype in iquant_triton.FORMATS and not (interp or t.qtype in LOOKUP_ON_GPU):
            return False
        if t.qtype not in iquant_triton.FORMATS and not (interp or t.qtype in K_ON_GPU):
            return False
    return True


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def plan(qtypes, N: int, K: int, batch: int, device: torch.device, block_n: int | None = None,
         block_k: int | None = None, host: bool = False, dtype: torch.dtype | None = None) -> tuple[int, int, bool, int]:
    """(BN rows per program, KW weights per iteration, EVEN: KW divides K, num_warps) for a launch over
    `batch` x N rows of the weights `qtypes` (one, or gate and up read together).

    One warp per program, KW_DECODE weights of a row per iteration (the largest power of two dividing K up to
    that, so tiles need no masks; if that is small (K = 96: 32), the next power of two >= K, the blocks past K
    masked), ROWS_MAX rows halved until the launch has PROGRAMS_PER_SM programs per SM (the interpreter on the
    CPU counts as one SM) and the tile is within the format's TILE. Measured over every (BN, KW, warps) of the
    Qwen3-30B-A3B decode shapes (`tools/bench_kernels.py --sweep`; docs/BENCHMARKS.md): one-warp programs with
    256-512 weights a row per iteration were the fastest or close to it for every shape, where the earlier rule
    (multi-warp programs, whole 2048-weight rows per iteration) was much slower for the expert GLU and the LM head. block_n / block_k override (powers of two; block_k a multiple of the block length).

    dtype: the activations' (None: half precision), where the i-quants' dp4a tiles take KW_DECODE_DP4A_IQ.

    host: the launch may read missed experts from pinned host RAM over the bus, where a program needs many more
    bytes in flight than in HBM: such launches keep the wide tiles they were measured with (`_plan_wide`; the
    sweep above timed VRAM reads only).
    """
    if host:
        return _plan_wide(qtypes, N, K, batch, device, block_n, block_k)
    # (the GLU launches only, where it was measured: gate and up read together)
    dp4a_iq = len(qtypes) == 2 and all(qt in dp4a_triton.IQ_FORMATS and dp4a_triton.rounds_activations(qt, dtype)
                                       for qt in qtypes)
    dp4a_kq = len(qtypes) == 2 and all(qt in DP4A_KQ_GLU and dp4a_triton.rounds_activations(qt, dtype)
                                       for qt in qtypes)
    most = KW_DECODE
    if dp4a_iq:
        most = KW_DECODE_DP4A_IQ
    elif dp4a_kq and all(qt == Q.Q4_K for qt in qtypes) and K <= DP4A_Q4K_GLU_KW_MAX_K:
        most = DP4A_Q4K_GLU_KW
    kw = _kw(qtypes, K, most, block_k)
    per_sm = DP4A_KQ_GLU_PROGRAMS if dp4a_kq else PROGRAMS_PER_SM
    tile = min(TILE[qt][0] for qt in qtypes)
    weights = kw * len(qtypes)  # per row and iteration
    if block_n:
        bn = block_n
    else:
        bn = DP4A_Q4K_GLU_ROWS_MAX if dp4a_kq and all(qt == Q.Q4_K for qt in qtypes) else ROWS_MAX
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else 1
        while bn > 1 and (bn * weights > tile or batch * triton.cdiv(N, bn) < per_sm * sms):
            bn //= 2
        if dp4a_iq and dp4a_triton.C_PARTS and K >= DP4A_IQ_ONE_ROW_ITERS * kw:
            bn = 1
    return bn, kw, K % kw == 0, 1


WIDE_KW_MAX, WIDE_ROWS_MAX, WIDE_WARPS_PER_SM = 2048, 16, 8


def _kw(qtypes, K: int, most: int, block_k: int | None) -> int:
    """Weights of a row per iteration: the largest power of two dividing K up to `most` (no masks); if that is
    small (K = 96: 32), the next power of two >= K (up to KW_MAX), the blocks past K masked; block_k overrides."""
    if block_k:
        return block_k
    kw = min(most, K & -K)
    if kw < min(K, 256):
        kw = min(KW_MAX, triton.next_power_of_2(K))
    return max(kw, max(block_len(qt) for qt in qtypes))


def _plan_wide(qtypes, N: int, K: int, batch: int, device: torch.device, block_n: int | None,
               block_k: int | None) -> tuple[int, int, bool, int]:
    """Whole rows (up to WIDE_KW_MAX weights) per iteration, rows filling the format's TILE, then halved until the
    launch has WIDE_WARPS_PER_SM warps per SM; warps give each thread ~TILE's per-thread weights (1 to 4)."""
    kw = _kw(qtypes, K, WIDE_KW_MAX, block_k)
    tile, per_thread = min(TILE[qt] for qt in qtypes)
    weights = kw * len(qtypes)

    def warps(bn: int) -> int:
        n = 1
        while n < 4 and 2 * n * 32 * per_thread <= bn * weights:
            n *= 2
        return n

    if block_n:
        bn = block_n
    else:
        bn = 1
        while bn < WIDE_ROWS_MAX and 2 * bn * weights <= tile:
            bn *= 2
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else 1
        while bn > 1 and batch * triton.cdiv(N, bn) * warps(bn) < WIDE_WARPS_PER_SM * sms:
            bn //= 2
    return bn, kw, K % kw == 0, warps(bn)


def triton_expert_ffn(x: torch.Tensor, gate, up, down, slots: torch.Tensor, block_n: int | None = None,
                      block_k: int | None = None, host=None, eids: torch.Tensor | None = None,
                      repeat: int = 1) -> torch.Tensor:
    """x [P / repeat, d] (pair p reads row p // repeat: a token's k choices need no repeated copy), pools (QTensor
    [S, ff, d], [S, ff, d], [S, d, ff]), slots [P] (negative: output 0) -> [P, d] float32. host: the layer's
    experts where they lie (QTensors [E, ...] of the pool's formats; on CUDA pinned host memory, which the
    kernels read over the bus) and eids [P] each pair's expert: a negative slot then reads expert eids[p] from
    there instead of giving 0."""
    P, d = slots.shape[0], x.shape[1]
    if x.shape[0] * repeat != P:
        raise ValueError(f"{x.shape[0]} rows of x x {repeat} pairs a row != {P} slots")
    ff = gate.shape[1]
    x = x.contiguous()
    slots = slots.contiguous()
    a = torch.empty(P, ff, dtype=torch.float32, device=x.device)
    y = torch.empty(P, d, dtype=torch.float32, device=x.device)
    if P == 0:
        return y
    g, u, dn = gate.raw, up.raw, down.raw
    if host is not None:
        hg, hu, hd = (t.raw for t in host)
        ids = eids.contiguous()
    else:
        hg, hu, hd, ids = g, u, dn, slots  # not read
    tab = codebooks_for((gate.qtype, up.qtype, down.qtype), a)
    bn, kw, even, warps = plan((gate.qtype, up.qtype), ff, d, P, x.device, block_n, block_k, host is not None, x.dtype)
    xq = dp4a_triton.int8_rows(x, (gate.qtype, up.qtype))
    _glu_kernel[(P * triton.cdiv(ff, bn),)](
        x, xq, g, u, slots, hg, hu, ids, tab, a, P, ff, d, repeat, g[0].numel(), u[0].numel(), g.shape[-1], u.shape[-1],
        QG=int(gate.qtype), QU=int(up.qtype), BN=bn, KW=kw, EVEN=even, HOST=host is not None, num_warps=warps,
        PARTS=dp4a_triton.parted((gate.qtype, up.qtype), xq))
    bn, kw, even, warps = plan((down.qtype,), d, ff, P, x.device, block_n, block_k, host is not None, x.dtype)
    aq = dp4a_triton.int8_rows(a, (down.qtype,), x.dtype)
    _gemv_kernel[(P * triton.cdiv(d, bn),)](
        a, aq, dn, slots, hd, ids, tab, y, P, d, ff, dn[0].numel(), dn.shape[-1], QT=int(down.qtype), BN=bn, KW=kw,
        EVEN=even, GATHER=True, HOST=host is not None, num_warps=warps, PARTS=dp4a_triton.parted((down.qtype,), aq))
    return y
