"""How many drafts pay (strata.engine.draft_cost): from step times by token count and a sequence's acceptance —
none where a verify step costs what its tokens do one by one (a budget-bound GPU), many where it costs little more
than one token (compute-bound), the drafters' own length until both kinds of step are timed, a look now and then
when drafts are ruled out, and in the engine the same text with fewer verify steps when drafts never stand."""

from __future__ import annotations

import pytest

from strata.engine import draft_cost as dc
from strata.engine.draft_cost import Acceptance, DraftCost, choose, expected_tokens
from tests.engine.test_spec import GREEDY, _engine, _prompt


def _timed(base: float, per: float, counts=(1, 2, 4, 8), n: int = 6) -> DraftCost:
    c = DraftCost()
    for t in counts:
        for i in range(n):
            c.record(t, base + per * (t - 1) + 0.01 * (i % 3))  # a little noise
    return c


def _acc(p: float, m: int = 4, steps: int = 400) -> Acceptance:
    """Acceptance counts of a sequence whose drafts stand with probability p each (deterministic: the expected
    run lengths)."""
    a = Acceptance()
    for i in range(steps):
        run = 0
        while run < m and ((i * 7919 + run * 104729) % 1000) / 1000 < p:
            run += 1
        a.add(m, run)
    return a


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_the_verify_cost_measured_on_b1_at_8_gib():
    """docs/BENCHMARKS.md: a step of T tokens took 13.2 ms at T = 1 and ~9.6 ms a further token. At 70% acceptance
    drafting loses there (the table's 69.9 tok/s at T = 2 against 75.8); at 95% three or more drafts win."""
    c = _timed(13.2, 9.6)
    base, slope = c.line()
    assert base == pytest.approx(13.2, abs=0.1) and slope == pytest.approx(9.6, abs=0.1)
    assert c.best(0.5, 8) == 0 and c.best(0.7, 8) == 0
    assert c.best(0.95, 8) >= 3


def test_a_compute_bound_machine_drafts_at_modest_acceptance():
    c = _timed(10.0, 0.6)  # a verify token costs 6% of a step (weights read once for all of them)
    assert c.best(0.5, 8) >= 2
    assert c.best(0.9, 8) == 8
    assert c.best(0.0, 8) == 0


def test_the_drafters_length_until_both_kinds_of_step_are_timed():
    c = DraftCost()
    acc = Acceptance()
    for _ in range(10):
        c.record(1, 5.0)
    assert c.line() is None and choose(c, acc, 6) == 6  # no verify step timed yet
    for _ in range(dc.MIN_VERIFY):
        c.record(3, 15.0)
    assert c.line() is not None
    assert choose(None, acc, 6) == 6  # (no cost model: the drafter decides)


def test_a_drafter_that_always_offers_gets_plain_steps_timed():
    """An MTP block offers drafts at every step, so no plain step was ever timed and the drafter's length stood for
    good (--draft-max 3 on text whose chained drafts stand half the time: slower than no drafts). Once verify steps
    are timed, plain steps are taken until enough are, then the cost decides."""
    c, acc = DraftCost(), _acc(0.5, m=3)
    assert choose(c, acc, 3) == 3  # nothing timed: the drafter's length
    for _ in range(dc.MIN_VERIFY):
        c.record(4, 22.0)  # a verify step of 3 drafts: 2.2x a plain one (the development machine's CPU)
    picks = []
    for _ in range(dc.MIN_PLAIN):
        picks.append(choose(c, acc, 3))
        c.record(1, 10.0)  # (the engine times the plain step it chose)
    assert picks == [0] * dc.MIN_PLAIN
    assert c.line() is not None and choose(c, acc, 3) < 3  # at p = 0.5 three chained drafts do not pay here


def test_acceptance_estimate_follows_the_runs():
    assert _acc(0.0).p == pytest.approx(0.0, abs=0.02)
    assert _acc(1.0).p == pytest.approx(1.0)
    assert 0.6 < _acc(0.75).p < 0.9
    fresh = Acceptance()
    assert fresh.p == 0.5


def test_one_rejected_first_draft_does_not_rule_drafts_out():
    """A sequence's acceptance rules its drafts out only after MIN_TRIED verify steps: its first draft rejected
    (p = 0 on one try) leaves the drafter's own length, not none until the next EXPLORE look; once it has tried
    enough, drafts that do not stand are ruled out as before."""
    c = _timed(3.4, 1.1)
    acc = Acceptance()
    acc.add(1, 0)
    assert acc.p == 0.0 and choose(c, acc, 1) == 1 and choose(c, acc, 2, peek=True) == 2
    for _ in range(dc.MIN_TRIED - 1):
        acc.add(1, 0)
    assert choose(c, acc, 1) == 0
    stood = Acceptance()
    for _ in range(dc.MIN_TRIED):
        stood.add(2, 2)
    assert choose(c, stood, 2) == 2  # (the costs, not the count, once it is reached)


def test_ruled_out_drafts_are_tried_now_and_then():
    c = _timed(13.2, 9.6)
    acc = _acc(0.3)
    got = [choose(c, acc, 4) for _ in range(3 * dc.EXPLORE)]
    assert got.count(4) == 3 and got.count(0) == 3 * dc.EXPLORE - 3
    assert [i for i, m in enumerate(got) if m] == [dc.EXPLORE - 1, 2 * dc.EXPLORE - 1, 3 * dc.EXPLORE - 1]


