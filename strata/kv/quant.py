"""Quantized KV rows (llama.cpp's `-ctk/-ctv q8_0 | q4_0`): each cached row (one head's key or value, or MLA's
latent) is stored as GGML blocks of 32 values sharing one f16 scale, quantized when written and dequantized when
attention reads it.

The blocks' quantized bytes and their scales live in two tensors (`qs` [..., blocks * block_bytes] and
`d` [..., blocks] f16) rather than interleaved as GGUF's 34-byte records: the scales then read as f16 in place (an
interleaved f16 field at stride 34 cannot be viewed without a copy) and both tensors index by slot and position
like a plain cache. The values and scales are GGML's Q8_0 / Q4_0 exactly (same rounding; tests/kv compares with
gguf-py's quantizer). A row whose length is not a multiple of 32 gets its last block zero-padded, so every
family's head dimension works (real models' are multiples of 32, tiny test models' often are not).

q4_0 rows are rotated before they are quantized: a 4-bit block's scale is set by its largest value, so one
outlier channel (keys have a few, many times the others) leaves the other 31 values of its block a level or two.
Multiplying each row by an orthonormal Hadamard matrix H (Sylvester's, over the largest power of two up to the
row's padded length that divides it) spreads every channel over the whole span first; reading multiplies by H
again (H = H^T = H^-1), so attention sees the row itself, less a quantization error that no longer depends on
one channel. tests/kv measures the attention error on keys with outlier channels both ways, and docs/BENCHMARKS.md
the perplexity each type costs. q8_0's 8 bits are not rotated.

Everything is whole-tensor torch ops with static shapes and no host reads, so a write at a device-side position
and a dequantized read of a fixed window are capturable in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32
# bytes of quantized values per block (the f16 scale is kept beside them)
QUANT_TYPES = {"q8_0": BLOCK, "q4_0": BLOCK // 2}


ROTATED = frozenset({"q4_0"})  # types whose rows are Hadamard-rotated before they are quantized
ROTATE_MAX = 256  # values one rotation spans at most (a head of 128 or 256 in one; longer rows in pieces)


def hadamard(n: int, device=None) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix of order n (a power of two), float32: symmetric, its own
    inverse."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n ** 0.5).to(device)


def rotation_order(padded: int) -> int:
    """The rotation's span for rows of `padded` values (a multiple of 32): the largest power of two up to
    ROTATE_MAX dividing it."""
    n = BLOCK
    while n * 2 <= ROTATE_MAX and padded % (n * 2) == 0:
        n *= 2
    return n


def rotate(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """x [..., m * n] float32, each run of n values multiplied by h [n, n] (its own inverse)."""
    n = h.shape[0]
    return (x.reshape(*x.shape[:-1], -1, n) @ h).reshape(x.shape)


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """roundf (half away from zero), as ggml's reference quantizer rounds; torch.round rounds half to even."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def _blocks(x: torch.Tensor, nb: int) -> torch.Tensor:
    """x [..., D] -> float32 [..., nb, 32], zero-padded past D."""
    x = x.float()
    pad = nb * BLOCK - x.shape[-1]
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], nb, BLOCK)


