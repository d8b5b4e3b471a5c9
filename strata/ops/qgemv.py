"""Decode-sized qmatmul on CUDA: Q4_K / Q5_K / Q6_K / Q8_0 (and, once tested, the lookup formats') weights read in place
by the Triton GEMV of `expert_triton`.

A decode step multiplies a handful of rows by each dense weight; dequantizing the whole weight per call
(the fallback) moves ~5 bytes per weight where the blocks hold ~1 (Q8_0), ~0.82 (Q6_K: the usual LM head) or
~0.56 (Q4_K). With few rows the GEMV reads each block once per row (rows of x run back to back, so the
repeats come from L2), so it is used up to `MAX_ROWS` rows; larger batches (prefill) are compute-bound and keep
the dequantize-then-GEMM path. The output is stored in x's dtype (float32 accumulation, one rounding at the
store), so qmatmul's `.to(x.dtype)` is free. Reference twin: `strata.quant.matmul.reference_qmatmul`.
"""

from __future__ import annotations

import torch

from strata.ops import expert_triton, kquant_rows
from strata.quant.matmul import KERNELS, _cuda_dequant_matmul, register_kernel
from strata.quant.qtensor import QTensor

MAX_ROWS = 8
# 2-8 rows of x (a verify step, a batch of sequences) against Q8_0 / Q4_K / Q6_K weights by the kernel that decodes
# each block once for all of them (strata.ops.kquant_rows). Its GPU test passes, but it stays off by default: timed
# on the GPU machine it is slower than the one-row kernel for Q4_K and for the smaller Q8_0 weights, and its sums
# are not the one-row kernel's bit for bit, so a drafted step's greedy text could differ from plain decoding's
# (docs/BENCHMARKS.md, "Speculative decoding"). The interpreter tests run it on the CPU.
ROWS_GPU_TESTED = False
# Dense weights in the lookup formats (an IQ4_XS or IQ2_XXS file's attention and shared-expert weights) through the
# same one-row kernel: its tiles have passed the fused expert kernels' GPU tests, this entry joins once
# tests/ops/test_qgemv.py has passed it on a GPU (tools/gpu/gated.sh); until then such weights are dequantized each
# call
LOOKUP_GPU_TESTED = True


def _gemv(x2d: torch.Tensor, w: QTensor, block_n: int | None = None, block_k: int | None = None,
          rows: bool | None = None) -> torch.Tensor:
    """x2d [T, K] @ W.T -> [T, N] in x2d's dtype (float32 for integer x). block_n / block_k: see expert_triton.plan
    (the one-row kernel). rows: 2-8 rows by kquant_rows (default: ROWS_GPU_TESTED; never with block_k)."""
    T, K = x2d.shape
    raw = w.raw
    if T > MAX_ROWS or K % expert_triton.block_len(w.qtype) or not x2d.is_contiguous() \
            or not expert_triton.aligned(raw):
        return _cuda_dequant_matmul(x2d, w)
    if (ROWS_GPU_TESTED if rows is None else rows) and block_k is None and kquant_rows.usable(T, w.qtype, K):
        return kquant_rows.gemv_rows(x2d, w, block_n)
    N = w.shape[0]
    out = torch.empty(T, N, dtype=x2d.dtype if x2d.dtype.is_floating_point else torch.float32, device=x2d.device)
    if T == 0:
        return out
    bn, kw, even, warps = expert_triton.plan((w.qtype,), N, K, T, x2d.device, block_n, block_k)
    from strata.ops.dp4a_triton import int8_rows, parted

    xq = int8_rows(x2d, (w.qtype,))
    expert_triton._gemv_kernel[(T * expert_triton.triton.cdiv(N, bn),)](
        x2d, xq, raw, out, raw, out, expert_triton.codebooks_for((w.qtype,), out), out, T, N, K, raw.numel(),
        raw.shape[-1], QT=int(w.qtype), BN=bn, KW=kw, EVEN=even, GATHER=False, HOST=False,
        num_warps=warps, PARTS=parted((w.qtype,), xq))  # slots, hw, eids unused without GATHER/HOST
    return out


def install() -> bool:
    """Register the kernels for CUDA when Triton is present (done when strata.ops.registry loads its kernel
    modules); returns whether it did."""
    if not expert_triton.available() or not torch.cuda.is_available():
        return False
    for qt in formats():  # (the formats whose tiles have run on a GPU)
        if (("cuda", qt)) not in KERNELS:
            register_kernel("cuda", qt, _gemv)
    return True


def formats() -> frozenset:
    """The weight formats this GEMV takes on a GPU."""
    return expert_triton.K_ON_GPU | (expert_triton.LOOKUP_ON_GPU if LOOKUP_GPU_TESTED else frozenset())


install()  # this module is one of strata.ops.registry.KERNEL_MODULES: imported on the first op call
