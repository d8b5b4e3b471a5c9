"""Anthropic's Messages API: POST /v1/messages (stream and not), POST /v1/messages/count_tokens."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from strata.server.body import read_request
from strata.server.openai_api import check_model, server_of
from strata.server.protocol import (AOther, APIError, ARedactedThinking, AText, AThinking, AToolResult, AToolUse,
                                    CountTokensRequest, MessagesRequest, bad_request)
from strata.server.generation import GenerationError
from strata.server.job import Job, sampling

router = APIRouter()
log = logging.getLogger("strata")

STOP_REASON = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


# Claude Code opens its system prompt with an attribution line, "x-anthropic-billing-header: cc_version=...;
# cch=a5145;", its stamp different on every request: left in, no request's prompt would share more than the text
# before that stamp with the last one, and the prompt cache would reuse nothing of the long system prompt and the
# conversation after it. The line is for Anthropic's billing, nothing the model should read: it is left out, as the
# proxies that put Claude Code in front of other models do.
_BILLING = "x-anthropic-billing-header:"


def _unstamped(text: str) -> str:
    if not text.startswith(_BILLING):
        return text
    _, nl, rest = text.partition("\n")
    return rest if nl else ""


def _system(system) -> str | None:
    if system is None:
        return None
    return _unstamped(system) if isinstance(system, str) else "".join(_unstamped(b.text) for b in system)


def _result_text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    out = []
    for b in content:
        if isinstance(b, AOther):
            raise bad_request(f"tool_result content blocks of type {b.type!r} are not supported (text only)")
        out.append(b.text)
    return "".join(out)


def to_chat(body) -> list[dict]:
    """Anthropic messages -> the chat template's messages (OpenAI's shape, which templates expect)."""
    msgs = []
    sys_text = _system(body.system)
    if sys_text:
        msgs.append({"role": "system", "content": sys_text})
    last = len(body.messages) - 1
    for i, m in enumerate(body.messages):
        if not m.content and not (i == last and m.role == "assistant"):
            # (Anthropic's rule too) an empty turn would vanish from the prompt, or render as nothing said
            raise bad_request(f"messages.{i}: content must not be empty (only a final assistant message may be)")
        if isinstance(m.content, str):
            msgs.append({"role": m.role, "content": m.content})
            continue
        if m.role == "user":
            text = []
            for b in m.content:
                if isinstance(b, AToolResult):
                    out = _result_text(b.content)
                    msgs.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                 "content": ("Error: " + out) if b.is_error else out})
                elif isinstance(b, AText):
                    text.append(b.text)
                elif isinstance(b, AOther):
                    raise bad_request(f"messages.{i}: content blocks of type {b.type!r} are not supported")
                else:
                    raise bad_request(f"messages.{i}: a user message cannot hold {b.type} blocks")
            if text:
                msgs.append({"role": "user", "content": "".join(text)})
        else:
            d = {"role": "assistant", "content": ""}
            text, thinking, calls = [], [], []
            for b in m.content:
                if isinstance(b, AText):
                    text.append(b.text)
                elif isinstance(b, AThinking):
                    thinking.append(b.thinking)
                elif isinstance(b, AToolUse):
                    calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}})
                elif isinstance(b, ARedactedThinking):
                    continue
                else:
                    raise bad_request(f"messages.{i}: an assistant message cannot hold {b.type} blocks")
            # only tool_use blocks: content None, as an OpenAI client sends such a turn
            # (strata.server.template_inputs gives the template what it takes)
            d["content"] = "".join(text) if text or not calls else None
            if thinking:
                d["reasoning_content"] = "".join(thinking)
            if calls:
                d["tool_calls"] = calls
            msgs.append(d)
    return msgs


def _tools(body) -> list[dict] | None:
    if not body.tools:
        return None
    # Anthropic's own tools (web_search_..., bash_..., text_editor_..., code_execution_...) come with no
    # input_schema: their schema, and for server tools their execution, are Anthropic's. Offered to this model as
    # functions of no parameters they would be called with nothing the client can run; refused, a client that
    # lists one among its own (an agent's web search) could not talk to this server at all. They are left out.
    own = [t.type for t in body.tools if t.type not in (None, "custom")]
    if own:
        log.info("strata: left out Anthropic's own tools, which this server does not run: %s", ", ".join(own))
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.input_schema}}
             for t in body.tools if t.type in (None, "custom")]
    return tools or None


def _thinking(body) -> bool | None:
    if body.thinking is None:
        return None
    return body.thinking.type != "disabled"


def _tool_use_id(call_id: str) -> str:
    """Anthropic's ``toolu_`` id for a call: ``call_X`` becomes ``toolu_X`` (a 9-character id made for Mistral's
    templates keeps its 9 characters after the prefix, which strata.server.template_inputs maps back)."""
    return "toolu_" + call_id.removeprefix("call_")


def check_budget(body, max_tokens: int | None) -> None:
    """Anthropic's limits on thinking.budget_tokens (its API answers 400 outside them): at least 1024, and below
    max_tokens, which counts the thinking too."""
    t = body.thinking
    if t is None or t.type != "enabled" or t.budget_tokens is None:
        return
    if t.budget_tokens < 1024:
        raise bad_request(f"thinking.budget_tokens: must be at least 1024 (got {t.budget_tokens})")
    if max_tokens is not None and t.budget_tokens >= max_tokens:
        raise bad_request(f"thinking.budget_tokens ({t.budget_tokens}) must be less than max_tokens ({max_tokens})")


async def _prompt(srv, body, tools, generates: bool = False) -> tuple[list[int], str]:
    # a final assistant message is a prefill: the reply continues it (and holds only the new text)
    prefill = body.messages[-1].role == "assistant"
    text = await asyncio.to_thread(srv.render, to_chat(body), tools, _thinking(body), prefill)
    if generates:  # (count_tokens counts a prompt of any size)
        srv.check_size(text)
    return await asyncio.to_thread(srv.encode_chat, text), text


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    srv = server_of(request)
    body = await read_request(request, CountTokensRequest)
    check_model(request, body.model)
    check_budget(body, None)
    ids, _ = await _prompt(srv, body, _tools(body))
    return {"input_tokens": len(ids)}


@router.post("/v1/messages")
async def messages(request: Request):
    srv = server_of(request)
    body = await read_request(request, MessagesRequest)
    name = check_model(request, body.model)
    check_budget(body, body.max_tokens)
    tools = _tools(body)
    tc = body.tool_choice
    if tc is not None and tc.type in ("any", "tool"):
        if not tools:  # a forced call with nothing to call: refused, as OpenAI's endpoint refuses it
            raise bad_request(f"tool_choice {tc.type!r} needs tools")
        if tc.type == "tool" and not tc.name:
            raise bad_request("tool_choice 'tool' needs the name of a tool")
    use_tools = tools if not (tc and tc.type == "none") else None
    ids, text = await _prompt(srv, body, use_tools, True)
    max_tokens = srv.max_tokens(len(ids), body.max_tokens)
    grammar = None
    if use_tools and tc is not None and tc.type in ("any", "tool"):
        if tc.type == "tool" and tc.name not in {t["function"]["name"] for t in use_tools}:
            raise bad_request(f"tool_choice names {tc.name!r}, which is not among the request's tools")
        grammar = await asyncio.to_thread(srv.tool_call_grammar, use_tools, tc.name if tc.type == "tool" else None,
                                          not tc.disable_parallel_tool_use, text.rstrip().endswith("<think>"))
    forced, what = grammar is not None, "the output grammar"
    fmt = body.output_config.format if body.output_config else None
    if fmt is not None and grammar is None:  # (a forced call's grammar wins, as over OpenAI's response_format)
        # Anthropic's structured outputs: the reply's text is JSON of the schema, objects closed as its API closes them
        grammar = await asyncio.to_thread(srv.json_grammar, fmt.schema_, True)
        what = "the output_config.format grammar"
    stops = [s for s in (body.stop_sequences or []) if s]
    if len(stops) > 16:
        raise bad_request("stop_sequences: at most 16")
    job = Job(ids, sampling(body, srv.defaults), max_tokens, srv.stop_ids(), stop=stops, grammar=grammar, grammar_what=what,
              reasoning=True,
              in_reasoning=text.rstrip().endswith("<think>"), tools=use_tools, forced=forced,
              one_call=bool(use_tools and tc and tc.disable_parallel_tool_use))
    job = await asyncio.to_thread(srv.finish_job, job)
    mid = "msg_" + uuid.uuid4().hex[:24]
    if body.stream:
        return StreamingResponse(_stream(srv, job, mid, name), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    blocks, res = [], None
    try:
        async for ev in srv.run(job, request):
            kind = ev[0]
            if kind == "reasoning":
                if blocks and blocks[-1]["type"] == "thinking":
                    blocks[-1]["thinking"] += ev[1]
                else:
                    blocks.append({"type": "thinking", "thinking": ev[1], "signature": ""})
            elif kind == "content":
                if blocks and blocks[-1]["type"] == "text":
                    blocks[-1]["text"] += ev[1]
                else:
                    blocks.append({"type": "text", "text": ev[1]})
            elif kind == "tool_call":
                c = ev[1]
                blocks.append({"type": "tool_use", "id": _tool_use_id(c.id), "name": c.name, "input": c.args_dict()})
            else:
                res = ev[1]
    except GenerationError as e:
        raise APIError(e.status, str(e), "api_error" if e.status == 500 else "overloaded_error") from None
    return JSONResponse({
        "id": mid, "type": "message", "role": "assistant", "model": name, "content": blocks,
        "stop_reason": "stop_sequence" if res.stop_word else STOP_REASON.get(res.finish_reason, "end_turn"),
        "stop_sequence": res.stop_word, "usage": _usage(res), "timings": res.timings,
    })


def _usage(res) -> dict:
    return _split(res.prompt_tokens, res.cached_tokens, res.completion_tokens)


def _split(n_prompt: int, cached: int, n_out: int) -> dict:
    """Anthropic's usage: input_tokens are the prompt tokens read, not those reused from the prompt cache (a slot's
    prefix or the conversation cache), which are cache_read_input_tokens. Every prefix is cached as it is read, with
    no cache_control breakpoint, so nothing is counted as cache creation (as OpenAI's cached_tokens counts none)."""
    return {"input_tokens": n_prompt - cached, "output_tokens": n_out, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def _ev(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


PING = _ev("ping", {"type": "ping"})


async def _stream(srv, job: Job, mid: str, name: str):
    n_prompt = len(job.prompt)
    started = False

    def message_start(cached: int) -> list[str]:
        nonlocal started
        started = True
        return [_ev("message_start", {"type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "model": name, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": _split(n_prompt, cached, 0)}}),
            PING]  # as Anthropic's streams send one after message_start

    index, open_type = -1, None

    def close():
        nonlocal open_type
        out = []
        if open_type == "thinking":
            out.append(_ev("content_block_delta", {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": "signature_delta", "signature": ""}}))
        if open_type is not None:
            out.append(_ev("content_block_stop", {"type": "content_block_stop", "index": index}))
        open_type = None
        return out

    def open_block(kind: str, block: dict):
        nonlocal index, open_type
        out = close()
        index += 1
        open_type = kind
        out.append(_ev("content_block_start", {"type": "content_block_start", "index": index,
                                               "content_block": block}))
        return out

    last_out = time.monotonic()
    try:
        # message_start waits for the request's slot, which decides the prompt tokens reused (its usage's split);
        # a request that waits longer than a ping's interval (all slots busy) starts with its whole prompt as
        # input_tokens, and message_delta's usage, which the clients take over message_start's, has the split
        async for ev in srv.run(job, idle_s=srv.ping_s):
            kind = ev[0]
            out = []
            if kind == "idle":
                out += [PING] if started else message_start(0)
            elif not started:  # (an event before "start": the request ended before it had a slot)
                out += message_start(ev[1].cached if kind == "start" else 0)
            if kind == "reasoning":
                if open_type != "thinking":
                    out += open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(_ev("content_block_delta", {"type": "content_block_delta", "index": index,
                                                       "delta": {"type": "thinking_delta", "thinking": ev[1]}}))
            elif kind == "content":
                if open_type != "text":
                    out += open_block("text", {"type": "text", "text": ""})
                out.append(_ev("content_block_delta", {"type": "content_block_delta", "index": index,
                                                       "delta": {"type": "text_delta", "text": ev[1]}}))
            elif kind == "tool_call":
                c = ev[1]
                out += open_block("tool_use", {"type": "tool_use", "id": _tool_use_id(c.id), "name": c.name,
                                               "input": {}})
                out.append(_ev("content_block_delta", {"type": "content_block_delta", "index": index,
                                                       "delta": {"type": "input_json_delta",
                                                                 "partial_json": json.dumps(c.args_dict())}}))
            elif kind == "done":
                res = ev[1]
                out += close()
                reason = "stop_sequence" if res.stop_word else STOP_REASON.get(res.finish_reason, "end_turn")
                out.append(_ev("message_delta", {"type": "message_delta",
                                                 "delta": {"stop_reason": reason, "stop_sequence": res.stop_word},
                                                 "usage": _usage(res), "timings": res.timings}))
                out.append(_ev("message_stop", {"type": "message_stop"}))
            if not out and time.monotonic() - last_out >= srv.ping_s:
                out = [PING]  # tokens come but none is sent yet (a tool call is held until it is whole)
            if out:
                last_out = time.monotonic()
            for o in out:
                yield o
    except GenerationError as e:
        kind = "api_error" if e.status == 500 else "overloaded_error"
        for o in message_start(0) if not started else []:  # (a stream starts with message_start, errors too)
            yield o
        yield _ev("error", {"type": "error", "error": {"type": kind, "message": str(e)}})
