"""VRAM sizing rules shared by the engine (strata.experts.cache) and `strata check` (no torch import here).

On a GPU the expert cache leaves room for one prefill chunk of PREFILL_TARGET tokens (or --prefill-chunk): a
chunk streams each uncached expert once, so a 4K prompt in one chunk crosses PCIe once where 217-token chunks
(what the free VRAM of an 8 GB card left after the cache would allow) crossed it 19 times.

A prefill chunk's streamed experts land in chunk buffers: the bytes of two buffers (sized here), as a ring of
CHUNK_RING (the copy of one buffer overlaps the compute of the other, across layer boundaries).
They come out of the VRAM budget, so on a small budget each of the two is kept to a sixteenth of what the expert
cache would get (a few slots per layer), and never above CHUNK_STAGE_MIB.
"""

from __future__ import annotations

MiB = 1 << 20
# Shared by the engine and `strata check` (imported by both, so they cannot drift apart):
VRAM_RESERVE_MIB = 700  # ExpertConfig.vram_reserve_mib's default: decode activations, graphs, allocator slack
DEFAULT_CTX = 8192  # EngineConfig.ctx_size 0 = min(the model's context, DEFAULT_CTX)
# what the driver may still add outside torch after set-up: modules loaded on first use, graph executables,
# cuBLASLt handles
OUTSIDE_GROWTH_MIB = 256


def staging_slots(k: int) -> int:
    """Experts the tiered backend's staging ring holds: two steps' worth of one token's k misses, at least 8."""
    return max(2 * int(k), 8)
CHUNK_STAGE_MIB = 256  # per buffer, at most (STRATA_CHUNK_STAGE_MIB sets a size by hand for benchmarks)
CHUNK_STAGE_SHARE = 16  # at most 1/16 of the bytes left for the expert cache, per buffer
# chunk buffers in the ring. Measured on the H200 machine (B1, 8 GiB, PCIe only, 4K prefill): 2 buffers 8,536
# tok/s, 4 7,321, 8 5,794 — the chunk path is bound by the host's launches, and each buffer is one grouped call
CHUNK_RING = 2
PREFILL_TARGET = 4096  # tokens: the prefill chunk a GPU's expert cache leaves room for by default


def prefill_bytes_per_token(d_model: int, k: int) -> int:
    """VRAM one token of a prefill chunk takes on a GPU while a layer runs: its k expert pairs' inputs (bf16),
    float32 outputs and FFN intermediates, the attention and norm temporaries, the dequantized weight chunks'
    share, and the allocator's rounding of all that. Measured on the H200 machine (B1: hidden 2048, top-8): a 4K
    chunk took torch's reserved memory 1.54 GiB above the weights, KV and expert cache (allocated: 1.2 GiB);
    d·(12k + 96) gives 393 KB a token, 1.54 GiB. Less room made the 4K prefill slower under the budget's cap
    (5,167 tok/s; 6,746 with ~0.3 GiB more), as torch then returns and re-maps memory inside the chunk."""
    return int(d_model) * (12 * max(1, int(k)) + 96)


def prefill_chunk_for(left_bytes: int, bytes_per_token: int) -> int:
    """The default prefill chunk on a GPU: PREFILL_TARGET tokens, or fewer (multiples of 256, at least 256) when
    its activations would take more than a third of the VRAM left for the chunk and the expert cache together
    (`left_bytes`: the budget less the context, dense weights, KV and reserve) — on a small budget the cache
    matters more than streaming each expert once per 4K tokens."""
    fit = (max(int(left_bytes), 0) // 3) // max(int(bytes_per_token), 1)
    return int(max(256, min(PREFILL_TARGET, fit // 256 * 256)))


def chunk_stage_experts(left_bytes: int, expert_bytes: int, n_experts: int, size_mib: float | None = None) -> int:
    """Experts one chunk buffer holds, given the VRAM left for the expert cache (before the buffers).
    `size_mib` (STRATA_CHUNK_STAGE_MIB, for benchmarks): the buffer's size set by hand, past the share rule —
    the cache gets what is left after it."""
    if size_mib is not None:
        per = float(size_mib) * MiB
    else:
        per = min(CHUNK_STAGE_MIB * MiB, max(left_bytes, 0) / CHUNK_STAGE_SHARE)
    return int(max(1, min(n_experts, per // max(expert_bytes, 1))))


def chunk_ring(per_buffer: int, ring: int | None = None) -> tuple[int, int]:
    """(buffers, experts each) of the chunk ring holding the experts of two buffers of `per_buffer` (`ring`:
    buffers wanted, CHUNK_RING by default)."""
    total = 2 * max(1, int(per_buffer))
    ring = max(2, min(int(ring or CHUNK_RING), total))
    return ring, total // ring
