"""What a web page can and cannot do with a strata server: CORS preflights, the Origin allow-list, content types;
and bodies no browser encoder would produce (lone surrogates). A real server on loopback, a real HTTP client."""

from __future__ import annotations

import httpx
import pytest

from .conftest import port_forward, serve

KEY = "browser-key"
APP = "http://app.example:3000"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
PREFLIGHT = {"Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type, x-api-key"}

_http = httpx.Client(timeout=60)


@pytest.fixture(scope="module")
def keyed(lm):
    with serve(lm, api_key=KEY, cors_origins=[APP], parallel=1) as s:
        yield s


def _totals(s) -> dict:
    return _http.get(s.url + "/metrics", params={"format": "json"}).json()["totals"]


def test_preflight_is_answered_before_the_key(keyed):
    """A browser sends the preflight without the key (by design); the page's real request then carries it."""
    r = _http.options(keyed.url + "/v1/chat/completions", headers={"Origin": APP, **PREFLIGHT})
    assert r.status_code == 204, r.text
    assert r.headers["access-control-allow-origin"] == APP
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"]
    assert "Origin" in r.headers["vary"]
    r = _http.post(keyed.url + "/v1/chat/completions", json=CHAT,
                   headers={"Origin": APP, "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
    # the page can read why it was refused: the 401 carries the CORS header too
    r = _http.post(keyed.url + "/v1/chat/completions", json=CHAT, headers={"Origin": APP})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == APP
    # a streamed answer carries it as well
    with _http.stream("POST", keyed.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                      headers={"Origin": APP, "x-api-key": KEY}) as r:
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP
        assert "data: [DONE]" in r.read().decode()


@pytest.mark.parametrize("origin", ["http://evil.example", "http://app.example:3001", "https://app.example:3000",
                                    "null", "http://localhost:1", "not a url", "http://127.0.0.1.evil.example"])
def test_other_origins_are_refused(keyed, origin):
    for method, path, headers in [("OPTIONS", "/v1/chat/completions", PREFLIGHT),
                                  ("POST", "/v1/chat/completions", {"x-api-key": KEY}),
                                  ("GET", "/v1/models", {"x-api-key": KEY})]:
        r = _http.request(method, keyed.url + path, json=CHAT if method == "POST" else None,
                          headers={"Origin": origin, **headers})
        assert r.status_code == 403, (origin, method, r.status_code)
        err = r.json()["error"]
        assert err["type"] == "permission_error" and "--cors-origin" in err["message"], err
        assert "access-control-allow-origin" not in r.headers


def test_requests_without_origin_are_unaffected(keyed):
    r = _http.post(keyed.url + "/v1/chat/completions", json=CHAT, headers={"x-api-key": KEY})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_the_servers_own_origin_is_allowed(server):
    """A page served from the server's own address may use it (no --cors-origin needed); the same name at another
    port is another origin."""
    p = server.port
    for origin in (f"http://127.0.0.1:{p}", f"http://localhost:{p}", f"http://[::1]:{p}", f"http://LOCALHOST:{p}/"):
        r = _http.post(server.url + "/v1/chat/completions", json=CHAT, headers={"Origin": origin})
        assert r.status_code == 200, (origin, r.text)
        r = _http.options(server.url + "/v1/messages", headers={"Origin": origin, **PREFLIGHT})
        assert r.status_code == 204, origin
    for origin in (f"http://127.0.0.1:{p + 1}", "http://localhost", f"http://10.0.0.1:{p}"):
        assert _http.post(server.url + "/v1/chat/completions", json=CHAT,
                          headers={"Origin": origin}).status_code == 403, origin


def test_own_pages_through_a_port_forward(lm):
    """The chat page opened through `ssh -L 9000:localhost:PORT` (or a container's published port) posts with
    Origin http://localhost:9000 and Host localhost:9000: that is the page's own origin, not another site's; it was
    refused with 403. A page of another port (Host still the forward's, Origin not) stays refused."""
    with serve(lm, api_key=KEY) as s, port_forward(s.port) as fwd:
        url = f"http://127.0.0.1:{fwd}"
        assert _http.get(url + "/").status_code == 200
        for origin in (url, f"http://localhost:{fwd}"):
            host = origin.removeprefix("http://")
            r = _http.post(url + "/v1/chat/completions", json=CHAT,
                           headers={"Origin": origin, "Host": host, "Authorization": f"Bearer {KEY}"})
            assert r.status_code == 200, (origin, r.text)
            r = _http.options(url + "/v1/chat/completions", headers={"Origin": origin, "Host": host, **PREFLIGHT})
            assert r.status_code == 204, origin
        # a TLS proxy in front: https://NAME with Host NAME (the default port of the origin's scheme)
        r = _http.post(url + "/v1/chat/completions", json=CHAT, headers={
            "Origin": "https://localhost", "Host": "localhost", "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text
        for origin, host in ((f"http://127.0.0.1:{fwd + 1}", f"127.0.0.1:{fwd}"), ("http://localhost", "localhost:8x"),
                             (f"http://evil.example:{fwd}", f"127.0.0.1:{fwd}"), ("http://localhost", "")):
            r = _http.post(url + "/v1/chat/completions", json=CHAT,
                           headers={"Origin": origin, "Host": host, "Authorization": f"Bearer {KEY}"})
            assert r.status_code == 403, (origin, host, r.status_code)
        # the key is still needed
        r = _http.post(url + "/v1/chat/completions", json=CHAT, headers={"Origin": url, "Host": url[7:]})
        assert r.status_code == 401


@pytest.mark.parametrize("ctype", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x", None])
def test_post_bodies_must_be_json(server, ctype):
    """The content types a page may POST cross-site without a preflight never start a generation."""
    import json

    before = _totals(server)
    headers = {} if ctype is None else {"content-type": ctype}
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens"):
        r = _http.post(server.url + path, content=json.dumps({**CHAT, "prompt": "hi"}).encode(), headers=headers)
        assert r.status_code == 415, (path, ctype, r.status_code)
        err = r.json()["error"]
        assert "application/json" in err["message"] and err["type"] == "invalid_request_error"
    assert _totals(server) == before  # nothing reached the engine
    for ok in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        r = _http.post(server.url + "/v1/chat/completions", content=json.dumps(CHAT).encode(),
                       headers={"content-type": ok})
        assert r.status_code == 200, (ok, r.text)


# -- bodies no encoder should produce ---------------------------------------------------------------------------

@pytest.mark.parametrize("path,raw", [
    ("/v1/chat/completions", rb'{"messages":[{"role":"user","content":"a\ud800b"}],"max_tokens":1}'),
    ("/v1/chat/completions", rb'{"messages":[{"role":"user","content":[{"type":"text","text":"\udfff"}]}],'
                             rb'"max_tokens":1,"stop":["\ud800"]}'),
    ("/v1/completions", rb'{"prompt":"\ud800","max_tokens":1}'),
    ("/v1/completions", rb'{"prompt":["\uDBFF\uDBFF"],"max_tokens":1,"stream":true}'),
    ("/v1/messages", rb'{"messages":[{"role":"user","content":"\ud800"}],"max_tokens":1,"system":"\udc00"}'),
    ("/v1/messages", rb'{"messages":[{"role":"user","content":[{"type":"text","text":"x\ud83d"}]}],"max_tokens":1,'
                     rb'"stream":true}'),
])
def test_lone_surrogates_are_replaced(server, path, raw):
    """JSON can spell a lone UTF-16 surrogate; a browser's UTF-8 encoder would have made it U+FFFD, so does strata
    (a JavaScript client that cut a string inside an emoji still gets its answer)."""
    r = _http.post(server.url + path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert "server_error" not in r.text and "api_error" not in r.text


def test_lone_surrogate_counts_as_the_replacement_character(server):
    def count(raw):
        r = _http.post(server.url + "/v1/messages/count_tokens", content=raw,
                       headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        return r.json()["input_tokens"]

    assert count(rb'{"messages":[{"role":"user","content":"\ud800"}]}') == \
        count('{"messages":[{"role":"user","content":"\ufffd"}]}'.encode())
    # a proper pair is one character, untouched
    assert count(rb'{"messages":[{"role":"user","content":"\ud83d\ude00"}]}') == \
        count('{"messages":[{"role":"user","content":"\U0001f600"}]}'.encode())


def test_any_origin_only_when_asked(lm):
    with serve(lm, cors_origins=["*"]) as s:
        r = _http.options(s.url + "/v1/chat/completions", headers={"Origin": "http://anything.example", **PREFLIGHT})
        assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "http://anything.example"


def test_a_malformed_cors_origin_is_one_line(capsys):
    from strata.cli import main

    assert main(["serve", "--cors-origin", "app.example:3000"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cors-origin" in err[0] and "app.example:3000" in err[0]
