"""strata calibrate: the keep-only-if-better rule on fake cost functions (wins, losses, noise, drift), where its
results live and how the engine config takes them, and one real run on the tiny model."""

import dataclasses
import random

import pytest
import torch

from strata.bench.calibrate import (
    Setting, ab, apply_calibration, calibration_path, candidate_space, load_calibration, save_calibration, search,
    share_plan, thread_candidates, thread_counts, try_candidate)
from strata.config import EngineConfig, ExpertConfig
from strata.experts.plan import CpuPlan

S0 = Setting(threads=4, cpu_plan="auto", cache_policy="lfu-decay", promote_min=0.0, swap_budget=4)


class FakeCost:
    """ms per token = base(setting) x drift(call index) x noise; records the order of the calls."""

    def __init__(self, base, drift: float = 0.0, noise: float = 0.0, seed: int = 0):
        self.base, self.drift, self.noise = base, drift, noise
        self.rng = random.Random(seed)
        self.calls: list[Setting] = []

    def __call__(self, s: Setting) -> float:
        i = len(self.calls)
        self.calls.append(s)
        return self.base(s) * (1 + self.drift * i) * (1 + self.noise * (2 * self.rng.random() - 1))


def test_blocks_are_interleaved_abba():
    f = FakeCost(lambda s: 10.0)
    b = dataclasses.replace(S0, threads=8)
    ta, tb = ab(f, S0, b, repeats=2)
    assert f.calls == [S0, b, b, S0, S0, b, b, S0]
    assert ta == [20.0, 20.0] and tb == [20.0, 20.0]


@pytest.mark.parametrize("cand_ms, kept", [(97.5, False), (97.0, True), (96.0, True), (100.0, False), (104.0, False)])
def test_keeps_only_a_win_over_three_percent(cand_ms, kept):
    cand = dataclasses.replace(S0, swap_budget=8)
    f = FakeCost(lambda s: cand_ms if s == cand else 100.0)
    t = try_candidate(f, "swap_budget", S0, cand, repeats=3)
    assert t.kept is kept
    assert t.gain == pytest.approx(100.0 / cand_ms - 1)


@pytest.mark.parametrize("drift", [-0.04, 0.04])
def test_a_drifting_machine_does_not_fake_a_win(drift):
    """The machine speeds up (or slows down) 4% per run: an equal candidate must not look better. Run A then B
    every time and it would (by ~4% per pair, past the 3% bar); A B B A cancels it."""
    cand = dataclasses.replace(S0, cpu_plan="000")
    t = try_candidate(FakeCost(lambda s: 100.0, drift=drift), "plan", S0, cand, repeats=3)
    assert not t.kept and t.gain == pytest.approx(0.0, abs=1e-9)
    naive = FakeCost(lambda s: 100.0, drift=-0.04)
    pairs = [(naive(S0), naive(cand)) for _ in range(3)]
    assert all(a / b - 1 > 0.03 for a, b in pairs)  # the trap the blocks avoid


def test_noise_needs_a_clear_win_in_every_block():
    cand = dataclasses.replace(S0, threads=8)
    # 1% better under +-3% noise: never kept over many seeds
    for seed in range(20):
        f = FakeCost(lambda s: 99.0 if s == cand else 100.0, noise=0.03, seed=seed)
        assert not try_candidate(f, "threads", S0, cand, repeats=2).kept
    # 15% better under the same noise: always kept
    for seed in range(20):
        f = FakeCost(lambda s: 85.0 if s == cand else 100.0, noise=0.03, seed=seed)
        assert try_candidate(f, "threads", S0, cand, repeats=2).kept


def test_search_walks_knob_by_knob_from_the_current_setting():
    """threads 8 is 10% faster, plan 000 only 2% (not kept), lru 20% slower, swap 8 another 6% faster; a
    candidate is always measured against the setting kept so far."""
    def base(s: Setting) -> float:
        ms = 100.0
        ms *= 0.90 if s.threads == 8 else 1.0
        ms *= 0.98 if s.cpu_plan == "000" else 1.0
        ms *= 1.20 if s.cache_policy == "lru" else 1.0
        ms *= 0.94 if s.swap_budget == 8 else 1.0
        return ms

    space = [("threads", [{"threads": 2}, {"threads": 8}]), ("plan", [{"cpu_plan": "000"}]),
             ("cache_policy", [{"cache_policy": "lru"}]), ("swap_budget", [{"swap_budget": v} for v in (2, 4, 8)])]
    best, trials = search(FakeCost(base), S0, space, repeats=2, say=lambda m: None)
    assert best == dataclasses.replace(S0, threads=8, swap_budget=8)
    assert [t.kept for t in trials] == [False, True, False, False, False, True]  # swap 4 is the current: skipped
    assert trials[-1].current.threads == 8  # measured against the kept threads


def test_search_rows_are_labelled_by_what_they_change():
    """lru wins, then the promote-min candidates (each with lfu-decay): promote-min 0 only switches the policy back,
    and its row said "promote_min  cache_policy lru -> lfu-decay". A row's label names what its change shows."""
    lines: list[str] = []
    space = [("cache_policy", [{"cache_policy": "lru"}]),
             ("promote_min", [{"promote_min": v, "cache_policy": "lfu-decay"} for v in (0.0, 0.5)])]
    best, _ = search(FakeCost(lambda s: 80.0 if s.cache_policy == "lru" else 100.0), S0, space, repeats=1,
                     say=lines.append)
    assert best.cache_policy == "lru"
    rows = [ln.split(None, 1) for ln in lines]
    assert [(label, change.split("  ")[0]) for label, change in rows] == [
        ("cache_policy", "cache_policy lfu-decay -> lru"), ("cache_policy", "cache_policy lru -> lfu-decay"),
        ("promote_min", "cache_policy lru -> lfu-decay, promote_min 0.0 -> 0.5")]


