"""Reference dequantizers in pure torch, bit-exact (float32) with gguf-py's numpy code.

Each block function takes the raw blocks of one format as a uint8 tensor [n, type_size] and returns
float32 [n, block_size]. Everything is torch ops on whole block arrays, so it runs on CPU and CUDA alike.
Bit-exactness with gguf-py depends on doing the float math in the same order (e.g. (d * sc) * q - dmin * m),
so each function mirrors its numpy twin step for step; integer steps may differ since they are exact.
"""

from __future__ import annotations

from typing import Callable

import torch
from gguf import QK_K, GGMLQuantizationType

from strata.ops import registry
from strata.quant.formats import FLOAT_TYPES, block_geometry, check_supported, warn_reference_path
from strata.quant.iquants import BLOCK_DEQUANT as _LUT_DEQUANT

# kernels for whole blocks are chosen in strata.ops.registry (the Triton dequantizer on CUDA)
_DEQUANTIZE_BLOCKS = registry.op("dequantize_blocks")

Q = GGMLQuantizationType

# Elements dequantized per pass: bounds the temporaries (~20 bytes per element) on big tensors.
CHUNK_ELEMENTS = 1 << 22


def _f16(blocks: torch.Tensor, off: int) -> torch.Tensor:
    """The f16 field at byte offset off of each block, as float32 [n, 1]."""
    # .contiguous() because the field's stride (type_size) does not allow a dtype view in place.
    return blocks[:, off:off + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """[n, k*group] bytes -> [n, k, 2, group]: low nibbles of each group, then its high nibbles."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, group)
    return torch.cat([qs & 0x0F, qs >> 4], dim=2)


def _bits(qh: torch.Tensor, group: int, width: int) -> torch.Tensor:
    """[n, k*group] bytes -> [n, k, 8/width, group] fields of `width` bits, lowest first."""
    n = qh.shape[0]
    qh = qh.reshape(n, -1, group)
    mask = (1 << width) - 1
    # Python-int shifts (no shift tensor to build on the device) keep this free of host->device copies.
    return torch.stack([(qh >> s) & mask for s in range(0, 8, width)], dim=2)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    qs = _nibbles(b[:, 2:], 16).reshape(n, -1).to(torch.float32) - 8.0
    return d * qs


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, m = _f16(b, 0), _f16(b, 2)
    qs = _nibbles(b[:, 4:], 16).reshape(n, -1).to(torch.float32)
    return d * qs + m


def _q5_low_high(b: torch.Tensor, off: int) -> torch.Tensor:
    """The 5-bit values 0..31 of a Q5_0/Q5_1 block whose 4 qh bytes start at off. [n, 32] uint8."""
    n = b.shape[0]
    # qh is a little-endian uint32: bit j belongs to element j, so byte j//8 holds bit j%8.
    qh = b[:, off:off + 4]
    qh = torch.stack([(qh >> s) & 1 for s in range(8)], dim=2).reshape(n, 32)   # [n, 4 bytes, 8 bits]
    ql = _nibbles(b[:, off + 4:], 16).reshape(n, 32)
    return ql | (qh << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    return d * (_q5_low_high(b, 2).to(torch.float32) - 16.0)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    return d * _q5_low_high(b, 4).to(torch.float32) + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    x = b[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return x * d


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, :QK_K // 16]                                        # [n, 16]
    qs = b[:, QK_K // 16:QK_K // 16 + QK_K // 4]                      # [n, 64]
    d, dmin = _f16(b, QK_K // 16 + QK_K // 4), _f16(b, QK_K // 16 + QK_K // 4 + 2)
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, QK_K // 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, QK_K // 16, 1)
    q = _bits(qs, 32, 2).reshape(n, QK_K // 16, 16).to(torch.float32)   # [n, 16, 16]
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask = b[:, :QK_K // 8]                                          # [n, 32]
    qs = b[:, QK_K // 8:QK_K // 8 + QK_K // 4]                        # [n, 64]
    sc = b[:, QK_K // 8 + QK_K // 4:QK_K // 8 + QK_K // 4 + 12]       # [n, 12]
    d = _f16(b, QK_K // 8 + QK_K // 4 + 12)
    # 6-bit scales: low 4 bits in bytes 0..7 (low nibbles, then high nibbles), high 2 bits in bytes 8..11.
    lo = _nibbles(sc[:, :8], 8).reshape(n, 16)
    hi = _bits(sc[:, 8:], 4, 2).reshape(n, 16)
    scales = (lo | (hi << 4)).to(torch.float32) - 32.0
    dl = (d * scales).reshape(n, 16, 1)
    ql = _bits(qs, 32, 2).reshape(n, 16, 16).to(torch.float32)
    # The high bit *subtracts* 4 when it is clear.
    qh = (_bits(hmask, 32, 1).reshape(n, 16, 16) ^ 1).to(torch.float32)
    q = ql - qh * 4.0
    return (dl * q).reshape(n, QK_K)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte Q4_K/Q5_K scales into 8 six-bit scales and 8 six-bit mins, each [n, 8]."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.to(torch.float32)).reshape(n, -1, 1)                 # [n, 8, 1]
    ml = (dmin * mn.to(torch.float32)).reshape(n, -1, 1)
    q = _nibbles(b[:, 16:], 32).reshape(n, -1, 32).to(torch.float32)  # [n, 8, 32]
    return (dl * q - ml).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.to(torch.float32)).reshape(n, -1, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(n, -1, 1)
    qh = _bits(b[:, 16:16 + QK_K // 8], 32, 1).reshape(n, -1, 32)  # [n, 8, 32]
    ql = _nibbles(b[:, 16 + QK_K // 8:], 32).reshape(n, -1, 32)       # [n, 8, 32]
    q = (ql | (qh << 4)).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, :QK_K // 2]                                             # [n, 128]
    qh = b[:, QK_K // 2:QK_K // 2 + QK_K // 4]                        # [n, 64]
    scales = b[:, QK_K // 2 + QK_K // 4:QK_K // 2 + QK_K // 4 + QK_K // 16].contiguous()
    d = _f16(b, QK_K // 2 + QK_K // 4 + QK_K // 16)
    d = (d * scales.view(torch.int8).to(torch.float32)).reshape(n, QK_K // 16, 1)
    lo = _nibbles(ql, 64).reshape(n, -1, 32)                          # [n, 8, 32]
    hi = _bits(qh, 32, 2).reshape(n, -1, 32)                       # [n, 8, 32]
    q = (lo | (hi << 4)).to(torch.float32) - 32.0
    return (d * q.reshape(n, QK_K // 16, -1)).reshape(n, QK_K)


BLOCK_DEQUANT: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0,
    Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
    **_LUT_DEQUANT,  # the i-quants, TQ1_0/TQ2_0 and MXFP4 (strata.quant.iquants)
}

_FLOAT_DTYPE = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def _float_view(flat: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """Bytes [N*size] of a float format -> its values as float32, exactly (bf16 via its bit pattern)."""
    itemsize = 4 if qtype == Q.F32 else 2
    if flat.storage_offset() % itemsize or flat.stride(-1) != 1:
        flat = flat.clone()                  # a dtype view needs an aligned, dense start
    if qtype == Q.F32:
        return flat.view(torch.float32)
    if qtype == Q.F16:
        return flat.view(torch.float16).to(torch.float32)
    return (flat.view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def dequantize_flat(raw: torch.Tensor, qtype, dtype: torch.dtype = torch.float32,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize a run of whole blocks (any uint8 tensor, read in memory order) into a fresh 1-D tensor."""
    qt = check_supported(qtype)
    block, size = block_geometry(qt)
    flat = raw.reshape(-1)
    if flat.dtype != torch.uint8:
        raise TypeError(f"raw weight bytes must be uint8, got {flat.dtype}")
    if flat.numel() % size:
        raise ValueError(f"{flat.numel()} bytes are not a whole number of {qt.name} blocks of {size} bytes")
    n_elem = flat.numel() // size * block
    if out is None:
        out = torch.empty(n_elem, dtype=dtype, device=flat.device)
    if qt in FLOAT_TYPES:
        if qt == Q.F32 or dtype == torch.float32 or dtype != _FLOAT_DTYPE[qt]:
            out.copy_(_float_view(flat, qt))
        else:                                # same dtype as stored: a plain byte copy
            out.view(torch.uint8).copy_(flat)
        return out
    if flat.is_cuda:
        # one Triton launch (bit-identical in float32) instead of ~20 torch ops per chunk, where one takes it
        kernel = _DEQUANTIZE_BLOCKS.pick(flat, qt, out)
        if kernel is not None:
            return kernel.fn(flat, qt, out)
        warn_reference_path(qt, "GPU dequantization")
    return dequantize_blocks_torch(flat, qt, out)


def dequantize_blocks_torch(flat: torch.Tensor, qt, out: torch.Tensor) -> torch.Tensor:
    """The reference dequantizer of whole blocks (flat uint8) into `out` (1-D), per format, in chunks."""
    block, size = block_geometry(qt)
    fn = BLOCK_DEQUANT[qt]
    blocks = flat.view(-1, size)                                      # [n_blocks, type_size]
    # bigger chunks on the GPU: each chunk is ~20 launches, and launches, not bytes, bound small decode steps
    step = max(1, CHUNK_ELEMENTS * (8 if flat.is_cuda else 1) // block)
    for i in range(0, blocks.shape[0], step):                         # chunks of many blocks, not per block
        out[i * block:(i + step) * block].copy_(fn(blocks[i:i + step]).reshape(-1))
    return out


def dequantize(raw: torch.Tensor, qtype, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize raw GGML bytes (uint8, torch order [..., row_bytes]) to a tensor of logical `shape`."""
    shape = tuple(int(s) for s in shape)
    out = dequantize_flat(raw, qtype, dtype)
    if out.numel() != _prod(shape):
        raise ValueError(f"{out.numel()} dequantized elements do not fill shape {shape}")
    return out.view(shape)


def _prod(shape) -> int:
    p = 1
    for s in shape:
        p *= s
    return p
