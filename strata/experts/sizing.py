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

from dataclasses import dataclass, replace

MiB = 1 << 20
GiB = 1 << 30
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
# chunk buffers in the ring: more buffers in flight measured slower (the chunk path is bound by the host's launches,
# and each buffer is one grouped call; docs/BENCHMARKS.md, "What was tried and did not pay")
CHUNK_RING = 2
PREFILL_TARGET = 4096  # tokens: the prefill chunk a GPU's expert cache leaves room for by default


def prefill_bytes_per_token(d_model: int, k: int) -> int:
    """VRAM one token of a prefill chunk takes on a GPU while a layer runs: its k expert pairs' float32 outputs
    (4·k·d, alive through the layer's MoE), their bf16 inputs, outputs and FFN intermediates in the grouped
    batches, the dequantized weight chunks' share (strata.ops.moe_prefill bounds both per batch), the attention
    and norm temporaries, and the allocator's rounding of all that: d·(7k + 60), 238 KB a token of B1 (hidden
    2048, top-8), 0.91 GiB for a 4K chunk, as measured there (torch's reserved memory 0.909 GiB above what was
    held before the prompt; allocated 0.80). (With 256 MiB batches, a whole batch's output widened to float32 at
    once and the choices combined in one product, a 4K chunk had taken 1.54 GiB reserved above the weights, KV
    and expert cache.) Less room than a chunk takes makes the prefill slower under the budget's cap, as torch
    then returns and re-maps memory inside the chunk."""
    return prefill_bytes_for(d_model, k)


def prefill_bytes_for(d_model: int, k: int, mixer: int = 0) -> int:
    """prefill_bytes_per_token with a sequence mixer whose prompt-chunk temporaries outgrow attention's: `mixer`
    bytes a token (a gated delta-net layer's chunked form: `deltanet_prefill_bytes`). A layer's mixer and its MoE
    run one after the other, so the larger of the two is what a chunk needs beside the shared d·60."""
    d, k = int(d_model), max(1, int(k))
    return d * 60 + max(7 * k * d, int(mixer))


# strata.layers.deltanet's CHUNK and GROUP (kept here so that `strata check` sizes a hybrid model without torch;
# tests/experts/test_prefill_sizing.py keeps them equal)
DELTANET_CHUNK, DELTANET_GROUP = 64, 8


def deltanet_prefill_bytes(hk: int, hv: int, dk: int, dv: int) -> int:
    """VRAM one prompt token takes in a gated delta-net layer (strata.layers.deltanet), float32: the input
    projections' output (the conv's channels, the gate z, ba) and the conv's, q and k per value head, the output;
    and the delta rule's temporaries of a group of chunks (padded q, k, v, the [chunk, chunk] products, the
    triangular solves' outputs, the decayed copies: ~11 per state dim and 2 per chunk row a value head and token,
    for GROUP x CHUNK tokens whatever the prompt chunk), spread over a 2048-token prompt chunk (more a token on a
    shorter one, less on a longer). Tracked tensor by tensor on the CPU (the same torch code runs on a GPU): 119 KB a
    token of Qwen3-Next's 32 x 128 x 128 heads above the projections' output at a 4K chunk, 142 at 2K; this gives
    192 with that output."""
    hk, hv, d, c = int(hk), int(hv), max(int(dk), int(dv)), DELTANET_CHUNK
    conv = 2 * hk * int(dk) + hv * int(dv)
    group = DELTANET_GROUP * c * hv * (11 * d + 2 * c) // 2048
    return 4 * (2 * conv + hv * int(dv) + 4 * hv * d + group)


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


