"""Verify steps of speculative decoding through the static (graph) path: every sequence's T tokens at
device-side positions, attention over a fixed window with a causal mask per query, all T positions' logits. On
the CPU the same static code runs eagerly (what CUDA graphs capture on a GPU); the text equals plain decoding
for greedy and sampled settings, resident and tiered experts, one and several sequences."""

from __future__ import annotations

import random

import pytest
import torch

from strata.config import EngineConfig, ExpertConfig
from strata.engine.engine import Engine, Sequence
from strata.engine.loader import load_model
from strata.engine.sampler import SamplingParams


def _prompt(n_vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, n_vocab, (40,), generator=g).tolist()
    return base + base[5:30] + base[:20] + base  # repeats itself: n-gram drafts are found


def _engine(path, draft_max, graphs, n_slots=1, experts=None, kv=None):
    cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", draft_max=draft_max, cuda_graphs=graphs,
                       draft_source="ngram", experts=experts or ExpertConfig(), **({"kv_dtype": kv} if kv else {}))
    return Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=n_slots)


def _spy(eng) -> list:
    calls, real = [], eng.graphs.step_batch

    def spy(toks, starts, slots, T=1):
        calls.append((len(slots), T))
        return real(toks, starts, slots, T)

    eng.graphs.step_batch = spy
    return calls


@pytest.mark.parametrize("family,kv,experts", [
    ("qwen3moe", None, None), ("deepseek_v3", None, None), ("gpt_oss", None, None), ("glm4moe", None, None), ("qwen3moe", "q8_0", None),
    ("qwen3moe", None, ExpertConfig(mode="tiered", slots=1, cpu_plan="000", decode_misses="direct")),
    ("qwen3moe", None, ExpertConfig(mode="tiered", slots=1, cpu_plan="011"))])
def test_graphed_verify_steps_keep_the_text(hf_and_gguf, family, kv, experts):
    _, path = hf_and_gguf(family)
    prompt = _prompt(1000, seed=1)
    ref = list(_engine(path, 0, False, kv=kv).generate(prompt, SamplingParams(temperature=0), 40))
    eng = _engine(path, 6, True, experts=experts, kv=kv)
    calls = _spy(eng)
    out = list(eng.generate(prompt, SamplingParams(temperature=0), 40))
    assert out == ref
    seq = eng.last
    assert any(T > 1 for _, T in calls), "no verify step went through the static path"
    assert seq.draft_accepted > 0
    if family == "qwen3moe":  # (this prompt also has drafts rejected: the rollback is exercised)
        assert seq.draft_accepted < seq.draft_n, (seq.draft_accepted, seq.draft_n)


def test_graphed_verify_with_several_sequences_and_sampling(hf_and_gguf, monkeypatch):
    """Two sequences verifying at once in one static step (their drafts made equally long here: the engine takes
    the static path only when they are), greedy and sampled: the same text as the eager verify steps with the
    same drafts and seeds, and greedy text as plain decoding."""
    _, path = hf_and_gguf("qwen3moe")
    plain = _engine(path, 0, False)
    eager = _engine(path, 4, False, n_slots=2)
    eng = _engine(path, 4, True, n_slots=2)
    real_draft = Engine._draft

    def padded(self, s):  # n-gram drafts padded with their last token (a wrong guess is simply rejected)
        room = min(4, s.max_tokens - len(s.output) - 1, self.max_ctx - 1 - s.pos)
        d = real_draft(self, s)[:max(room, 0)]
        return d + [(d or s.output)[-1]] * (room - len(d)) if room > 0 else []

    monkeypatch.setattr(Engine, "_draft", padded)
    calls = _spy(eng)
    rng = random.Random(5)

    def run(e, cases):
        outs = []
        for prompts, params, ns in cases:
            seqs = [Sequence(list(p), pr, n, set()) for p, pr, n in zip(prompts, params, ns)]
            for s in seqs:
                e.add(s)
            while not all(s.finished for s in seqs):
                e.step()
            for s in seqs:
                e.release(s)
            outs.append([s.output for s in seqs])
        return outs

    cases = []
    for case in range(4):
        prompts = [_prompt(1000, seed=rng.randrange(50))[: rng.randint(40, 120)] for _ in range(2)]
        params = [SamplingParams(temperature=t, seed=case * 2 + i) for i, t in enumerate(rng.choice(
            [(0, 0), (0.8, 0), (0.8, 0.8)]))]
        cases.append((prompts, params, [rng.randint(8, 30) for _ in range(2)]))
    got = run(eng, cases)
    assert got == run(eager, cases)
    for (prompts, params, ns), outs in zip(cases, got):
        for p, pr, n, o in zip(prompts, params, ns, outs):
            if pr.greedy:
                assert o == list(plain.generate(p, pr, n))
    assert any(b == 2 and T > 1 for b, T in calls), "no step verified both sequences in the static path"


