"""An embedding table's looked-up rows, kept dequantized by token id for decode-sized lookups on the CPU.

A decode step looks up one token's row (a drafted step on an MTP model: one more for each of the block's forwards),
and dequantizing one row through the reference dequantizer is ~15 torch operators whose dispatch is the whole
cost (a few hundred floats of work). Here a row is dequantized once, by the same dequantizer and so to the same
bits (each quantized block decodes alone, whatever rows are decoded beside it), and later lookups copy it.
Bounded by bytes (first in, first out), so a large vocabulary keeps only its recent tokens.
"""

from __future__ import annotations

import torch

from strata.quant import QTensor
from strata.quant.dequant import dequantize

MAX_BYTES = 16 << 20  # dequantized rows kept per table
MAX_TOKENS = 16  # lookups of more tokens (a prompt chunk) take the batched path and keep nothing


class EmbedRows:
    """Rows of `table` [V, d] (quantized, in host memory) as `dtype` vectors, for a CPU model."""

    def __init__(self, table: QTensor, dtype: torch.dtype):
        self.table, self.dtype = table, dtype
        self.rows: dict[int, torch.Tensor] = {}
        self.cap = max(1, MAX_BYTES // (int(table.shape[-1]) * torch.tensor([], dtype=dtype).element_size()))
        self.hits = 0  # lookups served from kept rows (tests: the path is taken)

    @staticmethod
    def serves(table: QTensor, device: torch.device) -> bool:
        return device.type == "cpu" and table.raw.device.type == "cpu" and len(table.shape) == 2

    def lookup(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [n] -> [n, d] in dtype, a fresh tensor (the caller may write into it)."""
        ids = tokens.tolist()
        if len(ids) > MAX_TOKENS:
            return self._dequantize(tokens)
        rows = self.rows
        miss = [t for t in dict.fromkeys(ids) if t not in rows]
        if miss:
            got = self._dequantize(torch.tensor(miss, dtype=torch.long))
            for t, r in zip(miss, got):
                if len(rows) >= self.cap:
                    rows.pop(next(iter(rows)), None)
                rows[t] = r
            if any(t not in rows for t in ids):  # (more new tokens than the bound holds: none kept for them)
                return self._dequantize(tokens)
        else:
            self.hits += 1
        return torch.stack([rows[t] for t in ids])

    def _dequantize(self, tokens: torch.Tensor) -> torch.Tensor:
        e = self.table
        raw = e.raw.index_select(0, tokens.to(e.raw.device))
        return dequantize(raw, e.qtype, (raw.shape[0], e.shape[-1])).to(self.dtype)
