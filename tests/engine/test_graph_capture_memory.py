"""A decode step whose CUDA-graph capture does not fit the VRAM budget: older captures make room once, and a step
that still does not fit runs eagerly (same text) while the engine keeps its graphs for the other steps."""

import pytest
import torch

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.graphs import DecodeGraphs
from strata.engine.loader import load_model
from strata.engine.sampler import SamplingParams


def _graphs(path):
    lm = load_model(str(path), EngineConfig(device="cpu", dtype="float32"))
    eng = Engine(lm, n_slots=1)
    return DecodeGraphs(lm.model, eng.kv, slot=0)


def test_a_capture_out_of_memory_drops_older_ones_then_is_not_retried(hf_and_gguf, monkeypatch):
    _, path = hf_and_gguf("qwen3moe")
    g = _graphs(path)
    for w in (256, 512, 1024, 2048):
        g.graphs[((0,), w)] = ("pieces", "logits", None)
    calls = []

    def fails_then_fits(key):
        calls.append(key)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("no room")
        return ("pieces", "logits", None)

    monkeypatch.setattr(g, "_capture_once", fails_then_fits)
    g._capture(((0,), 4096))
    assert calls == [((0,), 4096)] * 2
    assert list(g.graphs) == [((0,), 1024), ((0,), 2048)]  # the two least recently used went (and the new one
    assert g.dropped_for_memory == 2                        # is remembered by the caller's step_batch)

    def never_fits(key):
        calls.append(key)
        raise torch.OutOfMemoryError("no room")

    monkeypatch.setattr(g, "_capture_once", never_fits)
    calls.clear()
    with pytest.raises(torch.OutOfMemoryError):
        g._capture(((0,), 8192))
    assert len(calls) == 2 and ((0,), 8192) in g.no_room
    calls.clear()
    with pytest.raises(torch.OutOfMemoryError):  # known not to fit: not tried again
        g._capture(((0,), 8192))
    assert calls == []


def test_a_step_whose_capture_does_not_fit_runs_eagerly_and_keeps_the_graphs(hf_and_gguf, monkeypatch):
    _, path = hf_and_gguf("qwen3moe")
    ids = torch.randint(0, 1001, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    lm = load_model(str(path), EngineConfig(device="cpu", dtype="float32", cuda_graphs=False))
    ref = list(Engine(lm, n_slots=1).generate(ids, SamplingParams(temperature=0), 12))

    eng = Engine(load_model(str(path), EngineConfig(device="cpu", dtype="float32", cuda_graphs=True)), n_slots=1)
    assert eng.graphs is not None
    tried = []

    def no_room(*a, **k):
        tried.append(a)
        raise torch.OutOfMemoryError("no VRAM for the capture")

    monkeypatch.setattr(eng.graphs, "step_batch", no_room)
    monkeypatch.setattr(eng.graphs, "captured", lambda *a, **k: False)
    assert list(eng.generate(ids, SamplingParams(temperature=0), 12)) == ref
    assert tried and eng.graphs is not None


def test_a_step_launched_ahead_whose_capture_does_not_fit_is_left_to_the_scheduler(hf_and_gguf, monkeypatch):
    _, path = hf_and_gguf("qwen3moe")
    ids = torch.randint(0, 1001, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    lm = load_model(str(path), EngineConfig(device="cpu", dtype="float32", cuda_graphs=False))
    ref = list(Engine(lm, n_slots=1).generate(ids, SamplingParams(temperature=0), 10))

    cfg = EngineConfig(device="cpu", dtype="float32", cuda_graphs=True, decode_ahead=True)
    eng = Engine(load_model(str(path), cfg), n_slots=1)
    assert eng.ahead is not None
    real, refused = eng.graphs.step_batch, []

    def ahead_does_not_fit(tokens, *a, **k):
        if isinstance(tokens, torch.Tensor):  # (a step launched ahead takes its tokens on the device)
            refused.append(1)
            raise torch.OutOfMemoryError("no VRAM for the capture")
        return real(tokens, *a, **k)

    monkeypatch.setattr(eng.graphs, "step_batch", ahead_does_not_fit)
    assert list(eng.generate(ids, SamplingParams(temperature=0), 10)) == ref
    assert refused and eng.ahead.launched == 0
