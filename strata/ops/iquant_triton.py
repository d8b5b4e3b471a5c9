"""Triton tiles of the lookup-table formats for the fused expert kernels and the decode GEMV
(`strata.ops.expert_triton`): IQ2_XXS, IQ2_S, IQ3_XXS, IQ4_XS (the i-quants of the seeds' GLM / Qwen mixes), IQ4_NL and MXFP4
(gpt-oss's experts), read in place from the GGML blocks, no dequantized copy (IQ2_XS, IQ3_S, IQ1_S and IQ1_M: their
tiles are in `strata.ops.iquant_x_triton`, their grids in this module's table).

Each tile takes BN rows (byte pointers) of NB consecutive blocks, decodes them in registers and returns the BN dot
products with x, like the K-quant tiles beside them. The formats' codebooks (gguf-py's grids, sign patterns and
non-linear value tables, `strata.quant.iquants.table`) sit in one small float32 tensor on the device (`table`),
gathered from by index (a few KB: it stays in L1). Block layouts, as gguf-py dequantizes them:

    IQ4_XS   136 bytes / 256: f16 d, u16 of 8 x 2 high scale bits, 4 bytes of 8 x 4 low scale bits, 128 bytes of
             4-bit indices (sub-block ib: bytes 16 ib .. 16 ib + 15, low nibbles its weights 0-15, high 16-31);
             weight = d (scale - 32) iq4nl[index]
    IQ2_XXS   66 bytes / 256: f16 d, per sub-block of 32 two u32: 4 grid indices (bytes, 8 weights each), and
             4 x 7-bit sign indices + a 4-bit scale s; weight = d (0.5 + s) / 4 * grid[index][j] * sign
    IQ3_XXS   98 bytes / 256: f16 d, 64 grid index bytes (4 weights each), 8 u32 of 4 x 7-bit sign indices + a
             4-bit scale; weight = d (0.5 + s) / 2 * grid[index][j] * sign
    IQ2_S     82 bytes / 256: f16 d, 32 grid index bytes (8 weights each; 2 more bits each in qh), 32 sign bytes
             (bit j: weight j of the group negative), 8 bytes qh, 8 bytes of two 4-bit scales (16 weights each);
             weight = d (0.5 + s) / 4 * grid[index][j] * sign (IQ2_S's own 1024-entry grid)
    MXFP4     17 bytes / 32: an E8M0 exponent byte e, 16 bytes of 4-bit codes (low nibbles weights 0-15);
             weight = 2^(e - 128) * mxfp4[code] (gguf-py's doubled table; subnormal scales for e < 2)

The 66- and 98-byte blocks are only 2-byte aligned, so their u32 fields are read as two u16. Reference twins: the
torch dequantizers of `strata.quant.iquants` (tests/experts/test_expert_triton.py runs these tiles in Triton's
interpreter against them). Speed on a GPU: docs/BENCHMARKS.md, "The GPU lane per weight format".

Two tiles per 2- and 3-bit format. The lookup tiles gather one float per weight from the grid and one from the
sign table (three loads a weight: the load units' limit, well under Q4_K's bytes per second). The packed
tiles load per group of 8 (IQ3_XXS: 4) weights: the grid index, the entry's magnitudes as bytes in int32 words,
and the sign byte, then cut each weight's magnitude and sign out with shifts (under half a load a weight). The
packed ones pass their GPU tests but measured slower there (the shifts and int32 unpacking cost more than the
loads they save), so a GPU takes the lookup tiles (PACKED_GPU_TESTED); the interpreter runs both. A third kind,
four weights a step against int8 activations, is in `strata.ops.dp4a_triton` (behind its own flag).
"""

from __future__ import annotations

import threading

import torch
from gguf import GGMLQuantizationType

from strata.config import triton_interpreting

Q = GGMLQuantizationType

