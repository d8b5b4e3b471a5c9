"""OpenAI's API: POST /v1/chat/completions, POST /v1/completions, GET /v1/models (POST /v1/embeddings: refused)."""

from __future__ import annotations

import asyncio
import datetime
import json
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from strata.server.body import read_request
from strata.server.choices import chat_logprobs, check_n, legacy_logprobs, merged, run_all, usage_of
from strata.server.protocol import (GET_HEAD, APIError, ChatRequest, CompletionRequest, OtherPart, RefusalPart,
                                    bad_request, no_limit)
from strata.server.generation import GenerationError, Result
from strata.server.job import Job, parse_arguments, sampling, stop_list

router = APIRouter()
FINGERPRINT = "strata"


def server_of(request: Request):
    srv = getattr(request.app.state, "server", None)
    if srv is None:
        raise APIError(503, "the model is still loading", "unavailable_error")
    return srv


def check_model(request: Request, name: str | None) -> str:
    """The model name a reply carries: the one the request named (the model's id or an --alias, echoed as
    llama.cpp echoes it: a client that asked for "gpt-4o" may check it got "gpt-4o"), else the model's id. A
    name the server does not answer to is a 404."""
    st = request.app.state
    if name is None:
        return st.model_id
    if name not in st.model_names:
        names = ", ".join(repr(n) for n in _names(st))
        raise APIError(404, f"model {name!r} not found (this server serves {names})", "not_found_error",
                       "model_not_found")
    return name


