"""The web app's HTTP side against a real server on loopback (plain HTTP clients, no browser): the monitor's
address with a trailing slash, the files' headers, and the monitor stream shared by every open tab."""

from __future__ import annotations

import json
import threading
import time

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


def _first_events(url: str, n: int) -> list[str]:
    """n concurrent /monitor/stream clients, each reading its first event; they hang up once all have one."""
    got: list[str] = [""] * n
    go, done = threading.Barrier(n), threading.Barrier(n)

    def client(i):
        go.wait(30)
        with httpx.stream("GET", url + "/monitor/stream", timeout=60) as r:
            lines = r.iter_lines()  # kept: a line iterator dropped closes the connection
            got[i] = next(ln for ln in lines if ln.startswith("data:"))
            done.wait(60)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return got


def _until(cond, what: str, limit_s: float = 30.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < limit_s, what
        time.sleep(0.02)


def test_monitor_streams_share_one_snapshot_a_tick(lm, monkeypatch):
    """Tabs open at once are sent the same snapshot, built once: the count of builds, not a time. The period is
    set longer than the test so that one tick spans it all."""
    from strata.server import web

    builds = []
    real = web.snapshot
    monkeypatch.setattr(web, "PERIOD_S", 3600.0)
    monkeypatch.setattr(web, "snapshot", lambda app, heat: builds.append(heat) or real(app, heat))
    with serve(lm) as srv:
        first = _first_events(srv.url, 4)
        assert all(first) and len(set(first)) == 1 and len(builds) == 1, (len(set(first)), builds)
        assert '"cache"' in first[0]  # a tick's first snapshot has the heat map
        # the tabs gone, the ticker stops: nothing is built with no one watching, and no task is left behind
        feed = srv.state.monitor_feed
        _until(lambda: feed.clients == 0 and feed.task is None, "the monitor's ticker outlived its clients")
        assert len(builds) == 1
        # a tab that comes later gets a fresh snapshot, not the one left from before
        again = _first_events(srv.url, 2)
        assert len(set(again)) == 1 and again[0] != first[0] and len(builds) == 2


def test_monitor_stream_goes_on_tick_after_tick(lm):
    with serve(lm) as srv, httpx.stream("GET", srv.url + "/monitor/stream", timeout=60) as r:
        lines = r.iter_lines()
        snaps = [json.loads(next(ln for ln in lines if ln.startswith("data:"))[5:]) for _ in range(3)]
    assert [s["status"] for s in snaps] == ["ok"] * 3
    assert ["cache" in s for s in snaps] == [True, False, True]  # the heat map every other tick
    assert snaps[0]["uptime_s"] < snaps[1]["uptime_s"] < snaps[2]["uptime_s"]
