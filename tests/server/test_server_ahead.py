"""Decode steps launched one ahead (strata.engine.ahead), through a real server: concurrent streaming requests on
three slots, stop strings, a client that hangs up mid-stream and a second turn served from the slot's prefix give
what the same server gives with steps launched one by one (the CPU's static decode path stands in for CUDA graphs:
the same launches and drops, without the overlap)."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import httpx

from .conftest import serve

PROMPTS = [f"Write item {i} of a list of {i + 2} things." for i in range(6)]


def _lm(lm, ahead: bool):
    return dataclasses.replace(lm, cfg=dataclasses.replace(lm.cfg, cuda_graphs=True, decode_ahead=ahead))


def _run(url: str) -> dict:
    http = httpx.Client(timeout=120)

    def chat(i):
        body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[i]}], "max_tokens": 12 + 3 * i,
                "temperature": 0, "cache_prompt": False}
        if i % 3 == 1:
            body["stop"] = ["e"]  # a stop string the server finds in the text: the engine drops its ahead token
        return http.post(url + "/v1/chat/completions", json=body).json()["choices"][0]

    with ThreadPoolExecutor(3) as ex:
        out = {i: (c["message"]["content"], c["finish_reason"]) for i, c in zip(range(6), ex.map(chat, range(6)))}
    # a streaming client that goes away after a few chunks, while the step after its last token is in flight
    with http.stream("POST", url + "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 40,
            "temperature": 0, "stream": True}) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n == 4:
                break
    # a conversation's second turn: its prefix is the slot's (the first turn's ahead token is not in it)
    msgs = [{"role": "user", "content": PROMPTS[2]}]
    first = http.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": 10,
                                                           "temperature": 0}).json()
    msgs += [first["choices"][0]["message"], {"role": "user", "content": "And one more?"}]
    second = http.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": 10,
                                                            "temperature": 0}).json()
    out["turns"] = (first["choices"][0]["message"]["content"], second["choices"][0]["message"]["content"])
    return out


def test_server_text_is_the_same_with_steps_launched_ahead(lm):
    with serve(_lm(lm, True), parallel=3) as s:
        eng = s.state.server.worker.engine
        assert eng.ahead is not None
        got = _run(s.url)
        launched = eng.ahead.launched
        steps = httpx.get(s.url + "/props").json()["decode_steps"]
        assert steps["graphs"] and steps["ahead"] and steps["launched_ahead"] == launched
        assert steps["ahead_dropped"] >= 1  # the stop strings and the client that went away
        # a dense model: no expert path, no verdict, no loan
        assert steps["misses"] is None and steps["misses_why"] is None and steps["chunk_buffer_loans"] is None
    with serve(_lm(lm, False), parallel=3) as s:
        assert s.state.server.worker.engine.ahead is None
        want = _run(s.url)
        assert not httpx.get(s.url + "/props").json()["decode_steps"]["ahead"]
    assert got == want
    assert launched > 20
