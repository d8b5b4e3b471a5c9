"""`strata serve -np auto` (the default): the slot count from the KV a slot takes and the memory it lives in."""

from __future__ import annotations

import argparse
import time

import httpx
import pytest

from strata.engine.auto_slots import AUTO_SLOTS, KV_SHARE, auto_slots, choose_slots, kv_bytes_per_slot
from tests.server.conftest import serve

GiB = 2**30


def test_choose_slots_keeps_the_slots_kv_within_its_share():
    room = 8 * GiB
    share = int(KV_SHARE * room)
    assert choose_slots(share // 4, room) == AUTO_SLOTS  # four fit exactly
    assert choose_slots(share // 4 + 1, room) == 3
    assert choose_slots(share // 2, room) == 2
    assert choose_slots(share, room) == 1
    assert choose_slots(4 * share, room) == 1  # a context whose one slot exceeds the share still gets its slot
    assert choose_slots(1, room) == AUTO_SLOTS  # never more than llama-server's auto


def test_a_slots_kv_is_what_the_engine_allocates(lm):
    # the metadata's figure (strata check's) against the KV cache the engine really makes for one slot
    from strata.engine.engine import Engine

    per = kv_bytes_per_slot(lm)
    assert per == Engine(lm, n_slots=1).kv.nbytes
    got = auto_slots(lm)
    assert got.kv_bytes_per_slot == per and got.room_name == "the free RAM"
    assert got.slots == choose_slots(per, got.room_bytes)
    assert "-np auto" in got.render()


def test_the_flag_takes_a_count_or_auto():
    from strata.server.cli import _parallel

    assert _parallel("auto") == 0 and _parallel("AUTO") == 0 and _parallel("-1") == 0
    assert _parallel("3") == 3
    for bad in ("0", "-2", "four"):
        with pytest.raises(argparse.ArgumentTypeError):
            _parallel(bad)


def test_an_auto_server_reports_the_slots_it_took(lm):
    # on this CPU the tiny model's KV is a sliver of the free RAM: llama-server's four slots
    with serve(lm, parallel=0) as r:
        deadline = time.monotonic() + 60
        while httpx.get(r.url + "/health", timeout=30).status_code != 200:
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.1)
        settings = httpx.get(r.url + "/metrics?format=json", timeout=30).json()["settings"]
        assert settings["parallel"] == AUTO_SLOTS
        assert r.state.model_meta["parallel"] == AUTO_SLOTS
        assert r.state.metrics.worker.engine.n_slots == AUTO_SLOTS


@pytest.mark.parametrize("k,v", [("q8_0", "q8_0"), ("q4_0", "f16"), ("bf16", "q8_0")])
def test_a_slots_kv_in_a_compact_type_is_what_the_engine_allocates(tiny_gguf, k, v):
    from strata.config import EngineConfig
    from strata.engine.engine import Engine
    from strata.engine.loader import load_model

    cfg = EngineConfig(model=str(tiny_gguf), device="cpu", ctx_size=256, cache_type_k=k, cache_type_v=v)
    lm = load_model(str(tiny_gguf), cfg)
    assert kv_bytes_per_slot(lm) == Engine(lm, n_slots=1).kv.nbytes
