"""The server's Job is the engine's Request plus pipeline options, and the worker's Ticket refers to the Job:
a request field is declared once, in strata.engine.request.Request, and set where an API module builds the Job."""

from __future__ import annotations

import dataclasses

from strata.engine.engine import Sequence
from strata.engine.request import Request
from strata.engine.sampler import SamplingParams
from strata.server.job import Job
from strata.server.worker import Ticket


def _names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_job_is_a_request_and_adds_only_pipeline_fields():
    assert issubclass(Job, Request)
    extra = _names(Job) - _names(Request)
    # nothing of the output pipeline shadows (or is silently taken for) a field of the engine's sequence
    assert extra and not extra & _names(Sequence), extra & _names(Sequence)


def test_ticket_copies_no_request_field():
    assert "job" in _names(Ticket)
    assert not _names(Ticket) & _names(Request)


def test_the_worker_builds_the_sequence_from_the_job():
    job = Job([1, 2], SamplingParams(seed=3), 4, {9}, draft_max=0, logprobs=2, stop=["x"], grammar="g",
              cache_prompt=False, kind="completion")
    seq = Sequence.of(job)
    for name in _names(Request):
        assert getattr(seq, name) == getattr(job, name), name


def test_choices_share_the_request_but_not_the_seed():
    job = Job([1, 2], SamplingParams(temperature=1.0, seed=2**64 - 1), 4, logprobs=1, stop=["x"])
    a, b, c = job.copies(3)
    assert a is job and (b.params.seed, c.params.seed) == (0, 1)  # wraps within torch.Generator's range
    assert (b.prompt, b.logprobs, b.stop, b.max_tokens) == (job.prompt, 1, ["x"], 4)
    assert Sequence.of(b).prompt is not Sequence.of(c).prompt  # each choice edits its own
