"""A request's n choices (OpenAI's `n`), run side by side in the engine's slots, and the log-probability bodies
of both OpenAI APIs.

Each choice is its own engine request (its own slot, seed and grammar state); they are admitted together when
slots are free, so n is capped at the server's slot count (`--parallel`): more could never run side by side.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from strata.server.protocol import bad_request
from strata.server.generation import GenerationError, Result
from strata.server.job import Job


def check_n(srv, n: int | None) -> int:
    n = n or 1
    slots = srv.worker.engine.n_slots
    if n > slots:
        raise bad_request(f"n: at most {slots} choices per request on this server (its slot count, --parallel "
                          f"{slots}); got {n}")
    return n


@dataclass
class Choice:
    """What one choice produced, gathered for a non-streamed answer."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # where each logprobs entry's token starts in the text
    result: Result | None = None

    def add(self, ev) -> None:
        kind = ev[0]
        if kind == "content":
            self.content.append(ev[1])
        elif kind == "reasoning":
            self.reasoning.append(ev[1])
        elif kind == "tool_call":
            self.calls.append(ev[1])
        elif kind == "logprobs":
            self.logprobs.append(ev[1])
            self.offsets.append(ev[2])
        else:
            self.result = ev[1]


async def run_all(srv, jobs: list[Job], request=None) -> list[Choice]:
    """Run every choice to its end; the first failure (or the client leaving) cancels the others."""

    async def one(job: Job) -> Choice:
        c = Choice()
        async for ev in srv.run(job, request):
            c.add(ev)
        return c

    if len(jobs) == 1:
        return [await one(jobs[0])]
    tasks = [asyncio.ensure_future(one(j)) for j in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:  # (a no-op for those that finished)
            t.cancel()


async def merged(srv, jobs: list[Job]):
    """Every choice's events as they come: (index, event). A failing choice raises GenerationError here; leaving
    early (the client went away) cancels every choice's engine request."""
    if len(jobs) == 1:
        async for ev in srv.run(jobs[0]):
            yield 0, ev
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, job: Job):
        try:
            async for ev in srv.run(job):
                q.put_nowait((i, ev))
        except GenerationError as e:
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, j)) for i, j in enumerate(jobs)]
    try:
        left = len(jobs)
        while left:
            i, ev = await q.get()
            if ev is None:
                left -= 1
            elif isinstance(ev, GenerationError):
                raise ev
            else:
                yield i, ev
    finally:
        for t in tasks:
            t.cancel()


def usage_of(results: list[Result]) -> dict:
    """One prompt, n completions: completion tokens summed over the choices."""
    first = results[0]
    out = sum(r.completion_tokens for r in results)
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": out,
            "total_tokens": first.prompt_tokens + out,
            "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}


def chat_logprobs(entries: list[dict] | None):
    return None if entries is None else {"content": entries, "refusal": None}


def legacy_token(entry: dict) -> str:
    """A token as the legacy format names it: its text, or, for bytes that are not UTF-8 by themselves (a piece of
    a character), "bytes:" and every byte as \\xNN, as OpenAI writes them. Rendered as U+FFFD, such tokens would
    all read the same, and top_logprobs (a dict keyed by token) would keep one of them."""
    b = bytes(entry["bytes"])
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


def legacy_logprobs(entries: list[dict] | None, offsets: list[int], base: int = 0):
    """/v1/completions' format: parallel lists of tokens, their log-probabilities, {token: logprob} of the
    alternatives, and each token's character offset in the choice's text: `offsets` (the "logprobs" events'
    characters decoded before each token) after `base` (the echoed prompt's length)."""
    if entries is None:
        return None
    tops = []
    for e in entries:
        top: dict[str, float] = {}
        for t in e["top_logprobs"]:  # (distinct tokens have distinct keys; should two match, the likelier stands)
            top.setdefault(legacy_token(t), t["logprob"])
        tops.append(top)
    return {"tokens": [legacy_token(e) for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": tops, "text_offset": [base + o for o in offsets]}
