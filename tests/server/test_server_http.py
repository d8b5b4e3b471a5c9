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
