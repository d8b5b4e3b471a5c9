"""The Messages API's request parameters as the official anthropic client sends them, against a real server on
loopback: each one either does what Anthropic's API does with it, or is one clear 400."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from .conftest import serve

MSG = [{"role": "user", "content": "Is Paris in France?"}]
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture(scope="module")
def server(lm):
    with serve(lm, parallel=1) as r:
        yield r


@pytest.fixture(scope="module")
def anth(server):
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)


@pytest.mark.parametrize("stream", [False, True])
def test_output_config_format_makes_the_reply_json_of_the_schema(anth, stream):
    """Structured outputs (output_config.format): the reply's text is JSON of the schema, never free text that a
    client's json.loads fails on."""
    pytest.importorskip("llguidance")
    kw = dict(model="tiny", max_tokens=200, messages=MSG, thinking={"type": "disabled"},
              output_config={"format": {"type": "json_schema", "schema": ANSWER}})
    if stream:
        with anth.messages.stream(**kw) as st:
            m = st.get_final_message()
    else:
        m = anth.messages.create(**kw)
    assert m.stop_reason == "end_turn"
    text = "".join(b.text for b in m.content if b.type == "text")
    got = json.loads(text)
    assert set(got) == {"ok"} and isinstance(got["ok"], bool)


def test_output_config_format_needs_a_schema(anth):
    with pytest.raises(anthropic.BadRequestError, match="output_config.format.schema"):
        anth.messages.create(model="tiny", max_tokens=5, messages=MSG,
                             output_config={"format": {"type": "json_schema"}})


def test_the_stream_has_anthropics_event_order_and_a_ping(server):
    """message_start, ping (as Anthropic sends one), each block's start / deltas / stop, message_delta with the
    stop sequence that matched, message_stop; and nothing of the stop sequence in the text."""
    body = {"model": "tiny", "max_tokens": 30, "messages": MSG, "stream": True, "temperature": 0,
            "thinking": {"type": "disabled"}}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as r:
        free = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    text = "".join(e["delta"]["text"] for e in free if e["type"] == "content_block_delta")
    stop = text[5:12]
    assert len(stop) == 7
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stop_sequences": [stop]}, timeout=60) as r:
        lines = list(r.iter_lines())
    names = [line[7:] for line in lines if line.startswith("event: ")]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names == [e["type"] for e in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    middle = names[2:-2]
    assert middle[0] == "content_block_start" and middle[-1] == "content_block_stop"
    assert set(middle[1:-1]) == {"content_block_delta"}
    got = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert got == text[:5]
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}
