"""Access control and error bodies against a real server; the `strata serve` command itself. (Fuzzed input:
tests/server/test_fuzz.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from .conftest import CTX, free_port, serve

KEY = "s3cret-key"
ROUTES = [("GET", "/v1/models", None), ("GET", "/v1/models/tiny", None), ("GET", "/props", None),
          ("GET", "/slots", None), ("GET", "/metrics", None),
          ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
          ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
          ("POST", "/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
          ("POST", "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
          ("GET", "/no/such/route", None)]


_http = httpx.Client(timeout=60)  # one client: building one (its TLS context) costs more than a request here


def _req(url, method, path, body, headers=None):
    return _http.request(method, url + path, json=body, headers=headers or {})


def test_api_key_on_every_route(lm):
    with serve(lm, api_key=KEY) as s:
        assert _req(s.url, "GET", "/health", None).status_code == 200  # the one open route
        for method, path, body in ROUTES:
            r = _req(s.url, method, path, body)
            assert r.status_code == 401, (path, r.status_code)
            assert r.json()["error"]["type"] == "authentication_error"
            assert ("type" in r.json()) == path.startswith("/v1/messages")  # Anthropic's shape on its routes
            assert _req(s.url, method, path, body, {"Authorization": "Bearer wrong"}).status_code == 401
            assert _req(s.url, method, path, body, {"x-api-key": KEY[:-1]}).status_code == 401
            want = 404 if path == "/no/such/route" else 200
            assert _req(s.url, method, path, body, {"Authorization": f"Bearer {KEY}"}).status_code == want, path
            assert _req(s.url, method, path, body, {"x-api-key": KEY}).status_code == want, path
        # a key makes the server safe to reach by any name
        assert _req(s.url, "GET", "/v1/models", None, {"x-api-key": KEY, "Host": "evil.example"}).status_code == 200


def test_host_header_without_key(server):
    for host in ("evil.example", "evil.example:8080", "localhost.evil.example"):
        r = _http.get(server.url + "/v1/models", headers={"Host": host})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", host
    for host in ("localhost", f"localhost:{server.port}", f"127.0.0.1:{server.port}", "[::1]:80", "10.1.2.3"):
        assert _http.get(server.url + "/v1/models", headers={"Host": host}).status_code == 200, host


def test_no_cors_unless_asked(server, lm):
    pre = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST"}
    r = _http.options(server.url + "/v1/chat/completions", headers=pre)
    assert "access-control-allow-origin" not in r.headers
    with serve(lm, cors_origins=["http://app.example"]) as s:
        r = _http.options(s.url + "/v1/chat/completions", headers=pre)
        assert r.headers.get("access-control-allow-origin") == "http://app.example"
        r = _http.options(s.url + "/v1/chat/completions", headers={**pre, "Origin": "http://other.example"})
        assert r.headers.get("access-control-allow-origin") is None


@pytest.mark.parametrize("path,body,fragment", [
    ("/v1/chat/completions", b"{not json", "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", "JSON object"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 600}]}, "context"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": 2 ** 70}, "seed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "tools"),
    ("/v1/completions", {"prompt": [10 ** 9]}, "token ids"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]}, "role"),
])
def test_bad_requests_are_400(server, path, body, fragment):
    if isinstance(body, bytes):
        r = _http.post(server.url + path, content=body, headers={"content-type": "application/json"})
    else:
        r = _http.post(server.url + path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and fragment in err["message"], err


ANTHROPIC_ERRORS = [
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error", "max_tokens"),
    ("/v1/messages", b"{not json", 400, "invalid_request_error", "not valid JSON"),
    ("/v1/messages", {"model": "gpt-9", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}, 404,
     "not_found_error", "gpt-9"),
    ("/v1/messages/count_tokens", {"messages": []}, 400, "invalid_request_error", "messages"),
    ("/v1/messages/nothing", {}, 404, "not_found_error", "no route"),
    # a forced tool call with no tools to call (it was answered 200)
    ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "any"}},
     400, "invalid_request_error", "needs tools"),
    ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
                      "tool_choice": {"type": "tool", "name": "get_weather"}}, 400, "invalid_request_error",
     "needs tools"),
]


@pytest.mark.parametrize("path,body,status,type_,fragment", ANTHROPIC_ERRORS)
def test_anthropic_routes_answer_anthropic_error_bodies(server, path, body, status, type_, fragment):
    if isinstance(body, bytes):
        r = _http.post(server.url + path, content=body, headers={"content-type": "application/json"})
    else:
        r = _http.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    got = r.json()
    assert got == {"type": "error", "error": {"type": type_, "message": got["error"]["message"]}}, got
    assert fragment in got["error"]["message"]


def test_anthropic_client_reads_the_error(server):
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                               tool_choice={"type": "any"})
    assert e.value.body["type"] == "error" and "needs tools" in e.value.body["error"]["message"]
    r = _http.post(server.url + "/v1/messages", content=b"x", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["type"] == "error"
    r = _http.post(server.url + "/v1/chat/completions", json={"messages": []})  # OpenAI's routes keep theirs
    assert r.status_code == 400 and set(r.json()) == {"error"} and r.json()["error"]["param"] is None


HUGE = "word " * 2_000_000  # 10 MB: tokenizing it would hold the interpreter for seconds


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE}], "max_tokens": 4}),
    ("/v1/completions", {"prompt": HUGE}),
    ("/v1/messages", {"messages": [{"role": "user", "content": HUGE}], "max_tokens": 4}),
])
def test_a_prompt_far_past_the_context_is_refused_before_tokenizing(server, path, body):
    t0 = time.time()
    r = _http.post(server.url + path, json=body)
    took = time.time() - t0
    assert r.status_code == 400, r.text[:300]
    msg = r.json()["error"]["message"]
    assert "at least" in msg and "lower bound" in msg and f"context of {CTX} tokens" in msg, msg
    assert took < 3, took  # (tokenizing it took about 9 s)
    # the server goes on serving normal prompts
    r = _http.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                              "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_the_early_bound_never_refuses_what_fits(lm):
    """The bound is a lower bound: across texts of every kind, no token stands for more bytes than it says."""
    tok = lm.tokenizer
    longest = tok.max_token_bytes
    texts = ["word " * 300, "\n" * 500, " " * 700, "<|im_start|>" * 50, "한국어 " * 100,
             "\u1100\u1161\u11a8" * 100,  # decomposed Hangul: NFC composes 9 bytes into 3
             "".join(chr(c) for c in range(0x20, 0x3000, 7))]
    for text in texts:
        n_bytes = len(text.encode())
        assert len(tok.encode(text)) >= n_bytes / longest, text[:40]


def test_not_found(server):
    r = _http.get(server.url + "/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = _http.post(server.url + "/v1/chat/completions", json={"model": "gpt-9", "messages": [
        {"role": "user", "content": "hi"}], "max_tokens": 1})
    assert r.status_code == 404 and "gpt-9" in r.json()["error"]["message"]
    assert _http.get(server.url + "/v1/models/gpt-9").status_code == 404


# -- the command ------------------------------------------------------------------------------------------------


def test_strata_serve_command(tiny_gguf):
    """`strata serve` binds loopback by default, narrates its start-up, and answers /health once ready; with no
    model named it serves the default one."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STRATA_API_KEY": ""}
    try:
        from strata.models.default import default_model_path

        model = [] if str(default_model_path(warn=False)) == str(tiny_gguf) else ["-m", str(tiny_gguf)]
    except ImportError:
        model = ["-m", str(tiny_gguf)]
    p = subprocess.Popen([sys.executable, "-m", "strata", "serve", *model, "--port", str(port), "-c", "256",
                          "--threads", "1"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        t0, status = time.time(), None
        while time.time() - t0 < 120:
            try:
                status = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code
            except httpx.TransportError:
                status = None
            if status == 200 or p.poll() is not None:
                break
            assert status in (None, 503)
            time.sleep(0.1)
        assert status == 200
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        p.terminate()
        err = p.communicate(timeout=30)[1]
    assert f"listening on http://127.0.0.1:{port}" in err
    assert "loading" in err and "ready" in err and "WARNING" not in err


def test_serve_on_a_busy_port_fails_in_one_line(tiny_gguf):
    """Another program holds the port: one line naming it, a non-zero exit, and no claim to be listening."""
    import socket

    env = {**os.environ, "OMP_NUM_THREADS": "1", "STRATA_API_KEY": ""}
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "strata", "serve", "-m", str(tiny_gguf), "--port", str(port),
                            "--no-warmup"], env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 1, p.stderr
    assert len(lines) == 1 and f"port {port}" in lines[0] and "already in use" in lines[0], p.stderr
    assert lines[0].startswith("strata: error:") and "listening" not in p.stderr and p.stdout == ""


def test_non_loopback_without_key_warns_once_bound(tiny_gguf):
    """Binding every address with no key warns, once the port is bound: a server that cannot start (a busy port)
    says that in one line, with no warning about a server that never ran."""
    import socket

    env = {**os.environ, "OMP_NUM_THREADS": "1", "STRATA_API_KEY": ""}
    cmd = [sys.executable, "-m", "strata", "serve", "-m", str(tiny_gguf), "--host", "0.0.0.0", "--no-warmup"]
    port = free_port()
    p = subprocess.Popen([*cmd, "--port", str(port)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        err = ""
        while "listening" not in err:
            line = p.stderr.readline()
            assert line, err
            err += line
    finally:
        p.terminate()
        p.communicate(timeout=60)
    assert "WARNING: binding 0.0.0.0 with no API key" in err
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        busy = subprocess.run([*cmd, "--port", str(holder.getsockname()[1])], env=env, capture_output=True,
                              text=True, timeout=120)
    lines = [line for line in busy.stderr.splitlines() if line.strip()]
    assert busy.returncode == 1 and len(lines) == 1 and "already in use" in lines[0], busy.stderr


def test_health_is_503_until_the_model_is_loaded(lm):
    """The app answers while the model loads (here: a load that waits for a signal), 503 until it is in."""
    import threading

    from strata.server.app import ServeConfig, create_app

    from .conftest import Running

    go = threading.Event()

    def load():
        go.wait(60)
        return lm

    port = free_port()
    with Running(create_app(ServeConfig(port=port, model_id="tiny", warmup=False), load=load), port) as s:
        r = _http.get(s.url + "/health")
        assert r.status_code == 503
        r = _http.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable_error"
        go.set()
        t0 = time.time()
        while _http.get(s.url + "/health").status_code != 200:
            assert time.time() - t0 < 30
            time.sleep(0.02)
        assert _http.get(s.url + "/health").json()["status"] == "ok"
