"""Constrained output against a real server on loopback: llama.cpp's `grammar` (GBNF) and `json_schema`,
OpenAI's `response_format` (json_object, json_schema), and tool-call markup, which never reaches `content`.

The tiny model writes noise on its own, so every structure seen here comes from the constraint: a test that
passes with the constraint switched off would be a coincidence of thousands of random tokens.
"""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import openai
import pytest

from strata.reasoning import HARMONY_CALL, HARMONY_CALL_END, HarmonySplitter
from strata.server.toolcalls import DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN, DS_CALLS_END, DS_SEP

pytest.importorskip("llguidance")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                   "required": ["city"]}}}]
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
# what a block of each format starts with, and fragments of it that must never be in `content`
MARKUP = ("<tool_call", "</tool_call", "tool_call>", "[TOOL_CALLS", "｜", "<function=", "<parameter=", '"name"',
          "<arg_key", "arg_value>", "<|channel|>", "<|message|>", "to=functions", HARMONY_CALL, HARMONY_CALL_END)
_http = httpx.Client(timeout=120)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _post(server, path, body):
    return _http.post(server.url + path, json=body)


def _no_markup(text):
    assert not any(m in (text or "") for m in MARKUP), text


# -- grammar (GBNF) ------------------------------------------------------------------------------------------------


def test_gbnf_yes_no(server, oai):
    seen = set()
    for seed in range(6):
        r = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=8, temperature=1.5, seed=seed,
                                        extra_body={"grammar": 'root ::= "yes" | "no"'})
        assert r.choices[0].message.content in ("yes", "no") and r.choices[0].finish_reason == "stop"
        seen.add(r.choices[0].message.content)
    r = _post(server, "/v1/completions", {"prompt": "Is it?", "max_tokens": 8, "temperature": 1.0, "seed": 3,
                                           "grammar": 'root ::= "yes" | "no"'})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no")
    chunks = list(oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=8, temperature=1.0, seed=1,
                                              stream=True, extra_body={"grammar": 'root ::= "yes" | "no"'}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) in ("yes", "no")


def test_gbnf_character_classes(oai):
    g = 'root ::= [a-c] [a-c] [a-c] "=" digit digit\ndigit ::= [0-9]'
    for seed in range(3):
        r = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=20, temperature=1.0, seed=seed,
                                        extra_body={"grammar": g})
        assert re.fullmatch(r"[a-c]{3}=[0-9]{2}", r.choices[0].message.content), r.choices[0].message.content


def _deep(n: int) -> dict:
    d = x = {}
    for _ in range(n):
        x["properties"] = {"a": {}}
        x = x["properties"]["a"]
    return d


