"""Speculative decoding with n-gram drafts: the index against brute force, and the engine's output against plain
decoding (the oracle: greedy text identical with and without drafts), for both families, tiered experts,
penalties, several sequences, stop tokens, max_tokens and the context's end."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from strata.config import EngineConfig, ExpertConfig
from strata.engine.engine import Engine, Sequence
from strata.engine.loader import load_model
from strata.engine.sampler import SamplingParams
from strata.engine.spec import NgramDrafter, accept

GREEDY = SamplingParams(temperature=0)


def _brute_draft(toks: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    end = len(toks)
    for n in range(min(n_max, end), n_min - 1, -1):
        suffix = toks[end - n:]
        for at in range(end - 1, n - 1, -1):  # `at`: the position right after an occurrence, latest first
            if toks[at - n:at] == suffix:
                return toks[at:at + k]
    return []


@pytest.mark.parametrize("seed", range(6))
def test_ngram_drafts_match_brute_force(seed):
    rng = random.Random(seed)
    n_min, n_max = rng.choice([(1, 1), (2, 4), (1, 3), (3, 3)])
    d = NgramDrafter(n_min, n_max)
    toks: list[int] = []
    for _ in range(300):
        # a small vocabulary and copied spans: matches of every length occur
        if toks and rng.random() < 0.3:
            a = rng.randrange(len(toks))
            toks += toks[a:a + rng.randint(1, 6)]
        else:
            toks.append(rng.randrange(5))
        d.sync(toks[:3], toks[3:]) if len(toks) > 3 else d.sync(toks, [])
        k = rng.randint(1, 8)
        assert d.draft(k) == _brute_draft(toks, n_min, n_max, k), (toks, k)


def test_drafter_restarts_on_another_context_and_accept():
    d = NgramDrafter(2, 3)
    d.sync([1, 2, 3, 1, 2], [])
    assert d.draft(4) == [3, 1, 2]
    d.sync([7], [])  # shorter than what is indexed: not this context's prefix any more
    assert d.tokens == [7] and d.draft(4) == []
    assert accept([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accept([5, 6], [5, 6, 8]) == 2 and accept([5], [4, 4]) == 0 and accept([], [3]) == 0
    with pytest.raises(ValueError):
        NgramDrafter(3, 2)


def _prompt(n_vocab: int, seed: int = 0) -> list[int]:
    """A prompt that repeats spans of itself (as code being edited does), so drafts are found."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, n_vocab, (40,), generator=g).tolist()
    return base + base[5:30] + base[:20] + base


def _engine(path, draft_max, experts=None, ctx=0, n_slots=1):
    cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", ctx_size=ctx, draft_max=draft_max,
                       experts=experts or ExpertConfig())
    return Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=n_slots)


def _gen(eng, prompt, n, params=GREEDY, stop=None):
    out = list(eng.generate(prompt, params, n, stop))
    return out, eng.last


@pytest.mark.parametrize("family", ["qwen3moe", "deepseek_v3"])
def test_greedy_text_is_the_same_with_drafts(family, hf_and_gguf):
    _, path = hf_and_gguf(family)
    prompt = _prompt(1000, seed=1)  # (seed 0: the random model repeats one token; every draft stands)
    ref, _ = _gen(_engine(path, 0), prompt, 40)
    out, seq = _gen(_engine(path, 6), prompt, 40)
    assert out == ref
    assert seq.draft_steps > 0 and seq.draft_n >= seq.draft_accepted
    # both outcomes happened: drafts accepted, and drafts rejected (so the rollback is exercised)
    assert 0 < seq.draft_accepted < seq.draft_n, (seq.draft_accepted, seq.draft_n)


def test_tiered_experts_with_drafts_equal_plain(hf_and_gguf):
    _, path = hf_and_gguf("qwen3moe")
    prompt = _prompt(1000, seed=1)
    ex = ExpertConfig(mode="tiered", slots=1, cpu_plan="011")  # k = 2: one miss of two to the CPU
    ref, _ = _gen(_engine(path, 0), prompt, 32)
    out, seq = _gen(_engine(path, 8, experts=ex), prompt, 32)
    assert out == ref and seq.draft_n > 0


def test_penalties_and_top_k_1_sampling_with_drafts(hf_and_gguf):
    """The penalty window of each drafted position holds the drafts before it; a sampler that can only draw the
    argmax (top_k 1) goes through the sampled path and must give the greedy text."""
    _, path = hf_and_gguf("qwen3moe")
    prompt = _prompt(1000, seed=2)
    pen = SamplingParams(temperature=0, repetition_penalty=1.3, penalty_last_n=16)
    assert _gen(_engine(path, 5), prompt, 30, pen)[0] == _gen(_engine(path, 0), prompt, 30, pen)[0]
    one = SamplingParams(temperature=0.9, top_k=1, seed=3)
    out, seq = _gen(_engine(path, 5), prompt, 30, one)
    assert out == _gen(_engine(path, 0), prompt, 30, GREEDY)[0] and seq.draft_n > 0


