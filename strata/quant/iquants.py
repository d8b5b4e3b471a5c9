"""Reference dequantizers (pure torch) for the codebook and small-value formats: the i-quants (IQ1_S, IQ1_M,
IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS), the ternary TQ1_0 / TQ2_0 and MXFP4.

Same contract as `strata.quant.dequant`: each block function takes the raw blocks [n, type_size] uint8 and
returns float32 [n, block_size], bit-exact with gguf-py's numpy code, whose float steps it mirrors in order
(e.g. IQ2_XXS's `(d * (0.5 + s)) * 0.25`, then `(db * grid) * sign`).

The codebooks (grids, the sign table, the 16-entry value tables) are gguf-py's own, read from `gguf.quants` at
first use rather than copied here: gguf-py is the oracle these functions are tested against, so one source of
truth. Each table becomes a torch tensor once per device (`table`), so CUDA graphs and repeated chunks reuse it.
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np
import torch
from gguf import QK_K, GGMLQuantizationType

Q = GGMLQuantizationType

_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}
_LOCK = threading.Lock()


def _build(name: str) -> np.ndarray:
    """The numpy table `name` from gguf-py: a grid [N, k] float32, sign tables [128 or 256, 8], "iq4nl"/"mxfp4" [16]."""
    import gguf.quants as gq

    if name in ("ksigns", "bytesigns"):
        # a byte's 8 bits as signs, [n, 8] float32: +1 where bit i is clear, -1 where set (gguf-py's np.where);
        # "ksigns": the 128 even-parity patterns the 7-bit sign indices select, "bytesigns": every byte
        b = np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8) if name == "ksigns" else np.arange(256, dtype=np.uint8)
        bits = (b[:, None] >> np.arange(8, dtype=np.uint8)) & 1
        return np.where(bits == 0, np.float32(1), np.float32(-1)).astype(np.float32)
    if name == "iq4nl":
        return np.array(gq.IQ4_NL.kvalues, dtype=np.float32)
    if name == "mxfp4":
        return np.array(gq.MXFP4.kvalues, dtype=np.float32)
    cls = getattr(gq, name)
    cls.init_grid()                                      # decodes gguf-py's hex grid once (cached on the class)
    return np.ascontiguousarray(cls.grid.reshape(cls.grid_shape), dtype=np.float32)


def table(name: str, device: torch.device) -> torch.Tensor:
    """gguf-py's table `name` as a torch tensor on `device`, built once per (table, device)."""
    key = (name, device)
    t = _TABLES.get(key)
    if t is None:
        with _LOCK:
            t = _TABLES.get(key)
            if t is None:
                t = torch.from_numpy(_build(name)).to(device)
                _TABLES[key] = t
    return t


# the tables each format reads
FORMAT_TABLES: dict[GGMLQuantizationType, tuple[str, ...]] = {
    Q.IQ2_XXS: ("IQ2_XXS", "ksigns"), Q.IQ2_XS: ("IQ2_XS", "ksigns"), Q.IQ2_S: ("IQ2_S", "bytesigns"),
    Q.IQ3_XXS: ("IQ3_XXS", "ksigns"), Q.IQ3_S: ("IQ3_S", "bytesigns"), Q.IQ1_S: ("IQ1_S",), Q.IQ1_M: ("IQ1_S",),
    Q.IQ4_NL: ("iq4nl",), Q.IQ4_XS: ("iq4nl",), Q.MXFP4: ("mxfp4",),
}


def prepare(qtype: GGMLQuantizationType, device: torch.device) -> None:
    """Build the format's tables on `device` now: a weight arriving on the GPU does this at load time, so no
    host-to-device copy happens later inside a captured CUDA graph."""
    for name in FORMAT_TABLES.get(qtype, ()):
        table(name, device)


def _f16(blocks: torch.Tensor, off: int) -> torch.Tensor:
    """The f16 field at byte offset off of each block, as float32 [n, 1]."""
    return blocks[:, off:off + 2].contiguous().view(torch.float16).to(torch.float32)


