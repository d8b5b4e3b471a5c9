"""The official openai and anthropic clients against a real server on loopback, serving the tiny model.

A random-weight model writes noise, so structure is forced the way a user would force it: `tool_choice`
required/named (the server constrains output to the model's tool-call format with a grammar) and
`response_format` json_schema. The server's parsers then turn the model's own tokens into API objects.
"""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest

from .conftest import CTX, serve

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                   "required": ["city"]}}}]
A_TOOLS = [{"name": "get_weather", "description": "Weather of a city",
            "input_schema": TOOLS[0]["function"]["parameters"]}]
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"extra_body": {"temperature": 0}}  # the anthropic client has no temperature argument any more


_http = httpx.Client(timeout=60)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def anth(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def test_health_models_props_slots(server):
    h = _http.get(server.url + "/health").json()
    assert h["status"] == "ok"
    models = openai.OpenAI(base_url=server.url + "/v1", api_key="x").models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].meta["structured_output"] == "constrained"
    props = _http.get(server.url + "/props").json()
    assert props["total_slots"] == 2 and props["default_generation_settings"]["n_ctx"] == CTX
    assert "<|im_start|>" in props["chat_template"]
    slots = _http.get(server.url + "/slots").json()
    assert [s["id"] for s in slots] == [0, 1]


def test_chat_non_stream_and_stream_agree(oai):
    r = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, temperature=0, seed=1)
    assert r.object == "chat.completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 5
    t = r.model_extra["timings"]
    assert t["predicted_n"] == 6 and t["prompt_n"] + t["cache_n"] == r.usage.prompt_tokens
    assert t["prompt_ms"] > 0 and t["predicted_per_second"] > 0 and t["draft_n"] == 0
    chunks = list(oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_roles_and_content_parts(oai):
    r = oai.chat.completions.create(model="tiny", max_tokens=2, temperature=0, messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}])
    assert r.choices[0].message.role == "assistant"


def test_sampling_seeded_and_penalties(oai):
    kw = dict(model="tiny", messages=MSG, max_tokens=8, temperature=1.0, top_p=0.9, seed=7,
              presence_penalty=0.5, frequency_penalty=0.5, extra_body={"min_p": 0.01, "top_k": 50})
    a = oai.chat.completions.create(**kw).choices[0].message.content
    b = oai.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_logit_bias_forces_a_token(oai, lm):
    tid = lm.tokenizer.encode(" Paris", add_special=False)[0]
    r = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, temperature=0,
                                    logit_bias={str(tid): 100})
    assert r.choices[0].message.content == lm.tokenizer.decode([tid] * 4)


def test_stop_string(oai, lm):
    full = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=8, temperature=0)
    text = full.choices[0].message.content
    stop = text[3:5]
    assert stop and text.find(stop) == 3
    r = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=8, temperature=0, stop=[stop])
    assert r.choices[0].message.content == text[:3] and r.choices[0].finish_reason == "stop"


def test_completions(oai):
    r = oai.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.usage.completion_tokens == 5
    s = "".join(c.choices[0].text for c in oai.completions.create(model="tiny", prompt="Once upon a time",
                                                                     max_tokens=5, temperature=0, stream=True))
    assert s == r.choices[0].text


def test_json_schema_response(oai):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer",
                                                                               "minimum": 0, "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    r = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=40, temperature=0,
                                    response_format={"type": "json_schema",
                                                     "json_schema": {"name": "x", "schema": schema, "strict": True}})
    v = json.loads(r.choices[0].message.content)
    assert set(v) == {"ok", "n"} and isinstance(v["ok"], bool) and 0 <= v["n"] <= 9


