"""A sequence whose own part of a step fails ends alone: the batch it was decoding in goes on."""

from __future__ import annotations

import pytest

from strata.config import EngineConfig, ExpertConfig
from strata.engine.engine import Engine
from strata.engine.loader import load_model
from strata.engine.sampler import SamplingParams
from tests.experts.tiered_model import write_moe_gguf

PROMPT = [5, 17, 3, 88, 41, 41, 9, 60, 2, 33, 71, 14]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_moe_gguf(tmp_path_factory.mktemp("failures") / "moe.gguf", n_experts=8, k=2)


def test_a_failing_sequence_ends_alone(model_path):
    """Its own step work raising (a logits processor) ends that sequence with finish_reason "error"; the other
    sequence of the same steps decodes to its end, and `generate` raises instead of stopping silently."""
    from strata import StrataError
    from strata.engine.engine import Sequence

    cfg = EngineConfig(model=str(model_path), device="cpu", dtype="float32", experts=ExpertConfig(mode="resident"))
    eng = Engine(load_model(str(model_path), cfg, with_tokenizer=False), n_slots=2)
    calls = [0]

    def breaks(row):
        calls[0] += 1
        if calls[0] > 2:
            raise ValueError("broken processor")
        return row

    bad = Sequence(PROMPT, SamplingParams(temperature=0), 10, set(), logits_processor=breaks)
    good = Sequence(PROMPT[::-1], SamplingParams(temperature=0), 10, set())
    eng.add(bad)
    eng.add(good)
    failed = []
    while eng.running:
        eng.step()
        for s in eng.take_failed():
            failed.append(s)
            eng.release(s, "error")
        for s in [s for s in eng.running if s.finished]:
            eng.release(s)
    assert failed == [bad] and bad.finish_reason == "error" and "broken processor" in bad.error
    assert len(bad.output) == 2 and len(good.output) == 10 and good.finish_reason == "length"
    assert sorted(eng.free_slots) == [0, 1]
    calls[0] = 0
    gen = eng.generate(PROMPT, SamplingParams(temperature=0), 10)
    with pytest.raises(StrataError, match="broken processor"):
        for i, _ in enumerate(gen):
            if i == 0:
                eng.last.logits_processor = breaks