def _names(st) -> list[str]:
    """The model's id, then its --alias names: each a model a client can pick from /v1/models."""
    return [st.model_id, *(n for n in sorted(st.model_names) if n != st.model_id)]


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(res: Result) -> dict:
    return {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
            "total_tokens": res.prompt_tokens + res.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": res.cached_tokens}}


def error_event(e: Exception) -> str:
    return sse({"error": {"type": "server_error", "message": str(e), "code": None, "param": None}})


# ---------------------------------------------------------------------------------------------------------------
# chat


def _text(content, where: str, role: str = "user") -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for p in content:
        if isinstance(p, RefusalPart):
            # a refusal the model gave earlier, as OpenAI returns it in an assistant message: its text
            if role != "assistant":
                raise bad_request(f"{where}: a refusal content part belongs to an assistant message")
            parts.append(p.refusal)
            continue
        if isinstance(p, OtherPart):
            raise bad_request(f"{where}: content parts of type {p.type!r} are not supported (text only)")
        parts.append(p.text)
    return "".join(parts)


def chat_messages(body: ChatRequest) -> list[dict]:
    msgs = []
    for i, m in enumerate(body.messages):
        d = {"role": "system" if m.role == "developer" else m.role,
             "content": _text(m.content, f"messages.{i}", m.role)}
        if m.role == "assistant" and m.tool_calls:
            if not d["content"]:
                d["content"] = None  # calls and no text: the template gets None (strata.server.template_inputs)
            # arguments as the client wrote them (checked to be a JSON object): the template gets a dict, or this
            # string where it concatenates them as text
            d["tool_calls"] = [{"id": tc.id or f"call_{i}_{j}", "type": "function",
                                "function": {"name": tc.function.name,
                                             "arguments": _checked(tc.function.arguments)}}
                               for j, tc in enumerate(m.tool_calls)]
        if m.role == "tool":
            if m.tool_call_id:
                d["tool_call_id"] = m.tool_call_id
            if m.name:
                d["name"] = m.name
        if m.role == "assistant" and m.reasoning_content:
            d["reasoning_content"] = m.reasoning_content
        msgs.append(d)
    return msgs


def _checked(args):
    v = parse_arguments(args)  # a 400 unless a JSON object
    return args if args else v  # (no arguments at all: {})


def constraint(srv, body) -> tuple[str | None, str]:
    """The grammar of response_format / json_schema / grammar (at most one of them), and how its errors name it."""
    rf = body.response_format if body.response_format is not None and body.response_format.type != "text" else None
    asked = [k for k, v in (("response_format", rf), ("json_schema", body.json_schema), ("grammar", body.grammar))
             if v is not None]
    if len(asked) > 1:
        raise bad_request(f"{asked[0]} and {asked[1]} both constrain the output: send one of them")
    if body.grammar is not None:
        return srv.gbnf_grammar(body.grammar), "the grammar"
    if body.json_schema is not None:
        return srv.json_grammar(body.json_schema, False), "the json_schema grammar"
    if rf is None:
        return None, ""
    schema, strict = None, False  # json_object: any JSON object
    if rf.type == "json_schema":
        spec = rf.json_schema
        schema = (spec.schema_ if spec else None) or rf.schema_
        if schema is None:
            raise bad_request("response_format json_schema needs json_schema.schema")
        strict = bool(spec and spec.strict)
    return srv.json_grammar(schema, strict), f"the response_format {rf.type} grammar"


async def prepare_chat(srv, body: ChatRequest) -> Job:
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true")
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = body.tool_choice or "auto"
    only = None
    if not isinstance(choice, str):
        only = choice.function.name
        if not tools or only not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"tool_choice names {only!r}, which is not among the request's tools")
    elif choice == "required" and not tools:
        raise bad_request("tool_choice 'required' needs tools")
    use_tools = tools if choice != "none" else None
    if use_tools and (only is not None or choice == "required") and (body.grammar or body.json_schema):
        raise bad_request("tool_choice forces a tool call, so grammar / json_schema cannot also constrain the output")
    thinking = None
    if body.reasoning_effort is not None:
        thinking = body.reasoning_effort != "none"
    kw = body.chat_template_kwargs or {}
    if isinstance(kw.get("enable_thinking"), bool):
        thinking = kw["enable_thinking"]
    cont = body.continue_final_message
    if cont and body.add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true")
    if cont and body.messages[-1].role != "assistant":
        raise bad_request("continue_final_message needs the last message to be an assistant message")
    msgs = chat_messages(body)
    text = await asyncio.to_thread(srv.render, msgs, use_tools, thinking, cont, body.add_generation_prompt is not False)
    asked = no_limit(body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens)
    if body.max_completion_tokens is None and body.max_tokens is None:
        asked = srv.n_predict  # (serve's -n)
    srv.check_size(text)
    ids = await asyncio.to_thread(srv.encode_chat, text)
    max_tokens = srv.max_tokens(len(ids), asked)
    grammar, what = None, "the output grammar"
    if use_tools and (only is not None or choice == "required"):
        # (grammars are built off the event loop: a large one takes a while, and other streams wait on the loop)
        grammar = await asyncio.to_thread(srv.tool_call_grammar, use_tools, only, body.parallel_tool_calls is not False,
                                          text.rstrip().endswith("<think>"))
    forced = grammar is not None
    if not forced:  # (a forced call's grammar wins over response_format, which shapes a text answer)
        grammar, what = await asyncio.to_thread(constraint, srv, body)
    job = Job(ids, sampling(body, srv.defaults), max_tokens, srv.stop_ids(body.ignore_eos), draft_max=body.speculative_n_max,
              logprobs=(body.top_logprobs or 0) if body.logprobs else None,
              stop=stop_list(body.stop), logit_bias=body.logit_bias, grammar=grammar, grammar_what=what,
              reasoning=body.reasoning_format != "none", in_reasoning=text.rstrip().endswith("<think>"),
              tools=use_tools, forced=forced, one_call=bool(use_tools) and body.parallel_tool_calls is False,
              cache_prompt=body.cache_prompt)
    return await asyncio.to_thread(srv.finish_job, job)  # a grammar may take a moment to build


