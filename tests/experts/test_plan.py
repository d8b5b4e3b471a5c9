"""The CPU / PCIe split of missed experts, the prefill split and the cost model file."""

import itertools
import dataclasses
import json
import math

import pytest

from strata import StrataError
from strata.experts.plan import COST_VERSION, CostModel, CpuPlan, decode_lanes_ms, prefill_split

# published: RTX 4090 + Ryzen 9950X (the GPU time per expert is ours, a plausible slot matmul)
CPU_MS, PCIE_MS, GPU_MS = 0.084, 0.285, 0.02


def test_parse_digits_and_commas():
    plan = CpuPlan.parse("011223344")
    assert plan.shares == (0, 1, 1, 2, 2, 3, 3, 4, 4) and plan.k == 8
    assert str(plan) == "011223344" and CpuPlan.parse(str(plan)) == plan
    assert plan.cpu_count(0) == 0 and plan.cpu_count(5) == 3
    ten = CpuPlan.parse(" 0,1,1,2,2,3,3,4,5,6,10 ", k=10)
    assert ten.k == 10 and ten.cpu_count(10) == 10
    assert str(ten) == "0,1,1,2,2,3,3,4,5,6,10"
    assert CpuPlan.all_cpu(3).shares == (0, 1, 2, 3) and CpuPlan.all_pcie(3).shares == (0, 0, 0, 0)
    with pytest.raises(ValueError):
        plan.cpu_count(9)


@pytest.mark.parametrize(
    "text, k, message",
    [
        ("011x23344", None, "want digits"),
        ("", None, "want digits"),
        ("012213344", None, "must not decrease"),
        ("021223344", None, "with 1 misses the CPU can take 0..1, not 2"),
        ("111223344", None, "with 0 misses"),
        ("011223344", 10, "covers 8 routed experts, the model routes 10"),
        ("0,1,,2", None, "want digits"),
        ("0,-1", None, "want digits"),
    ],
)
def test_parse_errors(text, k, message):
    with pytest.raises(StrataError, match=message):
        CpuPlan.parse(text, k=k)


def brute_best(k, m, **costs):
    return min(max(decode_lanes_ms(k, m, c, **costs)) for c in range(m + 1))


def test_decode_lanes():
    # 8 routed, 3 missed, 2 of them on the CPU: the GPU computes 5 hits while 1 expert is copied, then that one
    cpu, gpu = decode_lanes_ms(8, 3, 2, 0.1, 0.3, 0.02, cpu_overhead_ms=0.05)
    assert cpu == pytest.approx(0.05 + 0.2) and gpu == pytest.approx(max(5 * 0.02, 0.3) + 0.02)
    # hits longer than the copies: they set the pace
    assert decode_lanes_ms(8, 1, 0, 0.1, 0.05, 0.02)[1] == pytest.approx(7 * 0.02 + 0.02)
    assert decode_lanes_ms(8, 3, 0, 0.1, 0.3, 0.02, cpu_overhead_ms=0.05)[0] == 0.0
    with pytest.raises(ValueError):
        decode_lanes_ms(8, 3, 4, 0.1, 0.3, 0.02)


def test_auto_is_optimal_and_follows_the_costs():
    costs = dict(cpu_ms_per_expert=CPU_MS, pcie_ms_per_expert=PCIE_MS, gpu_ms_per_expert=GPU_MS)
    cheap_cpu = CpuPlan.auto(8, **costs)
    for m in range(9):
        assert max(decode_lanes_ms(8, m, cheap_cpu.cpu_count(m), **costs)) == pytest.approx(brute_best(8, m, **costs))
    # the CPU is 3.4x faster per expert than the link: it takes most misses, more than the
    # published hand plan 011223344 did
    assert all(c >= h for c, h in zip(cheap_cpu.shares, CpuPlan.parse("011223344").shares))
    assert cheap_cpu.cpu_count(8) >= 6

    cheap_pcie = CpuPlan.auto(8, cpu_ms_per_expert=0.5, pcie_ms_per_expert=0.05, gpu_ms_per_expert=0.01)
    assert cheap_pcie.cpu_count(8) <= 1 and cheap_pcie.cpu_count(1) == 0
    assert all(a <= b for a, b in zip(cheap_pcie.shares, cheap_cpu.shares))

    # a large per-token-layer CPU overhead keeps single misses off the CPU
    overhead = CpuPlan.auto(8, CPU_MS, PCIE_MS, GPU_MS, cpu_overhead_ms=0.5)
    assert overhead.cpu_count(1) == 0 and overhead.cpu_count(8) > 0


