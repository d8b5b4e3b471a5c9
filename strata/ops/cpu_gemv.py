"""Decode-sized qmatmul on the CPU: quantized weights read in place by the native kernel (strata.ops.cpu_native).

The fallback dequantizes a weight to float32 on every call and multiplies: for a decode step (a few rows of x) that
writes and reads back ~4 bytes per weight where the blocks hold ~1 (Q8_0) or ~0.56 (Q4_K), and the dequantizing
itself dominates a CPU decode step.
Here each row of the weight is read once for all rows of x, dotted against x quantized to int8 per 256 (llama.cpp's
CPU rounding of activations; the CPU lane's kernel, the same dot products). Larger batches (prefill) are
compute-bound and keep the dequantize-then-GEMM path. Reference twin: `strata.quant.matmul.reference_qmatmul`.
"""

from __future__ import annotations

import threading

import torch
from gguf import GGMLQuantizationType

from strata.ops import cpu_native
from strata.quant import matmul
from strata.quant.matmul import KERNELS, reference_qmatmul, register_kernel
from strata.quant.qtensor import QTensor

# rows of x up to which each weight row is dotted per row of x (decode, verify steps, an expert's share of a prompt
# chunk): the kernel's time grows with the rows (one int8 dot product each), the fallback's is mostly the dequantizing
# and stays flat; where the two meet is measured in docs/BENCHMARKS.md ("A model on the CPU alone")
MAX_ROWS = matmul.CPU_ROWS_ALONE  # (one bound for both paths: a sequence's rows take one path whatever the step)
# weights below this many elements run on one thread: waking the others costs more than they save
PARALLEL_MIN = 1 << 18

_local = threading.local()  # a scratch buffer per calling thread


def _scratch(lib, T: int, K: int) -> int:
    need = int(lib.strata_native_gemv_scratch(T, K)) + 64
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < need:
        buf = _local.buf = torch.empty(max(need, 1 << 16), dtype=torch.uint8)
    return (buf.data_ptr() + 63) // 64 * 64


def native_qmatmul(x2d: torch.Tensor, w: QTensor) -> torch.Tensor:
    """x2d [T, K] @ W.T -> [T, N] float32; the reference where the kernel does not take the inputs."""
    T, K = x2d.shape
    fmt = w.qtype.name
    lib = cpu_native.load()
    if (matmul.cpu_exact() or lib is None or T == 0 or T > MAX_ROWS or fmt not in cpu_native.FORMATS or K % cpu_native.WIDTHS[fmt]
            or w.raw.dtype != torch.uint8 or not w.raw.is_contiguous()):
        return reference_qmatmul(x2d, w)
    x = x2d.to(torch.float32).contiguous()
    N = w.shape[0]
    out = torch.empty(T, N, dtype=torch.float32)
    threads = torch.get_num_threads() if N * K >= PARALLEL_MIN else 1
    rc = lib.strata_native_gemv(T, w.raw.data_ptr(), N, K, cpu_native.FORMATS[fmt], x.data_ptr(), out.data_ptr(),
                                threads, _scratch(lib, T, K))
    if rc:
        return reference_qmatmul(x2d, w)
    return out


def install() -> bool:
    """Register the kernel for the CPU formats the native kernel reads when it builds here (done when
    strata.ops.registry loads its kernel modules); returns whether it did."""
    if cpu_native.load() is None:
        return False
    for name in cpu_native.FORMATS:
        qt = GGMLQuantizationType[name]
        if ("cpu", qt) not in KERNELS:
            register_kernel("cpu", qt, native_qmatmul)
    return True


install()  # this module is one of strata.ops.registry.KERNEL_MODULES: imported on the first op call