@pytest.mark.gpu
# attention.VERIFY_ROWS_GPU_TESTED: each query by the one-query op; VERIFY_KV_FOLD_GPU_TESTED: the segment's K/V rows
# written by the rotary kernel
@pytest.mark.parametrize("rows,fold", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("experts", [None, ExpertConfig(mode="tiered", slots=1, cpu_plan="000", decode_misses="staged")])
def test_cuda_verify_steps_are_captured_and_keep_the_text(hf_and_gguf, experts, rows, fold, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from strata.kv.cache import KVCache
    from strata.layers import attention

    monkeypatch.setattr(attention, "VERIFY_ROWS_GPU_TESTED", rows)
    monkeypatch.setattr(attention, "VERIFY_KV_FOLD_GPU_TESTED", fold)
    writes, real_write_at = [], KVCache.write_at
    monkeypatch.setattr(KVCache, "write_at", lambda self, *a, **kw: writes.append(1) or real_write_at(self, *a, **kw))
    _, path = hf_and_gguf("qwen3moe")
    prompt = _prompt(1000, seed=1)

    def cuda_engine(draft_max, graphs):
        cfg = EngineConfig(model=str(path), device="cuda", dtype="float32", draft_max=draft_max, cuda_graphs=graphs,
                           draft_source="ngram", experts=experts or ExpertConfig())
        return Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=1)

    ref = list(cuda_engine(0, False).generate(prompt, SamplingParams(temperature=0), 40))
    eng = cuda_engine(6, True)
    writes.clear()
    out = list(eng.generate(prompt, SamplingParams(temperature=0), 40))
    assert out == ref and eng.last.draft_accepted > 0
    assert any(len(key) == 3 and key[2] > 1 for key in eng.graphs.graphs), "no verify step was captured"
    if fold:  # no step wrote its rows by index_copy_: decode and verify steps alike, through the rotary kernel
        assert not writes, len(writes)


def test_a_verify_step_that_cannot_be_captured_runs_eagerly_and_decode_keeps_its_graphs(hf_and_gguf, monkeypatch):
    """A failed capture of a T-token step turns verify graphs off (one warning), not graphs altogether."""
    _, path = hf_and_gguf("qwen3moe")
    prompt = _prompt(1000, seed=1)
    ref = list(_engine(path, 0, False).generate(prompt, SamplingParams(temperature=0), 30))
    eng = _engine(path, 6, True)
    real = eng.graphs.step_batch

    def failing(toks, starts, slots, T=1):
        if T > 1:
            raise RuntimeError("capture failed")
        eng.graphs.cuda = False  # (the static path of this CPU)
        try:
            return real(toks, starts, slots, T)
        finally:
            eng.graphs.cuda = True

    eng.graphs.step_batch = failing
    monkeypatch.setattr(eng.graphs, "cuda", True)  # (the failure path is a CUDA one)
    monkeypatch.setattr(eng.graphs, "captured", lambda *a: False)
    assert list(eng.generate(prompt, SamplingParams(temperature=0), 30)) == ref
    assert eng.graphs is not None and eng.graphs.verify is False and eng.last.draft_steps > 0
