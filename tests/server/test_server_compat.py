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
