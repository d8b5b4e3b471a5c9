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