@pytest.mark.parametrize("body,fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": _deep(420), "strict": True}}},
     "nested too deeply"),
    ({"grammar": "root ::= " + "(" * 3000 + '"a"' + ")" * 3000}, "grammar"),
    ({"grammar": "root ::= foo"}, "foo"),
    ({"grammar": "garbage(("}, "grammar"),
    ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "both constrain"),
    ({"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "both constrain"),
    ({"json_schema": {"type": "frobnicate"}}, "json_schema"),
    # an integer past 64 bits inside a schema (found by the fuzz campaign: it was a 500)
    ({"json_schema": {"N": [False, 6164657337406113.0, -1180591620717411303423]}}, "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "integer",
                                                                            "maximum": 2 ** 70}}}}, "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"grammar": 'root ::= "a"', "tools": TOOLS, "tool_choice": "required"}, "forces a tool call"),
    ({"grammar": ""}, "grammar"),
    # the cause of a regex error comes on a later line of llguidance's message than "regex parse error:"
    ({"json_schema": {"type": "string", "pattern": "(unclosed"}}, "regex parse error: (unclosed error: unclosed group"),
])
def test_bad_constraints_are_400(server, body, fragment):
    r = _post(server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"], r.json()


# -- JSON ----------------------------------------------------------------------------------------------------------


def test_json_object(oai, lm):
    # A random model inside a free-form object rarely closes it; a bias towards '"' and '}' (applied before the
    # grammar's mask) makes it close within max_tokens, while the grammar alone decides what is valid
    tok = lm.tokenizer
    bias = {str(tok.encode('"', add_special=False)[0]): 5, str(tok.encode("}", add_special=False)[0]): 3}
    values = []
    for seed in range(4):
        kw = dict(model="tiny", messages=MSG, temperature=0.7, seed=seed, logit_bias=bias)
        r = oai.chat.completions.create(response_format={"type": "json_object"}, max_tokens=100, **kw)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", text
        values.append(json.loads(text))
        assert isinstance(values[-1], dict), text
    free = oai.chat.completions.create(max_tokens=20, **kw).choices[0].message.content  # no constraint
    with pytest.raises(ValueError):
        json.loads(free)
    assert any(values), values  # not only {}


def test_llamacpp_json_schema_field(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 5}},
              "required": ["n"], "additionalProperties": False}
    for path, extra in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": MSG})):
        r = _post(server, path, {**extra, "max_tokens": 30, "temperature": 1.0, "seed": 2, "json_schema": schema})
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        v = json.loads(ch.get("text", ch.get("message", {}).get("content")))
        assert set(v) == {"n"} and 1 <= v["n"] <= 5


# -- tool-call markup never reaches content -------------------------------------------------------------------------

FORMATS = ["hermes", "qwen3_coder", "deepseek", "mistral", "glm", "harmony"]


@pytest.fixture
def tool_format(server):
    """The served model's tool format set to another (harmony: with gpt-oss's output splitter too)."""
    srv = server.state.server
    old = srv.tool_format, srv.splitter

    def use(fmt):
        srv.tool_format = fmt
        srv.splitter = HarmonySplitter if fmt == "harmony" else old[1]

    yield use
    srv.tool_format, srv.splitter = old


def _chat(oai, stream, **kw):
    """(content, tool calls as (name, arguments), finish_reason), streamed or not."""
    if not stream:
        ch = oai.chat.completions.create(model="tiny", messages=MSG, temperature=0, **kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in ch.message.tool_calls or []]
        return ch.message.content, calls, ch.finish_reason
    content, calls, finish = [], {}, None
    for c in oai.chat.completions.create(model="tiny", messages=MSG, temperature=0, stream=True, **kw):
        if not c.choices:
            continue
        d = c.choices[0].delta
        content.append(d.content or "")
        for tc in d.tool_calls or []:
            name, args = calls.get(tc.index, ("", ""))
            calls[tc.index] = (name + (tc.function.name or ""), args + (tc.function.arguments or ""))
        finish = c.choices[0].finish_reason or finish
    return "".join(content), list(calls.values()), finish


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("stream", [False, True])
def test_forced_call_markup_never_in_content(oai, tool_format, fmt, stream):
    """A forced call (required or named), whole or cut off by max_tokens anywhere: no markup in content."""
    tool_format(fmt)
    named = {"type": "function", "function": {"name": "get_weather"}}
    cases = [(named, 150), ("required", 17)] if stream else [("required", 150), (named, 9), ("required", 3)]
    for choice, n in cases:
        content, calls, finish = _chat(oai, stream, tools=TOOLS, tool_choice=choice, max_tokens=n,
                                       parallel_tool_calls=False)
        assert not content, (fmt, n, content)
        if n == 150:
            assert finish == "tool_calls" and [c[0] for c in calls] == ["get_weather"], (fmt, calls)
            assert json.loads(calls[0][1])["city"] in ("Paris", "Tokyo")
        else:
            assert finish == "length"


