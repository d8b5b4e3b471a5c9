"""The KV window (--kv-vram-tokens): a window of 64 tokens (pages of 16) under prompts of 200 read in several
chunks gives the full cache's logits bit for bit and its greedy tokens, for every family, over float and
quantized KV, several slots at once and a conversation reused from the slot or from the conversation cache; the
page pool's policy and counters; the flag's bad values."""

from __future__ import annotations

import pytest
import torch

from strata import StrataError
from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.loader import load_model
from strata.engine.sampler import SamplingParams
from strata.kv.cache import KVCache, Segment
from strata.kv.window import PagePolicy, WindowKVCache, auto_tokens, new_kv_cache, parse_tokens

FAMILIES = ["qwen3moe", "qwen3", "mixtral", "llama", "deepseek_v3", "deepseek_v3_noqlora", "glm4moe",
            "glm4moe_noqknorm", "gpt_oss", "qwen3next"]
WINDOW = dict(kv_vram_tokens="64", kv_page_tokens=16)
GREEDY = SamplingParams(temperature=0)


def _prompt(n, seed):
    return torch.randint(0, 1001, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _cfg(**kw):
    return EngineConfig(device="cpu", dtype="float32", **kw)


def _chunked_logits(lm, kv, ids, chunk, steps):
    """Every position's logits of a prompt read in chunks, then of `steps` greedy decode steps, over `kv`."""
    m, out, pos = lm.model, [], 0
    while pos < len(ids):
        n = min(chunk, len(ids) - pos)
        t = torch.tensor(ids[pos:pos + n])
        out.append(m.forward(t, torch.arange(pos, pos + n), [Segment(0, pos, n)], kv, all_logits=True))
        pos += n
    for _ in range(steps):
        tok = int(out[-1][-1].argmax())
        out.append(m.forward(torch.tensor([tok]), torch.tensor([pos]), [Segment(0, pos, 1)], kv, all_logits=True))
        pos += 1
    return torch.cat(out)


@pytest.mark.parametrize("family", FAMILIES)
def test_window_equals_full_kv(family, hf_and_gguf):
    """Logits of every position equal (the same rows reach the same attention), greedy tokens identical, and the
    window really served the prompt from both places (hits and misses)."""
    _, path = hf_and_gguf(family)
    lm = load_model(str(path), _cfg(**WINDOW))
    ids = _prompt(200, 1)
    full = lm.model.new_kv_cache(1, lm.max_ctx, torch.float32)
    win = new_kv_cache(lm.model, 1, lm.max_ctx, lm.cfg, torch.float32)
    assert isinstance(win, WindowKVCache) and win.host_nbytes >= 4 * win.pool.nbytes
    ref = _chunked_logits(lm, full, ids, 48, 6)
    got = _chunked_logits(lm, win, ids, 48, 6)
    assert torch.equal(got, ref), f"{family}: max difference {(got - ref).abs().max():.3g}"
    assert win.stats.hits > 0 and win.stats.misses > 0
    a = list(Engine(load_model(str(path), _cfg()), prefill_chunk=48).generate(ids, GREEDY, max_tokens=8))
    eng = Engine(lm, prefill_chunk=48)
    assert eng.graphs is None and eng.kv_window_stats is eng.kv.stats
    assert list(eng.generate(ids, GREEDY, max_tokens=8)) == a


@pytest.mark.parametrize("family,types", [("qwen3moe", ("q8_0", "q8_0")), ("deepseek_v3", ("q8_0", "q8_0")),
                                          ("gpt_oss", ("q4_0", "q8_0")), ("qwen3next", ("q8_0", "f16"))])
def test_window_over_quantized_kv(family, types, hf_and_gguf):
    """q8_0 / q4_0 pages are the blocks as stored: the window's logits equal the same quantized full cache's."""
    _, path = hf_and_gguf(family)
    lm = load_model(str(path), _cfg(cache_type_k=types[0], cache_type_v=types[1], **WINDOW))
    kt = lm.cfg.kv_cache_types
    full = lm.model.new_kv_cache(1, lm.max_ctx, torch.float32, *kt)
    win = new_kv_cache(lm.model, 1, lm.max_ctx, lm.cfg, torch.float32, *kt)
    assert isinstance(win, WindowKVCache) and win.quantized and full.quantized
    ids = _prompt(200, 2)
    assert torch.equal(_chunked_logits(lm, win, ids, 64, 4), _chunked_logits(lm, full, ids, 64, 4))


def _serve(path, prompts, n_slots, tokens=8, **kw):
    eng = Engine(load_model(str(path), _cfg(**kw)), n_slots=n_slots, prefill_chunk=40)
    from strata.engine.request import Request
    from strata.engine.sequence import Sequence

    seqs = [Sequence.of(Request(p, GREEDY, tokens, set())) for p in prompts]
    for s in seqs:
        eng.add(s)
    while any(not s.finished for s in seqs):
        eng.step()
    return [s.output for s in seqs], eng


@pytest.mark.parametrize("family", ["qwen3moe", "gpt_oss", "qwen3next"])
def test_several_slots_share_the_pool(family, hf_and_gguf):
    """Three sequences prefilled and decoded together (one pool for all slots; each slot's first and latest pages
    pinned) give what the full cache gives each."""
    _, path = hf_and_gguf(family)
    prompts = [_prompt(150, 3), _prompt(190, 4), _prompt(90, 5)]
    ref, _ = _serve(path, prompts, 3)
    got, eng = _serve(path, prompts, 3, kv_vram_tokens="96", kv_page_tokens=16)
    assert isinstance(eng.kv, WindowKVCache) and got == ref
    assert eng.kv_window_stats.misses > 0 and 0 < eng.kv_window_stats.hit_rate < 1


@pytest.mark.parametrize("family", ["qwen3moe", "deepseek_v3", "qwen3next"])
def test_conversation_reuse(family, hf_and_gguf):
    """A follow-up turn reuses the slot's KV (its prefix is not read again); after an unrelated prompt took the
    slot, the next turn gets its conversation back from the conversation cache (RAM) into the slot: the same
    tokens as the full cache gives. (Each turn goes on past all the slot held, so a recurrent model's state is
    reused too.)"""
    from strata.server.prompt_cache import PromptCache

    _, path = hf_and_gguf(family)

    def run(**kw):
        eng = Engine(load_model(str(path), _cfg(**kw)), n_slots=1, prefill_chunk=40)
        pc, outs = PromptCache(64), []

        def turn(prompt):
            pc.prepare(eng, prompt)
            outs.append(list(eng.generate(prompt, GREEDY, max_tokens=6)))
            outs.append(eng.last.cached)

        turn(_prompt(180, 6))
        turn(second := eng.slot_tokens[0] + _prompt(30, 8))
        turn(_prompt(120, 7))
        turn(second + outs[2][:-1] + _prompt(10, 9))
        return outs, pc.restores

    ref, restores = run()
    got, got_restores = run(**WINDOW)
    assert got == ref and got_restores == restores >= 1
    assert got[3] >= 180 and got[7] >= 210  # (reused from the slot, then from RAM)


def test_policy_keeps_first_and_latest_pages_and_does_not_thrash():
    """Pool of 4 pages, a slot of 10 pages read whole every step: page 0 and the last two stay, and the fourth
    keeps the last middle page admitted while the pool had room; the rest are read from the host each step, never
    churning the pool."""
    pol = PagePolicy(4)
    acc = pol.access(0, 0, 10, fresh=0, written=0)  # a prompt of 10 pages written at once: nothing read
    assert not acc.hits and not acc.misses
    assert sorted(p for (_, p) in pol.where) == [0, 3, 8, 9]
    for _ in range(3):  # decode steps writing in page 9
        acc = pol.access(0, 0, 10, fresh=10, written=9)
        assert sorted(p for p, _ in acc.hits) == [0, 3, 8, 9] and acc.misses == [1, 2, 4, 5, 6, 7]
        assert [p for p, _ in acc.to_pool] == [9]
    acc = pol.access(0, 0, 11, fresh=10, written=10)  # page 10 begins: pinned, it takes the least recently used unpinned page's place (3)
    assert sorted(p for (_, p) in pol.where) == [0, 8, 9, 10] and (10, pol.where[(0, 10)]) in acc.to_pool
    assert len({i for _, i in acc.to_pool}) == len(acc.to_pool)


def test_window_counts_and_bytes(hf_and_gguf):
    _, path = hf_and_gguf("qwen3moe")
    lm = load_model(str(path), _cfg(**WINDOW))
    win = new_kv_cache(lm.model, 1, lm.max_ctx, lm.cfg, torch.float32)
    ids = _prompt(200, 1)
    _chunked_logits(lm, win, ids, 200, 0)  # one chunk: every page fresh, nothing read back
    assert (win.stats.hits, win.stats.misses) == (0, 0)
    lm.model.forward(torch.tensor([5]), torch.tensor([200]), [Segment(0, 200, 1)], win)
    layers = win.n_layers
    # 13 pages of 16 up to position 200: 4 in the pool (page 0, a middle one, pages 11 and 12), 9 from the host
    assert (win.stats.hits, win.stats.misses) == (4 * layers, 9 * layers)
    assert win.stats.miss_bytes == 9 * layers * win.page_bytes and win.stats.hit_rate == pytest.approx(4 / 13)


def test_window_as_large_as_the_context_is_the_plain_cache(hf_and_gguf):
    _, path = hf_and_gguf("qwen3moe")
    lm = load_model(str(path), _cfg(kv_vram_tokens=str(2 * 512), kv_page_tokens=16, ctx_size=512))
    kv = new_kv_cache(lm.model, 2, 512, lm.cfg, torch.float32)
    assert type(kv) is KVCache and not kv.eager_only
    eng = Engine(load_model(str(path), _cfg(kv_vram_tokens="1000", kv_page_tokens=16, ctx_size=512)), n_slots=2)
    assert isinstance(eng.kv, WindowKVCache) and eng.kv.window == 1008  # (rounded up to whole pages)


@pytest.mark.parametrize("value", ["abc", "0", "-16", "1.5", ""])
def test_bad_values_are_one_clear_error(value):
    with pytest.raises(StrataError, match="--kv-vram-tokens") as e:
        EngineConfig(device="cpu", kv_vram_tokens=value).validate()
    assert "\n" not in str(e.value)


def test_flag_values_and_a_window_too_small():
    assert parse_tokens(None) is None and parse_tokens("auto") == "auto" and parse_tokens(" 4096 ") == 4096
    with pytest.raises(StrataError, match="at least 3 pages"):
        WindowKVCache(2, 1, 256, (2, 8), (2, 8), torch.float32, "cpu", window=32, page=16)
    with pytest.raises(StrataError, match="--kv-page-tokens"):
        EngineConfig(device="cpu", kv_page_tokens=0).validate()


def test_auto_sizing():
    # the whole KV fits beside the minimal expert cache: no window
    assert auto_tokens(left=10 << 30, per_token=100_000, full_tokens=32_768, stage=0, expert_min=1 << 30,
                       page=256) is None
    # it does not: what is left after the experts' minimum and the stage, in whole pages
    got = auto_tokens(left=4 << 30, per_token=100_000, full_tokens=131_072, stage=200 << 20, expert_min=1 << 30,
                      page=256)
    assert got % 256 == 0 and got * 100_000 <= (3 << 30) - (200 << 20) < (got + 256) * 100_000


def test_cpu_auto_is_the_plain_cache(hf_and_gguf):
    _, path = hf_and_gguf("qwen3moe")
    lm = load_model(str(path), _cfg(kv_vram_tokens="auto"))
    assert type(new_kv_cache(lm.model, 1, lm.max_ctx, lm.cfg, torch.float32)) is KVCache


@pytest.mark.gpu
@pytest.mark.parametrize("family,types", [("qwen3moe", (None, None)), ("gpt_oss", ("q8_0", "q8_0")),
                                          ("deepseek_v3", ("q4_0", "q4_0"))])
def test_window_on_cuda(family, types, hf_and_gguf):
    """On a GPU: the host copy pinned, the copies asynchronous on the compute stream, the same logits as the full
    VRAM cache, and the same greedy tokens as an engine without graphs over the full cache."""
    _, path = hf_and_gguf(family)
    kw = dict(device="cuda", dtype="float32", cache_type_k=types[0], cache_type_v=types[1])
    lm = load_model(str(path), EngineConfig(**kw, **WINDOW))
    kt = lm.cfg.kv_cache_types
    full = lm.model.new_kv_cache(1, lm.max_ctx, torch.float32, *kt)
    win = new_kv_cache(lm.model, 1, lm.max_ctx, lm.cfg, torch.float32, *kt)
    assert isinstance(win, WindowKVCache) and win.host.k[0] is not None
    assert all(t.is_pinned() for t in (win.host.k[0].qs if types[0] else win.host.k[0],))
    ids = _prompt(200, 1)
    assert torch.equal(_chunked_logits(lm, win, ids, 48, 6), _chunked_logits(lm, full, ids, 48, 6))
    ref = Engine(load_model(str(path), EngineConfig(**kw, cuda_graphs=False)), prefill_chunk=48)
    eng = Engine(lm, prefill_chunk=48)
    assert eng.graphs is None
    assert list(eng.generate(ids, GREEDY, max_tokens=8)) == list(ref.generate(ids, GREEDY, max_tokens=8))


def test_check_plans_the_window():
    """`strata check --kv-vram-tokens N`: the window and one layer's stage in VRAM, the whole KV in host RAM; a
    context whose KV does not fit the budget gets the window among the fixes."""
    from strata.hub.check import ModelFootprint, fit
    from strata.hub.machine import CPUInfo, GPUInfo, MachineInfo

    GiB = 1 << 30
    fp = ModelFootprint(files=["q.gguf"], architecture="qwen3moe", total_bytes=int(17.5 * GiB),
                        dense_bytes=int(1.5 * GiB), expert_bytes=16 * GiB, n_expert=128, n_expert_used=8,
                        n_moe_layers=48, slot_bytes=16 * GiB // (48 * 128), kv_bytes_per_token=98304,
                        context_length=131072)
    m = MachineInfo([GPUInfo(0, "GPU", 24 * GiB, 8 * GiB, 4, 4, 16, 16)], None, 128 * GiB, 128 * GiB,
                    CPUInfo("cpu", 8, 16), "/", 100 * GiB)
    full = fit(fp, m, ctx=131072, vram_budget=8 * GiB)
    assert not full.ok and any("--kv-vram-tokens" in x for x in full.fixes)
    win = fit(fp, m, ctx=131072, vram_budget=8 * GiB, kv_window=8192)
    host = 131072 * 98304
    assert win.ok and (win.kv_window, win.kv_host_bytes) == (8192, host)
    assert win.kv_bytes == 8192 * 98304 + host // 48 and win.ram_needed - full.ram_needed == host
    assert win.slots > 0 and any("KV window" in n for n in win.notes)
    assert fit(fp, m, ctx=4096, vram_budget=8 * GiB, kv_window=8192).kv_window == 0  # (the context fits whole)


def test_metrics_report_the_window(hf_and_gguf):
    from types import SimpleNamespace

    from strata.server.metrics import Metrics

    _, path = hf_and_gguf("qwen3moe")
    eng = Engine(load_model(str(path), _cfg(**WINDOW)), prefill_chunk=48)
    list(eng.generate(_prompt(120, 3), GREEDY, max_tokens=4))
    m = Metrics("tiny")
    assert m.kv_window_stats() == {}
    m.worker = SimpleNamespace(engine=eng, n_running=0, n_waiting=0)
    st = m.kv_window_stats()
    assert st["misses"] > 0 and st["hit_rate"] == round(eng.kv_window_stats.hit_rate, 4) < 1
    text = m.prometheus().decode()
    assert f"strata_kv_window_hit_rate {st['hit_rate']}" in text and "strata_kv_window_miss_bytes_total" in text


def test_a_context_the_host_cannot_hold_is_refused_with_the_numbers(hf_and_gguf, monkeypatch):
    import strata.kv.window as window

    _, path = hf_and_gguf("qwen3moe")
    lm = load_model(str(path), _cfg(**WINDOW))
    per = lm.model.kv_bytes_per_token(torch.float32)
    monkeypatch.setattr(window, "ram_available", lambda: 100 * per)
    with pytest.raises(StrataError, match=r"needs .* GiB of host RAM, .* GiB is available: -c 96 fits"):
        new_kv_cache(lm.model, 1, 512, lm.cfg, torch.float32)
    monkeypatch.setattr(window, "ram_available", lambda: 2 * 512 * per)
    assert isinstance(new_kv_cache(lm.model, 2, 512, lm.cfg, torch.float32), WindowKVCache)


def test_the_default_context_grows_with_a_window_on_a_gpu():
    from strata.kv.window import default_ctx

    class Cfg:  # (a CUDA device without one here: only its type is read)
        kv_vram_tokens, torch_device = "8192", torch.device("cuda")

    assert default_ctx(Cfg, 131072) == 131072
    Cfg.kv_vram_tokens = None
    assert default_ctx(Cfg, 131072) is None
    assert default_ctx(EngineConfig(device="cpu", kv_vram_tokens="64"), 131072) is None  # (on a CPU: as before)


def test_page_runs_and_the_indexed_copy(hf_and_gguf, monkeypatch):
    """Pages copied as slices where pages and pool indices run in step, else by one indexed copy: both exact."""
    import strata.kv.window as window

    assert window._runs([(0, 0), (1, 1), (2, 5), (3, 6), (7, 7)]) == [(0, 0, 2), (2, 5, 2), (7, 7, 1)]
    monkeypatch.setattr(window, "MAX_RUNS", 0)  # every copy indexed
    _, path = hf_and_gguf("gpt_oss")
    lm = load_model(str(path), _cfg(cache_type_k="q8_0", cache_type_v="q8_0", **WINDOW))
    kt = lm.cfg.kv_cache_types
    full = lm.model.new_kv_cache(1, lm.max_ctx, torch.float32, *kt)
    win = new_kv_cache(lm.model, 1, lm.max_ctx, lm.cfg, torch.float32, *kt)
    ids = _prompt(200, 4)
    assert torch.equal(_chunked_logits(lm, win, ids, 48, 4), _chunked_logits(lm, full, ids, 48, 4))


def test_sliding_layers_read_only_their_window(hf_and_gguf):
    """gpt-oss's sliding layers (a window of 6 tokens) fetch only the pages their window touches: after a prompt
    of 200 written in one chunk (nothing read back), a decode step at position 200 reads 13 pages in each of the
    two full-attention layers and one page in each of the two sliding layers."""
    _, path = hf_and_gguf("gpt_oss")
    lm = load_model(str(path), _cfg(**WINDOW))
    win = new_kv_cache(lm.model, 1, lm.max_ctx, lm.cfg, torch.float32)
    _chunked_logits(lm, win, _prompt(200, 1), 200, 0)
    lm.model.forward(torch.tensor([5]), torch.tensor([200]), [Segment(0, 200, 1)], win)
    assert win.stats.hits + win.stats.misses == 2 * 13 + 2 * 1


@pytest.mark.parametrize("family", ["qwen3moe", "gpt_oss"])
def test_speculative_decoding_over_the_window(family, hf_and_gguf):
    """Verify steps write drafts that may be rejected and rewritten: the same tokens as the full cache gives."""
    _, path = hf_and_gguf(family)
    base = _prompt(40, 11)
    ids = base * 4 + base[:20]  # (repeats: n-gram drafts find matches)

    def run(**kw):
        eng = Engine(load_model(str(path), _cfg(draft_max=4, **kw)), prefill_chunk=48)
        out = list(eng.generate(ids, GREEDY, max_tokens=24))
        return out, eng.last.draft_n

    ref, drafts = run()
    got, _ = run(**WINDOW)
    assert got == ref and drafts > 0


def test_pipeline_stages_refuse_the_window():
    with pytest.raises(StrataError, match="--kv-vram-tokens.*pipeline"):
        EngineConfig(device="cpu", kv_vram_tokens="4096", pipeline_parallel_size=2).validate()


def test_the_flag_parses():
    import argparse

    from strata.config import add_flags, from_flags

    p = argparse.ArgumentParser()
    add_flags(p, EngineConfig)
    cfg = from_flags(EngineConfig, p.parse_args(["--kv-vram-tokens", "auto", "--kv-page-tokens", "128"]))
    assert (cfg.kv_vram_tokens, cfg.kv_page_tokens) == ("auto", 128)
    assert from_flags(EngineConfig, p.parse_args([])).kv_vram_tokens is None


def test_auto_from_the_budget(monkeypatch):
    """auto on a GPU: the budget less what the device holds, the reserve, two expert slots a layer for each routed
    expert, a default prefill chunk's activations and the stage; the whole KV when it fits beside them."""
    from types import SimpleNamespace as NS

    import strata.kv.window as window
    from strata.experts.sizing import prefill_bytes_per_token

    MiB, GiB = 1 << 20, 1 << 30
    model = NS(device=torch.device("cuda"), kv_bytes_per_token=lambda *a: 48 * 1024,
               args=NS(n_experts_used=8, d_model=2048),
               experts=NS(store=NS(expert_nbytes=lambda i: 2 * MiB), layer_ids=range(48)))
    cfg = EngineConfig(device="cpu", kv_vram_tokens="auto")
    cfg.experts.vram_gb = 8
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (total - 3 * GiB, total))
    total = 80 * GiB  # (3 GiB held: context and weights)
    left = 5 * GiB - cfg.experts.vram_reserve_mib * MiB
    experts = 2 * 8 * 48 * 2 * MiB + 4096 * prefill_bytes_per_token(2048, 8)
    stage = 1024 * 131072
    got = window._auto(model, cfg, 1, 131072, 48, None, None, None, 256)
    assert got == (left - experts - stage) // (48 * 1024) // 256 * 256 and 0 < got < 131072
    assert window._auto(model, cfg, 1, 8192, 48, None, None, None, 256) is None  # (8K of KV fits whole)


