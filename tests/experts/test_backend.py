"""The declared seams, used the way a third party would: a cache policy written only against `CachePolicy` runs in
every tiered path (chunked prefill, eager decode, graphed decode), and an experts backend written only against
`ExpertsBackend` runs through the engine (eager steps and graph-piece steps), both matching the resident oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata.config import EngineConfig, ExpertConfig
from strata.engine.engine import Engine
from strata.engine.loader import load_model
from strata.engine.sampler import SamplingParams
from strata.experts.backend import ExpertsBackend, StepContext
from strata.experts.policy import CachePolicy, Swap
from strata.experts.resident import combine, expert_ffn
from strata.experts.tiered import TieredExperts
from tests.experts.tiered_model import write_moe_gguf

PROMPT = [5, 17, 3, 88, 41, 41, 9, 60, 2, 33, 71, 14]


class FifoPolicy:
    """First in, first out: a routed miss takes an empty slot, else the slot filled longest ago (one swap per
    layer and step). Plain lists; knows nothing of strata's own policies."""

    def __init__(self, n_layers: int, n_experts: int, slots):
        self.n_layers, self.n_experts, self.steps = n_layers, n_experts, 0
        caps = [slots] * n_layers if np.isscalar(slots) else list(slots)
        self._caps = [int(c) for c in caps]
        self._slots = [[-1] * c for c in self._caps]  # expert in each slot
        self._ready = [[False] * c for c in self._caps]
        self._order = [[] for _ in range(n_layers)]  # slots in fill order
        self._hit = [[-1] * n_experts for _ in range(n_layers)]
        self._map = np.full((n_layers, n_experts), -1, dtype=np.int32)
        self._seen: list[list[int]] = [[] for _ in range(n_layers)]
        self._uses = np.zeros((n_layers, n_experts), dtype=np.int64)
        self._keys = [[0.0] * n_experts for _ in range(n_layers)]

    def capacity(self, layer):
        return self._caps[layer]

    def tick(self):
        self.steps += 1

    def observe(self, layer, expert_ids):
        ids = [int(e) for e in np.asarray(expert_ids).reshape(-1)]
        for e in ids:
            self._uses[layer, e] += 1
            self._keys[layer][e] = float(self.steps)
        self._seen[layer] = ids

    def plan_swaps(self, layer):
        seen, self._seen[layer] = self._seen[layer], []
        slots = self._slots[layer]
        miss = [e for e in dict.fromkeys(seen) if e not in slots]
        if not miss or not slots:
            return []
        e = miss[0]
        if -1 in slots:
            return [Swap(None, e, slots.index(-1))]
        ready = [s for s in self._order[layer] if self._ready[layer][s]]
        return [Swap(slots[ready[0]], e, ready[0])] if ready else []

    def commit(self, layer, swaps):
        for sw in swaps:
            if sw.evict is not None:
                self._set(layer, sw.evict, -1)
                self._order[layer].remove(sw.slot)
            self._slots[layer][sw.slot] = sw.admit
            self._ready[layer][sw.slot] = False
            self._order[layer].append(sw.slot)

    def mark_ready(self, layer, expert):
        s = self._slots[layer].index(expert)
        self._ready[layer][s] = True
        self._set(layer, expert, s)

    def abort(self, layer, expert):
        s = self._slots[layer].index(expert)
        self._slots[layer][s] = -1
        self._order[layer].remove(s)

    def _set(self, layer, expert, slot):
        self._hit[layer][expert] = slot
        self._map[layer, expert] = slot

    def resident(self, layer):
        return {e: s for s, e in enumerate(self._slots[layer]) if e >= 0 and self._ready[layer][s]}

    def pending(self, layer):
        return {e: s for s, e in enumerate(self._slots[layer]) if e >= 0 and not self._ready[layer][s]}

    def is_hit(self, layer, expert):
        return self._hit[layer][expert] >= 0

    def slot_of(self, layer, expert):
        return self._hit[layer][expert]

    def expert_map(self):
        return self._map

    def scores(self, layer):
        return np.array(self._keys[layer])

    def rank_keys(self, layer):
        return self._keys[layer]

    def hit_row(self, layer):
        return self._hit[layer]

    def usage(self):
        return self._uses.copy()

    def initial_fill(self, ranking, frequency=None):
        raise NotImplementedError("not needed without a routing profile")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_moe_gguf(tmp_path_factory.mktemp("backend") / "moe.gguf", n_experts=8, k=2)


def _cfg(path, graphs=False, **ex):
    return EngineConfig(model=str(path), device="cpu", dtype="float32", cuda_graphs=graphs,
                        experts=ExpertConfig(**ex))


