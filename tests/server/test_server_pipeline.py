"""`strata serve --pipeline-parallel-size 2`: a real server whose model is split over two processes (gloo over
loopback) answers the official OpenAI client with the single-process engine's greedy text; a stage that dies
turns requests into errors and /health into 503, never a hang."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from tests.server.conftest import free_port


def _wait_ready(port: int, p: subprocess.Popen) -> None:
    t0 = time.time()
    while time.time() - t0 < 180:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if p.poll() is not None:
            raise AssertionError(f"strata serve exited: {p.communicate()[1][-3000:]}")
        time.sleep(0.2)
    raise AssertionError("strata serve -pp 2 did not become ready")


def test_serve_split_over_two_stages(tiny_gguf):
    openai = pytest.importorskip("openai")
    from strata.config import EngineConfig
    from strata.engine.engine import Engine
    from strata.engine.loader import load_model
    from strata.engine.sampler import SamplingParams

    lm = load_model(str(tiny_gguf), EngineConfig(model=str(tiny_gguf), device="cpu", ctx_size=256))
    prompt = "The quick brown fox"
    ref = lm.tokenizer.decode(list(Engine(lm, n_slots=1).generate(lm.tokenizer.encode(prompt),
                                                                  SamplingParams(temperature=0), 12)))
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STRATA_API_KEY": ""}
    p = subprocess.Popen([sys.executable, "-m", "strata", "serve", "-m", str(tiny_gguf), "--port", str(port),
                          "-c", "256", "--threads", "1", "--pipeline-parallel-size", "2", "--no-warmup"],
                         env=env, stderr=subprocess.PIPE, text=True)
    try:
        _wait_ready(port, p)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        r = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == ref
        stages = [c for c in psutil.Process(p.pid).children(recursive=True)
                  if "multiprocessing" in " ".join(c.cmdline())]
        assert stages, "no stage process"
        for c in stages:
            c.kill()
        with pytest.raises(openai.APIError):
            client.completions.create(model="strata-tiny-synthetic-v1", prompt=prompt, max_tokens=4, temperature=0)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 503
    finally:
        p.terminate()
        err = p.communicate(timeout=30)[1]
    assert "pipeline of 2 stages (stage 0: layers 0-" in err and "unavailable" not in err[:0]
