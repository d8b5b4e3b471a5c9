"""Tool-call, reasoning and stop-string parsing on crafted text, whole and streamed piece by piece, and the
grammars that force a call, run through llguidance with the tiny model's real vocabulary."""

from __future__ import annotations

import json
import random

import pytest

from strata.reasoning import HARMONY_CALL, HARMONY_CALL_END, HarmonySplitter, ReasoningSplitter, split_reasoning
from strata.server.generation import StopStrings
from strata.server.toolcalls import (DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN, DS_CALLS_END, DS_SEP,
                                     ToolCallStream, detect_format, parse_tool_calls, tool_grammar)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                                     "days": {"type": "integer"}}, "required": ["city", "days"]}}}]

CASES = {
    "hermes": ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Tokyo", "days": 1}}'
               '</tool_call>'),
    "qwen3_coder": ("Let me check. <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><tool_call><function=get_weather>"
                    "<parameter=city>Tokyo</parameter><parameter=days>1</parameter></function></tool_call>"),
    "deepseek": (f"Let me check. {DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}get_weather\n```json\n"
                 f'{{"city": "Paris", "days": 2}}\n```{DS_CALL_END}{DS_CALL_BEGIN}get_weather{DS_SEP}'
                 f'{{"city": "Tokyo", "days": 1}}{DS_CALL_END}{DS_CALLS_END}'),
    "mistral": ('Let me check. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
                '{"name": "get_weather", "arguments": {"city": "Tokyo", "days": 1}}]'),
    # GLM-4.5/4.6: a string value as it is, others as JSON (the template writes them so)
    "glm": ("Let me check. <tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>\n<tool_call>get_weather\n"
            "<arg_key>city</arg_key>\n<arg_value>Tokyo</arg_value>\n<arg_key>days</arg_key>\n<arg_value>1</arg_value>\n"
            "</tool_call>"),
    # gpt-oss: what the harmony splitter hands on for two call messages
    "harmony": (f'Let me check. {HARMONY_CALL}get_weather\n{{"city": "Paris", "days": 2}}{HARMONY_CALL_END}'
                f'{HARMONY_CALL}get_weather\n{{"city": "Tokyo", "days": 1}}{HARMONY_CALL_END}'),
}
EXPECTED = [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Tokyo", "days": 1})]


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_whole_output(fmt):
    text, calls = parse_tool_calls(fmt, CASES[fmt], TOOLS)
    assert text.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("fmt", sorted(CASES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_in_random_pieces(fmt, seed):
    rng = random.Random(seed)
    src, pieces, i = CASES[fmt], [], 0
    while i < len(src):
        n = rng.randint(1, 5)
        pieces.append(src[i:i + n])
        i += n
    s = ToolCallStream(fmt, TOOLS)
    text, calls = [], []
    for p in pieces:
        t, c = s.push(p)
        text.append(t)
        calls += c
        assert not any(m in "".join(text) for m in MARKUP)
    t, c = s.flush()
    text.append(t)
    calls += c
    assert "".join(text).strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED


def test_mistral_new_format():
    text, calls = parse_tool_calls("mistral", 'x[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}')
    assert text == "x" and [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED[:1]


@pytest.mark.parametrize("fmt", ["hermes", "deepseek"])
def test_broken_block_is_not_text(fmt):
    src = "before <tool_call>{not json</tool_call> after" if fmt == "hermes" else \
        f"before {DS_CALLS_BEGIN}garbage{DS_CALLS_END} after"
    s = ToolCallStream(fmt)
    text, calls = parse_tool_calls(fmt, src)
    assert calls == [] and text == "before  after"
    s.push(src), s.flush()
    assert s.dropped == 1


def test_unfinished_block_at_the_end_is_not_text():
    text, calls = parse_tool_calls("hermes", 'hi <tool_call>{"name": "get_wea')
    assert calls == [] and text == "hi "


MARKUP = ("<tool", "tool_call>", "[TOOL", "｜", "<function", "<parameter", '"name"', "[ARGS]", "<arg_", "arg_key>",
          HARMONY_CALL, HARMONY_CALL_END, "get_weather")


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_cut_anywhere_no_markup_in_text(fmt):
    """The output cut off at every character (max_tokens, a stop string), whole and streamed one character at a
    time, with a cut multi-byte character (U+FFFD) at the end: the text is the prose before the calls, never
    markup."""
    src = CASES[fmt]
    for i in range(len(src) + 1):
        for cut in (src[:i], src[:i] + "\ufffd"):
            text, _ = parse_tool_calls(fmt, cut, TOOLS)
            s = ToolCallStream(fmt, TOOLS)
            streamed = "".join(s.push(ch)[0] for ch in cut) + s.flush()[0]
            for t in (text, streamed):
                assert not any(m in t for m in MARKUP), (i, t)
                assert "Let me check.".startswith(t.replace("\ufffd", "").strip()), (i, t)


@pytest.mark.parametrize("fmt", ["hermes", "deepseek"])
def test_stray_end_marker_is_not_text(fmt):
    end = "</tool_call>" if fmt == "hermes" else DS_CALLS_END
    s = ToolCallStream(fmt, TOOLS)
    text = s.push(f"a {end}b")[0] + s.push(f" c{end}")[0] + s.flush()[0]
    assert text == "a b c" and s.dropped == 2


def test_forced_stream_has_no_text():
    s = ToolCallStream("hermes", TOOLS, forced=True)
    assert s.push("\n<tool")[0] == "" and s.flush() == ("", [])


def test_engine_text_around_a_call(lm):
    """Text the real engine produced, with a call spliced in the middle, streamed token by token."""
    from strata.engine.engine import Engine
    from strata.engine.sampler import SamplingParams

    tok = lm.tokenizer
    eng = Engine(lm, n_slots=1, prefill_chunk=64)
    ids = list(eng.generate(tok.encode("Hello"), SamplingParams(temperature=0), 12, set()))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo", "days": 1}}\n</tool_call>'
    ids = ids[:6] + tok.encode(call, add_special=False) + ids[6:]
    dec, s = tok.stream_decoder(), ToolCallStream("hermes", TOOLS)
    text, calls = [], []
    for t in ids:
        a, b = s.push(dec.put(t))
        text.append(a)
        calls += b
    a, b = s.push(dec.flush())
    c, d = s.flush()
    text += [a, c]
    calls += b + d
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED[1:]
    assert "".join(text) == tok.decode(ids).replace(call, "")


def test_detect_format():
    from strata.gguf.builtin_templates import QWEN3_TEMPLATE

    assert detect_format(QWEN3_TEMPLATE) == "hermes"
    assert detect_format("{{ '<function=' + x + '<parameter=' }}") == "qwen3_coder"
    assert detect_format("{{'<｜tool▁calls▁begin｜>'}}") == "deepseek"
    assert detect_format("[TOOL_CALLS]") == "mistral"
    assert detect_format(None) == "hermes"


def test_detect_format_of_real_templates(llamacpp_models):
    """GLM-4.6 and gpt-oss as their own repositories ship them (llama.cpp's copies of the real templates)."""
    t = llamacpp_models / "templates"
    assert detect_format((t / "GLM-4.6.jinja").read_text(encoding="utf-8")) == "glm"
    assert detect_format((t / "openai-gpt-oss-120b.jinja").read_text(encoding="utf-8")) == "harmony"
    assert detect_format((t / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")) == "hermes"


def test_glm_values_follow_the_schema():
    """A string parameter keeps its text even when it looks like JSON; others are JSON (text when not)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "code": {"type": "string"}, "n": {"type": "integer"}, "opts": {"type": "object"}}}}}]
    src = ("<tool_call>f\n<arg_key>code</arg_key>\n<arg_value>[1, 2]</arg_value>\n<arg_key>n</arg_key>\n"
           "<arg_value>3</arg_value>\n<arg_key>opts</arg_key>\n<arg_value>{\"a\": true}</arg_value>\n</tool_call>")
    _, calls = parse_tool_calls("glm", src, tools)
    assert json.loads(calls[0].arguments) == {"code": "[1, 2]", "n": 3, "opts": {"a": True}}
    _, calls = parse_tool_calls("glm", "<tool_call>f\n</tool_call>", tools)  # no arguments
    assert calls[0].name == "f" and calls[0].arguments == "{}"
    text, calls = parse_tool_calls("glm", "a <tool_call><arg_key>x</arg_key></tool_call> b", tools)  # no name
    assert calls == [] and text == "a  b"


HARMONY_OUT = ('<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary '
               'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 2}<|call|>')


@pytest.mark.parametrize("by_char", [False, True])
@pytest.mark.parametrize("text", [
    HARMONY_OUT,
    HARMONY_OUT[:-len("<|call|>")],  # <|call|> is an end-of-generation token: the decoded text stops before it
    # the header as gpt-oss's template writes it: the recipient before the channel
    ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris", "days": 2}<|call|>',
])
def test_harmony_calls_through_the_splitter(text, by_char):
    """gpt-oss's call messages: the splitter keeps the analysis as reasoning and hands the call over; the
    parser returns it with no markup in the text."""
    rs, tc = HarmonySplitter(calls=True), ToolCallStream("harmony", TOOLS)
    reasoning, content, calls = [], [], []
    for piece in (list(text) if by_char else [text]) + [None]:
        r, c = rs.push(piece) if piece is not None else rs.flush()
        t, got = tc.push(c) if piece is not None else (lambda a, b: (a[0] + b[0], a[1] + b[1]))(tc.push(c), tc.flush())
        reasoning.append(r)
        content.append(t)
        calls += got
    assert "".join(content) == ""
    assert "".join(reasoning) == ("Need weather." if text.startswith("<|channel|>analysis") else "")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED[:1]


def test_harmony_without_tools_is_text():
    """A request without tools: a call message's body stays content, as before."""
    rs = HarmonySplitter(calls=False)
    r, c = rs.push(HARMONY_OUT)
    r2, c2 = rs.flush()
    assert (r + r2, c + c2) == ("Need weather.", '{"city": "Paris", "days": 2}')


# -- reasoning ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,start,expected", [
    ("<think>\nweigh it\n</think>\n\nThe answer.", False, ("weigh it", "The answer.")),
    ("weigh it\n</think>\n\nThe answer.", True, ("weigh it", "The answer.")),
    ("The answer <think>not reasoning</think>", False, ("", "The answer <think>not reasoning</think>")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("<think>never closed", False, ("never closed", "")),
    ("<thin", False, ("", "<thin")),
])
def test_split_reasoning(text, start, expected):
    assert split_reasoning(text, in_reasoning=start) == expected
    s = ReasoningSplitter(True, start)  # one character at a time gives the same split
    got = [s.push(ch) for ch in text] + [s.flush()]
    r, c = "".join(x for x, _ in got), "".join(y for _, y in got)
    assert (r.rstrip("\n"), c) == expected


def test_reasoning_disabled():
    assert split_reasoning("<think>x</think>y", enabled=False) == ("", "<think>x</think>y")


# -- stop strings ------------------------------------------------------------------------------------------------


def test_stop_strings_across_pieces():
    s = StopStrings(["STOP", "\n\n"])
    out = "".join(s.push(p) for p in ["abc S", "TO", "P def"]) + s.flush()
    assert out == "abc " and s.hit == "STOP"
    s = StopStrings(["STOP"])
    out = "".join(s.push(p) for p in ["abc S", "TOx"]) + s.flush()
    assert out == "abc STOx" and s.hit is None


# -- grammars through llguidance with the real vocabulary --------------------------------------------------------


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder", "deepseek", "mistral", "glm", "harmony"])
def test_tool_grammar_accepts_the_formats_own_text(fmt, lm):
    """The grammar that forces a call accepts a call written in the format, and that text parses back."""
    llg = pytest.importorskip("llguidance")
    from strata.server.grammar import Grammars

    g = Grammars(lm.tokenizer, lm.tokenizer.vocab_size)
    src = tool_grammar(fmt, TOOLS[:1], None, g.literal, parallel=False)
    grammar = g.lark(src)
    assert llg.LLMatcher.validate_grammar(grammar, g._lltok()) == ""
    texts = {
        "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
        "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                       "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
        "deepseek": CASES["deepseek"].split("Let me check. ")[1].split(DS_CALL_BEGIN + "get_weather")[0] + DS_CALLS_END,
        "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
        "glm": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>"
               "\n<arg_value>2</arg_value>\n</tool_call>",
        "harmony": '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", '
                   '"days": 2}<|call|>',
    }
    m = llg.LLMatcher(g._lltok(), grammar, log_level=0)
    ids = lm.tokenizer.encode(texts[fmt], add_special=False)
    for t in ids:
        assert m.consume_token(t), (fmt, lm.tokenizer.decode([t]), m.get_error())
    assert m.is_accepting()
    text = texts[fmt]
    if fmt == "harmony":  # the splitter hands the message over first
        rs = HarmonySplitter(calls=True)
        text = rs.push(text)[1] + rs.flush()[1]
    _, calls = parse_tool_calls(fmt, text, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED[:1]
