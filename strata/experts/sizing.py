"""VRAM sizing rules shared by the engine (strata.experts.cache) and `strata check` (no torch import here).

A prefill chunk's streamed experts land in two chunk buffers (the copy of the next batch overlaps this one's
compute; with a buffer as large as a layer's misses the next layer's copies run during this layer). They come
out of the VRAM budget, so on a small budget they are kept to a sixteenth of what the expert cache would get
(a few slots per layer), and never above CHUNK_STAGE_MIB each.
"""

from __future__ import annotations

MiB = 1 << 20
CHUNK_STAGE_MIB = 256  # per buffer, at most (the engine passes STRATA_CHUNK_STAGE_MIB when set)
CHUNK_STAGE_SHARE = 16  # at most 1/16 of the bytes left for the expert cache, per buffer


def chunk_stage_experts(left_bytes: int, expert_bytes: int, n_experts: int, cap_mib: float | None = None) -> int:
    """Experts one chunk buffer holds, given the VRAM left for the expert cache (before the buffers)."""
    cap = float(cap_mib or CHUNK_STAGE_MIB) * MiB
    per = min(cap, max(left_bytes, 0) / CHUNK_STAGE_SHARE)
    return int(max(1, min(n_experts, per // max(expert_bytes, 1))))
