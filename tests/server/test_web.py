"""The web app in a real browser: headless Chromium (Debian's, driven by Playwright) against a real server on
loopback serving the tiny model with tiered experts. The chat page streams a reply, stops one (Escape), keeps the
conversation across a reload, regenerates and edits; a keyed server asks for the key and says when it is wrong;
the monitor shows the model and a hit rate that moves with a request; a loading server is shown as loading. No
page logs a console error."""

from __future__ import annotations

import json
import shutil
import threading

import httpx
import pytest

from tests.server.conftest import Running, free_port, port_forward, serve

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (Debian's chromium package)")


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def tiered_lm(lm):
    """The tiny model with its experts tiered (2 slots a layer on the 'device', the rest in RAM): hit rates move."""
    from strata.config import EngineConfig, ExpertConfig
    from strata.engine.loader import load_model

    cfg = EngineConfig(model=lm.gguf.paths[0].as_posix(), device="cpu", ctx_size=512,
                       experts=ExpertConfig(mode="tiered", slots=2, cpu_plan="0" * (lm.args.n_experts_used + 1)))
    return load_model(cfg.model, cfg)


@pytest.fixture(scope="module")
def site(tiered_lm):
    with serve(tiered_lm) as r:
        yield r


class Page:
    """A browser page that records console errors and uncaught exceptions."""

    def __init__(self, browser, expect: tuple[str, ...] = ()):
        # expect: console messages a test causes on purpose (the browser's own log line for a refused request)
        self.page = browser.new_page(viewport={"width": 1280, "height": 860})
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text)
                     if m.type == "error" and not any(x in m.text for x in expect) else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def __enter__(self):
        return self.page

    def __exit__(self, *exc):
        self.page.close()
        if exc[0] is None:
            assert self.errors == [], self.errors


def _ready(page, url):
    page.goto(url)
    page.wait_for_selector("body[data-ready='1']", timeout=30000)


def test_chat_round_trip_reload_regenerate_edit(browser, site):
    with Page(browser) as page:
        _ready(page, site.url + "/")
        assert page.inner_text("#model") == "tiny"
        page.fill("#max_tokens", "12")
        page.focus("#input")
        page.keyboard.type("Hello there")
        page.keyboard.press("Enter")  # the keyboard alone sends
        page.wait_for_selector(".msg.assistant .stats", timeout=60000)
        assert page.inner_text(".msg.user .body") == "Hello there"
        stats = page.inner_text(".msg.assistant .stats")
        assert "tokens" in stats and "tok/s" in stats and "cached" in stats, stats
        first = page.inner_text(".msg.assistant .body")
        assert first.strip()
        page.reload()  # the conversation is kept in the browser
        page.wait_for_selector("body[data-ready='1']")
        assert page.inner_text(".msg.user .body") == "Hello there"
        assert page.inner_text(".msg.assistant .body") == first
        page.click("text=Regenerate")
        page.wait_for_selector(".msg.assistant .stats", timeout=60000)
        assert page.locator(".msg.assistant").count() == 1
        page.click(".msg.user >> text=Edit")  # back into the composer, the conversation cut there
        assert page.input_value("#input") == "Hello there" and page.locator(".msg").count() == 0
        page.fill("#input", "Hello again")
        page.click("#send")
        page.wait_for_selector(".msg.assistant .stats", timeout=60000)
        assert page.inner_text(".msg.user .body") == "Hello again"


def test_stop_with_escape(browser, site):
    with Page(browser) as page:
        _ready(page, site.url + "/")
        page.click("#newchat")
        page.fill("#max_tokens", "400")
        page.fill("#input", "Tell me a long story")
        page.keyboard.press("Enter")
        page.wait_for_function("document.querySelector('.msg.assistant .body') && "
                               "document.querySelector('.msg.assistant .body').innerText.length > 3", timeout=60000)
        page.keyboard.press("Escape")
        page.wait_for_selector(".msg.assistant >> text=stopped", timeout=30000)
        assert page.is_enabled("#send") and not page.is_enabled("#stop")


def test_chat_through_a_port_forward(browser, site):
    """Opened through a port forward (ssh -L, a container's published port), the page's POST carries the forward's
    origin: it was refused as another site's (403), so no reply ever came."""
    with port_forward(site.port) as fwd, Page(browser) as page:
        _ready(page, f"http://localhost:{fwd}/")
        page.click("#newchat")
        page.fill("#max_tokens", "6")
        page.fill("#input", "Hi")
        page.keyboard.press("Enter")
        page.wait_for_selector(".msg.assistant .stats, .msg.assistant .error", timeout=60000)
        assert page.locator(".msg.assistant .error").count() == 0, page.inner_text(".msg.assistant .error")


