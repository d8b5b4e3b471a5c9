"""Llama 3.1/3.2/3.3 tool calls (``llama3``): the whole reply is one JSON object
``{"name": NAME, "parameters": {...}}`` (``arguments`` read too, a leading ``"type": "function"`` allowed), written
at the start of the reply, after whitespace and an optional ``<|python_tag|>``.

Llama 3.1's built-in tools come after ``<|python_tag|>`` too: ``brave_search.call(query="...")`` is read as a call
of that name with its keyword arguments; code (the code interpreter) stays content, the tag left out.

The chat template renders one call per assistant message (two raise "This model only supports single tool-calls
at once!"), so a reply holds at most one call: a further call object after the first is dropped (counted in
`dropped`), a forced call's grammar writes exactly one. A reply whose call does not parse (broken JSON, or cut off
by max_tokens) is content, as llama.cpp returns it: there is no markup to hide, only JSON.

Streaming: text that may still become a call (leading whitespace, a prefix of ``<|python_tag|>`` or of
``{"name"``) is held back; once decided, text flows and a call is held to the end of the output.
"""

from __future__ import annotations

import ast
import json
import re

from strata.server.toolcalls import ParsedCall, ToolCallStream, _call_from_obj, _json_rule, closed

PYTHON_TAG = "<|python_tag|>"

# the head of a JSON call: `{`, optionally `"type": "function",`, then the key `"name"` (or the OpenAI wrapper's
# `"function": {"name"`); None stands for \s*
_TYPE = ["{", None, '"type"', None, ":", None, '"function"', None, ",", None]
_HEADS = (["{", None, '"name"'], [*_TYPE, '"name"'], [*_TYPE, '"function"', None, ":", None, "{", None, '"name"'])


def _rx(piece) -> str:
    return r"\s*" if piece is None else re.escape(piece)


def _prefix_re(seqs) -> re.Pattern:
    """Matches (fullmatch) the proper prefixes of the texts the sequences of pieces match."""
    alts = []
    for seq in seqs:
        for k, p in enumerate(seq):
            head = "".join(_rx(q) for q in seq[:k])
            alts += [head + r"\s*"] if p is None else [head + re.escape(p[:j]) for j in range(1, len(p))]
    return re.compile("|".join(f"(?:{a})" for a in dict.fromkeys(alts)))


_JSON_HEAD = re.compile("|".join("".join(_rx(p) for p in seq) for seq in _HEADS))
_JSON_HEAD_PREFIX = _prefix_re(_HEADS)
_BUILTIN_HEAD = re.compile(r"\w+\s*\.\s*call\(")
_BUILTIN_HEAD_PREFIX = re.compile(r"\w+\s*(?:\.\s*(?:c(?:a(?:l(?:l)?)?)?)?)?")

CALL, TEXT, CODE, UNDECIDED = "call", "text", "code", None


def _after_tag(text: str) -> tuple[str, bool] | None:
    """(the text after leading whitespace and `<|python_tag|>`, whether the tag was there); None while the text
    may still be the tag cut short."""
    s = text.lstrip()
    if s.startswith(PYTHON_TAG):
        return s[len(PYTHON_TAG):].lstrip(), True
    if s and PYTHON_TAG.startswith(s):
        return None
    return s, False


def classify(text: str) -> str | None:
    """What a reply that begins with `text` is: CALL (a call's head is there), TEXT, CODE (`<|python_tag|>` and
    no call: built-in code), or UNDECIDED (it may still become a call)."""
    got = _after_tag(text)
    if got is None:
        return UNDECIDED
    s, tagged = got
    if not s:
        return UNDECIDED
    if _JSON_HEAD.match(s) or (tagged and _BUILTIN_HEAD.match(s)):
        return CALL
    if _JSON_HEAD_PREFIX.fullmatch(s) or (tagged and _BUILTIN_HEAD_PREFIX.fullmatch(s)):
        return UNDECIDED
    return CODE if tagged else TEXT


def _obj_call(obj) -> ParsedCall | None:
    if isinstance(obj, dict) and "name" not in obj and isinstance(obj.get("function"), dict):
        obj = obj["function"]  # the OpenAI wrapper {"type": "function", "function": {...}}
    return _call_from_obj(obj)


