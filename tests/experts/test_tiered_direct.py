"""Graphed decode with misses read where they lie (`--decode-misses direct`) against the all-resident oracle.

On the CPU the step runs eagerly and the torch twin reads missed experts from the store, so this checks the
path's logic: every pair from exactly one of the pool or the store, the routing learnt between steps (counts,
admissions, the map), several sequences in one step, verify steps in between. The GPU tests check the same
through replayed graphs (one piece per step: no host hand-off) with the Triton kernel reading pinned host RAM.
"""

from __future__ import annotations

import logging

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata.config import EngineConfig, ExpertConfig
from strata.engine.engine import Engine, Sequence
from strata.engine.loader import load_model
from strata.engine.sampler import SamplingParams
from tests.experts.tiered_model import write_moe_gguf

pytestmark = pytest.mark.exact_cpu  # float oracles: CPU qmatmul stays the float32 reference

PROMPT = [5, 17, 3, 88, 41, 41, 9, 60, 2, 33, 71, 14]
BATCH = [[(5 * i + 1) % 96 for i in range(n)] for n in (7, 30, 15)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    # Q8_0 experts: a format the fused GPU kernel reads (the CPU tests run the torch twin on it)
    return write_moe_gguf(tmp_path_factory.mktemp("direct") / "moe.gguf", n_experts=8, k=2, expert_type=Q.Q8_0)


def _engine(path, device: str, graphs: bool, n_slots: int = 1, **ex):
    mode = ex.pop("mode", "tiered")
    cfg = EngineConfig(model=str(path), device=device, dtype="float32", cuda_graphs=graphs,
                       experts=ExpertConfig(mode=mode, **ex))
    return Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=n_slots)


def _logits(eng: Engine, n: int = 10) -> torch.Tensor:
    """Greedy decode of n tokens after PROMPT through the engine's decode path; the logits of every step."""
    from strata.kv.cache import Segment

    m, out = eng.model, []
    with torch.inference_mode():
        logits = m.forward(torch.tensor(PROMPT, device=m.device), torch.arange(len(PROMPT), device=m.device),
                           [Segment(0, 0, len(PROMPT))], eng.kv)
        tok, pos = int(logits[-1].argmax()), len(PROMPT)
        for _ in range(n):
            logits = eng.graphs.step(tok, pos)
            out.append(logits[-1].float().cpu().clone())
            tok, pos = int(logits[-1].argmax()), pos + 1
    return torch.stack(out)


def _batch(eng: Engine, prompts, n: int = 10):
    seqs = [Sequence(list(p), SamplingParams(temperature=0), n, set()) for p in prompts]
    for s in seqs:
        eng.add(s, reuse_prefix=False)
    while any(not s.finished for s in seqs):
        eng.step()
    return [s.output for s in seqs]


@pytest.fixture(scope="module")
def reference(model_path):
    return _logits(_engine(model_path, "cpu", True, mode="resident"))


@pytest.mark.parametrize("slots", [0, 3, 8])
def test_direct_decode_matches_resident(model_path, reference, slots):
    eng = _engine(model_path, "cpu", True, slots=slots, cpu_plan="000", decode_misses="direct")
    ex = eng.model.experts
    out = _logits(eng)
    assert ex.direct is not None and ex.tuner is None
    assert (out - reference).abs().max().item() <= 1e-5
    assert list(ex.direct.records) == [1] and not ex.graphed.bufs  # the hand-off path never ran
    ex.direct.flush()  # the last step's routing
    s = ex.stats
    assert s.cpu == 0 and s.hits + s.pcie == s.lookups == s.tokens * 3 * 2
    assert s.tokens == len(PROMPT) + 10
    if slots == 0:
        assert s.hits == 0 and s.swaps == 0
    if slots == 8:  # every expert fits: the cache fills between steps and the last steps hit
        assert s.hits > 0 and s.swaps > 0