def test_the_engine_stops_verifying_drafts_that_never_stand(hf_and_gguf, monkeypatch):
    """Every draft rejected, verify steps made to look as dear as their tokens one by one: after the first few
    the engine rarely drafts, and the text is the plain one."""
    import strata.engine.engine as E

    _, path = hf_and_gguf("qwen3moe")
    prompt = _prompt(1000, seed=1)
    ref = list(_engine(path, 0).generate(prompt, GREEDY, 80))
    eng = _engine(path, 4)
    verified = []

    def reject_all(d, drawn):
        verified.append(len(d))
        return 0

    monkeypatch.setattr(E, "accept", reject_all)
    eng.draft_cost = _timed(13.2, 9.6)  # (as measured on a budget-bound GPU, not this CPU's)
    real = eng.draft_cost.record
    eng.draft_cost.record = lambda t, ms: real(t, 13.2 + 9.6 * (t - 1))  # keep it so
    out = list(eng.generate(prompt, GREEDY, 80))
    assert out == ref
    plain = _engine(path, 4)
    plain.draft_cost = None
    n_before = len(verified)
    monkeypatch.setattr(E, "accept", reject_all)
    assert list(plain.generate(prompt, GREEDY, 80)) == ref
    without_cost = len(verified) - n_before
    assert n_before < without_cost, (n_before, without_cost)  # fewer verify steps with the costs known
    assert n_before <= 80 // dc.EXPLORE + 6, n_before


def test_steps_that_capture_their_graphs_are_not_timed(hf_and_gguf, monkeypatch):
    """A step that first captured its CUDA graphs (a verify step's first of each length, a new attention window)
    took the capture's time as well: the engine leaves it out of the step costs, or one capture of a rare length
    would rule drafts out for good (seen on a GPU: a fitted 128 ms per drafted token). The captures are simulated
    on the CPU's static path: the first step of each shape counts one and takes 400 ms more (far above a step's
    time on a loaded 2-core machine, where plain steps were seen at up to 56 ms)."""
    import time

    from strata.config import EngineConfig
    from strata.engine.engine import Engine
    from strata.engine.loader import load_model

    _, path = hf_and_gguf("qwen3moe")
    cfg = EngineConfig(device="cpu", dtype="float32", cuda_graphs=True, draft_max=4, decode_ahead=False)
    eng = Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=1)
    g, seen = eng.graphs, set()
    real = g.step_batch

    def step_batch(tokens, positions, slots, T=1):
        if (len(slots), T) not in seen:
            seen.add((len(slots), T))
            g.captures += 1
            time.sleep(0.4)
        return real(tokens, positions, slots, T)

    monkeypatch.setattr(g, "step_batch", step_batch)
    prompt = _prompt(30, seed=3)
    list(eng.generate(prompt + prompt, GREEDY, 40))  # (the repeat: n-gram drafts of several lengths)
    assert len(seen) > 2  # plain steps and verify steps of more than one length were graphed
    times = [ms for v in eng.draft_cost.times.values() for ms in v]
    assert times and max(times) < 400, sorted(times)[-3:]


def _chain(first: float, second: float, steps: int = 200) -> Acceptance:
    """Verify steps of 2 drafts: the first stands in `first` of them, the second in `second` of those (spread
    evenly, deterministic)."""
    a = Acceptance()
    for i in range(steps):
        ok1 = (i * 37 % 100) < first * 100
        ok2 = ok1 and (i * 61 % 100) < second * 100
        a.add(2, 2 if ok2 else int(ok1))
    return a


def test_acceptance_is_counted_per_depth_of_the_chain():
    """A chain whose first draft nearly always stands and whose second rarely does (an MTP head on fresh text):
    per depth ~0.9 then ~0.2, where one probability for every draft read ~0.6."""
    a = _chain(0.9, 0.2)
    p1, p2 = a.ps(2)
    assert p1 > 0.8 and p2 < 0.35 and 0.5 < a.p < 0.8
    assert a.ps(4)[2:] == [p2, p2]  # depths never tried take the one before
    assert Acceptance().ps(2) == [0.5, 0.5]
    assert expected_tokens([1.0, 0.5], 2) == pytest.approx(2.5)
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(expected_tokens(0.5, 3))


def test_the_depth_that_pays_is_drafted():
    """On the CPU (a further verify token ~15% of a step) a first draft standing 90% of the time pays and a second
    standing 20% does not: one draft, where one probability for both chose otherwise."""
    c = _timed(2.7, 0.45)
    a = _chain(0.9, 0.2)
    assert choose(c, a, 2) == 1
    assert c.best(a.p, 2) != 1  # (the single estimate's choice)
    long_chain = Acceptance()
    for _ in range(40):
        long_chain.add(3, 3)
    assert choose(c, long_chain, 3) == 3


def test_a_depth_no_longer_drafted_is_tried_again():
    """The second draft failed for a while (the text was new), so one draft a step; once the first has stood for a
    while alone, the second's old failures have faded toward the first's rate and two are drafted again (a depth
    never drafted again would keep its stale estimate for good)."""
    c = _timed(2.7, 0.45)
    a = Acceptance()
    for _ in range(20):
        a.add(2, 1)
    assert choose(c, a, 2) == 1
    got = []
    for _ in range(30):
        m = choose(c, a, 2)
        got.append(m)
        a.add(m, m)  # every draft stands now
    assert got[0] == 1 and got[-1] == 2