def test_sampled_text_with_drafts_draws_from_the_model(hf_and_gguf):
    """Sampled decoding with drafts: every emitted token is one the model's sampler allows (top_k 3 of the
    position's logits, checked by a plain forward over the emitted text)."""
    _, path = hf_and_gguf("qwen3moe")
    prompt = _prompt(1000, seed=3)
    eng = _engine(path, 6)
    out, seq = _gen(eng, prompt, 40, SamplingParams(temperature=1.5, top_k=3, top_p=1.0, min_p=0.0, seed=7))
    assert len(out) == 40 and seq.draft_steps > 0
    logits = eng.model.forward(torch.tensor(prompt + out), torch.arange(len(prompt) + len(out)),
                               [__import__("strata.kv.cache", fromlist=["Segment"]).Segment(0, 0, len(prompt) + len(out))],
                               eng.model.new_kv_cache(1, 1024), all_logits=True)
    for i, tok in enumerate(out):
        top3 = torch.topk(logits[len(prompt) - 1 + i], 3).indices.tolist()
        assert tok in top3, (i, tok, top3)


def test_stop_token_and_max_tokens_inside_a_draft(hf_and_gguf):
    _, path = hf_and_gguf("qwen3moe")
    prompt = _prompt(1000, seed=4)
    ref, _ = _gen(_engine(path, 0), prompt, 30)
    stop = ref[12]
    first = ref.index(stop)
    out, seq = _gen(_engine(path, 8), prompt, 30, stop={stop})
    assert out == ref[:first + 1] and seq.finish_reason == "stop"
    for n in (1, 2, 7, 13):
        out, seq = _gen(_engine(path, 8), prompt, n)
        assert out == ref[:n] and seq.finish_reason == "length"


def test_drafts_stop_at_the_context_end(hf_and_gguf):
    _, path = hf_and_gguf("qwen3moe")
    prompt = _prompt(1000, seed=5)
    ctx = len(prompt) + 9
    ref = _engine(path, 0, ctx=ctx)
    eng = _engine(path, 8, ctx=ctx)
    seq_r = Sequence(list(prompt), GREEDY, 9)
    seq_d = Sequence(list(prompt), GREEDY, 9)
    for e, s in ((ref, seq_r), (eng, seq_d)):
        e.add(s)
        while not s.finished:
            e.step()
        assert s.pos < ctx
    assert seq_d.output == seq_r.output and seq_d.finish_reason == seq_r.finish_reason == "length"


def test_several_sequences_and_a_prefill_in_one_step(hf_and_gguf):
    """Two generating sequences with drafts and a third one's prompt chunks share steps; each text equals its
    plain solo run."""
    _, path = hf_and_gguf("qwen3moe")
    prompts = [_prompt(1000, seed=s) for s in (6, 7, 8)]
    refs = [_gen(_engine(path, 0), p, 20)[0] for p in prompts]
    eng = _engine(path, 6, n_slots=3)
    eng.prefill_chunk = 32
    seqs = [Sequence(list(p), GREEDY, 20) for p in prompts]
    eng.add(seqs[0])
    eng.add(seqs[1])
    steps = 0
    while not all(s.finished for s in seqs):
        if steps == 3:
            eng.add(seqs[2])  # its prompt is read in chunks while the others decode with drafts
        eng.step()
        steps += 1
    assert [s.output for s in seqs] == refs
    assert sum(s.draft_accepted for s in seqs) > 0


def test_no_drafts_for_a_sequence_with_a_logits_processor(hf_and_gguf):
    _, path = hf_and_gguf("qwen3moe")
    eng = _engine(path, 6)
    seq = Sequence(_prompt(1000, seed=9), GREEDY, 10)
    seq.logits_processor = lambda row: row
    eng.add(seq)
    while not seq.finished:
        eng.step()
    assert seq.draft_n == 0 and len(seq.output) == 10


def test_draft_settings_are_validated():
    from strata import StrataError

    for bad in (dict(draft_max=-1), dict(draft_ngram_min=0), dict(draft_ngram_min=3, draft_ngram_max=2)):
        with pytest.raises(StrataError, match="draft"):
            dataclasses.replace(EngineConfig(device="cpu"), **bad).validate()


