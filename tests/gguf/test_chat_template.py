"""strata's chat-template renderer against transformers' (called directly on the template strings), on the real
templates shipped with llama.cpp."""

import copy
import json
import os
import pathlib

import pytest

from strata import StrataError
from strata.gguf.chat_template import (ChatTemplate, ChatTemplateError, template_supports_thinking,
                                       template_supports_tools)
from strata.gguf.tokenizer import read_gguf_metadata

ROOT = pathlib.Path(__file__).resolve().parents[2]
LLAMACPP_MODELS = pathlib.Path(os.environ.get("STRATA_TESTDATA", ROOT / "tests" / "data")) / "llama.cpp-models"
TEMPLATES = sorted((LLAMACPP_MODELS / "templates").glob("*.jinja"))

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city (météo, 天气)",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}]


def _tool_turns(arguments):
    return [{"role": "system", "content": "You can call tools."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call00001", "type": "function",  # 9 alphanumerics: Mistral's templates insist
                 "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": "{\"temp\": 22}"},
            {"role": "assistant", "content": "It is 22 °C in Paris."},
            {"role": "user", "content": "Thanks"}]


CONVERSATIONS = {
    "system_user": dict(messages=[{"role": "system", "content": "You are a helpful assistant."},
                                  {"role": "user", "content": "Hello! Ünïcödé 我想 🚀 <b>&amp;</b>"}]),
    "multi_turn": dict(messages=[{"role": "user", "content": "Hi"},
                                 {"role": "assistant", "content": "Hello, how can I help?"},
                                 {"role": "user", "content": "Tell me a joke."}]),
    "tools": dict(messages=_tool_turns({"city": "Paris", "unit": "c"}), tools=TOOLS),
    "tools_str_args": dict(messages=_tool_turns('{"city": "Paris"}'), tools=TOOLS),
    "thinking_on": dict(messages=[{"role": "user", "content": "What is 2+2?"},
                                  {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
                                  {"role": "user", "content": "And 3+3?"}], enable_thinking=True),
    "thinking_off": dict(messages=[{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "What is 2+2?"}], enable_thinking=False),
    # tools the way Cohere's older template wants them, and Firefunction's `functions` variable
    "cohere_tools": dict(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[
        {"name": "get_weather", "description": "Get the weather",
         "parameter_definitions": {"city": {"description": "City", "type": "str", "required": True}}}]),
    "functions": dict(messages=[{"role": "user", "content": "Weather in Paris?"}],
                      extra={"functions": json.dumps([t["function"] for t in TOOLS]),
                             "datetime": "2024-05-17"}),
}


def _hf_render(source, messages, tools, add_generation_prompt, **kwargs):
    from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

    chat = _normalize_chat_messages(copy.deepcopy(messages))  # what apply_chat_template does first
    rendered, _ = render_jinja_template([chat], tools=tools, chat_template=source,
                                        add_generation_prompt=add_generation_prompt, **kwargs)
    return rendered[0]


def _both(source, name, conv, add_generation_prompt):
    conv = dict(conv)
    messages, tools = conv.pop("messages"), conv.pop("tools", None)
    thinking = conv.pop("enable_thinking", None)
    extra = conv.pop("extra", {})
    kwargs = dict(extra) if thinking is None else {"enable_thinking": thinking, **extra}
    try:
        want, want_err = _hf_render(source, messages, tools, add_generation_prompt, bos_token="<s>",
                                    eos_token="</s>", **kwargs), None
    except Exception as e:  # noqa: BLE001 (any failure of the oracle is a result to compare)
        want, want_err = None, e
    try:
        got, got_err = ChatTemplate(source, bos_token="<s>", eos_token="</s>", name=name).render(
            copy.deepcopy(messages), tools=tools, add_generation_prompt=add_generation_prompt,
            enable_thinking=thinking, **extra), None
    except ChatTemplateError as e:
        got, got_err = None, e
    return want, want_err, got, got_err


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.stem)
def test_template_matches_transformers(path):
    source = path.read_text(encoding="utf-8")
    rendered = 0
    for cname, conv in CONVERSATIONS.items():
        for agp in (True, False):
            want, want_err, got, got_err = _both(source, path.name, conv, agp)
            if want_err is not None:
                assert got_err is not None, f"{cname}: transformers failed ({want_err!r}), strata did not"
                assert path.name in str(got_err) and str(want_err)[:40] in str(got_err)
                assert isinstance(got_err, StrataError)
            else:
                assert got_err is None, f"{cname}: strata failed: {got_err}"
                assert got == want, cname
                rendered += 1
    assert rendered > 0  # every template renders at least one of the conversations


def test_templates_present():
    assert len(TEMPLATES) >= 60