# the packed tiles of IQ2_XXS, IQ2_S and IQ3_XXS on a GPU: their GPU tests pass there, but they measured slower than
# the lookup tiles (`tools/bench_kernels.py --expert-formats ... --iq-tiles packed` against `lookup`; docs/BENCHMARKS.md,
# "The GPU lane per weight format"), so a GPU keeps the lookup tiles; the interpreter runs both
PACKED_GPU_TESTED = False

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# offsets (in floats) of each codebook in the table
T_IQ4NL, T_MXFP4, T_KSIGNS, T_IQ2XXS, T_IQ3XXS = 0, 16, 32, 32 + 128 * 8, 32 + 128 * 8 + 256 * 8
T_IQ2S = T_IQ3XXS + 256 * 4
# the packed codebooks, int32 words stored as their bits among the floats: IQ2_XXS and IQ2_S grid entries as two
# words (magnitude k in byte k % 4 of word k // 4), IQ3_XXS entries as one, the 128 sign bytes (bit j: weight j < 0)
T_P2XXS = T_IQ2S + 1024 * 8
T_P2S = T_P2XXS + 256 * 2
T_P3XXS = T_P2S + 1024 * 2
T_PSIGN = T_P3XXS + 256
# the grids of the tiles in strata.ops.iquant_x_triton: IQ2_XS [512, 8], IQ3_S [512, 4], IQ1_S (IQ1_M's too) [2048, 8]
T_IQ2XS = T_PSIGN + 128
T_IQ3S = T_IQ2XS + 512 * 8
T_IQ1S = T_IQ3S + 512 * 4
# the dp4a tiles' signs (strata.ops.dp4a_triton): entry 2 i + h, the 4 signs of half h of sign byte i as a
# word with 1 in each negative weight's byte
T_PONES = T_IQ1S + 2048 * 8
# IQ2_XXS's grid and signs as byte-permute selectors (strata.ops.dp4a_triton, `prmt`): entry i's word has nibble k =
# weight k's level (0, 1, 2: magnitudes 8, 25, 43); sign index i's word has bit 2 of nibble k set where weight k is
# negative, so an entry's word OR its signs' word selects each weight's signed byte from 8 constant bytes
T_SEL2XXS = T_PONES + 256
T_SELSIGN = T_SEL2XXS + 256
# the same for IQ2_S: its 1024-entry grid, and a sign byte's word by the byte itself (IQ2_S stores its signs as bytes)
T_SEL2S = T_SELSIGN + 128
T_SELSIGN8 = T_SEL2S + 1024
T_SIZE = T_SELSIGN8 + 256
# (the dp4a tiles may read these tables' word pairs as 64-bit words: each pair 8-byte aligned in a table whose base
# a torch allocation aligns)
assert T_P2XXS % 2 == 0 and T_P2S % 2 == 0 and T_PONES % 2 == 0
FORMATS = {Q.IQ2_XXS: 66, Q.IQ3_XXS: 98, Q.IQ4_XS: 136, Q.MXFP4: 17, Q.IQ2_S: 82, Q.IQ4_NL: 18,  # bytes per block
           Q.IQ2_XS: 74, Q.IQ3_S: 110, Q.IQ1_S: 50, Q.IQ1_M: 56}
_TABLES: dict[torch.device, torch.Tensor] = {}
_LOCK = threading.Lock()


def table(device: torch.device) -> torch.Tensor:
    """The codebooks of every format here, one float32 tensor on `device` (built once per device: the first call
    must not happen inside a CUDA graph capture; a capture's warm-up forwards make it)."""
    t = _TABLES.get(device)
    if t is None:
        from strata.quant.iquants import table as gguf_table

        with _LOCK:
            t = _TABLES.get(device)
            if t is None:
                parts = [gguf_table(n, torch.device("cpu")).reshape(-1) for n in ("iq4nl", "mxfp4", "ksigns",
                                                                                   "IQ2_XXS", "IQ3_XXS", "IQ2_S")]
                parts += _packed()
                parts += [gguf_table(n, torch.device("cpu")).reshape(-1) for n in ("IQ2_XS", "IQ3_S", "IQ1_S")]
                parts += [_ones(), *_selectors()]
                t = torch.cat(parts).to(torch.float32)
                assert t.numel() == T_SIZE, t.numel()
                t = _TABLES[device] = t.to(device)
    return t


