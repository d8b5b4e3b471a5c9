"""Slot bookkeeping shared by the cache policies (strata.experts.policy): which expert holds each slot, which
copies are pending, the swap budgets and the swap planner. Pure Python lists: this runs on the host for every
token-layer, where numpy's per-call cost would dominate arrays of ~100 entries."""

from __future__ import annotations

import bisect
import math
from typing import Mapping, NamedTuple, Sequence

import numpy as np

MANY = 256  # ids per observe() from which counting them with numpy beats the per-id loop


class Swap(NamedTuple):
    evict: int | None  # expert leaving `slot`, None when the slot was empty
    admit: int  # expert copied into `slot`
    slot: int



class SlotPolicy:
    """Slot bookkeeping, budgets and the swap planner shared by the policies.

    Subclasses keep one key per expert (`_keys[layer][e]`, larger is hotter), update it in
    `_observe_keys`, and say when a candidate may replace a victim (`_eligible`, `_beats`). The
    per-step state is plain Python lists: this runs on the host for every token-layer, where
    numpy's per-call cost would dominate arrays of ~100 entries.
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
        if n_layers < 1 or n_experts < 1:
            raise ValueError(f"need at least one layer and one expert, got {n_layers} x {n_experts}")
        caps = [int(slots)] * n_layers if np.isscalar(slots) else [int(s) for s in slots]
        if len(caps) != n_layers:
            raise ValueError(f"slots has {len(caps)} entries for {n_layers} layers")
        if any(c < 0 or c > n_experts for c in caps):
            raise ValueError(f"slots per layer must be within 0..{n_experts}, got {caps}")
        for name, b in (("swap_budget", swap_budget), ("global_swap_budget", global_swap_budget)):
            if b is not None and b < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {b}")
        self.n_layers = n_layers
        self.n_experts = n_experts
        self.swap_budget = swap_budget
        self.global_swap_budget = global_swap_budget
        self.steps = 0
        self._caps = caps
        L, E = n_layers, n_experts
        self._slot_expert = [[-1] * c for c in caps]  # [L][S] expert in each slot, -1 empty
        self._slot_ready = [[False] * c for c in caps]  # [L][S] its copy finished
        self._ready_slots: list[list[int]] = [[] for _ in range(L)]  # sorted ready slots
        self._ready_experts: list[list[int]] = [[] for _ in range(L)]  # their experts, same order
        self._n_free = list(caps)  # empty slots per layer
        self._where = [[-1] * E for _ in range(L)]  # [L][E] slot, ready or pending
        self._hit = [[-1] * E for _ in range(L)]  # [L][E] slot, ready only
        self._map = np.full((L, E), -1, dtype=np.int32)  # [L, E] mirror of _hit for the GPU
        self._map_view = self._map.view()
        self._map_view.flags.writeable = False
        self._usage = [[0] * E for _ in range(L)]  # [L][E] raw use counts
        self._keys = [[0.0] * E for _ in range(L)]  # [L][E] policy's hotness key
        self._touched: list[set[int]] = [set() for _ in range(L)]
        # per layer, a lower bound of the ready residents' keys (None: none known) and the expert it came from: a
        # step whose hottest candidate cannot beat it plans no replacement, which spares a pass over every resident
        # (that pass was most of the decode step's host bookkeeping). Keys only grow, so it stays a bound while no
        # colder expert becomes ready (it follows one down) and no rescale shrinks every key (forgotten then); it
        # is forgotten too when its expert is routed or leaves, so that it stays tight
        self._cold: list[float | None] = [None] * L
        self._cold_e = [-1] * L
        self._swapped_layer = [0] * L  # swaps committed this step, per layer
        self._swapped_global = 0

    # --- state -----------------------------------------------------------------------------

    def capacity(self, layer: int) -> int:
        return self._caps[layer]

    def set_capacity(self, layer: int, cap: int) -> list[int]:
        """Grow the layer to `cap` slots (the new ones empty) or shrink it: the slots from `cap` on leave, their
        ready experts stop being hits and their pending copies are forgotten (returned: the caller drops their
        events; a later mark_ready of one would be refused). The slots that stay are untouched."""
        if not 0 <= cap <= self.n_experts:
            raise ValueError(f"slots per layer must be within 0..{self.n_experts}, got {cap}")
        old = self._caps[layer]
        row, ready, where = self._slot_expert[layer], self._slot_ready[layer], self._where[layer]
        dropped: list[int] = []
        if cap < old:
            for slot in range(cap, old):
                e = row[slot]
                if e < 0:
                    self._n_free[layer] -= 1
                    continue
                if ready[slot]:
                    self._set_ready(layer, e, -1)
                else:
                    dropped.append(e)
                where[e] = -1
            del row[cap:], ready[cap:]
        else:
            row.extend([-1] * (cap - old))
            ready.extend([False] * (cap - old))
            self._n_free[layer] += cap - old
        self._caps[layer] = cap
        self._cold[layer] = None
        return dropped

    def resident(self, layer: int) -> dict[int, int]:
        """Experts whose copy finished, expert -> slot."""
        row = self._slot_expert[layer]
        return {row[s]: s for s in self._ready_slots[layer]}

    def pending(self, layer: int) -> dict[int, int]:
        """Experts committed but not yet marked ready, expert -> slot."""
        ready = self._slot_ready[layer]
        return {e: s for s, e in enumerate(self._slot_expert[layer]) if e >= 0 and not ready[s]}

    def is_hit(self, layer: int, expert: int) -> bool:
        return self._hit[layer][expert] >= 0

    def slot_of(self, layer: int, expert: int) -> int:
        """The slot of a ready expert, -1 on a miss (pending experts are misses)."""
        return self._hit[layer][expert]

    def expert_map(self) -> np.ndarray:
        """[L, E] int32 slot of each ready expert, -1 elsewhere; a read-only live view."""
        return self._map_view

    def usage(self) -> np.ndarray:
        """[L, E] int64 raw (undecayed) use counts since construction, for routing profiles."""
        return np.array(self._usage, dtype=np.int64)

    def budget_left(self, layer: int) -> int:
        """Swaps this layer may still commit in the current step."""
        left = self.n_experts if self.swap_budget is None else self.swap_budget - self._swapped_layer[layer]
        if self.global_swap_budget is not None:
            left = min(left, self.global_swap_budget - self._swapped_global)
        return max(left, 0)

    def _set_ready(self, layer: int, expert: int, slot: int) -> None:
        """Make `expert` a hit in `slot`, or (slot -1) no longer a hit."""
        slots, experts = self._ready_slots[layer], self._ready_experts[layer]
        cold = self._cold[layer]
        if slot >= 0:
            if cold is not None and self._keys[layer][expert] < cold:
                self._cold[layer], self._cold_e[layer] = self._keys[layer][expert], expert
        elif expert == self._cold_e[layer]:
            self._cold[layer] = None
        if slot >= 0:
            self._slot_ready[layer][slot] = True
            i = bisect.bisect(slots, slot)
            slots.insert(i, slot)
            experts.insert(i, expert)
        else:
            i = slots.index(self._hit[layer][expert])
            self._slot_ready[layer][slots[i]] = False
            del slots[i], experts[i]
        self._hit[layer][expert] = slot
        self._map[layer, expert] = slot

    # --- the step --------------------------------------------------------------------------

    def tick(self) -> None:
        """Start a new step: scores age by one step and the swap budgets refill."""
        self.steps += 1
        self._swapped_layer = [0] * self.n_layers
        self._swapped_global = 0
        self._on_tick()

    def observe(self, layer: int, expert_ids: Sequence[int]) -> None:
        """Record the experts routed in `layer` this step; one listed twice (a batch) counts twice."""
        n = self.n_experts
        if isinstance(expert_ids, np.ndarray) and expert_ids.size > MANY:
            # a prefill chunk (thousands of pairs): count per expert once, then touch each used expert once
            a = expert_ids.reshape(-1).astype(np.int64, copy=False)
            bad = a[(a < 0) | (a >= n)]
            if bad.size:
                raise ValueError(f"expert id {int(bad[0])} out of range 0..{n - 1}")
            counts = np.bincount(a, minlength=n)
            used = np.flatnonzero(counts).tolist()
            usage = self._usage[layer]
            for e, c in zip(used, counts[used].tolist()):
                usage[e] += c
            self._observe_many(layer, a, used, counts)
            self._touched[layer].update(used)
            if self._cold_e[layer] >= 0 and counts[self._cold_e[layer]]:
                self._cold[layer] = None
            return
        ids = [int(e) for e in expert_ids]
        usage = self._usage[layer]
        for e in ids:
            if not 0 <= e < n:
                raise ValueError(f"expert id {e} out of range 0..{n - 1}")
            usage[e] += 1
        self._observe_keys(layer, ids)
        self._touched[layer].update(ids)
        if self._cold_e[layer] in ids:  # (the coldest resident got warmer: which one is coldest is not known)
            self._cold[layer] = None

    def plan_swaps(self, layer: int) -> list[Swap]:
        """Swaps worth doing now in `layer`: empty slots first, then hysteresis-gated replacements.

        The step's budget limits replacements only: filling an empty slot evicts nothing, and the expert it
        admits crosses the bus for this step anyway (a miss, or a prefill chunk's streamed expert, which the
        chunk then computes from its slot). So a cold cache fills in its first prompt instead of budget-many
        experts a step (an 80B model's 234 slots a layer took ~117 steps at 2 a step, its first tokens all
        misses). A budget of 0 freezes the cache: nothing is copied."""
        touched = self._touched[layer]
        if not touched:
            return []
        where = self._where[layer]
        keys = self._keys[layer]
        eligible = self._eligible
        cands = [e for e in touched if where[e] < 0 and eligible(keys[e])]
        touched.clear()
        if not cands:  # every routed expert is cached (the common decode step)
            return []
        budget = self.budget_left(layer)
        if budget == 0 and (not self._n_free[layer] or self.swap_budget == 0 or self.global_swap_budget == 0):
            return []
        cands.sort(key=lambda e: (-keys[e], e))  # hottest first
        free = self._n_free[layer]
        del cands[free + budget:]
        swaps: list[Swap] = []
        i = 0
        if free:
            row = self._slot_expert[layer]
            for slot in range(self._caps[layer]):
                if i == len(cands):
                    return swaps
                if row[slot] < 0:
                    swaps.append(Swap(None, cands[i], slot))
                    i += 1
        if i == len(cands):
            return swaps
        cold = self._cold[layer]
        if cold is not None and not self._beats(keys[cands[i]], cold):
            return swaps  # (the hottest candidate beats no resident: the loop below would stop at once)
        # victims: ready residents, coldest first (ties: lowest slot); pending slots are untouchable
        slots, experts = self._ready_slots[layer], self._ready_experts[layer]
        vkeys = [keys[e] for e in experts]
        if vkeys:
            cold = min(vkeys)
            self._cold[layer], self._cold_e[layer] = cold, experts[vkeys.index(cold)]
        while i < len(cands) and vkeys:
            cold = min(vkeys)
            if not self._beats(keys[cands[i]], cold):
                break  # candidates only get colder and victims hotter from here
            j = vkeys.index(cold)  # the first, i.e. lowest, slot among equals
            swaps.append(Swap(experts[j], cands[i], slots[j]))
            vkeys[j] = math.inf
            i += 1
        return swaps

    def commit(self, layer: int, swaps: Sequence[Swap]) -> None:
        """Issue swaps: victims stop being hits now, admitted experts are pending until mark_ready."""
        if not swaps:
            return
        evictions = sum(1 for sw in swaps if sw.evict is not None)
        if evictions > self.budget_left(layer) or (swaps and self.swap_budget == 0):
            raise ValueError(
                f"layer {layer}: {evictions} replacements exceed the step's budget of {self.budget_left(layer)}"
            )
        cap = self._caps[layer]
        row, ready, where = self._slot_expert[layer], self._slot_ready[layer], self._where[layer]
        for evict, admit, slot in swaps:
            if not 0 <= slot < cap:
                raise ValueError(f"layer {layer}: slot {slot} out of range 0..{cap - 1}")
            if not 0 <= admit < self.n_experts:
                raise ValueError(f"expert id {admit} out of range 0..{self.n_experts - 1}")
            held = row[slot]
            if evict is None and held >= 0:
                raise ValueError(f"layer {layer}: slot {slot} holds expert {held}, not empty")
            if evict is not None and (held != evict or not ready[slot]):
                raise ValueError(f"layer {layer}: expert {evict} is not ready in slot {slot}")
            if where[admit] >= 0:
                raise ValueError(f"layer {layer}: expert {admit} is already cached or pending")
            if evict is None:
                self._n_free[layer] -= 1
            else:
                where[evict] = -1
                self._set_ready(layer, evict, -1)
            row[slot] = admit
            where[admit] = slot
        self._swapped_layer[layer] += evictions  # (fills of empty slots are outside the budget)
        self._swapped_global += evictions

    def mark_ready(self, layer: int, expert: int) -> None:
        """The copy of a pending expert finished: it is a hit from now on."""
        slot = self._where[layer][expert]
        if slot < 0 or self._slot_ready[layer][slot]:
            raise ValueError(f"layer {layer}: expert {expert} is not pending")
        self._set_ready(layer, expert, slot)

    def abort(self, layer: int, expert: int) -> None:
        """A pending copy was abandoned: its slot becomes empty."""
        slot = self._where[layer][expert]
        if slot < 0 or self._slot_ready[layer][slot]:
            raise ValueError(f"layer {layer}: expert {expert} is not pending")
        self._slot_expert[layer][slot] = -1
        self._where[layer][expert] = -1
        self._n_free[layer] += 1

    def initial_fill(
        self, ranking: Mapping[int, Sequence[int]], frequency: Mapping[int, Sequence[float]] | None = None
    ) -> None:
        """Fill layers with their top-ranked experts, ready at once (copied before serving starts).

        Replaces what those layers held. `frequency[layer][e]`, uses per step from a routing
        profile, seeds the scores so the profile's experts are not evicted by the first newcomer.
        """
        for layer, experts in ranking.items():
            if not 0 <= layer < self.n_layers:
                raise ValueError(f"layer {layer} out of range 0..{self.n_layers - 1}")
            cap = self._caps[layer]
            chosen: list[int] = []
            for e in experts:
                e = int(e)
                if not 0 <= e < self.n_experts:
                    raise ValueError(f"expert id {e} out of range 0..{self.n_experts - 1}")
                if len(chosen) < cap and e not in chosen:
                    chosen.append(e)
            freq = None
            if frequency is not None and layer in frequency:
                freq = np.asarray(frequency[layer], dtype=np.float64)
                if freq.shape != (self.n_experts,):
                    raise ValueError(f"frequency of layer {layer} has shape {freq.shape}, want ({self.n_experts},)")
            self._slot_expert[layer] = chosen + [-1] * (cap - len(chosen))
            self._slot_ready[layer] = [False] * cap
            self._ready_slots[layer] = []
            self._ready_experts[layer] = []
            self._n_free[layer] = cap - len(chosen)
            self._where[layer] = [-1] * self.n_experts
            self._hit[layer] = [-1] * self.n_experts
            self._map[layer] = -1
            for slot, e in enumerate(chosen):
                self._where[layer][e] = slot
                self._set_ready(layer, e, slot)
            self._seed(layer, freq, chosen)
            self._cold[layer] = None  # (the seeded keys replaced the row)

    # --- scoring, per policy ----------------------------------------------------------------

    def scores(self, layer: int) -> np.ndarray:  # [E] float64, larger is hotter
        raise NotImplementedError

    def rank_keys(self, layer: int) -> list[float]:
        """The layer's hotness keys, ordered as `scores` (larger is hotter) but not scaled: the live list, for
        ranking a few experts on the decode hand-off without building an array. Do not modify."""
        return self._keys[layer]

    def hit_row(self, layer: int) -> list[int]:
        """The layer's ready slot of each expert, -1 if none (what `expert_map()[layer]` mirrors): the live list."""
        return self._hit[layer]

    def _observe_keys(self, layer: int, ids: list[int]) -> None:
        raise NotImplementedError

    def _observe_many(self, layer: int, ids: np.ndarray, used: list[int], counts: np.ndarray) -> None:
        """_observe_keys for a long array of ids, with their per-expert counts at hand."""
        self._observe_keys(layer, ids.tolist())

    def _on_tick(self) -> None:
        pass

    def _eligible(self, key: float) -> bool:
        return key > 0.0

    def _beats(self, cand: float, victim: float) -> bool:
        raise NotImplementedError

    def _seed(self, layer: int, freq: np.ndarray | None, chosen: list[int]) -> None:
        pass
