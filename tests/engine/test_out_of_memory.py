"""The device running out within its budget: a prefill chunk is halved and the request goes on (same tokens);
elsewhere one clear error."""

from __future__ import annotations

import pytest
import torch

from strata import StrataError
from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.loader import load_model
from strata.engine.sampler import SamplingParams
from tests.experts.tiered_model import write_moe_gguf

PROMPT = [(7 * i + 3) % 96 for i in range(600)]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    path = write_moe_gguf(tmp_path_factory.mktemp("oom") / "m.gguf")
    return load_model(str(path), EngineConfig(model=str(path), ctx_size=1024), with_tokenizer=False)


def _generate(eng: Engine) -> list[int]:
    return list(eng.generate(PROMPT, SamplingParams(temperature=0), 6))


def test_a_prefill_chunk_out_of_memory_is_halved_and_the_output_unchanged(lm, monkeypatch):
    want = _generate(Engine(lm, n_slots=1, prefill_chunk=1024))
    eng = Engine(lm, n_slots=1, prefill_chunk=1024)
    inner, sizes = lm.model.forward, []

    def forward(t, p, segs, kv, **kw):
        sizes.append(len(t))
        if len(t) > 300:  # the budget holds no chunk past 300 tokens
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return inner(t, p, segs, kv, **kw)

    monkeypatch.setattr(lm.model, "forward", forward)
    assert _generate(eng) == want
    assert eng.prefill_chunk == 256 and sizes[:4] == [600, 512, 256, 256]


def test_out_of_memory_in_decode_is_one_clear_error(lm, monkeypatch):
    eng = Engine(lm, n_slots=1, prefill_chunk=1024)
    inner = lm.model.forward

    def forward(t, p, segs, kv, **kw):
        if len(t) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return inner(t, p, segs, kv, **kw)

    monkeypatch.setattr(lm.model, "forward", forward)
    with pytest.raises(StrataError, match="out of memory on the GPU: lower --ctx-size"):
        _generate(eng)