def test_openai_tool_round_trip(oai):
    r = oai.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_tokens=120, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Tokyo")
    # the same call, streamed as tool-call deltas
    chunks = list(oai.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, max_tokens=120,
                                              tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                              parallel_tool_calls=False, temperature=0, stream=True))
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == json.loads(call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the result goes back; the model answers in text (tool_choice auto)
    msgs = MSG + [ch.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    final = oai.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=5, temperature=0)
    assert final.choices[0].finish_reason == "length" and final.choices[0].message.content
    assert final.usage.prompt_tokens > r.usage.prompt_tokens


def test_anthropic_messages(anth):
    m = anth.messages.create(model="tiny", max_tokens=6, system="Be brief.", messages=MSG, **GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "max_tokens"
    assert m.content[0].type == "text" and m.usage.output_tokens == 6
    with anth.messages.stream(model="tiny", max_tokens=6, system="Be brief.", messages=MSG, **GREEDY) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert final.content[0].text == m.content[0].text
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_stop" in events and "message_delta" in events


def test_anthropic_count_tokens(anth, oai):
    n = anth.messages.count_tokens(model="tiny", messages=MSG, system="Be brief.").input_tokens
    m = anth.messages.create(model="tiny", max_tokens=1, system="Be brief.", messages=MSG)
    assert n == m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert anth.messages.count_tokens(model="tiny", messages=MSG, tools=A_TOOLS).input_tokens > n


def test_anthropic_tool_round_trip(anth):
    m = anth.messages.create(model="tiny", max_tokens=120, messages=MSG, tools=A_TOOLS,
                             tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                             **GREEDY)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"] in ("Paris", "Tokyo")
    with anth.messages.stream(model="tiny", max_tokens=120, messages=MSG, tools=A_TOOLS,
                              tool_choice={"type": "any", "disable_parallel_tool_use": True}, **GREEDY) as s:
        streamed = s.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [use.input]
    msgs = MSG + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}]}]
    final = anth.messages.create(model="tiny", max_tokens=5, messages=msgs, tools=A_TOOLS)
    assert final.stop_reason == "max_tokens" and final.content[0].type == "text"


def test_conversation_cache_second_turn(oai):
    first = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, temperature=0)
    msgs = MSG + [{"role": "assistant", "content": first.choices[0].message.content},
                  {"role": "user", "content": "And tomorrow?"}]
    second = oai.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens
    assert second.model_extra["timings"]["prompt_n"] == second.usage.prompt_tokens - cached
    off = oai.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0,
                                      extra_body={"cache_prompt": False})
    assert off.usage.prompt_tokens_details.cached_tokens == 0
    assert off.choices[0].message.content == second.choices[0].message.content


def test_conversation_cache_survives_other_conversations(lm):
    """One slot, three conversations in turn: the first one's second turn comes back from RAM."""
    def turn2(url):
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        conv = [{"role": "user", "content": "Tell me about the history of the city of Paris in a few words."}]
        a = c.chat.completions.create(model="tiny", messages=conv, max_tokens=4, temperature=0)
        for other in ("Something else entirely, about Tokyo and its trains.", "A third one: quantum physics."):
            c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": other}], max_tokens=4,
                                      temperature=0)
        conv += [{"role": "assistant", "content": a.choices[0].message.content},
                 {"role": "user", "content": "More."}]
        b = c.chat.completions.create(model="tiny", messages=conv, max_tokens=4, temperature=0)
        return a.usage.prompt_tokens, b.usage.prompt_tokens_details.cached_tokens

    with serve(lm, parallel=1, prompt_cache_mib=64) as s:
        n1, cached = turn2(s.url)
        assert cached >= n1
        assert s.state.metrics.prompt_cache.restores >= 1
    with serve(lm, parallel=1, prompt_cache_mib=0) as s:
        n1, cached = turn2(s.url)
        assert cached < n1 // 2  # only the template's opening tokens are shared


