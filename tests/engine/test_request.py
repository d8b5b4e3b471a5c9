"""The engine's Request is declared once: Sequence inherits its fields and `Sequence.of` copies every one of them
by walking `dataclasses.fields(Request)`, so a field added to Request reaches the engine with no other edit."""

from __future__ import annotations

import dataclasses

from strata.engine.engine import Sequence
from strata.engine.request import Request
from strata.engine.sampler import SamplingParams


def _names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def test_sequence_declares_every_request_field_first():
    # first and in order: Sequence(prompt, params, max_tokens, stop_ids) keeps its positional meaning
    assert _names(Sequence)[: len(_names(Request))] == _names(Request)


def test_every_request_field_reaches_the_sequence():
    # a distinct object per field, whatever fields Request declares now or later: each must arrive unchanged
    marks = {name: object() for name in _names(Request)}
    seq = Sequence.of(Request(**marks))
    for name, mark in marks.items():
        assert getattr(seq, name) is mark, f"Request.{name} did not reach the Sequence"


def test_containers_are_the_sequences_own():
    req = Request([1, 2, 3], SamplingParams(temperature=0), 5, {7}, draft_max=2, logprobs=1)
    seq = Sequence.of(req)
    assert (seq.prompt, seq.max_tokens, seq.stop_ids, seq.draft_max, seq.logprobs) == ([1, 2, 3], 5, {7}, 2, 1)
    seq.prompt.append(4)
    seq.stop_ids.add(8)
    assert req.prompt == [1, 2, 3] and req.stop_ids == {7}  # the engine's edits stay in the engine
    assert seq.params is req.params


def test_a_subclass_brings_only_the_request_fields():
    # a caller's own request type (the server's Job is one) may carry more; the engine takes the Request part
    Tagged = dataclasses.make_dataclass("Tagged", [("tenant", str, "acme"), ("stop", list, None)], bases=(Request,))
    seq = Sequence.of(Tagged([5, 6], max_tokens=3, logprobs=2))
    assert (seq.prompt, seq.max_tokens, seq.logprobs) == ([5, 6], 3, 2)
    assert not hasattr(seq, "tenant") and not hasattr(seq, "stop")
    assert type(seq) is Sequence
