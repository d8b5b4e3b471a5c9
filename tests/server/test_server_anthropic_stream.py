"""A Messages API stream as Anthropic's: message_start's usage splits the prompt into the tokens read and those
reused from the prompt cache, as the final usage does; ping events keep a stream alive while a long prompt is read.
A real server on loopback and the official anthropic client."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from .conftest import serve

LONG = "Here is a long note about rivers, mountains and the towns between them. " * 30


@pytest.fixture(scope="module")
def server(lm):
    with serve(lm, parallel=1) as r:  # one slot: an unrelated request overwrites it (the conversation cache keeps it)
        yield r


@pytest.fixture(scope="module")
def anth(server):
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)


def _turn(anth, msgs, stream: bool):
    """The reply and, streamed, message_start's usage."""
    kw = dict(model="tiny", max_tokens=4, messages=msgs, thinking={"type": "disabled"}, extra_body={"temperature": 0})
    if not stream:
        return anth.messages.create(**kw), None
    with anth.messages.stream(**kw) as st:
        starts = [ev.message.usage for ev in st if ev.type == "message_start"]
        m = st.get_final_message()
    assert len(starts) == 1
    return m, starts[0]


@pytest.mark.parametrize("stream", [False, True])
def test_a_second_turn_reports_the_reused_prefix_as_cache_read(server, anth, stream):
    """The second turn's prompt begins with the first turn's, whose KV the conversation cache kept when another
    prompt took the slot: those tokens are cache_read_input_tokens, in message_start as in the final usage (which
    the non-streaming reply has too), and input_tokens are the rest."""
    cache = server.state.server.worker.cache
    msgs = [{"role": "user", "content": f"({stream}) " + LONG[:600] + "What flows?"}]
    first, _ = _turn(anth, msgs, stream)
    anth.messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "Unrelated: 2 + 2?"}])
    restores = cache.restores
    msgs += [{"role": "assistant", "content": first.content[0].text if first.content else "Water."},
             {"role": "user", "content": "And then?"}]
    second, start = _turn(anth, msgs, stream)
    assert cache.restores == restores + 1  # the first turn's KV came back from RAM
    u = second.usage
    n = anth.messages.count_tokens(model="tiny", messages=msgs, thinking={"type": "disabled"}).input_tokens
    assert u.input_tokens + u.cache_read_input_tokens == n
    # (most of the first prompt: the turn's end renders again a little differently)
    assert u.cache_read_input_tokens > (first.usage.input_tokens + first.usage.cache_read_input_tokens) // 2
    assert u.cache_creation_input_tokens == 0
    if stream:
        assert (start.input_tokens, start.cache_read_input_tokens, start.cache_creation_input_tokens) == \
            (u.input_tokens, u.cache_read_input_tokens, 0)
        assert start.output_tokens == 0


def test_pings_keep_a_stream_alive_while_a_long_prompt_is_read(lm):
    """A prompt read in many chunks sends nothing for a while; the stream sends ping events meanwhile (at the
    server's interval, here a tiny one so that the chunks surely outlast it), after message_start, and the
    anthropic client reads the stream as ever."""
    with serve(lm, parallel=1, prefill_chunk=16, ping_s=0.001) as s:
        body = {"model": "tiny", "max_tokens": 3, "temperature": 0, "stream": True,
                "thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": LONG[:1300]}]}
        with httpx.stream("POST", s.url + "/v1/messages", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = list(r.iter_lines())
        names = [line[7:] for line in lines if line.startswith("event: ")]
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
        assert names == [e["type"] for e in events]
        assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
        leading = next(i for i, n in enumerate(names) if i and n != "ping")  # the first event that is not a ping
        assert leading >= 3, names  # more pings than the one after message_start
        assert events[-2]["usage"]["input_tokens"] > 16 * 10  # (many chunks)
        a = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0, timeout=60)
        kw = {k: v for k, v in body.items() if k not in ("stream", "temperature")}
        with a.messages.stream(**kw, extra_body={"temperature": 0}) as st:
            m = st.get_final_message()
        text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
        assert "".join(b.text for b in m.content if b.type == "text") == text


def test_a_stream_waiting_for_a_slot_starts_and_pings(lm):
    """One slot, busy with a long request: a second request's stream does not sit silent in the queue. It sends
    message_start (its whole prompt as input_tokens: no slot yet, so nothing reused) and pings until its slot comes,
    then its text; message_delta's usage counts the same prompt, and the text equals the same request's on an idle
    server."""
    import threading
    import time

    with serve(lm, parallel=1, ping_s=0.05) as s:
        def body(text, n, stream):
            return {"model": "tiny", "max_tokens": n, "temperature": 0, "stream": stream,
                    "thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": text}]}

        alone = httpx.post(s.url + "/v1/messages", json=body("Waiting in line?", 6, False), timeout=60).json()
        busy = threading.Thread(target=lambda: httpx.post(
            s.url + "/v1/messages", json={**body(LONG[:400], 400, False), "ignore_eos": True}, timeout=120))
        busy.start()
        deadline = time.monotonic() + 60
        while not httpx.get(s.url + "/slots", timeout=30).json()[0]["is_processing"]:
            assert time.monotonic() < deadline, "the long request never took the slot"
            time.sleep(0.01)
        with httpx.stream("POST", s.url + "/v1/messages", json=body("Waiting in line?", 6, True), timeout=120) as r:
            assert r.status_code == 200
            lines = list(r.iter_lines())
        busy.join()
    names = [line[7:] for line in lines if line.startswith("event: ")]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names == [e["type"] for e in events]
    first_block = names.index("content_block_start")
    assert names[0] == "message_start" and names[1:first_block].count("ping") >= 3, names[:12]
    start = events[0]["message"]["usage"]
    final = events[-2]["usage"]
    assert start["cache_read_input_tokens"] == 0
    assert start["input_tokens"] == final["input_tokens"] + final["cache_read_input_tokens"] == \
        alone["usage"]["input_tokens"] + alone["usage"]["cache_read_input_tokens"]
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == "".join(b["text"] for b in alone["content"] if b["type"] == "text")
