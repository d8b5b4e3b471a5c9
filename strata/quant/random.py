"""Random, valid GGML weights made straight from random bytes (no quantizer): fast enough to write
multi-GB synthetic models. Quant bits, grid indices, signs and sub-block scales are uniform random bytes (made
valid where a format leaves codes unused: `make_valid`); the block scales (`d`, and `dmin` / `m` where the
format has them) are overwritten with one finite positive value chosen so the dequantized weights have roughly
the requested std and mean about zero (MXFP4's power-of-two scales: a mix of two neighbouring powers).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from gguf import GGMLQuantizationType

from strata.quant.dequant import dequantize_flat
from strata.quant.formats import FLOAT_TYPES, as_qtype, block_geometry, bytes_for, check_supported
from strata.quant.qtensor import QTensor

Q = GGMLQuantizationType

# qtype -> (byte offset of d, byte offset of the second f16 field or None, that field's value / d).
# The second field is a min: Q4_1/Q5_1 add m (so m = -mean(q) * d), the K formats subtract dmin * min
# (so dmin = mean(q) * d, the 6- or 4-bit sub-scales and mins having equal means). The i-quants, TQ1_0/TQ2_0
# and MXFP4 are symmetric: random sub-scales, grid indices and signs are valid blocks around zero, so d alone
# sets the std.
_SCALE_FIELDS: dict[GGMLQuantizationType, tuple[int, int | None, float]] = {
    Q.Q4_0: (0, None, 0.0),
    Q.Q4_1: (0, 2, -7.5),
    Q.Q5_0: (0, None, 0.0),
    Q.Q5_1: (0, 2, -15.5),
    Q.Q8_0: (0, None, 0.0),
    Q.Q2_K: (80, 82, 1.5),
    Q.Q3_K: (108, None, 0.0),
    Q.Q4_K: (0, 2, 7.5),
    Q.Q5_K: (0, 2, 15.5),
    Q.Q6_K: (208, None, 0.0),
    **{t: (0, None, 0.0) for t in (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ4_NL,
                                    Q.IQ4_XS)},
    Q.IQ1_M: (48, None, 0.0),
    Q.TQ1_0: (52, None, 0.0),
    Q.TQ2_0: (64, None, 0.0),
    Q.MXFP4: (0, None, 0.0),
}

# Scales not stored as a plain f16 field: MXFP4's is an E8M0 exponent byte (a power of two); IQ1_M's f16 d is
# spread over the top nibbles of its four uint16 scale words (bytes off+1, off+3, off+5, off+7).
_E8M0 = frozenset({Q.MXFP4})
_NIBBLE_F16 = frozenset({Q.IQ1_M})


def scale_mask(qtype) -> np.ndarray:
    """uint8 [type_size]: 0 on the bits of a block that hold its scale fields, 0xFF on the rest (the bits that
    random_raw_bytes fills at random)."""
    qt = check_supported(qtype)
    _, size = block_geometry(qt)
    mask = np.full(size, 0xFF, np.uint8)
    off_d, off_m, _ = _SCALE_FIELDS[qt]
    if qt in _E8M0:
        mask[off_d] = 0
    elif qt in _NIBBLE_F16:
        mask[off_d + 1:off_d + 8:2] = 0x0F
    else:
        for off in (off_d, off_m):
            if off is not None:
                mask[off:off + 2] = 0
    return mask


def make_valid(qtype, blocks: np.ndarray) -> None:
    """Turn random quant bits into ones the format's quantizer can produce (uint8 blocks, in place): TQ2_0's
    2-bit codes are q + 1 for ternary q, so the unused code 3 (a weight of 2d) becomes 1 (zero)."""
    if as_qtype(qtype) == Q.TQ2_0:
        qs = blocks.reshape(-1, block_geometry(Q.TQ2_0)[1])[:, :64]
        both = qs & (qs >> 1) & 0x55                     # low bit of each 2-bit code that is 3
        qs &= ~(both << 1)


def _e8m0_codes(n: int, d: float) -> np.ndarray:
    """MXFP4 exponent bytes for n blocks giving an RMS scale of d: E8M0 holds only powers of two, so blocks take
    2^a or 2^(a+1) (a = floor(log2 d)) in the proportion whose mean square is d^2, spread evenly by index."""
    a = int(np.floor(np.log2(d)))
    r = d / 2.0 ** a
    p = (r * r - 1.0) / 3.0                              # (1 - p) * 4^a + p * 4^(a+1) = d^2
    hi = ((np.arange(n) + 0.5) * 0.6180339887498949) % 1.0 < p
    return np.clip(a + 128 + hi, 2, 254).astype(np.uint8)   # e -> 2^(e-128) (the value table is doubled)


_TORCH_FLOAT = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def _as_rng(rng) -> np.random.Generator:
    """A numpy Generator from a Generator, an int seed, a torch.Generator or None (fresh entropy)."""
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, torch.Generator):
        seed = int(torch.randint(0, 2**62, (1,), generator=rng).item())
        return np.random.default_rng(seed)
    return np.random.default_rng(rng)


# Bytes made per call of the bit generator: small enough that its temporary comes from reused heap memory
# (fresh large allocations cost page faults, which dominate on some machines), big enough to amortise the call.
_CHUNK_BYTES = 1 << 20


def _random_bytes(rng: np.random.Generator, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """n uniform random bytes (into out when given). The bit generator's raw 64-bit output is the cheapest
    source numpy has (~2 GB/s per core for PCG64)."""
    flat = np.empty(n, dtype=np.uint8) if out is None else out.reshape(-1)
    bits = rng.bit_generator
    for i in range(0, n, _CHUNK_BYTES):
        m = min(_CHUNK_BYTES, n - i)
        flat[i:i + m] = bits.random_raw((m + 7) // 8).view(np.uint8)[:m]
    return flat


def _set_scales(blocks: np.ndarray, qtype: GGMLQuantizationType, d: float) -> None:
    """Overwrite the scale fields of every block ([n, type_size] uint8, in place) for block scale d."""
    off_d, off_m, ratio = _SCALE_FIELDS[qtype]
    if qtype in _E8M0:
        blocks[:, off_d] = _e8m0_codes(blocks.shape[0], d)
        return
    if qtype in _NIBBLE_F16:
        bits = int(np.float16(d).view(np.uint16))
        for k in range(4):
            col = blocks[:, off_d + 2 * k + 1]
            col &= 0x0F
            col |= ((bits >> (4 * k)) & 0x0F) << 4
        return
    halves = blocks.view(np.uint16)          # every f16 field's type_size and offset is even
    halves[:, off_d // 2] = np.float16(d).view(np.uint16)
    if off_m is not None:
        halves[:, off_m // 2] = np.float16(np.float16(d) * np.float32(ratio)).view(np.uint16)


@functools.lru_cache(maxsize=None)
def _unit_std(qtype: GGMLQuantizationType) -> float:
    """Std of dequantized random blocks whose d is 1 (measured once on a fixed sample)."""
    _, size = block_geometry(qtype)
    blocks = _random_bytes(np.random.default_rng(1234), 4096 * size).reshape(-1, size).copy()
    make_valid(qtype, blocks)
    _set_scales(blocks, qtype, 1.0)
    return float(dequantize_flat(torch.from_numpy(blocks), qtype).std())


def random_raw_bytes(qtype, n_rows: int, row_len: int, rng=None, scale: float = 0.02,
                     out: np.ndarray | None = None) -> np.ndarray:
    """Random valid weights as GGML bytes: uint8 [n_rows, row_bytes] whose values have std ~scale, mean ~0.

    rng: numpy Generator, int seed, torch.Generator or None. out: a contiguous uint8 buffer of that many bytes
    to fill (streaming writers reuse one; fastest). F32/F16/BF16 are N(0, scale) samples
    (a few times slower).
    """
    qt = check_supported(qtype)
    row_bytes = bytes_for(qt, row_len)
    gen = _as_rng(rng)
    n = n_rows * row_len
    if out is not None and (out.dtype != np.uint8 or out.size != n_rows * row_bytes
                            or not out.flags.c_contiguous):
        raise ValueError(f"out must be a contiguous uint8 array of {n_rows * row_bytes} bytes")
    if qt in FLOAT_TYPES:
        # torch's randn and float conversions are several times faster than numpy's (f16 above all).
        tgen = torch.Generator().manual_seed(int(gen.integers(0, 2**63 - 1)))
        x = torch.randn(n, generator=tgen).mul_(scale).to(_TORCH_FLOAT[qt])
        raw = x.view(torch.uint8).numpy()
        if out is not None:
            out.reshape(-1)[:] = raw
            raw = out
        return raw.reshape(n_rows, row_bytes)
    _, size = block_geometry(qt)
    raw = _random_bytes(gen, n_rows * row_bytes, out)
    make_valid(qt, raw)
    _set_scales(raw.reshape(-1, size), qt, scale / _unit_std(qt))
    return raw.reshape(n_rows, row_bytes)


def random_qtensor(qtype, shape, rng=None, scale: float = 0.02, device="cpu") -> QTensor:
    """A QTensor of logical `shape` (torch order) filled with random valid blocks (see random_raw_bytes).

    rng: numpy Generator, int seed, torch.Generator, or None.
    """
    shape = tuple(int(s) for s in shape)
    rows = 1
    for s in shape[:-1]:
        rows *= s
    raw = random_raw_bytes(qtype, rows, shape[-1], rng, scale)
    return QTensor.from_raw(raw, qtype, shape).to(device)
