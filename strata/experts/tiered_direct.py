"""Graphed decode with misses read in place (`--decode-misses direct`): no host hand-off inside the step.

The hand-off path (strata.experts.tiered_decode) cuts every MoE layer's step in pieces: the routing goes to the
host, which copies the misses into staging slots (or computes them on the CPU), and the GPU waits for both. Here
the expert kernel itself reads a missed expert's weights from the pinned host store, mapped into the GPU's
address space, so one launch serves every pair of a layer, hits from the slot pool and misses from host RAM
over the bus, and a decode step is one graph like a resident one:

    per MoE layer (GPU)   slots = expert_map[layer][ids]; y = two_tier_expert_ffn(x, pool, slots, store, ids)
                          ids copied to this layer's pinned buffer (a captured copy)
    between steps (host)  for each layer: count hits / misses, the policy learns the routing and admits
                          (copies on the side stream), finished copies become hits (expert_map uploaded)

A miss read over the bus costs more per byte than a DMA copy (docs/BENCHMARKS.md has both), but no layer waits
for the host, and a layer whose experts all hit costs what a resident one does. The host's bookkeeping runs
when the next step begins, after the engine has read the previous step's tokens (so its ids have landed).

On the CPU the same code runs eagerly with the torch twin reading the store (what CI tests against the
all-resident oracle).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from strata.experts.pipeline import admit
from strata.experts.resident import combine
from strata.experts.tiered_eager import PAIRS_MAX
from strata.ops.expert_gather import two_tier_expert_ffn, two_tier_fast

log = logging.getLogger("strata")


def supported(tiered) -> str:
    """'' when the direct path can serve this backend's decode steps, else why not (one log line's reason)."""
    if tiered.acts:
        return "its experts have biases or a non-SwiGLU activation (no fused kernel takes them)"
    if not tiered.cuda:
        return ""  # the torch twin reads the store on the CPU
    if not tiered.store.pinned:
        return "the expert store is not pinned (--low-ram reads the mapped file)"
    for layer in tiered.layer_ids:
        ew = tiered.store[layer]
        if not two_tier_fast(ew.gate, ew.up, ew.down):
            return f"layer {layer}'s expert formats have no fused GPU kernel"
    return ""


class _Ids:
    """One MoE layer's routed ids of a step of N tokens, as the host reads them between steps."""

    def __init__(self, P: int, cuda: bool):
        self.ids_h = torch.zeros(P, dtype=torch.int64, pin_memory=cuda)
        self.ids_np = self.ids_h.numpy()
        self.map_h = torch.zeros(0, dtype=torch.int64, pin_memory=cuda)  # the expert_map row upload buffer


class DirectDecode:
    """The one-graph decode path of a TieredExperts backend (`tiered`)."""

    def __init__(self, tiered):
        self.t = tiered
        self.bufs: dict[tuple[int, int], _Ids] = {}  # (layer index, tokens) -> buffers
        self.outstanding: tuple[int, bool] | None = None  # (tokens, counting) of a step not yet settled

    def begin_step(self, ctx) -> None:
        """A step begins: settle the last decode step's routing (its ids have landed: the engine read that step's
        tokens), then expect this one's when it is a graphed decode step."""
        self.settle()
        N = ctx.n_tokens
        if ctx.graphed and N * self.t.k <= PAIRS_MAX:
            self.outstanding = (N, ctx.counting)

    def forward(self, ctx, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [N, d], ids/w [N, k]: hits from the pool and misses from the store in one launch; ids to the host."""
        t = self.t
        N, k = ids.shape
        li = t.index[layer]
        b = self.bufs.get((li, N))
        if b is None:
            b = self.bufs[(li, N)] = _Ids(N * k, t.cuda)
        flat = ids.view(-1)  # [N*k], pair p = token p // k, choice p % k
        b.ids_h.copy_(flat, non_blocking=True)  # read by settle() once the step is over
        pool, ew = t.cache.pool_of[layer], t.store[layer]
        xs = x.repeat_interleave(k, dim=0) if N > 1 else x.expand(k, -1).contiguous()  # [N*k, d]
        slots = t.cache.map[li].index_select(0, flat)
        y = two_tier_expert_ffn(xs, pool.gate, pool.up, pool.down, slots, (ew.gate, ew.up, ew.down), flat)
        return combine(y.view(N, k, -1), w, x.dtype)

    def settle(self) -> None:
        """The last step's bookkeeping, layer by layer: hits and misses counted as the device map had them,
        the policy learns the routing and admits (copies on the side stream), finished copies become hits."""
        if self.outstanding is None:
            return
        N, counting = self.outstanding
        self.outstanding = None
        t = self.t
        if t.cuda:
            torch.cuda.current_stream(t.device).synchronize()  # (already idle: the step's tokens were read)
        pol, cache = t.policy, t.cache
        k = t.k
        for li, layer in enumerate(t.layer_ids):
            b = self.bufs.get((li, N))
            if b is None:
                continue
            ids_l = b.ids_np.tolist()
            row = pol.hit_row(li)  # the host mirror: the device map as the step read it (uploads happen here)
            missed = {e for e in ids_l if row[e] < 0}
            n_miss = sum(1 for e in ids_l if row[e] < 0)
            if counting:
                # bytes: each distinct missed expert once (what crossed the bus, as the PCIe lane counts)
                t.count(N * k - n_miss, 0, n_miss, N, layer=layer, pcie_experts=len(missed))
            swaps = admit(pol, li, ids_l)
            if swaps:
                cache.begin_copies()  # after the main stream's work so far (nothing reads the victims after it)
                for sw in swaps:
                    t.pending[li][sw.admit] = cache.copy(layer, sw.admit, cache.slot(layer, sw.slot))
                if counting:
                    t.count(0, 0, 0, 0, swaps=len(swaps))
            if t.poll(li, upload=False) or swaps:  # victims leave the map now, finished copies enter it
                self._upload(li, layer, b)

    def _upload(self, li: int, layer: int, b: _Ids) -> None:
        t = self.t
        row = t.policy.expert_map()[li]
        base = t.cache.pool_of[layer].base[layer]
        if b.map_h.numel() != row.shape[0]:
            b.map_h = torch.empty(row.shape[0], dtype=torch.int64, pin_memory=t.cuda)
        np.copyto(b.map_h.numpy(), np.where(row >= 0, row.astype(np.int64) + base, -1))
        t.cache.map[li].copy_(b.map_h, non_blocking=True)
