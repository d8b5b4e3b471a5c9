"""The web pages' own logic in headless Chromium (Debian's, driven by Playwright) against a mocked API: no model and
no server, the page's requests answered by the test. The Markdown renderer's code-span placeholders cannot be forged
by the text; blank chat settings are left out of the request (not sent as 0); on a CPU-only server the monitor does
not speak of VRAM; a reply refused for its key is sent again once the key is given."""

from __future__ import annotations

import json
import pathlib
import shutil
from urllib.parse import urlparse

import pytest

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (Debian's chromium package)")

WEB = pathlib.Path(__file__).resolve().parents[2] / "strata" / "server" / "web"
SITE = "http://strata.test"
TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser):
    pg = browser.new_page(viewport={"width": 1280, "height": 860})
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    pg.close()
    assert errors == [], errors


def _sse(*events) -> str:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def _serve(page, api: dict) -> list:
    """Answer the page's requests: the static files from strata/server/web, `api` paths with (status, type, body)
    or a function of the request giving one. Returns the list of JSON bodies posted to the API."""
    posted: list = []

    def handle(route):
        req = route.request
        path = urlparse(req.url).path
        name = {"/": "index.html", "/monitor": "monitor.html"}.get(path) or path.removeprefix("/web/")
        if path in api:
            answer = api[path]
            if callable(answer):
                answer = answer(req)
            if req.post_data:
                posted.append(json.loads(req.post_data))
            status, ctype, body = answer
            return route.fulfill(status=status, content_type=ctype, body=body)
        if (path == "/" or path == "/monitor" or path.startswith("/web/")) and (WEB / name).is_file():
            return route.fulfill(status=200, content_type=TYPES[(WEB / name).suffix], body=(WEB / name).read_bytes())
        return route.fulfill(status=404, content_type="application/json", body='{"error": {"message": "no"}}')

    page.route(SITE + "/**", handle)
    return posted


BASE_API = {"/health": (200, "application/json", '{"status": "ok", "model": "m"}'),
            "/v1/models": (200, "application/json", '{"object": "list", "data": [{"id": "m"}]}')}


# ---- md.js ----------------------------------------------------------------------------------------------------

def test_markdown_code_placeholders_cannot_be_forged(page):
    """Model text holding NUL + digit + NUL rendered as another span's code (or <code>undefined</code>)."""
    _serve(page, {"/blank": (200, "text/html", "<!doctype html><title>md</title>")})
    page.goto(SITE + "/blank")  # an empty page of the site, then the renderer alone
    page.add_script_tag(path=str(WEB / "md.js"))
    render = lambda text: page.evaluate("(t) => md.render(t)", text)  # noqa: E731
    html = render("a \u00000\u0000 b `x` c")
    assert html.count("<code>") == 1 and "undefined" not in html, html
    assert "\u0000" not in html and "\ufffd0\ufffd" in html, html
    html = render("only \u00005\u0000 here")
    assert "<code>" not in html and "undefined" not in html, html
    # ordinary Markdown is unchanged
    assert render("use `a` and `b`") == "<p>use <code>a</code> and <code>b</code></p>"
    assert render("[site](https://x.test/a) **b**") == ('<p><a href="https://x.test/a" target="_blank" '
                                                        'rel="noopener noreferrer">site</a> <strong>b</strong></p>')
    # a code span inside a link's URL stays out of the href
    html = render("[s](https://x.test/`y`)")
    assert "<code>y</code>" in html and 'href="https://x.test/<code>' not in html, html


# ---- chat.js --------------------------------------------------------------------------------------------------

def test_blank_chat_settings_are_left_out(page):
    """A cleared Max tokens or Top-p field was sent as 0, which the server refuses; blank fields are now omitted
    (the server's default applies) and filled ones are sent as numbers."""
    reply = (200, "text/event-stream", _sse({"choices": [{"index": 0, "delta": {"content": "ok"}}]},
                                            {"choices": [{"index": 0, "delta": {}}], "timings": {"predicted_n": 1}}))
    posted = _serve(page, {**BASE_API, "/v1/chat/completions": reply})
    page.goto(SITE + "/")
    page.wait_for_selector("body[data-ready='1']", timeout=30000)

    def send(text):
        n = len(posted)
        page.fill("#input", text)
        page.keyboard.press("Enter")
        page.wait_for_function(f"document.querySelectorAll('.msg.assistant .stats').length > {n}", timeout=30000)
        return posted[-1]

    body = send("first")  # the page's defaults
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.8, 0.95, 1024)
    page.fill("#max_tokens", "")
    page.fill("#top_p", "")
    page.fill("#temperature", "0.25")
    body = send("second")
    assert "max_tokens" not in body and "top_p" not in body and body["temperature"] == 0.25, body
    page.fill("#temperature", "")
    page.fill("#max_tokens", "7")
    body = send("third")
    assert "temperature" not in body and body["max_tokens"] == 7, body
    assert body["messages"][-1] == {"role": "user", "content": "third"} and body["stream"] is True