def test_qwen3_thinking_switch():
    source = (LLAMACPP_MODELS / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    t = ChatTemplate(source, name="qwen3")
    msgs = [{"role": "user", "content": "Hi"}]
    assert t.render(msgs, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert t.render(msgs, enable_thinking=True).endswith("<|im_start|>assistant\n")
    assert t.render(msgs) == t.render(msgs, enable_thinking=True)  # not passed: the template's default
    assert not t.render(msgs, add_generation_prompt=False).endswith("assistant\n")
    assert template_supports_thinking(source) and template_supports_tools(source)


def test_inputs_cleaned_like_transformers():
    source = (LLAMACPP_MODELS / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    t = ChatTemplate(source, name="qwen3")
    # content=None / tool_calls=None (as OpenAI clients send them) are dropped, not rendered as "None"
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo", "tool_calls": None},
            {"role": "user", "content": "again"}]
    assert "None" not in t.render(msgs)
    # `reasoning` is offered as `reasoning_content`
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo", "reasoning": "why"}]
    assert "<think>\nwhy\n</think>" in t.render(msgs, add_generation_prompt=False)


def test_continue_final_message_matches_transformers():
    source = (LLAMACPP_MODELS / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(encoding="utf-8")
    from transformers.utils.chat_template_utils import render_jinja_template

    msgs = [{"role": "user", "content": "Write a poem"}, {"role": "assistant", "content": "Roses are"}]
    want = render_jinja_template([copy.deepcopy(msgs)], chat_template=source, continue_final_message=True)[0][0]
    got = ChatTemplate(source).render(msgs, add_generation_prompt=False, continue_final_message=True)
    assert got == want and got.endswith("Roses are")
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render(msgs, add_generation_prompt=True, continue_final_message=True)


def test_environment_features():
    src = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% generation %}"
           "{{ m.content | tojson }}{% endgeneration %}|{% endfor %}{{ bos_token }}{{ strftime_now('%Y') | length }}"
           "{% set ns = namespace(n=1) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}{{ dict(a=1) | tojson }}")
    msgs = [{"role": "user", "content": "é<>&"}, {"role": "user", "content": "b"}, {"role": "user", "content": "c"}]
    assert ChatTemplate(src, bos_token="<s>").render(msgs) == '"é<>&"|"b"|<s>42{"a": 1}'
    # {{ x | tojson(indent=2) }}, keys kept in order
    assert ChatTemplate("{{ tools | tojson(indent=2) }}").render(msgs, tools=[{"b": 1, "a": 2}]) == (
        '[\n  {\n    "b": 1,\n    "a": 2\n  }\n]')


def test_errors_name_template_and_reason():
    with pytest.raises(ChatTemplateError, match=r"mytpl: syntax error at line 1"):
        ChatTemplate("{% if %}", name="mytpl")
    with pytest.raises(ChatTemplateError, match=r"mytpl: TemplateError: no system role"):
        ChatTemplate("{{ raise_exception('no system role') }}", name="mytpl").render([{"role": "user"}])
    with pytest.raises(ChatTemplateError, match=r"mytpl: .*unsafe"):
        ChatTemplate("{% set x = [] %}{{ x.append(1) }}", name="mytpl").render([{"role": "user"}])
    with pytest.raises(ChatTemplateError, match=r"mytpl: SecurityError"):
        ChatTemplate("{% set ns = namespace(_x=1) %}", name="mytpl").render([{"role": "user"}])
    with pytest.raises(ChatTemplateError, match="empty"):
        ChatTemplate("  ", name="mytpl")
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        ChatTemplate("{{ 1 }}", name="mytpl").render([])
    assert issubclass(ChatTemplateError, StrataError)


def test_from_metadata():
    md = read_gguf_metadata(LLAMACPP_MODELS / "ggml-vocab-qwen2.gguf")
    t = ChatTemplate.from_metadata(md)
    assert t.name == "qwen2" and t.eos_token == "<|endoftext|>"
    text = t.render([{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    with pytest.raises(ChatTemplateError, match="no tokenizer.chat_template"):
        ChatTemplate.from_metadata({"general.name": "x"})


def test_capability_heuristics():
    def read(name):
        return (LLAMACPP_MODELS / "templates" / f"{name}.jinja").read_text(encoding="utf-8")

    assert template_supports_thinking(read("openai-gpt-oss-120b"))
    assert template_supports_thinking(read("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"))
    assert not template_supports_thinking(read("Qwen-Qwen2.5-7B-Instruct"))
    assert not template_supports_thinking(read("meta-llama-Llama-3.1-8B-Instruct"))
    assert template_supports_tools(read("meta-llama-Llama-3.1-8B-Instruct"))
    assert template_supports_tools(read("Qwen3-Coder"))
    assert not template_supports_tools(read("google-gemma-2-2b-it"))
    assert not template_supports_tools(read("microsoft-Phi-3.5-mini-instruct"))
