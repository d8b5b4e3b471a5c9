"""OpenAI's Responses API: POST /v1/responses (stream and not), what Codex CLI and OpenAI's agent SDKs speak.

A request is read into the chat path's request (messages, tools, tool_choice, response_format, reasoning_effort)
and run as the same Job (strata.server.openai_api.prepare_chat): the same rendering, tool-call parsing,
reasoning split, grammars and sampling. Only the shapes differ: input items in, output items and typed stream
events out. Nothing is stored: `store` is accepted and ignored, and `previous_response_id` is refused.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from strata.server.body import read_request
from strata.server.generation import GenerationError
from strata.server.job import parse_arguments
from strata.server.openai_api import check_model, prepare_chat, server_of
from strata.server.protocol import APIError, ChatRequest, bad_request, parse
from strata.server.responses_protocol import (RFunctionCall, RFunctionCallOutput, RMessage, ROtherItem, ROtherPart,
                                              RReasoning, RRefusal, ResponsesRequest)

router = APIRouter()


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    out = []
    for p in content:
        if isinstance(p, ROtherPart):
            raise bad_request(f"{where}: content parts of type {p.type!r} are not supported (text only)")
        out.append(p.refusal if isinstance(p, RRefusal) else p.text)
    return "".join(out)


def _messages(body: ResponsesRequest) -> list[dict]:
    """The input items as the chat path's messages: `instructions` first as a system message, a developer message
    as a system one, and each function_call joined to the assistant turn it follows (the chat templates' shape)."""
    if isinstance(body.input, str):
        items = [RMessage(role="user", content=body.input)] if body.input else []
    else:
        items = body.input
    if not items:
        raise bad_request("input: must not be empty (a string or a list of input items)")
    msgs = [{"role": "system", "content": body.instructions}] if body.instructions else []
    names: dict[str, str] = {}  # call_id -> the function's name (templates that name a tool result)
    for i, it in enumerate(items):
        where = f"input.{i}"
        if isinstance(it, RReasoning):
            continue
        if isinstance(it, ROtherItem):
            raise bad_request(f"{where}: input items of type {it.type!r} are not supported (message, function_call, "
                              "function_call_output and reasoning items only)")
        if isinstance(it, RMessage):
            msgs.append({"role": "system" if it.role == "developer" else it.role,
                         "content": _text(it.content, where)})
        elif isinstance(it, RFunctionCall):
            try:
                parse_arguments(it.arguments)
            except APIError:
                raise bad_request(f"{where}: arguments must be a JSON object") from None
            names[it.call_id] = it.name
            call = {"id": it.call_id, "type": "function", "function": {"name": it.name, "arguments": it.arguments}}
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(it, RFunctionCallOutput):
            if it.call_id not in names:
                raise bad_request(f"{where}: function_call_output for call_id {it.call_id!r}, which no function_call "
                                  "item before it made")
            msgs.append({"role": "tool", "tool_call_id": it.call_id, "name": names[it.call_id],
                         "content": _text(it.output, where)})
    return msgs


def _tools(body: ResponsesRequest) -> list[dict] | None:
    if not body.tools:
        return None
    out = []
    for i, t in enumerate(body.tools):
        if t.type != "function":
            raise bad_request(f"tools.{i}: tools of type {t.type!r} are not supported by this server (it runs no "
                              "hosted tools: function tools only)")
        if not t.name:
            raise bad_request(f"tools.{i}: a function tool needs a name")
        fn = {"name": t.name, "parameters": t.parameters if t.parameters is not None else {"type": "object"}}
        if t.description is not None:
            fn["description"] = t.description
        if t.strict is not None:
            fn["strict"] = t.strict
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(body: ResponsesRequest):
    tc = body.tool_choice
    if tc is None or isinstance(tc, str):
        return tc
    if tc.type != "function":
        raise bad_request(f"tool_choice of type {tc.type!r} is not supported (\"auto\", \"none\", \"required\" or "
                          "{\"type\": \"function\", \"name\": ...})")
    if not tc.name:
        raise bad_request("tool_choice: a function choice needs the function's name")
    return {"type": "function", "function": {"name": tc.name}}


def _response_format(body: ResponsesRequest) -> dict | None:
    f = body.text.format if body.text is not None else None
    if f is None or f.type == "text":
        return None
    if f.type == "json_object":
        return {"type": "json_object"}
    if f.schema_ is None:
        raise bad_request("text.format: a json_schema format needs its schema")
    return {"type": "json_schema", "json_schema": {"name": f.name, "schema": f.schema_, "strict": f.strict}}


def chat_request(body: ResponsesRequest) -> ChatRequest:
    """The chat path's request that runs this one."""
    if body.previous_response_id is not None:
        raise bad_request("previous_response_id is not supported: this server keeps no responses (send the whole "
                          "conversation in input)")
    effort = body.reasoning.effort if body.reasoning is not None else None
    d = {"model": body.model, "messages": _messages(body), "tools": _tools(body), "tool_choice": _tool_choice(body),
         "parallel_tool_calls": body.parallel_tool_calls, "max_completion_tokens": body.max_output_tokens,
         "temperature": body.temperature, "top_p": body.top_p, "response_format": _response_format(body),
         "reasoning_effort": "high" if effort == "xhigh" else effort}
    return parse(ChatRequest, {k: v for k, v in d.items() if v is not None})


def _base(body: ResponsesRequest, rid: str, name: str) -> dict:
    """The response object's fields that echo the request."""
    tc = body.tool_choice
    fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else None
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "model": name, "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            "store": False, "temperature": body.temperature, "top_p": body.top_p,
            "text": {"format": fmt or {"type": "text"}},
            "tool_choice": (tc.model_dump(exclude_none=True) if tc is not None and not isinstance(tc, str)
                            else tc or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []], "truncation": "disabled",
            "usage": None, "metadata": body.metadata or {}, "user": body.user}


