"""Expert statistics and the step profile."""

import time

import pytest

from strata.experts.stats import ExpertStats, StepProfile


def test_add_and_derived():
    s = ExpertStats()
    assert s.hit_rate == 0.0 and s.cpu_per_token == 0.0  # nothing yet, no division by zero
    s.add(hits=5, cpu=2, pcie=1, swaps=1, tokens=1, layers=1)
    s.add(lookups=8, hits=8, tokens=1, layers=1)
    assert (s.lookups, s.hits, s.cpu, s.pcie, s.swaps, s.tokens, s.layers) == (16, 13, 2, 1, 1, 2, 2)
    assert s.hit_rate == pytest.approx(13 / 16)
    assert s.cpu_per_token == 1.0 and s.pcie_per_token == 0.5 and s.swaps_per_token == 0.5
    assert s.lookups_per_token == 8.0
    d = s.as_dict()
    assert d["hit_rate"] == pytest.approx(13 / 16) and d["lookups"] == 16 and d["swaps_per_token"] == 0.5
    assert set(d) >= {"lookups", "hits", "cpu", "pcie", "swaps", "tokens", "layers", "cpu_per_token", "pcie_per_token"}
    assert s.summary() == "hit 81.2% | cpu 1.0/tok | pcie 0.5/tok | swaps 0.5/tok"


def test_invariant_enforced():
    s = ExpertStats()
    with pytest.raises(ValueError, match="!= lookups 9"):
        s.add(lookups=9, hits=5, cpu=2, pcie=1)
    assert s == ExpertStats()  # a refused add changes nothing
    with pytest.raises(ValueError, match=">= 0"):
        s.add(hits=-1, cpu=1)
    with pytest.raises(ValueError, match="!= lookups"):
        ExpertStats(lookups=3, hits=1)


def test_merge_snapshot_reset_and_difference():
    total = ExpertStats(lookups=8, hits=8, tokens=1, layers=1)
    req = ExpertStats()
    req.add(hits=3, cpu=4, pcie=1, swaps=2, tokens=1, layers=1)
    before = total.snapshot()
    total.merge(req)
    assert total.lookups == 16 and total.cpu == 4 and total.tokens == 2
    assert before.lookups == 8  # the snapshot is a copy
    assert total - before == req
    assert before + req == total
    req.reset()
    assert req == ExpertStats() and total.cpu == 4
    with pytest.raises(ValueError):
        before - total  # negative counts


STEP = {  # a 24.47 ms decode token
    "pcie_wait": 7.60,
    "linear_attention": 5.38,
    "gpu_experts": 3.31,
    "mla": 2.85,
    "router_shared": 2.14,
    "cpu_wait": 1.75,
    "dense_other": 1.44,
}


def test_step_profile_per_token_and_render():
    prof = StepProfile()
    for _ in range(4):  # four tokens, each the same
        for k, v in reversed(list(STEP.items())):
            prof.add(k, v)
        prof.add_tokens()
    per = prof.per_token()
    assert list(per) == list(STEP)  # largest first
    assert per["pcie_wait"] == pytest.approx(7.60)
    assert prof.total_ms() == pytest.approx(24.47)
    assert prof.coverage(24.47) == pytest.approx(1.0)
    assert prof.coverage(48.94) == pytest.approx(0.5)

    lines = prof.render(measured_ms=24.47, width=40).splitlines()
    row = {ln.split("  ")[0].strip(): ln for ln in lines}
    assert "7.60" in row["PCIe wait"] and "31.1" in row["PCIe wait"]
    assert "5.38" in row["linear attention"] and "22.0" in row["linear attention"]
    assert "1.44" in row["dense/other"] and "5.9" in row["dense/other"]
    bars = {name: ln.count("█") for name, ln in row.items() if "█" in ln}
    assert bars["PCIe wait"] == 12  # 31.1% of 40 cells = 12.4: 12 full and a partial cell
    assert bars["PCIe wait"] > bars["linear attention"] > bars["GPU experts"] > bars["dense/other"]
    assert "24.47" in row["total"] and "coverage 100.0%" in lines[-1]

    # time outside every bucket shows as unaccounted
    lines = prof.render(measured_ms=30.0).splitlines()
    assert any(ln.startswith("unaccounted") and "5.53" in ln for ln in lines)
    assert "coverage 81.6%" in lines[-1]


def test_step_profile_timed_merge_reset():
    prof = StepProfile()
    with prof.timed("cpu_wait"):
        time.sleep(0.02)
    prof.add_tokens()
    assert 19.0 <= prof.per_token()["cpu_wait"] < 1000
    other = StepProfile()
    other.add("cpu_wait", 10.0)
    other.add("custom", 1.0)
    other.add_tokens()
    prof.merge(other)
    assert prof.tokens == 2 and "custom" in prof.render()
    assert prof.as_dict()["tokens"] == 2
    with pytest.raises(ValueError):
        prof.add("attention", -1.0)
    prof.reset()
    assert prof.per_token() == {} and prof.total_ms() == 0.0 and prof.coverage(10.0) == 0.0