# ---- monitor.js -----------------------------------------------------------------------------------------------

def _snapshot(device: str, slots: int, gpus: list) -> dict:
    L, E = 8, 32
    return {"status": "ok", "model": "m", "settings": {"device": device} if device else {},
            "state": {"status": "idle", "running": 0, "waiting": 0, "tokens_per_second": 0.0, "slots": []},
            "experts": {}, "totals": {}, "prompt_cache": {}, "recent_requests": [], "vram_split": None,
            "machine": {"cpu": {"count": 2}, "ram": {"total_bytes": 8 << 30}, "gpus": gpus},
            "cache": {"layers": L, "experts": E, "layer_ids": list(range(L)), "slots_per_layer": slots,
                      "resident": ([1] * slots + [0] * (E - slots)) * L, "heat": None if slots == E else [128] * L * E}}


@pytest.mark.parametrize("device,slots,gpus,want,unwanted", [
    ("cpu", 32, [], ["8 layers × 32 experts", "all resident in RAM", "no VRAM"], ["in VRAM", "in RAM only"]),
    ("cpu", 4, [], ["32 in cache slots", "in a cache slot (RAM)"], ["in VRAM"]),
    ("", 32, [], ["all resident in RAM"], ["in VRAM"]),  # a server that does not say its device, no GPU seen
    ("cuda:0", 4, [{"name": "H100"}], ["32 in VRAM (4 slots a layer)", "in RAM only"], ["CPU run"]),
])
def test_monitor_says_where_the_experts_are(page, device, slots, gpus, want, unwanted):
    """A CPU-only run said "256 in VRAM" and its legend "in VRAM": there is no VRAM there."""
    snap = (200, "text/event-stream", _sse(_snapshot(device, slots, gpus)))
    _serve(page, {**BASE_API, "/monitor/stream": snap})
    page.goto(SITE + "/monitor")
    page.wait_for_selector("body[data-ready='1']", timeout=30000)
    page.wait_for_function("document.getElementById('heat').dataset.resident !== undefined", timeout=30000)
    text = " | ".join(page.locator(sel).inner_text() for sel in ("#heat-note", ".card.wide >> nth=1", "#vram-legend"))
    for w in want:
        assert w in text, (w, text)
    for u in unwanted:
        assert u not in text, (u, text)


def test_a_refused_key_mid_chat_sends_the_turn_again(page):
    """A reply refused with 401 (the server restarted with another key) asked for the key, then left the user's
    message with no reply and no way to resend it but editing it; the turn is now sent again with the new key."""
    keys: list = []

    def chat(req):
        keys.append(req.headers.get("authorization"))
        if req.headers.get("authorization") != "Bearer new":
            return 401, "application/json", '{"error": {"message": "a valid API key is required"}}'
        return 200, "text/event-stream", _sse({"choices": [{"index": 0, "delta": {"content": "hello"}}]},
                                              {"choices": [{"index": 0, "delta": {}}], "timings": {"predicted_n": 1}})

    def models(req):
        ok = not keys or req.headers.get("authorization") == "Bearer new"  # keyed once a reply was refused
        return (200, "application/json", BASE_API["/v1/models"][2]) if ok else \
            (401, "application/json", '{"error": {"message": "a valid API key is required"}}')

    _serve(page, {**BASE_API, "/v1/models": models, "/v1/chat/completions": chat})
    page.goto(SITE + "/")
    page.wait_for_selector("body[data-ready='1']", timeout=30000)
    page.fill("#input", "hi")
    page.keyboard.press("Enter")
    page.wait_for_selector("#keydialog[open]", timeout=30000)
    page.fill("#keyinput", "new")
    page.keyboard.press("Enter")
    page.wait_for_selector(".msg.assistant .stats", timeout=30000)
    assert page.inner_text(".msg.assistant .body") == "hello"
    assert [m.inner_text() for m in page.locator(".msg.user .body").all()] == ["hi"]
    assert keys == [None, "Bearer new"]
