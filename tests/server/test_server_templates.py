"""Real chat templates behind the server: the tiny model served with another template swapped into its metadata,
the conversation rendered on the server's own path (request body -> chat_messages / to_chat -> Server.render)
and compared with transformers' renderer, and tool-call round trips through the official clients."""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import anthropic
import httpx
import openai
import pytest

from strata.gguf.chat_template import ChatTemplate
from strata.server.openai_api import chat_messages
from strata.server.protocol import ChatRequest
from strata.server.template_inputs import short_id

from .conftest import serve

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                   "required": ["city"]}}}]
A_TOOLS = [{"name": "get_weather", "description": "Weather of a city",
            "input_schema": TOOLS[0]["function"]["parameters"]}]
ASK = {"role": "user", "content": "Weather in Paris?"}
ARGS = '{"city": "Paris"}'
_http = httpx.Client(timeout=120)


@pytest.fixture(scope="module")
def big_lm(tiny_gguf):
    """The tiny model with room for Mistral Small's long default system prompt (over 1200 tokens)."""
    from strata.config import EngineConfig
    from strata.engine.loader import load_model

    return load_model(str(tiny_gguf), EngineConfig(model=str(tiny_gguf), device="cpu", ctx_size=2048))


def with_template(lm, source: str):
    """The same weights with `source` as the GGUF's chat template: the metadata too, so that the server detects
    the template's tool-call format from it as it does for a real model file."""
    g = copy.copy(lm.gguf)
    g.metadata = {**lm.gguf.metadata, "tokenizer.chat_template": source}
    return dataclasses.replace(lm, gguf=g, template=ChatTemplate.from_metadata(g.metadata))


def _template(llamacpp_models, name: str) -> str:
    return (llamacpp_models / "templates" / f"{name}.jinja").read_text(encoding="utf-8")