@pytest.mark.parametrize("k", [1, 4, 8, 10])
def test_auto_shares_valid_over_a_grid(k):
    for cpu, pcie, gpu, ovh in itertools.product([0.01, 0.1, 1.0], [0.01, 0.3], [0.0, 0.05], [0.0, 0.2]):
        plan = CpuPlan.auto(k, cpu, pcie, gpu, cpu_overhead_ms=ovh)  # validates monotone, <= m
        assert plan.k == k
        costs = dict(cpu_ms_per_expert=cpu, pcie_ms_per_expert=pcie, gpu_ms_per_expert=gpu, cpu_overhead_ms=ovh)
        for m in range(k + 1):
            got = max(decode_lanes_ms(k, m, plan.cpu_count(m), **costs))
            assert got == pytest.approx(brute_best(k, m, **costs))


def test_choose_sends_the_coldest_to_the_cpu():
    plan = CpuPlan.parse("011223344")
    scores = {5: 1.0, 3: 0.2, 9: 3.0, 4: 0.2}
    assert plan.choose([5, 3, 9], scores) == ([5, 3], [9])
    assert plan.choose([9, 4, 3], scores) == ([4, 3], [9])  # ties: routing order
    assert plan.choose([9], scores) == ([9], [])
    assert plan.choose([], scores) == ([], [])
    assert CpuPlan.all_pcie(8).choose([5, 3], scores) == ([], [5, 3])
    # a policy's score array works the same
    arr = [0.0] * 10
    arr[7] = 5.0
    assert plan.choose([7, 2, 1], arr) == ([2, 1], [7])
    assert plan.choose([7, 2, 1], None) == ([2, 1], [7])


def brute_threshold(tokens, resident, cpu_tok, pcie, gpu_tok, cpu_fixed=0.0):
    missed = sorted((n, e) for e, n in tokens.items() if n and e not in resident)
    base = sum(n * gpu_tok for e, n in tokens.items() if e in resident)
    best = math.inf
    for t in range(len(missed) + 1):
        cpu = sum(cpu_fixed + n * cpu_tok for n, _ in missed[:t])
        gpu = base + sum(pcie + n * gpu_tok for n, _ in missed[t:])
        best = min(best, max(cpu, gpu))
    return best


def test_prefill_split_few_tokens_go_to_the_cpu():
    tokens = {0: 1, 1: 60, 2: 2, 3: 120, 4: 0, 5: 3, 6: 80}
    split = prefill_split(tokens, cpu_ms_per_token_expert=0.05, pcie_ms_per_expert=0.285, gpu_ms_per_token_expert=0.001)
    assert split.cpu == [0, 2, 5] and split.stream == [1, 3, 6]
    assert 4 not in split.cpu + split.stream  # no tokens, no work
    assert max(split.cpu_ms, split.gpu_ms) == pytest.approx(brute_threshold(tokens, set(), 0.05, 0.285, 0.001))
    # resident experts are neither streamed nor given to the CPU, but load the GPU lane
    split = prefill_split(tokens, 0.05, 0.285, 0.001, resident=[3, 0])
    assert 3 not in split.stream + split.cpu and 0 not in split.stream + split.cpu
    assert split.gpu_ms >= 120 * 0.001
    # a slow link pushes everything to the CPU, a slow CPU everything to the GPU
    assert prefill_split(tokens, 0.001, 50.0, 0.001).stream == []
    assert prefill_split(tokens, 5.0, 0.01, 0.001).cpu == []
    with pytest.raises(ValueError):
        prefill_split({0: -1}, 0.05, 0.285)
    # past the token count the CPU's cost was measured at, an expert streams however cheap the line makes the CPU
    assert prefill_split(tokens, 0.001, 50.0, 0.001, cpu_max_tokens=8).cpu == [0, 2, 5]
    assert prefill_split(tokens, 0.001, 50.0, 0.001, cpu_max_tokens=2).cpu == [0, 2]


def test_prefill_split_matches_brute_force():
    import random

    rnd = random.Random(3)
    for _ in range(50):
        tokens = {e: rnd.choice([0, 1, 2, 3, 5, 8, 20, 64, 200]) for e in range(rnd.randint(1, 12))}
        resident = {e for e in tokens if rnd.random() < 0.2}
        cpu_tok, pcie = rnd.uniform(0.01, 0.2), rnd.uniform(0.05, 1.0)
        gpu_tok, fixed = rnd.uniform(0, 0.01), rnd.uniform(0, 0.1)
        split = prefill_split(tokens, cpu_tok, pcie, gpu_tok, cpu_ms_per_expert=fixed, resident=resident)
        want = brute_threshold(tokens, resident, cpu_tok, pcie, gpu_tok, fixed)
        assert max(split.cpu_ms, split.gpu_ms) == pytest.approx(want)
        assert sorted(split.cpu + split.stream) == sorted(e for e, n in tokens.items() if n and e not in resident)


