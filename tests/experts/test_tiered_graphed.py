"""The graph-piece decode path of the tiered backend (what CUDA graphs replay) against the all-resident oracle.

On the CPU the pieces run eagerly and every hand-off runs inline, so this checks the path's logic: the split of
each choice into hits / PCIe-staged / CPU lane, the combine, the static buffers reused across layers and
steps, and the statistics.
"""

from __future__ import annotations

import pytest
import torch

from strata.config import EngineConfig, ExpertConfig
from strata.engine.engine import Engine
from strata.engine.loader import load_model
from strata.engine.sampler import SamplingParams
from tests.experts.tiered_model import write_moe_gguf

PROMPT = [5, 17, 3, 88, 41, 41, 9, 60, 2, 33, 71, 14]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_moe_gguf(tmp_path_factory.mktemp("graphed") / "moe.gguf", n_experts=8, k=2)


def _engine(path, graphs: bool, **ex):
    mode = ex.pop("mode", "tiered")
    cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", cuda_graphs=graphs,
                       experts=ExpertConfig(mode=mode, **ex))
    return Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=1)


def _logits(eng: Engine, n: int = 10) -> torch.Tensor:
    """Greedy decode of n tokens after PROMPT, through the engine's decode path; the logits of every step."""
    from strata.kv.cache import Segment

    m, out = eng.model, []
    with torch.inference_mode():
        logits = m.forward(torch.tensor(PROMPT), torch.arange(len(PROMPT)), [Segment(0, 0, len(PROMPT))], eng.kv)
        tok, pos = int(logits[-1].argmax()), len(PROMPT)
        for _ in range(n):
            if eng.graphs is not None:
                logits = eng.graphs.step(tok, pos)
            else:
                logits = m.forward(torch.tensor([tok]), torch.tensor([pos]), [Segment(0, pos, 1)], eng.kv)
            out.append(logits[-1].clone())
            tok, pos = int(logits[-1].argmax()), pos + 1
    return torch.stack(out)


@pytest.fixture(scope="module")
def reference(model_path):
    return _logits(_engine(model_path, False, mode="resident"))


@pytest.mark.parametrize("plan", ["012", "000", "011", "001"])
@pytest.mark.parametrize("slots", [0, 3, 8])
def test_graphed_decode_matches_resident(model_path, reference, plan, slots):
    eng = _engine(model_path, True, slots=slots, cpu_plan=plan)
    assert eng.graphs is not None
    ex = eng.model.experts
    out = _logits(eng)
    assert (out - reference).abs().max().item() <= 1e-5
    # the decode steps went through the graph-piece path: its buffers exist for every MoE layer
    assert len(ex.graphed.bufs) == 3
    s = ex.stats
    assert s.hits + s.cpu + s.pcie == s.lookups
    assert s.tokens == len(PROMPT) + 10 and s.lookups == s.tokens * 3 * 2
    if slots == 0:
        assert s.hits == 0
    if plan == "012":
        assert s.pcie == 0
    if plan == "000":
        assert s.cpu == 0
    if slots == 8:
        assert s.hits > 0 and s.swaps > 0
    if plan == "000" and 0 < slots < 8 and s.swaps:
        # experts admitted in decode had just come up for this step: copied from their staging slot
        assert ex.cache.promoted > 0


@pytest.mark.parametrize("plan", ["000", "011"])
@pytest.mark.parametrize("slots", [0, 3])
def test_prefetch_of_the_next_layer_keeps_logits(model_path, reference, plan, slots):
    """--expert-prefetch: the next MoE layer's router on this layer's input picks experts that are copied into
    the staging ring ahead; the ones the next layer routes to are taken from there (counted as PCIe), the
    logits stay those of the all-resident model."""
    eng = _engine(model_path, True, slots=slots, cpu_plan=plan, prefetch_next=True)
    ex = eng.model.experts
    out = _logits(eng)
    assert (out - reference).abs().max().item() <= 1e-5
    assert ex.next_moe and ex.cache.staging_for(ex.layer_ids[0]) >= 4 * 2  # 4k staging slots
    assert ex.prefetch_issued > 0 and 0 < ex.prefetch_used <= ex.prefetch_issued
    s = ex.stats
    assert s.hits + s.cpu + s.pcie == s.lookups
    if plan == "011":  # a prefetched miss is not the CPU's: with one miss the plan would have sent it there
        assert s.pcie >= ex.prefetch_used


def test_graphed_generation_equals_eager_tiered(model_path):
    ids = list(range(3, 40))
    gen = [list(_engine(model_path, g, slots=3, cpu_plan="011").generate(ids, SamplingParams(temperature=0), 24))
           for g in (False, True)]
    assert gen[0] == gen[1] and len(gen[0]) == 24


def test_cache_fills_through_the_graphed_path(model_path):
    """Admissions decided in the hand-off's bookkeeping reach the map: a repeated prompt hits more."""
    eng = _engine(model_path, True, slots=4, cpu_plan="011")
    ex = eng.model.experts
    rates = []
    for _ in range(3):
        before = ex.stats.snapshot()
        list(eng.generate(PROMPT, SamplingParams(temperature=0), 12))
        rates.append((ex.stats - before).hit_rate)
    assert rates[-1] > rates[0]


def _cuda_engine(path, graphs: bool, **ex):
    mode = ex.pop("mode", "tiered")
    ex.setdefault("decode_misses", "handoff")  # the hand-off path (tests/experts/test_tiered_direct.py: direct)
    cfg = EngineConfig(model=str(path), device="cuda", dtype="float32", cuda_graphs=graphs,
                       experts=ExpertConfig(mode=mode, **ex))
    return Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=1)


