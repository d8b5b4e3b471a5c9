"""The reasoning split through a real server on loopback, its output forced by a grammar: the streamed pieces of
`reasoning_content` (OpenAI) and of a thinking block (Anthropic) concatenate to exactly the non-streamed field,
the content likewise; llama.cpp's per-request `reasoning_format`."""

from __future__ import annotations

import anthropic
import openai
import pytest

from .conftest import serve

MSG = [{"role": "user", "content": "Think about it."}]
# the model's whole output: a reasoning block with the newline templates put before </think>, then the answer
FORCED = 'root ::= "<think>\\ndeep thought here\\n</think>\\n\\nthe answer"'
# the generation prompt already opened the block (thinking_lm's template)
FORCED_OPEN = 'root ::= "deep thought here\\n\\n</think>\\n\\nthe answer"'
REASONING, ANSWER = "deep thought here", "the answer"


@pytest.fixture(scope="module")
def servers(lm, thinking_lm):
    with serve(lm, parallel=1) as plain, serve(thinking_lm, parallel=1) as opened:
        yield {"plain": (plain, FORCED), "opened": (opened, FORCED_OPEN)}


def _oai(s):
    return openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.mark.parametrize("which", ["plain", "opened"])
def test_streamed_reasoning_content_is_the_non_streamed_one(servers, which):
    s, g = servers[which]
    c = _oai(s)
    kw = dict(model="tiny", messages=MSG, max_tokens=60, temperature=0, extra_body={"grammar": g})
    msg = c.chat.completions.create(**kw).choices[0].message
    assert (msg.model_extra.get("reasoning_content"), msg.content) == (REASONING, ANSWER)
    chunks = list(c.chat.completions.create(**kw, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    pieces = [(d.model_extra or {}).get("reasoning_content") for d in deltas]
    assert len([p for p in pieces if p]) > 1  # streamed in pieces, one a token
    assert "".join(p or "" for p in pieces) == REASONING
    assert "".join(d.content or "" for d in deltas) == ANSWER


@pytest.mark.parametrize("which", ["plain", "opened"])
def test_streamed_thinking_block_is_the_non_streamed_one(servers, which, monkeypatch):
    s, g = servers[which]
    srv = s.state.server
    real = srv.finish_job

    def forced(job):  # the Anthropic API has no grammar field: the job gets the grammar an OpenAI request sends
        job.grammar = srv.gbnf_grammar(g)
        return real(job)

    monkeypatch.setattr(srv, "finish_job", forced)
    a = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0, timeout=120)
    kw = dict(model="tiny", max_tokens=2000, messages=MSG, thinking={"type": "enabled", "budget_tokens": 1024},
              extra_body={"temperature": 0})
    m = a.messages.create(**kw)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
        ("thinking", REASONING), ("text", ANSWER)]
    with a.messages.stream(**kw) as st:
        deltas = [e.delta for e in st if e.type == "content_block_delta"]
        fm = st.get_final_message()
    assert [b.model_dump() for b in fm.content] == [b.model_dump() for b in m.content]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == REASONING
    assert "".join(d.text for d in deltas if d.type == "text_delta") == ANSWER


def test_a_newline_inside_the_reasoning_is_kept(servers):
    """Held back only until the next piece shows it was inside the run."""
    s, _ = servers["plain"]
    c = _oai(s)
    g = 'root ::= "<think>\\nfirst\\n\\nsecond\\n</think>\\nthe answer"'
    kw = dict(model="tiny", messages=MSG, max_tokens=60, temperature=0, extra_body={"grammar": g})
    msg = c.chat.completions.create(**kw).choices[0].message
    assert msg.model_extra.get("reasoning_content") == "first\n\nsecond" and msg.content == ANSWER
    chunks = list(c.chat.completions.create(**kw, stream=True))
    assert "".join((ch.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                   for ch in chunks if ch.choices) == "first\n\nsecond"


@pytest.mark.parametrize("which", ["plain", "opened"])
def test_reasoning_format_none_leaves_the_reasoning_in_content(servers, which):
    """llama.cpp's `reasoning_format: "none"`: the output as written, tags and all, in content (streamed alike)."""
    s, g = servers[which]
    raw = g[len('root ::= "'):-1].replace("\\n", "\n")
    c = _oai(s)
    kw = dict(model="tiny", messages=MSG, max_tokens=60, temperature=0,
              extra_body={"grammar": g, "reasoning_format": "none"})
    msg = c.chat.completions.create(**kw).choices[0].message
    assert msg.content == raw and msg.model_extra.get("reasoning_content") is None
    deltas = [ch.choices[0].delta for ch in c.chat.completions.create(**kw, stream=True) if ch.choices]
    assert "".join(d.content or "" for d in deltas) == raw
    assert not any((d.model_extra or {}).get("reasoning_content") for d in deltas)
    for fmt in ("deepseek", "auto"):  # llama.cpp's splitting values: as without the field
        kw["extra_body"]["reasoning_format"] = fmt
        msg = c.chat.completions.create(**kw).choices[0].message
        assert (msg.model_extra.get("reasoning_content"), msg.content) == (REASONING, ANSWER)


@pytest.mark.parametrize("value", ["deepseek-legacy", "raw", 1])
def test_an_unknown_reasoning_format_is_a_400_naming_the_allowed_ones(servers, value):
    s, _ = servers["plain"]
    with pytest.raises(openai.BadRequestError) as e:
        _oai(s).chat.completions.create(model="tiny", messages=MSG, max_tokens=4,
                                        extra_body={"reasoning_format": value})
    text = str(e.value)
    assert "reasoning_format" in text and all(f"'{v}'" in text for v in ("none", "auto", "deepseek")), text
