"""Speculative decoding with n-gram drafts (prompt lookup): guess the next tokens by finding the context's last
few tokens earlier in the context and proposing what followed them there; verify all guesses in one forward.

Why it pays for a MoE on a budget: a step's cost is dominated by reading its experts (from VRAM, over PCIe or by
the CPU), and a verify step of 1 + m tokens reads each expert once for all of them. Coding agents and chat
about documents repeat long spans of their context (code being edited, quoted text), where drafts are accepted
for many tokens in a row; where nothing matches no draft is made and the step is a plain decode step.

Verification is exact for any sampler: the target's token is drawn at every drafted position from that
position's distribution (the same processing as without drafts), and drafts are accepted while they equal the
drawn tokens; the first difference ends the step with the drawn token. Each emitted token is thus a draw from
the model's distribution given the tokens before it. Each draw's randomness is keyed by the drawn token's
position (sampler.position_uniform), so a rejected row's draw shifts no later one: greedy or seeded, the text is the
one decoding without drafts writes.
"""

from __future__ import annotations

from strata.engine.draft_cost import choose


class NgramDrafter:
    """An index of a sequence's context (prompt + output) by its n-grams, n_min <= n <= n_max: for each n-gram,
    where it last occurred with at least one token after it. `draft` looks the context's last n tokens up,
    longest n first, and proposes up to `k` of the tokens that followed. Extending the context costs O(n_max) per
    token, a draft O(n_max + k), whatever the context's length."""

    def __init__(self, n_min: int = 2, n_max: int = 4):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> the position right after its latest occurrence

    def extend(self, tokens) -> None:
        toks = self.tokens
        for t in tokens:
            # the n-grams ending at the current end now have a following token: index them
            end = len(toks)
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self._last[tuple(toks[end - n:end])] = end
            toks.append(int(t))

    def sync(self, prompt: list[int], output: list[int]) -> None:
        """Catch up with a sequence whose context (prompt, then output) only grows: index what was added."""
        n, p = len(self.tokens), len(prompt)
        if n > p + len(output):  # not this context's prefix any more (a reused drafter): start over
            self.tokens, self._last, n = [], {}, 0
        if n < p:
            self.extend(prompt[n:])
            n = p
        self.extend(output[n - p:])

    def draft(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the context's longest matching suffix."""
        toks = self.tokens
        end = len(toks)
        if k <= 0:
            return []
        for n in range(min(self.n_max, end), self.n_min - 1, -1):
            at = self._last.get(tuple(toks[end - n:end]))
            if at is not None:
                return toks[at:at + k]
        return []


def accept(drafts: list[int], drawn: list[int]) -> int:
    """How many drafts are accepted: drafts[i] stands while it equals drawn[i], the token the model drew at the
    position before it (drawn has len(drafts) + 1 entries: the last is the bonus token when all stand)."""
    a = 0
    while a < len(drafts) and drafts[a] == drawn[a]:
        a += 1
    return a


def _room(engine, s) -> int:
    """Drafts the sequence's next step may carry at most (0: none, whatever its tokens)."""
    limit = engine.draft_max if s.draft_max is None else s.draft_max
    room = min(s.draft_len or limit, limit, s.max_tokens - len(s.output) - 1, engine.max_ctx - 1 - s.pos)
    if room <= 0 or s.logits_processor is not None or s.logprobs is not None:
        return 0
    return room


def may_draft(engine, s) -> bool:
    """Whether the sequence's next step may carry drafts, as known before its last token is read: not while its
    drafts are paused or while none pays at its acceptance (strata.engine.ahead launches such steps ahead)."""
    room = _room(engine, s)
    return room > 0 and s.draft_pause <= 0 and choose(getattr(engine, "draft_cost", None), s.draft_acc, room,
                                                      peek=True) > 0


def pause_step(engine, s) -> None:
    """A step of the sequence went without drafts before `draft_for` saw it (launched ahead): a pause counts it,
    as does the count of steps the costs kept from drafting (its next look at drafts comes after EXPLORE)."""
    room = _room(engine, s)
    if room <= 0:
        return
    if s.draft_pause > 0:
        s.draft_pause -= 1
    else:
        choose(getattr(engine, "draft_cost", None), s.draft_acc, room)


def draft_for(engine, s) -> list[int]:
    """Draft tokens for a decoding sequence of `engine` (strata.engine.engine.Engine): up to --draft-max, within
    its max_tokens and the context; none for a sequence whose logits pass through a processor (a grammar's state
    follows each accepted token) or that reports log-probabilities (one row per step). From the model's MTP block
    when the engine drafts with it, else from the context's n-grams."""
    room = _room(engine, s)
    if room <= 0:
        return []
    if s.draft_pause > 0:
        s.draft_pause -= 1
        return []
    # as many as pay at this sequence's acceptance, with verify steps costing what they were measured to
    room = choose(getattr(engine, "draft_cost", None), s.draft_acc, room)
    if room <= 0:
        return []
    if engine.mtp is not None:
        return engine.mtp.draft(s, room)
    if s.drafter is None:
        s.drafter = NgramDrafter(*engine.draft_ngram)
    s.drafter.sync(s.prompt, s.output)
    return s.drafter.draft(room)
