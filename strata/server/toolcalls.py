"""Tool calls in the model's own format: detection from the chat template, parsing (whole or streamed), and the
grammar that constrains output to a call when the client requires one.

Formats (what the model writes):

- ``hermes`` (Qwen2.5/Qwen3, Hermes, many others): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
- ``qwen3_coder``: ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>``
- ``deepseek``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`` (V3; V3.1 drops ``function`` and the code fence)
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` or ``[TOOL_CALLS]NAME[ARGS]{...}``
- ``glm`` (GLM-4.5/4.6): ``<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>...</tool_call>``
  (a value is JSON unless the tool's schema says string)
- ``harmony`` (gpt-oss): a message ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}
  <|call|>``; the harmony splitter (strata.reasoning) hands it over as a block between two private-use
  characters, ``NAME\n{...}``
- ``llama3`` (Llama 3.1/3.2/3.3): the reply is one ``{"name": ..., "parameters": {...}}``, optionally after
  ``<|python_tag|>`` (strata.server.toolcalls_llama)

Markup never reaches the answer text: a block that opens but does not parse (broken, or cut off by max_tokens
or a stop string) is left out of the text and counted in `ToolCallStream.dropped`; OpenAI's clients read
`finish_reason` ("length") for the cut-off case, and a block that is garbage would only mislead them as prose.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from strata.reasoning import HARMONY_CALL, HARMONY_CALL_END, partial_suffix, uses_harmony

DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


@dataclass
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def args_dict(self) -> dict:
        try:
            v = json.loads(self.arguments)
        except ValueError:
            return {}
        return v if isinstance(v, dict) else {}


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: str
    end: str | None  # None: the block runs to the end of the output


FORMATS = {
    "hermes": ToolFormat("hermes", "<tool_call>", "</tool_call>"),
    "qwen3_coder": ToolFormat("qwen3_coder", "<tool_call>", "</tool_call>"),
    "deepseek": ToolFormat("deepseek", DS_CALLS_BEGIN, DS_CALLS_END),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", None),
    "glm": ToolFormat("glm", "<tool_call>", "</tool_call>"),
    "harmony": ToolFormat("harmony", HARMONY_CALL, HARMONY_CALL_END),
    "llama3": ToolFormat("llama3", "<|python_tag|>", None),  # a call opens the reply: see toolcalls_llama
}


def detect_format(template_source: str | None) -> str:
    """The tool-call format a chat template teaches its model (hermes when the template says nothing)."""
    src = template_source or ""
    if uses_harmony(src):
        return "harmony"
    if "<arg_key>" in src and "<arg_value>" in src:
        return "glm"
    if "<function=" in src and "<parameter=" in src:
        return "qwen3_coder"
    if "tool▁calls▁begin" in src or "tool▁call▁begin" in src:
        return "deepseek"
    if "[TOOL_CALLS]" in src:
        return "mistral"
    if "<|start_header_id|>ipython<|end_header_id|>" in src and '"parameters": ' in src and "<tool_call>" not in src:
        return "llama3"  # Llama 3.1/3.2/3.3 (functionary's ipython template writes no "parameters")
    return "hermes"


# ---------------------------------------------------------------------------------------------------------------
# parsing one block (the text between the format's start and end markers)


def _json_args(v) -> str | None:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            return None
    if v is None:
        v = {}
    return json.dumps(v, ensure_ascii=False) if isinstance(v, dict) else None


def _call_from_obj(obj) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = _json_args(obj.get("arguments", obj.get("parameters", {})))
    return ParsedCall(obj["name"], args) if args is not None else None


_XML_FUNC = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|$)", re.S)


def _param_types(tools: list[dict] | None, fname: str) -> dict[str, object]:
    for t in tools or []:
        f = t.get("function", t)
        if f.get("name") == fname:
            return {k: (v or {}).get("type") for k, v in ((f.get("parameters") or {}).get("properties") or {}).items()}
    return {}


def _parse_xml(body: str, tools: list[dict] | None) -> list[ParsedCall] | None:
    calls = []
    for m in _XML_FUNC.finditer(body):
        name = m.group(1).strip()
        types = _param_types(tools, name)
        args = {}
        for p in _XML_PARAM.finditer(m.group(2)):
            key, raw = p.group(1).strip(), p.group(2)
            if types.get(key) == "string":
                args[key] = raw
                continue
            try:
                args[key] = json.loads(raw)
            except ValueError:
                args[key] = raw
        calls.append(ParsedCall(name, json.dumps(args, ensure_ascii=False)))
    return calls or None


def _parse_hermes(body: str, tools) -> list[ParsedCall] | None:
    body = body.strip()
    if body.startswith("<function="):
        return _parse_xml(body, tools)
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    c = _call_from_obj(obj)
    return [c] if c else None


_DS_CALL = re.compile(
    re.escape(DS_CALL_BEGIN)
    + r"(?:(?:function)?" + re.escape(DS_SEP) + r"([^\n]+)\n```(?:json)?\n(.*?)\n```"
    + r"|([^<]*?)" + re.escape(DS_SEP) + r"(.*?))" + r"\s*(?:" + re.escape(DS_CALL_END) + r"|$)",
    re.S,
)


def _parse_deepseek(body: str, tools) -> list[ParsedCall] | None:
    calls = []
    for m in _DS_CALL.finditer(body):
        name, args = (m.group(1), m.group(2)) if m.group(1) is not None else (m.group(3), m.group(4))
        a = _json_args(args.strip())
        if not name or not name.strip() or a is None:
            return None
        calls.append(ParsedCall(name.strip(), a))
    return calls or None


def _parse_mistral(body: str, tools) -> list[ParsedCall] | None:
    body = body.strip()
    if body.startswith("["):
        try:
            arr = json.loads(body)
        except ValueError:
            return None
        calls = [_call_from_obj(o) for o in (arr if isinstance(arr, list) else [arr])]
        return calls if calls and all(calls) else None
    calls = []
    for part in body.split("[TOOL_CALLS]"):
        if not part.strip():
            continue
        name, sep, rest = part.partition("[ARGS]")
        name = name.split("[CALL_ID]")[0].strip()
        a = _json_args(rest.strip()) if sep else None
        if not name or a is None:
            return None
        calls.append(ParsedCall(name, a))
    return calls or None


def _typed(raw: str, kind) -> object:
    """A parameter value written as text: the text itself for a string parameter, else its JSON value (the text
    when it is not JSON)."""
    if kind == "string":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|$)", re.S)


def _parse_glm(body: str, tools) -> list[ParsedCall] | None:
    body = body.strip()
    i = body.find("<arg_key>")
    head, rest = (body, "") if i < 0 else (body[:i], body[i:])
    name, _, tail = head.strip().partition("\n")
    name = name.strip()
    if not name or "<" in name:
        return None
    if tail.strip():  # some outputs give the arguments as one JSON object after the name
        a = _json_args(tail.strip())
        return [ParsedCall(name, a)] if a is not None and not rest else None
    types = _param_types(tools, name)
    args = {m.group(1).strip(): _typed(m.group(2), types.get(m.group(1).strip())) for m in _GLM_ARG.finditer(rest)}
    if rest.strip() and not args:
        return None
    return [ParsedCall(name, json.dumps(args, ensure_ascii=False))]


def _parse_harmony(body: str, tools) -> list[ParsedCall] | None:
    name, _, args = body.partition("\n")
    a = _json_args(args.strip() or "{}")
    return [ParsedCall(name.strip(), a)] if name.strip() and a is not None else None


PARSERS = {"hermes": _parse_hermes, "qwen3_coder": _parse_hermes, "deepseek": _parse_deepseek,
           "mistral": _parse_mistral, "glm": _parse_glm, "harmony": _parse_harmony}


def _llama3():
    from strata.server import toolcalls_llama  # imports this module: loaded on first use

    return toolcalls_llama


def parse_block(fmt: str, body: str, tools: list[dict] | None = None) -> list[ParsedCall] | None:
    return (_llama3().parse_block if fmt == "llama3" else PARSERS[fmt])(body, tools)


# ---------------------------------------------------------------------------------------------------------------
# streaming


def _marker_tail(text: str, marker: str) -> int:
    """Length of the tail of `text` that may be the start of `marker`: a proper prefix of it, and the U+FFFD
    that the decoder writes for a multi-byte character cut off by the end of the output."""
    bare = text.rstrip("\ufffd")
    n = partial_suffix(bare, marker)
    return n + len(text) - len(bare) if n else 0


class ToolCallStream:
    """Feed answer text; get (text, calls) back. Text that may start a call is held until it is decided."""

    def __init__(self, fmt: str, tools: list[dict] | None = None, enabled: bool = True, forced: bool = False):
        # forced: a grammar constrains the output to calls, so all of it is markup (a start marker cut off at
        # the very end included)
        self.fmt, self.spec, self.tools, self.enabled, self.forced = fmt, FORMATS[fmt], tools, enabled, forced
        self._buf = ""
        self._in_block = False
        self.calls: list[ParsedCall] = []
        self.dropped = 0  # blocks that did not parse, left out of the text

    def push(self, text: str) -> tuple[str, list[ParsedCall]]:
        if not self.enabled:
            return text, []
        self._buf += text
        out, calls = [], []
        start, end = self.spec.start, self.spec.end
        while self._buf:
            if not self._in_block:
                i = self._buf.find(start)
                head = self._buf if i < 0 else self._buf[:i]
                if end is not None and end in head:  # a closing marker with no block open: markup still
                    self.dropped += head.count(end)
                    self._buf = head.replace(end, "") + ("" if i < 0 else self._buf[i:])
                    continue
                if i >= 0:
                    out.append(self._buf[:i])
                    self._buf = self._buf[i + len(start):]
                    self._in_block = True
                    continue
                keep = _marker_tail(self._buf, start)
                out.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            if end is None:
                break  # the block runs to the end of the output
            j = self._buf.find(end)
            if j < 0:
                break
            body, self._buf = self._buf[:j], self._buf[j + len(end):]
            self._in_block = False
            got = parse_block(self.fmt, body, self.tools)
            if got:
                calls += got
            else:
                self.dropped += 1
        self.calls += calls
        return self._text("".join(out)), calls

    def _text(self, text: str) -> str:
        # whitespace between or after calls is layout, not an answer; a forced output is all markup
        return "" if self.forced or (self.calls and not text.strip()) else text

    def flush(self) -> tuple[str, list[ParsedCall]]:
        buf, self._buf = self._buf, ""
        if not self._in_block:
            if _marker_tail(buf, self.spec.start):  # a start marker cut off by the end of the output
                return "", []
            return self._text(buf), []
        self._in_block = False
        got = parse_block(self.fmt, buf, self.tools)
        if got:
            self.calls += got
            return "", got
        self.dropped += 1  # cut off (max_tokens, a stop string) or broken: markup, not an answer
        return "", []


def tool_stream(fmt: str, tools: list[dict] | None = None, enabled: bool = True,
                forced: bool = False) -> ToolCallStream:
    """The format's incremental parser: llama3's call has no markers, so it has a stream of its own."""
    cls = _llama3().Llama3Stream if fmt == "llama3" else ToolCallStream
    return cls(fmt, tools, enabled=enabled, forced=forced)


def parse_tool_calls(fmt: str, text: str, tools: list[dict] | None = None) -> tuple[str, list[ParsedCall]]:
    """Whole-output parse: (remaining text, calls)."""
    s = tool_stream(fmt, tools)
    t1, c1 = s.push(text)
    t2, c2 = s.flush()
    return (t1 + t2), c1 + c2


# ---------------------------------------------------------------------------------------------------------------
# grammars (llguidance's Lark dialect) that force a call when tool_choice is "required" or names a function


def closed(schema):
    """The schema with `additionalProperties: false` wherever an object lists its properties and says nothing
    (OpenAI's strict mode): a forced call then holds exactly the declared arguments."""
    if isinstance(schema, list):
        return [closed(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def call_schema(tools: list[dict], only: str | None = None) -> dict:
    """JSON schema of {"name": ..., "arguments": {...}} for the given tools (OpenAI tool dicts)."""
    alts = []
    for t in tools:
        f = t.get("function", t)
        if only is not None and f["name"] != only:
            continue
        params = closed(f.get("parameters") or {"type": "object"})
        alts.append({"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": params},
                     "required": ["name", "arguments"], "additionalProperties": False})
    return alts[0] if len(alts) == 1 else {"anyOf": alts}


_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _json_rule(schema: dict) -> str:
    """`%json` with fixed separators: a free-whitespace grammar lets a weak model pad forever."""
    return "%json " + json.dumps({**schema, "x-guidance": _COMPACT}, ensure_ascii=False)


def _lark_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _chosen(tools: list[dict], only: str | None):
    """(function, its parameters in call order: the required ones, else all; properties) of each tool offered."""
    for t in tools:
        f = t.get("function", t)
        if only is not None and f["name"] != only:
            continue
        params = f.get("parameters") or {}
        props = params.get("properties") or {}
        req = [p for p in props if p in set(params.get("required") or [])] or list(props)
        yield f, req, props


def _value_rule(ps: dict) -> str:
    """A parameter's value written as text: an enum's strings, a short string without markup, or JSON."""
    if ps.get("type") == "string" and "enum" in ps:
        return " | ".join(_lark_str(str(v)) for v in ps["enum"])
    if ps.get("type") == "string":
        return "/[^<]{0,200}/"
    return _json_rule(closed(ps))


def tool_grammar(fmt: str, tools: list[dict], only: str | None = None, lit=_lark_str, parallel: bool = True) -> str:
    """A Lark grammar whose sentences are one or more tool calls in `fmt`.

    `lit(text)` writes a literal: a marker that is a special token of the vocabulary must be written as that
    token (`<[id]>`), since its text would otherwise be spelled out in ordinary tokens.
    """
    if fmt == "llama3":  # one call: the template takes no more (parallel or not)
        return _llama3().grammar(tools, only)
    sch = call_schema(tools, only)
    more = "(\"\\n\" call)*" if parallel else ""
    if fmt in ("hermes",):
        return (f"start: call {more}\ncall: {lit('<tool_call>')} \"\\n\" body \"\\n\" {lit('</tool_call>')}\n"
                f"body: {_json_rule(sch)}\n")
    if fmt == "qwen3_coder":
        alts, rules = [], []
        for k, t in enumerate(tools):
            f = t.get("function", t)
            if only is not None and f["name"] != only:
                continue
            params = f.get("parameters") or {}
            props = params.get("properties") or {}
            req = [p for p in props if p in set(params.get("required") or [])] or list(props)
            seq = [f"\"<function={f['name']}>\\n\""]
            for j, p in enumerate(req):
                ps = props[p] or {}
                if ps.get("type") == "string" and "enum" in ps:
                    val = " | ".join(_lark_str(str(v)) for v in ps["enum"])
                    rules.append(f"v{k}_{j}: {val}")
                elif ps.get("type") == "string":
                    rules.append(f"v{k}_{j}: /[^<]{{0,200}}/")
                else:
                    rules.append(f"v{k}_{j}: {_json_rule(closed(ps))}")
                seq.append(f"\"<parameter={p}>\\n\" v{k}_{j} \"\\n</parameter>\\n\"")
            seq.append("\"</function>\"")
            alts.append(f"f{k}")
            rules.append(f"f{k}: " + " ".join(seq))
        return (f"start: call {more}\ncall: {lit('<tool_call>')} \"\\n\" ({' | '.join(alts)}) \"\\n\" "
                f"{lit('</tool_call>')}\n" + "\n".join(rules) + "\n")
    if fmt == "deepseek":
        alts, rules = [], []
        for k, t in enumerate(tools):
            f = t.get("function", t)
            if only is not None and f["name"] != only:
                continue
            alts.append(f"c{k}")
            rules.append(f"c{k}: {lit(DS_CALL_BEGIN)} \"function\" {lit(DS_SEP)} {_lark_str(f['name'])} "
                         f"\"\\n```json\\n\" a{k} \"\\n```\" {lit(DS_CALL_END)}")
            rules.append(f"a{k}: {_json_rule(closed(f.get('parameters') or {'type': 'object'}))}")
        rep = "+" if parallel else ""
        return f"start: {lit(DS_CALLS_BEGIN)} ({' | '.join(alts)}){rep} {lit(DS_CALLS_END)}\n" + "\n".join(rules) + "\n"
    if fmt == "mistral":
        arr = {"type": "array", "items": sch, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        return f"start: {lit('[TOOL_CALLS]')} body\nbody: {_json_rule(arr)}\n"
    if fmt == "glm":
        alts, rules = [], []
        for k, (f, req, props) in enumerate(_chosen(tools, only)):
            seq = [_lark_str(f["name"])]
            for j, p in enumerate(req):
                rules.append(f"v{k}_{j}: " + _value_rule(props[p] or {}))
                seq.append(f"\"\\n\" {lit('<arg_key>')} {_lark_str(p)} {lit('</arg_key>')} \"\\n\" {lit('<arg_value>')} "
                           f"v{k}_{j} {lit('</arg_value>')}")
            alts.append(f"f{k}")
            rules.append(f"f{k}: " + " ".join(seq))
        return (f"start: call {more}\ncall: {lit('<tool_call>')} ({' | '.join(alts)}) \"\\n\" {lit('</tool_call>')}\n"
                + "\n".join(rules) + "\n")
    if fmt == "harmony":
        # one call: `<|call|>` ends the generation (the client sends the result back for the next)
        alts, rules = [], []
        for k, (f, _, _) in enumerate(_chosen(tools, only)):
            alts.append(f"c{k}")
            rules.append(f"c{k}: {_lark_str('commentary to=functions.' + f['name'])} \" \" {lit('<|constrain|>')} "
                         f"\"json\" {lit('<|message|>')} a{k}")
            rules.append(f"a{k}: {_json_rule(closed(f.get('parameters') or {'type': 'object'}))}")
        return (f"start: {lit('<|channel|>')} ({' | '.join(alts)}) {lit('<|call|>')}\n" + "\n".join(rules) + "\n")
    raise ValueError(f"no grammar for tool format {fmt}")
