"""RMSNorm, computed in float32 whatever the activation dtype (as llama.cpp and transformers do)."""

from __future__ import annotations

import torch

from strata.ops import registry
from strata.ops.reference import rms_norm as rms_norm_ref  # noqa: F401 - the torch twin, by its old name

_RMS_NORM = registry.op("rms_norm")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] in x's dtype. On CUDA one Triton launch instead of ~8 torch kernels
    (the kernel is chosen in strata.ops.registry)."""
    return _RMS_NORM(x, weight, eps)


_ADD_RMS_NORM = registry.op("add_rms_norm")


def add_rms_norm(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual h = x + a and rms_norm(h, weight, eps) -> (h, normed): one op (one launch on a GPU once its
    kernel is taken there)."""
    return _ADD_RMS_NORM(x, a, weight, eps)
