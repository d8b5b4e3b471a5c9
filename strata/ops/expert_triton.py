"""Fused expert FFN over a slot pool in Triton: Q4_K / Q6_K / Q8_0 blocks read straight from the slots, no
dequantized copy, two launches per MoE layer. The same tile functions serve the dense decode GEMV
(`strata.ops.qgemv`).

For each (pair p, block of BN output rows) a program reads the slot `slots[p]` (negative = a miss: the pair's
output is zero and no weight is read), walks the reduction dimension KW weights at a time, decodes the GGML
blocks in registers and accumulates in float32:

    kernel 1:  a[p] = silu(x[p] @ gate[slot].T) * (x[p] @ up[slot].T)      [P, ff]
    kernel 2:  y[p] = a[p] @ down[slot].T                                  [P, d]

Reference twin: `strata.ops.expert_gather.gather_expert_ffn` (tests run these kernels in Triton's
interpreter on the CPU; see tests/experts/test_expert_triton.py). Q4_K block (144 bytes / 256 weights): f16 d,
f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles (byte c of the 128: low nibble = weight
64*(c//32) + c%32, high nibble = that + 32). Q6_K block (210 bytes / 256 weights): 128 bytes ql of low
nibbles, 64 bytes qh of 2-bit high parts, 16 int8 scales (one per 16 weights), f16 d;
weight = d * scale * (q - 32). Q8_0 block (34 bytes / 32 weights): f16 d, 32 int8.

Why the tiles look as they do (a decode GEMV moves each weight byte once, so it is bound by memory latency
unless many bytes are in flight):
- One loop iteration loads a whole [BN rows, KW weights] tile (KW up to 2048: a Qwen3 row of 2048 in one
  go), i.e. [BN, NB, 32] Q8_0 or [BN, NB, 128] K-quant bytes, ~TILE_BYTES per program, not one block per row.
- `_plan` picks BN so that a launch still has >= PROGRAMS_PER_SM programs per SM (a 512-row weight gets 1-row
  programs, a 150K-row head 2-row ones); the grid is flat (pid = row block * P + p) so no axis limit binds.
- f16 scales and the Q4_K scale words are single aligned loads (the byte pointer cast to f16 / u32).
- The Q4_K 6-bit scales and mins are decoded from three u32 words with 4-byte-wide bit operations
  (llama.cpp's get_scale_min_k4) on a [BN, NB, 4] tensor, then broadcast; the weight math is factored per
  sub-block: d*sc * sum(q*x) - dmin*m * sum(x), the sums of x shared by all rows of the program.
- Integers become floats through the exponent trick (bits 0x4B000000 | v are the float 2^23 + v), never an
  I2F instruction, which issues at 1/8 of the FMA rate on sm_90 and would cap Q4_K well below the roofline.
All products of quant integers with f16 scales are exact in float32; sums are float32.
"""

from __future__ import annotations

import functools

import torch
from gguf import GGMLQuantizationType

Q = GGMLQuantizationType

try:  # Triton is optional: without it (or without a GPU) the torch grouped path runs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

SUPPORTED = frozenset({Q.Q4_K, Q.Q6_K, Q.Q8_0})
QUANT_BYTES = {Q.Q4_K: 128, Q.Q6_K: 192, Q.Q8_0: 32}  # quant bytes per block (the bulk of each block)
KW_MAX = 2048  # weights of a row per loop iteration
TILE_BYTES = 4096  # quant bytes per program per iteration (all weights it reads): ~32 bytes per thread
ROWS_MAX = 16  # rows per program
PROGRAMS_PER_SM = 4  # fewer rows per program until a launch has this many programs per SM
NUM_WARPS = 4


