"""The bench's side of the wire: an OpenAI-compatible client that times what the user sees, and server processes
started for a run (strata's own, or a peer speaking the same API).

What is measured where:
- the engine's own timings (`timings.prompt_n/prompt_ms/predicted_n/predicted_ms/cache_n`, llama.cpp's shape;
  strata sends them with the finishing chunk, llama.cpp with the usage chunk: the last one seen wins);
- the client's clock: time to the first chunk that carries output (TTFT) and to the last one. The first SSE
  chunk of a chat stream only opens the assistant's turn and is not counted as output.

Decode speed is taken from the engine's timings, never from client wall time (which includes the prefill,
HTTP and detokenisation).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from strata import StrataError


class ServerGone(StrataError):
    """The server stopped answering mid-run (died, or hung past the timeout)."""


@dataclass
class Reply:
    """One generation as the client saw it."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    t_sent: float = 0.0  # perf_counter when the request went out
    t_first: float | None = None  # first chunk with output
    t_last: float | None = None  # last chunk with output
    t_done: float = 0.0  # the stream closed
    chunks: int = 0  # chunks with output
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_sent

    @property
    def wall_s(self) -> float:
        return self.t_done - self.t_sent

    @property
    def prompt_tokens(self) -> int | None:
        n = self.usage.get("prompt_tokens")
        return int(n) if n is not None else (int(self.timings["prompt_n"]) if "prompt_n" in self.timings else None)

    @property
    def completion_tokens(self) -> int | None:
        n = self.usage.get("completion_tokens")
        if n is not None:
            return int(n)
        return int(self.timings["predicted_n"]) if "predicted_n" in self.timings else None

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the engine reused instead of computing (the larger of what it reported both ways)."""
        details = self.usage.get("prompt_tokens_details") or {}
        return max(int(details.get("cached_tokens") or 0), int(self.timings.get("cache_n") or 0))

    @property
    def prefill_tok_s(self) -> float | None:
        """Prompt tokens computed per second of the engine's prompt time."""
        n, ms = self.timings.get("prompt_n"), self.timings.get("prompt_ms")
        return n / (ms / 1e3) if n and ms else None

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens per second of the engine's generation time: predicted_ms runs from the first generated token
        to the last, i.e. covers predicted_n - 1 steps (llama.cpp divides the same way)."""
        n, ms = self.timings.get("predicted_n"), self.timings.get("predicted_ms")
        return (n - 1) / (ms / 1e3) if n and n > 1 and ms else None

    def as_dict(self) -> dict:
        return {"text": self.text, "reasoning": self.reasoning, "tool_calls": self.tool_calls,
                "finish_reason": self.finish_reason, "usage": self.usage, "timings": self.timings,
                "ttft_s": self.ttft_s, "wall_s": self.wall_s, "chunks": self.chunks, "error": self.error}


class _Stream:
    """Folds the `data:` payloads of a chat-completions SSE stream into a Reply."""

    def __init__(self, reply: Reply):
        self.r = reply
        self.calls: dict[int, dict] = {}

    def line(self, line: str) -> bool:
        """Feed one line; False once the stream says [DONE]."""
        if not line.startswith("data:"):
            return True
        data = line[5:].strip()
        if data == "[DONE]":
            return False
        ev = json.loads(data)
        if "error" in ev:
            err = ev["error"]
            self.r.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return True
        now = time.perf_counter()
        if ev.get("usage"):
            self.r.usage = ev["usage"]
        if ev.get("timings"):
            self.r.timings = ev["timings"]
        for ch in ev.get("choices") or []:
            d = ch.get("delta") or {}
            out = False
            if d.get("content"):
                self.r.text += d["content"]
                out = True
            if d.get("reasoning_content"):
                self.r.reasoning += d["reasoning_content"]
                out = True
            for tc in d.get("tool_calls") or []:
                c = self.calls.setdefault(tc.get("index", 0), {"name": "", "arguments": ""})
                fn = tc.get("function") or {}
                c["name"] += fn.get("name") or ""
                c["arguments"] += fn.get("arguments") or ""
                out = True
            if out:
                self.r.chunks += 1
                self.r.t_last = now
                if self.r.t_first is None:
                    self.r.t_first = now
            if ch.get("finish_reason"):
                self.r.finish_reason = ch["finish_reason"]
        return True

    def done(self) -> Reply:
        self.r.t_done = time.perf_counter()
        self.r.tool_calls = [self.calls[i] for i in sorted(self.calls)]
        return self.r


# llama.cpp's default sampler chain, sent explicitly with a temperature > 0 so that two servers whose defaults
# differ sample from the same distribution
SAMPLED = {"top_k": 40, "top_p": 0.95, "min_p": 0.05}


def sampling(temperature: float) -> dict:
    """The sampling fields of a timed request: greedy at 0, else llama.cpp's default chain at `temperature`."""
    if temperature < 0:
        raise StrataError(f"temperature must be >= 0, got {temperature}")
    return {"temperature": temperature, **(SAMPLED if temperature > 0 else {})}


