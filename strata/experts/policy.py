"""Expert cache policies: which experts hold the GPU's slots, and which to swap in next.

Pure Python (numpy only for the arrays it hands out), no tensors: the experts backend asks the policy what to do and
performs the copies itself. One forward step, per policy:

    policy.tick()                                   # once per step, before its observations
    for each MoE layer:
        hit = policy.is_hit(layer, e)               # (or read policy.expert_map())
        policy.observe(layer, routed_ids)           # every routed expert, hits and misses
        swaps = policy.plan_swaps(layer)            # [(evict or None, admit, slot)], within budget
        policy.commit(layer, swaps)                 # victims stop being hits now; copies start
    ... when a copy's event completed:  policy.mark_ready(layer, admit)

An admitted expert is *pending* between commit() and mark_ready(): lookups of it are misses and
its slot can be neither evicted nor refilled, so the GPU never reads a half-copied slot.

Candidates for admission are the non-resident experts routed since the previous plan_swaps() of
that layer; a hot expert that lost to the budget is routed again soon and reconsidered then.
"""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from strata import StrataError
from strata.experts.slots import SlotPolicy, Swap

__all__ = ["POLICIES", "CachePolicy", "auto_decay", "DecayedCountPolicy", "LRUPolicy", "SlotPolicy", "Swap", "make_policy"]

POLICIES = ("lfu-decay", "lru")

# --cache-decay auto: the counts' memory, 1 / (1 - decay) steps, holds AUTO_USES uses of an evenly routed expert
# (E / k steps each). A shorter memory ranks a model of many experts on its last few tokens' noise and trades slots
# on it: a fixed 0.95 did that on a 512-expert model, with no more hits than the longer memory and a copy for
# nearly every miss (docs/BENCHMARKS.md, "B2 at 24 GiB").
AUTO_USES = 5.0


def auto_decay(n_experts: int, k: int) -> float:
    """The decay that remembers AUTO_USES uses of an evenly routed expert, within [0.95, 0.999]."""
    return min(0.999, max(0.95, 1.0 - k / (AUTO_USES * max(1, n_experts))))


# the decay scale is renormalised before float64 could overflow (1e300); at decay=0.95 that is
# every ~4600 steps and costs one pass over [L, E]
_RENORM_AT = 1e150


@runtime_checkable
class CachePolicy(Protocol):
    """What the experts backend needs from a cache policy: everything any path (chunked prefill, eager decode,
    graphed decode) calls, and nothing else.

    expert_map() is [L, E] int32, the ready slot of each expert or -1 (the backend uploads its rows to the GPU);
    hit_row(layer) is the same row as a sequence the host reads per id (the graphed decode hand-off: plain Python
    on a few ids); scores(layer) [E] and rank_keys(layer) [E] order experts by hotness (larger is hotter; the
    plan sends the coldest misses to the CPU), rank_keys without the scaling (it only has to rank).
    """

    n_layers: int
    n_experts: int
    steps: int

    def capacity(self, layer: int) -> int: ...
    def tick(self) -> None: ...
    def observe(self, layer: int, expert_ids: Sequence[int]) -> None: ...
    def plan_swaps(self, layer: int) -> list[Swap]: ...
    def commit(self, layer: int, swaps: Sequence[Swap]) -> None: ...
    def mark_ready(self, layer: int, expert: int) -> None: ...
    def abort(self, layer: int, expert: int) -> None: ...
    def resident(self, layer: int) -> dict[int, int]: ...
    def pending(self, layer: int) -> dict[int, int]: ...
    def is_hit(self, layer: int, expert: int) -> bool: ...
    def slot_of(self, layer: int, expert: int) -> int: ...
    def expert_map(self) -> np.ndarray: ...
    def scores(self, layer: int) -> np.ndarray: ...
    def rank_keys(self, layer: int) -> Sequence[float]: ...
    def hit_row(self, layer: int) -> Sequence[int]: ...
    def usage(self) -> np.ndarray: ...
    def initial_fill(
        self, ranking: Mapping[int, Sequence[int]], frequency: Mapping[int, Sequence[float]] | None = None
    ) -> None: ...


