"""Requests as coding agents and apps send them (Claude Code through the anthropic client, OpenAI-API apps through
the openai client) against a real server on loopback: what those clients parse, and what they send that the
plain API tests do not."""

from __future__ import annotations

import datetime

import anthropic
import httpx
import openai
import pytest

from .conftest import serve

MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def server(lm):
    with serve(lm, parallel=1) as r:
        yield r


@pytest.fixture(scope="module")
def anth(server):
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _claude_code_system(stamp: str) -> list[dict]:
    return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; "
                                     f"cch={stamp};"},
            {"type": "text", "text": "You are a coding agent working in a repository. " * 12,
             "cache_control": {"type": "ephemeral"}}]


def test_claude_codes_billing_stamp_leaves_the_prompt_cache_working(anth):
    """Claude Code's first system block, an attribution line, carries a stamp that changes on every request; the
    rest of the prompt (its long system prompt, the conversation) is the same, and comes from the cache."""
    first = anth.messages.create(model="tiny", max_tokens=1, system=_claude_code_system("a5145"), messages=MSG)
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    second = anth.messages.create(model="tiny", max_tokens=1, system=_claude_code_system("9c0d2"), messages=MSG)
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == total
    assert second.usage.cache_read_input_tokens >= total - 1  # all but the token the engine evaluates again
    counts = {anth.messages.count_tokens(model="tiny", system=_claude_code_system(s), messages=MSG).input_tokens
              for s in ("a5145", "9c0d2")}
    assert counts == {total}


def test_a_system_prompt_without_the_stamp_is_kept_as_sent(server, anth):
    srv = server.state.server
    seen = []
    real = srv.render

    def spy(msgs, *a, **kw):
        seen.append(msgs[0]["content"])
        return real(msgs, *a, **kw)

    srv.render = spy
    try:
        text = "Mentions cch=a5145; in passing."
        anth.messages.count_tokens(model="tiny", system=text, messages=MSG)
        anth.messages.count_tokens(model="tiny", system=_claude_code_system("a5145"), messages=MSG)
    finally:
        del srv.render
    assert seen[0] == text
    assert seen[1] == _claude_code_system("a5145")[1]["text"]  # the attribution line left out, the rest as sent


def test_models_list_parses_in_both_clients(anth, oai):
    (m,) = anth.models.list().data
    assert (m.id, m.type, m.display_name) == ("tiny", "model", "tiny")
    assert isinstance(m.created_at, datetime.datetime) and m.created_at.tzinfo is not None
    page = anth.models.list()
    assert (page.has_more, page.first_id, page.last_id) == (False, "tiny", "tiny")
    one = anth.models.retrieve("tiny")
    assert one.type == "model" and one.created_at == m.created_at
    (o,) = oai.models.list().data
    assert (o.id, o.object, o.owned_by) == ("tiny", "model", "strata")
    assert o.created == int(m.created_at.timestamp())


@pytest.mark.parametrize("path", ["/v1/embeddings", "/embeddings"])
def test_embeddings_are_refused_by_name(server, oai, path):
    r = httpx.post(server.url + path, json={"model": "tiny", "input": "hello"}, timeout=30)
    assert r.status_code == 400
    assert "embeddings are not supported" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="embeddings are not supported"):
        oai.embeddings.create(model="tiny", input="hello")


@pytest.mark.parametrize("tool", [
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
    {"type": "bash_20250124", "name": "bash"},
])
def test_anthropics_own_tools_are_left_out(server, anth, tool):
    """A server tool (or a schema-less client tool of Anthropic's) among an agent's own: the request is served with
    the custom tools alone offered to the model (a 400 would cut the agent off this server)."""
    srv = server.state.server
    seen = []
    real = srv.render

    def spy(msgs, tools=None, *a, **kw):
        seen.append(tools)
        return real(msgs, tools, *a, **kw)

    custom = {"name": "get_weather", "description": "Weather of a city", "input_schema": SCHEMA}
    srv.render = spy
    try:
        m = anth.messages.create(model="tiny", max_tokens=2, messages=MSG, tools=[custom, tool])
        anth.messages.create(model="tiny", max_tokens=2, messages=MSG, tools=[{**custom, "type": "custom"}])
    finally:
        del srv.render
    assert m.stop_reason == "max_tokens"
    assert [[t["function"]["name"] for t in ts] for ts in seen] == [["get_weather"], ["get_weather"]]


