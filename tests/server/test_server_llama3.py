"""A real server whose model carries Llama 3.1's chat template (the embedded synthetic model, a GGUF copy with the
template swapped in): the `llama3` tool-call format end to end."""

from __future__ import annotations

import json
import os
import pathlib

import httpx
import openai
import pytest

from gguf_rewrite import rewrite
from tests.server.conftest import serve

pytest.importorskip("llguidance")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                                           "required": ["zone"]}}}]
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_gguf, llamacpp_models_dir, tmp_path_factory):
    from strata.config import EngineConfig
    from strata.engine.loader import load_model

    src = (llamacpp_models_dir / "templates" / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text(encoding="utf-8")
    path = rewrite(tiny_gguf, tmp_path_factory.mktemp("llama3") / "llama3-template.gguf",
                   meta={"tokenizer.chat_template": src})
    # the template's tool prompt is long
    lm = load_model(str(path), EngineConfig(model=str(path), device="cpu", ctx_size=2048))
    with serve(lm, parallel=1) as r:
        yield r


@pytest.fixture(scope="module")
def llamacpp_models_dir():
    root = pathlib.Path(__file__).resolve().parents[2]  # as tests/conftest.py finds it
    models = pathlib.Path(os.environ.get("STRATA_TESTDATA", root / "tests" / "data")) / "llama.cpp-models"
    if not models.is_dir():
        pytest.skip(f"test data not found at {models}")
    return models


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _valid(name: str, args: dict) -> None:
    """The arguments follow the tool's schema (the parts these tools use)."""
    params = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
    props = params["properties"]
    assert set(args) == set(params["required"]) and set(args) <= set(props), args
    for k, v in args.items():
        p = props[k]
        if p["type"] == "string":
            assert isinstance(v, str) and ("enum" not in p or v in p["enum"]), (k, v)
            assert len(v) <= p.get("maxLength", len(v)), (k, v)
        else:
            assert isinstance(v, int) and not isinstance(v, bool) and p.get("minimum", v) <= v <= p.get("maximum", v)


def _chat(oai, stream, **kw):
    """(content, [(id, name, arguments)], finish_reason), streamed or not."""
    if not stream:
        ch = oai.chat.completions.create(model="tiny", temperature=0, **kw).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in ch.message.tool_calls or []]
        return ch.message.content, calls, ch.finish_reason
    content, calls, finish = [], {}, None
    for c in oai.chat.completions.create(model="tiny", temperature=0, stream=True, **kw):
        if not c.choices:
            continue
        d = c.choices[0].delta
        content.append(d.content or "")
        for tc in d.tool_calls or []:
            i, name, args = calls.get(tc.index, (None, "", ""))
            calls[tc.index] = (i or tc.id, name + (tc.function.name or ""), args + (tc.function.arguments or ""))
        finish = c.choices[0].finish_reason or finish
    return "".join(content), list(calls.values()), finish


def test_props_report_llama3(server):
    props = httpx.get(server.url + "/props").json()
    assert props["tool_call_format"] == "llama3"
    assert "<|start_header_id|>ipython<|end_header_id|>" in props["chat_template"]


@pytest.mark.parametrize("stream", [False, True])
def test_required_gives_one_call_and_its_history_renders(oai, stream):
    """tool_choice required, parallel calls asked for: exactly one call (the template takes one), its arguments
    follow the schema; sent back with its result, the history renders (no "single tool-calls" error)."""
    content, calls, finish = _chat(oai, stream, messages=MSG, tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=True, max_tokens=120)
    assert not content and finish == "tool_calls" and len(calls) == 1, (content, calls, finish)
    cid, name, args = calls[0]
    assert name in ("get_weather", "get_time")
    _valid(name, json.loads(args))
    history = MSG + [{"role": "assistant", "content": None,
                      "tool_calls": [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}]},
                     {"role": "tool", "tool_call_id": cid, "content": "sunny, 21 C"}]
    r = oai.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_named_call(oai):
    named = {"type": "function", "function": {"name": "get_time"}}
    content, calls, finish = _chat(oai, False, messages=MSG, tools=TOOLS, tool_choice=named, max_tokens=120)
    assert not content and finish == "tool_calls" and [c[1] for c in calls] == ["get_time"]
    _valid("get_time", json.loads(calls[0][2]))


@pytest.mark.parametrize("stream", [False, True])
def test_free_output_in_llama3_json_is_a_call(oai, stream):
    """tool_choice auto: the model's own `{"name": ..., "parameters": ...}` (here forced by a GBNF grammar, behind
    <|python_tag|> written as text) comes back as the call, not content; a second call is left out."""
    call = '{"name": "get_weather", "parameters": {"city": "Tokyo", "days": 3}}'
    g = "root ::= " + json.dumps(f"<|python_tag|>{call}; {call}")
    content, calls, finish = _chat(oai, stream, messages=MSG, tools=TOOLS, max_tokens=200,
                                   extra_body={"grammar": g})
    assert not content and finish == "tool_calls", (content, calls)
    assert [(n, json.loads(a)) for _, n, a in calls] == [("get_weather", {"city": "Tokyo", "days": 3})]
    g = "root ::= " + json.dumps(f"It is sunny. {call}")  # not at the start: prose, as llama.cpp reads it
    content, calls, finish = _chat(oai, stream, messages=MSG, tools=TOOLS, max_tokens=200, extra_body={"grammar": g})
    assert content == f"It is sunny. {call}" and not calls and finish == "stop"
