"""What a chat template is given for the tool calls of the conversation, by what that template can take.

Clients send an assistant turn that only calls tools with ``content: null`` and each call's ``arguments`` as a
JSON string. The real templates disagree on both (surveyed on the templates that llama.cpp ships):

- content: DeepSeek-R1's distills render the calls only under ``message['content'] is none`` (with ``""`` they
  drop the calls, or write an empty turn), while Qwen3, gpt-oss, Granite 3.3, Phi-3.5, Devstral and others fail
  on None (``'<think>' in content``, ``content + ...``) and need a string.
- arguments: transformers documents them as a dict and vLLM passes a dict (most templates ``tojson`` them; a
  string would be written JSON-quoted, ``"{\\"city\\": ...}"``, and GLM, Qwen3-Coder, MiniMax refuse it), while
  functionary-v3.2 and DeepSeek-R1-Distill-Llama concatenate them as text and fail on a dict.

So the prompt is rendered with the first of these inputs that the template accepts (`variants`): content None
and dict arguments, None and the client's string, ``""`` and dicts, ``""`` and strings. A template's failure is an
exception, never a silently wrong prompt, which is what makes trying them in turn safe. The order puts None
first because a template that reads ``content is none`` renders the calls only that way, and a template that
cannot take None fails outright rather than rendering something else.

Mistral's templates (Nemo, Small 3.x) refuse any tool-call id that is not 9 alphanumerics. For them the server
makes 9-character ids (`new_short_id`) and maps a client's other ids (``call_...``, Anthropic's ``toolu_...``)
to 9 characters before rendering (`shorten_ids`), the same id to the same characters in the assistant's call
and in the tool's result, as vLLM does for Mistral models. The map is a hash, not a counter, so a conversation
renders the same prefix on every turn (the prompt cache reuses it).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import secrets
import string

_ALNUM = string.ascii_letters + string.digits
_NINE = re.compile(r"[A-Za-z0-9]{9}")
# an id this server made (OpenAI's `call_` prefix, or Anthropic's `toolu_`) keeps its 9 characters
_PREFIXED_NINE = re.compile(r"(?:call_|toolu_)([A-Za-z0-9]{9})")


def needs_short_ids(template_source: str | None) -> bool:
    """True when the template raises on a tool-call id that is not 9 characters (Mistral's)."""
    src = template_source or ""
    return "length 9" in src or re.search(r"\|\s*length\s*!=\s*9\b", src) is not None


def new_short_id() -> str:
    """A fresh tool-call id of 9 alphanumerics (what Mistral's templates accept)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def short_id(call_id: str) -> str:
    """`call_id` as 9 alphanumerics: itself when it already is, the 9 characters of this server's own
    ``call_XXXXXXXXX`` / ``toolu_XXXXXXXXX``, else a hash of it (the same id always maps to the same text)."""
    if _NINE.fullmatch(call_id):
        return call_id
    m = _PREFIXED_NINE.fullmatch(call_id)
    if m:
        return m.group(1)
    n = int.from_bytes(hashlib.sha256(call_id.encode("utf-8", "surrogatepass")).digest()[:8], "big")
    out = []
    for _ in range(9):
        n, r = divmod(n, len(_ALNUM))
        out.append(_ALNUM[r])
    return "".join(out)


def shorten_ids(messages: list[dict]) -> list[dict]:
    """The messages with every tool-call id (the assistant's calls, the tool's results) mapped by `short_id`."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "id": short_id(c["id"])} if isinstance(c.get("id"), str) else c
                                     for c in m["tool_calls"]]}
        if m.get("role") == "tool" and isinstance(m.get("tool_call_id"), str):
            m = {**m, "tool_call_id": short_id(m["tool_call_id"])}
        out.append(m)
    return out


def _arguments(args, as_text: bool):
    if as_text:
        return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return json.loads(args) if isinstance(args, str) else args  # (checked to be a JSON object on the way in)


def _variant(messages: list[dict], null_content: bool, text_args: bool) -> list[dict]:
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            m = copy.copy(m)
            if m.get("content") is None and not null_content:
                m["content"] = ""
            m["tool_calls"] = [{**c, "function": {**c["function"],
                                                  "arguments": _arguments(c["function"]["arguments"], text_args)}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def variants(messages: list[dict]) -> list[tuple[list[dict], bool]]:
    """(messages, keep content None) to render with, in order of preference (see the module's docstring). An
    assistant message with calls and no text has content None here; arguments are the client's (string or dict).
    A conversation without tool calls has one variant, itself."""
    calls = [m for m in messages if m.get("role") == "assistant" and m.get("tool_calls")]
    if not calls:
        return [(messages, False)]
    nulls = (True, False) if any(m.get("content") is None for m in calls) else (False,)
    return [(_variant(messages, null, text), null) for null in nulls for text in (False, True)]
