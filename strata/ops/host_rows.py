"""Rows of a table in pinned host RAM gathered by a kernel on the GPU: the input embedding of a decode step whose
table stays on the host (EngineConfig.host_embed), inside a captured step, from token ids in device memory.

`gather_rows(table [V, B] uint8 (pinned host), ids [n] int64 (device)) -> [n, B] uint8 (device)`: one program per
row reads its B bytes over the bus (mapped host memory) and writes them to VRAM. The rows stay in their stored
format (a Q8_0 row of a 2048-wide table is 2,176 bytes); the model dequantizes them on the GPU. With the ids on the
device, a step needs no token value on the host, so the next step can be launched before the host reads this
one's tokens (strata.engine.ahead). Reference twin: `strata.ops.reference.gather_rows` (an index_select on the
host). Tested in Triton's interpreter on the CPU and on the GPU (tests/ops/test_host_rows.py).
"""

from __future__ import annotations

import torch

from strata.ops import registry

try:  # Triton is optional: without it the torch twin runs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK = 4096  # bytes one program copies per iteration


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _rows_kernel(table, ids, out, B, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        row = tl.load(ids + r).to(tl.int64)
        for a in range(0, B, BLOCK):
            off = a + tl.arange(0, BLOCK)
            m = off < B
            tl.store(out + r.to(tl.int64) * B + off, tl.load(table + row * B + off, mask=m, other=0), mask=m)


def triton_gather_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    n, B = ids.shape[0], table.shape[1]
    out = torch.empty(n, B, dtype=table.dtype, device=ids.device)
    if n:
        _rows_kernel[(n,)](table, ids, out, B, BLOCK=min(BLOCK, triton.next_power_of_2(B)), num_warps=4)
    return out


def _when(table: torch.Tensor, ids: torch.Tensor) -> bool:
    return (triton is not None and ids.is_cuda and table.device.type == "cpu" and table.is_pinned()
            and table.is_contiguous() and table.dim() == 2 and table.dtype == torch.uint8)


registry.op("gather_rows").register("triton", triton_gather_rows, _when)