def _ones() -> torch.Tensor:
    """T_PONES as float32 holding int32 bits."""
    import gguf.quants as gq
    import numpy as np

    signs = np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8).astype(np.int64)
    half = np.stack([signs & 15, signs >> 4], axis=1).reshape(-1)  # [256]: byte i's low then high 4 signs
    ones = sum(((half >> r) & 1) << (8 * r) for r in range(4))
    return torch.from_numpy(ones.astype(np.int32)).view(torch.float32)


def _selectors() -> list[torch.Tensor]:
    """T_SEL2XXS, T_SELSIGN, T_SEL2S and T_SELSIGN8 as float32 tensors holding int32 bits."""
    import gguf.quants as gq
    import numpy as np

    from strata.quant.iquants import table as gguf_table

    def levels(name: str) -> np.ndarray:  # [entries] an entry's 8 levels (magnitudes 8 / 25 / 43) as nibbles
        grid = gguf_table(name, torch.device("cpu")).numpy().astype(np.int64)
        level = np.searchsorted(np.array([8, 25, 43]), grid)
        assert (np.array([8, 25, 43])[level] == grid).all()
        return (level << (4 * np.arange(8))).sum(axis=1)

    def negative(signs: np.ndarray) -> np.ndarray:  # sign bytes (bit k: weight k < 0) -> bit 2 of nibble k
        return (((signs[:, None] >> np.arange(8)) & 1) << (4 * np.arange(8) + 2)).sum(axis=1)

    ksigns = np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8).astype(np.int64)  # [128]
    return [torch.from_numpy(v.astype(np.uint32).view(np.int32)).view(torch.float32)
            for v in (levels("IQ2_XXS"), negative(ksigns), levels("IQ2_S"), negative(np.arange(256)))]


def _packed() -> list[torch.Tensor]:
    """The packed codebooks (T_P2XXS ...) as float32 tensors holding int32 bits."""
    import gguf.quants as gq
    import numpy as np

    from strata.quant.iquants import table as gguf_table

    def words(name: str) -> torch.Tensor:  # each entry's magnitudes as bytes, read as little-endian int32 words
        grid = gguf_table(name, torch.device("cpu")).numpy()
        return torch.from_numpy(np.ascontiguousarray(grid.astype(np.uint8)).view("<i4").reshape(-1).copy())

    signs = torch.from_numpy(np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8).astype(np.int32))
    return [w.view(torch.float32) for w in (words("IQ2_XXS"), words("IQ2_S"), words("IQ3_XXS"), signs)]


