"""Decode steps launched one ahead (strata.engine.ahead): the same text as steps launched one at a time, for
greedy and seeded sampling, stop tokens, max_tokens, staggered sequences on several slots, an abort while a step
is in flight, and prefix reuse after a sequence that dropped its ahead token. On the CPU the static (graph) path
runs eagerly, so every launch and drop happens as on a GPU, without the overlap."""

from __future__ import annotations

import pytest
import torch

from strata.config import EngineConfig
from strata.engine.engine import Engine, Sequence
from strata.engine.loader import load_model
from strata.engine.sampler import SamplingParams


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1001, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def models(hf_and_gguf):
    _, path = hf_and_gguf("qwen3moe")

    def lm(ahead: bool):
        cfg = EngineConfig(device="cpu", dtype="float32", cuda_graphs=True, decode_ahead=ahead)
        return load_model(str(path), cfg, with_tokenizer=False)

    return lm(True), lm(False)


def test_one_sequence_gives_the_same_text(models):
    on, off = models
    for sp in (SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=11, top_k=0, top_p=1.0, min_p=0),
               SamplingParams(temperature=0.7, seed=5)):
        a, b = Engine(on, n_slots=1), Engine(off, n_slots=1)
        assert a.ahead is not None and b.ahead is None
        got = list(a.generate(_prompt(20, 1), sp, 24))
        assert got == list(b.generate(_prompt(20, 1), sp, 24)) and len(got) == 24
        assert a.ahead.launched >= 20  # every step after the first was launched ahead (but the last)


def test_stop_token_and_reuse_of_the_slot(models):
    on, off = models
    prompt = _prompt(16, 2)
    ref = list(Engine(off, n_slots=1).generate(prompt, SamplingParams(temperature=0), 30))
    stop = ref[9]
    a, b = Engine(on, n_slots=1), Engine(off, n_slots=1)
    got = list(a.generate(prompt, SamplingParams(temperature=0), 30, {stop}))
    assert got == list(b.generate(prompt, SamplingParams(temperature=0), 30, {stop})) == ref[:ref.index(stop) + 1]
    assert a.slot_tokens == b.slot_tokens  # the dropped ahead token is not in the slot's record
    # the next request shares the whole conversation: its prefix comes from the slot, and the text is unchanged
    follow = prompt + got + _prompt(5, 3)
    assert list(a.generate(follow, SamplingParams(temperature=0), 12)) == \
        list(b.generate(follow, SamplingParams(temperature=0), 12))
    assert a.last.cached == b.last.cached > len(prompt)
    assert a.ahead.dropped >= 1


def test_staggered_sequences_and_an_abort(models):
    on, off = models
    prompts = [_prompt(10 + 7 * i, 10 + i) for i in range(5)]
    lens = [18, 7, 25, 12, 9]

    def run(lm):
        eng = Engine(lm, n_slots=3)
        waiting = [Sequence(list(p), SamplingParams(temperature=0), n, set()) for p, n in zip(prompts, lens)]
        running, done, step = [], [], 0
        while waiting or running:
            if waiting and eng.free_slots and step % 4 == 0:
                s = waiting.pop(0)
                eng.add(s, reuse_prefix=True)
                running.append(s)
            eng.step()
            if step == 9 and running:  # a client goes away mid-generation (a step may be in flight)
                gone = running[0]
                eng.release(gone, "abort")
            for s in [s for s in running if s.finished]:
                eng.release(s)
                running.remove(s)
                done.append(s)
            step += 1
        return eng, {tuple(s.prompt): (s.output, s.finish_reason) for s in done}

    ea, got = run(on)
    _, want = run(off)
    assert got == want
    assert ea.ahead.launched > 10


def test_not_taken_when_the_host_needs_the_token(models):
    """Penalties read the tokens so far; log-probabilities are read per step: those sequences step one by one."""
    on, off = models
    sp = SamplingParams(temperature=0, repetition_penalty=1.3)
    a = Engine(on, n_slots=1)
    assert list(a.generate(_prompt(12, 4), sp, 15)) == list(Engine(off, n_slots=1).generate(_prompt(12, 4), sp, 15))
    assert a.ahead.launched == 0
    assert not EngineConfig(decode_ahead=False).decode_ahead


def test_not_taken_while_a_plan_is_tuned(hf_and_gguf):
    """The plan tuner fits each decode step's time to its misses: while it runs, steps go one at a time."""
    from strata.config import ExpertConfig

    _, path = hf_and_gguf("qwen3moe")
    cfg = EngineConfig(device="cpu", dtype="float32", cuda_graphs=True,
                       experts=ExpertConfig(mode="tiered", slots=2, cpu_plan="011"))
    eng = Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=1)
    tuning = [True]
    eng.model.experts.tuning = lambda: tuning[0]
    list(eng.generate(_prompt(10, 9), SamplingParams(temperature=0), 12))
    assert eng.ahead is not None and eng.ahead.launched == 0
    tuning[0] = False
    list(eng.generate(_prompt(10, 9), SamplingParams(temperature=0), 12))
    assert eng.ahead.launched > 5