def test_direct_cache_learns_between_steps(model_path):
    """Admissions decided between steps reach the device map: a repeated prompt hits more, and the bytes read
    over the bus are counted as the PCIe lane's."""
    eng = _engine(model_path, "cpu", True, slots=4, cpu_plan="000", decode_misses="direct")
    ex = eng.model.experts
    rates = []
    for _ in range(3):
        before = ex.stats.snapshot()
        list(eng.generate(PROMPT, SamplingParams(temperature=0), 12))
        ex.direct.flush()
        d = ex.stats - before
        rates.append(d.hit_rate)
        assert d.pcie_bytes == 0 or d.pcie_bytes % ex.expert_bytes[ex.layer_ids[0]] == 0
    assert rates[-1] > rates[0]
    assert ex.policy.expert_map().max() >= 0


@pytest.mark.parametrize("mode", ["direct", "staged"])
@pytest.mark.parametrize("slots", [0, 2, 8])
def test_direct_batch_of_sequences_matches_resident(model_path, slots, mode):
    ref = _batch(_engine(model_path, "cpu", False, n_slots=3, mode="resident"), BATCH)
    eng = _engine(model_path, "cpu", True, n_slots=3, slots=slots, cpu_plan="000", decode_misses=mode)
    assert _batch(eng, BATCH) == ref
    ex = eng.model.experts
    assert 3 in ex.direct.records, "no step decoded three sequences through the direct path"
    ex.direct.flush()
    s = ex.stats
    assert s.hits + s.cpu + s.pcie == s.lookups == s.tokens * 3 * 2


def test_direct_with_drafts_keeps_the_text(model_path):
    """Verify steps (eager, several tokens, the plan's split) between direct single-token steps."""
    prompt = PROMPT * 3
    ref = list(_engine(model_path, "cpu", False, mode="resident").generate(prompt, SamplingParams(temperature=0), 40))
    eng = _engine(model_path, "cpu", True, slots=3, cpu_plan="011", decode_misses="direct")
    eng.draft_max = 4
    assert list(eng.generate(prompt, SamplingParams(temperature=0), 40)) == ref
    assert eng.last.draft_steps > 0 and eng.model.experts.direct.records


def test_handoff_is_the_default(model_path):
    eng = _engine(model_path, "cpu", True, slots=3, cpu_plan="000")
    _logits(eng, 2)
    ex = eng.model.experts
    assert ex.direct is None and ex.graphed.bufs


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["direct", "staged"])
@pytest.mark.parametrize("slots", [0, 3, 8])
@pytest.mark.parametrize("bookkeeping", [False, True])
def test_cuda_direct_decode_is_one_graph_and_matches_resident(model_path, slots, mode, bookkeeping, monkeypatch):
    import strata.ops.host_stage as hs

    monkeypatch.setattr(hs, "BOOKKEEPING_GPU_TESTED", bookkeeping)  # (the cache lookups in one launch, or torch's)
    ref = _logits(_engine(model_path, "cuda", True, mode="resident"), 40)
    # the slot count as given (on a GPU the prefill loan would lend this tiny model slots: hits at 0 slots)
    eng = _engine(model_path, "cuda", True, slots=slots, cpu_plan="000", decode_misses=mode, prefill_loan="off")
    out = _logits(eng, 40)  # 12 + 40 tokens: the first window's graph replayed 39 times
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    ex = eng.model.experts
    assert ex.direct is not None and ex.store.pinned
    pieces = next(iter(eng.graphs.graphs.values()))[0]
    assert len(pieces) == 1, "a direct decode step has no hand-off"
    ex.direct.flush()
    s = ex.stats
    assert s.cpu == 0 and s.hits + s.pcie == s.lookups
    if slots == 0:
        assert s.hits == 0
    if slots == 8:
        assert s.hits > s.pcie and s.swaps > 0


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_cuda_direct_batch_matches_resident(model_path, mode):
    ref = _batch(_engine(model_path, "cuda", False, n_slots=3, mode="resident"), BATCH)
    eng = _engine(model_path, "cuda", True, n_slots=3, slots=2, cpu_plan="000", decode_misses=mode)
    assert _batch(eng, BATCH) == ref
    assert 3 in eng.model.experts.direct.records


