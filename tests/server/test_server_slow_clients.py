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


# (a response larger than the socket buffers, which the kernel grows to some 4 MiB on loopback: 20 alternatives
# with each token make some 2 KB of stream per token)
WRITE_CTX = 8192


@pytest.fixture(scope="module")
def roomy_lm(tiny_gguf):
    from strata.config import EngineConfig
    from strata.engine.loader import load_model

    return load_model(str(tiny_gguf), EngineConfig(model=str(tiny_gguf), device="cpu", ctx_size=WRITE_CTX))


def test_a_stream_its_client_stopped_reading_ends_and_frees_its_slot(roomy_lm):
    """A streaming client that keeps its socket open but reads nothing: once its buffers are full and it takes no
    byte for the timeout, the server drops the connection and the generation ends there (before, it ran to
    max_tokens and the connection stayed open for as long as the client kept it), and the next request is served."""
    max_tokens = WRITE_CTX - 64
    with serve(roomy_lm, parallel=1, timeout_s=READ_TIMEOUT_S) as srv:
        payload = json.dumps({"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "stream": True,
                              "ignore_eos": True, "logprobs": True, "top_logprobs": 20,
                              "messages": [{"role": "user", "content": "Tell a story."}]}).encode()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (a small window: the server's writes back up)
        s.connect(("127.0.0.1", srv.port))
        with s:
            s.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload)
            w = srv.state.server.worker
            t0 = time.monotonic()
            while not srv.state.metrics.recent:  # (wait, never reading, until the request has ended)
                assert time.monotonic() - t0 < 120, "the stuck request never ended"
                time.sleep(0.05)
            gone = srv.state.metrics.recent[-1]
            assert gone["finish_reason"] == "abort", gone
            assert 0 < gone["completion_tokens"] < max_tokens, gone
            assert w.n_running == 0
            _closed_by_server(s)  # what came before the drop, then the end of the connection
        with httpx.Client(timeout=60) as c:
            r = c.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_a_slow_reader_that_keeps_reading_is_not_cut(roomy_lm):
    """The write timeout is on a client that takes nothing: one that reads slowly (the server's writes paused most
    of the time) keeps its stream, well past the timeout."""
    with serve(roomy_lm, parallel=1, timeout_s=READ_TIMEOUT_S) as srv:
        payload = json.dumps({"model": "tiny", "max_tokens": WRITE_CTX - 64, "temperature": 0, "stream": True,
                              "ignore_eos": True, "logprobs": True, "top_logprobs": 20,
                              "messages": [{"role": "user", "content": "Tell a story."}]}).encode()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", srv.port))
        with s:
            s.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\n"
                       f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload)
            time.sleep(READ_TIMEOUT_S / 5)  # (the buffers fill)
            got = 0
            t0 = time.monotonic()
            while time.monotonic() - t0 < 8 * READ_TIMEOUT_S:
                got += len(s.recv(65536))
                time.sleep(READ_TIMEOUT_S / 10)
            assert got > 0
            assert not srv.state.metrics.recent, srv.state.metrics.recent  # still generating: not dropped
            assert srv.state.server.worker.n_running == 1


def test_an_idle_keep_alive_connection_outlives_the_read_timeout(impatient):
    """Between two requests a client owes nothing: an idle kept-alive connection lasts uvicorn's keep-alive time
    (longer than clients' pool expiry), not the read timeout, and its next request is served."""
    with socket.create_connection(("127.0.0.1", impatient.port)) as s:
        s.sendall(_request(impatient.port))
        s.settimeout(30)
        got = b""
        while got.count(b"\r\n\r\n") < 1 or not got.endswith(b"}"):
            got += s.recv(65536)
        assert got.startswith(b"HTTP/1.1 200"), got[:300]
        time.sleep(4 * READ_TIMEOUT_S)
        s.sendall(_request(impatient.port, "Connection: close\r\n"))
        out = _closed_by_server(s)
    assert out.startswith(b"HTTP/1.1 200"), out[:300]


def test_a_second_request_cut_in_its_headers_is_closed(impatient):
    with socket.create_connection(("127.0.0.1", impatient.port)) as s:
        s.sendall(_request(impatient.port))
        s.settimeout(30)
        got = b""
        while not got.endswith(b"}"):
            got += s.recv(65536)
        s.sendall(_request(impatient.port)[:30])
        assert _closed_by_server(s) == b""
