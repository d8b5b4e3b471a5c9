"""The FastAPI application: routes, error bodies, access control, and the engine's life cycle.

`create_app(cfg, load)` returns an app whose lifespan loads the model on a background thread (so /health can
say 503 while it loads), builds the Engine and starts its worker thread; `create_app(cfg, lm=...)` serves an
already-loaded model.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from strata import StrataError, __version__
from strata.engine.sampler import SamplingParams
from strata.server.protocol import GET_HEAD, APIError

log = logging.getLogger("strata.server")


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    cors_origins: list[str] = field(default_factory=list)
    parallel: int = 1  # KV slots; 0: auto (strata.engine.auto_slots)
    prompt_cache_mib: int = 1024
    model_id: str = "strata"
    aliases: list[str] = field(default_factory=list)
    prefill_chunk: int = 0
    warmup: bool = True
    warmup_tune_s: float = 90.0  # at most this long choosing the CPU/PCIe plan on warm-up text (strata.server.warmup)
    # the sampling of a request that sets no such fields (`strata serve --temp/--seed/...`; None: SamplingParams'
    # defaults), and its max_tokens when it sets none (None: as many as the context leaves)
    sampling: SamplingParams | None = None
    n_predict: int | None = None
    # a connection that sends no byte for this long while the server waits for its request (headers or body), or
    # takes no byte of its response, is closed, as llama.cpp's server does after its --timeout; uvicorn alone
    # would hold it open forever (strata.server.http_protocol)
    timeout_s: float = 600.0
    # a stream of Anthropic's Messages API sends a ping event after this many seconds without one (a long prompt
    # being read, a request waiting for a slot), as Anthropic's streams do: proxies and clients that drop a
    # connection idle for a while (often 60 s) keep it
    ping_s: float = 5.0
    fault_after_tokens: int | None = None  # tests only: see strata.config.fault_after_tokens_for_tests


def _cache_settings(engine) -> dict | None:
    """The expert cache's policy, its decay (lfu-decay) and swap budget, or None without a cache."""
    experts = getattr(engine.model, "experts", None)
    pol = getattr(experts, "policy", None)
    if pol is None:
        return None
    ex = engine.lm.cfg.experts
    return {"policy": ex.cache_policy, "decay": getattr(pol, "decay", None), "swap_budget": ex.swap_budget}


def _kv_types(engine) -> dict:
    """How the KV cache stores K and V (-ctk/-ctv, or --kv-dtype for both), by llama.cpp's type names. The
    engine's cache says, where it keeps them; else the types the engine was built with."""
    import torch

    names = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
    cfg_k, cfg_v = getattr(engine.lm.cfg, "kv_cache_types", (None, None))
    k, v = getattr(engine.kv, "k_type", None) or cfg_k, getattr(engine.kv, "v_type", None) or cfg_v

    def name(t):
        return None if t is None else t if isinstance(t, str) else names.get(t, str(t).replace("torch.", ""))

    return {"cache_type_k": name(k), "cache_type_v": name(v)}


def _decode_steps(engine) -> dict:
    """How decode steps run: replayed graphs, launched one ahead (strata.engine.ahead), and how many so far."""
    ahead = getattr(engine, "ahead", None)
    experts = getattr(engine.model, "experts", None)
    return {"graphs": getattr(engine, "graphs", None) is not None, "ahead": ahead is not None,
            "misses": getattr(experts, "decode_misses_path", None),
            "misses_why": getattr(experts, "path_reason", "") or None,  # (the plan trials' verdict, when one ran)
            "chunk_buffer_loans": getattr(experts, "loans", 0) if getattr(getattr(experts, "cache", None), "loan",
                                                                          False) else None,
            "chunk_buffer_borrow_ms": round(getattr(experts, "loan_ms", 0.0), 3),
            "launched_ahead": ahead.launched if ahead is not None else 0,
            "ahead_dropped": ahead.dropped if ahead is not None else 0,
            "verify_cost_ms": _verify_cost(engine),
            "prefetch": _prefetch(experts),
            **_memory_pressure(engine)}


