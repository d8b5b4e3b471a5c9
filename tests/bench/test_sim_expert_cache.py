"""tools/bench_decode.py --dump-routing and tools/sim_expert_cache.py: a routing recorded from a real engine run on
a small tiered model (CPU) replays through the policy, and the replay's hits at the engine's own settings are the
engine's own (the replay is the policy's code on the same observations, in the same order)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _sim():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import sim_expert_cache
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return sim_expert_cache


def test_a_recorded_routing_replays_to_the_engines_hits(tmp_path):
    from tests.experts.tiered_model import write_moe_gguf

    model = write_moe_gguf(tmp_path / "moe.gguf", n_experts=16, k=2, n_layers=3)
    dump = tmp_path / "routing.npz"
    cmd = [sys.executable, str(ROOT / "tools" / "bench_decode.py"), "-m", str(model), "--device", "cpu",
           "--dtype", "float32", "--expert-slots", "6", "--cpu-plan", "000", "--prompt-tokens", "24", "--gen", "24",
           "--runs", "2", "--ctx-size", "128", "--cache-decay", "0.9", "--dump-routing", str(dump)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    sim = _sim()
    d = sim.load(str(dump))
    assert int(d["n_experts"]) == 16 and int(d["k"]) == 2 and list(d["slots"]) == [6, 6, 6]
    assert len(d["layer"]) == len(d["step"]) == len(d["offsets"]) - 1 > 0
    got = sim.replay(d, "lfu-decay", decay=0.9, swap_budget=4)
    assert got["tokens"] > 0 and 0.0 < got["hit"] <= 1.0
    # the engine's measured runs against the replay of every decode step (the warm-up's too): the same policy on
    # the same routing, so the rates are close (the engine's copies land a step later or sooner than the replay's)
    assert got["hit"] == pytest.approx(res["experts_decode"]["hit_rate"], abs=0.08)


def test_the_stand_in_routing_has_the_dump_layout():
    sim = _sim()
    d = sim.stand_in("32,4,2,8,0.8,2")
    assert int(d["n_experts"]) == 32 and int(d["k"]) == 4 and list(d["slots"]) == [8, 8]
    lens = np.diff(d["offsets"])
    assert set(lens.tolist()) == {4, 4 * 1024} and (d["ids"] >= 0).all() and (d["ids"] < 32).all()
    a = sim.replay(d, "lfu-decay", decay=0.95, swap_budget=4)
    b = sim.replay(d, "lfu-decay", decay=0.99, swap_budget=4)
    assert a["tokens"] == b["tokens"] == 2 * 128 and b["swaps_per_token"] < a["swaps_per_token"]
