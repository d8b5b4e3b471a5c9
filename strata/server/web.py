"""The web app: a chat page at `/` and a live monitor of the engine at `/monitor`.

The pages are static files inside the package (strata/server/web/: HTML, CSS and plain JavaScript, nothing fetched
from elsewhere at run time). They hold no data, so they are served without the API key; they ask for the key when
the server has one (kept in the tab's sessionStorage) and send it with every API call. The monitor reads
`/monitor/stream`: server-sent events, one snapshot a second (the engine's counters, slots, the VRAM split and,
every other second, the expert cache's residency and heat), produced only while a page is connected and shared
by all the connected pages. The files go out with ETag and Last-Modified and `no-cache`: a reload asks again, and
an unchanged file is a 304.
"""

from __future__ import annotations

import asyncio
import json
import re
from email.utils import parsedate_to_datetime
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response, StreamingResponse

from strata.server.protocol import GET_HEAD, APIError

WEB = Path(__file__).resolve().parent / "web"
PERIOD_S = 1.0  # monitor snapshots per second: bounded whatever the page asks
HEAT_EVERY = 2  # the heat map (the largest part) in every second snapshot
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".txt": "text/plain; charset=utf-8"}
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")

router = APIRouter()


def _file(name: str, request: Request):
    path = WEB / name
    if not _NAME.match(name) or path.suffix not in TYPES or not path.is_file():
        # the body every other 404 has (strata.server.protocol.APIError)
        return JSONResponse(APIError(404, f"no route GET /web/{name}", "not_found_error").body(), status_code=404)
    # no-cache: a page reloaded after an upgrade gets the new files (revalidated, not re-sent when unchanged);
    # nosniff: the browser takes each file as the type it is sent with (a script or a style sheet only as one)
    resp = FileResponse(path, media_type=TYPES[path.suffix], stat_result=path.stat(),
                        headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"})
    if _unchanged(request.headers, resp.headers):
        return Response(status_code=304, headers={k: resp.headers[k] for k in ("etag", "last-modified",
                                                                               "cache-control",
                                                                               "x-content-type-options")})
    return resp


def _unchanged(req, resp) -> bool:
    """Whether the browser's copy is current (RFC 9110 13.1.2-3): its If-None-Match names the file's ETag (weak
    comparison), or, without that header, its If-Modified-Since is no earlier than the file's Last-Modified."""
    inm = req.get("if-none-match")
    if inm is not None:
        tags = [t.strip().removeprefix("W/") for t in inm.split(",")]
        return "*" in tags or resp["etag"].removeprefix("W/") in tags
    ims = req.get("if-modified-since")
    if ims is None:
        return False
    try:
        return parsedate_to_datetime(resp["last-modified"]) <= parsedate_to_datetime(ims)
    except (TypeError, ValueError):  # a date that does not parse: send the file
        return False


@router.api_route("/", methods=GET_HEAD, include_in_schema=False)
async def chat_page(request: Request):
    return _file("index.html", request)


@router.api_route("/monitor", methods=GET_HEAD, include_in_schema=False)
async def monitor_page(request: Request):
    return _file("monitor.html", request)


@router.api_route("/monitor/", methods=GET_HEAD, include_in_schema=False)
async def monitor_slash(request: Request):
    # open like the page itself (strata.server.auth.OPEN_PATHS): with an API key, a browser sent here would
    # otherwise get the key check's 401 body; a relative Location holds through a port forward or a proxy
    query = request.url.query
    return RedirectResponse("/monitor" + (f"?{query}" if query else ""), status_code=307)


@router.api_route("/web/{name}", methods=GET_HEAD, include_in_schema=False)
async def web_file(name: str, request: Request):
    return _file(name, request)


def snapshot(app, heat: bool) -> dict:
    """What the monitor shows now: the engine's counters (Metrics.as_json), the model, the VRAM split and, with
    `heat`, the expert cache's residency and heat."""
    st = app.state
    if st.server is None:
        if st.load_error:
            return {"status": "error", "error": f"the model failed to load: {st.load_error}"}
        return {"status": "loading"}
    out = st.metrics.as_json()
    out["status"] = "ok"
    out["model"] = st.model_id
    out["model_meta"] = {k: v for k, v in (st.model_meta or {}).items() if isinstance(v, (str, int, float, bool))}
    split = st.server.worker.engine.vram_split
    out["vram_split"] = split.as_dict() if split is not None else None
    if heat:
        experts = st.server.worker.engine.model.experts
        out["cache"] = experts.cache_view() if experts is not None else None
    return out


def _event(app, heat: bool) -> str:
    return f"data: {json.dumps(snapshot(app, heat), default=str)}\n\n"


class Feed:
    """The monitor's snapshots, shared by every connected stream: one built a tick whatever the number of open
    tabs (the heat map, NVML's queries and psutil's CPU window are each taken once), none while no tab is
    connected. A tab that connects gets the latest snapshot at once, then each new one."""

    def __init__(self, app):
        self.app = app
        self.clients = 0
        self.task: asyncio.Task | None = None  # the ticker, running while a client is connected
        self.seq = 0  # the number of the latest snapshot
        self.event: str | None = None  # that snapshot as an SSE event; None until the running ticker built one
        self.error: Exception | None = None
        self.next = asyncio.Event()  # set (and replaced) when a snapshot is published

    def _publish(self) -> None:
        self.seq += 1
        done, self.next = self.next, asyncio.Event()
        done.set()

    async def _tick(self) -> None:
        n = 0
        try:
            while True:
                self.event = await asyncio.to_thread(_event, self.app, n % HEAT_EVERY == 0)
                self._publish()
                n += 1
                await asyncio.sleep(PERIOD_S)
        except Exception as e:  # noqa: BLE001 - every connected stream ends with it (the next one starts afresh)
            self.error = e
            self.task = None
            self._publish()

    def join(self) -> None:
        self.clients += 1
        if self.task is None:
            self.event, self.error = None, None
            self.task = asyncio.create_task(self._tick())

    def leave(self) -> None:
        self.clients -= 1
        if self.clients == 0 and self.task is not None:
            self.task.cancel()
            self.task, self.event = None, None


@router.get("/monitor/stream", include_in_schema=False)
async def monitor_stream(request: Request):
    app = request.app
    feed = getattr(app.state, "monitor_feed", None)
    if feed is None:
        feed = app.state.monitor_feed = Feed(app)

    async def events():
        feed.join()
        try:
            last = None
            while not app.state.closing and not await request.is_disconnected():
                if feed.error is not None:
                    raise feed.error
                if feed.event is not None and feed.seq != last:
                    last = feed.seq
                    yield feed.event
                else:
                    await feed.next.wait()
        finally:  # also when the stream is cancelled for a client that hung up
            feed.leave()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
