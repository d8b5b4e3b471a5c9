"""Clients that never finish sending a request: a connection that sends nothing, part of its headers, or part of
its body is closed once no byte has come for the read timeout (llama.cpp's server closes such a connection after
its --timeout); none of them takes a slot, and clients that behave are served meanwhile."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from .conftest import serve

READ_TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def impatient(lm):
    with serve(lm, parallel=1, timeout_s=READ_TIMEOUT_S) as r:
        yield r


def _request(port: int, headers: str = "") -> bytes:
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{headers}\r\n").encode() + body


def _closed_by_server(sock: socket.socket) -> bytes:
    """What the server sent before it closed the connection (fails if it is still open after a generous wait)."""
    sock.settimeout(30)
    out = b""
    try:
        while data := sock.recv(65536):
            out += data
    except socket.timeout:
        raise AssertionError(f"the server kept the connection open (got {out[:200]!r})") from None
    except ConnectionResetError:
        pass
    return out


@pytest.mark.parametrize("sent", ["nothing", "part of the headers", "part of the body"])
def test_a_request_that_never_completes_is_closed_without_a_slot(impatient, sent):
    full = _request(impatient.port)
    head_end = full.index(b"\r\n\r\n") + 4
    part = {"nothing": b"", "part of the headers": full[:20], "part of the body": full[:head_end + 5]}[sent]
    w = impatient.state.server.worker
    steps = w.steps
    with socket.create_connection(("127.0.0.1", impatient.port)) as s:
        s.sendall(part)
        with httpx.Client(timeout=60) as c:  # another client is served while this one stalls
            r = c.post(impatient.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
        assert _closed_by_server(s) == b""
    assert w.steps - steps == 2  # only the other client's request ran
    assert w.n_running == 0 and w.n_waiting == 0


def test_a_slow_but_steady_body_is_served(impatient):
    """The timeout is on silence, not on the whole request: a body that keeps coming, byte by byte over more
    than the timeout, is answered."""
    full = _request(impatient.port, "Connection: close\r\n")
    with socket.create_connection(("127.0.0.1", impatient.port)) as s:
        head_end = full.index(b"\r\n\r\n") + 4
        s.sendall(full[:head_end])
        t0 = time.monotonic()
        for i in range(head_end, len(full)):
            s.sendall(full[i:i + 1])
            time.sleep(READ_TIMEOUT_S / 5)
        assert time.monotonic() - t0 > READ_TIMEOUT_S  # (the premise: the whole body took longer than the timeout)
        out = _closed_by_server(s)
    assert out.startswith(b"HTTP/1.1 200"), out[:300]


def test_serve_closes_a_silent_connection_after_its_timeout(tmp_path):
    """`strata serve -to N` (llama-server's flag) sets the timeout of the server it runs."""
    import os
    import subprocess
    import sys

    from .conftest import free_port

    port = free_port()
    env = {**os.environ, "STRATA_API_KEY": ""}
    p = subprocess.Popen([sys.executable, "-m", "strata", "serve", "--port", str(port), "-np", "1", "--no-warmup",
                          "-to", "1"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        for line in p.stderr:
            if "listening on" in line:
                break
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\n")
            assert _closed_by_server(s) == b""
    finally:
        p.terminate()
        p.wait(60)