class DecayedCountPolicy(SlotPolicy):
    """LFU with exponential decay (`lfu-decay`): score = sum over uses of decay ** age_in_steps.

    An expert routed every step settles at 1 / (1 - decay) (20 at decay 0.95). A candidate replaces
    the coldest resident only when `score > victim * (1 + margin) + abs_margin`, so two experts of
    near-equal popularity do not trade a slot back and forth; `promote_min` keeps out experts with
    fewer decayed uses than that, even from empty slots.
    """

    def __init__(
        self,
        n_layers: int,
        n_experts: int,
        slots: int | Sequence[int],
        *,
        decay: float = 0.95,
        margin: float = 0.2,
        abs_margin: float = 0.5,
        promote_min: float = 0.0,
        swap_budget: int | None = 2,
        global_swap_budget: int | None = None,
    ):
        super().__init__(
            n_layers, n_experts, slots, swap_budget=swap_budget, global_swap_budget=global_swap_budget
        )
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if margin < 0 or abs_margin < 0 or promote_min < 0:
            raise ValueError("margin, abs_margin and promote_min must be >= 0")
        self.decay = decay
        self.margin = margin
        self.abs_margin = abs_margin
        self.promote_min = promote_min
        # Lazy decay: a use at step t adds scale_t = decay**-t to the key and score = key / scale_now,
        # so observe() touches only the k routed entries and tick() only multiplies one float.
        self._scale = 1.0

    def _on_tick(self) -> None:
        self._scale /= self.decay
        if self._scale > _RENORM_AT:
            inv = 1.0 / self._scale
            self._keys = [[k * inv for k in row] for row in self._keys]
            self._scale = 1.0
            self._cold = [None] * self.n_layers  # (every key rescaled)

    def _observe_keys(self, layer: int, ids: list[int]) -> None:
        keys, scale = self._keys[layer], self._scale
        for e in ids:
            keys[e] += scale

    def _observe_many(self, layer: int, ids: np.ndarray, used: list[int], counts: np.ndarray) -> None:
        keys, scale = self._keys[layer], self._scale
        for e, c in zip(used, counts[used].tolist()):
            keys[e] += scale * c

    def scores(self, layer: int) -> np.ndarray:
        return np.array(self._keys[layer]) / self._scale

    def score(self, layer: int, expert: int) -> float:
        return self._keys[layer][expert] / self._scale

    def counts(self) -> np.ndarray:
        """[L, E] decayed use counts of every layer."""
        return np.array(self._keys) / self._scale

    def _eligible(self, key: float) -> bool:
        return key > 0.0 and key >= self.promote_min * self._scale

    def _beats(self, cand: float, victim: float) -> bool:
        # both sides in key units (score * scale)
        return cand > victim * (1.0 + self.margin) + self.abs_margin * self._scale

    def _seed(self, layer: int, freq: np.ndarray | None, chosen: list[int]) -> None:
        if freq is None:
            return
        steady = freq / (1.0 - self.decay) if self.decay < 1.0 else freq
        self._keys[layer] = (steady * self._scale).tolist()


class LRUPolicy(SlotPolicy):
    """Least recently used (`lru`): every routed miss may replace the resident unused the longest.

    A resident routed in the current step is never the victim, so one step's experts cannot evict
    each other.
    """

    def __init__(
        self,
        n_layers: int,
        n_experts: int,
        slots: int | Sequence[int],
        *,
        swap_budget: int | None = 2,
        global_swap_budget: int | None = None,
    ):
        super().__init__(
            n_layers, n_experts, slots, swap_budget=swap_budget, global_swap_budget=global_swap_budget
        )
        # keys are stamps of the last use, counting up across all layers
        self._stamp = 0.0
        self._step_start = 0.0  # stamps above this were made in the current step

    def _on_tick(self) -> None:
        self._step_start = self._stamp

    def _observe_keys(self, layer: int, ids: list[int]) -> None:
        keys, stamp = self._keys[layer], self._stamp
        for e in ids:
            stamp += 1.0
            keys[e] = stamp
        self._stamp = stamp

    def _observe_many(self, layer: int, ids: np.ndarray, used: list[int], counts: np.ndarray) -> None:
        # as the loop: each expert's key is the stamp of its last occurrence
        keys, n = self._keys[layer], ids.size
        first_rev = np.unique(ids[::-1], return_index=True)[1]  # [used] first index in the reversed ids
        for e, r in zip(used, first_rev.tolist()):
            keys[e] = self._stamp + float(n - r)
        self._stamp += float(n)

    def scores(self, layer: int) -> np.ndarray:
        return np.array(self._keys[layer])

    def _beats(self, cand: float, victim: float) -> bool:
        return victim <= self._step_start < cand

    def _seed(self, layer: int, freq: np.ndarray | None, chosen: list[int]) -> None:
        # the ranking's last resident is the first to go; stamps stay below any real use's (> 0)
        for rank, e in enumerate(chosen):
            self._keys[layer][e] = -1.0 - rank


def make_policy(name: str, n_layers: int, n_experts: int, slots: int | Sequence[int], **kwargs) -> CachePolicy:
    """The policy named by `--cache-policy` (lfu-decay | lru); lru ignores the lfu-only settings."""
    if name == "lfu-decay":
        return DecayedCountPolicy(n_layers, n_experts, slots, **kwargs)
    if name == "lru":
        lru_keys = {"swap_budget", "global_swap_budget"}
        return LRUPolicy(n_layers, n_experts, slots, **{k: v for k, v in kwargs.items() if k in lru_keys})
    raise StrataError(f"unknown cache policy {name!r}; choose one of {', '.join(POLICIES)}")
