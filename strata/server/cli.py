"""`strata serve`: the OpenAI- and Anthropic-compatible HTTP server."""

from __future__ import annotations

import argparse
import errno
import socket
import sys
import time

from strata import StrataError


def register(sub) -> None:
    from strata.engine.cli import add_engine_args

    p = sub.add_parser("serve", help="serve the model over OpenAI- and Anthropic-compatible HTTP APIs")
    g = p.add_argument_group("server")  # (first: what a user sets most, before the engine's many flags)
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8080, help="TCP port to listen on (0: a free one the system picks, "
                   "printed in the 'listening on' line)")
    g.add_argument("--api-key", default=None, help="require this key on every route but /health "
                   "(default: $STRATA_API_KEY)")
    g.add_argument("-np", "--parallel", type=_parallel, default=0, metavar="N|auto",
                   help="sequences decoded together (KV slots); auto (the default): up to 4, as many as keep their "
                   "KV within a sixteenth of the VRAM budget (or of the free GPU memory / RAM)")
    g.add_argument("--prompt-cache-mib", type=int, default=1024,
                   help="host RAM for the KV of past conversations (0 = only what the slots hold)")
    g.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="let web pages from this origin (http(s)://host[:port], 'null', or '*' for any) use the "
                   "server; repeatable. Pages from the server's own address are always allowed, any other "
                   "Origin gets 403")
    g.add_argument("--alias", action="append", default=[],
                   help="another model name clients may use (repeatable); replies name the model as the request did")
    g.add_argument("-to", "--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="close a connection that sends no byte for this long while its request is owed (headers "
                   "or body), or takes no byte of its response (a stream it stopped reading: its generation ends), "
                   "as llama-server's --timeout (default 600)")
    g.add_argument("--threads", type=int, default=0, help="PyTorch CPU threads (default: PyTorch's choice)")
    g.add_argument("--no-warmup", action="store_true", help="skip the warm-up (a forward pass, and choosing the "
                   "CPU/PCIe plan on warm-up text; without it the cost model's plan is kept)")
    g.add_argument("--warmup-tune-s", type=float, default=90.0, help="at most this many seconds choosing the "
                   "CPU/PCIe plan (--cpu-plan auto on a GPU) on text the server makes before it says ready; past "
                   "it the best plan measured so far is kept (default 90)")
    from strata.engine.cli import _add_sampling

    # llama-server's sampling flags: the defaults of a request that leaves the field out (/props shows them)
    _add_sampling(p.add_argument_group("sampling defaults (a request's own fields win)"),
                  n_help="tokens a request generates when it sets no max_tokens (-1, the default: as many as the "
                  "context leaves; /v1/completions: 16, as OpenAI's)")
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)


def _parallel(text: str) -> int:
    """-np's value: a slot count >= 1, or auto (0: strata.engine.auto_slots decides once the model is loaded)."""
    if text.strip().lower() in ("auto", "-1"):  # (-1: llama-server's spelling of auto)
        return 0
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a slot count or auto, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (or auto), got {n}")
    return n


def _say(msg: str) -> None:
    print(f"strata: {msg}", file=sys.stderr, flush=True)


