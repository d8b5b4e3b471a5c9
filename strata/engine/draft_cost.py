"""How many tokens to draft, from what a step of T tokens costs on this machine and how often drafts stand.

A verify step of T = 1 + m tokens gives, when each draft stands with probability p given the ones before it stood,
E(m) = 1 + p + ... + p^m = (1 - p^(m+1)) / (1 - p) tokens. Whether that pays depends on the step's cost: on a
small model on a CPU a step of 8 tokens costs about what a step of 1 does (compute-bound, weights read once),
and drafting pays at any acceptance; under a VRAM budget each drafted token brings its own missed experts (B1 at
8 GiB: a step of 4 tokens costs 3.2x one, docs/BENCHMARKS.md), and drafting loses unless nearly every draft
stands. So the engine measures: steps of one sequence are timed by their token count, `cost(T)` is the line
fitted through them, and a sequence drafts the m (up to what its n-gram or MTP drafter offers) that maximizes
E(m) / cost(1 + m); m = 0 is a plain step. E(m) = 1 + p1 + p1 p2 + ... with p_d the decayed count of drafts at
depth d of the chain that stood over those tried there (a draft after a rejected one is never tried); with one p for
every depth it is the geometric sum above.

Until both plain and verify steps have been timed the drafters' own adaptation decides (as before), except that
once verify steps are timed and plain ones are not (a drafter that offers a draft at every step, as an MTP block
does), the next steps are plain until MIN_PLAIN of them are timed; a sequence's acceptance rules its drafts out
only once it has drafted MIN_TRIED verify steps; a sequence whose drafts the cost rules out still tries one every
`EXPLORE` steps, so a change in the text (an agent starting
to re-emit a file it was given) is noticed. Pure Python: strata.engine.spec applies it, tests/engine checks it.
"""

from __future__ import annotations

from collections import deque

WINDOW = 64  # recent timed steps kept per token count
MIN_PLAIN = 4  # timed one-token steps before the fit is trusted
MIN_VERIFY = 4  # timed verify steps before the fit is trusted
EXPLORE = 16  # a sequence kept from drafting tries a draft once in this many steps
DECAY = 0.9  # weight of the past in a sequence's acceptance counts
# verify steps a sequence drafts before its acceptance may rule drafts out: one rejected first draft read as p = 0
# and kept drafts off until the next EXPLORE look (strata-tiny's MTP block on a re-emitted file: its first draft,
# made from the prompt, fails, the next ones nearly all stand)
MIN_TRIED = 4
PRIOR_TRIES = 1.0  # weight, in tries, of the depth before it in a depth's acceptance estimate