def test_candidate_space():
    k = 8
    assert share_plan(k, 0.0) == str(CpuPlan.all_cpu(k)) and share_plan(k, 1.0) == str(CpuPlan.all_pcie(k))
    half = CpuPlan.parse(share_plan(k, 0.5), k)
    assert [half.cpu_count(m) for m in range(k + 1)] == [m - (m + 1) // 2 for m in range(k + 1)]
    assert thread_counts(16) == [1, 2, 4, 8, 16] and thread_counts(6) == [1, 2, 4, 6] and thread_counts(1) == [1]
    assert thread_candidates({1: 5.0, 2: 3.0, 4: 2.0, 8: 2.1, 16: 2.6}) == [4, 8, 16]
    space = dict(candidate_space(k, {1: 5.0, 2: 3.0}))
    assert list(space) == ["threads", "plan", "pcie_share", "cache_policy", "promote_min", "swap_budget"]
    assert all(c["cache_policy"] == "lfu-decay" for c in space["promote_min"])  # promote-min is lfu-decay's knob
    no_lane = dict(candidate_space(k, {}, has_lane=False))
    assert "threads" not in no_lane and "plan" not in no_lane


def test_saved_calibration_fills_only_default_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    cfg = EngineConfig(model=str(model), device="cpu", experts=ExpertConfig(vram_gb=8.0))
    best = Setting(threads=6, cpu_plan="011223344", cache_policy="lru", promote_min=0.0, swap_budget=8)
    path = calibration_path(model, cfg)
    assert path.parent == tmp_path / "calibration"
    save_calibration(path, {"setting": dataclasses.asdict(best)})
    calib = load_calibration(model, cfg)
    assert calib["setting"] == dataclasses.asdict(best)
    # another budget, another file
    other = EngineConfig(model=str(model), device="cpu", experts=ExpertConfig(vram_gb=16.0))
    assert load_calibration(model, other) is None
    # the user's explicit --swap-budget 2 and --cache-policy win; the rest comes from the calibration
    cfg.experts.swap_budget = 2
    changed = apply_calibration(cfg, calib, explicit={"cache_policy"})
    assert changed == {"cpu_threads": (0, 6), "cpu_plan": ("auto", "011223344")}
    assert (cfg.experts.cpu_threads, cfg.experts.cpu_plan, cfg.experts.cache_policy, cfg.experts.swap_budget) == \
        (6, "011223344", "lfu-decay", 2)
    path.write_text("{not json")
    assert load_calibration(model, cfg) is None  # a damaged file is ignored, never fatal


def test_calibrate_the_tiny_model(hf_and_gguf, tmp_path, monkeypatch):
    """A real (short) run: costs measured, candidates decoded, the result saved where load_calibration and
    --cpu-plan auto find it."""
    from strata.bench.calibrate import calibrate
    from strata.engine.loader import load_model
    from strata.experts.costs import cost_model_for
    from strata.experts.plan import CostModel

    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    _, path = hf_and_gguf("qwen3moe")
    # one thread: on a shared 2-core machine a busy neighbour stalls every multi-threaded op of a tiny model
    cfg = EngineConfig(model=str(path), device="cpu", ctx_size=256,
                       experts=ExpertConfig(slots=4, swap_budget=4, cpu_threads=1))
    threads = torch.get_num_threads()
    try:
        lm = load_model(str(path), cfg)
        lines = []
        res = calibrate(lm, str(path), knobs=("pcie_share",), repeats=1, decode_tokens=3, prompt_tokens=8,
                        say=lines.append)
    finally:
        torch.set_num_threads(threads)
    assert res["costs"]["pcie_ms_per_expert"] > 0 and res["costs"]["cpu_ms_per_expert"]
    trials = res["trials"]
    # top-2 routing: a PCIe share of 0.25, 0.5, 0.75 of the misses, each against the setting kept so far
    assert [t["candidate"]["cpu_plan"] for t in trials] == ["011", "001", "000"]
    for t in trials:
        assert len(t["current_ms"]) == len(t["candidate_ms"]) == 1 and t["kept"] == (t["gain"] > 0.03)
    final = 8 if res["start_ms"] else 0
    assert res["decode_runs"] == 1 + len(trials) * 8 + final  # set-up, then A B B A x (warm-up + timed)
    saved = load_calibration(path, cfg)
    assert saved is not None and saved["setting"] == res["setting"]
    assert any(line.startswith("flags: --cpu-threads") for line in lines)
    # the cost model for the kept thread count is where the engine looks for it
    backend = lm.model.experts
    assert CostModel.load(res["cost_model_path"]) == cost_model_for(backend)


def test_calibrating_under_uniform_routing_is_not_saved_as_the_models(tmp_path, monkeypatch, capsys):
    """Settings tuned for random routing would be read back by every later `strata serve` of the model: refused
    unless --no-save, before the model loads."""
    from strata.cli import main

    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    rc = main(["calibrate", "-m", str(tmp_path / "absent.gguf"), "--device", "cpu", "--expert-slots", "2",
               "--expert-routing", "uniform"])
    assert rc != 0
    assert "add --no-save" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
