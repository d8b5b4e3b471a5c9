"""Rotary position embeddings: both element orders GGUF models use, and YaRN context extension.

`neox` rotates the two halves of the rotated dims against each other (transformers' rotate_half; Qwen, DeepSeek
as converted); `norm` rotates adjacent pairs (llama.cpp's LLAMA_ROPE_TYPE_NORM, used for `llama`, whose Q/K
weights llama.cpp's converter permutes so that pairs line up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from strata.ops import registry
from strata.ops.reference import rope

_QK_NORM_ROPE = registry.op("qk_norm_rope")
_QK_NORM_ROPE_KV = registry.op("qk_norm_rope_kv")


@dataclass
class RopeScaling:
    kind: str = "none"  # none | linear | yarn
    factor: float = 1.0
    original_ctx: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0  # yarn: attention temperature multiplier (`rope.scaling.yarn_log_multiplier` related)
    mscale_all_dim: float = 0.0
    truncate: bool = True  # yarn: round the ramp's ends to whole dims (llama.cpp, most checkpoints; gpt-oss: no)


def _yarn_inv_freq(dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    # YaRN (Peng et al. 2023): interpolate low frequencies by the factor, keep high ones, ramp in between.
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extra = 1.0 / pos_freqs
    inter = 1.0 / (s.factor * pos_freqs)

    def correction_dim(n_rot: float) -> float:
        return (dim * math.log(s.original_ctx / (n_rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extra_mask = 1 - ramp
    inv = inter * (1 - extra_mask) + extra * extra_mask

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.mscale_all_dim:
        attn = get_mscale(s.factor, s.mscale) / get_mscale(s.factor, s.mscale_all_dim)
    else:
        attn = get_mscale(s.factor)
    return inv, attn


class Rotary:
    def __init__(self, dim: int, theta: float, style: str, max_len: int, scaling: RopeScaling | None = None):
        self.dim, self.style, self.max_len = dim, style, max_len
        scaling = scaling or RopeScaling()
        self.attn_factor = 1.0
        if scaling.kind == "yarn" and scaling.factor > 1:
            inv, self.attn_factor = _yarn_inv_freq(dim, theta, scaling)
        else:
            inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
            if scaling.kind == "linear" and scaling.factor > 0:
                inv = inv / scaling.factor
        self.inv_freq = inv.to(torch.float32)
        self._cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # Built once per device for the whole context, so the decode step indexes a table (no host sync).
        got = self._cache.get(device)
        if got is None:
            t = torch.arange(self.max_len, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq)  # [S, dim/2]
            got = ((freqs.cos() * self.attn_factor).to(device), (freqs.sin() * self.attn_factor).to(device))
            self._cache[device] = got
        return got

    def __call__(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [N, H, D] (rotates the first `dim` of D), pos [N] absolute positions. On CUDA one Triton launch."""
        cos_t, sin_t = self._tables(x.device)
        return _QK_NORM_ROPE(x, None, pos, cos_t, sin_t, self.dim, self.style == "neox")[0]

    def qk(self, q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, q_norm: torch.Tensor | None = None,
           k_norm: torch.Tensor | None = None, eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """q [N, Hq, D], k [N, Hk, D]: per-head RMSNorm (when q_norm/k_norm [D] are given), then rotary.
        On CUDA one Triton launch for both (instead of ~38 torch kernels)."""
        cos_t, sin_t = self._tables(q.device)
        return _QK_NORM_ROPE(q, k, pos, cos_t, sin_t, self.dim, self.style == "neox", q_norm, k_norm, eps)

    def qk_into_cache(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                      q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                      k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor | None:
        """A decode step's q' from `qk`, with k' and v written into a layer's cache [slots, positions, ...] at
        (slot t, pos[t]) for token t in the same launch; None (nothing done) where no kernel takes it."""
        cos_t, sin_t = self._tables(q.device)
        args = (q, k, v, pos, cos_t, sin_t, self.dim, self.style == "neox", q_norm, k_norm, eps, k_cache, v_cache)
        if _QK_NORM_ROPE_KV.pick(*args) is None:
            return None
        return _QK_NORM_ROPE_KV(*args)

    def rotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The torch twin of the fused rotary (CPU path and test oracle)."""
        cos_t, sin_t = self._tables(x.device)
        return rope(x, pos, cos_t, sin_t, self.dim, self.style == "neox")
