"""Decode-sized qmatmul on CUDA: Q4_K / Q6_K / Q8_0 weights read in place by the Triton GEMV of `expert_triton`.

A decode step multiplies a handful of rows by each dense weight; dequantizing the whole weight per call
(the fallback) moves ~5 bytes per weight where the blocks hold ~1 (Q8_0), ~0.82 (Q6_K: the usual LM head) or
~0.56 (Q4_K). With few rows the GEMV reads each block once per row, so it is used up to `MAX_ROWS` rows; larger
batches (prefill) are compute-bound and keep the dequantize-then-GEMM path. Reference twin:
`strata.quant.matmul.reference_qmatmul`.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q

from strata.ops import expert_triton
from strata.quant.matmul import KERNELS, _cuda_dequant_matmul, register_kernel
from strata.quant.qtensor import QTensor

MAX_ROWS = 8


def _gemv(x2d: torch.Tensor, w: QTensor) -> torch.Tensor:
    T, K = x2d.shape
    block = expert_triton.block_len(w.qtype)
    if T > MAX_ROWS or K % block or not x2d.is_contiguous():
        return _cuda_dequant_matmul(x2d, w)
    N = w.shape[0]
    raw = w.raw
    out = torch.empty(T, N, dtype=torch.float32, device=x2d.device)
    slots = torch.zeros(T, dtype=torch.int32, device=x2d.device)  # one "slot": the whole weight
    bn = expert_triton.BLOCK_N
    expert_triton._gemv_kernel[(T, expert_triton.triton.cdiv(N, bn))](
        x2d, raw, slots, out, N, K, raw.numel(), raw.shape[-1], QT=int(w.qtype), BN=bn)
    return out


def install() -> bool:
    """Register the kernels for CUDA when Triton is present; returns whether it did."""
    if not expert_triton.available() or not torch.cuda.is_available():
        return False
    for qt in (Q.Q4_K, Q.Q6_K, Q.Q8_0):
        if (("cuda", qt)) not in KERNELS:
            register_kernel("cuda", qt, _gemv)
    return True