@pytest.mark.parametrize("messages,where", [
    ([{"role": "user", "content": []}], "messages.0"),
    ([{"role": "user", "content": ""}], "messages.0"),
    ([*MSG, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": []}], "messages.2"),
    ([*MSG, {"role": "assistant", "content": []}, {"role": "user", "content": "And?"}], "messages.1"),
])
def test_an_empty_turn_is_refused_not_dropped(anth, messages, where):
    with pytest.raises(anthropic.BadRequestError, match=f"{where}: content must not be empty"):
        anth.messages.create(model="tiny", max_tokens=2, messages=messages)
    with pytest.raises(anthropic.BadRequestError, match=f"{where}: content must not be empty"):
        anth.messages.count_tokens(model="tiny", messages=messages)


def test_a_final_empty_assistant_turn_is_still_a_prefill(anth):
    m = anth.messages.create(model="tiny", max_tokens=2, messages=[*MSG, {"role": "assistant", "content": ""}])
    assert m.stop_reason == "max_tokens"


# the model's output, forced: a call, a second call, and text after them
_CALL = '<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"CITY\\"}}\\n</tool_call>'
TWO_CALLS = ('root ::= "Checking.\\n' + _CALL.replace("CITY", "Paris") + '\\n' + _CALL.replace("CITY", "Tokyo")
             + '\\nDone, that is all."')
O_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": SCHEMA}}]


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_gets_one_call(oai, stream):
    """tool_choice auto, parallel_tool_calls false: the generation ends with the first call (llama.cpp's call
    grammar ends it there), whatever the model would have written after it."""
    kw = dict(model="tiny", messages=MSG, tools=O_TOOLS, max_tokens=200, temperature=0,
              extra_body={"grammar": TWO_CALLS})
    if stream:
        with oai.chat.completions.stream(**kw, parallel_tool_calls=False) as st:
            for _ in st:
                pass
            r = st.get_final_completion()
    else:
        r = oai.chat.completions.create(**kw, parallel_tool_calls=False)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in ch.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]
    assert ch.message.content.strip() == "Checking."
    both = oai.chat.completions.create(**kw)  # parallel calls allowed (the default): both, and all the tokens
    assert [c.function.arguments for c in both.choices[0].message.tool_calls] == [
        '{"city": "Paris"}', '{"city": "Tokyo"}']
    if not stream:
        assert r.usage.completion_tokens < both.usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_disable_parallel_tool_use_gets_one_tool_use(server, anth, monkeypatch, stream):
    srv = server.state.server
    real = srv.finish_job

    def forced(job):  # the Anthropic API has no grammar field: the job gets the one an OpenAI request sends
        job.grammar = srv.gbnf_grammar(TWO_CALLS)
        return real(job)

    monkeypatch.setattr(srv, "finish_job", forced)
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": SCHEMA}]
    kw = dict(model="tiny", max_tokens=200, messages=MSG, tools=tools,
              tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    if stream:
        with anth.messages.stream(**kw) as st:
            m = st.get_final_message()
    else:
        m = anth.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "input", None)) for b in m.content] == [
        ("text", None), ("tool_use", {"city": "Paris"})]
    kw["tool_choice"] = {"type": "auto"}
    assert [b.input for b in anth.messages.create(**kw).content if b.type == "tool_use"] == [
        {"city": "Paris"}, {"city": "Tokyo"}]


@pytest.mark.parametrize("path,body,expected", [
    ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "foo", "text": "x"}]}]},
     ("messages.0.content.0:", "'foo'")),
    ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}, {"type": "tool_use", "name": "get_weather", "input": {}}]}]},
     ("messages.0.content.1.id: Field required",)),
    ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "tool_reference", "tool_name": "x"}]}]}]},
     ("messages.0.content.0.content.0:", "'tool_reference'")),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "foo", "text": "x"}]}]},
     ("messages.0.content.0:", "'foo'")),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     ("messages.0.content.0.text: Field required",)),
])
def test_a_bad_content_block_is_one_error_naming_it(server, path, body, expected):
    """Not one error per kind of block the value is not (pydantic's union branches, 'content.str: Input should
    be a valid string' and such): the block, where it is, and what is wrong with it."""
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert msg.startswith(expected[0]) and all(x in msg for x in expected[1:]), msg
    assert ";" not in msg and "union" not in msg and ".str" not in msg, msg