def test_keyed_server_asks_for_the_key(browser, tiered_lm):
    with serve(tiered_lm, api_key="s3cret") as srv, Page(browser, expect=("status of 401",)) as page:
        page.goto(srv.url + "/")  # the page itself needs no key
        page.wait_for_selector("#keydialog[open]", timeout=30000)
        assert "needs an API key" in page.inner_text("#keynote")
        page.fill("#keyinput", "wrong")
        page.keyboard.press("Enter")
        page.wait_for_selector("#keynote.bad", timeout=30000)
        assert "refused" in page.inner_text("#keynote")
        page.fill("#keyinput", "s3cret")
        page.keyboard.press("Enter")
        page.wait_for_selector("body[data-ready='1']", timeout=30000)
        page.fill("#max_tokens", "6")
        page.fill("#input", "Hi")
        page.keyboard.press("Enter")
        page.wait_for_selector(".msg.assistant .stats", timeout=60000)
        # the key stays with the tab: the API without it is still refused
        assert httpx.get(srv.url + "/v1/models").status_code == 401


def test_monitor_shows_the_model_and_a_moving_hit_rate(browser, site):
    with Page(browser) as page:
        _ready(page, site.url + "/monitor")
        page.wait_for_function("document.getElementById('model').dataset.model === 'tiny'", timeout=30000)
        page.wait_for_function("document.getElementById('heat').dataset.resident !== undefined", timeout=30000)
        assert int(page.get_attribute("#heat", "data-resident")) > 0
        before = page.get_attribute("#hit", "data-overall")
        r = httpx.post(site.url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "max_tokens": 24, "temperature": 0.9, "seed": 7,
            "messages": [{"role": "user", "content": "Something new to route: zebra quantum 42"}]})
        assert r.status_code == 200
        page.wait_for_function(f"document.getElementById('hit').dataset.overall !== {before!r}", timeout=30000)
        assert page.inner_text("#machine")  # CPUs and RAM at least
        assert "slot" in page.inner_text("#slots") and page.locator("#slots tbody tr").count() == 1


def test_pages_show_a_loading_server(browser, tiered_lm):
    """/health answers 503 while the model loads: the pages say so, then go on by themselves."""
    from strata.server.app import ServeConfig, create_app

    go = threading.Event()

    def load():
        go.wait(60)
        return tiered_lm

    port = free_port()
    app = create_app(ServeConfig(host="127.0.0.1", port=port, model_id="tiny", warmup=False), load=load)
    with Running(app, port) as srv:
        for path in ("/", "/monitor"):
            with Page(browser, expect=("status of 503",)) as page:  # (the browser logs each 503 of /health)
                page.goto(srv.url + path)
                page.wait_for_selector("#banner.loading", timeout=30000)
                assert "loading" in page.inner_text("#banner").lower()
        go.set()
        with Page(browser) as page:
            _ready(page, srv.url + "/")


def test_web_files_are_served_and_confined(site):
    for path, kind in (("/", "text/html"), ("/monitor", "text/html"), ("/web/chat.js", "javascript"),
                       ("/web/style.css", "text/css")):
        r = httpx.get(site.url + path)
        assert r.status_code == 200 and kind in r.headers["content-type"], path
    for bad in ("/web/../app.py", "/web/%2e%2e/app.py", "/web/nothing.js", "/web/web.py"):
        assert httpx.get(site.url + bad).status_code == 404, bad
    # a missing file's 404 has the body any other 404 has
    missing, other = httpx.get(site.url + "/web/nothing.js").json(), httpx.get(site.url + "/nothing").json()
    assert set(missing) == set(other) and set(missing["error"]) == set(other["error"])


def test_monitor_stream_needs_the_key(tiered_lm):
    with serve(tiered_lm, api_key="k") as srv:
        assert httpx.get(srv.url + "/").status_code == 200
        assert httpx.get(srv.url + "/monitor/stream").status_code == 401
        with httpx.stream("GET", srv.url + "/monitor/stream", headers={"Authorization": "Bearer k"},
                          timeout=30) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            line = next(ln for ln in r.iter_lines() if ln.startswith("data:"))
        snap = json.loads(line[5:])
        assert snap["status"] == "ok" and snap["model"] == "tiny"
        assert snap["cache"]["layers"] * snap["cache"]["experts"] == len(snap["cache"]["resident"])

