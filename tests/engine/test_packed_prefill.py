"""Prompts that arrive together share one prefill chunk (strata.engine.engine, `_schedule`): the chunk's tokens are
filled from every waiting prompt in arrival order, each sequence's text is what it decodes alone, and a budgeted
model streams each missed expert once for the chunk rather than once per prompt."""

from __future__ import annotations

import pytest
import torch

from strata.config import EngineConfig, ExpertConfig
from strata.engine.engine import Engine, Sequence
from strata.engine.loader import load_model
from strata.engine.sampler import SamplingParams
from tests.experts.tiered_model import write_moe_gguf


def _prompts(lens, seed=5, vocab=96):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _spy(eng: Engine) -> list[list[tuple[int, int]]]:
    """Record every forward's segments as (slot, tokens)."""
    seen = []
    real = eng.model.forward

    def forward(t, p, segs, kv, **kw):
        seen.append([(s.slot, s.n) for s in segs])
        return real(t, p, segs, kv, **kw)

    eng.model.forward = forward
    return seen


def _together(eng: Engine, prompts, n) -> list[list[int]]:
    seqs = [Sequence(list(p), SamplingParams(temperature=0), n, set()) for p in prompts]
    for s in seqs:
        eng.add(s, reuse_prefix=False)
    while eng.running:
        eng.step()
    return [s.output for s in seqs]


@pytest.mark.parametrize("family", ["qwen3moe", "qwen3next"])
def test_prompts_arriving_together_share_chunks_and_decode_as_alone(hf_and_gguf, family):
    _, path = hf_and_gguf(family)
    lm = load_model(str(path), EngineConfig(device="cpu", dtype="float32", cuda_graphs=False))
    prompts = _prompts([21, 34, 9], vocab=lm.args.vocab_size)
    alone = [list(Engine(lm, n_slots=1).generate(p, SamplingParams(temperature=0), 6)) for p in prompts]
    eng = Engine(lm, n_slots=4, prefill_chunk=40)
    seen = _spy(eng)
    assert _together(eng, prompts, 6) == alone
    # chunk 1: all 21 of the first prompt and 19 of the second; chunk 2: the second's last 15, the third's 9, and
    # the first sequence's first decode token
    assert seen[0] == [(0, 21), (1, 19)]
    assert sorted(seen[1]) == [(0, 1), (1, 15), (2, 9)]
    assert all(sum(n for _, n in segs) <= 40 for segs in seen)


def test_a_shared_chunk_streams_missed_experts_once(tmp_path):
    """Tiered experts with a cache too small for a layer's experts: the chunk's misses move each expert once, so
    three prompts prefilled together move fewer expert bytes than the same prompts one after another."""
    path = write_moe_gguf(tmp_path / "moe.gguf", n_experts=16, k=4)
    cfg = EngineConfig(model=str(path), device="cpu", dtype="float32",
                       experts=ExpertConfig(mode="tiered", slots=2, cpu_plan="00000"))
    prompts = _prompts([24, 24, 24])

    def moved(together: bool) -> tuple[int, list]:
        lm = load_model(str(path), cfg, with_tokenizer=False)
        eng = Engine(lm, n_slots=3, prefill_chunk=96)
        before = eng.expert_stats.snapshot()
        if together:
            out = _together(eng, prompts, 1)
        else:
            out = [_together(eng, [p], 1)[0] for p in prompts]
        d = eng.expert_stats.snapshot()
        return (d.cpu_bytes + d.pcie_bytes) - (before.cpu_bytes + before.pcie_bytes), out

    packed, out_packed = moved(True)
    serial, out_serial = moved(False)
    assert out_packed == out_serial
    assert 0 < packed < serial * 0.6, (packed, serial)