@pytest.mark.gpu
def test_cuda_direct_needs_a_pinned_store(model_path, caplog):
    """--low-ram keeps the experts in the mapped file, which the GPU cannot read: one warning, the hand-off."""
    with caplog.at_level(logging.WARNING, logger="strata"):
        eng = _engine(model_path, "cuda", True, slots=3, cpu_plan="000", decode_misses="direct", low_ram=True)
        ref = _logits(_engine(model_path, "cuda", True, mode="resident"), 4)
        out = _logits(eng, 4)
    assert eng.model.experts.direct is None
    assert any("--decode-misses direct" in r.getMessage() for r in caplog.records)
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5


@pytest.mark.parametrize("misses,want", [("staged", "staged"), ("direct", "direct"), ("handoff", "handoff")])
def test_the_backend_says_which_decode_path_it_took(model_path, misses, want):
    """What /props reports as decode_steps.misses (the path a run took is visible without reading its logs)."""
    eng = _engine(model_path, "cpu", True, slots=2, cpu_plan="000", decode_misses=misses)
    list(eng.generate(PROMPT, SamplingParams(temperature=0), 3))
    assert eng.model.experts.decode_misses_path == want


def _leaves_the_handoff(model_path, device: str, monkeypatch, cache_dir, n: int = 24):
    """A backend on the hand-off (as `auto` takes it where the cost model expects the CPU lane to pay) whose plan
    tuner then measures that it does not: the generation that ran the trials ends on the hand-off; once the engine
    is at rest (as before its next request) misses are staged, the graphs captured anew, the text the resident
    oracle's throughout."""
    from strata.experts import tiered
    from strata.experts.plan import CpuPlan
    from strata.experts.tuner import PlanTuner

    verdicts = []

    def verdict(tuner, n_layers, costs):
        verdicts.append(tuner.chosen)
        return False, "all-PCIe was fastest"

    monkeypatch.setattr(tiered, "handoff_after_tuning", verdict)
    monkeypatch.setenv("STRATA_CACHE_DIR", str(cache_dir))
    ref = _logits(_engine(model_path, device, True, mode="resident"), n)
    # set up on the hand-off as `auto` is where the cost model expects the CPU lane to pay (a GPU engine sets its
    # backend up when it is made, with an explicit plan and no cost model: staged unless told otherwise)
    real = tiered.TieredExperts._wants_direct
    monkeypatch.setattr(tiered.TieredExperts, "_wants_direct", lambda self: False)
    eng = _engine(model_path, device, True, slots=3, cpu_plan="011", decode_misses="auto")
    monkeypatch.setattr(tiered.TieredExperts, "_wants_direct", real)
    ex = eng.model.experts
    ex._handoff_chosen = True
    assert ex.decode_misses_path in (None, "handoff")
    ex.tuner = PlanTuner([CpuPlan.parse("011"), CpuPlan.all_pcie(2)], trial=2, rounds=1, warmup=0)
    out = _logits(eng, n)
    assert len(verdicts) == 1 and ex.tuner.done
    assert ex.decode_misses_path == "handoff" and ex.path_epoch == 0  # not inside the generation that tuned
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    ex.at_rest()
    out = _logits(eng, n)
    assert ex.decode_misses_path == "staged" and ex.direct is not None and ex.path_epoch == 1
    assert eng.graphs.epoch == 1
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    return eng


def test_the_engine_takes_the_verdict_before_its_next_request(model_path, monkeypatch, tmp_path):
    """Through Engine.generate: the request that ran the trials keeps the hand-off; the next one, taken while
    nothing decodes, runs staged; both texts the resident one."""
    from strata.experts import tiered
    from strata.experts.plan import CpuPlan
    from strata.experts.tuner import PlanTuner

    monkeypatch.setattr(tiered, "handoff_after_tuning", lambda *a: (False, "all-PCIe was fastest"))
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    sp = SamplingParams(temperature=0)
    ref = list(_engine(model_path, "cpu", True, mode="resident").generate(PROMPT, sp, 24))
    eng = _engine(model_path, "cpu", True, slots=3, cpu_plan="011", decode_misses="auto")
    ex = eng.model.experts
    ex._handoff_chosen = True
    ex.tuner = PlanTuner([CpuPlan.parse("011"), CpuPlan.all_pcie(2)], trial=2, rounds=1, warmup=0)
    assert list(eng.generate(PROMPT, sp, 24)) == ref
    assert ex.tuner.done and ex.decode_misses_path == "handoff"
    assert list(eng.generate(PROMPT, sp, 24)) == ref
    assert ex.decode_misses_path == "staged"


