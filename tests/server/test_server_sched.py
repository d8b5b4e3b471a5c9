"""Scheduling through a real server: FIFO with one slot, continuous batching with four (greedy output identical
to running alone), every request answered, and a client that hangs up frees its slot within one step."""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from .conftest import serve

PROMPTS = [f"Question {i}: what is {i} times {i + 3}?" for i in range(8)]


_http = httpx.Client(timeout=60)


def _recent(url):
    return _http.get(url + "/metrics?format=json").json()["recent_requests"]


_local = threading.local()


def _chat(url, content, max_tokens=4, **extra):
    c = getattr(_local, "clients", {}).get(url)
    if c is None:  # one client per thread: building one costs more than a tiny request
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        _local.clients = {**getattr(_local, "clients", {}), url: c}
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                  max_tokens=max_tokens, temperature=0, extra_body=extra or None)
    return r


def test_fifo_with_one_slot_and_nothing_lost(lm):
    with serve(lm, parallel=1) as s:
        def client(k):
            return [_chat(s.url, f"client {k} request {j}") for j in range(5)]

        with ThreadPoolExecutor(8) as ex:
            results = [r for rs in ex.map(client, range(8)) for r in rs]
        assert len(results) == 40
        assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4 for r in results)
        recs = sorted(_recent(s.url), key=lambda r: r["id"])
        assert len(recs) == 40
        admitted = [r["admit_step"] for r in recs]
        assert admitted == sorted(admitted), "requests were not served in arrival order"
        assert len(set(admitted)) == 40  # one slot: never two admitted at the same step


def test_batched_greedy_equals_alone(lm):
    with serve(lm, parallel=4) as s:
        w = s.state.server.worker
        steps0 = w.steps
        alone = [_chat(s.url, p, 8, cache_prompt=False).choices[0].message.content for p in PROMPTS]
        steps_alone = w.steps - steps0
        steps0 = w.steps
        with ThreadPoolExecutor(8) as ex:
            together = list(ex.map(lambda p: _chat(s.url, p, 8, cache_prompt=False).choices[0].message.content,
                                   PROMPTS))
        steps_together = w.steps - steps0
        assert together == alone
        assert steps_together < steps_alone * 0.6, (steps_together, steps_alone)  # they really shared steps


def test_disconnect_frees_the_slot_within_one_step(lm):
    with serve(lm, parallel=1) as s:
        w = s.state.server.worker
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Talk for a long time."}],
                "max_tokens": 400, "temperature": 0, "stream": True}
        got = []
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", s.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                n = 0
                for line in lines:
                    if line.startswith("data: ") and "content" in line:
                        n += 1
                    if n >= 4:
                        break
                t = threading.Thread(target=lambda: got.append(_chat(s.url, "Next in line.", 3)))
                t.start()
                t0 = time.time()
                while w.n_waiting < 1:
                    assert time.time() - t0 < 30
                    time.sleep(0.005)
            # the response is closed here: the connection goes away mid-stream
        t.join(60)
        assert got and got[0].usage.completion_tokens == 3
        recs = {r["finish_reason"]: r for r in _recent(s.url)}
        gone, nxt = recs["abort"], recs["length"]
        assert gone["completion_tokens"] < 400  # stopped long before its max_tokens
        assert nxt["id"] == gone["id"] + 1
        assert 0 <= nxt["admit_step"] - gone["cancel_step"] <= 1, (gone, nxt)
        assert _http.get(s.url + "/health").json()["slots_idle"] == 1


LONG_CTX = 8192  # (the tiny model writes the 512 tokens of the shared fixture's context in under a second)


@pytest.fixture(scope="module")
def long_lm(tiny_gguf):
    from strata.config import EngineConfig
    from strata.engine.loader import load_model

    return load_model(str(tiny_gguf), EngineConfig(model=str(tiny_gguf), device="cpu", ctx_size=LONG_CTX))


def _hang_up(url: str, path: str, body: dict) -> float:
    """Send a non-streaming request and hang up while it generates; the seconds until the slot is idle again."""
    with httpx.Client(timeout=0.5) as c, contextlib.suppress(httpx.ReadTimeout):
        r = c.post(url + path, json=body)
        raise AssertionError(f"the request finished before the client hung up: {r.text[:300]}")
    t0 = time.time()
    while _http.get(url + "/health").json()["slots_idle"] != 1:
        assert time.time() - t0 < 60, "the slot stayed busy"
        time.sleep(0.02)
    return time.time() - t0


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Talk for a long time."}], "ignore_eos": True}),
    # (greedy: this prompt's reply runs to max_tokens without an end of turn, which the Messages API cannot ignore)
    ("/v1/messages", {"messages": [{"role": "user", "content": "Talk for a long time."}]}),
])
def test_non_streaming_hang_up_frees_the_slot_while_tokens_flow(long_lm, path, body):
    """The server asks whether the client is still there on the clock, not only when no token came for a while
    (while tokens flow every few milliseconds, such a wait never ran out and the slot stayed busy to max_tokens:
    here many seconds)."""
    max_tokens = LONG_CTX - 100
    with serve(long_lm, parallel=1) as s:
        w = s.state.server.worker
        freed_s = _hang_up(s.url, path, {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, **body})
        gone = max(_recent(s.url), key=lambda r: r["id"])
        assert gone["finish_reason"] == "abort", gone
        assert 10 < gone["completion_tokens"] < max_tokens / 4, gone  # tokens flowed when the client left
        assert freed_s < 1.0, freed_s
        assert w.n_running == 0
