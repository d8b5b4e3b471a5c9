"""The conversation cache on a real engine: KV saved before a slot is overwritten, restored bit for bit, and
least-recently-used conversations evicted to stay within the byte budget."""

from __future__ import annotations

import torch

from strata.engine.engine import Engine, Sequence
from strata.engine.sampler import SamplingParams
from strata.server.prompt_cache import PromptCache


def _run(engine, cache, prompt, n=3):
    seq = Sequence(list(prompt), SamplingParams(temperature=0), n, set())
    cache.prepare(engine, seq.prompt)
    engine.add(seq)
    while not seq.finished:
        engine.step()
    return seq


def test_restore_gives_the_same_tokens_and_kv(lm):
    e = Engine(lm, n_slots=1, prefill_chunk=64)
    per_entry = e.kv.nbytes // e.max_ctx * 40  # bytes of ~40 tokens of KV
    cache = PromptCache(1)
    cache.budget = int(per_entry * 1.5)  # room for one conversation of this size, not two
    a = list(range(10, 50))
    b = list(range(100, 140))
    c = list(range(200, 240))
    first = _run(e, cache, a)
    kv_a = [e.kv.k[0][0, :40].clone()]
    _run(e, cache, b)  # a goes to RAM
    assert cache.saves == 1 and len(cache.entries) == 1
    again = _run(e, cache, a + [7, 8])  # a comes back from RAM; b goes there
    assert cache.restores == 1 and again.cached == 40 and first.output
    assert torch.equal(e.kv.k[0][0, :40], kv_a[0])
    assert [x.tokens[:40] for x in cache.entries.values()] == [b]
    _run(e, cache, c)  # a (grown by its second turn) is saved; b, the least recently used, is evicted for it
    assert cache.used <= cache.budget and cache.evictions == 1
    assert [x.tokens[:40] for x in cache.entries.values()] == [a]
    cold = Sequence(list(b) + [1], SamplingParams(temperature=0), 2, set())
    cache.prepare(e, cold.prompt)
    e.add(cold)
    assert cold.cached == 0  # b was evicted
    e.release(cold, "abort")


def test_same_output_with_and_without_cache(lm):
    e = Engine(lm, n_slots=1, prefill_chunk=16)
    cache = PromptCache(64)
    conv = list(range(30, 70))
    base = _run(e, cache, conv, 6).output
    _run(e, cache, list(range(300, 340)))
    hot = _run(e, cache, conv, 6)
    assert hot.cached == len(conv) - 1 and hot.output == base


def test_round_trip_with_q8_0_cache_keeps_the_blocks(tiny_gguf):
    """-ctk q8_0 -ctv q8_0: entries hold the stored blocks and scales (about half a bf16 cache's bytes), and a
    restore puts them back bit for bit: the same tokens as a cold run of the same cache type."""
    from strata.config import EngineConfig
    from strata.engine.loader import load_model

    cfg = EngineConfig(model=str(tiny_gguf), device="cpu", ctx_size=256, cache_type_k="q8_0", cache_type_v="q8_0")
    e = Engine(load_model(str(tiny_gguf), cfg), n_slots=1, prefill_chunk=64)
    assert e.kv.quantized
    cache = PromptCache(64)
    a, b = list(range(10, 50)), list(range(100, 140))
    _run(e, cache, a)
    stored = [e.kv.k[0].qs[0, :40].clone(), e.kv.k[0].d[0, :40].clone(), e.kv.v[0].qs[0, :40].clone()]
    _run(e, cache, b)  # a goes to RAM, as stored
    entry = next(iter(cache.entries.values()))
    assert [t.dtype for t in entry.k[0]] == [torch.uint8, torch.float16]
    assert entry.nbytes == sum(t.numel() * t.element_size() for rows in entry.k + entry.v for t in rows)
    again = _run(e, cache, a + [7, 8])
    assert cache.restores == 1 and again.cached == 40
    assert torch.equal(e.kv.k[0].qs[0, :40], stored[0]) and torch.equal(e.kv.k[0].d[0, :40], stored[1])
    assert torch.equal(e.kv.v[0].qs[0, :40], stored[2])
    cold = Engine(load_model(str(tiny_gguf), cfg), n_slots=1, prefill_chunk=64)
    assert _run(cold, PromptCache(0), a + [7, 8]).output == again.output
