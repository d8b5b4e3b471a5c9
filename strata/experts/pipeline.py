"""One MoE layer's miss decision: which routed experts hit the cache, which missed ones the CPU lane computes,
which cross PCIe, and which the cache admits. Host data only (numpy and lists, no tensors, no kernels): tested
on the CPU by tests/experts/test_pipeline.py.

Every path of the tiered backend takes its decision here and only carries it out:

    eager layer (prefill chunks, eager decode; strata.experts.tiered_eager)
        plan_layer(ids, row, policy, li, plan, ...)        split, then admit (observe -> plan swaps -> commit)
    graphed decode hand-off (strata.experts.tiered_decode)
        plan_handoff(ids, hit, n, k, keys, plan, ...)      split, on the hand-off (plain lists: a few ids)
        admit(policy, li, ids)                             after the next piece is launched (keeps the GPU fed)

The split rule is the same everywhere: each token's misses are divided by the plan (`CpuPlan.choose`: the
coldest go to the CPU), and an expert streamed for one token serves all of its pairs; a prefill chunk priced by
the measured cost model (`--cpu-plan auto`) is split by `CostModel.prefill_split` instead. Experts already
copied ahead (prefetched) cost no PCIe and are never sent to the CPU. The hand-off holds at most `ring` streamed
experts (its staging slots); the rest go to the CPU, or fail clearly when the plan has no CPU lane.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from strata import StrataError
from strata.experts.plan import CostModel, CpuPlan
from strata.experts.policy import CachePolicy, Swap


@dataclass
class LayerDecision:
    """hit: per pair, whether the cache holds its expert ([N, k] bool array on the eager path, a flat list of N*k
    on the hand-off); cpu: missed experts the CPU lane computes; stream: missed experts copied over PCIe now (in
    plan order); swaps: the cache admissions committed with the policy. On the hand-off also cpu_pairs (flat pair
    indices for the CPU lane), pcie_pairs (pairs computed from staging slots: streamed or prefetched) and
    prefetched_pairs (of those, the prefetched). cpu_estimate_ms: a cost-model split's CPU lane time, unscaled (None: no such split ran)."""

    hit: object
    cpu: set[int] = field(default_factory=set)
    stream: list[int] = field(default_factory=list)
    swaps: list[Swap] = field(default_factory=list)
    cpu_pairs: list[int] = field(default_factory=list)
    pcie_pairs: int = 0
    prefetched_pairs: int = 0
    cpu_estimate_ms: float | None = None


def admit(policy: CachePolicy, li: int, ids) -> list[Swap]:
    """The policy learns this layer's routing and commits its swaps (within the step's budget): the experts the
    cache admits now. The caller copies them and marks each ready when its copy lands."""
    policy.observe(li, ids)
    swaps = policy.plan_swaps(li)
    policy.commit(li, swaps)
    return swaps


def stream_per_token(rows: Sequence[Sequence[int]], plan: CpuPlan, keys) -> dict[int, None]:
    """Each token's misses (rows: one list of missed experts per token) split by the plan; the union of what goes
    over PCIe, in first-chosen order (an expert streamed for one token serves all its pairs)."""
    streamed: dict[int, None] = {}
    for misses in rows:
        if misses:
            for e in plan.choose(misses, keys)[1]:
                streamed.setdefault(e, None)
    return streamed


def plan_layer(ids: np.ndarray, row: np.ndarray, policy: CachePolicy, li: int, plan: CpuPlan, *,
               hit: np.ndarray | None = None, prefetched: set[int] | frozenset = frozenset(),
               costs: CostModel | None = None, cpu_scale: float = 1.0, serial: bool = False,
               swaps: bool = True) -> LayerDecision:
    """The eager path's decision. ids [N, k] routed experts; row [E] the cache's ready slot of each expert (-1:
    not cached); prefetched: experts already in the chunk buffers; costs: split a chunk (N > 1) by the cost model
    (--cpu-plan auto), the CPU priced at cpu_scale x its estimate, serial: the CPU share runs before the GPU's
    (no overlap); swaps: also admit (the policy observes this routing)."""
    if hit is None:
        hit = row[ids] >= 0  # [N, k]
    d = LayerDecision(hit)
    d.cpu, stream = _split(ids, hit, policy, li, plan, prefetched, costs, cpu_scale, serial, d)
    d.stream = sorted(stream)
    if swaps:
        d.swaps = admit(policy, li, ids.reshape(-1))
    return d


def _split(ids, hit, policy, li, plan, pre, costs, cpu_scale, serial, d) -> tuple[set[int], set[int]]:
    """Missed experts -> (computed on the CPU, streamed over PCIe)."""
    miss = ~hit
    if not miss.any():
        return set(), set()
    N = ids.shape[0]
    missed = ids[miss]
    if costs is not None and N > 1:
        counts = np.bincount(ids.reshape(-1), minlength=policy.n_experts)
        used = np.flatnonzero(counts)
        tpe = dict(zip(used.tolist(), counts[used].tolist()))
        split = costs.prefill_split(tpe, resident=set(np.unique(ids[hit]).tolist()) | pre, cpu_scale=cpu_scale,
                                    serial=serial)
        d.cpu_estimate_ms = split.cpu_ms / max(cpu_scale, 1e-9)  # unscaled: the measured time corrects it
        return set(split.cpu), set(split.stream) | (pre & set(missed.tolist()))
    scores = policy.scores(li)
    if N > 1:  # every row at once (a chunk: thousands of rows)
        cpu, stream = plan.split_rows(ids, miss, scores)
        moved = cpu & pre  # experts already copied ahead for this chunk are computed on the GPU
        return cpu - moved, stream | moved
    stream = set(stream_per_token([ids[t][miss[t]].tolist() for t in range(N)], plan, scores))
    return set(missed.tolist()) - stream, stream


def plan_handoff(ids: list[int], hit: list[bool], n: int, k: int, keys, plan: CpuPlan, *,
                 prefetched: Mapping[int, int] | None = None, ring: int, lane: bool) -> LayerDecision:
    """The graphed decode hand-off's decision (plain Python: it runs for every layer of every step on a few ids).
    ids/hit: flat [n*k] (pair p = token p // k); keys: the policy's rank_keys; prefetched: experts already in
    staging slots; ring: the staging slots (most streamed experts); lane: whether a CPU lane exists."""
    pre = prefetched or {}
    avail = [h or e in pre for h, e in zip(hit, ids)]  # prefetched misses cost the plan nothing
    rows = [[ids[p] for p in range(t * k, t * k + k) if not avail[p]] for t in range(n)]
    streamed = list(stream_per_token(rows, plan, keys))
    if len(streamed) > ring:  # more distinct experts than staging slots: the rest go to the CPU
        streamed = streamed[:ring]
    staged = set(streamed)
    if not lane and any(not avail[p] and ids[p] not in staged for p in range(n * k)):
        raise StrataError(f"{n} sequences missed more experts than the {ring} staging slots hold and the plan "
                          "leaves the CPU lane off; decode fewer sequences per step")
    d = LayerDecision(hit, stream=streamed)
    for p, e in enumerate(ids):
        if hit[p]:
            continue
        if e in staged or e in pre:
            d.pcie_pairs += 1
            d.prefetched_pairs += e in pre
        else:
            d.cpu_pairs.append(p)
            d.cpu.add(e)
    return d
