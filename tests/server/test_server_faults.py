"""An engine failure mid-stream, end to end: a test-only fault makes the engine worker's step raise once a sequence
has generated K tokens. The client gets an error event (and [DONE] on the OpenAI API), the slot is freed, and the
next request is served in full."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from strata import StrataError

from .conftest import serve

K = 4
LONG = {"max_tokens": 12, "ignore_eos": True}  # reaches K tokens: fails
SHORT = {"max_tokens": K - 1, "ignore_eos": True}  # stops before K: served
MSG = [{"role": "user", "content": "tell me a story"}]


@pytest.fixture(scope="module")
def faulty(lm):
    with serve(lm, parallel=2, fault_after_tokens=K) as s:
        yield s


def _events(r: httpx.Response) -> list[tuple[str | None, str]]:
    out, name = [], None
    for line in r.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            out.append((name, line[6:]))
            name = None
    return out


def _all_idle(client: httpx.Client) -> bool:
    return all(s["state"] == "idle" for s in client.get("/slots").json())


def _served_next(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json={"messages": MSG, **SHORT})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == K - 1
    assert _all_idle(client)


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", {"messages": MSG}),
                                       ("/v1/completions", {"prompt": "Once upon a time"})])
def test_openai_stream_gets_an_error_then_done(faulty, path, body):
    with httpx.Client(base_url=faulty.url, timeout=60) as c:
        with c.stream("POST", path, json={**body, **LONG, "stream": True}) as r:
            assert r.status_code == 200
            events = _events(r)
        data = [d for _, d in events]
        assert data[-1] == "[DONE]"
        err = json.loads(data[-2])["error"]
        assert err["type"] == "server_error" and "engine failure" in err["message"] and "injected" in err["message"]
        # the tokens before the failure did reach the client, and no chunk claims a normal finish
        chunks = [json.loads(d) for d in data[:-2]]
        assert chunks and all(ch["choices"][0]["finish_reason"] is None for ch in chunks)
        assert _all_idle(c)
        _served_next(c)


def test_anthropic_stream_gets_an_error_event(faulty):
    with httpx.Client(base_url=faulty.url, timeout=60) as c:
        with c.stream("POST", "/v1/messages", json={"messages": MSG, "max_tokens": 12, "temperature": 0,
                                                     "stream": True}) as r:  # greedy: no early end of turn
            assert r.status_code == 200
            events = _events(r)
        names = [n for n, _ in events]
        assert names[0] == "message_start" and names[-1] == "error" and "message_stop" not in names
        err = json.loads(events[-1][1])
        assert err["type"] == "error" and err["error"]["type"] == "api_error"
        assert "engine failure" in err["error"]["message"]
        assert _all_idle(c)
        r = c.post("/v1/messages", json={"messages": MSG, "max_tokens": K - 1})
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] <= K - 1


def test_non_streaming_request_gets_a_500_and_the_connection_lives(faulty):
    with httpx.Client(base_url=faulty.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"messages": MSG, **LONG})
        assert r.status_code == 500
        assert "engine failure" in r.json()["error"]["message"]
        _served_next(c)  # same keep-alive connection
        assert c.get("/health").json()["slots_idle"] == 2


def test_the_fault_hook_is_read_from_the_environment(monkeypatch):
    from strata.config import fault_after_tokens_for_tests

    monkeypatch.delenv("STRATA_TEST_FAULT_AFTER_TOKENS", raising=False)
    assert fault_after_tokens_for_tests() is None
    monkeypatch.setenv("STRATA_TEST_FAULT_AFTER_TOKENS", "7")
    assert fault_after_tokens_for_tests() == 7
    for bad in ("0", "x", "-2"):
        monkeypatch.setenv("STRATA_TEST_FAULT_AFTER_TOKENS", bad)
        with pytest.raises(StrataError, match="STRATA_TEST_FAULT_AFTER_TOKENS"):
            fault_after_tokens_for_tests()


def test_an_unhandled_error_is_a_500_and_the_connection_lives(lm):
    """A bug in a route (here: a route added to the real app that raises) is a 500 with an error body, and the
    client's keep-alive connection still serves the next request (uvicorn drops it when an exception escapes)."""
    from strata.server.app import ServeConfig, create_app

    from .conftest import Running, free_port

    port = free_port()
    app = create_app(ServeConfig(port=port, model_id="tiny", warmup=False), lm=lm)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a bug")

    with Running(app, port) as s, httpx.Client(base_url=s.url, timeout=60,
                                                limits=httpx.Limits(max_connections=1)) as c:
        for _ in range(3):
            r = c.get("/boom")
            assert r.status_code == 500 and r.json()["error"] == {
                "type": "server_error", "message": "internal error: RuntimeError", "code": None, "param": None}
            assert c.get("/health").status_code == 200


def test_one_sequence_failing_ends_only_its_request(lm, monkeypatch):
    """A sequence whose own step work raises (here its logits processor, as a broken grammar would) gets an error;
    the request decoding beside it in the same steps runs to its end."""
    import strata.server.generation as generation
    from concurrent.futures import ThreadPoolExecutor

    real = generation.bias_processor

    def failing_after_three(*a, **kw):
        inner, calls = real(*a, **kw), [0]

        def fn(row):
            calls[0] += 1
            if calls[0] > 3:
                raise RuntimeError("the grammar broke")
            return inner(row)
        return fn

    monkeypatch.setattr(generation, "bias_processor", failing_after_three)
    with serve(lm, parallel=2) as r:
        oai = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "Count to twenty."}]

        def healthy():
            return oai.chat.completions.create(model="tiny", messages=msgs, max_tokens=40, temperature=0,
                                               extra_body={"ignore_eos": True})

        def broken():
            try:
                oai.chat.completions.create(model="tiny", messages=msgs, max_tokens=40, temperature=0,
                                            logit_bias={"5": 1.0}, extra_body={"ignore_eos": True})
            except openai.APIStatusError as e:
                return e
            return None

        with ThreadPoolExecutor(2) as pool:
            ok, err = pool.submit(healthy), pool.submit(broken)
            ok, err = ok.result(), err.result()
        assert err is not None and err.status_code == 500 and "the grammar broke" in str(err.body)
        assert ok.usage.completion_tokens == 40 and ok.choices[0].finish_reason == "length"
        assert not r.state.server.worker.engine.running  # the failed sequence's slot came back
        again = healthy()  # and the server goes on
        assert again.usage.completion_tokens == 40
