"""Access control, as plain ASGI middleware in front of every route (unknown routes included).

The threat is a web page in the user's browser: it can send requests to a server on loopback (or on the LAN)
and, for "simple" requests, the browser does not ask the server first. The checks, in order:

- Origin: a request that carries an Origin header (every browser request from a page does, cross-site ones
  always) is refused with 403 unless the origin is on the allow-list: the `--cors-origin` values plus the
  server's own origins (http://NAME:PORT for the names it answers to) and the origin the request is addressed to
  (its Host header): a page of this server reached through a port forward (ssh -L, a container's published
  port) or a reverse proxy has that origin, and the Host check below still refuses a rebinding page's name.
  Requests without Origin (curl, SDKs, agents) are not affected.
- A CORS preflight (OPTIONS with Origin and Access-Control-Request-Method) from an allowed origin is answered
  here, before the key check: browsers never send credentials on a preflight, by design.
- With an API key, every path but /health and the web pages' files (/, /monitor and its
  redirect /monitor/, /web/...) needs it: `Authorization: Bearer KEY` or `x-api-key: KEY`, compared
  in constant time.
- Without a key, a request whose Host header is not loopback, the bound name, this machine's name or an IP
  address is refused: that is what a DNS-rebinding page sends (its own hostname, resolved to 127.0.0.1).
- A POST must say `Content-Type: application/json` (415 otherwise): the content types a page may send without a
  preflight (text/plain, forms) are exactly the ones refused, so no cross-site form or beacon starts a generation.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import socket
from urllib.parse import urlsplit

from strata.server.protocol import error_body

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "localhost.localdomain", "ip6-localhost"}
# the web pages and their files hold no data: they ask for the key and send it with every API call they make
OPEN_PATHS = {"/health", "/", "/monitor", "/monitor/"}  # /monitor/ only redirects to /monitor
OPEN_PREFIXES = ("/web/",)
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
BODY_METHODS = {"POST", "PUT", "PATCH"}
DEFAULT_PORTS = {"http": 80, "https": 443}


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(value: str) -> str:
    """The host part of a Host header value: strips the port and IPv6 brackets, lower-cases."""
    v = value.strip().lower()
    if v.startswith("["):
        return v[1: v.find("]")] if "]" in v else v[1:]
    if v.count(":") == 1:
        v = v.split(":", 1)[0]
    return v.rstrip(".")


def _host_port(value: str) -> tuple[str, int | None]:
    """The host (as _host_name gives it) and the port, None when the Host header names none."""
    v = value.strip()
    tail = v[v.find("]") + 1:] if v.startswith("[") else v
    port = None
    if tail.count(":") == 1:
        try:
            port = int(tail.rsplit(":", 1)[1])
        except ValueError:
            port = -1  # a malformed port matches no origin
    return _host_name(v), port


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def origin_key(origin: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an Origin value, default ports filled in; None for "null" or anything malformed."""
    try:
        u = urlsplit(origin.strip())
        port = u.port
    except ValueError:
        return None
    if u.scheme not in DEFAULT_PORTS or not u.hostname or u.path not in ("", "/") or u.query or u.username:
        return None
    return u.scheme, u.hostname.rstrip(".").lower(), port or DEFAULT_PORTS[u.scheme]


def _local_addresses() -> set[str]:
    """This machine's interface addresses: a server bound to a wildcard address is its own origin at any of them."""
    try:
        import psutil

        return {a.address.split("%")[0].lower() for addrs in psutil.net_if_addrs().values() for a in addrs
                if a.family in (socket.AF_INET, socket.AF_INET6)}
    except Exception:  # noqa: BLE001 - without the list, the loopback and bound names still work
        return set()


