"""A real server on loopback serving the tiny model with tiered experts under a --vram-gb budget: each response's
`timings` carry the miss lanes' GB/s over its decode, /metrics the totals, /props the VRAM split."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from strata.experts.sizing import staging_slots

from .conftest import CTX, serve

MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
SLOTS = 8  # of the tiny model's 32 experts per layer: most routed experts miss
_http = httpx.Client(timeout=60)


@pytest.fixture(scope="module")
def tiered_lm(tiny_gguf):
    from strata.config import EngineConfig, ExpertConfig
    from strata.engine.loader import load_model
    from strata.hub.check import model_footprint

    fp = model_footprint([tiny_gguf])
    # a budget (no reserve) of the staging ring and SLOTS slots in every layer, on a CPU sized as on a GPU
    budget = staging_slots(fp.n_expert_used) * fp.slot_bytes + SLOTS * (fp.expert_bytes // fp.n_expert) + 1000
    plan = "0" + "1" * fp.n_expert_used  # one miss of each token's to the CPU, the others over PCIe
    ex = ExpertConfig(mode="tiered", vram_gb=budget / (1 << 30), vram_reserve_mib=0, cpu_plan=plan)
    return load_model(str(tiny_gguf), EngineConfig(model=str(tiny_gguf), device="cpu", ctx_size=CTX, experts=ex))


@pytest.fixture(scope="module")
def server(tiered_lm):
    with serve(tiered_lm, parallel=1) as r:
        yield r


def test_timings_metrics_and_props_report_the_lanes_and_the_split(server, tiered_lm):
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=12, temperature=0)
    t = r.model_extra["timings"]
    assert t["predicted_n"] == 12
    assert t["experts_cpu_bytes"] > 0 and t["experts_pcie_bytes"] > 0  # both lanes moved experts
    s = t["predicted_ms"] / 1e3
    assert t["experts_cpu_gbps"] == pytest.approx(t["experts_cpu_bytes"] / s / 1e9, abs=1e-4)
    assert t["experts_pcie_gbps"] == pytest.approx(t["experts_pcie_bytes"] / s / 1e9, abs=1e-4)
    assert t["experts_miss_gbps"] == pytest.approx(t["experts_cpu_gbps"] + t["experts_pcie_gbps"], abs=2e-4)
    assert t["experts_cpu_gbps"] > 0 and t["experts_pcie_gbps"] > 0

    text = _http.get(server.url + "/metrics").text
    values = {m[0]: float(m[1]) for m in re.findall(r"^(strata_[a-z_]+) ([0-9.e+-]+)$", text, re.M)}
    for name in ("strata_experts_cpu_gbps", "strata_experts_pcie_gbps", "strata_experts_miss_gbps"):
        assert values[name] > 0, name
    # one request: the totals' GB/s are its own
    assert values["strata_experts_pcie_gbps"] == pytest.approx(t["experts_pcie_gbps"], rel=1e-3, abs=1e-4)
    assert values["strata_expert_cpu_bytes_total"] >= t["experts_cpu_bytes"]  # all phases: the prefill too
    assert values["strata_expert_cache_slots_per_layer"] == SLOTS
    assert 'strata_vram_split_bytes{part="cache"}' in text and 'strata_vram_split_bytes{part="staging"}' in text

    j = _http.get(server.url + "/metrics?format=json").json()
    lanes = j["experts"]["decode_lanes"]
    assert lanes["pcie_bytes"] == t["experts_pcie_bytes"] and lanes["decode_s"] == pytest.approx(s, rel=1e-3)
    assert j["recent_requests"][-1]["experts_cpu_gbps"] == t["experts_cpu_gbps"]
    split = j["settings"]["vram_split"]
    assert split["slots_per_layer"] == SLOTS and 0 < split["cache_share"] < 1
    props = _http.get(server.url + "/props").json()
    assert props["vram_split"] == split
    # the cache's policy and its decay as --cache-decay auto resolved it for this model's shape
    from strata.experts.policy import auto_decay

    cache = j["settings"]["expert_cache"]
    assert cache["policy"] == "lfu-decay" and cache["swap_budget"] >= 0 and props["expert_cache"] == cache
    assert cache["decay"] == pytest.approx(auto_decay(tiered_lm.args.n_experts, tiered_lm.args.n_experts_used))


def test_a_resident_model_reports_no_lanes(lm):
    """Resident experts count nothing: no lane fields in the timings, no split."""
    with serve(lm, parallel=1) as srv:
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        t = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=3, temperature=0).model_extra["timings"]
        assert "experts_cpu_gbps" not in t
        props = _http.get(srv.url + "/props").json()
        assert props["vram_split"] is None and props["expert_cache"] is None
        text = _http.get(srv.url + "/metrics").text
        assert "strata_experts_miss_gbps 0.0" in text and "strata_vram_split_bytes" not in text
