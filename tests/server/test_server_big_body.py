"""A large request body is decoded and validated off the event loop: other clients' streams keep flowing."""

from __future__ import annotations

import gc
import json
import random
import threading
import time

import httpx

from strata.server.body import LARGE_BODY, decode_json
from strata.server.protocol import CompletionRequest, parse


def _stream_gaps(url: str, stop: threading.Event, out: list[list[float]]) -> None:
    """Stream chat replies back to back until `stop`; each reply's chunk arrival times."""
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as c:
        while not stop.is_set():
            times: list[float] = []
            out.append(times)
            with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        times.append(time.perf_counter())
                    if stop.is_set():
                        break


def test_a_large_body_does_not_stall_other_streams(server):
    random.seed(0)
    raw = json.dumps({"prompt": [random.randrange(1000) for _ in range(4_000_000)], "max_tokens": 4}).encode()
    assert len(raw) > 50 * LARGE_BODY  # ~20 MB
    t = time.perf_counter()
    parse(CompletionRequest, decode_json(raw))
    parse_s = time.perf_counter() - t  # what the event loop spent on it, all at once, before the fix
    streams: list[list[float]] = []
    stop = threading.Event()
    th = threading.Thread(target=_stream_gaps, args=(server.url, stop, streams), daemon=True)
    # a full collection over the heap earlier tests left in this process stops every thread for 0.1-0.3 s, whatever
    # the body: frozen, those objects are not scanned, and what is measured is the body's handling
    gc.collect()
    gc.freeze()
    th.start()
    try:
        t_wait = time.time()
        while sum(len(s) for s in streams) < 5:  # the stream flows
            assert time.time() - t_wait < 60 and th.is_alive()
            time.sleep(0.01)
        t0 = time.perf_counter()
        r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"},
                       timeout=120)
        t1 = time.perf_counter()
    finally:
        stop.set()
        th.join(60)
        gc.unfreeze()
    assert r.status_code == 400 and "context" in r.json()["error"]["message"], r.text
    gaps = [b - a for s in streams for a, b in zip(s, s[1:]) if b > t0 and a < t1]
    assert gaps, "no chunk arrived while the body was handled"
    # on the loop, or on a thread whose parse holds the GIL throughout, the gap is the parse time or more (4.8 s and
    # 0.57 s against a parse of 0.53 s); what still holds it at once is pydantic's check of the list and freeing it,
    # about a third of the parse (typical gap: a sixth); the bound leaves a loaded machine room below the failure's
    assert max(gaps) < parse_s * 0.85, (max(gaps), parse_s, t1 - t0)


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