class DraftCost:
    """Step times by token count (one sequence per step), and the draft length that pays."""

    def __init__(self):
        self.times: dict[int, deque] = {}

    def record(self, tokens: int, ms: float) -> None:
        if tokens >= 1 and ms > 0:
            self.times.setdefault(tokens, deque(maxlen=WINDOW)).append(ms)

    def line(self) -> tuple[float, float] | None:
        """(ms of a one-token step, ms per further token): a least-squares line through the medians of each
        token count, None until enough plain and verify steps are timed."""
        plain = self.times.get(1, ())
        verify = {t: v for t, v in self.times.items() if t > 1}
        if len(plain) < MIN_PLAIN or sum(len(v) for v in verify.values()) < MIN_VERIFY:
            return None
        pts = [(t, sorted(v)[len(v) // 2]) for t, v in self.times.items() if v]
        n = len(pts)
        mt = sum(t for t, _ in pts) / n
        mc = sum(c for _, c in pts) / n
        var = sum((t - mt) ** 2 for t, _ in pts)
        slope = max(0.0, sum((t - mt) * (c - mc) for t, c in pts) / var) if var > 0 else 0.0
        base = max(1e-6, mc - slope * (mt - 1))
        return base, slope

    def wants_plain(self) -> bool:
        """Verify steps are timed but too few plain ones: a drafter that offers a draft at every step (an MTP
        block always predicts) would otherwise leave the fit unknown for good, and its length unchecked."""
        verify = sum(len(v) for t, v in self.times.items() if t > 1)
        return verify >= MIN_VERIFY and len(self.times.get(1, ())) < MIN_PLAIN

    def best(self, p, offered: int) -> int | None:
        """The number of drafts, 0..offered, with the most tokens per ms at acceptance p (one probability for every
        draft, or a list: the probability that the draft at depth d stands given the ones before it did);
        None: not known yet."""
        fit = self.line()
        if fit is None:
            return None
        base, slope = fit
        best_m, best_rate = 0, 1.0 / base
        for m in range(1, offered + 1):
            rate = expected_tokens(p, m) / (base + slope * m)
            if rate > best_rate * 1.0001:
                best_m, best_rate = m, rate
        return best_m


def expected_tokens(p, m: int) -> float:
    """Tokens a verify step of m drafts gives (the drawn token included) when each stands with probability p, or
    with p[d - 1] given that the ones before it stood (a list: per depth d = 1 .. m)."""
    if not isinstance(p, (int, float)):
        out, run = 1.0, 1.0
        for d in range(m):
            run *= min(max(float(p[d]), 0.0), 1.0)
            out += run
        return out
    p = min(max(p, 0.0), 1.0)
    return float(m + 1) if p >= 1.0 else (1 - p ** (m + 1)) / (1 - p)


class Acceptance:
    """A sequence's decayed counts of drafts that stood and drafts tried, in all and per depth in the chain: a
    model's own MTP head chains its drafts, and the second stands far less often than the first (strata-tiny on a
    fresh prompt: ~0.9 at depth 1, ~0.2 at depth 2), which one probability for every draft cannot say (it read
    ~0.55 there and ruled out even the one draft that pays)."""

    __slots__ = ("stood", "tried", "skipped", "steps", "depth")

    def __init__(self):
        self.stood = 0.0
        self.tried = 0.0
        self.skipped = 0  # steps without a draft since the cost last ruled drafts out
        self.steps = 0  # verify steps counted (not decayed)
        self.depth: list[list[float]] = []  # [stood, tried] of the draft at depth d + 1

    def add(self, drafted: int, accepted: int) -> None:
        """A verify step with `drafted` drafts, of which the first `accepted` stood (the one after them, if any,
        was tried and failed; those after it were never tried)."""
        self.steps += 1
        self.stood = DECAY * self.stood + accepted
        self.tried = DECAY * self.tried + accepted + (1 if accepted < drafted else 0)
        tried = min(drafted, accepted + 1)  # depths tried: the ones that stood and the first that failed
        while len(self.depth) < tried:
            self.depth.append([0.0, 0.0])
        for d, c in enumerate(self.depth):
            # every depth's counts fade, tried or not: one no longer drafted drifts back to the depth before it
            # (`ps`), so a chain cut short on an old estimate is tried at its length again
            c[0] = DECAY * c[0] + (1.0 if d < accepted else 0.0)
            c[1] = DECAY * c[1] + (1.0 if d < tried else 0.0)

    @property
    def p(self) -> float:
        return self.stood / self.tried if self.tried > 0 else 0.5

    def ps(self, m: int) -> list[float]:
        """The probability that the draft at depth d (1 .. m) stands given that the ones before it did: its counts
        with PRIOR_TRIES of the depth before it (depth 1: of the overall estimate), so a depth tried little or
        long ago reads as the one before it."""
        out, last = [], self.p
        for d in range(m):
            stood, tried = self.depth[d] if d < len(self.depth) else (0.0, 0.0)
            last = (stood + PRIOR_TRIES * last) / (tried + PRIOR_TRIES)
            out.append(last)
        return out


def choose(cost: DraftCost | None, acc: Acceptance, offered: int, peek: bool = False) -> int:
    """How many of the `offered` drafts to verify (0: a plain step). peek: what the next step would choose, its
    step not counted (the decode-ahead check asks before the step; the step itself then counts once, as drafted
    or as launched without drafts: strata.engine.spec.pause_step)."""
    if cost is None or offered <= 0:
        return offered
    m = cost.best(acc.ps(offered), offered)
    if m is None:  # not yet timed: the drafter's own length, or a plain step to time one
        return 0 if cost.wants_plain() else offered
    if m == 0 and acc.steps < MIN_TRIED:  # too few of its drafts tried to tell (the drafter's own length)
        return offered
    if m == 0:
        if peek:
            return offered if (acc.skipped + 1) % EXPLORE == 0 else 0
        acc.skipped += 1
        if acc.skipped % EXPLORE == 0:  # a look now and then: the text may have started to repeat its context
            return offered
        return 0
    acc.skipped = 0
    return m