def _u32(b: torch.Tensor) -> torch.Tensor:
    """[n, 4k] bytes -> [n, k] little-endian uint32 values, as int64 (torch has no full uint32 arithmetic)."""
    w = b.reshape(b.shape[0], -1, 4).to(torch.int64)
    return w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16) | (w[..., 3] << 24)


def _u16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2k] bytes -> [n, k] little-endian uint16 values, as int64."""
    w = b.reshape(b.shape[0], -1, 2).to(torch.int64)
    return w[..., 0] | (w[..., 1] << 8)


def _split(x: torch.Tensor, shifts, width: int) -> torch.Tensor:
    """x [...] -> [..., len(shifts)]: the `width`-bit fields of x at each shift."""
    mask = (1 << width) - 1
    return torch.stack([(x >> s) & mask for s in shifts], dim=-1)


def _sign_bits(b: torch.Tensor) -> torch.Tensor:
    """Bytes [...] -> float32 [..., 8]: +1 where bit i is clear, -1 where set."""
    return table("bytesigns", b.device)[b.to(torch.int64)]


def _ksigns(idx: torch.Tensor) -> torch.Tensor:
    """7-bit indices [...] -> float32 signs [..., 8] from the ksigns table (8th bit: the parity)."""
    return table("ksigns", idx.device)[idx]


def _nib_scales(b: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 2k] 4-bit scales: low nibble of each byte, then its high nibble."""
    return _split(b, (0, 4), 4).reshape(b.shape[0], -1)


# ---- i-quants ----------------------------------------------------------------------------------------------

def _iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    # 66 bytes: f16 d, then 8 groups of 32 weights, each two uint32: 4 grid indices (bytes), and 4 x 7-bit
    # sign indices + a 4-bit scale (top bits)
    n = b.shape[0]
    d = _f16(b, 0)
    qs = _u32(b[:, 2:66]).reshape(n, 8, 2)
    db = (d * (0.5 + (qs[..., 1] >> 28).to(torch.float32)) * 0.25).reshape(n, 8, 1, 1)
    signs = _ksigns(_split(qs[..., 1], (0, 7, 14, 21), 7))                       # [n, 8, 4, 8]
    idx = b[:, 2:66].reshape(n, 8, 2, 4)[:, :, 0].to(torch.int64)                 # [n, 8, 4]
    grid = table("IQ2_XXS", b.device)[idx]                                       # [n, 8, 4, 8]
    return (db * grid * signs).reshape(n, QK_K)