class Output:
    """The output items built from the Job's events, and the stream events that build them, in OpenAI's order:
    an item's added event, its content part's, the deltas, then the part's and the item's done events."""

    def __init__(self, srv, base: dict):
        self.srv, self.resp, self.seq = srv, base, 0
        self.items: list[dict] = []
        self.open: dict | None = None  # the item receiving deltas (a reasoning or a message item)

    def ev(self, type_: str, **data) -> str:
        d = {"type": type_, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {type_}\ndata: {json.dumps(d, ensure_ascii=False)}\n\n"

    def lifecycle(self, type_: str) -> str:
        return self.ev(type_, response=self.resp)

    def _add(self, item: dict) -> list[str]:
        self.items.append(item)
        return [self.ev("response.output_item.added", output_index=len(self.items) - 1, item=dict(item, content=[])
                        if "content" in item else dict(item))]

    def _where(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def text(self, kind: str, delta: str) -> list[str]:
        """A delta of reasoning ("reasoning") or answer text ("content")."""
        out = []
        if self.open is None or self.open["type"] != ("reasoning" if kind == "reasoning" else "message"):
            out += self.close()
            if kind == "reasoning":
                item = {"id": "rs_" + uuid.uuid4().hex, "type": "reasoning", "summary": [],
                        "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
            else:
                item = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "status": "in_progress",
                        "role": "assistant", "content": [{"type": "output_text", "text": "", "annotations": []}]}
            out += self._add(item)
            self.open = item
            part = dict(item["content"][0])
            out.append(self.ev("response.content_part.added", **self._where(), content_index=0, part=part))
        self.open["content"][0]["text"] += delta
        if kind == "reasoning":
            out.append(self.ev("response.reasoning_text.delta", **self._where(), content_index=0, delta=delta))
        else:
            out.append(self.ev("response.output_text.delta", **self._where(), content_index=0, delta=delta,
                               logprobs=[]))
        return out

    def close(self, status: str = "completed") -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        part, where = item["content"][0], self._where()
        if item["type"] == "reasoning":
            out = [self.ev("response.reasoning_text.done", **where, content_index=0, text=part["text"])]
        else:
            out = [self.ev("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])]
        out.append(self.ev("response.content_part.done", **where, content_index=0, part=part))
        out.append(self.ev("response.output_item.done", output_index=where["output_index"], item=item))
        return out

    def call(self, c) -> list[str]:
        out = self.close()
        item = {"id": "fc_" + uuid.uuid4().hex, "type": "function_call", "status": "in_progress",
                "call_id": c.id, "name": c.name, "arguments": ""}
        out += self._add(item)
        where = self._where()
        out.append(self.ev("response.function_call_arguments.delta", **where, delta=c.arguments))
        item.update(arguments=c.arguments, status="completed")
        out.append(self.ev("response.function_call_arguments.done", **where, name=c.name, arguments=c.arguments))
        out.append(self.ev("response.output_item.done", output_index=where["output_index"], item=item))
        return out

    def done(self, res) -> list[str]:
        cut = res.finish_reason == "length"
        out = self.close("incomplete" if cut else "completed")
        thought = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")
        # the thinking's tokens: its text encoded again (the engine counts a reply's tokens, not which were thought)
        n_think = min(len(self.srv.tok.encode(thought, add_special=False)), res.completion_tokens) if thought else 0
        self.resp.update(status="incomplete" if cut else "completed", output=self.items,
                         incomplete_details={"reason": "max_output_tokens"} if cut else None,
                         usage={"input_tokens": res.prompt_tokens,
                                "input_tokens_details": {"cached_tokens": res.cached_tokens},
                                "output_tokens": res.completion_tokens,
                                "output_tokens_details": {"reasoning_tokens": n_think},
                                "total_tokens": res.prompt_tokens + res.completion_tokens})
        # (OpenAI ends a response cut at max_output_tokens with response.incomplete, not response.completed)
        out.append(self.lifecycle("response.incomplete" if cut else "response.completed"))
        return out

    def add(self, ev) -> list[str]:
        if ev[0] in ("reasoning", "content"):
            return self.text(ev[0], ev[1])
        if ev[0] == "tool_call":
            return self.call(ev[1])
        if ev[0] == "done":
            return self.done(ev[1])
        return []


@router.post("/v1/responses")
async def responses(request: Request):
    srv = server_of(request)
    body = await read_request(request, ResponsesRequest)
    name = check_model(request, body.model)
    job = await prepare_chat(srv, chat_request(body))
    out = Output(srv, _base(body, "resp_" + uuid.uuid4().hex, name))
    if body.stream:
        return StreamingResponse(_stream(srv, job, out), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        async for ev in srv.run(job, request):
            out.add(ev)
    except GenerationError as e:
        raise APIError(e.status, str(e), "server_error" if e.status == 500 else "unavailable_error") from None
    return JSONResponse(out.resp)


async def _stream(srv, job, out: Output):
    yield out.lifecycle("response.created")
    yield out.lifecycle("response.in_progress")
    try:
        async for ev in srv.run(job):  # a client that leaves closes this generator: the generation is cancelled
            for s in out.add(ev):
                yield s
    except GenerationError as e:
        yield out.ev("error", code="server_error" if e.status == 500 else "unavailable_error", message=str(e),
                     param=None)