def quantize(x: torch.Tensor, kind: str, h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [..., D] -> (qs [..., nb * block_bytes] uint8, d [..., nb] f16), nb = ceil(D / 32); h: the
    rotation applied to the zero-padded rows first (None: none)."""
    nb = -(-x.shape[-1] // BLOCK)
    b = _blocks(x, nb)
    if h is not None:
        b = rotate(b.reshape(*b.shape[:-2], nb * BLOCK), h).reshape(b.shape)
    if kind == "q8_0":
        d = b.abs().amax(-1, keepdim=True) / 127  # ggml: d = amax / 127, values scaled by 1/d in float32
        inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
        q = _round_away(b * inv).to(torch.int8).view(torch.uint8)
    elif kind == "q4_0":
        # ggml: d = max / -8 where max is the signed value of largest magnitude; q = min(15, (int)(x / d + 8.5))
        idx = b.abs().argmax(-1, keepdim=True)
        d = b.gather(-1, idx) / -8
        inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
        q = torch.clamp(torch.trunc(b * inv + 8.5), max=15).to(torch.uint8)
        q = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)  # element j in the low nibble, j + 16 in the high
    else:
        raise ValueError(f"unknown KV quant type {kind!r}")
    return q.reshape(*x.shape[:-1], -1), d.squeeze(-1).to(torch.float16)


def dequantize(qs: torch.Tensor, d: torch.Tensor, kind: str, dim: int, dtype: torch.dtype,
               h: torch.Tensor | None = None) -> torch.Tensor:
    """(qs [..., nb * block_bytes], d [..., nb]) -> [..., dim] in `dtype` (the product in float32); h: the
    rotation the rows were quantized under (undone here)."""
    lead, nb = qs.shape[:-1], d.shape[-1]
    q = qs.reshape(*lead, nb, -1)
    if kind == "q8_0":
        v = q.view(torch.int8).float()
    else:
        v = torch.cat([q & 0x0F, q >> 4], dim=-1).float() - 8
    x = (v * d.float().unsqueeze(-1)).reshape(*lead, nb * BLOCK)
    if h is not None:
        x = rotate(x, h)
    x = x.to(dtype)
    return x if dim == nb * BLOCK else x[..., :dim]  # a padded last block: its zeros are not keys


@dataclass(frozen=True)
class Blocks:
    """A window of quantized rows as stored, for a kernel that reads the blocks itself
    (strata.ops.decode_attention_kv): qs [L, *lead, nb * block_bytes] uint8, d [L, *lead, nb] f16, the type, the
    row's width and the rotation the rows were quantized under (None: none)."""

    qs: torch.Tensor
    d: torch.Tensor
    kind: str
    dim: int
    h: torch.Tensor | None = None

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.qs, self.d, self.kind, self.dim, dtype, self.h)


class QuantRows:
    """One layer's K (or V) cache in blocks: qs [n_slots, max_ctx, *lead, nb * block_bytes] uint8 and
    d [n_slots, max_ctx, *lead, nb] f16, where the row shape is (*lead, dim)."""

    def __init__(self, n_slots: int, max_ctx: int, shape: tuple[int, ...], kind: str, device,
                 rotated: bool | None = None):
        if kind not in QUANT_TYPES:
            raise ValueError(f"unknown KV quant type {kind!r}")
        *lead, self.dim = shape
        self.kind = kind
        nb = -(-self.dim // BLOCK)
        # rotated: None = as the type is (ROTATED); made once here, not inside a captured step
        rotated = kind in ROTATED if rotated is None else rotated
        self.h = hadamard(rotation_order(nb * BLOCK), device) if rotated else None
        self.qs = torch.zeros(n_slots, max_ctx, *lead, nb * QUANT_TYPES[kind], dtype=torch.uint8, device=device)
        self.d = torch.zeros(n_slots, max_ctx, *lead, nb, dtype=torch.float16, device=device)

    @staticmethod
    def bytes_per_row(dim: int, kind: str) -> int:
        """Bytes of one cached row of `dim` values (blocks and scales)."""
        return -(-dim // BLOCK) * (QUANT_TYPES[kind] + 2)

    @property
    def nbytes(self) -> int:
        return self.qs.numel() * self.qs.element_size() + self.d.numel() * self.d.element_size()

    def write(self, slot: int, start: int, end: int, x: torch.Tensor) -> None:
        qs, d = quantize(x, self.kind, self.h)
        self.qs[slot, start:end] = qs
        self.d[slot, start:end] = d

    def write_at(self, slot: int, pos_t: torch.Tensor, x: torch.Tensor) -> None:
        qs, d = quantize(x, self.kind, self.h)
        self.qs[slot].index_copy_(0, pos_t, qs)
        self.d[slot].index_copy_(0, pos_t, d)

    def read(self, slot: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        """The first n positions of a slot, dequantized: [n, *lead, dim]."""
        return dequantize(self.qs[slot, :n], self.d[slot, :n], self.kind, self.dim, dtype, self.h)

    def window(self, slot: int, n: int) -> Blocks:
        """The first n positions of a slot as stored (views, not dequantized)."""
        return Blocks(self.qs[slot, :n], self.d[slot, :n], self.kind, self.dim, self.h)

    def rows(self, slot: int, n: int, device) -> list[torch.Tensor]:
        """Copies of the stored blocks of a slot's first n positions (the conversation cache keeps them as is)."""
        return [self.qs[slot, :n].to(device, copy=True), self.d[slot, :n].to(device, copy=True)]

    def put_rows(self, slot: int, n: int, rows: list[torch.Tensor]) -> None:
        self.qs[slot, :n] = rows[0][:n].to(self.qs.device, non_blocking=True)
        self.d[slot, :n] = rows[1][:n].to(self.d.device, non_blocking=True)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self.qs[dst, :n] = self.qs[src, :n]
        self.d[dst, :n] = self.d[src, :n]
