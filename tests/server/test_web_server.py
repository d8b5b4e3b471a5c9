"""The web app's HTTP side against a real server on loopback (plain HTTP clients, no browser): the monitor's
address with a trailing slash, the files' headers, and the monitor stream shared by every open tab."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import serve

KEY = "k3y"


@pytest.mark.parametrize("api_key", [None, KEY])
def test_monitor_with_a_trailing_slash_redirects_to_the_page(lm, api_key):
    with serve(lm, api_key=api_key) as srv:
        for method in ("GET", "HEAD"):
            r = httpx.request(method, srv.url + "/monitor/")
            assert r.status_code == 307 and r.headers["location"] == "/monitor", (method, r.status_code)
        assert httpx.get(srv.url + "/monitor/?x=1").headers["location"] == "/monitor?x=1"
        page = httpx.get(srv.url + "/monitor/", follow_redirects=True)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert str(page.url) == srv.url + "/monitor"
        if api_key:  # nothing else under /monitor/ is opened by it
            for path in ("/monitor/stream", "/monitor/x", "/monitor//"):
                r = httpx.get(srv.url + path)
                assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path


def test_web_files_say_nosniff(lm):
    with serve(lm) as srv:
        for path in ("/", "/monitor", "/web/chat.js", "/web/monitor.js", "/web/style.css", "/web/favicon.svg"):
            r = httpx.get(srv.url + path)
            assert r.status_code == 200 and r.headers.get("x-content-type-options") == "nosniff", path
            again = httpx.get(srv.url + path, headers={"If-None-Match": r.headers["etag"]})
            assert again.status_code == 304 and again.headers.get("x-content-type-options") == "nosniff", path
