"""qmatmul: x @ W.T with W kept in its stored format.

Kernels are chosen from KERNELS by (device type, qtype); a fast kernel plugs in with register_kernel()
and is tested against reference_qmatmul. The fallbacks dequantize row chunks per call: weights stay in
their format and no dequantized copy is ever cached.
"""

from __future__ import annotations

import contextvars
import threading
from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from strata import StrataError
from strata.ops import registry
from strata.quant import dequant
from strata.quant.dequant import dequantize_flat
from strata.quant.qtensor import QTensor

Kernel = Callable[[torch.Tensor, QTensor], torch.Tensor]

# (device type, qtype) -> kernel; a qtype of None is that device's default for every format.
KERNELS: dict[tuple[str, GGMLQuantizationType | None], Kernel] = {}

# True: CPU qmatmul is the float32 reference for every batch size. False (the default): decode-sized batches take
# the native kernel's int8-activation dot products where it reads the format (strata.ops.cpu_gemv), as llama.cpp's
# CPU backend rounds activations. The tests against float oracles set it (their `exact_cpu` marker); `exact_cpu()`
# sets it for one thread's block (the CPU lane's `ref` kernel, which promises float32 math).
CPU_EXACT = False
_tls = threading.local()


def cpu_exact() -> bool:
    """Whether CPU qmatmul must be the float32 reference here (globally, or in this thread's `exact_cpu` block)."""
    return CPU_EXACT or getattr(_tls, "exact", False)


@contextmanager
def exact_cpu():
    """Inside (this thread): CPU qmatmul is the float32 reference for every batch size."""
    before = getattr(_tls, "exact", False)
    _tls.exact = True
    try:
        yield
    finally:
        _tls.exact = before


def register_kernel(device_type: str, qtype: GGMLQuantizationType | None, fn: Kernel) -> None:
    """Route qmatmul on `device_type` ("cpu", "cuda") for `qtype` (None: all formats) to fn(x2d, w) -> [T, out]."""
    KERNELS[(device_type, qtype)] = fn


# Rows of x up to which a CPU product computes each row by itself, as the same call a one-row step makes: BLAS picks
# its blocking by the number of rows, so a row's sums (and with them a router's near tie, or a sampled token) would
# otherwise depend on the rows beside it: a speculative verify step would not give a token the logits a one-token
# step gives it, nor a step of several sequences each its own. Past it (prompt chunks) one product for all rows.
CPU_ROWS_ALONE = 64


# The rows of the step being computed, by sequence (its segments' lengths, in row order; None: one sequence). A CPU
# product of more than CPU_ROWS_ALONE rows over several sequences computes each sequence's rows as that sequence's
# step alone computes them: a short prompt sharing a prefill chunk with a long one would otherwise take the long
# one's path (the float product, where alone its rows take the int8 one) and get other logits and KV than alone.
_GROUPS: contextvars.ContextVar[tuple[int, ...] | None] = contextvars.ContextVar("strata_row_groups", default=None)


@contextmanager
def row_groups(sizes):
    """Inside: the step's rows belong to sequences of these many rows each, in order (strata.models.base)."""
    token = _GROUPS.set(tuple(int(n) for n in sizes) if len(sizes) > 1 else None)
    try:
        yield
    finally:
        _GROUPS.reset(token)


def group_slices(n: int, alone: int) -> list[slice] | None:
    """For a CPU product (or expert pass) over n rows whose path changes past `alone` rows: the row ranges to compute
    apart so that each sequence's rows take the path they take alone (sequences of at most `alone` rows merged
    while together they stay within it: that path computes each row by itself), or None where one call does."""
    g = _GROUPS.get()
    if g is None or n <= alone or sum(g) != n:
        return None
    out, start, small = [], 0, 0  # small: rows in the run of short sequences being merged
    for size in g:
        if size > alone or small + size > alone:
            if small:
                out.append(slice(start - small, start))
                small = 0
            if size > alone:
                out.append(slice(start, start + size))
                start += size
                continue
        small += size
        start += size
    if small:
        out.append(slice(start - small, start))
    return out if len(out) > 1 else None


def _linear(x2d: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2d @ w.T; on the CPU each of up to CPU_ROWS_ALONE rows by itself (batch invariant)."""
    n = x2d.shape[0]
    if x2d.is_cuda or n > CPU_ROWS_ALONE:
        return F.linear(x2d, w)
    # each row copied to memory of its own: BLAS's path (and so its sums) can follow the row's alignment, which a
    # row of a larger batch does not share with a one-row step's input
    return torch.cat([F.linear(x2d[i:i + 1].clone(), w) for i in range(n)])


def _chunked(x2d: torch.Tensor, w: QTensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, in] @ W.T computed in `dtype`, dequantizing at most ~CHUNK_ELEMENTS weights at a time."""
    out_f, in_f = w.shape
    x2d = x2d.to(dtype)
    # On the GPU, fewer larger chunks: each chunk costs ~20 launches, and a large head in small chunks would cost
    # thousands of launches per decode step.
    budget = dequant.CHUNK_ELEMENTS * (8 if x2d.is_cuda else 1)
    rows = max(1, budget // in_f)
    if rows >= out_f:
        return _linear(x2d, dequantize_flat(w.raw, w.qtype, dtype).view(out_f, in_f))
    y = torch.empty(x2d.shape[0], out_f, dtype=dtype, device=x2d.device)      # [T, out]
    for r in range(0, out_f, rows):
        wc = dequantize_flat(w.raw[r:r + rows], w.qtype, dtype).view(-1, in_f)  # [rows, in]
        y[:, r:r + wc.shape[0]] = _linear(x2d, wc)
    return y


def reference_qmatmul(x2d: torch.Tensor, w: QTensor) -> torch.Tensor:
    """The oracle: dequantize to float32 and multiply in float32. [T, in] -> [T, out] float32."""
    return _chunked(x2d, w, torch.float32)


def _cuda_dequant_matmul(x2d: torch.Tensor, w: QTensor) -> torch.Tensor:
    # Dequantize to the activation dtype each call (until fused kernels land), so the GEMM runs in it.
    return _chunked(x2d, w, x2d.dtype if x2d.dtype.is_floating_point else torch.float32)


register_kernel("cpu", None, reference_qmatmul)
register_kernel("cuda", None, _cuda_dequant_matmul)


def qmatmul(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """x @ W.T for x [..., in] and a 2-D QTensor W of logical shape (out, in); returns [..., out] in x's dtype."""
    if len(w.shape) != 2:
        raise StrataError(f"qmatmul needs a 2-D weight (out, in), got shape {w.shape}; index experts first")
    out_f, in_f = w.shape
    if x.shape[-1] != in_f:
        raise StrataError(f"qmatmul: input has {x.shape[-1]} features, weight {w.shape} expects {in_f}")
    if x.device != w.device:
        raise StrataError(f"qmatmul: input on {x.device} but weight on {w.device}")
    dev = x.device.type
    registry.load()  # the kernel modules fill KERNELS on the first call (strata.ops.registry)
    kernel = KERNELS.get((dev, w.qtype)) or KERNELS.get((dev, None)) or reference_qmatmul
    lead = x.shape[:-1]
    x2d = x.reshape(-1, in_f)
    parts = group_slices(x2d.shape[0], CPU_ROWS_ALONE) if dev == "cpu" else None
    if parts is not None:  # several sequences past a decode-sized product: each one's rows as alone
        y = torch.cat([kernel(x2d[p], w) for p in parts])
    else:
        y = kernel(x2d, w)                                                      # [T, out]
    return y.to(x.dtype).view(*lead, out_f)