def _memory_pressure(engine) -> dict:
    """Signs of a budget too tight for the steps (CUDA): torch's allocator retries (each one frees its cached blocks
    and waits for the device: a decode step that allocates at the cap pays that every time), and decode-step
    captures dropped or refused for want of VRAM (those steps run eagerly)."""
    if engine.device.type != "cuda":
        return {}
    import torch

    g = getattr(engine, "graphs", None)
    return {"alloc_retries": int(torch.cuda.memory_stats(engine.device).get("num_alloc_retries", 0)),
            "captures_dropped": g.dropped_for_memory if g is not None else 0,
            "captures_no_room": len(g.no_room) if g is not None else 0}


def _prefetch(experts) -> dict | None:
    """The next-layer expert prefetch of the staged path: on or not now, and the experts it copied ahead / that
    their layer then used (None: not the staged path)."""
    direct = getattr(experts, "direct", None)
    if direct is None or not getattr(direct, "stage", False):
        return None
    return {"on": bool(direct.prefetch), "issued": experts.prefetch_issued, "used": experts.prefetch_used,
            "off_why": direct.off_reason}


def _verify_cost(engine) -> dict | None:
    """What a step of one sequence costs by its token count, as the draft-length choice fits it
    (strata.engine.draft_cost): None until plain and verify steps have both been timed."""
    cost = getattr(engine, "draft_cost", None)
    fit = cost.line() if cost is not None else None
    return None if fit is None else {"one_token": round(fit[0], 3), "per_draft": round(fit[1], 3)}


