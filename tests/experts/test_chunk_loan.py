"""The prefill chunk buffers lent to the expert cache between prompts (`--chunk-buffer-loan`): they are rows of
the slot pool; decode steps use them as each layer's extra slots, a prompt's chunk borrows them back (their
experts forgotten, the device map rows cleared) and the next decode step gives them back empty. Against the
resident oracle over two prompts (the second borrows rows the first prompt's decode refilled), on both decode
paths; on the CPU the chunk path runs as the GPU's (GROUPED_CHUNKS_ON_CPU)."""

from __future__ import annotations

import pytest
import torch

from strata.engine.sampler import SamplingParams
from tests.experts.test_tiered_direct import _engine
from tests.experts.tiered_model import Q, write_moe_gguf

A = [(7 * i + 3) % 96 for i in range(40)]  # (over 32 tokens: a chunk on a GPU too, k = 2)
B = [(11 * i + 5) % 96 for i in range(36)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_moe_gguf(tmp_path_factory.mktemp("loan") / "moe.gguf", n_experts=8, k=2, expert_type=Q.Q8_0)


def _texts(eng, n=24):
    sp = SamplingParams(temperature=0)
    return [list(eng.generate(p, sp, n)) for p in (A, B)]


@pytest.fixture(scope="module")
def reference(model_path):
    return _texts(_engine(model_path, "cpu", False, mode="resident"))


@pytest.mark.parametrize("misses", ["handoff", "staged"])
def test_lent_buffers_keep_the_text(model_path, reference, monkeypatch, misses):
    import strata.experts.tiered_eager as tiered_eager

    monkeypatch.setattr(tiered_eager, "GROUPED_CHUNKS_ON_CPU", True)
    monkeypatch.setenv("STRATA_CHUNK_STAGE_MIB", "0.05")  # ~8 of these experts a buffer: a few slots a layer
    eng = _engine(model_path, "cpu", True, slots=2, cpu_plan="000", decode_misses=misses, chunk_loan="on")
    ex = eng.model.experts
    sp = SamplingParams(temperature=0)
    a = list(eng.generate(A, sp, 24))
    cache = ex.cache
    assert cache.loan and cache.lent and ex.loans == 1
    assert cache.prefetched > 0, "the prompt's chunk wrote no chunk buffer"
    share = cache.loan_slots[cache.layer_ids[0]]
    assert share > 0 and all(ex.policy.capacity(li) == 2 + share for li in range(len(cache.layer_ids)))
    # the decode refilled lent rows: some expert sits in a slot past the layer's own two
    assert any(s >= 2 for li in range(len(cache.layer_ids)) for s in ex.policy.resident(li).values())
    pool = cache.pool_of[cache.layer_ids[0]]
    buf = next(iter(cache._chunk_stage.values())).bufs[0][0].raw
    assert buf.untyped_storage().data_ptr() == pool.gate.raw.untyped_storage().data_ptr()  # a view of the pool
    b = list(eng.generate(B, sp, 24))
    assert ex.loans == 2 and cache.lent and ex.loan_ms > 0  # (the borrows timed for /props)
    assert [a, b] == reference


def test_off_keeps_the_buffers_apart(model_path):
    eng = _engine(model_path, "cpu", True, slots=2, cpu_plan="000", chunk_loan="off")
    list(eng.generate(A, SamplingParams(temperature=0), 4))
    ex = eng.model.experts
    assert not ex.cache.loan and not any(ex.cache.loan_slots.values()) and ex.policy.capacity(0) == 2


def test_auto_is_off_on_the_cpu(model_path):
    eng = _engine(model_path, "cpu", True, slots=2, cpu_plan="000")
    list(eng.generate(A, SamplingParams(temperature=0), 2))
    assert not eng.model.experts.cache.loan


@pytest.mark.gpu
@pytest.mark.parametrize("misses", ["handoff", "staged"])
def test_cuda_lent_buffers_keep_the_text(model_path, monkeypatch, misses):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setenv("STRATA_CHUNK_STAGE_MIB", "0.05")
    ref = _texts(_engine(model_path, "cuda", True, mode="resident"))
    eng = _engine(model_path, "cuda", True, slots=2, cpu_plan="000", decode_misses=misses, chunk_loan="on")
    assert _texts(eng) == ref
    assert eng.model.experts.loans == 2
