"""The Messages API's request parameters as the official anthropic client sends them, against a real server on
loopback: each one either does what Anthropic's API does with it, or is one clear 400."""

from __future__ import annotations

import json

import anthropic
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
