"""A real uvicorn server on loopback, serving a real tiny model (no stand-in engine)."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time

import pytest
import torch

CTX = 512


def tiny_model_path(hf_and_gguf):
    # The synthetic tiny model (random weights): its behaviour under forced outputs is what these tests pin
    # down; the trained default model is served by tests/test_strata_tiny.py.
    from strata.models.default import synthetic_model_path

    return synthetic_model_path()


@pytest.fixture(scope="session")
def tiny_gguf(hf_and_gguf):
    return tiny_model_path(hf_and_gguf)


@pytest.fixture(scope="session")
def lm(tiny_gguf):
    from strata.config import EngineConfig
    from strata.engine.loader import load_model

    return load_model(str(tiny_gguf), EngineConfig(model=str(tiny_gguf), device="cpu", ctx_size=CTX))


@pytest.fixture(scope="session")
def thinking_lm(lm):
    """The same weights behind a chat template whose generation prompt ends inside <think>."""
    from strata.gguf.builtin_templates import QWEN3_TEMPLATE
    from strata.gguf.chat_template import ChatTemplate

    src = QWEN3_TEMPLATE.replace("{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}")
    assert src != QWEN3_TEMPLATE
    return dataclasses.replace(lm, template=ChatTemplate(src))


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    # the engine thread, the event loop and the test's clients share 2 CI cores: intra-op threads only contend
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    def __init__(self, app, port: int, host: str = "127.0.0.1"):
        from strata.server.cli import uvicorn_server

        self.app, self.port, self.host = app, port, host
        self.url = f"http://{host}:{port}"
        self.server = uvicorn_server(app, host, port, graceful_s=2)  # the server and settings serve runs with
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            if time.time() - t0 > 60 or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=20)

    @property
    def state(self):
        return self.app.state


@contextlib.contextmanager
def serve(lm, **kw):
    from strata.server.app import ServeConfig, create_app

    port = free_port()
    kw.setdefault("model_id", "tiny")
    kw.setdefault("warmup", False)
    cfg = ServeConfig(host="127.0.0.1", port=port, **kw)
    with Running(create_app(cfg, lm=lm), port) as r:
        yield r


@pytest.fixture(scope="module")
def server(lm):
    with serve(lm, parallel=2) as r:
        yield r


@contextlib.contextmanager
def port_forward(target_port: int):
    """A TCP port forward to a server on loopback (what `ssh -L` or a container's published port is): yields the
    local port that reaches `target_port`."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(16)
    lsock.settimeout(0.2)
    stop = threading.Event()

    def pump(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def accept():
        while not stop.is_set():
            try:
                c, _ = lsock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            c.settimeout(None)
            u = socket.create_connection(("127.0.0.1", target_port))
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield lsock.getsockname()[1]
    finally:
        stop.set()
        t.join(timeout=5)
        lsock.close()
