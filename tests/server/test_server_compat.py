"""Values other servers (llama.cpp, vLLM) and their clients send, answered as those servers answer them."""

from __future__ import annotations

import argparse
import json

import httpx
import openai
import pytest

from .conftest import serve

MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
_http = httpx.Client(timeout=120)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


# ---------------------------------------------------------------------------------------------------------------
# seed -1: llama.cpp's "draw a random seed"


def test_seed_minus_one_is_a_random_seed(oai):
    chat = dict(model="tiny", messages=MSG, max_tokens=8, temperature=1.5, seed=-1)
    texts = {oai.chat.completions.create(**chat).choices[0].message.content for _ in range(3)}
    assert len(texts) > 1, texts  # seed -1 was one fixed seed: three times the same text
    comp = dict(model="tiny", prompt="The weather in Paris is", max_tokens=8, temperature=1.5, seed=-1)
    texts = {oai.completions.create(**comp).choices[0].text for _ in range(3)}
    assert len(texts) > 1, texts
    # a seed of 0 or more still repeats
    fixed = {oai.chat.completions.create(**{**chat, "seed": 3}).choices[0].message.content for _ in range(2)}
    assert len(fixed) == 1


def test_seed_minus_one_parses_as_no_seed():
    from strata.server.protocol import ChatRequest, CompletionRequest, parse

    assert parse(ChatRequest, {"messages": MSG, "seed": -1}).seed is None
    assert parse(CompletionRequest, {"prompt": "x", "seed": -1}).seed is None
    assert parse(CompletionRequest, {"prompt": "x", "seed": -2}).seed == -2  # only llama.cpp's -1 is "random"
    assert parse(CompletionRequest, {"prompt": "x", "seed": 0}).seed == 0


def test_cli_seed_minus_one_is_random():
    from strata.engine.cli import _add_sampling, sampling_from_args

    p = argparse.ArgumentParser()
    _add_sampling(p)
    assert sampling_from_args(p.parse_args(["--seed", "-1"])).seed is None
    assert sampling_from_args(p.parse_args(["--seed", "5"])).seed == 5
    assert sampling_from_args(p.parse_args([])).seed is None


# ---------------------------------------------------------------------------------------------------------------
# "off" as other servers spell it: top_k -1 (vLLM), max_tokens -1 (llama.cpp's n_predict)


def test_top_k_zero_or_less_is_off(server, oai):
    kw = dict(model="tiny", messages=MSG, max_tokens=6, temperature=1.0, seed=5)
    off = oai.chat.completions.create(**kw, extra_body={"top_k": 0}).choices[0].message.content
    assert oai.chat.completions.create(**kw, extra_body={"top_k": -1}).choices[0].message.content == off
    r = _http.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "top_k": -1})
    assert r.status_code == 200, r.text
    r = _http.post(server.url + "/v1/messages", json={"max_tokens": 2, "top_k": -1,
                                                      "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text


def test_max_tokens_minus_one_is_up_to_the_context(server):
    ctx = server.state.server.ctx
    for path, body in [("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": MSG}),
                       ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": -1})]:
        r = _http.post(server.url + path, json={"max_tokens": -1, "temperature": 0, "ignore_eos": True, **body})
        assert r.status_code == 200, r.text
        out = r.json()
        u = out["usage"]
        assert out["choices"][0]["finish_reason"] == "length"
        assert u["prompt_tokens"] + u["completion_tokens"] == ctx, u


@pytest.mark.parametrize("path,body,fragment", [
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -2}, "max_tokens"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
])
def test_max_tokens_zero_is_still_400(server, path, body, fragment):
    r = _http.post(server.url + path, json=body)
    assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text


# ---------------------------------------------------------------------------------------------------------------
# max_tokens past the context: generation stops at the context's end (llama.cpp), the prompt is never cut


def test_max_tokens_past_the_context_stops_at_its_end(server, oai):
    import anthropic

    ctx = server.state.server.ctx
    r = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=99_999_999, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == ctx
    r = oai.completions.create(model="tiny", prompt="Once", max_tokens=32000, temperature=0,
                               extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.total_tokens == ctx
    # Claude Code's default max_tokens, against a context far smaller: stop_reason max_tokens at the context's end
    a = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    m = a.messages.create(model="tiny", max_tokens=32000, messages=MSG, extra_body={"temperature": 0})
    assert m.stop_reason in ("max_tokens", "end_turn")
    if m.stop_reason == "max_tokens":
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens + m.usage.output_tokens == ctx
    with a.messages.stream(model="tiny", max_tokens=32000, messages=MSG, extra_body={"temperature": 0}) as s:
        final = s.get_final_message()
    assert final.stop_reason == m.stop_reason
    assert [b.text for b in final.content] == [b.text for b in m.content]


def test_n_choices_each_stop_at_their_slots_context_end(server):
    ctx = server.state.server.ctx
    for stream in (False, True):
        r = _http.post(server.url + "/v1/chat/completions", json={
            "messages": MSG, "max_tokens": 10 * ctx, "n": 2, "temperature": 1.0, "ignore_eos": True,
            "stream": stream, "stream_options": {"include_usage": True} if stream else None})
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
            reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]
                       and c["choices"][0]["finish_reason"]]
            usage = chunks[-1]["usage"]
        else:
            reasons = [c["finish_reason"] for c in r.json()["choices"]]
            usage = r.json()["usage"]
        assert reasons == ["length", "length"]
        assert usage["completion_tokens"] == 2 * (ctx - usage["prompt_tokens"]), usage


