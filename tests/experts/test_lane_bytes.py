"""The bytes each miss lane moved (the CPU lane from RAM, PCIe into staging slots), counted with the lookups in
TieredExperts.count, and their GB/s over a request's decode time."""

from __future__ import annotations

import subprocess
import sys

import pytest

from strata.config import EngineConfig, ExpertConfig
from strata.engine.engine import Engine
from strata.engine.loader import load_model
from strata.engine.sampler import SamplingParams
from strata.experts.stats import ExpertStats
from tests.experts.tiered_model import write_moe_gguf

PROMPT = [5, 17, 3, 88, 41, 41, 9, 60, 2, 33, 71, 14]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_moe_gguf(tmp_path_factory.mktemp("lanes") / "moe.gguf", n_experts=8, k=2)


def _engine(path, graphs: bool, n_slots: int = 1, **ex) -> Engine:
    ex = {"slots": 2, "cpu_plan": "011", **ex}  # one miss to the CPU, a second over PCIe
    cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", cuda_graphs=graphs,
                       experts=ExpertConfig(mode="tiered", **ex))
    return Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=n_slots)


def _expert_bytes(eng: Engine) -> int:
    t = eng.model.experts
    sizes = set(t.expert_bytes.values())
    assert sizes == {t.store.expert_nbytes()}  # every layer's experts the same size in this model
    return sizes.pop()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-pieces"])
def test_decode_bytes_are_the_counts_times_the_expert_bytes(model_path, graphs):
    eng = _engine(model_path, graphs)
    eb = _expert_bytes(eng)
    list(eng.generate(PROMPT, SamplingParams(temperature=0), 12))
    seq = eng.last
    assert (eng.graphs is not None) == graphs  # the graph-piece path ran (no fallback to eager steps)
    d = seq.experts_decode
    assert d is not None and d.cpu > 0 and d.pcie > 0  # both lanes ran during decode
    # one token per step: each routed expert is distinct, so a lane moved one expert per lookup it served
    assert (d.cpu_bytes, d.pcie_bytes) == (d.cpu * eb, d.pcie * eb)
    assert d.tokens == len(seq.output) - 1  # the decode steps after the first token (which the prefill gave)
    s = seq.predicted_ms / 1e3
    g = seq.lane_gbps
    assert g["experts_cpu_gbps"] == pytest.approx(d.cpu_bytes / s / 1e9, abs=1e-4)
    assert g["experts_pcie_gbps"] == pytest.approx(d.pcie_bytes / s / 1e9, abs=1e-4)
    assert g["experts_miss_gbps"] == pytest.approx((d.cpu_bytes + d.pcie_bytes) / s / 1e9, abs=1e-4)
    # the prefill chunk: an expert serving several of the chunk's tokens was read or copied once for them
    total = eng.model.experts.stats
    pre = total - d
    assert pre.cpu_bytes % eb == 0 and pre.pcie_bytes % eb == 0
    assert pre.cpu_bytes + pre.pcie_bytes < (pre.cpu + pre.pcie) * eb
    assert total.cpu_bytes > 0 and total.pcie_bytes > 0


def test_batched_decode_moves_a_shared_expert_once(model_path):
    """Two sequences decoding in one step: an expert both route to is counted once per layer call."""
    eng = _engine(model_path, False, n_slots=2, slots=0, cpu_plan="012")
    eb = _expert_bytes(eng)
    from strata.engine.engine import Sequence
    from strata.engine.request import Request

    a = Sequence.of(Request(PROMPT, SamplingParams(temperature=0), 10, set()))
    b = Sequence.of(Request(PROMPT[::-1], SamplingParams(temperature=0), 10, set()))
    eng.add(a)
    eng.add(b)
    while not (a.finished and b.finished):
        eng.step()
    for s in (a, b):
        d = s.experts_decode
        assert d.cpu_bytes % eb == 0 and d.cpu_bytes <= d.cpu * eb and d.pcie == 0  # no slots: all on the CPU
    # both prompts hold the same tokens, and with no slots every routed expert is a miss: some are shared
    assert any(s.experts_decode.cpu_bytes < s.experts_decode.cpu * eb for s in (a, b))


def test_stats_carry_bytes_through_merge_and_difference():
    s = ExpertStats()
    s.add(hits=1, cpu=2, pcie=1, tokens=1, layers=1, cpu_bytes=200, pcie_bytes=100)
    t = s.snapshot()
    s.add_layer(0, 1, 1, 1, 100, 100)
    assert (s - t).cpu_bytes == 100 and (s - t).pcie_bytes == 100
    assert (s + t).as_dict()["cpu_bytes"] == 500
    with pytest.raises(ValueError, match=">= 0"):
        s.add(cpu=1, cpu_bytes=-1)
    assert s.lane_gbps(0.0) == {"experts_cpu_gbps": 0.0, "experts_pcie_gbps": 0.0, "experts_miss_gbps": 0.0}
    big = ExpertStats(cpu_bytes=3 * 10**9, pcie_bytes=10**9)
    assert big.lane_gbps(2.0) == {"experts_cpu_gbps": 1.5, "experts_pcie_gbps": 0.5, "experts_miss_gbps": 2.0}
    assert "CPU 1.50 GB/s" in big.lane_summary(2.0) and "together 2.00 GB/s" in big.lane_summary(2.0)


def test_a_miss_without_its_layer_is_refused(model_path):
    t = _engine(model_path, False).model.experts
    with pytest.raises(ValueError, match="layer"):
        t.count(0, 1, 0, 1)


def test_generate_prints_the_split_and_the_lanes_gbps(hf_and_gguf):
    from strata.experts.sizing import staging_slots
    from strata.hub.check import model_footprint

    _, path = hf_and_gguf("qwen3moe")
    fp = model_footprint([path])
    # no reserve: the staging ring and one slot in every layer (on a CPU the budget sizes the pool as on a GPU)
    budget = staging_slots(fp.n_expert_used) * fp.slot_bytes + fp.expert_bytes // fp.n_expert + 1000
    cmd = [sys.executable, "-m", "strata", "generate", "-m", str(path), "--device", "cpu", "-p", "def hello():",
           "-n", "8", "--temperature", "0", "--experts", "tiered", "--vram-gb", repr(budget / (1 << 30)),
           "--vram-reserve-mib", "0", "--cpu-plan", "011"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    split = next(x for x in r.stderr.splitlines() if x.startswith("strata: VRAM "))
    assert f"expert cache: 1 of {fp.n_expert} slots per layer" in split and "staging ring" in split
    line = next(x for x in r.stderr.splitlines() if "miss lanes" in x)
    assert "GB/s" in line and "CPU" in line and "PCIe" in line and "together" in line
