"""An idle keep-alive connection outlives the idle expiry of clients' connection pools: httpx (under the openai and
anthropic clients) keeps a pooled connection 5 s, and a server that closes at the same moment makes the client's next
request on it fail with "connection reset" although the server is healthy."""

from __future__ import annotations

import http.client
import time

IDLE_S = 6.0  # past httpx's 5 s expiry, and past uvicorn's own 5 s default


def test_an_idle_connection_is_still_open_after_a_client_pools_expiry(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/health")
    first = conn.getresponse()
    first.read()
    assert first.status == 200 and not first.will_close
    sock = conn.sock
    time.sleep(IDLE_S)
    conn.request("GET", "/health")  # on the same socket: http.client opens a new one only when it has none
    second = conn.getresponse()
    second.read()
    assert second.status == 200
    assert conn.sock is sock, "the server closed the idle connection"
    conn.close()