def test_prefill_split_serial_lanes():
    """Lanes that do not overlap (a CUDA chunk: the host that computes the CPU share issues the GPU's work):
    the CPU takes an expert only where it is cheaper than its copy and compute, fixed costs included."""
    tokens = {0: 1, 1: 60, 2: 2, 3: 120, 5: 3, 6: 80}
    # parallel lanes: the CPU takes the few-token experts even where each costs more there than on the GPU
    par = prefill_split(tokens, cpu_ms_per_token_expert=0.05, pcie_ms_per_expert=0.04, gpu_ms_per_token_expert=0.001)
    assert par.cpu == [0, 2, 5]
    ser = prefill_split(tokens, 0.05, 0.04, 0.001, serial=True)
    assert ser.cpu == [] and ser.cpu_ms == 0.0
    # cheaper on the CPU one by one, but not past the lane's fixed cost
    assert prefill_split(tokens, 0.01, 0.04, 0.001, serial=True).cpu == [0, 2, 5]
    assert prefill_split(tokens, 0.01, 0.04, 0.001, cpu_overhead_ms=1.0, serial=True).cpu == []
    for serial in (False, True):
        for cpu_tok, pcie in ((0.05, 0.04), (0.01, 0.3), (0.2, 0.01)):
            split = prefill_split(tokens, cpu_tok, pcie, 0.001, serial=serial)
            missed = sorted((n, e) for e, n in tokens.items())
            f = (lambda c, g: c + g) if serial else max
            want = min(f(sum(n * cpu_tok for n, _ in missed[:t]), sum(pcie + n * 0.001 for n, _ in missed[t:]))
                       for t in range(len(missed) + 1))
            assert f(split.cpu_ms, split.gpu_ms) == pytest.approx(want)


def test_cost_model_round_trip_and_plans(tmp_path):
    cost = CostModel(
        CPU_MS,
        PCIE_MS,
        GPU_MS,
        cpu_ms_per_token_expert=0.01,
        gpu_ms_per_token_expert=0.0005,
        machine="host-a",
        model="q4_k 768x2048",
    )
    path = tmp_path / "sub" / "costs.json"
    cost.save(path)
    assert json.loads(path.read_text())["format"] == "strata-cost-model"
    back = CostModel.load(path)
    assert back == cost and back.matches("host-a", "q4_k 768x2048") and not back.matches("host-b", "q4_k 768x2048")
    assert cost.cpu_plan(8) == CpuPlan.auto(8, CPU_MS, PCIE_MS, GPU_MS)
    assert cost.decode_lanes_ms(8, 2, 1) == decode_lanes_ms(8, 2, 1, CPU_MS, PCIE_MS, GPU_MS)
    # the first token on the CPU pays for reading the weights, later ones for arithmetic only
    split = cost.prefill_split({0: 1, 1: 100})
    assert split.cpu == [0] and split.stream == [1]
    many = cost.prefill_split({0: 9, 1: 9})  # more tokens than the CPU was measured at: streamed, a slow link or not
    assert dataclasses.replace(cost, pcie_ms_per_expert=50.0).prefill_split({0: 9, 1: 9}).cpu == [] and many.cpu == []
    assert split.cpu_ms == pytest.approx(CPU_MS)
    assert [p.name for p in tmp_path.joinpath("sub").iterdir()] == ["costs.json"]  # no temp left