def cache_slots(left: int, expert_bytes: int, per_slot: int, n_experts: int, n_sigs: int = 1,
                chunk_mib: float | None = None, buffers_in_budget: bool = True) -> tuple[int, int, int]:
    """(slots per layer, experts per chunk buffer, bytes of the chunk buffers) from `left`: the VRAM the chunk
    buffers and the expert cache share (the budget less the context, dense weights, KV, reserve, staging ring
    and prefill activations). Each weight signature (`n_sigs`) has its two buffers; `per_slot` is one slot in
    every layer. buffers_in_budget False: the buffers live in RAM (a CPU run sized as a GPU's budget)."""
    chunk = chunk_stage_experts(left, expert_bytes, n_experts, chunk_mib)
    buffers = 2 * chunk * expert_bytes * max(1, int(n_sigs)) if buffers_in_budget else 0
    slots = int(max(0, min(n_experts, (left - buffers) // max(int(per_slot), 1))))
    return slots, chunk, buffers


# --prefill-loan's auto takes it on a GPU once its GPU test (tests/experts/test_prefill_loan.py) has passed there
PREFILL_LOAN_GPU_TESTED = True


def lent_slots(split: "VramSplit", n_layers: int, per_slot: int, prefill_loan: bool | None = None) -> int:
    """Slots a layer a GPU's cache gets between prompts beyond the split's own, as strata.experts.cache lays them
    out: the share of the prefill chunk buffers (--chunk-buffer-loan, on for GPUs) and, with the prefill loan (by
    default where its GPU test passed), the VRAM of a prompt chunk's activations."""
    n = 2 * split.chunk_experts // max(int(n_layers), 1)
    if PREFILL_LOAN_GPU_TESTED if prefill_loan is None else prefill_loan:
        n += split.prefill // max(int(per_slot), 1)
    return int(max(0, min(n, split.n_experts - split.slots)))


# the parts of a VRAM split, in the order they are reported
SPLIT_LABELS = {"context": "CUDA context", "dense": "dense weights", "kv": "KV cache",
                "other": "torch allocator cache", "prefill": "prefill activations", "chunk_buffers": "chunk buffers",
                "staging": "staging ring", "cache": "expert cache", "reserve": "reserve", "unused": "unused"}


@dataclass(frozen=True)
class VramSplit:
    """How a VRAM budget is divided, in bytes; the parts add up to `budget` (`unused`: less than one more slot in
    every layer; negative when the budget is short by that much). The engine measures them on the device before
    it allocates the cache: `context` is what the device holds outside torch (the CUDA context, any other
    process), `dense` + `kv` what torch had allocated (told apart by `itemized`), `other` what torch's allocator
    kept cached besides. `strata check` estimates the context from the GGUF and knows no `other`."""

    budget: int
    context: int
    dense: int
    kv: int
    other: int
    reserve: int
    prefill: int  # one prefill chunk's activations
    chunk_buffers: int  # the prefill chunk ring's buffers (each streamed expert lands there once per chunk)
    staging: int  # the ring decode misses stream into over PCIe
    cache: int  # the expert cache's slots
    unused: int
    slots: int  # per layer
    n_experts: int  # per layer
    chunk_experts: int = 0  # experts per chunk buffer
    prefill_chunk: int = 0  # tokens
    lent_slots: int = 0  # per layer, in the chunk buffers' and prefill activations' VRAM between prompts (the loans)

    PARTS = tuple(SPLIT_LABELS)

    @property
    def cache_share(self) -> float:
        """The share of the budget the expert cache got."""
        return self.cache / self.budget if self.budget > 0 else 0.0

    def itemized(self, kv: int, prefill_chunk: int | None = None) -> "VramSplit":
        """This split with the KV cache's `kv` bytes told apart from the rest of what torch had allocated before
        the cache (`dense`: weights and their tables); the parts still add up to the budget."""
        k = max(0, min(int(kv), self.dense + self.kv))
        return replace(self, dense=self.dense + self.kv - k, kv=k,
                       prefill_chunk=self.prefill_chunk if prefill_chunk is None else int(prefill_chunk))

    def as_dict(self) -> dict:
        """GiB per part (`<part>_gib`), the budget, slots per layer and the cache's share of the budget."""
        out: dict = {"budget_gib": round(self.budget / GiB, 3)}
        out.update({f"{p}_gib": round(getattr(self, p) / GiB, 3) for p in self.PARTS})
        out.update(slots_per_layer=self.slots, n_experts=self.n_experts, cache_share=round(self.cache_share, 4),
                   prefill_chunk=self.prefill_chunk, chunk_experts=self.chunk_experts, lent_slots=self.lent_slots)
        return out

    def _shown(self) -> list[str]:
        # parts that are 0 (no CUDA context on a CPU, no allocator cache in `strata check`) are left out
        return [p for p in self.PARTS if getattr(self, p) or p == "cache"]

    def _note(self, p: str) -> str:
        if p == "prefill" and self.prefill_chunk:
            return f"{self.prefill_chunk}-token chunks"
        if p == "chunk_buffers" and self.chunk_experts:
            return f"{self.chunk_experts} experts per buffer"
        if p == "cache":
            lent = ""
            if self.lent_slots:  # while decoding the loans hold experts too: what the cache then has in all
                total = self.cache + self.lent_slots * self.cache // max(self.slots, 1)
                lent = (f" (+{self.lent_slots} lent between prompts: {self.slots + self.lent_slots} a layer, "
                        f"{total / GiB:.2f} GiB of experts while decoding)")
            return (f"{self.slots} of {self.n_experts} slots per layer{lent}, {100 * self.cache_share:.1f}% of the "
                    "budget")
        return ""

    def render(self) -> str:
        """One line: `VRAM 8.00 GiB = CUDA context 0.94 + dense weights 1.50 + ... GiB; expert cache: 12 of 128
        slots per layer, 6.6% of the budget`."""
        parts = [f"{SPLIT_LABELS[p]} {getattr(self, p) / GiB:.2f}" for p in self._shown()]
        return f"VRAM {self.budget / GiB:.2f} GiB = " + " + ".join(parts) + f" GiB; expert cache: {self._note('cache')}"

    def table(self, indent: str = "  ") -> list[str]:
        """A line per part: its label, GiB and what it holds."""
        rows = [(SPLIT_LABELS[p], getattr(self, p) / GiB, self._note(p)) for p in self._shown()]
        rows.append(("budget", self.budget / GiB, ""))
        w = max(len(r[0]) for r in rows)
        return [f"{indent}{name:<{w}}  {gib:8.3f} GiB  {note}".rstrip() for name, gib, note in rows]


def split_budget(budget: int, *, context: int, dense: int = 0, kv: int = 0, other: int = 0, reserve: int,
                 staging: int, prefill: int, expert_bytes: int, per_slot: int, n_experts: int, n_sigs: int = 1,
                 chunk_mib: float | None = None, buffers_in_budget: bool = True,
                 prefill_chunk: int = 0) -> VramSplit:
    """The split of `budget` bytes (the engine's budget_slots and `strata check` both size the cache here): what
    is held (context, dense, kv, other), the reserve, the staging ring and one prefill chunk's activations come
    first; the chunk buffers and the cache share the rest (cache_slots)."""
    left = budget - context - dense - kv - other - reserve - staging - prefill
    slots, chunk, buffers = cache_slots(left, expert_bytes, per_slot, n_experts, n_sigs, chunk_mib, buffers_in_budget)
    cache = slots * per_slot
    return VramSplit(int(budget), int(context), int(dense), int(kv), int(other), int(reserve), int(prefill),
                     int(buffers), int(staging), int(cache), int(left - buffers - cache), slots, int(n_experts),
                     chunk, int(prefill_chunk))


def prefill_left(budget: int, held: int, reserve: int) -> int:
    """The VRAM the default prefill chunk is sized from (prefill_chunk_for): the budget less what the device holds
    (context, dense weights, KV) and the reserve."""
    return int(budget) - int(held) - int(reserve)


# KV cache types (-ctk/-ctv) -> (values per block, bytes per block): q8_0 and q4_0 are GGML blocks of 32 values
# and one f16 scale (strata.kv.quant), a row that is not a multiple of 32 padded to whole blocks
KV_TYPE_BLOCKS = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18)}


def kv_row_bytes(n: int, kind: str) -> int:
    """Bytes of one cached row (a head's key or value, or MLA's latent) of n values stored as `kind`."""
    per, nbytes = KV_TYPE_BLOCKS[kind]
    return -(-n // per) * nbytes


def model_prefill_bytes(args) -> int:
    """prefill_bytes_for a loaded model's args (ModelArgs): its hidden size, top-k and, for a hybrid model, its
    delta-net layers' chunked form."""
    lin = args.extra.get("linear") if getattr(args, "extra", None) else None
    mixer = deltanet_prefill_bytes(lin["hk"], lin["hv"], lin["dk"], lin["dv"]) if lin else 0
    return prefill_bytes_for(args.d_model, getattr(args, "n_experts_used", 0) or 1, mixer)