def test_a_prompt_that_fills_the_context_is_still_400(server, lm):
    ctx = server.state.server.ctx
    ids = lm.tokenizer.encode("hello world " * ctx, add_special=False)[:ctx]
    for body in ({"prompt": ids}, {"prompt": ids, "max_tokens": 4}, {"prompt": ids, "max_tokens": -1}):
        r = _http.post(server.url + "/v1/completions", json=body)
        assert r.status_code == 400 and f"does not fit the context of {ctx}" in r.json()["error"]["message"], r.text
    # one token short of the context: one token generated
    r = _http.post(server.url + "/v1/completions", json={"prompt": ids[:-1], "max_tokens": 100, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = _http.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hello world " * ctx}], "max_tokens": 4})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"], r.text


# ---------------------------------------------------------------------------------------------------------------
# the model a reply names: the one the request named (an --alias included), as llama.cpp echoes it


def test_replies_name_the_model_the_request_named(lm):
    import anthropic

    with serve(lm, parallel=1, aliases=["gpt-4o", "claude-sonnet-4-5"]) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        a = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0)
        for name in ("gpt-4o", "tiny"):
            assert c.chat.completions.create(model=name, messages=MSG, max_tokens=2).model == name
            chunks = list(c.chat.completions.create(model=name, messages=MSG, max_tokens=2, stream=True))
            assert {x.model for x in chunks} == {name}
            assert c.completions.create(model=name, prompt="x", max_tokens=2).model == name
            assert {x.model for x in c.completions.create(model=name, prompt="x", max_tokens=2, stream=True)} == {name}
        for name in ("claude-sonnet-4-5", "tiny"):
            assert a.messages.create(model=name, messages=MSG, max_tokens=2).model == name
            with a.messages.stream(model=name, messages=MSG, max_tokens=2) as st:
                assert st.get_final_message().model == name
        # no model named: the model's id
        r = _http.post(s.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 2})
        assert r.json()["model"] == "tiny"
        r = _http.post(s.url + "/v1/messages", json={"messages": MSG, "max_tokens": 2})
        assert r.json()["model"] == "tiny"


# ---------------------------------------------------------------------------------------------------------------
# strict types, as OpenAI and Anthropic check them


_USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path,body,fragment", [
    ("/v1/chat/completions", {"messages": _USER, "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": _USER, "max_tokens": "5"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": _USER, "max_tokens": 5.0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": _USER, "temperature": "0.5"}, "temperature"),
    ("/v1/chat/completions", {"messages": _USER, "temperature": True}, "temperature"),
    ("/v1/chat/completions", {"messages": _USER, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": _USER, "n": True}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "needs content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "needs content"),
    ("/v1/chat/completions", {"messages": [*_USER, {"role": "assistant"}]}, "needs content"),
    ("/v1/chat/completions", {"messages": [{"role": "system"}, *_USER]}, "needs content"),
    ("/v1/completions", {"prompt": [True]}, "prompt"),
    ("/v1/completions", {"prompt": [1.0, 2.0]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "echo": "true"}, "echo"),
    ("/v1/completions", {"prompt": "x", "seed": "7"}, "seed"),
    ("/v1/messages", {"messages": _USER, "max_tokens": "5"}, "max_tokens"),
    ("/v1/messages", {"messages": _USER, "max_tokens": 5, "stream": 1}, "stream"),
    ("/v1/messages", {"messages": [{"role": "user", "content": 5}], "max_tokens": 5}, "content"),
])
def test_loose_types_are_400(server, path, body, fragment):
    r = _http.post(server.url + path, json=body)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"], r.json()


def test_content_may_be_left_out_with_tool_calls(server):
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    for assistant in ({"role": "assistant", "tool_calls": calls}, {"role": "assistant", "content": None,
                                                                   "tool_calls": calls}):
        r = _http.post(server.url + "/v1/chat/completions", json={"max_tokens": 1, "messages": [
            *_USER, assistant, {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]})
        assert r.status_code == 200, r.text
    # proper JSON types, an int where a float goes included
    r = _http.post(server.url + "/v1/chat/completions", json={"messages": _USER, "max_tokens": 1, "temperature": 1,
                                                              "top_p": 1, "stream": False, "logprobs": False})
    assert r.status_code == 200, r.text