def _free_grammar(fmt: str) -> str:
    """A GBNF grammar that makes the model write text, one call in `fmt`'s markup, and (when the format's block
    ends) more text, with tool_choice auto: the parser, not a tool grammar, has to take the markup out."""
    args = '{"city": "Paris"}'
    call = {
        "hermes": f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>',
        "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                       "</tool_call>",
        "deepseek": f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}get_weather\n```json\n{args}\n```{DS_CALL_END}"
                    f"{DS_CALLS_END}",
        "mistral": f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {args}}}]',
        "glm": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
        # a final message, then the call message (its <|call|> ends the turn)
        "harmony": f"<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                   f"<|message|>{args}<|call|>",
    }[fmt]
    before = "<|channel|>final<|message|>Sure. " if fmt == "harmony" else "Sure. "
    after = "" if fmt in ("mistral", "harmony") else " Done."
    return "root ::= " + " ".join(json.dumps(x, ensure_ascii=False) for x in (before, call, after) if x)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("stream", [False, True])
def test_free_call_markup_never_in_content(oai, tool_format, fmt, stream):
    tool_format(fmt)
    g = _free_grammar(fmt)
    content, calls, finish = _chat(oai, stream, tools=TOOLS, max_tokens=200, extra_body={"grammar": g})
    assert calls == [("get_weather", '{"city": "Paris"}')] and finish == "tool_calls", (content, calls)
    _no_markup(content)
    assert content.split() == (["Sure."] if fmt in ("mistral", "harmony") else ["Sure.", "Done."])
    cuts = (12,) if stream else (8, 20)
    if fmt == "harmony":  # its header comes first
        cuts = (30,) if stream else (25, 40)
    for n in cuts:  # cut off inside the block
        content, calls, finish = _chat(oai, stream, tools=TOOLS, max_tokens=n, extra_body={"grammar": g})
        _no_markup(content)
        assert finish == "length" and "Sure. ".startswith(content), (fmt, n, content)


def test_anthropic_no_markup_in_text_blocks(server, tool_format):
    a = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    a_tools = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    for fmt in ("hermes", "mistral"):
        tool_format(fmt)
        for n in (11, 150):
            kw = dict(model="tiny", max_tokens=n, messages=MSG, tools=a_tools, extra_body={"temperature": 0},
                      tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
            m = a.messages.create(**kw)
            with a.messages.stream(**kw) as s:
                streamed = s.get_final_message()
            for msg in (m, streamed):
                assert [b for b in msg.content if b.type == "text"] == [], (fmt, n, msg.content)
                if n == 150:
                    assert msg.stop_reason == "tool_use"
                    assert [b.name for b in msg.content if b.type == "tool_use"] == ["get_weather"]
                else:
                    assert msg.stop_reason == "max_tokens"


def test_a_grammar_builds_off_the_event_loop(server, monkeypatch):
    """A large grammar takes a while to convert (a 200 KB GBNF: ~0.1 s); it is built on a worker thread, so the
    server goes on answering (here /health) while one builds. The real converter runs, held until /health answered."""
    import asyncio
    import threading

    from strata.server.grammar import Grammars

    held, seen = threading.Event(), []
    real = Grammars.gbnf

    def on_loop() -> bool:
        try:
            asyncio.get_running_loop()
            return True
        except RuntimeError:
            return False

    def slow(self, src):
        seen.append(on_loop())
        if not seen[-1]:  # (held on the loop, it would hold /health too: this test's failure then comes at once)
            held.wait(60)
        return real(self, src)

    monkeypatch.setattr(Grammars, "gbnf", slow)
    out = {}
    t = threading.Thread(target=lambda: out.update(r=_post(server, "/v1/chat/completions", {
        "messages": MSG, "max_tokens": 4, "grammar": 'root ::= "yes" | "no"'})))
    t.start()
    try:
        for _ in range(600):  # (until the request reached the converter)
            if seen:
                break
            threading.Event().wait(0.05)
        assert seen == [False]
        assert httpx.get(server.url + "/health", timeout=20).status_code == 200  # while the grammar is held
    finally:
        held.set()
        t.join(120)
    assert out["r"].status_code == 200 and out["r"].json()["choices"][0]["message"]["content"] in ("yes", "no")