def _call_json(c, index: int) -> dict:
    return {"index": index, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    srv = server_of(request)
    body = await read_request(request, ChatRequest)
    name = check_model(request, body.model)
    n = check_n(srv, body.n)
    jobs = (await prepare_chat(srv, body)).copies(n)
    cid, created = "chatcmpl-" + uuid.uuid4().hex[:24], int(time.time())
    base = {"id": cid, "created": created, "model": name, "system_fingerprint": FINGERPRINT}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_chat_stream(srv, jobs, base, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        outs = await run_all(srv, jobs, request)
    except GenerationError as e:
        raise APIError(e.status, str(e), "server_error" if e.status == 500 else "unavailable_error") from None
    choices = []
    for i, c in enumerate(outs):
        text = "".join(c.content)
        msg = {"role": "assistant", "content": text if (text or not c.calls) else None}
        if c.reasoning:
            msg["reasoning_content"] = "".join(c.reasoning)  # (its trailing newlines dropped as streamed: RunEnd)
        if c.calls:
            msg["tool_calls"] = [_call_json(call, j) for j, call in enumerate(c.calls)]
            for t in msg["tool_calls"]:
                del t["index"]
        choices.append({"index": i, "message": msg, "finish_reason": c.result.finish_reason,
                        "logprobs": chat_logprobs(c.logprobs if body.logprobs else None)})
    res = [c.result for c in outs]
    return JSONResponse({**base, "object": "chat.completion", "choices": choices, "usage": usage_of(res),
                         "timings": res[0].timings})


async def _chat_stream(srv, jobs: list[Job], base: dict, include_usage: bool):
    with_lp = jobs[0].logprobs is not None
    pending: list[list[dict]] = [[] for _ in jobs]  # log-probabilities not sent yet, per choice

    def chunk(i, delta, finish=None, **extra):
        lp = None
        if with_lp:
            lp, pending[i] = chat_logprobs(pending[i]), []
        return sse({**base, "object": "chat.completion.chunk",
                    "choices": [{"index": i, "delta": delta, "finish_reason": finish, "logprobs": lp}], **extra})

    for i in range(len(jobs)):
        yield chunk(i, {"role": "assistant", "content": ""})
    n_calls = [0] * len(jobs)
    results = []
    try:
        async for i, ev in merged(srv, jobs):
            kind = ev[0]
            if kind == "logprobs":
                pending[i].append(ev[1])  # sent with this choice's next chunk
            elif kind == "content":
                yield chunk(i, {"content": ev[1]})
            elif kind == "reasoning":
                yield chunk(i, {"reasoning_content": ev[1]})
            elif kind == "tool_call":
                c = ev[1]
                yield chunk(i, {"tool_calls": [{"index": n_calls[i], "id": c.id, "type": "function",
                                                "function": {"name": c.name, "arguments": ""}}]})
                yield chunk(i, {"tool_calls": [{"index": n_calls[i], "function": {"arguments": c.arguments}}]})
                n_calls[i] += 1
            else:
                res = ev[1]
                results.append(res)
                yield chunk(i, {}, res.finish_reason, timings=res.timings)
        if include_usage:
            yield sse({**base, "object": "chat.completion.chunk", "choices": [], "usage": usage_of(results)})
    except GenerationError as e:
        yield error_event(e)
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------------------------
# completions


async def prepare_completion(srv, body: CompletionRequest) -> tuple[Job, str]:
    if body.logprobs is not None and body.echo:
        raise bad_request("logprobs with echo (log-probabilities of the prompt's tokens) are not supported")
    if body.suffix:
        raise bad_request("suffix (fill-in-the-middle) is not supported")
    p = body.prompt
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        if len(p) != 1:
            raise bad_request("prompt: one prompt per request")
        p = p[0]
    # (unset: serve's -n, else OpenAI's default for completions)
    asked = no_limit(body.max_tokens) if body.max_tokens is not None else srv.n_predict or 16
    if isinstance(p, str):
        srv.check_size(p)
        ids = await asyncio.to_thread(srv.tok.encode, p)
        max_tokens = srv.max_tokens(len(ids), asked)
        text = p
    else:
        # the length first: ids that cannot fit are refused before a walk over millions of them
        max_tokens = srv.max_tokens(len(p), asked)
        if any(not 0 <= t < srv.vocab_size for t in p):
            raise bad_request(f"prompt: token ids must be in 0..{srv.vocab_size - 1}")
        ids = list(p)
        text = srv.tok.decode(p) if body.echo else ""
    grammar, what = await asyncio.to_thread(constraint, srv, body)
    job = Job(ids, sampling(body, srv.defaults), max_tokens, srv.stop_ids(body.ignore_eos), draft_max=body.speculative_n_max,
              logprobs=body.logprobs, stop=stop_list(body.stop), logit_bias=body.logit_bias, grammar=grammar,
              grammar_what=what, cache_prompt=body.cache_prompt, kind="completion")
    return await asyncio.to_thread(srv.finish_job, job), text if body.echo else ""


@router.post("/v1/completions")
async def completions(request: Request):
    srv = server_of(request)
    body = await read_request(request, CompletionRequest)
    name = check_model(request, body.model)
    n = check_n(srv, body.n)
    if body.best_of is not None and body.best_of != n:
        raise bad_request(f"best_of {body.best_of} is not supported (nothing ranks choices on this server): leave it "
                          f"out, or set it to n ({n}), and ask for n choices")
    job, echo = await prepare_completion(srv, body)
    jobs = job.copies(n)
    base = {"id": "cmpl-" + uuid.uuid4().hex[:24], "object": "text_completion", "created": int(time.time()),
            "model": name, "system_fingerprint": FINGERPRINT}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_completion_stream(srv, jobs, base, echo, include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        outs = await run_all(srv, jobs, request)
    except GenerationError as e:
        raise APIError(e.status, str(e), "server_error" if e.status == 500 else "unavailable_error") from None
    choices = [{"index": i, "text": echo + "".join(c.content),
                "logprobs": legacy_logprobs(c.logprobs if job.logprobs is not None else None, c.offsets, len(echo)),
                "finish_reason": c.result.finish_reason} for i, c in enumerate(outs)]
    res = [c.result for c in outs]
    return JSONResponse({**base, "choices": choices, "usage": usage_of(res), "timings": res[0].timings})


async def _completion_stream(srv, jobs: list[Job], base: dict, echo: str, include_usage: bool):
    with_lp = jobs[0].logprobs is not None
    pending: list[list[tuple[dict, int]]] = [[] for _ in jobs]  # (entry, its offset) not sent yet, per choice

    def chunk(i, text, finish=None, **extra):
        lp = None
        if with_lp:
            lp = legacy_logprobs([e for e, _ in pending[i]], [o for _, o in pending[i]], len(echo))
            pending[i] = []
        return sse({**base, "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}],
                    **extra})

    results = []
    try:
        if echo:
            for i in range(len(jobs)):
                yield sse({**base, "choices": [{"index": i, "text": echo, "logprobs": None, "finish_reason": None}]})
        async for i, ev in merged(srv, jobs):
            if ev[0] == "logprobs":
                pending[i].append((ev[1], ev[2]))
            elif ev[0] == "content":
                yield chunk(i, ev[1])
            elif ev[0] == "done":
                res = ev[1]
                results.append(res)
                yield chunk(i, "", res.finish_reason, timings=res.timings)
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage_of(results)})
    except GenerationError as e:
        yield error_event(e)
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------------------------
# models


def model_card(request: Request, name: str | None = None) -> dict:
    """A model as both APIs list it: OpenAI's fields (object, created, owned_by) and Anthropic's (type,
    display_name, created_at as RFC 3339), so that either client reads its own."""
    st = request.app.state
    name = name or st.model_id
    created = datetime.datetime.fromtimestamp(int(st.started), datetime.timezone.utc)
    return {"id": name, "object": "model", "created": int(st.started), "owned_by": "strata",
            "type": "model", "display_name": name, "created_at": created.isoformat().replace("+00:00", "Z"),
            "meta": st.model_meta}


@router.api_route("/v1/models", methods=GET_HEAD)
async def models(request: Request):
    # the aliases listed as models of their own (as vLLM lists each --served-model-name): a client picks from here.
    # has_more / first_id / last_id: Anthropic's page of the list (one page holds them all)
    names = _names(request.app.state)
    return {"object": "list", "data": [model_card(request, n) for n in names], "has_more": False,
            "first_id": names[0], "last_id": names[-1]}


@router.post("/v1/embeddings")
@router.post("/embeddings")
async def embeddings(request: Request):
    # a generative model's hidden states are no embedding model's vectors: refused by name (as vLLM refuses a
    # generative model's embeddings), not answered as an unknown route
    raise bad_request("embeddings are not supported: this server serves a text-generation model (/v1/chat/completions, "
                      "/v1/completions, /v1/responses, /v1/messages)")


@router.api_route("/v1/models/{name:path}", methods=GET_HEAD)
async def model(name: str, request: Request):
    check_model(request, name)
    return model_card(request, name)
