"""What one engine step runs: the segments of every sequence in it, flattened (strata.engine.engine schedules it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.engine.sequence import Sequence
from strata.kv.cache import Segment


@dataclass
class StepPlan:
    """One step's flattened batch: segments with their tokens and positions, whose they are, and the drafts."""

    prefill: Sequence | None = None  # the first sequence of the prefill chunk (None: no prompt read this step)
    segs: list[Segment] = field(default_factory=list)
    toks: list[int] = field(default_factory=list)
    poss: list[int] = field(default_factory=list)
    owners: list[Sequence] = field(default_factory=list)
    drafts: dict[int, list[int]] = field(default_factory=dict)  # sequence id -> its draft tokens
    rows: list[int] | None = None  # with drafts: the positions whose logits are drawn from
    graphed: bool = False  # the step replayed captured graphs

    def add(self, s: Sequence, pos: int, toks: list[int]) -> None:
        self.segs.append(Segment(s.slot, pos, len(toks)))
        self.toks += toks
        self.poss += range(pos, pos + len(toks))
        self.owners.append(s)
