"""A request in the engine (`Sequence`): the `Request` fields and its running state (slot, position, output,
drafts, timings, the experts' counts)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

import torch

from strata.engine.request import Request, request_fields
from strata.engine.draft_cost import Acceptance
from strata.engine.sampler import position_uniform
from strata.engine.spec import NgramDrafter
from strata.experts.stats import ExpertStats

_ids = itertools.count(1)


@dataclass
class Sequence(Request):
    """A request in the engine: the `Request` fields (inherited, so declared once) and its running state."""

    id: int = field(default_factory=lambda: next(_ids))
    slot: int = -1
    pos: int = 0  # tokens already in the KV cache
    cached: int = 0  # prompt tokens reused from a cached prefix (not recomputed)
    output: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None  # why it failed (finish_reason "error"): its own step work raised; the others go on
    sample_seed: int = 0  # the request's seed (drawn at random when it gave none): see sampler.position_uniform

    def seed_draw(self, pos: int) -> float | None:
        """The uniform number that draws the token at sequence position `pos` (None when greedy)."""
        return None if self.params.greedy else position_uniform(self.sample_seed, pos)
    # speculative decoding (strata.engine.spec): the context's n-gram index, draft tokens proposed and accepted
    drafter: NgramDrafter | None = None
    draft_len: int = 0  # this sequence's next draft length (adapted to how many drafts stood lately; 0: not set)
    draft_pause: int = 0  # steps left without drafts (after drafts of which none stood)
    draft_backoff: int = 0  # the next pause's length: doubles while whole drafts fail, 0 once one stands
    # how often this sequence's drafts stand (strata.engine.draft_cost): with the step costs, how many pay
    draft_acc: Acceptance = field(default_factory=Acceptance)
    draft_steps: int = 0
    draft_n: int = 0
    draft_accepted: int = 0
    # Applied to the sequence's logits row [V] before sampling: OpenAI's logit_bias, grammar masks. None = off.
    logits_processor: Callable[[torch.Tensor], torch.Tensor] | None = None
    # with `logprobs` set: one entry per token of `output`, (logprob, [(token id, logprob), ...]); see
    # sampler.token_logprobs
    token_logprobs: list = field(default_factory=list)
    # timings (engine clock, ms)
    t_start: float = 0.0
    prompt_ms: float = 0.0
    predicted_ms: float = 0.0
    t_first: float = 0.0
    # the experts backend's counts at the first token, and what they grew by until the last (the miss lanes'
    # bytes over predicted_ms; with other sequences in flight their steps' counts are in it too). None: nothing
    # counted (a dense model, resident experts)
    experts_at_first: ExpertStats | None = None
    experts_decode: ExpertStats | None = None

    @property
    def lane_gbps(self) -> dict[str, float]:
        """The miss lanes' GB/s over this sequence's decode (ExpertStats.lane_gbps); {} when nothing counted."""
        if self.experts_decode is None:
            return {}
        return self.experts_decode.lane_gbps(self.predicted_ms / 1e3)

    @classmethod
    def of(cls, req: Request) -> "Sequence":
        """A sequence for `req` (a Request or a subclass such as the server's Job): every Request field, copied."""
        return cls(**request_fields(req))

    @property
    def prompt_done(self) -> bool:
        return self.pos >= len(self.prompt)

    @property
    def prompt_n(self) -> int:
        return len(self.prompt) - self.cached

    def context(self) -> list[int]:
        return self.prompt + self.output

    def tokens(self, a: int, b: int) -> list[int]:
        """context()[a:b] without building the whole context (a long prompt: once per step adds up)."""
        p = len(self.prompt)
        if b <= p:
            return self.prompt[a:b]
        if a >= p:
            return self.output[a - p:b - p]
        return self.prompt[a:] + self.output[:b - p]
