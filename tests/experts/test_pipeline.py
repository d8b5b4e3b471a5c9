"""The miss pipeline's decisions (strata.experts.pipeline), on host data only: no tensors, no kernels."""

from __future__ import annotations

import numpy as np
import pytest

from strata import StrataError
from strata.experts.pipeline import admit, plan_handoff, plan_layer
from strata.experts.plan import CostModel, CpuPlan
from strata.experts.policy import make_policy

E, K = 8, 2


def _policy(slots=3, resident=(), layers=1):
    pol = make_policy("lfu-decay", layers, E, slots, swap_budget=2)
    if resident:
        pol.initial_fill({0: list(resident)})
    return pol


def _row(pol, li=0):
    return pol.expert_map()[li].copy()


def test_all_hits_decide_nothing():
    pol = _policy(resident=(1, 2, 3))
    ids = np.array([[1, 2], [3, 1]])
    d = plan_layer(ids, _row(pol), pol, 0, CpuPlan.parse("012", K), swaps=False)
    assert d.hit.all() and not d.cpu and not d.stream and not d.swaps
    h = plan_handoff(ids.reshape(-1).tolist(), [True] * 4, 2, K, pol.rank_keys(0), CpuPlan.parse("012", K),
                     ring=4, lane=True)
    assert not h.cpu_pairs and h.pcie_pairs == 0 and not h.stream


@pytest.mark.parametrize("plan", ["000", "001", "011", "012"])
def test_one_token_split_is_the_same_on_both_paths(plan):
    """A decode token: the eager layer and the graphed hand-off apply the same rule (coldest misses to the CPU)."""
    pol = _policy(resident=(0,))
    pol.observe(0, [5] * 5 + [6])  # 5 hotter than 6 and 7
    ids = np.array([[5, 7]])
    p = CpuPlan.parse(plan, K)
    d = plan_layer(ids, _row(pol), pol, 0, p, swaps=False)
    hit = (_row(pol)[ids] >= 0).reshape(-1).tolist()
    h = plan_handoff(ids.reshape(-1).tolist(), hit, 1, K, pol.rank_keys(0), p, ring=8, lane=True)
    assert d.cpu == h.cpu and set(d.stream) == set(h.stream)
    n_cpu = int(plan[2])  # the plan's CPU share of a token with both choices missed
    assert len(d.cpu) == n_cpu
    if n_cpu == 1:
        assert d.cpu == {7}  # the colder miss


def test_batch_split_equals_per_token_union():
    """A chunk's vectorised split gives what splitting every token and uniting the streamed experts gives."""
    rng = np.random.default_rng(0)
    pol = _policy(resident=(0, 1))
    pol.observe(0, rng.integers(0, E, 64).tolist())
    p = CpuPlan.parse("011", K)
    for _ in range(20):
        ids = np.stack([rng.choice(E, K, replace=False) for _ in range(6)])
        d = plan_layer(ids, _row(pol), pol, 0, p, swaps=False)
        hit = (_row(pol)[ids] >= 0).reshape(-1).tolist()
        h = plan_handoff(ids.reshape(-1).tolist(), hit, 6, K, pol.rank_keys(0), p, ring=E, lane=True)
        assert set(d.stream) == set(h.stream)
        assert d.cpu == h.cpu
        assert d.cpu.isdisjoint(d.stream)
        assert d.cpu | set(d.stream) == set(ids[~d.hit].tolist())


def test_handoff_ring_overflow_goes_to_the_cpu_or_fails_without_a_lane():
    pol = _policy(slots=0)
    ids = [0, 1, 2, 3, 4, 5]  # three tokens, six distinct misses, all over PCIe by the plan
    hit = [False] * 6
    h = plan_handoff(ids, hit, 3, K, pol.rank_keys(0), CpuPlan.all_pcie(K), ring=4, lane=True)
    assert h.stream == [0, 1, 2, 3] and h.cpu_pairs == [4, 5] and h.pcie_pairs == 4
    with pytest.raises(StrataError, match="staging slots"):
        plan_handoff(ids, hit, 3, K, pol.rank_keys(0), CpuPlan.all_pcie(K), ring=4, lane=False)


def test_handoff_prefetched_experts_cost_no_copy_and_never_go_to_the_cpu():
    pol = _policy(slots=0)
    h = plan_handoff([3, 4], [False, False], 1, K, pol.rank_keys(0), CpuPlan.all_cpu(K), prefetched={4: 7},
                     ring=4, lane=True)
    assert h.stream == [] and h.cpu_pairs == [0] and h.pcie_pairs == 1 and h.prefetched_pairs == 1


def test_chunk_prefetched_experts_stream_and_cost_model_split():
    pol = _policy(slots=0)
    ids = np.array([[0, 1], [0, 2], [0, 3], [1, 2]])
    cheap_cpu = CostModel(cpu_ms_per_expert=0.01, pcie_ms_per_expert=10.0, gpu_ms_per_expert=0.001)
    d = plan_layer(ids, _row(pol), pol, 0, CpuPlan.all_cpu(K), prefetched={2}, costs=cheap_cpu, swaps=False)
    assert 2 in d.stream and 2 not in d.cpu  # already copied: computed on the GPU
    assert d.cpu_estimate_ms is not None and d.cpu  # the cost model ran and gave the cheap CPU a share
    d = plan_layer(ids, _row(pol), pol, 0, CpuPlan.all_cpu(K), prefetched={2}, swaps=False)
    assert d.cpu == {0, 1, 3} and d.stream == [2] and d.cpu_estimate_ms is None


def test_admit_observes_then_commits_within_the_budget():
    pol = _policy(slots=3)
    pol.tick()
    ids = np.array([[4, 5], [6, 4]])
    d = plan_layer(ids, _row(pol), pol, 0, CpuPlan.all_pcie(K))
    # the empty slots fill at once (a fill evicts nothing: outside the budget of 2)
    assert len(d.swaps) == 3 and {s.admit for s in d.swaps} == {4, 5, 6} and all(s.evict is None for s in d.swaps)
    assert set(pol.pending(0)) == {s.admit for s in d.swaps}  # committed, not yet ready
    assert not pol.is_hit(0, d.swaps[0].admit)
    assert admit(pol, 0, [4]) == []  # pending: nothing more to admit
