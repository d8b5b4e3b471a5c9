"""A large request body is decoded and validated off the event loop: other clients' streams keep flowing."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx

from strata.server.body import LARGE_BODY, decode_json, read_request
from strata.server.protocol import CompletionRequest, parse


class _Request:
    """What read_request reads of a starlette request: its body."""

    def __init__(self, raw: bytes):
        self.raw = raw

    async def body(self) -> bytes:
        return self.raw


def _loop_ticks_while_reading(raw: bytes) -> tuple[int, float]:
    """Run read_request on an event loop beside a task that ticks every 5 ms: (ticks while it ran, its seconds)."""
    async def main():
        ticks = 0
        done = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                await asyncio.sleep(0.005)
                ticks += 1

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.02)  # the ticker runs
        ticks = 0
        t = time.perf_counter()
        try:
            await read_request(_Request(raw), CompletionRequest)
        finally:
            took = time.perf_counter() - t
            done.set()
            await task
        return ticks, took

    return asyncio.run(main())


def test_a_large_body_leaves_the_event_loop_free():
    """Other clients' streams are tasks on the server's one event loop: while a 20 MB body is decoded and validated
    the loop keeps running them. On the loop (or on a thread whose parse holds the GIL throughout) it ticks not at
    all until the parse ends, whatever the machine's load."""
    random.seed(0)
    raw = json.dumps({"prompt": [random.randrange(1000) for _ in range(4_000_000)], "max_tokens": 4}).encode()
    assert len(raw) > 50 * LARGE_BODY  # ~20 MB
    ticks, took = _loop_ticks_while_reading(raw)
    # at 5 ms a tick a free loop ticks dozens of times in the parse's 0.3-1 s (40-50 on an idle machine); blocked, at
    # most once at the end, and on a thread without the parse's hooks a few times around pydantic's check (4)
    assert ticks >= 12, (ticks, took)
    small = json.dumps({"prompt": [1, 2, 3], "max_tokens": 4}).encode()
    assert parse(CompletionRequest, decode_json(small)).prompt == [1, 2, 3]


def test_large_bodies_answer_as_small_ones(server):
    """The same 400s whichever path decoded the body."""
    pad = " " * (2 * LARGE_BODY)
    for raw, fragment in [(b"{not json" + pad.encode(), "not valid JSON"),
                          (("[1, 2]" + pad).encode(), "JSON object"),
                          (json.dumps({"prompt": "x", "max_tokens": "many", "user": pad}).encode(), "max_tokens"),
                          (json.dumps({"prompt": [1, 2.5], "user": pad}).encode(), "prompt")]:
        r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"},
                       timeout=60)
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/v1/messages", timeout=60,
                   json={"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "metadata": {"p": pad}})
    assert r.status_code == 200, r.text
