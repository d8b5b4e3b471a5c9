"""Tiered experts on a CPU alone, on the CPU's default path (int8-rounded activations, not the float32 reference):
the logits and greedy tokens equal the resident backend's bit for bit, whatever the cache holds. A missed expert
went through the CPU lane's float32 `ref` while a cached one took the native kernel's int8 activations, so a
temperature-0 text depended on which experts the cache held when (strata.experts.cpu_mirror)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata.config import EngineConfig, ExpertConfig
from strata.engine.loader import load_model
from strata.experts.cpu_lane import CpuLane
from strata.experts.resident import ExpertAct, ExpertWeights, ResidentExperts
from strata.kv.cache import Segment
from strata.quant import random_qtensor
from tests.experts.tiered_model import Q, write_moe_gguf
from tests.ops.native_oracle import native_or_skip

SHORT = [5, 17, 3, 88, 41, 41, 9, 60, 2, 33, 71, 14]  # a decode-sized prompt: the fused kernel's part
LONG = [(37 * i + 11) % 90 + 3 for i in range(70)]  # past it: the per-expert chain, some experts past 64 rows


def _load(path, mode, **ex):
    cfg = EngineConfig(model=str(path), device="cpu", ctx_size=256, experts=ExpertConfig(mode=mode, **ex))
    return load_model(str(path), cfg, with_tokenizer=False)


@torch.inference_mode()
def _greedy(lm, prompt, steps=8):
    """Logits of the prompt's chunk and of `steps` greedy one-token steps [len(prompt) + steps, V], and the tokens."""
    m = lm.model
    kv = m.new_kv_cache(1, 256)
    n = len(prompt)
    out = [m.forward(torch.tensor(prompt), torch.arange(n), [Segment(0, 0, n)], kv, all_logits=True)]
    toks = []
    for i in range(steps):
        toks.append(int(out[-1][-1].argmax()))
        out.append(m.forward(torch.tensor(toks[-1:]), torch.tensor([n + i]), [Segment(0, n + i, 1)], kv,
                             all_logits=True))
    return torch.cat(out), toks


@pytest.fixture(scope="module")
def q8_path(tmp_path_factory):
    return write_moe_gguf(tmp_path_factory.mktemp("cpu_exact") / "moe-q8.gguf", n_experts=8, k=2,
                          expert_type=Q.Q8_0)


@pytest.mark.parametrize("plan", ["012", "011", "000"])
@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["short", "long"])
def test_tiered_equals_resident_bit_for_bit(q8_path, plan, prompt):
    native_or_skip()
    ref, ref_toks = _greedy(_load(q8_path, "resident"), prompt)
    lm = _load(q8_path, "tiered", slots=3, cpu_plan=plan)
    got, toks = _greedy(lm, prompt)
    assert toks == ref_toks
    assert torch.equal(got, ref), (got - ref).abs().max().item()
    s = lm.model.experts.stats
    assert s.hits > 0 and s.cpu + s.pcie > 0  # both a cache and its misses
    if plan != "000":
        assert s.cpu > 0 and set(lm.model.experts.lane.kernel.values()) == {"resident"}


@pytest.mark.parametrize("family", ["qwen3moe_aligned", "gpt_oss_aligned"])
def test_converted_q8_models_tiered_equal_resident(family, hf_and_gguf, tmp_path, monkeypatch):
    """Real families (gpt-oss: biases and the clamped SwiGLU, read from the cache's slots by expert id), the
    default `--cpu-plan auto` (measured here), a prompt then greedy steps."""
    native_or_skip()
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    _, path = hf_and_gguf(family, "q8_0")
    for prompt in (SHORT, LONG):
        ref, ref_toks = _greedy(_load(path, "resident"), prompt)
        lm = _load(path, "tiered", slots=2)
        got, toks = _greedy(lm, prompt)
        assert toks == ref_toks and torch.equal(got, ref), (family, len(prompt), (got - ref).abs().max().item())
        ex = lm.model.experts
        assert ex.stats.cpu > 0 and ex.stats.hits > 0
        assert all(ew._cpu_native is not None for ew in ex.store.layers.values())  # the fused kernel's pairs too


@torch.inference_mode()
def test_a_shared_chunk_of_two_prompts_equals_resident(q8_path):
    """A short prompt beside a long one in one chunk: each sequence's rows take the path they take alone, in the
    tiered backend's slots and lane as in the resident backend (strata.quant.matmul.row_groups)."""
    native_or_skip()

    def chunk(lm):
        m = lm.model
        kv = m.new_kv_cache(2, 256)
        segs = [Segment(0, 0, len(LONG)), Segment(1, 0, 4)]
        return m.forward(torch.tensor(LONG + SHORT[:4]), torch.cat([torch.arange(len(LONG)), torch.arange(4)]), segs,
                         kv, all_logits=True)

    ref = chunk(_load(q8_path, "resident"))
    for plan in ("012", "000"):
        lm = _load(q8_path, "tiered", slots=3, cpu_plan=plan)
        assert torch.equal(chunk(lm), ref), plan


def test_the_lane_gives_the_resident_backends_pairs():
    """CpuLane(host=True) under `auto`: each (token, expert) pair as ResidentExperts computes it, in a decode step
    (the fused kernel), a prompt chunk (the chain) and one token through several experts."""
    native_or_skip()
    rng = np.random.default_rng(0)
    E, D, FF = 6, 64, 64
    act = ExpertAct("swiglu_oai", gate_b=torch.randn(E, FF), up_b=torch.randn(E, FF), down_b=torch.randn(E, D))
    for a in (None, act):
        ew = ExpertWeights(*(random_qtensor(Q.Q8_0, s, rng) for s in ((E, FF, D), (E, FF, D), (E, D, FF))), a)
        lane = CpuLane({0: ew}, kernel="auto", dtype=torch.float32, host=True)
        assert lane.kernel[0] == "resident"
        res = ResidentExperts({0: ew})
        for n in (1, 5, 40):
            x = torch.randn(n, D)
            got = lane.run(0, x, [(e, torch.arange(n)) for e in range(E)])  # every token through every expert
            for e in range(E):
                ids = torch.full((n, 1), e)
                want = res.forward(0, x, ids, torch.ones(n, 1))
                assert torch.equal(got[e * n:(e + 1) * n], want), (a is not None, n, e)
        x = torch.randn(1, D)
        want = torch.cat([res.forward(0, x, torch.tensor([[e]]), torch.ones(1, 1)) for e in (4, 1)])
        assert torch.equal(lane.run_experts(0, x, [4, 1]), want)
        assert CpuLane({0: ew}, kernel="auto", dtype=torch.float32).kernel[0] == "ref"  # a GPU's lane: as it was
