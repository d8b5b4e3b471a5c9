"""The decode-time plan tuner: interleaved trials, dropped intervals, the fastest candidate kept."""

from __future__ import annotations

import pytest

from strata.experts.plan import CpuPlan
from strata.experts.tuner import PlanTuner

A, B, C = CpuPlan.parse("0111"), CpuPlan.all_pcie(3), CpuPlan.all_cpu(3)


def _drive(tuner, cost, steps, start=0.0, gaps=()):
    """Run decode steps whose duration depends on the plan they ran with; returns the plans used."""
    t, used = start, []
    for i in range(steps):
        if i in gaps:
            tuner.interrupt()
            t += 100.0  # a prefill or an idle pause: must not count
        plan = tuner.step(t)
        used.append(plan)
        t += cost[str(plan)]
    return used


def test_keeps_the_fastest_after_interleaved_trials():
    tuner = PlanTuner([A, B, C, A], trial=4, rounds=2, warmup=3)
    assert tuner.candidates == [A, B, C]  # duplicates dropped
    cost = {str(A): 0.012, str(B): 0.010, str(C): 0.015}
    used = _drive(tuner, cost, 3 + 2 * 3 * 5 + 10, gaps=(7, 20))
    assert tuner.done and tuner.chosen == B and tuner.plan == B
    assert used[-1] == B and {str(p) for p in used[:-10]} == {str(A), str(B), str(C)}
    med = tuner.medians()
    assert med[1] == pytest.approx(0.010) and med[0] == pytest.approx(0.012) and med[2] == pytest.approx(0.015)
    assert tuner.report()["chosen"] == str(B)


def test_outliers_and_gaps_do_not_count():
    tuner = PlanTuner([A, B], trial=3, rounds=1, warmup=0, max_step_s=0.5)
    t = 0.0
    for _ in range(4):  # A: one interval of 2 s (a stall) is dropped, the rest are 0.02
        tuner.step(t)
        t += 2.0 if t == 0.0 else 0.02
    for _ in range(6):
        tuner.step(t)
        t += 0.01
    assert tuner.done and tuner.chosen == B
    assert all(x < 0.5 for ts in tuner.times for x in ts)


def test_single_candidate_is_done_at_once():
    tuner = PlanTuner([B, B])
    assert tuner.done and tuner.plan == B and tuner.step(0.0) == B
    with pytest.raises(ValueError):
        PlanTuner([])


def test_alternating_rounds_cancel_a_warming_drift():
    """Steps get faster over time (the cache warms up); all candidates cost the same. Visiting them in one order
    per round would favour the last one; alternating rounds leave the medians level."""
    tuner = PlanTuner([A, B, C], trial=4, rounds=4, warmup=0)
    t, n = 0.0, 0
    while not tuner.done:
        tuner.step(t)
        t += 0.02 - 0.0001 * n  # a linear drift, the same for every plan
        n += 1
    med = tuner.medians()
    assert max(med) - min(med) < 1e-4  # one order per round: 1e-3 (the last candidate looks fastest)


def test_lane_candidates_and_their_names():
    from strata.experts.tuner import LaneSetting, lane_candidates

    c = lane_candidates(CpuPlan.parse("0112"), 3, 16)
    assert [str(x) for x in c] == ["0112@16", "0000@16", "0123@16", "0123@8", "0123@4"]
    assert [str(x) for x in lane_candidates(A, 3, 1)] == ["0111@1", "0000@1", "0123@1"]  # no duplicate threads
    assert str(LaneSetting(B)) == "0000"