def cmd_serve(args) -> int:
    from strata.config import api_key_from_env, fault_after_tokens_for_tests
    from strata.engine.cli import (check_sampling_args, engine_config, load_from_args, resolve_model_path,
                                   sampling_from_args)
    from strata.server.app import ServeConfig, create_app, model_id_for
    from strata.server.auth import is_loopback, origin_key

    if not 0 <= args.port < 65536:
        raise StrataError(f"--port must be 0..65535 (got {args.port}; 0: a free one)")
    for o in args.cors_origin:
        if o not in ("*", "null") and origin_key(o) is None:
            raise StrataError(f"--cors-origin must be an origin such as http://localhost:3000, 'null' or '*' "
                              f"(got {o!r})")
    if not args.timeout > 0:
        raise StrataError(f"--timeout must be a number of seconds > 0 (got {args.timeout})")
    if args.prompt_cache_mib < 0:
        raise StrataError("--prompt-cache-mib must be >= 0")
    check_sampling_args(args)
    engine_config(args)  # the engine's flags checked here, as generate and chat do: a bad one is one line, not two
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.api_key is not None and not args.api_key.strip():
        raise StrataError("--api-key is empty: pass a key, or leave the flag out to serve without one")
    key = args.api_key or api_key_from_env()
    cfg_kw = dict(host=args.host, api_key=key, cors_origins=args.cors_origin, parallel=args.parallel,
                  prompt_cache_mib=args.prompt_cache_mib, aliases=args.alias, prefill_chunk=args.prefill_chunk,
                  warmup=not args.no_warmup, warmup_tune_s=args.warmup_tune_s, timeout_s=args.timeout,
                  fault_after_tokens=fault_after_tokens_for_tests(), sampling=sampling_from_args(args),
                  n_predict=None if args.n_predict == -1 else args.n_predict)
    try:
        path = resolve_model_path(args.model)
    except ImportError:
        raise StrataError("no model given and this build has no embedded default model: pass -m MODEL") from None
    args.model = path
    _check_model(path)  # (a file that holds no model it can run fails before "listening", not after)
    state = {}

    def load():
        t0 = time.perf_counter()
        lm = load_from_args(args)
        _say(f"model loaded in {time.perf_counter() - t0:.1f}s")
        return lm

    def failed(e: BaseException) -> None:
        state["error"] = e
        server.should_exit = True

    sock = bind(args.host, args.port)  # before saying "listening": a busy port is one line, not a false claim
    # --port 0 (as llama-server's): the port the system picked is the one printed, allowed as the page's own
    # origin and reported in /metrics
    port = sock.getsockname()[1]
    cfg = ServeConfig(model_id=model_id_for(path), port=port, **cfg_kw)
    if not key and not is_loopback(args.host):  # (once bound: a server that does not start warns of nothing)
        bar = "!" * 78
        print(f"{bar}\nstrata: WARNING: binding {args.host} with no API key: anyone who can reach this port can use "
              f"the model.\nstrata: WARNING: pass --api-key KEY (or set STRATA_API_KEY).\n{bar}", file=sys.stderr,
              flush=True)
    app = create_app(cfg, load=load, narrate=_say, on_error=failed)
    server = uvicorn_server(app, args.host, port)
    _say(f"listening on http://{_url_host(args.host)}:{port} (the model loads in the background; "
         f"/health answers 503 until it is ready)")
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if "error" in state:
        e = state["error"]
        raise e if isinstance(e, StrataError) else StrataError(f"could not start: {e}")
    return 0


def _check_model(path: str) -> None:
    """The loader's checks of the file that need no weights read: GGUF, complete, a model (not a vocabulary), of an
    architecture strata runs; StrataError naming what is wrong."""
    from strata.gguf.header import check_gguf_file, require_model
    from strata.gguf.reader import split_paths
    from strata.models.registry import FAMILIES

    paths = split_paths(path)
    headers = [check_gguf_file(p) for p in paths]
    require_model(headers[0].metadata, len(paths), sum(len(h.tensors) for h in headers), paths[0].name)
    arch = headers[0].architecture
    if arch not in FAMILIES:
        raise StrataError(f"{paths[0].name}: unknown model architecture '{arch}' (strata runs: "
                          f"{', '.join(sorted(FAMILIES))})")


# Seconds an idle connection stays open. Longer than the idle expiry of clients' connection pools (httpx, which the
# openai and anthropic clients use: 5 s; aiohttp: 15 s; undici: 4 s): a server that closes first races the client's
# next request on the same connection, which then fails with "connection reset" although the server is healthy.
KEEP_ALIVE_S = 75


def uvicorn_config(app, host: str, port: int, graceful_s: float = 3):
    import uvicorn

    from strata.server.http_protocol import protocol_with_timeouts

    return uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                          timeout_graceful_shutdown=graceful_s, timeout_keep_alive=KEEP_ALIVE_S,
                          http=protocol_with_timeouts(app.state.cfg.timeout_s))


def uvicorn_server(app, host: str, port: int, graceful_s: float = 3):
    """uvicorn's server for `app`, whose shutdown (Ctrl-C, SIGTERM) first ends the app's open streams with an
    error event: uvicorn only waits graceful_s for them, then cancels them mid-write (a cut stream for the client,
    tracebacks in the log)."""
    import uvicorn

    from strata.server.app import shutting_down

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            shutting_down(app)
            await super().shutdown(sockets)

    return Server(uvicorn_config(app, host, port, graceful_s))


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port, or StrataError naming what is in the way. The address family is
    chosen as uvicorn chooses it (IPv6 only for an address with a colon), so a name binds what it did before."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # as uvicorn does: a restarted server may take the port over from connections still in TIME_WAIT
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if isinstance(e, socket.gaierror):
            raise StrataError(f"--host {host!r}: cannot resolve it ({e.strerror})") from None
        if e.errno == errno.EADDRINUSE:
            raise StrataError(f"port {port} on {host} is already in use (another server?): stop it or pass "
                              "--port N") from None
        if e.errno == errno.EACCES:
            raise StrataError(f"no permission to listen on port {port} of {host} (ports below 1024 need root): "
                              "pass --port N") from None
        raise StrataError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