def test_reasoning_split(thinking_lm):
    """A template whose generation prompt opens <think>: the model's output is reasoning, reasoning_effort
    'none' turns it off, and a forced tool call closes the block first."""
    with serve(thinking_lm, parallel=1) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, temperature=0)
        msg = r.choices[0].message
        assert msg.model_extra.get("reasoning_content") and not msg.content
        streamed = list(c.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, temperature=0,
                                                  stream=True))
        rs = "".join((ch.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for ch in streamed)
        assert rs == msg.model_extra["reasoning_content"]
        off = c.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, temperature=0,
                                        reasoning_effort="none")
        assert off.choices[0].message.content and not off.choices[0].message.model_extra.get("reasoning_content")
        t = c.chat.completions.create(model="tiny", messages=MSG, max_tokens=120, temperature=0, tools=TOOLS,
                                      tool_choice="required", parallel_tool_calls=False)
        assert t.choices[0].finish_reason == "tool_calls"
        a = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0)
        m = a.messages.create(model="tiny", max_tokens=6, messages=MSG, **GREEDY)
        assert [b.type for b in m.content] == ["thinking"]
        assert m.content[0].thinking == msg.model_extra["reasoning_content"]
        with a.messages.stream(model="tiny", max_tokens=6, messages=MSG, **GREEDY) as st:
            fm = st.get_final_message()
        assert [b.type for b in fm.content] == ["thinking"] and fm.content[0].thinking == m.content[0].thinking
        m2 = a.messages.create(model="tiny", max_tokens=6, messages=MSG, thinking={"type": "disabled"})
        assert [b.type for b in m2.content] == ["text"]


def test_metrics(server, oai):
    oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=3, temperature=0)
    text = _http.get(server.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:spec_decode_num_drafts_total", "strata_expert_hit_rate",
                 "strata_cpu_experts_per_token", "strata_pcie_experts_per_token", "strata_expert_swaps_total",
                 "strata_expert_cache_vram_bytes"):
        assert name in text, name
    j = _http.get(server.url + "/metrics?format=json").json()
    assert set(j) == set(_http.get(server.url + "/metrics", headers={"Accept": "application/json"}).json())
    assert j["state"]["status"] in ("idle", "reading", "generating")
    assert j["settings"]["parallel"] == 2 and j["totals"]["requests"] >= 1
    assert j["recent_requests"][-1]["completion_tokens"] == 3
    assert "ram" in j["machine"] and "gpus" in j["machine"]


def test_ignore_eos_generates_max_tokens(server):
    """llama.cpp's `ignore_eos`: exactly max_tokens come back, whatever the model would have ended with."""
    r = _http.post(server.url + "/v1/completions", json={"prompt": "def f(", "max_tokens": 24, "temperature": 0,
                                                          "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 24 and body["choices"][0]["finish_reason"] == "length"
    assert body["timings"]["predicted_n"] == 24


def test_metrics_count_a_request_of_n_choices_once(server, oai):
    """n choices are one request with one prompt (as vLLM counts them); their tokens are all generated tokens."""
    def scrape():
        j = _http.get(server.url + "/metrics?format=json").json()["totals"]
        return j["requests"], j["prompt_tokens"], j["generated_tokens"]

    r0, p0, g0 = scrape()
    r = oai.completions.create(model="tiny", prompt="def f(", max_tokens=4, n=2, temperature=0.8, seed=1,
                               extra_body={"ignore_eos": True})
    deadline = time.time() + 10
    while scrape()[0] == r0 and time.time() < deadline:  # (metrics are fed by the engine thread)
        time.sleep(0.05)
    time.sleep(0.2)
    r1, p1, g1 = scrape()
    assert r1 - r0 == 1 and p1 - p0 == r.usage.prompt_tokens and g1 - g0 == 8


def test_aliases_are_listed_as_models(lm):
    """--alias names are models a client can pick from /v1/models (each its own card), and a 404 names them all."""
    with serve(lm, parallel=1, aliases=["foo", "bar"]) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x")
        assert [m.id for m in c.models.list()] == ["tiny", "bar", "foo"]
        assert c.models.retrieve("foo").id == "foo"
        r = _http.get(s.url + "/v1/models/nope")
        assert r.status_code == 404 and "'tiny', 'bar', 'foo'" in r.json()["error"]["message"]
