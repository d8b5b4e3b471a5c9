"""What a caller asks of the engine for one generation, declared once.

`Sequence` (strata.engine.engine) extends `Request` with the engine's running state, and `Sequence.of(request)`
copies every field declared here, so a new engine-level option is one field below and nothing else in the engine.
The server's `Job` (strata.server.job) extends `Request` too, with what only its output pipeline reads; those extra
fields never reach the engine, because the copy walks the fields of `Request`, not of the object it is given.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

from strata.engine.sampler import SamplingParams


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    stop_ids: set[int] = field(default_factory=set)  # generation ends after drawing one of these
    draft_max: int | None = None  # most draft tokens per step for this sequence (None: the engine's --draft-max)
    # report the log-probability of each drawn token and of this many most likely alternatives (None: off)
    logprobs: int | None = None


def request_fields(req: Request) -> dict:
    """The `Request` fields of `req` (an instance of Request or of a subclass), as keyword arguments.

    Containers are copied: the engine appends to and edits its sequence's lists, which must not be the caller's
    (a job's n choices share one prompt list). SamplingParams is shared: the engine only reads it."""
    return {f.name: _own(getattr(req, f.name)) for f in dataclasses.fields(Request)}


def _own(v):
    return copy.copy(v) if isinstance(v, (list, set, dict)) else v
