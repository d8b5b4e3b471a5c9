"""Prompts of an exact size that no cache can serve.

- Every prompt starts with a line no other prompt has (a run tag and a random nonce), so even a server that
  ignored `cache_prompt: false` could reuse at most the chat template's preamble; the sweep also aborts when
  the engine reports cached tokens.
- The body is English-like filler from a fixed seed: the same words for every prompt of a length (so
  routing and speculative drafts see the same content from run to run), but not a repetition of one phrase
  (which would make routing collapse and n-gram drafts look perfect).
- Sizes are hit by calibrating the chat template's overhead and the filler's tokens per character with the
  server's own token counter, then cutting the filler to the character (secant steps, then bisection):
  within 1% (or 1 token) of the target, checked against what the engine reports.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from typing import Callable

from strata import StrataError

_NOUNS = (
    "river mountain garden engine market teacher window letter village ocean bridge harbor forest library "
    "kitchen station council painter farmer doctor lantern meadow canyon signal journal museum orchard "
    "valley compass theater workshop island bakery tunnel quarry glacier castle harvest archive courier "
    "violin pocket mirror ladder blanket pepper copper thunder"
).split()
_ADJS = (
    "quiet bright narrow ancient gentle heavy silver hidden careful patient distant golden rapid crooked "
    "modest steady fragile humble curious restless hollow vivid sturdy faint polished rough"
).split()
_VERBS = (
    "carries follows watches builds repairs crosses gathers measures guards paints visits counts opens "
    "borrows studies describes improves shelters collects remembers"
).split()
_PLACES = (
    "near the old mill|beyond the northern road|under the stone arch|beside the wide river|at the edge of town|"
    "behind the market hall|across the valley|inside the east tower|along the harbor wall|past the last farm"
).split("|")


def filler_words(n: int, seed: int = 0) -> list[str]:
    """n words of plain sentences ("The quiet river carries the golden lantern near the old mill."),
    deterministic in seed; a word ending a sentence carries the period, every third sentence ends a line."""
    rng = random.Random(seed)
    out: list[str] = []
    sentences = 0
    while len(out) < n:
        words = ["The", rng.choice(_ADJS), rng.choice(_NOUNS), rng.choice(_VERBS), "the", rng.choice(_ADJS),
                 rng.choice(_NOUNS), *rng.choice(_PLACES).split()]
        words[-1] += "."
        sentences += 1
        if sentences % 3 == 0:
            words[-1] += "\n"
        out.extend(words)
    return out[:n]


def join_words(words: list[str]) -> str:
    return "".join(w if w.endswith("\n") or i == len(words) - 1 else w + " " for i, w in enumerate(words))


_TEXT: dict[int, str] = {}


def filler_text(n_chars: int, seed: int = 0) -> str:
    """The first n_chars characters of the seed's filler (cut anywhere: sizes are hit to the token)."""
    t = _TEXT.get(seed, "")
    if len(t) < n_chars:
        words = max(1024, 2 * len(t.split()))
        while len(t) < n_chars:
            t = join_words(filler_words(words, seed))
            words *= 2
        _TEXT[seed] = t
    return t[:n_chars]


def unique_line(tag: str = "bench") -> str:
    """A first line no other prompt has."""
    return f"[{tag} {uuid.uuid4().hex[:16]}] Read the notes below, then answer."


@dataclass
class Prompt:
    text: str
    tokens: int  # as the counter saw it (the chat-rendered prompt), plus the offset the engine adds
    target: int
    chars: int  # filler characters used
    first_line: str

    @property
    def error(self) -> float:
        """Relative size error against the target."""
        return (self.tokens - self.target) / self.target if self.target else 0.0


Counter = Callable[[str], int]  # text of one user message -> tokens of the rendered chat prompt
Body = Callable[[str], str]  # filler text -> the message body (the needle inserts a sentence, adds a question)


class PromptBuilder:
    """Builds user messages whose rendered chat prompt has a target token count.

    `count` returns the tokens of the whole rendered prompt (template included) for one user message; it is
    called a few times per prompt (the server's count_tokens route, or a local tokenizer in tests). The filler
    is cut to a number of characters found by secant steps and bisection, so the size is hit to the token.
    `body(text)` may wrap the filler as long as the token count grows with it.
    """

    def __init__(self, count: Counter, tag: str = "bench", seed: int = 0, tolerance: float = 0.01):
        self.count, self.tag, self.seed, self.tolerance = count, tag, seed, tolerance
        self._rate: float | None = None  # tokens per filler character (calibrated once)

    def render(self, first_line: str, n_chars: int, body: Body | None = None) -> str:
        text = filler_text(n_chars, self.seed)
        return f"{first_line}\n{body(text) if body is not None else text}"

    def build(self, target: int, body: Body | None = None, max_iter: int = 24, first_line: str | None = None,
              offset: int = 0) -> Prompt:
        """A prompt of `target` tokens (within the tolerance, at least to 1 token).

        offset: tokens the engine counts beyond what the counter says (e.g. a BOS the count route leaves out),
        learnt from a warm-up request's usage; the counter is aimed at target - offset."""
        first = first_line or unique_line(self.tag)
        size, target = target, target - offset
        base = self.count(self.render(first, 0, body))  # the template's overhead + the first line (+ wrapping)
        if target <= base:
            raise StrataError(f"a prompt of {size} tokens is smaller than the template's overhead ({base + offset} "
                              "tokens)")
        if self._rate is None:
            probe = 2048
            self._rate = max((self.count(self.render(first, probe, body)) - base) / probe, 1e-3)
        tol = max(1, int(size * self.tolerance))
        lo, hi = 0, None  # characters known to give < target / > target tokens
        n = max(1, round((target - base) / self._rate))
        best = (target - base, 0, base)
        for i in range(max_iter):
            got = self.count(self.render(first, n, body))
            if abs(got - target) < best[0]:
                best = (abs(got - target), n, got)
            if got == target or (i >= 6 and abs(got - target) <= tol):  # exact, or close enough after a while
                break
            if got < target:
                lo = max(lo, n)
            else:
                hi = n if hi is None else min(hi, n)
            nxt = n + round((target - got) / self._rate)
            if hi is not None and not lo < nxt < hi:  # the secant left the bracket: bisect it
                nxt = (lo + hi) // 2
            if nxt == n or (hi is not None and hi - lo <= 1):
                break
            n = nxt
        err, n, got = best
        if err > tol:
            raise StrataError(f"could not build a prompt of {size} tokens (closest: {got + offset})")
        return Prompt(self.render(first, n, body), got + offset, size, n, first)


def parse_size(text: str) -> int:
    """`4K` / `4k` = 4096, `32K` = 32768, `1500` = 1500, `1M` = 1048576."""
    t = text.strip().lower()
    mult = 1
    if t.endswith("k"):
        mult, t = 1024, t[:-1]
    elif t.endswith("m"):
        mult, t = 1024 * 1024, t[:-1]
    try:
        v = float(t) * mult
    except ValueError:
        raise StrataError(f"not a size: {text!r} (use e.g. 512, 4K, 32K)") from None
    if v < 1:
        raise StrataError(f"size must be positive: {text!r}")
    return int(v)


def parse_sizes(text: str) -> list[int]:
    return [parse_size(p) for p in text.split(",") if p.strip()]


def fmt_size(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)
