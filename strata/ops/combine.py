"""A MoE layer's k expert outputs per token weighted and summed in one launch, where torch takes three (the
product, the sum over choices, the cast to the activation dtype) in every MoE layer of a decode step.

`combine_choices(y [N, k, d] float32, w [N, k] float32, dtype) -> [N, d] in dtype`: one program per (token, block
of d) sums its k rows in routing order in float32. Reference twin: `strata.ops.reference.combine_choices` (the
float32 product and sum torch computes). Tested in Triton's interpreter (tests/ops/test_combine_interpret.py).

GPU_TESTED: the kernel is taken on a GPU since its GPU test passed there (the interpreter does not catch what only
compiled code does); False puts the twin back.
"""

from __future__ import annotations

import torch

from strata.ops import registry

try:  # Triton is optional: without it the torch twin runs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

GPU_TESTED = True
BLOCK_D = 1024


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _combine_kernel(Y, W, O, K, D, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < D
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in range(0, K):  # routing order, as the twin's sum over the choices
            w = tl.load(W + t * K + j).to(tl.float32)
            acc += tl.load(Y + (t * K + j) * D + offs, mask=m, other=0.0).to(tl.float32) * w
        tl.store(O + t * D + offs, acc.to(O.dtype.element_ty), mask=m)


def triton_combine_choices(y: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    N, k, d = y.shape
    out = torch.empty(N, d, dtype=dtype, device=y.device)
    if N:
        block = min(BLOCK_D, triton.next_power_of_2(d))
        _combine_kernel[(N, triton.cdiv(d, block))](y, w, out, k, d, BLOCK=block, num_warps=4)
    return out


def _when(y: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> bool:
    return (GPU_TESTED and triton is not None and y.is_cuda and y.dtype == torch.float32 and y.is_contiguous()
            and w.is_contiguous() and w.dtype == torch.float32 and y.dim() == 3)


registry.op("combine_choices").register("triton", triton_combine_choices, _when)