def sampling_text(temperature: float, seed: int = 0) -> str:
    if not temperature:
        return "greedy"
    return (f"sampled at temperature {temperature:g} (top-k {SAMPLED['top_k']}, top-p {SAMPLED['top_p']}, "
            f"min-p {SAMPLED['min_p']}, seed {seed})")


def chat_body(messages: list[dict], max_tokens: int, *, cache_prompt: bool = False, temperature: float = 0.0,
              tools: list[dict] | None = None, ignore_eos: bool = False, seed: int = 0, **extra) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "cache_prompt": cache_prompt,
            "temperature": temperature, "seed": seed, **extra}
    if temperature == 0:
        body["top_k"] = 1  # greedy on servers whose temperature 0 still samples
    if tools:
        body["tools"] = tools
    if ignore_eos:
        body["ignore_eos"] = True  # llama.cpp's field: generate exactly max_tokens
    return body


def _http_error(r: httpx.Response, url: str) -> StrataError:
    try:
        msg = r.json().get("error", {}).get("message") or r.text
    except ValueError:
        msg = r.text
    return StrataError(f"{url}: HTTP {r.status_code}: {str(msg)[:300]}")


class BenchClient:
    """An OpenAI-compatible server, as the bench talks to it (strata's or a peer's)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 1800.0):
        self.base = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self.http = httpx.Client(base_url=self.base, headers=self.headers, timeout=timeout)
        self._counter: str | None = None

    def close(self) -> None:
        self.http.close()

    # -- the server's state ---------------------------------------------------------------------------------------
    def health(self) -> tuple[int, dict]:
        try:
            r = self.http.get("/health", timeout=5)
        except httpx.HTTPError:
            return 0, {}
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, {}

    def wait_ready(self, timeout: float = 600.0, proc: subprocess.Popen | None = None, log: Path | None = None):
        """Wait for /health to say 200; fail early (with the log's tail) if the server process exits."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            status, body = self.health()
            if status == 200:
                return
            if status == 500 or (proc is not None and proc.poll() is not None):
                tail = _tail(log) if log else ""
                why = (body.get("error") or {}).get("message") if status == 500 else f"exit {proc.returncode}"
                raise StrataError(f"the server at {self.base} failed to start ({why}){': ' + tail if tail else ''}")
            time.sleep(0.2)
        raise StrataError(f"the server at {self.base} was not ready after {timeout:.0f}s")

    def get_json(self, path: str) -> dict | None:
        """GET a JSON document, None where the server has no such route or answers something else."""
        try:
            r = self.http.get(path, timeout=30)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def props(self) -> dict:
        return self.get_json("/props") or {}

    def metrics(self) -> dict | None:
        """strata's /metrics?format=json (expert statistics, settings, totals); None on servers without it."""
        m = self.get_json("/metrics?format=json")
        return m if isinstance(m, dict) and "totals" in m else None

    # -- prompt sizes ---------------------------------------------------------------------------------------------
    def count_tokens(self, text: str) -> int:
        """Tokens of `text` sent as one user message through the server's chat template.

        strata answers through Anthropic's count_tokens route (same template, no generation); llama.cpp through
        /apply-template + /tokenize; any other server by a one-token generation (which costs a prefill)."""
        msgs = [{"role": "user", "content": text}]
        order = [self._counter] if self._counter else ["strata", "llamacpp", "generate"]
        for how in order:
            n = self._count(how, msgs)
            if n is not None:
                self._counter = how
                return n
        raise StrataError(f"{self.base}: cannot count prompt tokens (no count_tokens, tokenize or usage)")

    def _count(self, how: str, msgs: list[dict]) -> int | None:
        try:
            if how == "strata":
                r = self.http.post("/v1/messages/count_tokens", json={"messages": msgs})
                return int(r.json()["input_tokens"]) if r.status_code == 200 else None
            if how == "llamacpp":
                r = self.http.post("/apply-template", json={"messages": msgs})
                if r.status_code != 200:
                    return None
                r = self.http.post("/tokenize", json={"content": r.json()["prompt"], "add_special": True,
                                                      "parse_special": True})
                return len(r.json()["tokens"]) if r.status_code == 200 else None
            rep = self.chat(msgs, 1)
            return rep.prompt_tokens
        except httpx.TransportError as e:  # no answer at all: not a server without the route
            raise self.gone(e) from None
        except (httpx.HTTPError, ValueError, KeyError):
            return None
        except ServerGone:
            raise
        except StrataError:
            return None

    # -- generation -----------------------------------------------------------------------------------------------
    def chat(self, messages: list[dict], max_tokens: int, **kw) -> Reply:
        """A streamed chat completion; raises StrataError on an HTTP error, records an in-stream error."""
        body = chat_body(messages, max_tokens, **kw)
        rep = Reply(t_sent=time.perf_counter())
        st = _Stream(rep)
        try:
            with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    raise _http_error(r, self.base)
                for line in r.iter_lines():
                    if not st.line(line):
                        break
        except httpx.HTTPError as e:  # a server that died or hung mid-run: its numbers are incomplete
            raise self.gone(e) from None
        return st.done()

    def gone(self, e: httpx.HTTPError) -> "ServerGone":
        """The error for a request the server did not answer: refused, cut off, or timed out."""
        if isinstance(e, httpx.TimeoutException):
            return ServerGone(f"the server at {self.base} did not answer within {self.timeout:.0f}s ({e})")
        return ServerGone(f"the server at {self.base} stopped answering ({type(e).__name__}: {e})")

    async def achat(self, http: httpx.AsyncClient, messages: list[dict], max_tokens: int, **kw) -> Reply:
        """`chat` on an AsyncClient (concurrent workers); errors are recorded in the Reply, not raised."""
        body = chat_body(messages, max_tokens, **kw)
        rep = Reply(t_sent=time.perf_counter())
        st = _Stream(rep)
        try:
            async with http.stream("POST", self.base + "/v1/chat/completions", json=body,
                                   headers=self.headers) as r:
                if r.status_code != 200:
                    await r.aread()
                    rep.error = str(_http_error(r, self.base))
                else:
                    async for line in r.aiter_lines():
                        if not st.line(line):
                            break
        except (httpx.HTTPError, ValueError) as e:
            rep.error = f"{type(e).__name__}: {e}"
        return st.done()


# ---------------------------------------------------------------------------------------------------------------
# server processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path | None, n: int = 6) -> str:
    if path is None or not Path(path).exists():
        return ""
    lines = [ln for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
    return " | ".join(lines[-n:])


class ServerProcess:
    """A server started for the run (a child process, its log in a file); stopped on exit."""

    def __init__(self, argv: list[str], port: int, log: Path, name: str, env: dict | None = None,
                 ready_timeout: float = 900.0):
        self.argv, self.port, self.log, self.name = argv, port, Path(log), name
        self.url = f"http://127.0.0.1:{port}"
        self.env = env
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.log, "w", encoding="utf-8")
        self.proc = subprocess.Popen(self.argv, stdout=self._fh, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(self.env or {})}, start_new_session=True)
        c = BenchClient(self.url)
        try:
            c.wait_ready(self.ready_timeout, self.proc, self.log)
        except BaseException:
            self.stop()
            raise
        finally:
            c.close()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if getattr(self, "_fh", None) is not None:
            self._fh.close()
            self._fh = None


def strata_server(model: str, engine_argv: list[str], log: Path, parallel: int = 1,
                  port: int | None = None) -> ServerProcess:
    """`python -m strata serve` on loopback with the given engine flags."""
    port = port or free_port()
    argv = [sys.executable, "-m", "strata", "serve", "-m", model, "--port", str(port), "--parallel", str(parallel),
            *engine_argv]
    return ServerProcess(argv, port, log, "strata")
