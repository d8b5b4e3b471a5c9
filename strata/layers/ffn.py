"""Dense SwiGLU feed-forward (dense layers, shared experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.quant import QTensor, qmatmul


class SwiGLU:
    def __init__(self, gate: QTensor, up: QTensor, down: QTensor):
        self.gate, self.up, self.down = gate, up, down

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return qmatmul(F.silu(qmatmul(x, self.gate)) * qmatmul(x, self.up), self.down)
