"""Llama 3.1/3.2/3.3 tool calls (`llama3`): detection from the real templates, the parser (whole and streamed at
every split), the forced-call grammar; the server end to end is tests/server/test_server_llama3.py."""

from __future__ import annotations

import json

import pytest

from strata.server.toolcalls import detect_format, parse_tool_calls, tool_grammar, tool_stream
from strata.server.toolcalls_llama import Llama3Stream

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                                     "days": {"type": "integer"}}, "required": ["city", "days"]}}},
         {"type": "function", "function": {"name": "brave_search", "parameters": {
             "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]

PARIS = ("get_weather", {"city": "Paris", "days": 2})

# (model output, expected content, expected calls as (name, arguments))
CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', "", [PARIS]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', "", [PARIS]),
    (' \n\n {"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}\n', "", [PARIS]),
    ('{"type": "function", "name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', "", [PARIS]),
    ('{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}', "", [PARIS]),
    ('{"name":"get_weather","parameters":{"city":"Paris","days":2}}', "", [PARIS]),
    # arguments as a JSON string (some fine-tunes), and none at all
    ('{"name": "get_weather", "parameters": "{\\"city\\": \\"Paris\\", \\"days\\": 2}"}', "", [PARIS]),
    ('{"name": "get_weather"}', "", [("get_weather", {})]),
    # the OpenAI wrapper some outputs copy from the tool list
    ('{"type": "function", "function": {"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}}', "",
     [PARIS]),
    # Llama 3.1's built-in tool call
    ('<|python_tag|>brave_search.call(query="weather in Paris")', "", [("brave_search", {"query": "weather in Paris"})]),
    # text after the call is content; a second call the template cannot take is dropped
    ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}\n\nChecking now.', "Checking now.", [PARIS]),
    ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
     '{"name": "get_weather", "parameters": {"city": "Tokyo", "days": 1}}', "", [PARIS]),
    # not calls: prose, prose before a call (a call opens the reply), JSON that is not a call
    ("The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ('Sure: {"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
     'Sure: {"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": 3, "parameters": {}}', '{"name": 3, "parameters": {}}', []),
    ('{ "nameless": true }', '{ "nameless": true }', []),
    ("{}", "{}", []),
    ("", "", []),
    ("  ", "  ", []),
    ("<|pyt", "<|pyt", []),
    # malformed or cut-off JSON: content, as llama.cpp answers
    ('{"name": "get_weather", "parameters": {"city": "Paris", "days": }}',
     '{"name": "get_weather", "parameters": {"city": "Paris", "days": }}', []),
    ('{"name": "get_weather", "parameters": {"city": "Par', '{"name": "get_weather", "parameters": {"city": "Par', []),
    # built-in code (the code interpreter): content, without the tag
    ("<|python_tag|>import math\nprint(math.pi)", "import math\nprint(math.pi)", []),
    ("<|python_tag|>brave_search.call(query=", "brave_search.call(query=", []),
]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_whole_output(text, content, calls):
    got_text, got = parse_tool_calls("llama3", text, TOOLS)
    assert (got_text.strip(), _calls(got)) == (content.strip(), calls)


@pytest.mark.parametrize("text,content,calls", CASES)
def test_streamed_split_anywhere(text, content, calls):
    """Every split in two, and one character at a time, gives the whole-output parse."""
    whole_text, whole = parse_tool_calls("llama3", text, TOOLS)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        s = tool_stream("llama3", TOOLS)
        assert isinstance(s, Llama3Stream)
        out, got = [], []
        for p in pieces:
            t, c = s.push(p)
            out.append(t)
            got += c
        t, c = s.flush()
        assert ("".join(out) + t, _calls(got + c)) == (whole_text, _calls(whole)), pieces


def test_streamed_text_is_not_held():
    """Prose flows as it comes; only what may still become a call is held."""
    s = tool_stream("llama3", TOOLS)
    assert s.push("  ") == ("", [])
    assert s.push("The") == ("  The", [])
    assert s.push(" weather") == (" weather", [])
    s = tool_stream("llama3", TOOLS)
    assert s.push('{"na') == ("", [])
    assert s.push('me": "get_weather", "parameters": {') == ("", [])
    assert s.push('"city": "Paris", "days": 2}}') == ("", [])
    t, c = s.flush()
    assert t == "" and _calls(c) == [PARIS]
    s = tool_stream("llama3", TOOLS)
    assert s.push('{"') == ("", [])
    assert s.push('answer') == ('{"answer', [])


