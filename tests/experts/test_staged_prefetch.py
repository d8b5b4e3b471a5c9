"""--expert-prefetch on the staged decode path: at each MoE layer of a one-token step the next MoE layer's router
predicts its experts from this layer's input, and its predicted misses are staged ahead (a side stream on a GPU)
into a prefetch region of the staging ring; the next layer reads them from there. Checked against the resident
oracle (the prediction may be wrong: every pair must still come from exactly one right place), with the counts
of what was prefetched and used. On the CPU the same code runs eagerly with the torch twin of the copy."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata.engine.sampler import SamplingParams
from tests.experts.test_tiered_direct import BATCH, PROMPT, _batch, _engine, _logits
from tests.experts.tiered_model import write_moe_gguf

pytestmark = pytest.mark.exact_cpu  # float oracles: CPU qmatmul stays the float32 reference


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    # four MoE layers: predictions for layers 1..3 (odd and even prefetch regions both used)
    return write_moe_gguf(tmp_path_factory.mktemp("prefetch") / "moe.gguf", n_experts=8, k=2, n_layers=4,
                          expert_type=Q.Q8_0)


@pytest.mark.parametrize("slots", [0, 3])
def test_prefetched_misses_give_the_resident_logits(model_path, slots):
    ref = _logits(_engine(model_path, "cpu", True, mode="resident"), 16)
    eng = _engine(model_path, "cpu", True, slots=slots, cpu_plan="000", decode_misses="staged",
                  prefetch_next=True)
    out = _logits(eng, 16)
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    ex = eng.model.experts
    ex.direct.flush()
    assert ex.direct.prefetch and ex.prefetch_issued > 0
    assert 0 <= ex.prefetch_used <= ex.prefetch_issued
    if slots == 0:  # nothing is cached: every predicted expert is staged, 16 steps x 3 layers x k
        assert ex.prefetch_issued == 16 * 3 * 2


def test_a_wrong_prediction_is_harmless(model_path, monkeypatch):
    """Predictions unrelated to the routing (always the last two experts): the layer's own misses are staged as
    without prefetch, and the prefetched experts are used only where the routing happened to pick them."""
    from strata.layers.moe import MoE

    ref = _logits(_engine(model_path, "cpu", True, mode="resident"), 8)
    real = MoE.route_ids

    def wrong(self, x):
        ids = real(self, x)
        return torch.tensor([[6, 7]], device=ids.device).expand_as(ids).contiguous()

    monkeypatch.setattr(MoE, "route_ids", wrong)
    eng = _engine(model_path, "cpu", True, slots=0, cpu_plan="000", decode_misses="staged", prefetch_next=True)
    out = _logits(eng, 8)
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    ex = eng.model.experts
    ex.direct.flush()
    assert ex.prefetch_issued == 8 * 3 * 2 and ex.prefetch_used < ex.prefetch_issued // 2


@pytest.mark.parametrize("flag,min_use,stays_on", [(None, 0.9, False), (None, 0.0, True), (True, 0.9, True)])
def test_a_prefetch_that_does_not_predict_turns_itself_off(model_path, monkeypatch, flag, min_use, stays_on):
    """By default the prefetch is measured: predictions that the layers seldom use (here always the last two
    experts, and a required share of 90%) turn it off once PREFETCH_PROBE prefetched experts are settled, from
    the next request on (the decode path's epoch moves: graphs are captured again). --expert-prefetch keeps it
    on; the text is the resident one throughout."""
    from strata.experts import tiered_direct
    from strata.layers.moe import MoE

    monkeypatch.setattr(tiered_direct, "PREFETCH_PROBE", 24)
    monkeypatch.setattr(tiered_direct, "PREFETCH_MIN_USE", min_use)
    real = MoE.route_ids

    def wrong(self, x):
        ids = real(self, x)
        return torch.tensor([[6, 7]], device=ids.device).expand_as(ids).contiguous()

    monkeypatch.setattr(MoE, "route_ids", wrong)
    sp = SamplingParams(temperature=0)
    want = list(_engine(model_path, "cpu", False, mode="resident").generate(PROMPT, sp, 20))
    eng = _engine(model_path, "cpu", True, slots=0, cpu_plan="000", decode_misses="staged", prefetch_next=flag)
    ex = eng.model.experts
    assert list(eng.generate(PROMPT, sp, 20)) == want
    d, epoch = ex.direct, ex.path_epoch
    d.flush()                                                          # (the last step's counts)
    assert d.prefetch and ex.prefetch_used < ex.prefetch_issued       # the verdict waits for a rest
    assert (d.off_reason is None) == stays_on
    issued = ex.prefetch_issued
    assert list(eng.generate(PROMPT, sp, 20)) == want                 # the next request
    d.flush()
    if stays_on:
        assert d.prefetch and ex.path_epoch == epoch and ex.prefetch_issued > issued
    else:
        assert "prefetched experts were used" in d.off_reason
        assert not d.prefetch and ex.path_epoch == epoch + 1 and ex.prefetch_issued == issued


@pytest.mark.parametrize("flag", [None, True])
def test_batches_and_text_unchanged(model_path, flag):
    """Steps of several sequences prefetch (the first k of their predicted misses) only when --expert-prefetch is
    given (by default one-token steps do); the text is the resident one either way."""
    ref = _batch(_engine(model_path, "cpu", False, n_slots=3, mode="resident"), BATCH)
    eng = _engine(model_path, "cpu", True, n_slots=3, slots=2, cpu_plan="000", decode_misses="staged",
                  prefetch_next=flag)
    assert _batch(eng, BATCH) == ref
    ex = eng.model.experts
    ex.direct.flush()
    assert ex.direct.prefetch and ex.direct.prefetch_batches == bool(flag)
    if flag:  # three sequences decode together throughout (their prompts were read in one chunk)
        assert ex.prefetch_issued > 0 and ex.prefetch_used <= ex.prefetch_issued
    else:
        assert ex.prefetch_issued == 0
    one = _engine(model_path, "cpu", True, slots=2, cpu_plan="000", decode_misses="staged", prefetch_next=flag)
    plain = _engine(model_path, "cpu", False, mode="resident")
    sp = SamplingParams(temperature=0)
    assert list(one.generate(PROMPT, sp, 20)) == list(plain.generate(PROMPT, sp, 20))


@pytest.mark.gpu
@pytest.mark.parametrize("slots,programs", [(0, 16), (3, 16), (3, 0), (0, 1)])
@pytest.mark.parametrize("bookkeeping", [False, True])
def test_cuda_prefetch_is_one_graph_and_matches_resident(model_path, slots, programs, bookkeeping, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import strata.ops.host_stage as hs

    monkeypatch.setattr(hs, "BOOKKEEPING_GPU_TESTED", bookkeeping)  # (lookups and the prefetch's map in one launch)
    ref = _logits(_engine(model_path, "cuda", True, mode="resident"), 40)
    # the slot count as given: on a GPU the prefill loan would lend this tiny model enough slots for every expert
    # (nothing missed, nothing to prefetch)
    eng = _engine(model_path, "cuda", True, slots=slots, cpu_plan="000", decode_misses="staged",
                  prefetch_next=True, prefetch_programs=programs, prefill_loan="off")
    out = _logits(eng, 40)
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    pieces = next(iter(eng.graphs.graphs.values()))[0]
    assert len(pieces) == 1, "the prefetch's side stream joins inside the one graph"
    ex = eng.model.experts
    ex.direct.flush()
    assert ex.direct.side is not None and ex.prefetch_issued > 0


@pytest.mark.gpu
def test_cuda_batch_prefetch_matches_resident(model_path):
    """Three sequences decoding together in graphed steps, their predicted misses prefetched (--expert-prefetch
    given): the resident text."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ref = _batch(_engine(model_path, "cuda", False, n_slots=3, mode="resident"), BATCH, 24)
    eng = _engine(model_path, "cuda", True, n_slots=3, slots=2, cpu_plan="000", decode_misses="staged",
                  prefetch_next=True)
    assert _batch(eng, BATCH, 24) == ref
    ex = eng.model.experts
    ex.direct.flush()
    assert ex.direct.prefetch_batches and ex.prefetch_issued > 0


def test_a_negative_program_count_is_refused():
    from strata import StrataError
    from strata.config import ExpertConfig

    with pytest.raises(StrataError, match="--expert-prefetch-programs must be >= 0"):
        ExpertConfig(prefetch_programs=-1).validate()
