"""Dense SwiGLU feed-forward (dense layers, shared experts)."""

from __future__ import annotations

import torch

from strata.layers.attention import fuse_rows, row_views
from strata.ops import registry
from strata.quant import QTensor, qmatmul

_SILU_MUL = registry.op("silu_mul")  # one launch on a GPU once its kernel is taken there (strata.ops.fused)


class SwiGLU:
    def __init__(self, gate: QTensor, up: QTensor, down: QTensor, fuse: bool = False):
        self.gate, self.up, self.down = gate, up, down
        # on a GPU (or `fuse`: anywhere) gate and up as one weight (one GEMV a step), each a view of it
        self.gate_up, self.sizes = fuse_rows((gate, up), always=fuse)
        if self.gate_up is not None:
            self.gate, self.up = row_views(self.gate_up, self.sizes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            g, u = qmatmul(x, self.gate_up).split(self.sizes, dim=-1)
        else:
            g, u = qmatmul(x, self.gate), qmatmul(x, self.up)
        return qmatmul(_SILU_MUL(g, u), self.down)