def _greedy(lm, graphs_n: int = 8) -> list[int]:
    eng = Engine(lm, n_slots=1)
    return list(eng.generate(PROMPT, SamplingParams(temperature=0.0), max_tokens=graphs_n))


@pytest.fixture(scope="module")
def reference(model_path):
    return _greedy(load_model(str(model_path), _cfg(model_path, mode="resident"), with_tokenizer=False))


def test_fifo_policy_satisfies_the_protocol():
    assert isinstance(FifoPolicy(2, 8, 3), CachePolicy)


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("plan", ["000", "012", "011"])
def test_third_party_policy_runs_every_tiered_path(model_path, reference, monkeypatch, graphs, plan):
    """Eager decode and chunked prefill (the GPU's grouped chunk path, run on the CPU), or graph-piece decode."""
    import strata.experts.tiered_eager as tiered

    monkeypatch.setattr(tiered, "GROUPED_CHUNKS_ON_CPU", True)
    made = []

    def factory(layers):
        be = TieredExperts(layers, cfg, progress=False, policy=lambda L, E, s: made.append(FifoPolicy(L, E, s))
                           or made[-1])
        return be

    cfg = _cfg(model_path, graphs, mode="tiered", slots=3, cpu_plan=plan)
    lm = load_model(str(model_path), cfg, with_tokenizer=False, experts=factory)
    assert _greedy(lm) == reference
    ex = lm.model.experts
    assert made and ex.policy is made[0]
    s = ex.stats
    assert s.hits + s.cpu + s.pcie == s.lookups and s.hits > 0 and s.swaps > 0
    assert (len(ex.graphed.bufs) > 0) == graphs  # the graph-piece path ran exactly when graphs were on


class CountingBackend:
    """Every expert computed on the CPU from the stored weights, per (token, choice) pair; counts the steps and
    phases it was told about. Written against ExpertsBackend only."""

    sizes_cache = False
    profiler = None
    stats = None

    def __init__(self, layers):
        self.layers = layers
        self.steps: list[tuple[str, int, bool]] = []  # (phase, tokens, graphed)
        self.calls = 0

    def setup(self, k, act_bytes=0):
        pass

    def max_graph_batch(self, k):
        return 1

    def set_routers(self, moes):
        self.moes = moes

    def begin_step(self, ctx: StepContext):
        self.steps.append((ctx.phase, ctx.n_tokens, ctx.graphed))

    def launched(self):
        self.launches = getattr(self, "launches", 0) + 1

    def cache_view(self):
        return None

    def forward(self, layer, x, ids, w, ctx):
        self.calls += 1
        ew = self.layers[layer]
        n, k = ids.shape
        y = torch.zeros(n, k, x.shape[-1], dtype=torch.float32)
        for t in range(n):
            for j in range(k):
                e = int(ids[t, j])
                y[t, j] = expert_ffn(x[t:t + 1], ew.gate[e], ew.up[e], ew.down[e]).float()[0]
        return combine(y, w, x.dtype)

    def at_rest(self):
        pass

    def begin_request(self):
        return None

    def profile_report(self, measured_ms=None):
        return ""

    def tuning(self):
        return False

    def end_tuning(self):
        return ""

    def close(self):
        pass


@pytest.mark.parametrize("graphs", [False, True])
def test_minimal_backend_runs_through_the_engine(model_path, reference, graphs):
    made = []
    cfg = _cfg(model_path, graphs, mode="resident")
    lm = load_model(str(model_path), cfg, with_tokenizer=False,
                    experts=lambda layers: made.append(CountingBackend(layers)) or made[-1])
    be = lm.model.experts
    assert isinstance(be, ExpertsBackend) and be is made[0]
    assert sorted(be.moes) == [0, 1, 2]
    assert _greedy(lm) == reference
    # one begin per step: the prompt as one prefill chunk, then one decode step per further token
    assert be.steps[0] == ("prefill", len(PROMPT), False)
    assert be.steps[1:] == [("decode", 1, graphs)] * (len(reference) - 1)
    assert be.calls == 3 * len(be.steps)


def test_step_context_phase_and_bad_phase():
    from strata.kv.cache import Segment

    assert StepContext.for_segments([Segment(0, 0, 5)], 5).phase == "prefill"
    assert StepContext.for_segments([Segment(0, 5, 1), Segment(1, 3, 1)], 2).phase == "decode"
    assert StepContext.for_segments([Segment(0, 0, 5), Segment(1, 3, 1)], 6).phase == "mixed"
    with pytest.raises(ValueError, match="phase"):
        StepContext(n_tokens=1, phase="warmup")