def _iq2_xs(b: torch.Tensor) -> torch.Tensor:
    # 74 bytes: f16 d, 32 uint16 (9-bit grid index | 7-bit sign index), 8 bytes of 4-bit scales (16 weights each)
    n = b.shape[0]
    d = _f16(b, 0)
    qs = _u16(b[:, 2:66])                                                         # [n, 32]
    db = (d * (0.5 + _nib_scales(b[:, 66:74]).to(torch.float32)) * 0.25).reshape(n, 16, 1, 1)
    signs = _ksigns(qs >> 9).reshape(n, 16, 2, 8)
    grid = table("IQ2_XS", b.device)[qs & 511].reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _iq2_s(b: torch.Tensor) -> torch.Tensor:
    # 82 bytes: f16 d, 32 grid index bytes, 32 sign bytes, 8 bytes of index high bits (2 each), 8 scale bytes
    n = b.shape[0]
    d = _f16(b, 0)
    db = (d * (0.5 + _nib_scales(b[:, 74:82]).to(torch.float32)) * 0.25).reshape(n, 16, 1, 1)
    signs = _sign_bits(b[:, 34:66]).reshape(n, 16, 2, 8)
    qh = _split(b[:, 66:74], (0, 2, 4, 6), 2).reshape(n, 32).to(torch.int64)
    idx = b[:, 2:34].to(torch.int64) | (qh << 8)
    grid = table("IQ2_S", b.device)[idx].reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _iq3_xxs(b: torch.Tensor) -> torch.Tensor:
    # 98 bytes: f16 d, 64 grid index bytes (4 weights each), 8 uint32 (4 x 7-bit sign indices + 4-bit scale)
    n = b.shape[0]
    d = _f16(b, 0)
    sc = _u32(b[:, 66:98])                                                        # [n, 8]
    db = (d * (0.5 + (sc >> 28).to(torch.float32)) * 0.5).reshape(n, 8, 1, 1)
    signs = _ksigns(_split(sc, (0, 7, 14, 21), 7))                                # [n, 8, 4, 8]
    grid = table("IQ3_XXS", b.device)[b[:, 2:66].to(torch.int64)].reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _iq3_s(b: torch.Tensor) -> torch.Tensor:
    # 110 bytes: f16 d, 64 grid index bytes, 8 bytes of index 9th bits, 32 sign bytes, 4 bytes of 4-bit scales
    n = b.shape[0]
    d = _f16(b, 0)
    db = (d * (1 + 2 * _nib_scales(b[:, 106:110])).to(torch.float32)).reshape(n, 8, 1, 1)
    signs = _sign_bits(b[:, 74:106]).reshape(n, 8, 4, 8)
    qh = _split(b[:, 66:74], range(8), 1).reshape(n, 64).to(torch.int64)
    idx = b[:, 2:66].to(torch.int64) | (qh << 8)
    grid = table("IQ3_S", b.device)[idx].reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _iq1_grid(idx: torch.Tensor, qh_delta: torch.Tensor, shape) -> torch.Tensor:
    """grid + delta for IQ1_S/IQ1_M: idx [n, 32] 11-bit indices, qh_delta the matching +-0.125 (broadcast)."""
    return table("IQ1_S", idx.device)[idx].reshape(shape) + qh_delta


def _iq1_s(b: torch.Tensor) -> torch.Tensor:
    # 50 bytes: f16 d, 32 grid index low bytes, 8 uint16: 4 x 3-bit index high bits, a 3-bit scale, a delta sign
    n = b.shape[0]
    d = _f16(b, 0)
    qh = _u16(b[:, 34:50])                                                        # [n, 8]
    dl = (d * (2 * ((qh >> 12) & 7) + 1).to(torch.float32)).reshape(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, 0.125, -0.125).reshape(n, 8, 1, 1).to(torch.float32)
    idx = b[:, 2:34].to(torch.int64) | (_split(qh, (0, 3, 6, 9), 3).reshape(n, 32) << 8)
    return (dl * _iq1_grid(idx, delta, (n, 8, 4, 8))).reshape(n, QK_K)


def _iq1_m(b: torch.Tensor) -> torch.Tensor:
    # 56 bytes: 32 grid index low bytes, 16 bytes (two nibbles: 3 index high bits + a delta sign each), 4 uint16
    # of 3-bit scales whose top nibbles together hold the f16 d
    n = b.shape[0]
    sc = _u16(b[:, 48:56])                                                        # [n, 4]
    dbits = ((sc[:, 0] & 0xF000) >> 12) | ((sc[:, 1] & 0xF000) >> 8) | ((sc[:, 2] & 0xF000) >> 4) \
        | (sc[:, 3] & 0xF000)
    d = torch.stack([dbits & 0xFF, dbits >> 8], dim=1).to(torch.uint8).view(torch.float16).to(torch.float32)
    scales = _split(sc, (0, 3, 6, 9), 3).reshape(n, 16)
    dl = (d * (2 * scales + 1).to(torch.float32)).reshape(n, 8, 2, 1, 1)
    qh = _split(b[:, 32:48], (0, 4), 4).reshape(n, 32).to(torch.int64)
    idx = b[:, :32].to(torch.int64) | ((qh & 7) << 8)
    delta = torch.where((qh & 0x08) == 0, 0.125, -0.125).to(torch.float32).reshape(n, 8, 2, 2, 1)
    return (dl * _iq1_grid(idx, delta, (n, 8, 2, 2, 8))).reshape(n, QK_K)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    # 18 bytes: f16 d, 16 bytes of 4-bit indices into the 16 non-linear values (low nibbles first)
    d = _f16(b, 0)
    q = torch.cat([b[:, 2:18] & 0x0F, b[:, 2:18] >> 4], dim=1).to(torch.int64)
    return d * table("iq4nl", b.device)[q]


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    # 136 bytes: f16 d, uint16 of 8 x 2 high scale bits, 4 bytes of 8 x 4 low scale bits, 128 bytes of indices
    n = b.shape[0]
    d = _f16(b, 0)
    sh = _split(_u16(b[:, 2:4])[:, 0], range(0, 16, 2), 2)                        # [n, 8]
    sl = _nib_scales(b[:, 4:8])                                                   # [n, 8]
    scales = ((sl | (sh << 4)) - 32).to(torch.float32)
    dl = (d * scales).reshape(n, 8, 1)
    qs = b[:, 8:136].reshape(n, 8, 16)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).to(torch.int64)                    # [n, 8, 32]
    return (dl * table("iq4nl", b.device)[q]).reshape(n, QK_K)