def test_cost_model_validation(tmp_path):
    with pytest.raises(ValueError, match="cpu_ms_per_expert"):
        CostModel(-1.0, PCIE_MS, GPU_MS)
    with pytest.raises(ValueError, match="pcie_ms_per_expert"):
        CostModel(CPU_MS, float("nan"), GPU_MS)
    with pytest.raises(StrataError, match="not found.*calibrate"):
        CostModel.load(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(StrataError, match="unreadable"):
        CostModel.load(bad)
    bad.write_text(json.dumps({"format": "other"}))
    with pytest.raises(StrataError, match="not a strata cost model"):
        CostModel.load(bad)
    bad.write_text(json.dumps({"format": "strata-cost-model", "version": COST_VERSION, "cpu_ms_per_expert": 0.1}))
    with pytest.raises(StrataError, match="malformed"):
        CostModel.load(bad)
    bad.write_text(
        json.dumps(
            {
                "format": "strata-cost-model",
                "version": COST_VERSION,
                "cpu_ms_per_expert": "fast",
                "pcie_ms_per_expert": 1,
                "gpu_ms_per_expert": 1,
            }
        )
    )
    with pytest.raises(StrataError, match="malformed.*cpu_ms_per_expert"):
        CostModel.load(bad)


@pytest.mark.parametrize("plan", ["011223344", "000000000", "012345678", "001122334"])
def test_split_rows_equals_choose_per_row(plan):
    """The batched split gives what choose() row by row gives (coldest misses to the CPU, a streamed expert
    serves all rows), ties broken in routing order."""
    import numpy as np

    rng = np.random.default_rng(1)
    p = CpuPlan.parse(plan)
    E, N, k = 32, 50, 8
    ids = np.stack([rng.permutation(E)[:k] for _ in range(N)])
    miss = rng.random((N, k)) < 0.6
    scores = rng.integers(0, 4, size=E).astype(float)  # many ties
    stream = set()
    for t in range(N):
        stream.update(p.choose(ids[t][miss[t]].tolist(), scores)[1])
    cpu = set(ids[miss].tolist()) - stream
    assert p.split_rows(ids, miss, scores) == (cpu, stream)


def test_decode_path_stages_unless_the_cpu_lane_clearly_wins():
    from strata.experts.plan import HANDOFF_STEP_MS, CostModel, CpuPlan, decode_path

    k = 8
    # a fast link beside a CPU that reads experts slower than it: every miss crosses the link, in the graph
    fast_link = CostModel(cpu_ms_per_expert=0.25, pcie_ms_per_expert=0.065, gpu_ms_per_expert=0.01,
                          cpu_overhead_ms=0.03)
    path, staged, handoff = decode_path(fast_link, fast_link.cpu_plan(k), k)
    assert path == "staged" and staged == pytest.approx(4 * 0.065 + 8 * 0.01)
    # PCIe 4.0 beside DDR5: the CPU lane computes a share faster than the link moves it
    slow_link = CostModel(cpu_ms_per_expert=0.06, pcie_ms_per_expert=0.12, gpu_ms_per_expert=0.01,
                          cpu_overhead_ms=0.03)
    plan = slow_link.cpu_plan(k)
    path, staged, handoff = decode_path(slow_link, plan, k)
    assert plan.shares[4] > 0 and path == "handoff" and handoff < 0.9 * staged
    # the same machine with a plan set by hand that keeps the CPU idle: nothing to gain from handing off
    assert decode_path(slow_link, CpuPlan([0] * (k + 1)), k)[0] == "staged"
    # the published RTX 4090 + Ryzen 9950X costs: its CPU lane beats its link by 3x
    desktop = CostModel(cpu_ms_per_expert=CPU_MS, pcie_ms_per_expert=PCIE_MS, gpu_ms_per_expert=GPU_MS)
    assert decode_path(desktop, desktop.cpu_plan(k), k)[0] == "handoff"
    # a CPU share that saves less than the margin does not pay for leaving the graph: one miss, the CPU a hair
    # faster than the link once its hand-off is counted
    near = CostModel(cpu_ms_per_expert=0.06, pcie_ms_per_expert=0.1, gpu_ms_per_expert=0.0, cpu_overhead_ms=0.035)
    p, s, h = decode_path(near, near.cpu_plan(k), k, misses=1)
    assert near.cpu_plan(k).shares[1] == 1 and h == pytest.approx(0.095 + HANDOFF_STEP_MS) and p == "staged"
    # costs like the H200 machine's (a Gen5 link beside 16 cores; B1's experts): the lanes alone look faster than
    # staging, but the hand-off's pieces cost more than they save (measured there: 21.0 ms a token handed off
    # with every miss on the link, 14.4 ms staged)
    h200 = CostModel(cpu_ms_per_expert=0.07, pcie_ms_per_expert=0.062, gpu_ms_per_expert=0.004, cpu_overhead_ms=0.05)
    p, s, h = decode_path(h200, h200.cpu_plan(k), k)
    lanes = max(h200.decode_lanes_ms(k, 4, h200.cpu_plan(k).shares[4]))
    assert h200.cpu_plan(k).shares[4] > 0 and lanes < 0.9 * s and p == "staged"
