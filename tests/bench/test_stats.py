"""The bench's statistics against numpy (percentiles) and by hand (summaries, ratios)."""

import math

import numpy as np
import pytest

from strata.bench.stats import Summary, latency, median, percentile, ratio


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 10, 33])
@pytest.mark.parametrize("q", [0, 10, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(n, q):
    xs = np.random.default_rng(n * 100 + q).lognormal(size=n)
    assert percentile(xs.tolist(), q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)


def test_percentile_edges():
    assert math.isnan(percentile([], 50))
    assert percentile([3.0], 90) == 3.0
    assert median([4, 1, 3, 2]) == 2.5  # mean of the two middle values
    with pytest.raises(ValueError):
        percentile([1, 2], 101)


def test_summary_median_and_range():
    s = Summary.of([120.0, 100.0, 110.0])
    assert (s.median, s.min, s.max, s.n) == (110.0, 100.0, 120.0, 3)
    assert s.spread == pytest.approx(20 / 110)
    assert s.fmt() == "110.0 (100.0-120.0)"
    assert Summary.of([5.0]).fmt(2) == "5.00"
    empty = Summary.of([])
    assert empty.n == 0 and empty.fmt() == "-"


def test_latency_percentiles():
    d = latency([1.0, 2.0, 3.0, 4.0, 10.0])
    assert d["p50"] == 3.0
    assert d["p90"] == pytest.approx(7.6)  # 4 + 0.6 * (10 - 4)
    assert d["max"] == 10.0 and d["mean"] == 4.0 and d["n"] == 5
    assert latency([])["n"] == 0


def test_ratio_never_hides_a_missing_number():
    assert ratio(6.0, 3.0) == 2.0
    for a, b in ((None, 1.0), (1.0, None), (1.0, 0.0), (math.nan, 1.0)):
        assert math.isnan(ratio(a, b))


def test_expert_statistics_of_an_interval():
    """/metrics snapshots with raw counts (ExpertStats.as_dict()) give the interval's rates; rates alone are
    labelled cumulative."""
    from strata.bench.record import expert_delta
    from strata.experts.stats import ExpertStats

    a = ExpertStats()
    a.add(hits=30, cpu=6, pcie=4, tokens=5, layers=20, swaps=2)  # warm-up: a cold cache
    before = {"experts": a.as_dict()}
    a.add(hits=90, cpu=8, pcie=2, tokens=10, layers=40, swaps=1)
    d = expert_delta(before, {"experts": a.as_dict()})
    assert d["interval"] and d["lookups"] == 100 and d["hit_rate"] == pytest.approx(0.9)
    assert d["cpu_per_token"] == pytest.approx(0.8) and d["pcie_per_token"] == pytest.approx(0.2)
    assert d["swaps_per_token"] == pytest.approx(0.1)
    rates = expert_delta({"experts": {"swaps": 3}}, {"experts": {"hit_rate": 0.7, "swaps": 5}})
    assert rates == {"hit_rate": 0.7, "swaps": 5, "swaps_interval": 2, "cumulative": True}
    assert expert_delta(None, {"experts": {}}) == {}