def create_app(cfg: ServeConfig, load: Callable[[], object] | None = None, lm=None,
               narrate: Callable[[str], None] | None = None,
               on_error: Callable[[BaseException], None] | None = None) -> FastAPI:
    from contextlib import asynccontextmanager

    say = narrate or (lambda msg: log.info(msg))
    holder: dict = {}

    def bring_up():
        try:
            model = lm if lm is not None else load()
            state = _start_engine(app, cfg, model, say)
            holder["worker"] = state
        except BaseException as e:  # noqa: BLE001 - reported by the caller (the CLI exits)
            # a StrataError is a message for the user; anything else is named by its class too
            app.state.load_error = str(e) if isinstance(e, StrataError) else f"{type(e).__name__}: {e}"
            if on_error is not None:  # the caller reports it (`strata serve`: one `strata: error:` line)
                on_error(e)
            else:
                log.error("strata: could not start: %s", app.state.load_error)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        t = threading.Thread(target=bring_up, name="strata-load", daemon=True)
        t.start()
        if lm is not None:  # already loaded: be ready when the server is
            t.join()
        yield
        w = holder.get("worker")
        if w is not None:
            w.stop()

    app = FastAPI(title="strata", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = None
    app.state.load_error = None
    app.state.model_id = cfg.model_id
    app.state.model_names = {cfg.model_id, *cfg.aliases}
    app.state.model_meta = {}
    app.state.started = time.time()
    app.state.closing = False  # shutting down: open streams end (strata.server.app.shutting_down)
    app.state.cfg = cfg

    from strata.server.metrics import Metrics

    app.state.metrics = Metrics(cfg.model_id)
    _routes(app)
    from strata.server import anthropic_api, openai_api, responses_api, web

    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(responses_api.router)
    app.include_router(web.router)
    from strata.server.auth import AccessControl

    # the last one added runs first: access control, then error containment, then the routes
    app.add_middleware(ContainErrors)
    app.add_middleware(AccessControl, api_key=cfg.api_key, bound_host=cfg.host, port=cfg.port,
                       cors_origins=cfg.cors_origins)
    return app


def shutting_down(app: FastAPI) -> None:
    """The server stops: every generation ends now with an error (OpenAI's streams then send [DONE], Anthropic's
    an error event, a waiting non-streamed request gets a 503), and the monitor's stream ends, so that no
    response is still open when uvicorn's grace period runs out."""
    app.state.closing = True
    srv = app.state.server
    if srv is not None:
        srv.worker.close("the server is shutting down")


def _start_engine(app: FastAPI, cfg: ServeConfig, lm, say) -> object:
    from strata.engine.engine import Engine
    from strata.server.grammar import Grammars, constrained_available
    from strata.server.prompt_cache import PromptCache
    from strata.server.generation import Server
    from strata.server.worker import EngineWorker
    from strata.server.toolcalls import detect_format

    if lm.tokenizer is None:
        raise APIError(500, "the model has no tokenizer in its metadata")
    t0 = time.perf_counter()
    if cfg.parallel < 1:  # -np auto: from the KV a slot takes and the memory it lives in
        from strata.engine.auto_slots import auto_slots

        chosen = auto_slots(lm)
        cfg.parallel = chosen.slots
        say(chosen.render())
    engine = Engine(lm, n_slots=cfg.parallel, prefill_chunk=cfg.prefill_chunk or None)
    kv_mib = engine.kv.nbytes / 2**20
    say(f"KV cache: {cfg.parallel} slot(s) x {engine.max_ctx} tokens ({kv_mib:.0f} MiB on {engine.device}), "
        f"prefill chunk {engine.prefill_chunk}")
    if engine.kv_window_stats is not None:
        say(engine.kv.describe())
    if engine.vram_split is not None:  # how --vram-gb (or the device) was divided, the expert cache's share
        say(engine.vram_split.render())
    warmed = {}
    if cfg.warmup:
        from strata.server.warmup import warm_up

        warmed = warm_up(engine, lm.tokenizer, say, cfg.warmup_tune_s)
    elif engine.model.experts is not None and engine.model.experts.tuning():
        # no warm-up traffic to tune on: keep the cost model's plan rather than try plans inside requests
        say(f"CPU/PCIe plan from the cost model (no warm-up): {engine.model.experts.end_tuning()}")
    metrics = app.state.metrics
    pipelined = getattr(engine.model, "stage", None) is not None  # (strata.engine.pipeline)
    if pipelined and cfg.prompt_cache_mib:
        say("conversation cache in RAM off: it does not save KV rows across pipeline stages yet")
    cache = PromptCache(0 if pipelined else cfg.prompt_cache_mib)
    metrics.prompt_cache = cache
    worker = EngineWorker(engine, cache, metrics, fault_after_tokens=cfg.fault_after_tokens)
    metrics.worker = worker
    tool_format = detect_format(lm.gguf.get("tokenizer.chat_template"))
    grammars = Grammars(lm.tokenizer, getattr(lm.args, "vocab_size", None) or lm.tokenizer.vocab_size)
    srv = Server(lm, worker, metrics, grammars, tool_format, cfg.model_id, engine.max_ctx, cfg.sampling,
                 cfg.n_predict)
    srv.ping_s = cfg.ping_s
    # with llguidance, json_object / json_schema / forced tool calls are constrained token by token; without it
    # they are only asked for (the chat template's tool prompt) and parsed afterwards
    structured = "constrained" if constrained_available() else "unconstrained"
    app.state.model_meta = {"n_ctx": engine.max_ctx, "n_ctx_train": getattr(lm.args, "ctx_len", None),
                            "n_vocab": srv.vocab_size, "arch": lm.gguf.arch, "parallel": cfg.parallel,
                            "tool_call_format": tool_format, "structured_output": structured,
                            "path": str(lm.cfg.model)}
    metrics.settings = {"model": str(lm.cfg.model), "n_ctx": engine.max_ctx, "parallel": cfg.parallel,
                        "prefill_chunk": engine.prefill_chunk, "device": str(engine.device),
                        "dtype": str(lm.cfg.torch_dtype).replace("torch.", ""), **_kv_types(engine),
                        "experts": lm.cfg.experts.mode, "expert_routing": lm.cfg.experts.routing,
                        "prompt_cache_mib": cfg.prompt_cache_mib,
                        "structured_output": structured, "tool_call_format": tool_format,
                        "api_key": cfg.api_key is not None, "host": cfg.host, "port": cfg.port,
                        "warmup": warmed,
                        # how --vram-gb was divided (GiB per part, slots per layer, the cache's share); None: no
                        # budget was divided (resident experts, --expert-slots, a CPU without --vram-gb)
                        "vram_split": engine.vram_split.as_dict() if engine.vram_split is not None else None,
                        # the expert cache's policy and its decay as resolved (--cache-decay auto); None: no cache
                        "expert_cache": _cache_settings(engine)}
    worker.start()
    app.state.server = srv
    say(f"ready in {time.perf_counter() - t0:.1f}s")
    return worker


class ContainErrors:
    """An exception no route turned into an answer becomes a 500 with OpenAI's error body, and the connection stays
    usable: Starlette's last-resort handler answers and then re-raises, and uvicorn drops the keep-alive connection
    (the client's next request on it fails). Once a response has started (a stream), there is nothing to answer.
    A client that hangs up before its body has all come is no error of the server's: no answer, no log."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except ClientDisconnect:
            return
        except Exception as e:  # noqa: BLE001 - the last line of defence: logged, answered
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            body = json.dumps(APIError(500, f"internal error: {type(e).__name__}", "server_error")
                              .body(scope.get("path") or "")).encode()
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})


def _error(status: int, message: str, type_: str, path: str = "") -> JSONResponse:
    return JSONResponse(APIError(status, message, type_).body(path), status_code=status)


def _routes(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(request.url.path), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            return _error(404, f"no route {request.method} {request.url.path}", "not_found_error", request.url.path)
        if e.status_code == 405:
            return _error(405, f"method {request.method} not allowed on {request.url.path}", "invalid_request_error",
                          request.url.path)
        return _error(e.status_code, str(e.detail), "invalid_request_error", request.url.path)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return _error(500, f"internal error: {type(e).__name__}", "server_error", request.url.path)

    @app.api_route("/health", methods=GET_HEAD)
    async def health(request: Request):
        st = request.app.state
        if st.server is None:
            if st.load_error:
                return _error(500, f"the model failed to load: {st.load_error}", "server_error")
            return JSONResponse({"status": "loading", "error": {"code": 503, "message": "Loading model",
                                                                "type": "unavailable_error"}}, status_code=503)
        w = st.server.worker
        if w.broken:
            return _error(503, w.broken, "unavailable_error")
        return {"status": "ok", "model": st.model_id, "slots_idle": w.n_idle,
                "slots_processing": w.n_running, "requests_waiting": w.n_waiting}

    @app.api_route("/props", methods=GET_HEAD)
    async def props(request: Request):
        from strata.server.openai_api import server_of

        srv = server_of(request)
        tok = srv.tok
        return {
            "default_generation_settings": {"n_ctx": srv.ctx, "id_slot": -1, "params": {
                **_sampling_props(srv.defaults), "n_predict": -1 if srv.n_predict is None else srv.n_predict,
                "cache_prompt": True,
                "speculative.n_max": srv.worker.engine.draft_max,
                "speculative.source": "mtp" if srv.worker.engine.mtp is not None else "ngram",
                "speculative.n_min": 0}},
            "total_slots": srv.worker.engine.n_slots,
            "model_alias": srv.model_id,
            "model_path": request.app.state.model_meta.get("path"),
            "chat_template": srv.lm.gguf.get("tokenizer.chat_template") or "",
            "bos_token": tok.decode([tok.bos_id]) if tok.bos_id is not None else "",
            "eos_token": tok.decode([tok.eos_id]) if tok.eos_id is not None else "",
            "modalities": {"vision": False, "audio": False},
            "build_info": f"strata {__version__}",
            "structured_output": request.app.state.model_meta.get("structured_output"),
            "tool_call_format": srv.tool_format,
            **_kv_types(srv.worker.engine),  # (llama-server's /props has no such fields)
            "vram_split": request.app.state.metrics.settings.get("vram_split"),
            "expert_cache": request.app.state.metrics.settings.get("expert_cache"),
            "decode_steps": _decode_steps(srv.worker.engine),
        }

    @app.api_route("/slots", methods=GET_HEAD)
    async def slots(request: Request):
        from strata.server.openai_api import server_of

        return server_of(request).worker.slots()

    @app.api_route("/metrics", methods=GET_HEAD)
    async def metrics(request: Request):
        m = request.app.state.metrics
        if request.query_params.get("format") == "json" or "application/json" in request.headers.get("accept", ""):
            return JSONResponse(m.as_json())
        return PlainTextResponse(m.prometheus().decode(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _sampling_props(d: SamplingParams) -> dict:
    """A request's default sampling as llama-server's /props names it (seed: its -1 for a random one)."""
    return {"temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p, "min_p": d.min_p,
            "repeat_penalty": d.repetition_penalty, "presence_penalty": d.presence_penalty,
            "frequency_penalty": d.frequency_penalty, "seed": -1 if d.seed is None else d.seed}


def model_id_for(path: str | os.PathLike) -> str:
    name = os.path.basename(str(path))
    return name[:-5] if name.endswith(".gguf") else name
