"""A reply that continues the conversation's last (assistant) message: Anthropic's prefill (a final assistant
message) and vLLM's continue_final_message / add_generation_prompt on /v1/chat/completions, through the official
clients against a real server. Greedy output with a prefill must be exactly the raw completion of the prompt the
chat template renders with the last message left open."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

PREFILL = '{"city": "'
CONVERSATION = [{"role": "user", "content": "Answer in JSON: where is the Eiffel tower?"},
                {"role": "assistant", "content": PREFILL}]
N = 8

_http = httpx.Client(timeout=60)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def anth(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def _raw(server, lm, **render) -> tuple[int, str]:
    """(prompt tokens, greedy text) of the chat template's rendering given as a raw completion of token ids."""
    text = lm.template.render(CONVERSATION, **render)
    ids = lm.tokenizer.encode_prompt(text)
    r = _http.post(server.url + "/v1/completions", json={"prompt": ids, "max_tokens": N, "temperature": 0})
    assert r.status_code == 200, r.text
    return len(ids), r.json()["choices"][0]["text"]


def test_anthropic_prefill_is_continued(server, lm, anth):
    n_prompt, want = _raw(server, lm, add_generation_prompt=False, continue_final_message=True)
    assert lm.template.render(CONVERSATION, add_generation_prompt=False,
                              continue_final_message=True).endswith(PREFILL)
    r = anth.messages.create(model="tiny", max_tokens=N, messages=CONVERSATION, extra_body={"temperature": 0})
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == n_prompt
    text = "".join(b.text for b in r.content if b.type == "text")
    assert text == want  # the new text only: not the prefill again
    assert anth.messages.count_tokens(model="tiny", messages=CONVERSATION).input_tokens == n_prompt
    # a new turn (no prefill) is a different prompt
    plain = anth.messages.create(model="tiny", max_tokens=N, messages=CONVERSATION[:1], extra_body={"temperature": 0})
    assert plain.usage.input_tokens + plain.usage.cache_read_input_tokens != n_prompt


def test_anthropic_prefill_streams_the_continuation(server, lm, anth):
    _, want = _raw(server, lm, add_generation_prompt=False, continue_final_message=True)
    with anth.messages.stream(model="tiny", max_tokens=N, messages=CONVERSATION,
                              extra_body={"temperature": 0}) as s:
        assert "".join(s.text_stream) == want


@pytest.mark.parametrize("extra", [{"continue_final_message": True, "add_generation_prompt": False},
                                   {"continue_final_message": True}])  # (unset: no generation prompt)
def test_openai_continue_final_message(server, lm, oai, extra):
    n_prompt, want = _raw(server, lm, add_generation_prompt=False, continue_final_message=True)
    r = oai.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=N, temperature=0,
                                    extra_body=extra)
    assert r.usage.prompt_tokens == n_prompt
    assert r.choices[0].message.content == want


def test_openai_no_generation_prompt(server, lm, oai):
    n_prompt, want = _raw(server, lm, add_generation_prompt=False)
    r = oai.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=N, temperature=0,
                                    extra_body={"add_generation_prompt": False})
    assert r.usage.prompt_tokens == n_prompt
    assert r.choices[0].message.content == want
    with_prompt = oai.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=1)
    assert with_prompt.usage.prompt_tokens > n_prompt  # the default adds the assistant header


@pytest.mark.parametrize("messages,extra,fragment", [
    (CONVERSATION, {"continue_final_message": True, "add_generation_prompt": True}, "cannot both be true"),
    (CONVERSATION[:1], {"continue_final_message": True}, "last message to be an assistant message"),
])
def test_openai_continue_final_message_errors(server, messages, extra, fragment):
    r = _http.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]
