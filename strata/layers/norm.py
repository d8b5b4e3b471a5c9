"""RMSNorm, computed in float32 whatever the activation dtype (as llama.cpp and transformers do)."""

from __future__ import annotations

import torch

from strata.ops import fused


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch twin (CPU path and test oracle of the fused kernel)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] in x's dtype. On CUDA one Triton launch instead of ~8 torch kernels."""
    if fused.use_for(x):
        return fused.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)
