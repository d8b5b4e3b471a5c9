"""A real HTTP server on loopback that imitates the Hugging Face hub's API and file endpoints, and breaks on
demand the ways real mirrors and CDNs have broken downloads.

Endpoints:
  GET  /api/models/{owner}/{repo}/revision/{rev}?blobs=true   listing with sizes and LFS sha256 (hub shape)
  GET|HEAD /{owner}/{repo}/resolve/{rev}/{path}                file bytes, Range supported
  GET|HEAD /files/{path}                                       plain file (the `strata pull URL` case)

Faults (`hub.fault(kind, match=..., times=..., at=...)`), consumed by the first matching requests:
  no_length       no Content-Length on HEAD or GET; body read-until-close, cut at `at` when given
  cr_before       a ranged GET answered 206 with a Content-Range starting `at` bytes before the request
  cr_after        ... starting `at` bytes after the request
  ignore_range    a ranged GET answered 200 with the whole file
  drop            full headers, body cut at file offset `at` by closing the connection
  flip            the byte at file offset `at` inverted
  truncate        the file served as its first `at` bytes, with headers to match
  status          answered with HTTP status `at` (with the header `header`, "Name: value", when given)
  gated           answered `at` (401 or 403) with the hub's X-Error-Code: GatedRepo
  stall           full headers, the body up to file offset `at`, then nothing until `hub.release` is set
  no_if_range     If-Range ignored: a ranged GET answered 206 from the file as it is now
  redirect        a 302 to the same path on another origin (`localhost` for `127.0.0.1`), as the hub sends a
                  file to its CDN

Every file response carries a strong ETag (the content's sha256) and honours If-Range, as the hub's CDN does;
`hub.etags = False` leaves ETags out. Request headers are logged in `hub.headers` (one dict per request).
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


@dataclass
class Fault:
    kind: str
    match: str = ""
    times: int | None = 1  # None: forever
    at: int = 0
    ranged_only: bool = False  # only requests carrying a Range header
    header: str = ""


@dataclass
class Repo:
    commit: str
    files: dict[str, bytes]
    meta: dict[str, dict] = field(default_factory=dict)  # per-file overrides of the API's answer


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.plain: dict[str, bytes] = {}
        self.faults: list[Fault] = []
        self.log: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.headers: list[dict[str, str]] = []  # each request's headers, in the order of `log`
        self.etags = True
        self.release = threading.Event()  # ends every `stall`
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "FakeHub":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def add_repo(self, repo: str, files: dict[str, bytes], commit: str = "0" * 39 + "1") -> None:
        self.repos[repo] = Repo(commit, dict(files))

    def add_plain(self, path: str, data: bytes) -> str:
        self.plain[path] = data
        return f"{self.url}/files/{path}"

    def fault(self, kind: str, match: str = "", times: int | None = 1, at: int = 0, ranged_only: bool = False,
              header: str = "") -> None:
        with self.lock:
            self.faults.append(Fault(kind, match, times, at, ranged_only, header))

    def gets(self, match: str = "") -> list[tuple[str, str, str | None]]:
        """Logged GETs of file bytes whose path contains `match`."""
        return [e for e in self.log if e[0] == "GET" and "/api/" not in e[1] and match in e[1]]

    def _take_fault(self, path: str, ranged: bool) -> Fault | None:
        with self.lock:
            for f in self.faults:
                if f.match in path and (ranged or not f.ranged_only) and (f.times is None or f.times > 0):
                    if f.times is not None:
                        f.times -= 1
                    return f
        return None

    def listing(self, repo: str, rev: str) -> dict | None:
        r = self.repos.get(repo)
        if r is None or rev not in ("main", r.commit):
            return None
        siblings = []
        for name, data in r.files.items():
            s: dict = {"rfilename": name, "size": len(data)}
            if name.endswith(".gguf"):
                s["blobId"] = hashlib.sha1(b"pointer" + name.encode()).hexdigest()
                s["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
            else:
                s["blobId"] = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            if name in r.meta:
                over = r.meta[name]
                s.update({k: v for k, v in over.items() if k != "lfs"})
                if "lfs" in over:
                    s["lfs"] = {**s.get("lfs", {}), **over["lfs"]}
            siblings.append(s)
        return {"id": repo, "sha": r.commit, "private": False, "siblings": siblings}


def _make_handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep test output clean
            pass

        def do_HEAD(self) -> None:
            self._serve(head=True)

        def do_GET(self) -> None:
            self._serve(head=False)

        def _send(self, status: int, body: bytes, ctype: str = "application/json", code: str = "") -> None:
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _serve(self, head: bool) -> None:
            url = urlparse(self.path)
            path = unquote(url.path)
            rng = self.headers.get("Range")
            with hub.lock:
                hub.log.append(("HEAD" if head else "GET", path, rng))
                hub.headers.append({k.lower(): v for k, v in self.headers.items()})
            m = re.match(r"^/api/models/([^/]+/[^/]+)/revision/([^/]+)$", path)
            if m:
                if m.group(1) not in hub.repos:  # the hub answers 401 + RepoNotFound, as for private repos
                    return self._send(401, b'{"error": "Repository not found"}', code="RepoNotFound")
                data = hub.listing(m.group(1), m.group(2))
                if data is None:
                    return self._send(404, b'{"error": "Invalid rev id"}', code="RevisionNotFound")
                return self._send(200, json.dumps(data).encode())
            m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
            content = None
            if m and m.group(1) in hub.repos:
                repo = hub.repos[m.group(1)]
                if m.group(2) in ("main", repo.commit):
                    content = repo.files.get(m.group(3))
            elif path.startswith("/files/"):
                content = hub.plain.get(path[len("/files/") :])
            if content is None:
                return self._send(404, b'{"error": "Entry not found"}')
            self._file(content, path, rng, head)

        def _file(self, data: bytes, path: str, rng: str | None, head: bool) -> None:
            fault = hub._take_fault(path, rng is not None)
            kind = fault.kind if fault else None
            if kind == "status":
                self.send_response(fault.at)
                if fault.header:
                    self.send_header(*(x.strip() for x in fault.header.split(":", 1)))
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")
                return
            if kind == "gated":
                return self._send(fault.at, b'{"error": "Access to model is restricted"}', code="GatedRepo")
            if kind == "redirect":
                host, port = hub.server.server_address[:2]
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{port}{self.path}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if kind == "flip":
                data = data[: fault.at] + bytes([data[fault.at] ^ 0xFF]) + data[fault.at + 1 :]
            if kind == "truncate":
                data = data[: fault.at]
            total = len(data)
            start = 0
            etag = f'"{hashlib.sha256(data).hexdigest()}"'
            if_range = self.headers.get("If-Range")
            if rng and if_range is not None and if_range != etag and hub.etags and kind != "no_if_range":
                rng = None  # RFC 9110: the validator does not match, so the whole file, 200
            if rng and kind != "ignore_range":
                m = re.match(r"bytes=(\d+)-$", rng)
                assert m, rng
                start = int(m.group(1))
                if start >= total:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{total}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if kind == "cr_before":
                    start = max(0, start - fault.at)
                elif kind == "cr_after":
                    start = min(total - 1, start + fault.at)
            body = data[start:]
            self.send_response(206 if start or (rng and kind != "ignore_range") else 200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Accept-Ranges", "bytes")
            if hub.etags:
                self.send_header("ETag", etag)
            if rng and kind != "ignore_range":
                self.send_header("Content-Range", f"bytes {start}-{total - 1}/{total}")
            if kind == "no_length":
                self.send_header("Connection", "close")
                self.close_connection = True
                if fault.at:
                    body = data[start : fault.at]
            else:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if head:
                return
            if kind == "stall":
                self.wfile.write(body[: max(0, fault.at - start)])
                self.wfile.flush()
                hub.release.wait(120)
                self.close_connection = True
                return
            if kind == "drop":
                cut = max(0, fault.at - start)
                self.wfile.write(body[:cut])
                self.wfile.flush()
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return
            self.wfile.write(body)

    return Handler