def test_the_tuner_verdict_moves_the_handoff_to_staged(model_path, monkeypatch, tmp_path):
    from strata.experts.costs import load_verdict

    eng = _leaves_the_handoff(model_path, "cpu", monkeypatch, tmp_path)
    ex = eng.model.experts
    assert ex.direct.records  # the last steps went through the direct path's records
    saved = load_verdict(ex)  # kept for the next run on this machine
    assert saved is not None and saved["path"] == "staged" and saved["why"] == "all-PCIe was fastest"
    assert saved["plan"] == str(ex.tuner.chosen)


def test_a_saved_verdict_is_this_machine_and_shape_only(model_path, monkeypatch, tmp_path, caplog):
    from strata.experts.costs import load_verdict, save_verdict

    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    eng = _engine(model_path, "cpu", True, slots=3, cpu_plan="011")
    _logits(eng, 1)
    ex = eng.model.experts
    assert load_verdict(ex) is None
    f = save_verdict(ex, "handoff", "011", "the CPU lane pays")
    assert f is not None and f.parent == tmp_path / "costs"
    v = load_verdict(ex)
    assert v["path"] == "handoff" and v["plan"] == "011"
    ex.lane.set_threads(ex.lane.threads + 1)  # another lane: another shape key
    assert load_verdict(ex) is None
    ex.lane.set_threads(ex.lane.threads - 1)
    f.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="strata"):
        assert load_verdict(ex) is None
    assert any("ignoring the saved plan verdict" in r.getMessage() for r in caplog.records)


def test_a_tuner_verdict_for_the_handoff_keeps_it(model_path, monkeypatch):
    from strata.experts import tiered
    from strata.experts.plan import CpuPlan
    from strata.experts.tuner import PlanTuner

    monkeypatch.setattr(tiered, "handoff_after_tuning", lambda *a: (True, "the CPU lane pays"))
    eng = _engine(model_path, "cpu", True, slots=3, cpu_plan="011", decode_misses="auto")
    ex = eng.model.experts
    ex._handoff_chosen = True
    ex.tuner = PlanTuner([CpuPlan.parse("011"), CpuPlan.all_pcie(2)], trial=2, rounds=1, warmup=0)
    _logits(eng, 16)
    assert ex.tuner.done and ex.decode_misses_path == "handoff" and ex.path_epoch == 0


@pytest.mark.gpu
def test_cuda_tuner_verdict_recaptures_the_step_without_the_handoff(model_path, monkeypatch, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    eng = _leaves_the_handoff(model_path, "cuda", monkeypatch, tmp_path, n=40)
    pieces = next(iter(eng.graphs.graphs.values()))[0]
    assert len(eng.graphs.graphs) == 1 and len(pieces) == 1, "captured anew as one graph: no hand-off"
    # the next run on this machine starts on the staged path from the saved verdict: no trials
    again = _engine(model_path, "cuda", True, slots=3, cpu_plan="auto", decode_misses="auto")
    ex = again.model.experts
    _logits(again, 4)
    assert ex.tuner is None and ex.decode_misses_path == "staged" and "earlier run" in ex.path_reason


@pytest.mark.gpu
def test_cuda_direct_decode_under_the_profiler_keeps_its_graphs(model_path):
    """`--profile` cuts a graphed step at every timed span, between a layer's prefetch fork and the next layer's
    join: each cut joins the forked stream first (CUDA refuses to end a capture with unjoined work; the engine
    then decoded without graphs), and the text is the resident one's."""
    ref = _logits(_engine(model_path, "cuda", True, mode="resident"), 20)
    eng = _engine(model_path, "cuda", True, slots=3, cpu_plan="000", decode_misses="direct", profile=True)
    out = _logits(eng, 20)
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    pieces = next(iter(eng.graphs.graphs.values()))[0]
    assert len(pieces) > 1, "the profiler's cuts"