def available() -> bool:
    return triton is not None


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
    def _int_f32(v, off: tl.constexpr):
        """float32(v) - off for int32 v in [0, 2^23): the bits 0x4B000000 | v are the float 2^23 + v (exact)."""
        return (v | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + off)

    @triton.jit
    def _q8_0_tile(row, xp, b0, nblk, BN: tl.constexpr, NB: tl.constexpr):
        """Blocks b0 .. b0+NB (those < nblk) of BN rows of Q8_0 blocks (row: [BN] byte pointers) against x
        (xp: pointer to K floats) -> [BN] float32."""
        c = tl.arange(0, 32)
        j = b0 + tl.arange(0, NB)  # [NB] block index
        jm = j < nblk
        blk = row[:, None] + (j * 34)[None, :]  # [BN, NB] byte pointers to the blocks
        d = _f16(blk, jm[None, :])  # [BN, NB]
        q = tl.load(blk[:, :, None] + 2 + c[None, None, :], mask=jm[None, :, None], other=0,
                    eviction_policy="evict_first")  # [BN, NB, 32] the int8 as bytes
        xv = tl.load(xp + (j * 32)[:, None] + c[None, :], mask=jm[:, None], other=0.0).to(tl.float32)  # [NB, 32]
        qs = _int_f32(q.to(tl.int32) ^ 128, 128.0)  # (q ^ 128) = int8 value + 128
        return tl.sum(d * tl.sum(qs * xv[None, :, :], axis=2), axis=1)

    @triton.jit
    def _q4k_tile(row, xp, b0, nsb, BN: tl.constexpr, NB: tl.constexpr):
        """Superblocks b0 .. b0+NB (those < nsb) of BN rows of Q4_K blocks against x -> [BN] float32."""
        g = tl.arange(0, 4)  # 32-byte group of the 128 quant bytes: low nibbles = sub-block 2g, high = 2g+1
        l = tl.arange(0, 32)
        sb = b0 + tl.arange(0, NB)  # [NB] superblock index
        sm = sb < nsb
        m2 = sm[None, :]
        blk = row[:, None] + (sb * 144)[None, :]  # [BN, NB]
        d = _f16(blk, m2)[:, :, None]  # [BN, NB, 1]
        dmin = _f16(blk + 2, m2)[:, :, None]
        s0 = _u32(blk + 4, m2)  # [BN, NB] scale bytes 0-3
        s1 = _u32(blk + 8, m2)  # 4-7
        s2 = _u32(blk + 12, m2)  # 8-11
        # 6-bit scale / min of sub-block j, byte j % 4 of a word (llama.cpp's get_scale_min_k4, 4 at a time):
        # j < 4: s[j] & 63, s[j+4] & 63; j >= 4: (s[j+4] & 15) | (s[j-4] >> 6) << 4, (s[j+4] >> 4) | (s[j] >> 6) << 4
        sc_a = s0 & 0x3F3F3F3F
        mn_a = s1 & 0x3F3F3F3F
        sc_b = (s2 & 0x0F0F0F0F) | ((s0 >> 2) & 0x30303030)
        mn_b = ((s2 >> 4) & 0x0F0F0F0F) | ((s1 >> 2) & 0x30303030)
        first = (g < 2)[None, None, :]  # groups 0, 1 hold sub-blocks 0-3 (word a), groups 2, 3 sub-blocks 4-7
        sh = (16 * (g % 2))[None, None, :]  # [1, 1, 4] shift of sub-block 2g's byte in its word
        scw = tl.where(first, sc_a[:, :, None], sc_b[:, :, None])  # [BN, NB, 4]
        mnw = tl.where(first, mn_a[:, :, None], mn_b[:, :, None])
        a_lo = d * ((scw >> sh) & 63).to(tl.float32)  # [BN, NB, 4] d * scale of sub-block 2g
        a_hi = d * ((scw >> (sh + 8)) & 63).to(tl.float32) * 0.0625  # of 2g+1; /16: its nibble is read as 16*q
        b_lo = dmin * ((mnw >> sh) & 63).to(tl.float32)
        b_hi = dmin * ((mnw >> (sh + 8)) & 63).to(tl.float32)
        byte = (32 * g)[:, None] + l[None, :]  # [4, 32]
        q = tl.load(blk[:, :, None, None] + 16 + byte[None, None, :, :], mask=m2[:, :, None, None], other=0,
                    eviction_policy="evict_first").to(tl.int32)  # [BN, NB, 4, 32]
        xo = (sb * 256)[:, None, None] + (64 * g)[None, :, None] + l[None, None, :]  # [NB, 4, 32] low nibble's x
        xm = sm[:, None, None]
        xl = tl.load(xp + xo, mask=xm, other=0.0).to(tl.float32)  # [NB, 4, 32]
        xh = tl.load(xp + xo + 32, mask=xm, other=0.0).to(tl.float32)
        dl = tl.sum(_int_f32(q & 15, 0.0) * xl[None], axis=3)  # [BN, NB, 4] sum q*x of sub-block 2g
        dh = tl.sum(_int_f32(q & 240, 0.0) * xh[None], axis=3)  # 16 * sum q*x of sub-block 2g+1
        sl = tl.sum(xl, axis=2)[None]  # [1, NB, 4] sum x of sub-block 2g
        shs = tl.sum(xh, axis=2)[None]
        part = a_lo * dl + a_hi * dh - (b_lo * sl + b_hi * shs)  # [BN, NB, 4]
        return tl.sum(tl.sum(part, axis=2), axis=1)

    @triton.jit
    def _q6k_tile(row, xp, b0, nsb, BN: tl.constexpr, NB: tl.constexpr):
        """Superblocks b0 .. b0+NB (those < nsb) of BN rows of Q6_K blocks against x -> [BN] float32.

        ql byte c = 64h + 32j + l (llama.cpp's dequantize_row_q6_K): low nibble = weight 128h + 32j + l, high
        nibble = that + 64; their 2 high bits sit in qh byte 32h + l at bits 2j and 2j + 4. Here c = 16g + m:
        h = g // 4, j = (g // 2) % 2, l = 16 (g % 2) + m, and the low nibble's scale (one per 16 weights) is
        g + 4h, the high nibble's g + 4h + 4.
        """
        g = tl.arange(0, 8)
        mm = tl.arange(0, 16)
        h = g // 4
        jj = (g // 2) % 2
        lane = (16 * (g % 2))[:, None] + mm[None, :]  # [8, 16] l
        sb = b0 + tl.arange(0, NB)
        sm = sb < nsb
        m2 = sm[None, :]
        blk = row[:, None] + (sb * 210)[None, :]  # [BN, NB]
        d = _f16(blk + 208, m2)  # [BN, NB]
        sidx = (g + 4 * h)[None, None, :]  # [1, 1, 8]
        m3 = m2[:, :, None]
        sc_lo = tl.load(blk[:, :, None] + 192 + sidx, mask=m3, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        sc_hi = tl.load(blk[:, :, None] + 196 + sidx, mask=m3, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        m4 = m2[:, :, None, None]
        b4 = blk[:, :, None, None]
        ql = tl.load(b4 + ((16 * g)[:, None] + mm[None, :])[None, None], mask=m4, other=0,
                     eviction_policy="evict_first").to(tl.int32)  # [BN, NB, 8, 16]
        qh = tl.load(b4 + 128 + ((32 * h)[:, None] + lane)[None, None], mask=m4, other=0,
                     eviction_policy="evict_first").to(tl.int32)  # [BN, NB, 8, 16]; each qh byte twice
        sh = (2 * jj)[None, None, :, None]  # [1, 1, 8, 1]
        q_lo = _int_f32((ql & 15) | (((qh >> sh) & 3) << 4), 32.0)  # [BN, NB, 8, 16] in -32..31
        q_hi = _int_f32((ql >> 4) | (((qh >> (sh + 4)) & 3) << 4), 32.0)
        xo = (sb * 256)[:, None, None] + ((128 * h + 32 * jj)[:, None] + lane)[None]  # [NB, 8, 16]
        xm = sm[:, None, None]
        xl = tl.load(xp + xo, mask=xm, other=0.0).to(tl.float32)
        xh = tl.load(xp + xo + 64, mask=xm, other=0.0).to(tl.float32)
        part = sc_lo * tl.sum(q_lo * xl[None], axis=3) + sc_hi * tl.sum(q_hi * xh[None], axis=3)  # [BN, NB, 8]
        return tl.sum(d * tl.sum(part, axis=2), axis=1)

    @triton.jit
    def _tile_dot(row, xp, it, K, QT: tl.constexpr, BN: tl.constexpr, KW: tl.constexpr):
        """Iteration `it` (weights it*KW .. it*KW+KW of K) of BN rows (byte pointers) against x -> [BN]."""
        if QT == 12:  # Q4_K
            return _q4k_tile(row, xp, it * (KW // 256), K // 256, BN, KW // 256)
        elif QT == 14:  # Q6_K
            return _q6k_tile(row, xp, it * (KW // 256), K // 256, BN, KW // 256)
        else:  # Q8_0
            return _q8_0_tile(row, xp, it * (KW // 32), K // 32, BN, KW // 32)

    @triton.jit
    def _glu_kernel(x, gate, up, slots, out, P, N, K, g_slot_bytes, u_slot_bytes, g_row_bytes, u_row_bytes,
                    QG: tl.constexpr, QU: tl.constexpr, BN: tl.constexpr, KW: tl.constexpr):
        pid = tl.program_id(0)
        p = pid % P  # pairs vary fastest: pairs sharing a slot read its rows back to back (L2)
        n = (pid // P) * BN + tl.arange(0, BN)
        nm = n < N
        n = tl.minimum(n, N - 1).to(tl.int64)
        s = tl.load(slots + p).to(tl.int64)
        if s >= 0:
            xp = x + p * K
            grow = gate + s * g_slot_bytes + n * g_row_bytes  # [BN]
            urow = up + s * u_slot_bytes + n * u_row_bytes
            g = tl.zeros([BN], dtype=tl.float32)
            u = tl.zeros([BN], dtype=tl.float32)
            for it in range(0, tl.cdiv(K, KW)):  # both tiles of an iteration in flight together
                g += _tile_dot(grow, xp, it, K, QG, BN, KW)
                u += _tile_dot(urow, xp, it, K, QU, BN, KW)
            tl.store(out + p * N + n, g / (1.0 + tl.exp(-g)) * u, mask=nm)
        else:  # a miss: no weight is read
            tl.store(out + p * N + n, tl.zeros([BN], dtype=tl.float32), mask=nm)

    @triton.jit
    def _gemv_kernel(x, w, slots, out, P, N, K, slot_bytes, row_bytes, QT: tl.constexpr, BN: tl.constexpr,
                     KW: tl.constexpr, GATHER: tl.constexpr):
        """out[p] = x[p] @ W.T for W = slot slots[p] of w (GATHER) or w itself; out in its own dtype."""
        pid = tl.program_id(0)
        p = pid % P  # rows of x vary fastest: they read the same weight rows back to back (L2)
        n = (pid // P) * BN + tl.arange(0, BN)
        nm = n < N
        n = tl.minimum(n, N - 1).to(tl.int64)
        if GATHER:
            s = tl.load(slots + p).to(tl.int64)
        else:
            s = 0
        if s >= 0:
            row = w + s * slot_bytes + n * row_bytes  # [BN]
            acc = tl.zeros([BN], dtype=tl.float32)
            for it in range(0, tl.cdiv(K, KW)):
                acc += _tile_dot(row, x + p * K, it, K, QT, BN, KW)
            tl.store(out + p * N + n, acc.to(out.dtype.element_ty), mask=nm)
        else:
            tl.store(out + p * N + n, tl.zeros([BN], dtype=out.dtype.element_ty), mask=nm)


def block_len(qtype) -> int:
    """Weights per block of a supported format (Q4_K and Q6_K: 256, Q8_0: 32)."""
    return 256 if qtype in (Q.Q4_K, Q.Q6_K) else 32


def aligned(raw: torch.Tensor) -> bool:
    """The kernels' u32 / f16 loads need 4-byte aligned weights laid out row after row."""
    return raw.is_contiguous() and raw.data_ptr() % 4 == 0


def supports(gate, up, down) -> bool:
    """Triton is importable and the pool's formats have kernels (K a whole number of blocks)."""
    if triton is None:
        return False
    for t in (gate, up, down):
        if t.qtype not in SUPPORTED or t.shape[-1] % block_len(t.qtype) or not aligned(t.raw):
            return False
    return True


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def plan(qtypes, N: int, K: int, batch: int, device: torch.device, block_n: int | None = None,
         block_k: int | None = None) -> tuple[int, int]:
    """(BN rows per program, KW weights per iteration) for a launch over `batch` x N rows of the weights
    `qtypes` (one, or gate and up read together). KW covers K up to KW_MAX; BN fills TILE_BYTES, then halves
    until the launch has PROGRAMS_PER_SM programs per SM (the interpreter on the CPU counts as one SM).
    block_n / block_k override (powers of two; block_k >= 256)."""
    kw = block_k or max(256, min(KW_MAX, triton.next_power_of_2(K)))
    if block_n:
        return block_n, kw
    row = sum(QUANT_BYTES[qt] * kw // block_len(qt) for qt in qtypes)  # quant bytes of one row per iteration
    bn = 1
    while bn < ROWS_MAX and 2 * bn * row <= TILE_BYTES:
        bn *= 2
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 1
    while bn > 1 and batch * triton.cdiv(N, bn) < PROGRAMS_PER_SM * sms:
        bn //= 2
    return bn, kw


def triton_expert_ffn(x: torch.Tensor, gate, up, down, slots: torch.Tensor, block_n: int | None = None,
                      block_k: int | None = None) -> torch.Tensor:
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
    bn, kw = plan((gate.qtype, up.qtype), ff, d, P, x.device, block_n, block_k)
    _glu_kernel[(P * triton.cdiv(ff, bn),)](
        x, g, u, slots, a, P, ff, d, g[0].numel(), u[0].numel(), g.shape[-1], u.shape[-1],
        QG=int(gate.qtype), QU=int(up.qtype), BN=bn, KW=kw, num_warps=NUM_WARPS)
    bn, kw = plan((down.qtype,), d, ff, P, x.device, block_n, block_k)
    _gemv_kernel[(P * triton.cdiv(d, bn),)](
        a, dn, slots, y, P, d, ff, dn[0].numel(), dn.shape[-1], QT=int(down.qtype), BN=bn, KW=kw, GATHER=True,
        num_warps=NUM_WARPS)
    return y