def test_second_call_counted_as_dropped():
    s = tool_stream("llama3", TOOLS)
    s.push('{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}\n'
           '{"name": "get_weather", "parameters": {"city": "Tokyo", "days": 1}}')
    _, calls = s.flush()
    assert len(calls) == 1 and s.dropped == 1


def test_forced_and_disabled():
    s = tool_stream("llama3", TOOLS, forced=True)
    assert s.push('{"name": "get_weather", "parameters": {"city": "Pa') == ("", [])
    assert s.flush() == ("", [])  # cut off: a forced output is all call
    s = tool_stream("llama3", None, enabled=False)
    text = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'
    assert s.push(text) == (text, []) and s.flush() == ("", [])


LLAMA3 = ["meta-llama-Llama-3.1-8B-Instruct.jinja", "meta-llama-Llama-3.2-3B-Instruct.jinja",
          "meta-llama-Llama-3.3-70B-Instruct.jinja"]
NOT_LLAMA3 = {"NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": "hermes",
              "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja": "hermes",
              "Qwen-Qwen3-0.6B.jinja": "hermes", "Qwen-Qwen2.5-7B-Instruct.jinja": "hermes",
              "meetkai-functionary-medium-v3.1.jinja": "hermes", "MiniMax-M1.jinja": "hermes",
              "GLM-4.6.jinja": "glm", "openai-gpt-oss-120b.jinja": "harmony"}


@pytest.mark.parametrize("name", LLAMA3)
def test_detect_llama3_templates(llamacpp_models, name):
    assert detect_format((llamacpp_models / "templates" / name).read_text(encoding="utf-8")) == "llama3"


def test_detect_others_not_llama3(llamacpp_models):
    t = llamacpp_models / "templates"
    got = {n: detect_format((t / n).read_text(encoding="utf-8")) for n in NOT_LLAMA3}
    assert got == NOT_LLAMA3
    others = [p.name for p in sorted(t.glob("*.jinja"))
              if p.name not in LLAMA3 and detect_format(p.read_text(encoding="utf-8")) == "llama3"]
    assert others == []


def test_template_renders_the_parsed_call(llamacpp_models):
    """A parsed call sent back renders as the JSON the model writes; two calls are the template's error."""
    from strata.gguf.chat_template import ChatTemplate

    tmpl = ChatTemplate((llamacpp_models / "templates" / LLAMA3[0]).read_text(encoding="utf-8"))
    _, calls = parse_tool_calls("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}')
    call = {"id": calls[0].id, "type": "function",
            "function": {"name": calls[0].name, "arguments": calls[0].args_dict()}}
    msgs = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"}]
    out = tmpl.render(msgs, tools=TOOLS, add_generation_prompt=True)
    assert '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}' in out
    with pytest.raises(Exception, match="single tool-calls"):
        tmpl.render([msgs[0], {"role": "assistant", "tool_calls": [call, call]}], tools=TOOLS)


def test_grammar_single_call_with_the_schema(lm):
    """The forced grammar takes one `{"name", "parameters"}` object that follows the schema, never two."""
    llg = pytest.importorskip("llguidance")
    from strata.server.grammar import Grammars

    g = Grammars(lm.tokenizer, lm.tokenizer.vocab_size)
    grammar = g.lark(tool_grammar("llama3", TOOLS, None, g.literal, parallel=True))
    assert llg.LLMatcher.validate_grammar(grammar, g._lltok()) == ""

    def accepts(text):
        m = llg.LLMatcher(g._lltok(), grammar, log_level=0)
        ok = all(m.consume_token(t) for t in lm.tokenizer.encode(text, add_special=False))
        return ok and m.is_accepting()

    one = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'
    assert accepts(one)
    assert accepts('{"name": "brave_search", "parameters": {"query": "x"}}')
    assert not accepts(one + "\n" + one)
    assert not accepts('{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}')
    assert not accepts('{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}')
    assert not accepts('<tool_call>\n' + one + '\n</tool_call>')
    named = g.lark(tool_grammar("llama3", TOOLS, "brave_search", g.literal))
    m = llg.LLMatcher(g._lltok(), named, log_level=0)
    assert not all(m.consume_token(t) for t in lm.tokenizer.encode(one, add_special=False))