if triton is not None:
    # the offsets as Triton constants: a compiled kernel may read a global only when it is a constexpr (the
    # interpreter on the CPU reads any global, so only a GPU catches this)
    C_IQ4NL, C_MXFP4, C_KSIGNS, C_IQ2XXS, C_IQ3XXS, C_IQ2S = (tl.constexpr(v) for v in (
        T_IQ4NL, T_MXFP4, T_KSIGNS, T_IQ2XXS, T_IQ3XXS, T_IQ2S))
    C_P2XXS, C_P2S, C_P3XXS, C_PSIGN = (tl.constexpr(v) for v in (T_P2XXS, T_P2S, T_P3XXS, T_PSIGN))
    C_IQ2XS, C_IQ3S, C_IQ1S, C_PONES = (tl.constexpr(v) for v in (T_IQ2XS, T_IQ3S, T_IQ1S, T_PONES))
    C_SEL2XXS, C_SELSIGN, C_SEL2S, C_SELSIGN8 = (tl.constexpr(v) for v in (T_SEL2XXS, T_SELSIGN, T_SEL2S, T_SELSIGN8))
    # which tiles the 2- and 3-bit formats take (read when a kernel compiles; the interpreter reads it per call)
    C_PACKED = tl.constexpr(PACKED_GPU_TESTED or triton_interpreting())

    @triton.jit
    def _u16(p, m):
        """The little-endian u16 at 2-byte aligned byte pointers p, as int32 (0 where m is false)."""
        return tl.load(p.to(tl.pointer_type(tl.uint16)), mask=m, other=0).to(tl.int32)

    @triton.jit
    def _u32h(p, m):
        """The little-endian u32 at 2-byte aligned byte pointers p, from its two halves, as uint32. Assembled in
        uint32: an int32 `hi << 16` overflows into the sign bit, which compiled code may treat as undefined
        (the interpreter wraps it, so only a GPU would show it)."""
        q = p.to(tl.pointer_type(tl.uint16))
        lo = tl.load(q, mask=m, other=0).to(tl.uint32)
        hi = tl.load(q + 1, mask=m, other=0).to(tl.uint32)
        return lo | (hi << 16)

    @triton.jit
    def _f16v(p, m):
        return tl.load(p.to(tl.pointer_type(tl.float16)), mask=m, other=0.0).to(tl.float32)

    @triton.jit
    def _blocks(b0, nsb, NB: tl.constexpr, EVEN: tl.constexpr):
        sb = (b0 + tl.arange(0, NB)).to(tl.int64)
        if EVEN:
            sm = tl.full([NB], 1, tl.int1)
        else:
            sm = sb < nsb
        return sb, sm

    @triton.jit
    def iq4xs_tile(row, xp, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        ib = tl.arange(0, 8)
        j = tl.arange(0, 16)
        sb, sm = _blocks(b0, nsb, NB, EVEN)
        m2 = sm[None, :]
        m3 = m2[:, :, None]
        blk = row[:, None] + sb[None, :] * 136  # [BN, NB]
        d = _f16v(blk, m2)
        sh = _u16(blk + 2, m2)  # [BN, NB] 8 x 2 high scale bits
        slb = tl.load(blk[:, :, None] + 4 + (ib // 2).to(tl.int64)[None, None, :], mask=m3, other=0).to(tl.int32)
        ls = ((slb >> (4 * (ib % 2))[None, None, :]) & 15) | (((sh[:, :, None] >> (2 * ib)[None, None, :]) & 3) << 4)
        dl = d[:, :, None] * (ls - 32).to(tl.float32)  # [BN, NB, 8]
        qo = (16 * ib)[:, None].to(tl.int64) + j[None, :].to(tl.int64)  # [8, 16]
        q = tl.load(blk[:, :, None, None] + 8 + qo[None, None], mask=m3[:, :, :, None], other=0,
                    eviction_policy="evict_first").to(tl.int32)  # [BN, NB, 8, 16]
        lo = tl.load(tab + C_IQ4NL + (q & 15))
        hi = tl.load(tab + C_IQ4NL + (q >> 4))
        xo = sb[:, None, None] * 256 + (32 * ib)[None, :, None].to(tl.int64) + j[None, None, :].to(tl.int64)
        xm = sm[:, None, None]
        xl = tl.load(xp + xo, mask=xm, other=0.0).to(tl.float32)  # [NB, 8, 16]
        xh = tl.load(xp + xo + 16, mask=xm, other=0.0).to(tl.float32)
        part = tl.sum(lo * xl[None] + hi * xh[None], axis=3) * dl  # [BN, NB, 8]
        return tl.sum(tl.sum(part, axis=2), axis=1)

    # IQ2_XXS and IQ3_XXS decode a sub-block's 32 weights as one axis t = 8 l + j (l: the sub-block's four
    # groups of 8, each with its own sign index) in [BN, NB, 8, 32] tensors, the rank of the IQ4_XS tile, which
    # compiles right on the H200 (their first tiles had a fifth axis for j: exact in the interpreter, wrong sums
    # compiled)

    @triton.jit
    def _iq2xxs_lookup(row, xp, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        ib = tl.arange(0, 8).to(tl.int64)
        t = tl.arange(0, 32)
        lg = t // 8  # the weight's group (its grid index byte and sign index)
        j = t % 8  # its place in the group's grid entry
        sb, sm = _blocks(b0, nsb, NB, EVEN)
        m2 = sm[None, :]
        m3 = m2[:, :, None]
        m4 = m3[:, :, :, None]
        blk = row[:, None] + sb[None, :] * 66
        d = _f16v(blk, m2)
        w = blk[:, :, None] + 2 + 8 * ib[None, None, :]  # [BN, NB, 8] the sub-block's two u32
        w1 = _u32h(w + 4, m3)  # sign indices and scale
        db = d[:, :, None] * (0.5 + (w1 >> 28).to(tl.float32)) * 0.25  # [BN, NB, 8]
        gi = tl.load(w[:, :, :, None] + lg.to(tl.int64)[None, None, None, :], mask=m4, other=0,
                     eviction_policy="evict_first").to(tl.int32)  # [BN, NB, 8, 32] each weight's grid index
        si = ((w1[:, :, :, None] >> (7 * lg).to(tl.uint32)[None, None, None, :]) & 127).to(tl.int32)
        grid = tl.load(tab + C_IQ2XXS + gi * 8 + j[None, None, None, :])
        sg = tl.load(tab + C_KSIGNS + si * 8 + j[None, None, None, :])
        xo = sb[:, None, None] * 256 + 32 * ib[None, :, None] + t.to(tl.int64)[None, None, :]  # [NB, 8, 32]
        x = tl.load(xp + xo, mask=sm[:, None, None], other=0.0).to(tl.float32)
        part = tl.sum(grid * sg * x[None], axis=3) * db  # [BN, NB, 8]
        return tl.sum(tl.sum(part, axis=2), axis=1)

    @triton.jit
    def _iq2s_lookup(row, xp, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        # group g = 4 ib + l of 8 weights: grid index qs[g] | (2 bits of qh[ib] at 2 l) << 8 (1024 entries), its
        # 8 signs the bits of byte 32 + g of qs, scale the low (l < 2) or high nibble of scales[ib]
        ib = tl.arange(0, 8).to(tl.int64)
        t = tl.arange(0, 32)
        lg = t // 8
        j = t % 8
        sb, sm = _blocks(b0, nsb, NB, EVEN)
        m2 = sm[None, :]
        m3 = m2[:, :, None]
        m4 = m3[:, :, :, None]
        blk = row[:, None] + sb[None, :] * 82
        d = _f16v(blk, m2)
        g = blk[:, :, None, None] + 2 + 4 * ib[None, None, :, None] + lg.to(tl.int64)[None, None, None, :]
        lo = tl.load(g, mask=m4, other=0, eviction_policy="evict_first").to(tl.int32)  # [BN, NB, 8, 32]
        sgb = tl.load(g + 32, mask=m4, other=0, eviction_policy="evict_first").to(tl.int32)
        qh = tl.load(blk[:, :, None] + 66 + ib[None, None, :], mask=m3, other=0).to(tl.int32)  # [BN, NB, 8]
        sc = tl.load(blk[:, :, None] + 74 + ib[None, None, :], mask=m3, other=0).to(tl.int32)
        gi = lo | (((qh[:, :, :, None] >> (2 * lg)[None, None, None, :]) & 3) << 8)
        grid = tl.load(tab + C_IQ2S + gi * 8 + j[None, None, None, :])
        sg = 1.0 - 2.0 * ((sgb >> j[None, None, None, :]) & 1).to(tl.float32)
        nib = (sc[:, :, :, None] >> (4 * (lg // 2))[None, None, None, :]) & 15
        db = d[:, :, None, None] * (0.5 + nib.to(tl.float32)) * 0.25  # [BN, NB, 8, 32]
        xo = sb[:, None, None] * 256 + 32 * ib[None, :, None] + t.to(tl.int64)[None, None, :]
        x = tl.load(xp + xo, mask=sm[:, None, None], other=0.0).to(tl.float32)
        part = tl.sum(grid * sg * db * x[None], axis=3)  # [BN, NB, 8]
        return tl.sum(tl.sum(part, axis=2), axis=1)

    @triton.jit
    def _iq3xxs_lookup(row, xp, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        ib = tl.arange(0, 8).to(tl.int64)
        t = tl.arange(0, 32)
        lg = t // 8
        j = t % 8
        sb, sm = _blocks(b0, nsb, NB, EVEN)
        m2 = sm[None, :]
        m3 = m2[:, :, None]
        m4 = m3[:, :, :, None]
        blk = row[:, None] + sb[None, :] * 98
        d = _f16v(blk, m2)
        sp = blk[:, :, None] + 66 + 4 * ib[None, None, :]  # [BN, NB, 8] the sub-block's u32
        sc = _u32h(sp, m3)
        db = d[:, :, None] * (0.5 + (sc >> 28).to(tl.float32)) * 0.5
        si = ((sc[:, :, :, None] >> (7 * lg).to(tl.uint32)[None, None, None, :]) & 127).to(tl.int32)
        # weight t of sub-block ib: index byte 2 + 8 ib + t // 4 (= 2 l + j // 4), value t % 4 of its grid entry
        gi = tl.load(blk[:, :, None, None] + 2 + 8 * ib[None, None, :, None] + (t // 4).to(tl.int64)[None, None, None, :],
                     mask=m4, other=0, eviction_policy="evict_first").to(tl.int32)  # [BN, NB, 8, 32]
        grid = tl.load(tab + C_IQ3XXS + gi * 4 + (t % 4)[None, None, None, :])
        sg = tl.load(tab + C_KSIGNS + si * 8 + j[None, None, None, :])
        xo = sb[:, None, None] * 256 + 32 * ib[None, :, None] + t.to(tl.int64)[None, None, :]
        x = tl.load(xp + xo, mask=sm[:, None, None], other=0.0).to(tl.float32)
        part = tl.sum(grid * sg * x[None], axis=3) * db
        return tl.sum(tl.sum(part, axis=2), axis=1)

    @triton.jit
    def iq4nl_tile(row, xp, tab, b0, nblk, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        # IQ4_NL: MXFP4's nibble layout (low nibbles weights 0-15, high 16-31) with an f16 scale and the IQ4_NL
        # codebook: what llama.cpp's quantizer writes for an i-quant mix's rows that are not whole 256-blocks
        j = tl.arange(0, 16)
        sb, sm = _blocks(b0, nblk, NB, EVEN)
        m2 = sm[None, :]
        blk = row[:, None] + sb[None, :] * 18  # [BN, NB] (2-byte aligned)
        d = _f16v(blk, m2)
        q = tl.load(blk[:, :, None] + 2 + j.to(tl.int64)[None, None, :], mask=m2[:, :, None], other=0,
                    eviction_policy="evict_first").to(tl.int32)  # [BN, NB, 16]
        lo = tl.load(tab + C_IQ4NL + (q & 15))
        hi = tl.load(tab + C_IQ4NL + (q >> 4))
        xo = sb[:, None] * 32 + j.to(tl.int64)[None, :]  # [NB, 16]
        xl = tl.load(xp + xo, mask=sm[:, None], other=0.0).to(tl.float32)
        xh = tl.load(xp + xo + 16, mask=sm[:, None], other=0.0).to(tl.float32)
        part = tl.sum(lo * xl[None] + hi * xh[None], axis=2) * d  # [BN, NB]
        return tl.sum(part, axis=1)

    @triton.jit
    def mxfp4_tile(row, xp, tab, b0, nblk, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        j = tl.arange(0, 16)
        sb, sm = _blocks(b0, nblk, NB, EVEN)
        m2 = sm[None, :]
        blk = row[:, None] + sb[None, :] * 17  # [BN, NB]
        e = tl.load(blk, mask=m2, other=0).to(tl.int32)
        # 2^(e - 128) from its bits (ggml_e8m0_to_fp32_half): subnormal below e = 2
        bits = tl.where(e < 2, 0x00200000 << tl.minimum(e, 1), (tl.maximum(e, 1) - 1) << 23)
        dv = bits.to(tl.float32, bitcast=True)
        q = tl.load(blk[:, :, None] + 1 + j.to(tl.int64)[None, None, :], mask=m2[:, :, None], other=0,
                    eviction_policy="evict_first").to(tl.int32)  # [BN, NB, 16]
        lo = tl.load(tab + C_MXFP4 + (q & 15))
        hi = tl.load(tab + C_MXFP4 + (q >> 4))
        xo = sb[:, None] * 32 + j.to(tl.int64)[None, :]  # [NB, 16]
        xl = tl.load(xp + xo, mask=sm[:, None], other=0.0).to(tl.float32)
        xh = tl.load(xp + xo + 16, mask=sm[:, None], other=0.0).to(tl.float32)
        part = tl.sum(lo * xl[None] + hi * xh[None], axis=2) * dv  # [BN, NB]
        return tl.sum(part, axis=1)

    # The packed tiles. Axes: the tile's sub-blocks of 32 weights s (NB blocks x 8: one axis, so no tensor has a
    # fifth), a sub-block's groups, a group's weights; per-group values are loaded once and broadcast over the
    # last axis. Magnitudes become floats through the exponent bits (2^23 + m, exact), not an int conversion.

    @triton.jit
    def _subblocks(b0, nsb, NB: tl.constexpr, EVEN: tl.constexpr):
        """The tile's NB * 8 sub-blocks: their block index, index within the block, and mask."""
        s = tl.arange(0, NB * 8)
        sb = (b0 + s // 8).to(tl.int64)
        if EVEN:
            sm = tl.full([NB * 8], 1, tl.int1)
        else:
            sm = sb < nsb
        return sb, (s % 8).to(tl.int64), sm

    @triton.jit
    def _mag(word, sh):
        """Byte `sh // 8` of int32 words (a magnitude < 128) as float32."""
        return (((word >> sh) & 255) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def _iq2xxs_packed(row, xp, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        itab = tab.to(tl.pointer_type(tl.int32))
        sb, ib, sm = _subblocks(b0, nsb, NB, EVEN)
        m2 = sm[None, :]
        m3 = m2[:, :, None]
        lg = tl.arange(0, 4)
        j = tl.arange(0, 8)
        blk = row[:, None] + sb[None, :] * 66  # [BN, S]
        d = _f16v(blk, m2)
        w = blk + 2 + 8 * ib[None, :]  # the sub-block's two u32: 4 grid index bytes, then signs and scale
        w1 = _u32h(w + 4, m2)
        db = d * (0.5 + (w1 >> 28).to(tl.float32)) * 0.25  # [BN, S]
        gi = tl.load(w[:, :, None] + lg.to(tl.int64)[None, None, :], mask=m3, other=0,
                     eviction_policy="evict_first").to(tl.int32)  # [BN, S, 4]
        si = ((w1[:, :, None] >> (7 * lg).to(tl.uint32)[None, None, :]) & 127).to(tl.int32)
        lo = tl.load(itab + C_P2XXS + 2 * gi)
        hi = tl.load(itab + C_P2XXS + 2 * gi + 1)
        sg = tl.load(itab + C_PSIGN + si)  # [BN, S, 4] sign bytes
        j4 = j[None, None, None, :]
        word = tl.where(j4 < 4, lo[:, :, :, None], hi[:, :, :, None])  # [BN, S, 4, 8]
        mag = _mag(word, 8 * (j4 % 4))
        neg = ((sg[:, :, :, None] >> j4) & 1) != 0
        xo = sb[:, None, None] * 256 + 32 * ib[:, None, None] + (8 * lg)[None, :, None] + j[None, None, :]
        x = tl.load(xp + xo, mask=sm[:, None, None], other=0.0).to(tl.float32)  # [S, 4, 8]
        v = mag * x[None]
        part = tl.sum(tl.sum(tl.where(neg, -v, v), axis=3), axis=2) * db  # [BN, S]
        return tl.sum(part, axis=1)

    @triton.jit
    def _iq2s_packed(row, xp, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        itab = tab.to(tl.pointer_type(tl.int32))
        sb, ib, sm = _subblocks(b0, nsb, NB, EVEN)
        m2 = sm[None, :]
        m3 = m2[:, :, None]
        lg = tl.arange(0, 4)
        j = tl.arange(0, 8)
        blk = row[:, None] + sb[None, :] * 82
        d = _f16v(blk, m2)
        g = blk[:, :, None] + 2 + 4 * ib[None, :, None] + lg.to(tl.int64)[None, None, :]  # [BN, S, 4]
        lo8 = tl.load(g, mask=m3, other=0, eviction_policy="evict_first").to(tl.int32)
        sgb = tl.load(g + 32, mask=m3, other=0, eviction_policy="evict_first").to(tl.int32)
        qh = tl.load(blk + 66 + ib[None, :], mask=m2, other=0).to(tl.int32)  # [BN, S]
        sc = tl.load(blk + 74 + ib[None, :], mask=m2, other=0).to(tl.int32)
        gi = lo8 | (((qh[:, :, None] >> (2 * lg)[None, None, :]) & 3) << 8)
        nib = (sc[:, :, None] >> (4 * (lg // 2))[None, None, :]) & 15
        db = d[:, :, None] * (0.5 + nib.to(tl.float32)) * 0.25  # [BN, S, 4]
        lo = tl.load(itab + C_P2S + 2 * gi)
        hi = tl.load(itab + C_P2S + 2 * gi + 1)
        j4 = j[None, None, None, :]
        word = tl.where(j4 < 4, lo[:, :, :, None], hi[:, :, :, None])
        mag = _mag(word, 8 * (j4 % 4))
        neg = ((sgb[:, :, :, None] >> j4) & 1) != 0
        xo = sb[:, None, None] * 256 + 32 * ib[:, None, None] + (8 * lg)[None, :, None] + j[None, None, :]
        x = tl.load(xp + xo, mask=sm[:, None, None], other=0.0).to(tl.float32)
        v = mag * x[None]
        part = tl.sum(tl.sum(tl.where(neg, -v, v), axis=3) * db, axis=2)  # [BN, S]
        return tl.sum(part, axis=1)

    @triton.jit
    def _iq3xxs_packed(row, xp, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        # a sub-block's 32 weights as 8 index groups q of 4 (weight 4 q + r); signs by groups of 8: sign index
        # q // 2, bits 4 (q % 2) + r of its byte
        itab = tab.to(tl.pointer_type(tl.int32))
        sb, ib, sm = _subblocks(b0, nsb, NB, EVEN)
        m2 = sm[None, :]
        m3 = m2[:, :, None]
        q = tl.arange(0, 8)
        r = tl.arange(0, 4)
        blk = row[:, None] + sb[None, :] * 98
        d = _f16v(blk, m2)
        sc = _u32h(blk + 66 + 4 * ib[None, :], m2)  # [BN, S]
        db = d * (0.5 + (sc >> 28).to(tl.float32)) * 0.5
        gi = tl.load(blk[:, :, None] + 2 + 8 * ib[None, :, None] + q.to(tl.int64)[None, None, :], mask=m3, other=0,
                     eviction_policy="evict_first").to(tl.int32)  # [BN, S, 8]
        si = ((sc[:, :, None] >> (7 * (q // 2)).to(tl.uint32)[None, None, :]) & 127).to(tl.int32)
        gw = tl.load(itab + C_P3XXS + gi)  # [BN, S, 8] an entry's 4 magnitudes
        sg = (tl.load(itab + C_PSIGN + si) >> (4 * (q % 2))[None, None, :]) & 15
        r4 = r[None, None, None, :]
        mag = _mag(gw[:, :, :, None], 8 * r4)  # [BN, S, 8, 4]
        neg = ((sg[:, :, :, None] >> r4) & 1) != 0
        xo = sb[:, None, None] * 256 + 32 * ib[:, None, None] + (4 * q)[None, :, None] + r[None, None, :]
        x = tl.load(xp + xo, mask=sm[:, None, None], other=0.0).to(tl.float32)  # [S, 8, 4]
        v = mag * x[None]
        part = tl.sum(tl.sum(tl.where(neg, -v, v), axis=3), axis=2) * db
        return tl.sum(part, axis=1)

    @triton.jit
    def iq2xxs_tile(row, xp, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        if C_PACKED:
            return _iq2xxs_packed(row, xp, tab, b0, nsb, BN, NB, EVEN)
        else:
            return _iq2xxs_lookup(row, xp, tab, b0, nsb, BN, NB, EVEN)

    @triton.jit
    def iq2s_tile(row, xp, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        if C_PACKED:
            return _iq2s_packed(row, xp, tab, b0, nsb, BN, NB, EVEN)
        else:
            return _iq2s_lookup(row, xp, tab, b0, nsb, BN, NB, EVEN)

    @triton.jit
    def iq3xxs_tile(row, xp, tab, b0, nsb, BN: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        if C_PACKED:
            return _iq3xxs_packed(row, xp, tab, b0, nsb, BN, NB, EVEN)
        else:
            return _iq3xxs_lookup(row, xp, tab, b0, nsb, BN, NB, EVEN)