def _hf(source: str, messages: list[dict], tmpl: ChatTemplate) -> str:
    """transformers' renderer on the messages as given (its 5.x clean-up, which drops `content: None`, left out:
    a template that tests `content is none` was written for the message as the client sends it)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    out, _ = render_jinja_template([copy.deepcopy(messages)], chat_template=source, add_generation_prompt=True,
                                   bos_token=tmpl.bos_token, eos_token=tmpl.eos_token)
    return out[0]


def _call_turn(content, arguments, call_id="call00001"):
    return [ASK, {"role": "assistant", "content": content, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "21 C"}]


# (template, what it is given for a call-only turn: content None?, arguments as the client's string?)
SHAPES = [
    ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", True, True),  # `content is none`; concatenates arguments
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", True, False),  # `content is none`; tojson of the arguments
    ("meetkai-functionary-medium-v3.2", True, True),  # concatenates arguments ("str" + dict: TypeError)
    ("meta-llama-Llama-3.1-8B-Instruct", True, False),
    ("Qwen-Qwen3-0.6B", False, False),  # `'<think>' in content` fails on None
]


@pytest.mark.parametrize("name,null,text_args", SHAPES, ids=[s[0] for s in SHAPES])
def test_call_turn_renders_as_the_template_takes_it(llamacpp_models, lm, name, null, text_args):
    source = _template(llamacpp_models, name)
    lm2 = with_template(lm, source)
    # what an OpenAI client sends: content null, arguments a JSON string
    body = ChatRequest.model_validate({"messages": _call_turn(None, ARGS)})
    with serve(lm2, parallel=1) as s:
        got = s.state.server.render(chat_messages(body), None, None)
        r = _http.post(s.url + "/v1/chat/completions", json={
            "messages": _call_turn(None, ARGS), "max_tokens": 1, "temperature": 0})
    want = _hf(source, _call_turn(None if null else "", ARGS if text_args else json.loads(ARGS)), lm2.template)
    assert got == want
    assert "get_weather" in got and "Paris" in got  # the call is in the prompt
    assert '\\"city' not in got  # and its arguments are not a JSON-quoted string
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(s.state.server.encode_chat(got))


def test_call_turn_content_none_keeps_the_call(llamacpp_models, lm):
    """DeepSeek-R1-Distill writes an assistant turn's calls only when its content is None; with "" (what the
    server used to pass) the call was dropped from the prompt."""
    source = _template(llamacpp_models, "deepseek-ai-DeepSeek-R1-Distill-Llama-8B")
    tmpl = ChatTemplate(source)
    assert "get_weather" not in tmpl.render(_call_turn("", ARGS))
    with serve(with_template(lm, source), parallel=1) as s:
        for content in (None, "", []):  # no text, however the client says it
            body = ChatRequest.model_validate({"messages": _call_turn(content, ARGS)})
            assert "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather" in s.state.server.render(
                chat_messages(body), None, None)


def test_bad_arguments_still_refused(server):
    r = _http.post(server.url + "/v1/chat/completions", json={"messages": _call_turn(None, "[1, 2]"),
                                                              "max_tokens": 1})
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]


def test_anthropic_tool_use_only_turn_is_content_none(llamacpp_models, lm):
    source = _template(llamacpp_models, "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B")
    with serve(with_template(lm, source), parallel=1) as s:
        c = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0, timeout=120)
        msgs = [ASK, {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "21 C"}]}]
        n = c.messages.count_tokens(model="tiny", messages=msgs).input_tokens
        want = _hf(source, _call_turn(None, {"city": "Paris"}, "toolu_01"), s.state.server.template)
        assert "get_weather" in want
        assert n == len(s.state.server.encode_chat(want))


# ---------------------------------------------------------------------------------------------------------------
# Mistral: tool-call ids of 9 alphanumerics

MISTRAL = ["Mistral-Small-3.2-24B-Instruct-2506", "mistralai-Mistral-Nemo-Instruct-2407"]
NINE = re.compile(r"[A-Za-z0-9]{9}")


@pytest.mark.parametrize("name", MISTRAL)
def test_mistral_tool_round_trip(llamacpp_models, big_lm, name):
    source = _template(llamacpp_models, name)
    with serve(with_template(big_lm, source), parallel=1) as s:
        assert _http.get(s.url + "/props").json()["tool_call_format"] == "mistral"
        oai = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
        r = oai.chat.completions.create(model="tiny", messages=[ASK], tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=60, temperature=0)
        (call,) = r.choices[0].message.tool_calls
        assert NINE.fullmatch(call.id), call.id  # an id the template accepts when it comes back
        chunks = list(oai.chat.completions.create(model="tiny", messages=[ASK], tools=TOOLS, tool_choice="required",
                                                  parallel_tool_calls=False, max_tokens=60, temperature=0,
                                                  stream=True))
        first = next(tc for c in chunks for tc in (c.choices[0].delta.tool_calls or []))
        assert NINE.fullmatch(first.id)
        # the result goes back with the server's id
        msgs = [ASK, r.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "21 C"}]
        final = oai.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=3, temperature=0)
        assert final.choices[0].finish_reason == "length"
        assert final.usage.prompt_tokens_details.cached_tokens > 0  # the first turn's prefix rendered alike
        # a conversation from elsewhere, with OpenAI's long ids: mapped alike in the call and in its result
        long_id = "call_" + "0123456789abcdef01234567"
        msgs = [ASK, {"role": "assistant", "content": None, "tool_calls": [
                    {"id": long_id, "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
                {"role": "tool", "tool_call_id": long_id, "content": "21 C"}]
        other = oai.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=3, temperature=0)
        assert other.choices[0].finish_reason == "length"
        text = s.state.server.render(chat_messages(ChatRequest.model_validate({"messages": msgs})), TOOLS, None)
        assert long_id not in text and text.count(short_id(long_id)) == 2
        # transformers renders the same text once given the mapped ids
        mapped = copy.deepcopy(msgs)
        mapped[1]["tool_calls"][0]["id"] = mapped[2]["tool_call_id"] = short_id(long_id)
        mapped[1]["tool_calls"][0]["function"]["arguments"] = json.loads(ARGS)
        from transformers.utils.chat_template_utils import render_jinja_template

        want = render_jinja_template([mapped], tools=TOOLS, chat_template=source, add_generation_prompt=True,
                                     bos_token=s.state.server.template.bos_token,
                                     eos_token=s.state.server.template.eos_token)[0][0]
        assert text == want
        with pytest.raises(Exception, match="alphanumeric strings with length 9"):
            ChatTemplate(source).render(msgs, tools=TOOLS)  # the client's ids as they are: refused

        # Anthropic: toolu_ ids go out, and come back accepted
        anth = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0, timeout=120)
        m = anth.messages.create(model="tiny", max_tokens=60, messages=[ASK], tools=A_TOOLS,
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                 extra_body={"temperature": 0})
        (use,) = [b for b in m.content if b.type == "tool_use"]
        assert use.id.startswith("toolu_") and NINE.fullmatch(use.id[6:])
        msgs = [ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}]}]
        final = anth.messages.create(model="tiny", max_tokens=3, messages=msgs, tools=A_TOOLS)
        assert final.stop_reason == "max_tokens"


def test_short_id_mapping():
    assert short_id("abcDEF123") == "abcDEF123"  # already what Mistral takes
    assert short_id("call_abcDEF123") == short_id("toolu_abcDEF123") == "abcDEF123"  # this server's own
    long_ids = [f"call_{i:024x}" for i in range(200)]
    mapped = [short_id(x) for x in long_ids]
    assert all(NINE.fullmatch(x) for x in mapped) and len(set(mapped)) == len(mapped)
    assert mapped == [short_id(x) for x in long_ids]  # stable: a conversation re-renders the same prefix


def test_other_templates_keep_long_ids(server):
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    r = oai.chat.completions.create(model="tiny", messages=[ASK], tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_tokens=120, temperature=0)
    assert r.choices[0].message.tool_calls[0].id.startswith("call_")


# ---------------------------------------------------------------------------------------------------------------
# /props: the KV cache types; history refusals; Anthropic's thinking budget


def test_props_report_kv_cache_types(lm, server):
    props = _http.get(server.url + "/props").json()
    assert props["cache_type_k"] == props["cache_type_v"] == "f32"  # the CPU's plain cache: the compute dtype
    lm2 = dataclasses.replace(lm, cfg=dataclasses.replace(lm.cfg, cache_type_k="q8_0", cache_type_v="f16"))
    with serve(lm2, parallel=1) as s:
        props = _http.get(s.url + "/props").json()
        assert (props["cache_type_k"], props["cache_type_v"]) == ("q8_0", "f16")
        settings = _http.get(s.url + "/metrics?format=json").json()["settings"]
        assert (settings["cache_type_k"], settings["cache_type_v"]) == ("q8_0", "f16")


def test_refusal_in_history_is_text(server):
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    refusal = "I can't help with that request at all."
    msgs = [{"role": "user", "content": "Something bad"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": refusal}]},
            {"role": "user", "content": "Fine, the weather then?"}]
    r = oai.chat.completions.create(model="tiny", messages=msgs, max_tokens=1)
    text = server.state.server.render(chat_messages(ChatRequest.model_validate({"messages": msgs})), None, None)
    assert refusal in text
    assert r.usage.prompt_tokens == len(server.state.server.encode_chat(text))
    msgs[0]["content"] = [{"type": "refusal", "refusal": refusal}]  # a user does not refuse
    with pytest.raises(openai.BadRequestError, match="assistant message"):
        oai.chat.completions.create(model="tiny", messages=msgs, max_tokens=1)


def test_anthropic_thinking_budget_limits(server):
    anth = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError, match="at least 1024"):
        anth.messages.create(model="tiny", max_tokens=100, messages=[ASK],
                             thinking={"type": "enabled", "budget_tokens": 500})
    with pytest.raises(anthropic.BadRequestError, match=r"less than max_tokens \(100\)"):
        anth.messages.create(model="tiny", max_tokens=100, messages=[ASK],
                             thinking={"type": "enabled", "budget_tokens": 2048})
    with pytest.raises(anthropic.BadRequestError, match="at least 1024"):
        anth.messages.count_tokens(model="tiny", messages=[ASK], thinking={"type": "enabled", "budget_tokens": 10})
    ok = anth.messages.count_tokens(model="tiny", messages=[ASK], thinking={"type": "enabled", "budget_tokens": 1024})
    assert ok.input_tokens > 0
    m = anth.messages.create(model="tiny", max_tokens=2, messages=[ASK], thinking={"type": "disabled"})
    assert m.stop_reason == "max_tokens"
