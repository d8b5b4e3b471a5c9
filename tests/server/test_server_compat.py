"""Values other servers (llama.cpp, vLLM) and their clients send, answered as those servers answer them."""

from __future__ import annotations

import argparse

import httpx
import openai
import pytest

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