@pytest.mark.gpu
def test_cuda_graphed_batch_matches_resident(model_path):
    def cuda(graphs, **ex):
        from strata.engine.engine import Sequence

        mode = ex.pop("mode", "tiered")
        cfg = EngineConfig(model=str(model_path), device="cuda", dtype="float32", cuda_graphs=graphs,
                           experts=ExpertConfig(mode=mode, decode_misses="handoff", **ex))
        eng = Engine(load_model(str(model_path), cfg, with_tokenizer=False), n_slots=len(BATCH))
        seqs = [Sequence(list(p), SamplingParams(temperature=0), 10, set()) for p in BATCH]
        for s in seqs:
            eng.add(s, reuse_prefix=False)
        while any(not s.finished for s in seqs):
            eng.step()
        return [s.output for s in seqs]

    assert cuda(True, slots=2, cpu_plan="011") == cuda(False, mode="resident")


@pytest.mark.gpu
@pytest.mark.parametrize("plan,slots,prefetch", [("012", 0, False), ("000", 0, False), ("011", 3, False),
                                                 ("001", 8, False), ("000", 0, True), ("011", 3, True)])
def test_cuda_graphed_tiered_matches_resident(model_path, plan, slots, prefetch):
    ref = _logits(_cuda_engine(model_path, False, mode="resident"), 40).float().cpu()
    eng = _cuda_engine(model_path, True, slots=slots, cpu_plan=plan, prefetch_next=prefetch)
    out = _logits(eng, 40).float().cpu()  # 12 + 40 tokens: the first window's pieces replayed 39 times
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    assert eng.graphs.graphs, "no graph was captured"
    pieces = next(iter(eng.graphs.graphs.values()))[0]
    assert len(pieces) == 1 + 2 * 3  # two hand-offs per MoE layer
    s = eng.model.experts.stats
    assert s.hits + s.cpu + s.pcie == s.lookups
    if slots == 8:
        assert s.hits > 0
    if prefetch:  # the predicted experts were copied ahead on the urgent stream and some were used
        assert 0 < eng.model.experts.prefetch_used <= eng.model.experts.prefetch_issued


def _concurrent(path, graphs: bool, prompts, n=10, **ex):
    from strata.engine.engine import Sequence

    mode = ex.pop("mode", "tiered")
    cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", cuda_graphs=graphs,
                       experts=ExpertConfig(mode=mode, **ex))
    eng = Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=len(prompts))
    seqs = [Sequence(list(p), SamplingParams(temperature=0), n, set()) for p in prompts]
    for s in seqs:
        eng.add(s, reuse_prefix=False)
    while any(not s.finished for s in seqs):
        eng.step()
    return eng, [s.output for s in seqs]


BATCH = [[(5 * i + 1) % 96 for i in range(n)] for n in (7, 30, 15)]


@pytest.fixture(scope="module")
def batch_reference(model_path):
    return _concurrent(model_path, False, BATCH, mode="resident")[1]


@pytest.mark.parametrize("plan,slots", [("012", 3), ("000", 0), ("011", 2), ("001", 8)])
def test_graphed_batch_of_sequences_matches_resident(model_path, batch_reference, plan, slots):
    """Three sequences decoded in one graphed step: each token's misses split by the plan, an expert streamed
    for one token serves the others, CPU pairs grouped by expert."""
    eng, got = _concurrent(model_path, True, BATCH, slots=slots, cpu_plan=plan)
    assert eng.graph_batch == 3
    assert got == batch_reference
    ex = eng.model.experts
    assert any(n == 3 for _, n in ex.graphed.bufs), "no step decoded three sequences through the graphed path"
    s = ex.stats
    assert s.hits + s.cpu + s.pcie == s.lookups == s.tokens * 3 * 2


@pytest.mark.gpu
@pytest.mark.parametrize("plan,slots", [("011", 3), ("000", 0)])
def test_cuda_drafts_between_graphed_steps_keep_the_text(model_path, plan, slots):
    """Speculative verify steps (eager, several tokens) between replayed single-token steps of the graphed tiered
    path on CUDA: the greedy text equals the all-resident one, and both kinds of step ran."""
    prompt = PROMPT * 3  # repeats itself: drafts are found
    ref = list(_cuda_engine(model_path, False, mode="resident").generate(prompt, SamplingParams(temperature=0), 40))
    cfg = EngineConfig(model=str(model_path), device="cuda", dtype="float32", cuda_graphs=True, draft_max=4,
                       experts=ExpertConfig(mode="tiered", slots=slots, cpu_plan=plan, decode_misses="handoff"))
    eng = Engine(load_model(str(model_path), cfg, with_tokenizer=False), n_slots=1)
    out = list(eng.generate(prompt, SamplingParams(temperature=0), 40))
    assert out == ref
    assert eng.last.draft_steps > 0 and eng.graphs is not None and eng.graphs.graphs
    s = eng.model.experts.stats
    assert s.hits + s.cpu + s.pcie == s.lookups


def test_drafts_between_graph_path_steps_keep_the_text(model_path):
    """The same on the CPU (the graph-piece path runs eagerly): verify steps through the eager tiered path
    between single-token steps through the graph-piece path."""
    prompt = PROMPT * 3
    ref = list(_engine(model_path, False, mode="resident").generate(prompt, SamplingParams(temperature=0), 40))
    eng = _engine(model_path, True, slots=3, cpu_plan="011")
    eng.draft_max = 4
    calls = {"graphed": 0}
    step = eng.graphs.step_batch

    def counted(*a, **k):
        calls["graphed"] += 1
        return step(*a, **k)

    eng.graphs.step_batch = counted
    out = list(eng.generate(prompt, SamplingParams(temperature=0), 40))
    assert out == ref
    assert eng.last.draft_steps > 0 and calls["graphed"] > 0, (eng.last.draft_steps, calls)
