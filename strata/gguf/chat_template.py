"""Chat templates: render a conversation to the prompt text a model was trained on.

Rendering follows transformers' ``apply_chat_template`` exactly (the templates are written against it): a
sandboxed, immutable Jinja2 environment with ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension,
the ``{% generation %}`` tag, a ``tojson`` filter that is plain ``json.dumps`` (no HTML escaping, non-ASCII kept),
``raise_exception``, ``strftime_now``, and the same clean-up of the inputs (keys whose value is None are dropped,
a message's reasoning is also offered as ``reasoning_content`` and ``thinking``). transformers is not imported.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

from strata import StrataError


class ChatTemplateError(StrataError):
    """A chat template failed to compile or to render (the message names the template and the reason)."""


# ---- the Jinja environment


class _GenerationTag(jinja2.ext.Extension):
    # `{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps the body
    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    # `dict(...)` in templates, without exposing the dict type itself
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # namespaces refuse underscore names, so templates cannot reach interpreter internals through them
    def __init__(*args: Any, **kwargs: Any):  # noqa: N805 (same signature trick as jinja2's Namespace)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


@lru_cache(maxsize=1)
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    return _environment().from_string(source)


# ---- inputs, cleaned the way transformers cleans them

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _to_plain(value: Any, drop_none: bool = False) -> Any:
    """JSON-like plain data: message objects (pydantic models, dataclasses) become dicts; anything else that is not
    plain data becomes a placeholder string, so the sandbox never sees foreign objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_to_plain(k): _to_plain(v) for k, v in value.items() if not (drop_none and v is None)}
    if isinstance(value, list):
        return [_to_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _to_plain({f.name: getattr(value, f.name) for f in dataclasses.fields(value)}, drop_none)
    if callable(getattr(value, "model_dump", None)):
        return _to_plain(value.model_dump(), drop_none)
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _to_plain(value.item())
    return f"<{type(value).__name__}>"


def _prepare_messages(messages: Any, null_content: bool = False) -> list[dict]:
    out = []
    for m in messages:
        # null_content: the one exception to dropping None, for templates that test `content is none`
        keep_null = null_content and isinstance(m, Mapping) and "content" in m and m["content"] is None
        m = _to_plain(m, drop_none=True)  # top-level keys whose value is None are dropped (content=None, ...)
        if keep_null:
            m["content"] = None
        if not isinstance(m, dict):
            raise ChatTemplateError(f"chat messages must be dicts, got {type(m).__name__}")
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


# ---- the template


class ChatTemplate:
    """A compiled chat template. ``render(messages, ...)`` gives the prompt text."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", name: str = "",
                 extra_context: Mapping[str, Any] | None = None):
        self.source = source
        self.name = name or "chat template"
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.extra_context = dict(extra_context or {})
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError(f"{self.name}: the chat template is empty")
        try:
            self._template = _compile(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"{self.name}: syntax error at line {e.lineno}: {e.message}") from e

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], name: str | None = None) -> "ChatTemplate":
        """The GGUF's ``tokenizer.chat_template``, with its BOS/EOS token texts."""
        source = md.get("tokenizer.chat_template")
        label = name or str(md.get("general.name") or "GGUF")
        if not source:
            raise ChatTemplateError(f"{label}: the GGUF has no tokenizer.chat_template")
        tokens = md.get("tokenizer.ggml.tokens") or []

        def text(key: str) -> str:
            i = md.get(key)
            return tokens[i] if i is not None and 0 <= int(i) < len(tokens) else ""

        return cls(source, bos_token=text("tokenizer.ggml.bos_token_id"),
                   eos_token=text("tokenizer.ggml.eos_token_id"), name=label)

    def render(self, messages: Any, tools: list[dict] | None = None, add_generation_prompt: bool = True,
               enable_thinking: bool | None = None, documents: list[dict] | None = None,
               continue_final_message: bool = False, null_content: bool = False, **extra: Any) -> str:
        """Render ``messages`` (OpenAI-style dicts or objects) to prompt text.

        enable_thinking: passed to the template when not None (Qwen3-style templates switch reasoning with it).
        continue_final_message: end the text inside the last message, so that generation continues it (the
        template's end-of-turn after it is cut), like transformers' option of that name.
        null_content: a message's ``content: None`` reaches the template as None instead of being dropped (what
        transformers before 5 and vLLM pass): DeepSeek-R1's distills render a tool-calling turn only under
        ``message['content'] is none`` (strata.server.template_inputs chooses when).
        extra: further template variables (e.g. ``reasoning_effort``, ``date_string``).
        """
        chat = _prepare_messages(messages, null_content)
        if not chat:
            raise ChatTemplateError(f"{self.name}: cannot render an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(f"{self.name}: continue_final_message and add_generation_prompt exclude "
                                    "each other")
        context: dict[str, Any] = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                                   **self.extra_context, **_to_plain(extra)}
        if enable_thinking is not None:
            context["enable_thinking"] = bool(enable_thinking)

        tag = "CONTINUE_FINAL_MESSAGE_TAG "
        final = None
        if continue_final_message:
            final = chat[-1].get("content")
            if not isinstance(final, str):
                raise ChatTemplateError(f"{self.name}: continue_final_message needs a final message with text")
            chat[-1]["content"] = final + tag

        try:
            text = self._template.render(messages=chat, tools=_to_plain(tools), documents=_to_plain(documents),
                                         add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{self.name}: {type(e).__name__}: {e.message or e}") from e
        except Exception as e:  # errors raised inside template expressions (TypeError, KeyError, ...)
            raise ChatTemplateError(f"{self.name}: {type(e).__name__}: {e}") from e

        if final is not None:
            if final.strip() not in text or tag.strip() not in text:
                raise ChatTemplateError(f"{self.name}: the template drops (part of) the final message, so it "
                                        "cannot be continued")
            at = text.rindex(tag.strip())
            text = text[:at] if text[at:at + len(tag)] == tag else text[:at].rstrip()
        return text

    def __repr__(self) -> str:
        return f"ChatTemplate(name={self.name!r}, {len(self.source)} chars)"


# ---- what a template can do (cheap, documented heuristics for the server)


@lru_cache(maxsize=64)
def template_variables(source: str) -> frozenset[str]:
    """Variables the template reads from its context (``messages``, ``tools``, ``enable_thinking``, ...)."""
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(source)))
    except jinja2.TemplateSyntaxError:
        return frozenset()


def template_supports_tools(source: str) -> bool:
    """True when the template reads a ``tools`` variable (it can list tool definitions in the prompt).

    Templates that only render ``tool_calls`` of past messages but never the tool list answer False.
    """
    return "tools" in template_variables(source)


_THINKING_MARKS = ("<think>", "reasoning_content", "<|channel|>analysis", "<seed:think>", "[THINK]")


def template_supports_thinking(source: str) -> bool:
    """True when the model reasons before answering, by the template's own marks: an ``enable_thinking`` or
    ``reasoning_effort`` switch, a ``thinking`` flag, or reasoning markup it renders (``<think>``,
    ``reasoning_content``, gpt-oss's analysis channel, Seed's ``<seed:think>``, Mistral's ``[THINK]``)."""
    variables = template_variables(source)
    if variables & {"enable_thinking", "reasoning_effort", "thinking"}:
        return True
    return any(mark in source for mark in _THINKING_MARKS)