# ---- ternary and microscaling --------------------------------------------------------------------------------

def _tq1_0(b: torch.Tensor) -> torch.Tensor:
    # 54 bytes: 48 bytes of 5 trits each, 4 bytes of 4 trits each (base-3 fixed point), f16 d at the end.
    # gguf-py multiplies in uint8 (wrapping) before widening: mirrored with & 0xFF.
    n = b.shape[0]
    d = _f16(b, 52)
    pow3 = (1, 3, 9, 27, 81)
    qs = b[:, :48].to(torch.int32)
    q0 = torch.stack([(qs[:, :32] * p) & 0xFF for p in pow3], dim=1).reshape(n, 160)
    q1 = torch.stack([(qs[:, 32:48] * p) & 0xFF for p in pow3], dim=1).reshape(n, 80)
    qh = b[:, 48:52].to(torch.int32)
    q2 = torch.stack([(qh * p) & 0xFF for p in pow3[:4]], dim=1).reshape(n, 16)
    q = torch.cat([q0, q1, q2], dim=1)
    q = ((q * 3) >> 8) - 1
    return d * q.to(torch.float32)


def _tq2_0(b: torch.Tensor) -> torch.Tensor:
    # 66 bytes: 64 bytes of 2-bit values (q - 1), four per byte, f16 d at the end
    n = b.shape[0]
    d = _f16(b, 64)
    qs = b[:, :64].reshape(n, 2, 1, 32)
    q = torch.cat([(qs >> s) & 3 for s in (0, 2, 4, 6)], dim=2).reshape(n, QK_K)
    return d * (q.to(torch.float32) - 1.0)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """MXFP4's exponent byte -> float32 2^(e-128) (half the E8M0 scale: the value table is doubled), exactly
    as ggml_e8m0_to_fp32_half: subnormal for e < 2."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e.clamp(max=1), (e - 1).clamp(min=0) << 23)
    return bits.view(torch.float32)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    # 17 bytes: an E8M0 exponent byte, 16 bytes of 4-bit E2M1 codes (low nibbles: weights 0..15)
    d = e8m0_half(b[:, :1])
    q = torch.cat([b[:, 1:17] & 0x0F, b[:, 1:17] >> 4], dim=1).to(torch.int64)
    return d * table("mxfp4", b.device)[q]


BLOCK_DEQUANT: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.IQ1_S: _iq1_s, Q.IQ1_M: _iq1_m, Q.IQ2_XXS: _iq2_xxs, Q.IQ2_XS: _iq2_xs, Q.IQ2_S: _iq2_s,
    Q.IQ3_XXS: _iq3_xxs, Q.IQ3_S: _iq3_s, Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs,
    Q.TQ1_0: _tq1_0, Q.TQ2_0: _tq2_0, Q.MXFP4: _mxfp4,
}
