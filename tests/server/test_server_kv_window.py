"""The server over a KV window (--kv-vram-tokens): the same completions as over the full cache, a follow-up turn
reusing the conversation, and the window's hit rate in /metrics (Prometheus and JSON)."""

from __future__ import annotations

import httpx
import pytest

from strata.config import EngineConfig
from strata.engine.loader import load_model

from .conftest import CTX, serve

PROMPT = "Once upon a time there was a small fox who lived by a river. " * 12  # (longer than the window)


@pytest.fixture(scope="module")
def window_lm(tiny_gguf):
    return load_model(str(tiny_gguf), EngineConfig(model=str(tiny_gguf), device="cpu", ctx_size=CTX,
                                                   kv_vram_tokens="64", kv_page_tokens=16))


def _turns(url: str) -> list[str]:
    out = []
    for prompt in (PROMPT, PROMPT + " The fox"):
        r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0},
                       timeout=120)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


def test_server_over_the_window(window_lm, lm):
    with serve(lm, parallel=1) as full:
        ref = _turns(full.url)
    with serve(window_lm, parallel=1) as r:
        assert r.state.server.worker.engine.kv_window_stats is not None
        assert _turns(r.url) == ref
        text = httpx.get(r.url + "/metrics").text
        j = httpx.get(r.url + "/metrics?format=json").json()
    assert "strata_kv_window_hit_rate" in text and "strata_kv_window_miss_bytes_total" in text
    hits = [ln for ln in text.splitlines() if ln.startswith("vllm:prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) > 0  # (the follow-up turn reused the first one's KV)
    kw = j["kv_window"]
    assert kw["misses"] > 0 and 0 < kw["hit_rate"] < 1