def _builtin_call(s: str) -> tuple[ParsedCall | None, str]:
    """`name.call(key=value, ...)` (Python literals): (the call, text after it) or (None, s)."""
    m = _BUILTIN_HEAD.match(s)
    if not m:
        return None, s
    depth, quote, end = 0, None, None
    for i in range(m.end() - 1, len(s)):  # the closing parenthesis, outside strings
        c = s[i]
        if quote:
            quote = None if c == quote and s[i - 1] != "\\" else quote
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                end = i + 1
                break
    if end is None:
        return None, s
    try:
        node = ast.parse(s[:end].strip(), mode="eval").body
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Attribute):
            return None, s
        args = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
        name = node.func.value.id if isinstance(node.func.value, ast.Name) else None
        text = json.dumps(args, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError, RecursionError, AttributeError):
        return None, s
    return (ParsedCall(name, text) if name else None), s[end:]


_DECODER = json.JSONDecoder()


def parse_reply(text: str) -> tuple[str, list[ParsedCall], int]:
    """A whole reply: (content, calls (at most one), further calls dropped)."""
    got = _after_tag(text)
    s, tagged = got if got is not None else (text, False)
    if not s.startswith("{"):
        call, rest = _builtin_call(s) if tagged else (None, s)
        if call is None:
            return (s if tagged else text), [], 0
        return rest.strip(), [call], 0
    try:
        obj, end = _DECODER.raw_decode(s)
    except ValueError:
        return s, [], 0  # broken or cut off: content, as llama.cpp answers
    call = _obj_call(obj)
    if call is None:
        return s, [], 0
    dropped, rest = 0, s[end:]
    while True:  # parallel calls the template cannot take: `{...}; {...}`, `{...}\n{...}`
        r = rest.lstrip().lstrip(";,").lstrip()
        if not r.startswith("{"):
            break
        try:
            obj, end = _DECODER.raw_decode(r)
        except ValueError:
            break
        if _obj_call(obj) is None:
            break
        dropped, rest = dropped + 1, r[end:]
    return rest.strip(), [call], dropped


def parse_block(body: str, tools=None) -> list[ParsedCall] | None:
    _, calls, _ = parse_reply(body)
    return calls or None


class Llama3Stream(ToolCallStream):
    """ToolCallStream for `llama3`: a call can only open the reply, and runs to its end."""

    def __init__(self, fmt: str, tools: list[dict] | None = None, enabled: bool = True, forced: bool = False):
        super().__init__(fmt, tools, enabled, forced)
        self._state = UNDECIDED

    def push(self, text: str) -> tuple[str, list[ParsedCall]]:
        if not self.enabled:
            return text, []
        if self._state == TEXT:
            return self._text(text), []
        self._buf += text
        if self._state is UNDECIDED:
            self._state = classify(self._buf)
            if self._state == TEXT:
                buf, self._buf = self._buf, ""
                return self._text(buf), []
            if self._state == CODE:  # built-in code: content from here on, without the tag
                buf, self._buf, self._state = _after_tag(self._buf)[0], "", TEXT
                return self._text(buf), []
        return "", []  # undecided, or a call: held to the end

    def flush(self) -> tuple[str, list[ParsedCall]]:
        buf, self._buf = self._buf, ""
        if not self.enabled or self._state == TEXT:
            return self._text(buf), []
        if self._state is UNDECIDED:  # never became a call: whitespace, a cut-off tag...
            got = _after_tag(buf)
            return self._text(buf if got is None else got[0] if got[1] else buf), []
        text, calls, dropped = parse_reply(buf)
        self.calls += calls
        self.dropped += dropped
        return self._text(text), calls


def schema(tools: list[dict], only: str | None = None) -> dict:
    """JSON schema of {"name": ..., "parameters": {...}} for the given tools (OpenAI tool dicts)."""
    alts = []
    for t in tools:
        f = t.get("function", t)
        if only is not None and f["name"] != only:
            continue
        params = closed(f.get("parameters") or {"type": "object"})
        alts.append({"type": "object", "properties": {"name": {"const": f["name"]}, "parameters": params},
                     "required": ["name", "parameters"], "additionalProperties": False})
    return alts[0] if len(alts) == 1 else {"anyOf": alts}


def grammar(tools: list[dict], only: str | None = None) -> str:
    """A Lark grammar whose sentences are one call (the template takes no more): the JSON object alone, as the
    template renders a past call."""
    return f"start: body\nbody: {_json_rule(schema(tools, only))}\n"