def test_the_bench_records_the_window():
    """strata bench: the window's page hits between two /metrics snapshots, and a line under the sweep's table."""
    from strata.bench.record import kv_window_delta
    from strata.bench.report import _sweep_md

    before = {"kv_window": {"hits": 10, "misses": 30, "miss_bytes": 10**9}}
    after = {"kv_window": {"hits": 40, "misses": 90, "miss_bytes": 4 * 10**9}}
    d = kv_window_delta(before, after)
    assert d == {"hits": 30, "misses": 60, "miss_bytes": 3 * 10**9, "hit_rate": 30 / 90}
    assert kv_window_delta(before, {"experts": {}}) == {}
    row = {"length": 32768, "prompt_tokens": [32768], "prefill_tok_s": None, "decode_tok_s": None, "ttft_s": None,
           "experts": {}, "kv_window": d}
    text = "\n".join(_sweep_md({"config": {"warmup": 1, "runs": 1, "gen": 8}, "rows": [row]}))
    assert "KV window at 32K: 33.3% of the KV pages read from VRAM, 3.00 GB from host RAM" in text


def test_a_window_too_small_is_named_as_typed(hf_and_gguf):
    """The error names the value the user wrote, not the whole pages it was rounded up to."""
    _, path = hf_and_gguf("qwen3moe")
    lm = load_model(str(path), _cfg(kv_vram_tokens="10", kv_page_tokens=16, ctx_size=512))
    with pytest.raises(StrataError, match=r"^--kv-vram-tokens 10: the window needs at least 3 pages of 16 tokens"):
        new_kv_cache(lm.model, 1, 512, lm.cfg, torch.float32)
