"""The static-shape decode step (what CUDA graphs replay) equals the dynamic one."""


import pytest
import torch

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.loader import load_model
from strata.engine.sampler import SamplingParams


def _run(path, device, graphs, ids, n=24):
    cfg = EngineConfig(device=device, dtype="float32", cuda_graphs=graphs)
    eng = Engine(load_model(str(path), cfg), n_slots=1)
    assert (eng.graphs is not None) == graphs
    return list(eng.generate(ids, SamplingParams(temperature=0), n))


@pytest.mark.parametrize("family", ["qwen3moe", "deepseek_v3"])
def test_static_decode_equals_dynamic(family, hf_and_gguf):
    _, path = hf_and_gguf(family)
    ids = torch.randint(0, 1001, (245,), generator=torch.Generator().manual_seed(4)).tolist()
    # 245 + 24 crosses the first window (256): both windows are exercised
    assert _run(path, "cpu", True, ids) == _run(path, "cpu", False, ids)


def test_static_window_masks_stale_cache(hf_and_gguf):
    """Positions past the current one hold stale K/V from an earlier, longer sequence: the mask must hide them."""
    from strata.engine.graphs import DecodeGraphs

    _, path = hf_and_gguf("qwen3moe")
    lm = load_model(str(path), EngineConfig(device="cpu", dtype="float32"))
    eng = Engine(lm, n_slots=1)
    long = list(range(10, 110))
    list(eng.generate(long, SamplingParams(temperature=0), 4))  # fills slot 0 up to ~104
    short = list(range(500, 520))
    ref = list(Engine(lm, n_slots=1).generate(short, SamplingParams(temperature=0), 8))
    eng.graphs = DecodeGraphs(lm.model, eng.kv, slot=0)
    assert list(eng.generate(short, SamplingParams(temperature=0), 8)) == ref


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager(hf_and_gguf):
    _, path = hf_and_gguf("qwen3moe")
    ids = torch.randint(0, 1001, (245,), generator=torch.Generator().manual_seed(4)).tolist()
    assert _run(path, "cuda", True, ids) == _run(path, "cuda", False, ids)


def _concurrent(path, device, graphs, prompts, n=12):
    """Greedy outputs of several sequences decoded together (one engine step decodes all of them)."""
    from strata.engine.engine import Sequence

    cfg = EngineConfig(device=device, dtype="float32", cuda_graphs=graphs)
    eng = Engine(load_model(str(path), cfg), n_slots=len(prompts))
    seqs = [Sequence(list(p), SamplingParams(temperature=0), n, set()) for p in prompts]
    for s in seqs:
        eng.add(s, reuse_prefix=False)
    while any(not s.finished for s in seqs):
        eng.step()
    return eng, [s.output for s in seqs]


@pytest.mark.parametrize("family", ["qwen3moe", "llama"])
def test_batched_static_decode_equals_dynamic(family, hf_and_gguf):
    """Three sequences at different positions (one crossing the first window) in one static step."""
    _, path = hf_and_gguf(family)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 1001, (n,), generator=g).tolist() for n in (20, 250, 97)]
    eng, got = _concurrent(path, "cpu", True, prompts)
    assert eng.graph_batch == 3 and eng.graphs is not None
    assert got == _concurrent(path, "cpu", False, prompts)[1]


@pytest.mark.gpu
def test_cuda_batched_graphs_equal_eager(hf_and_gguf):
    _, path = hf_and_gguf("qwen3moe")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 1001, (n,), generator=g).tolist() for n in (20, 250, 97)]
    eng, got = _concurrent(path, "cuda", True, prompts)
    assert len(eng.graphs.graphs) >= 2  # batch sizes 3 (and 2, 1 as sequences finish) captured
    assert got == _concurrent(path, "cuda", False, prompts)[1]


def test_captured_sets_are_bounded_least_recently_used_first(hf_and_gguf, monkeypatch):
    import strata.engine.graphs as graphs

    _, path = hf_and_gguf("qwen3moe")
    lm = load_model(str(path), EngineConfig(device="cpu", dtype="float32"))
    g = graphs.DecodeGraphs(lm.model, Engine(lm, n_slots=1).kv)
    monkeypatch.setattr(graphs, "MAX_CAPTURES", 3)
    for i in range(3):
        g.remember(((i,), 256), ([], None))
    g.graphs.move_to_end(((0,), 256))  # used again: the oldest is now (1,)
    g.remember(((9,), 256), ([], None))
    assert list(g.graphs) == [((2,), 256), ((0,), 256), ((9,), 256)]


@pytest.mark.gpu
def test_graphed_bf16_step_with_split_attention_matches_sdpa(hf_and_gguf, monkeypatch):
    """bf16 decode replays the split-key attention kernel; its logits match the same step through SDPA."""
    from strata.engine.engine import Sequence
    from strata.engine.graphs import DecodeGraphs
    from strata.ops import decode_attention

    _, path = hf_and_gguf("qwen3moe")
    lm = load_model(str(path), EngineConfig(device="cuda", dtype="bfloat16", cuda_graphs=True))
    eng = Engine(lm, n_slots=1)
    ids = torch.randint(0, 1001, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    seq = Sequence(ids, SamplingParams(temperature=0), 1, set())
    eng.add(seq, reuse_prefix=False)
    while not seq.finished:
        eng.step()
    assert decode_attention.available()
    split = DecodeGraphs(lm.model, eng.kv, slot=0).step(ids[-1], len(ids)).float().clone()
    monkeypatch.setenv("STRATA_DECODE_ATTN", "sdpa")
    sdpa = DecodeGraphs(lm.model, eng.kv, slot=0).step(ids[-1], len(ids)).float()
    assert ((split - sdpa).abs().max() / sdpa.abs().max()).item() < 3e-2
    assert split.argmax().item() == sdpa.argmax().item()


def test_capture_runs_with_the_collector_paused():
    """No cycle is collected during a capture (its pinned buffers would be freed mid-capture), and the collector is
    as it was found afterwards."""
    import gc

    from strata.engine.graphs import collector_paused

    freed = []

    class Cycle:
        def __init__(self):
            self.me = self

        def __del__(self):
            freed.append(True)

    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        Cycle()
        for _ in range(3000):  # (allocations that would trigger a collection)
            [[] for _ in range(10)]
        assert freed == []
    assert gc.isenabled()
    gc.collect()
    assert freed == [True]
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # (left as it was found)
    finally:
        gc.enable()