@pytest.mark.gpu
@pytest.mark.parametrize("experts", [None, dict(mode="tiered", slots=1, cpu_plan="000", decode_misses="staged")])
def test_cuda_steps_launched_ahead_keep_the_text(hf_and_gguf, experts):
    """On the GPU (graphs captured; under tiered experts the embedding table in pinned host RAM, read by the
    graph): greedy and seeded text equal the steps launched one by one, for one and for three sequences."""
    from strata.config import ExpertConfig

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _, path = hf_and_gguf("qwen3moe")

    def eng(ahead: bool, n: int) -> Engine:
        cfg = EngineConfig(device="cuda", dtype="float32", decode_ahead=ahead, host_embed=experts is not None,
                           experts=ExpertConfig(**(experts or {})))
        return Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=n)

    for sp in (SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=3)):
        a = eng(True, 1)
        assert a.ahead is not None and a.graphs.host_rows == (experts is not None)
        assert list(a.generate(_prompt(30, 7), sp, 40)) == list(eng(False, 1).generate(_prompt(30, 7), sp, 40))
        assert a.ahead.launched > 30
    outs = []
    for ahead in (True, False):
        e = eng(ahead, 3)
        seqs = [Sequence(_prompt(12 + i, 20 + i), SamplingParams(temperature=0), 20 + 5 * i, set()) for i in range(3)]
        for s in seqs:
            e.add(s)
        while any(not s.finished for s in seqs):
            e.step()
        outs.append([s.output for s in seqs])
    assert outs[0] == outs[1]


def test_drafting_sequences_launch_ahead_while_their_drafts_are_paused(hf_and_gguf, monkeypatch):
    """With n-gram drafts on, a sequence whose drafts did not stand pauses drafting (1, 2, 4 ... steps); those
    steps carry no drafts and are launched ahead like plain ones. The text is the one without drafts."""
    from strata.engine.spec import NgramDrafter

    _, path = hf_and_gguf("qwen3moe")

    def eng(ahead: bool, draft_max: int):
        cfg = EngineConfig(device="cpu", dtype="float32", cuda_graphs=True, decode_ahead=ahead, draft_max=draft_max)
        e = Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=1)
        # the pauses alone decide which steps draft: the timed costs, which differ between the two engines, would
        # weigh in while a sequence's acceptance reads its first few tries (strata.engine.draft_cost.MIN_TRIED)
        e.draft_cost = None
        return e

    prompt, sp = _prompt(40, 4), SamplingParams(temperature=0)
    ref = list(eng(False, 0).generate(prompt, sp, 48))
    full = prompt + ref
    # every draft wrong: one token past the greedy continuation's next one
    monkeypatch.setattr(NgramDrafter, "draft", lambda self, k: [(full[len(self.tokens)] + 1) % 1000] if k else [])
    a, b = eng(True, 4), eng(False, 4)
    assert a.ahead is not None
    assert list(a.generate(prompt, sp, 48)) == list(b.generate(prompt, sp, 48)) == ref
    assert a.last.draft_steps > 0 and a.last.draft_accepted == 0    # drafted steps, none stood ...
    assert a.ahead.launched > 0                                       # ... and paused steps launched ahead
    assert a.last.draft_steps <= b.last.draft_steps


def test_drafts_ruled_out_by_their_cost_are_still_looked_at_while_steps_launch_ahead(hf_and_gguf, monkeypatch):
    """With the measured costs ruling drafts out, a sequence still tries one every draft_cost.EXPLORE steps (the
    text may start to repeat its context) when its plain steps are launched ahead: the check before a launch
    only peeks, and the launched step counts once."""
    import strata.engine.draft_cost as dc
    from strata.engine.spec import NgramDrafter

    _, path = hf_and_gguf("qwen3moe")
    cfg = EngineConfig(device="cpu", dtype="float32", cuda_graphs=True, decode_ahead=True, draft_max=4)
    eng = Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=1)
    prompt, sp = _prompt(40, 4), SamplingParams(temperature=0)
    ref = list(Engine(load_model(str(path), EngineConfig(device="cpu", dtype="float32"), with_tokenizer=False),
                      n_slots=1).generate(prompt, sp, 6 * dc.EXPLORE))
    full = prompt + ref
    monkeypatch.setattr(NgramDrafter, "draft", lambda self, k: [(full[len(self.tokens)] + 1) % 1000] if k else [])
    cost = dc.DraftCost()
    for _ in range(dc.WINDOW):  # verify steps far dearer than plain ones: no draft pays at any acceptance
        cost.record(1, 10.0)
        cost.record(5, 100.0)
    cost.record = lambda t, ms: None
    eng.draft_cost = cost
    assert list(eng.generate(prompt, sp, 6 * dc.EXPLORE)) == ref
    assert eng.ahead.launched > 0
    # a look every EXPLORE steps (none stands, so each look is followed by a pause of 1, 2, 4 ... steps)
    assert 3 <= eng.last.draft_steps <= 6, eng.last.draft_steps
