"""HTTP beyond the APIs' bodies: HEAD on the routes that read, and conditional GETs of the web pages' files."""

from __future__ import annotations

import httpx
import pytest

from .conftest import serve

_http = httpx.Client(timeout=60)
READ_ROUTES = ["/health", "/", "/monitor", "/metrics", "/web/chat.js", "/web/style.css", "/v1/models",
               "/v1/models/tiny", "/props", "/slots"]


@pytest.mark.parametrize("path", READ_ROUTES)
def test_head_answers_as_get_without_a_body(server, path):
    g, h = _http.get(server.url + path), _http.head(server.url + path)
    assert g.status_code == 200 and h.status_code == 200, (path, h.status_code, h.text)
    assert h.content == b""
    assert h.headers["content-type"] == g.headers["content-type"]
    if path != "/metrics":  # (its counters move between the two requests)
        assert h.headers["content-length"] == g.headers["content-length"]


def test_head_elsewhere(server, lm):
    # a route that only takes POST still says so; an unknown one is still a 404
    assert _http.head(server.url + "/v1/chat/completions").status_code == 405
    assert _http.head(server.url + "/nothing").status_code == 404
    assert _http.head(server.url + "/web/nothing.js").status_code == 404
    # with a key, HEAD is let through where GET is: /health and the pages open, the rest keyed
    with serve(lm, api_key="k") as s:
        assert _http.head(s.url + "/health").status_code == 200
        assert _http.head(s.url + "/").status_code == 200
        assert _http.head(s.url + "/metrics").status_code == 401
        assert _http.head(s.url + "/metrics", headers={"Authorization": "Bearer k"}).status_code == 200


@pytest.mark.parametrize("path", ["/", "/monitor", "/web/chat.js"])
def test_web_files_are_revalidated(server, path):
    first = _http.get(server.url + path)
    etag, modified = first.headers["etag"], first.headers["last-modified"]
    assert first.status_code == 200 and first.content
    for headers in ({"If-None-Match": etag}, {"If-None-Match": f'"other", W/{etag}'}, {"If-None-Match": "*"},
                    {"If-Modified-Since": modified}, {"If-Modified-Since": "Fri, 01 Jan 2100 00:00:00 GMT"}):
        r = _http.get(server.url + path, headers=headers)
        assert r.status_code == 304 and r.content == b"", (headers, r.status_code)
        assert r.headers["etag"] == etag and r.headers["cache-control"] == "no-cache"
        assert _http.head(server.url + path, headers=headers).status_code == 304
    for headers in ({"If-None-Match": '"other"'}, {"If-Modified-Since": "Thu, 01 Jan 1998 00:00:00 GMT"},
                    {"If-Modified-Since": "not a date"},
                    # If-None-Match wins over If-Modified-Since (RFC 9110)
                    {"If-None-Match": '"other"', "If-Modified-Since": modified}):
        r = _http.get(server.url + path, headers=headers)
        assert r.status_code == 200 and r.content == first.content, headers
