"""Request parameters that OpenAI clients send (stop strings, prompts as token ids, ...), answered as the OpenAI API,
llama.cpp's server and vLLM answer them; a real server on loopback, read with the official openai client."""

from __future__ import annotations

import openai
import pytest

PROMPT = "The weather in Paris is"


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _tokens_to(text: str, offsets: list[int], stop: str) -> int:
    """How many tokens it takes (offsets: where each starts in `text`) for the text to contain `stop`."""
    ends = offsets[1:] + [len(text)]
    return next(k + 1 for k, e in enumerate(ends) if stop in text[:e])


def test_usage_counts_the_tokens_up_to_the_stop_string(oai):
    # the engine draws on until the cancel a matched stop string sends reaches it: those tokens are no part of the
    # reply, and usage (and timings' predicted_n) counted them, one or more past the stop, as the race went
    ref = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, logprobs=0)
    text, offsets = ref.choices[0].text, ref.choices[0].logprobs.text_offset
    assert len(offsets) == 40
    # stop strings that span two tokens, matched early and late in the reply
    stops = [text[o - 1:o + 1] for o in offsets[2:38:2] if text[o - 1:o + 1].strip()]
    assert len(stops) >= 8, text
    for stop in stops:
        want = _tokens_to(text, offsets, stop)
        assert want < 40
        for stream in (False, True):
            kw = dict(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stop=stop, n=2)
            if stream:
                chunks = list(oai.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
                got = "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == 0)
                usage = chunks[-1].usage
            else:
                r = oai.completions.create(**kw)
                got, usage = r.choices[0].text, r.usage
                assert [c.finish_reason for c in r.choices] == ["stop", "stop"]
            assert got == text[:text.index(stop)]
            assert usage.completion_tokens == 2 * want, (stop, stream, usage.completion_tokens, want)


def test_a_prompt_of_token_id_lists(server, oai):
    # the openai client types a batch of token-id prompts as a list of lists: a batch of one is that prompt, as
    # [text] is; a larger batch is refused as a larger batch of texts is, by one line that says so
    ids = server.state.server.tok.encode(PROMPT)
    want = oai.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    got = oai.completions.create(model="tiny", prompt=[ids], max_tokens=6, temperature=0)
    assert got.choices[0].text == want.choices[0].text and got.usage.prompt_tokens == len(ids)
    for batch in ([ids, ids], [PROMPT, PROMPT]):
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(model="tiny", prompt=batch, max_tokens=6)
        assert "one prompt per request" in e.value.message
    # a prompt of no known shape: one error that says what a prompt may be (not one per shape tried)
    for bad in (["a", 1], [[1, 2], "a"], [[1, "2"]], [True, 2], 5):
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(model="tiny", prompt=bad, max_tokens=6)
        assert e.value.message.count("prompt") == 1 and "list of token ids" in e.value.message, e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tiny", prompt=[[1, 2, 10**9]], max_tokens=6)
    assert "token ids must be in 0.." in e.value.message


def test_best_of_other_than_n_is_400(oai):
    # best_of asks the server to draw several and return the likeliest: served as asked only where best_of = n
    # (langchain sends best_of 1 by default), else refused rather than one unranked choice answered silently
    for n, best_of in ((1, 1), (2, 2)):
        r = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=n, best_of=best_of)
        assert len(r.choices) == n
    for n, best_of in ((1, 2), (2, 1)):
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=n, best_of=best_of)
        assert f"best_of {best_of} is not supported" in e.value.message
