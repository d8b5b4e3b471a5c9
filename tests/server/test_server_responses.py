"""OpenAI's Responses API (POST /v1/responses) through the official openai client against a real server on loopback:
the response object and its output items, the typed stream events as the SDK parses and accumulates them, tool
calls and their results fed back, structured output, and the requests it refuses."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from .conftest import serve

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": SCHEMA,
          "strict": True},
         {"type": "function", "name": "get_time", "description": "The time in a city.", "parameters": SCHEMA}]
# the model's whole output, forced: a reasoning block, then the answer
FORCED = 'root ::= "<think>\\ndeep thought here\\n</think>\\n\\nthe answer"'
REASONING, ANSWER = "deep thought here", "the answer"


@pytest.fixture(scope="module")
def server(lm):
    with serve(lm, parallel=1) as r:
        yield r


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture
def forced(server, monkeypatch):
    """The Responses API has no grammar field: the job gets the grammar a chat request would send, so that the
    (random-weight) model writes FORCED."""
    srv = server.state.server
    real = srv.finish_job

    def force(job):
        job.grammar = srv.gbnf_grammar(FORCED)
        return real(job)

    monkeypatch.setattr(srv, "finish_job", force)


def _tokens(server, text: str) -> int:
    return len(server.state.server.tok.encode(text, add_special=False))


def test_plain_text_response(server, client, forced):
    r = client.responses.create(model="tiny", input="Think about it.", instructions="Be brief.", temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    assert r.status == "completed" and r.incomplete_details is None
    assert [o.type for o in r.output] == ["reasoning", "message"]
    think, msg = r.output
    assert think.summary == [] and [(c.type, c.text) for c in think.content] == [("reasoning_text", REASONING)]
    assert msg.role == "assistant" and msg.status == "completed"
    assert [(c.type, c.text, c.annotations) for c in msg.content] == [("output_text", ANSWER, [])]
    assert r.output_text == ANSWER  # (the SDK's convenience, from the message items)
    u = r.usage
    assert u.output_tokens_details.reasoning_tokens == _tokens(server, REASONING)
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.input_tokens > 0
    # the same conversation as a chat completion (the same forced output) counts the same tokens
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                                                 {"role": "user", "content": "Think about it."}])
    assert chat.choices[0].message.content == ANSWER
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (u.input_tokens, u.output_tokens)
    again = client.responses.create(model="tiny", input="Think about it.", instructions="Be brief.").usage
    assert again.input_tokens_details.cached_tokens >= u.input_tokens - 1  # the prompt, from the cache


def test_reasoning_effort_none_turns_thinking_off(server, client):
    srv = server.state.server
    seen = []
    real = srv.render

    def spy(msgs, tools, thinking, *a, **kw):
        seen.append(thinking)
        return real(msgs, tools, thinking, *a, **kw)

    srv.render = spy
    try:
        client.responses.create(model="tiny", input="Hi", max_output_tokens=1, reasoning={"effort": "none"})
        client.responses.create(model="tiny", input="Hi", max_output_tokens=1, reasoning={"effort": "high"})
    finally:
        del srv.render
    assert seen == [False, True]


def test_max_output_tokens_makes_it_incomplete(client):
    r = client.responses.create(model="tiny", input="Talk for a long time.", max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3
    assert r.output and r.output[-1].status == "incomplete"
    events = list(client.responses.create(model="tiny", input="Talk for a long time.", max_output_tokens=3,
                                          temperature=0, stream=True))
    # OpenAI ends a response cut short with response.incomplete
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert events[-1].response.usage.output_tokens == 3


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"}])
def test_forced_tool_call_is_a_function_call_item(client, choice):
    r = client.responses.create(model="tiny", input="What is the weather in Paris?", tools=TOOLS,
                                tool_choice=choice, parallel_tool_calls=False, max_output_tokens=200, temperature=0)
    assert r.status == "completed"
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1
    c = calls[0]
    assert c.id.startswith("fc_") and c.call_id and c.status == "completed"
    if isinstance(choice, dict):
        assert c.name == "get_time"
    args = json.loads(c.arguments)
    assert args["city"] in ("Paris", "Rome") and set(args) == {"city"}


def test_function_call_output_round_trip(server, client):
    srv = server.state.server
    first = client.responses.create(model="tiny", input="Weather in Paris?", tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=200, temperature=0)
    (call,) = [o for o in first.output if o.type == "function_call"]
    seen = []
    real = srv.render

    def spy(msgs, *a, **kw):
        seen.append(msgs)
        return real(msgs, *a, **kw)

    srv.render = spy
    try:
        r = client.responses.create(
            model="tiny", tools=TOOLS, max_output_tokens=5,
            input=[{"role": "user", "content": "Weather in Paris?"},
                   {"type": "reasoning", "id": "rs_1", "summary": []},
                   call.model_dump(exclude_none=True),
                   {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    finally:
        del srv.render
    assert r.status in ("completed", "incomplete")
    (msgs,) = seen
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool"]
    assert msgs[1]["tool_calls"][0]["id"] == call.call_id
    assert msgs[1]["tool_calls"][0]["function"] == {"name": call.name, "arguments": call.arguments}
    assert (msgs[2]["tool_call_id"], msgs[2]["content"]) == (call.call_id, "sunny, 21 C")


def test_json_schema_text_format(client):
    # (a closed set of values: the random-weight model would write a free string up to max_output_tokens)
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "n": {"type": "boolean"}},
              "required": ["city", "n"], "additionalProperties": False}
    r = client.responses.create(model="tiny", input="A city, as JSON.", max_output_tokens=200, temperature=0,
                                text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                                                 "strict": True}})
    assert r.status == "completed", r.output_text
    v = json.loads(r.output_text)
    assert set(v) == {"city", "n"} and v["city"] in ("Paris", "Rome") and isinstance(v["n"], bool)
    # json_object: any object (the random-weight model writes free keys until the limit: only its start is known)
    r = client.responses.create(model="tiny", input="JSON, please.", max_output_tokens=8, temperature=0,
                                text={"format": {"type": "json_object"}})
    assert r.output_text.lstrip().startswith("{"), r.output_text


def test_stream_events_parse_and_build_the_final_response(client, forced):
    with client.responses.stream(model="tiny", input="Think about it.") as s:
        events = list(s)
        final = s.get_final_response()
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert (thought, text) == (REASONING, ANSWER)
    assert len([t for t in types if t == "response.output_text.delta"]) > 1  # streamed in pieces
    assert final.output_text == ANSWER and final.status == "completed"
    assert [o.type for o in final.output] == ["reasoning", "message"]
    # each item: added, its content part, deltas, then done events, in OpenAI's order
    msg = [t for t, e in zip(types, events) if getattr(e, "output_index", None) == 1]
    assert msg[:2] == ["response.output_item.added", "response.content_part.added"]
    assert msg[-3:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    done = [e for e in events if e.type == "response.output_text.done"]
    assert [e.text for e in done] == [ANSWER]


def test_stream_of_a_tool_call(client):
    events = list(client.responses.create(model="tiny", input="Weather?", tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, max_output_tokens=200, stream=True, temperature=0))
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types and types[-1] == "response.completed"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == args and set(json.loads(args)) == {"city"}
    (item,) = [o for o in events[-1].response.output if o.type == "function_call"]
    assert item.arguments == args and item.status == "completed"


def test_a_client_that_leaves_a_stream_stops_its_generation(server):
    body = {"model": "tiny", "input": "Talk for a long time.", "max_output_tokens": 400, "temperature": 0,
            "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.url + "/v1/responses", json=body) as resp:
            assert resp.status_code == 200
            n = 0
            for line in resp.iter_lines():
                n += line.startswith("event: response.output_text.delta")
                if n >= 2:
                    break
    t0 = time.time()
    while httpx.get(server.url + "/health").json()["slots_idle"] != 1:
        assert time.time() - t0 < 60, "the slot stayed busy after the client left"
        time.sleep(0.05)
    rec = httpx.get(server.url + "/metrics?format=json").json()["recent_requests"][-1]
    assert rec["finish_reason"] == "abort" and rec["completion_tokens"] < 400


@pytest.mark.parametrize("kw, message", [
    (dict(input="Hi", tools=[{"type": "web_search"}]), "tools of type 'web_search' are not supported"),
    (dict(input="Hi", tools=[{"type": "file_search", "vector_store_ids": ["vs_1"]}]),
     "tools of type 'file_search' are not supported"),
    (dict(input="Hi", previous_response_id="resp_123"), "previous_response_id is not supported"),
    (dict(input=""), "input: must not be empty"),
    (dict(input=[]), "input: must not be empty"),
    (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input items of type 'item_reference'"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]),
     "content parts of type 'input_image' are not supported"),
    (dict(input=[{"type": "function_call_output", "call_id": "call_9", "output": "x"}]),
     "call_id 'call_9', which no function_call"),
    (dict(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]),
     "input.0: arguments must be a JSON object"),
    (dict(input="Hi", tool_choice="required"), "tool_choice 'required' needs tools"),
    (dict(input="Hi", text={"format": {"type": "json_schema", "name": "x"}}), "json_schema format needs its schema"),
    (dict(input="Hi", tools=TOOLS, tool_choice={"type": "web_search_preview"}), "tool_choice of type"),
])
def test_bad_requests_are_400s_that_say_why(client, kw, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", **kw)
    assert e.value.status_code == 400
    assert message in e.value.body["message"], e.value.body
    assert e.value.body["type"] == "invalid_request_error"


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-5", input="Hi")