def test_draft_length_follows_the_runs_that_stand(hf_and_gguf, monkeypatch):
    """After a rejection the next draft is one past the run that stood; while every draft stands it doubles (up
    to --draft-max). Drafts may come out shorter (the match runs out, max_tokens), never longer. (The rule of an
    engine whose step costs are not timed yet: once they are, the costs choose: tests/engine/test_draft_cost.py.)"""
    import strata.engine.engine as E

    seen = []

    def spy(d, drawn):
        a = accept(d, drawn)
        seen.append((len(d), a))
        return a

    monkeypatch.setattr(E, "accept", spy)
    _, path = hf_and_gguf("deepseek_v3")
    eng = _engine(path, 8)
    eng.draft_cost = None  # (no step costs: the rule alone)
    out, seq = _gen(eng, _prompt(1000, seed=1), 60)
    assert len(seen) == seq.draft_steps > 3
    cap = 8
    for (n, a), (n_next, _) in zip(seen, seen[1:]):
        cap = min(8, max(cap, 2 * n)) if a == n else a + 1
        assert n_next <= cap, seen
    assert any(a < n for n, a in seen) and any(n_next == a + 1 for (n, a), (n_next, _) in zip(seen, seen[1:])
                                               if a < n), seen


def test_drafts_fuzz_against_plain_decoding(hf_and_gguf):
    """Random prompts, draft settings, penalties, stop tokens and lengths, two sequences at a time on one engine
    (slots reused, prefixes shared): every text equals the same sequence decoded alone without drafts."""
    _, path = hf_and_gguf("qwen3moe")
    rng = random.Random(12)
    lm_plain = load_model(str(path), EngineConfig(model=str(path), device="cpu", dtype="float32"),
                          with_tokenizer=False)
    plain = Engine(lm_plain, n_slots=1)
    lm = load_model(str(path), EngineConfig(model=str(path), device="cpu", dtype="float32", draft_max=8),
                    with_tokenizer=False)
    eng = Engine(lm, n_slots=2)
    drafted = accepted = 0
    for case in range(16):
        eng.draft_ngram = rng.choice([(1, 3), (2, 4), (2, 2)])
        seqs, refs = [], []
        for _ in range(2):
            prompt = _prompt(1000, seed=rng.randrange(100))[: rng.randint(30, 130)]
            # sampled ones too: each token's draw is seeded by its position, so drafts never change the text
            params = SamplingParams(temperature=rng.choice([0, 0, 0.8, 1.5]), seed=rng.randrange(1000),
                                    repetition_penalty=rng.choice([1.0, 1.2]), penalty_last_n=rng.choice([0, 8, 64]))
            n = rng.randint(1, 30)
            ref = list(plain.generate(prompt, params, n))
            stop = {ref[rng.randrange(len(ref))]} if rng.random() < 0.5 else set()
            ref = list(plain.generate(prompt, params, n, stop))
            seqs.append(Sequence(list(prompt), params, n, stop))
            seqs[-1].draft_max = rng.choice([None, 1, 3])
            refs.append(ref)
        for s in seqs:
            eng.add(s)
        while not all(s.finished for s in seqs):
            eng.step()
        assert [s.output for s in seqs] == refs, case
        drafted += sum(s.draft_n for s in seqs)
        accepted += sum(s.draft_accepted for s in seqs)
    assert 0 < accepted < drafted, (accepted, drafted)


def test_drafting_pauses_after_drafts_that_all_fail(hf_and_gguf, monkeypatch):
    """Drafts of which none stands pause drafting for 1, 2, 4 ... steps (a verify step costs more than a plain
    one). Rejecting every draft is always correct (the drawn token is the model's), so the text stays the same."""
    import strata.engine.engine as E

    _, path = hf_and_gguf("qwen3moe")
    prompt = _prompt(1000, seed=1)
    ref, _ = _gen(_engine(path, 0), prompt, 60)
    eng = _engine(path, 4)
    steps = []
    orig_step = eng.step

    def counting_step():
        steps.append(0)
        return orig_step()

    verify_at = []

    def reject_all(d, drawn):
        verify_at.append(len(steps))
        return 0

    monkeypatch.setattr(E, "accept", reject_all)
    eng.step = counting_step
    eng.draft_cost = None  # the pauses alone (with step costs measured, drafts that never stand stop sooner)
    out = list(eng.generate(prompt, GREEDY, 60))
    assert out == ref
    gaps = [b - a for a, b in zip(verify_at, verify_at[1:])]
    assert len(gaps) >= 4 and gaps[:4] == [2, 3, 5, 9], verify_at  # a pause of 1, 2, 4, 8 steps between


def test_a_sequences_token_slices_are_its_contexts():
    """Sequence.tokens(a, b) (what the MTP drafter reads each step) equals context()[a:b] across the prompt/output
    boundary, without building the context."""
    from strata.engine.sampler import SamplingParams
    from strata.engine.sequence import Sequence

    s = Sequence([1, 2, 3, 4], SamplingParams(), 10, set())
    s.output = [5, 6, 7]
    ctx = s.context()
    assert all(s.tokens(a, b) == ctx[a:b] for a in range(9) for b in range(a, 10))