class AccessControl:
    def __init__(self, app, api_key: str | None, bound_host: str, port: int = 0, cors_origins=()):
        self.app = app
        self.key = api_key.encode() if api_key else None
        allowed = set(LOOPBACK_NAMES) | {_host_name(bound_host)}
        try:
            name = socket.gethostname().lower()
            allowed |= {name, socket.getfqdn(name).lower()}
        except OSError:
            pass
        self.allowed_hosts = {h for h in allowed if h and h not in WILDCARD_HOSTS}
        self.any_origin = "*" in cors_origins
        self.cors = {k for k in map(origin_key, cors_origins) if k is not None}
        self.cors_null = "null" in cors_origins  # sandboxed frames and file:// pages send "Origin: null"
        own = set(self.allowed_hosts)
        if _host_name(bound_host) in WILDCARD_HOSTS:
            own |= _local_addresses()
        # the server's own pages: the names the Host check accepts (no bare IP literals: a page on any address
        # could claim one), at this port exactly (a page served by another program on this machine is another
        # origin)
        self.own = {(scheme, h, port) for h in own for scheme in ("http", "https")} if port else set()

    def origin_allowed(self, origin: str, host: str = "") -> bool:
        """Whether a page of `origin` may use the server; `host` is the request's Host header: a page whose origin
        is the address the browser sent this request to is the same origin (what a port forward or a proxy in
        front of the server makes of its own pages)."""
        if self.any_origin:
            return True
        if origin.strip() == "null":
            return self.cors_null
        k = origin_key(origin)
        if k is None:
            return False
        if k in self.cors or k in self.own:
            return True
        name, port = _host_port(host)
        return bool(name) and (name, port or DEFAULT_PORTS[k[0]]) == k[1:]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        method = scope.get("method", "GET")
        origin = headers.get("origin")
        if origin is not None:
            origin = origin.decode("latin-1")
            if not self.origin_allowed(origin, headers.get("host", b"").decode("latin-1")):
                return await _deny(scope, send, 403, "permission_error",
                                   f"Origin {origin!r} is not allowed: start strata with --cors-origin {origin} to "
                                   "let pages from it use this server")
            cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
            if method == "OPTIONS" and "access-control-request-method" in headers:
                return await _preflight(send, cors, headers.get("access-control-request-headers"))
            send = _with_headers(send, cors)
        if self.key is not None:
            path = scope.get("path") or ""
            if path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES) and not self._key_ok(headers):
                return await _deny(scope, send, 401, "authentication_error",
                                   "a valid API key is required (Authorization: Bearer KEY or x-api-key: KEY)")
        else:
            host = _host_name(headers.get("host", b"").decode("latin-1"))
            if not (host in self.allowed_hosts or _is_ip(host)):
                return await _deny(scope, send, 403, "permission_error",
                                   f"Host {host!r} is not allowed: without --api-key, strata answers only requests "
                                   "addressed to this machine (loopback, its name or an IP address)")
        if method in BODY_METHODS:
            ctype = headers.get("content-type", b"").decode("latin-1")
            media = ctype.split(";", 1)[0].strip().lower()
            if media != "application/json" and not media.endswith("+json"):
                return await _deny(scope, send, 415, "invalid_request_error",
                                   f"Content-Type must be application/json (got {ctype or 'none'!r}); with curl, "
                                   "add -H 'Content-Type: application/json'")
        return await self.app(scope, receive, send)

    def _key_ok(self, headers: dict) -> bool:
        got = headers.get("x-api-key")
        auth = headers.get("authorization")
        if auth is not None and auth[:7].lower() == b"bearer ":
            got = auth[7:].strip()
        if got is None:
            return False
        return hmac.compare_digest(got, self.key)


def _with_headers(send, extra: list[tuple[bytes, bytes]]):
    async def wrapped(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return wrapped


async def _preflight(send, cors: list, req_headers: bytes | None) -> None:
    headers = [*cors, (b"access-control-allow-methods", b"GET, POST, OPTIONS"), (b"access-control-max-age", b"600"),
               (b"content-length", b"0")]
    if req_headers:  # whatever the page means to send (authorization, x-api-key, anthropic-version, ...)
        headers.append((b"access-control-allow-headers", req_headers))
    await send({"type": "http.response.start", "status": 204, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


async def _deny(scope, send, status: int, type_: str, message: str) -> None:
    body = json.dumps(error_body(scope.get("path") or "", type_, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
