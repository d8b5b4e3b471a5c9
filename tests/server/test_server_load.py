"""The server under hostile and concurrent load: clients that hang up at any moment, many at once; each case
asserts what must hold afterwards (no error logged, no slot held, later requests served)."""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import time

import httpx
import pytest

from .conftest import CTX, serve

MSG = [{"role": "user", "content": "tell me a story"}]


@pytest.fixture(scope="module")
def server(lm):
    with serve(lm, parallel=2) as s:
        yield s


def _settle(s, deadline_s: float = 60) -> None:
    """Wait until uvicorn holds no connection (every hang-up handled) and every slot is idle."""
    t0 = time.time()
    with httpx.Client(base_url=s.url, timeout=30) as c:
        while time.time() - t0 < deadline_s:
            if len(s.server.server_state.connections) <= 1 and all(x["state"] == "idle" for x in c.get("/slots").json()):
                return
            time.sleep(0.05)
    raise AssertionError("the server did not settle")


def _raw(s, path: str, body: bytes, length: int | None = None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", s.port))
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\n\r\n").encode()
    sock.sendall(head + body)
    return sock


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages"])
def test_a_client_gone_before_its_body_came_is_no_server_error(server, caplog, path):
    """A client that sends part of its body and hangs up: no 'unhandled error' traceback in the log (it was one per
    such client), and the next request is served."""
    body = json.dumps({"model": "tiny", "messages": MSG, "prompt": "hi", "max_tokens": 4}).encode()
    caplog.set_level(logging.ERROR, logger="strata.server")
    for _ in range(3):
        sock = _raw(server, path, body[:10], length=len(body))
        sock.close()
    _settle(server)
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 3}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_drafts_that_reach_the_context_end_all_stand(lm, stream):
    """A verify step whose standing drafts fill the context to its last row: every one of them is delivered and
    the reply fills the context (it stopped at the first of them, up to draft-max tokens short, and which
    tokens a reply got depended on the other requests' steps)."""
    drafting = dataclasses.replace(lm, cfg=dataclasses.replace(lm.cfg, draft_max=8))
    code = "def add(a, b):\n    return a + b\n\n" * 16
    with serve(drafting, parallel=1) as s, httpx.Client(base_url=s.url, timeout=300) as c:
        body = {"prompt": code, "temperature": 0, "ignore_eos": True, "max_tokens": 100000, "stream": stream,
                **({"stream_options": {"include_usage": True}} if stream else {})}
        if stream:
            with c.stream("POST", "/v1/completions", json=body) as r:
                data = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
            usage = data[-1]["usage"]
        else:
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
        timings = c.get("/metrics?format=json").json()
        assert usage["prompt_tokens"] + usage["completion_tokens"] == CTX, usage
        assert timings["totals"]["generated_tokens"] == usage["completion_tokens"]
