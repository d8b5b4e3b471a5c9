"""Access control, as plain ASGI middleware in front of every route (unknown routes included).

- With an API key, every path but /health needs it: `Authorization: Bearer KEY` or `x-api-key: KEY`, compared
  in constant time.
- Without a key, a request whose Host header is not loopback, the bound name, this machine's name or an IP
  address is refused: that is what a DNS-rebinding page sends (its own hostname, resolved to 127.0.0.1).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import socket

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "localhost.localdomain", "ip6-localhost"}
OPEN_PATHS = {"/health"}


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


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


class AccessControl:
    def __init__(self, app, api_key: str | None, bound_host: str):
        self.app = app
        self.key = api_key.encode() if api_key else None
        allowed = set(LOOPBACK_NAMES) | {_host_name(bound_host)}
        try:
            name = socket.gethostname().lower()
            allowed |= {name, socket.getfqdn(name).lower()}
        except OSError:
            pass
        self.allowed_hosts = {h for h in allowed if h and h not in ("0.0.0.0", "::")}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        if self.key is not None:
            if scope.get("path") not in OPEN_PATHS and not self._key_ok(headers):
                return await _deny(send, 401, "authentication_error",
                                   "a valid API key is required (Authorization: Bearer KEY or x-api-key: KEY)")
        else:
            host = _host_name(headers.get("host", b"").decode("latin-1"))
            if not (host in self.allowed_hosts or _is_ip(host)):
                return await _deny(send, 403, "permission_error",
                                   f"Host {host!r} is not allowed: without --api-key, strata answers only requests "
                                   "addressed to this machine (loopback, its name or an IP address)")
        return await self.app(scope, receive, send)

    def _key_ok(self, headers: dict) -> bool:
        got = headers.get("x-api-key")
        auth = headers.get("authorization")
        if auth is not None and auth[:7].lower() == b"bearer ":
            got = auth[7:].strip()
        if got is None:
            return False
        return hmac.compare_digest(got, self.key)


async def _deny(send, status: int, type_: str, message: str) -> None:
    body = json.dumps({"error": {"type": type_, "message": message, "code": None, "param": None}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
