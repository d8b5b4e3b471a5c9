"""Every family runs over a q8_0 KV cache (-ctk q8_0 -ctv q8_0; MLA's latent cache too): logits close to the
float32 cache's, the same first greedy tokens, and the static-shape decode step (CUDA graphs) equal to eager."""

import pytest
import torch

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.loader import forward_all, load_model
from strata.engine.sampler import SamplingParams
from strata.kv.cache import Segment

FAMILIES = ["qwen3moe", "qwen3", "mixtral", "llama", "deepseek_v3", "deepseek_v3_noqlora", "glm4moe",
            "glm4moe_noqknorm", "gpt_oss", "qwen3next"]
Q8 = dict(device="cpu", dtype="float32", cache_type_k="q8_0", cache_type_v="q8_0")
# Q8_0 moves each cached value by at most amax/254 of its block of 32 (under 0.5% of a row's largest value).
# Through these tiny random-weight models that shifts a position's logits by about 1% of their range (the median
# over positions is held to 2%). A MoE router's top-k is discontinuous: where two experts' scores nearly tie, the
# perturbation swaps one for a token, and that position's logits jump by more (up to ~10% here), so the worst
# position gets a looser bound. A cache read back wrongly (a scale off, nibbles swapped) misses both by far.
MEDIAN_TOL, MAX_TOL = 2e-2, 0.2
# greedy tokens that must match the float32 cache's: random weights give near-ties (two logits within the
# cache's error) a few tokens in, where the two may part
FIRST_SAME = 2


def _prompt(n, seed):
    return torch.randint(0, 1001, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_family_runs_with_q8_0_cache(family, hf_and_gguf):
    _, path = hf_and_gguf(family)
    lm = load_model(str(path), EngineConfig(**Q8))
    ids = _prompt(40, 5)
    ref = forward_all(lm, ids)  # the float32 cache
    kv = lm.model.new_kv_cache(1, lm.max_ctx, torch.float32, *lm.cfg.kv_cache_types)
    assert kv.quantized
    got = lm.model.forward(torch.tensor(ids), torch.arange(len(ids)), [Segment(0, 0, len(ids))], kv, all_logits=True)
    per = (got - ref).abs().amax(-1) / ref.abs().max()  # each position's worst logit, relative to the range
    assert 0 < per.median() <= MEDIAN_TOL and per.max() <= MAX_TOL, f"{family}: {per.median():.2e}, {per.max():.2e}"
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    eng = Engine(lm, prefill_chunk=7)  # chunked prefill and decode both read the quantized cache
    assert eng.kv.quantized and eng.kv.nbytes < Engine(load_model(str(path), EngineConfig(
        device="cpu", dtype="float32"))).kv.nbytes
    q8 = list(eng.generate(ids, SamplingParams(temperature=0), max_tokens=8))
    f32 = list(Engine(load_model(str(path), EngineConfig(device="cpu", dtype="float32")), prefill_chunk=7).generate(
        ids, SamplingParams(temperature=0), max_tokens=8))
    assert len(q8) == 8 and q8[:FIRST_SAME] == f32[:FIRST_SAME]


def _run(path, device, graphs, ids, n=24, **kv):
    cfg = EngineConfig(device=device, dtype="float32", cuda_graphs=graphs, **kv)
    eng = Engine(load_model(str(path), cfg), n_slots=1)
    assert (eng.graphs is not None) == graphs and eng.kv.quantized == bool(kv)
    return list(eng.generate(ids, SamplingParams(temperature=0), n))


@pytest.mark.parametrize("family,types,n", [("qwen3moe", ("q8_0", "q8_0"), 245), ("deepseek_v3", ("q8_0", "q8_0"), 245),
                                            ("gpt_oss", ("q8_0", "f16"), 200)])
def test_static_decode_equals_dynamic_with_q8_0(family, types, n, hf_and_gguf):
    """(gpt-oss: sinks and sliding windows, with a K/V mix; its fixture's context is 256 tokens)"""
    _, path = hf_and_gguf(family)
    ids = _prompt(n, 4)  # 245 + 24 crosses the first window (256): both windows are exercised
    kv = dict(cache_type_k=types[0], cache_type_v=types[1])
    assert _run(path, "cpu", True, ids, **kv) == _run(path, "cpu", False, ids, **kv)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3moe", "deepseek_v3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decode_equals_eager_with_q8_0(family, dtype, hf_and_gguf):
    _, path = hf_and_gguf(family)
    ids = _prompt(245, 4)

    def run(graphs):
        cfg = EngineConfig(device="cuda", dtype=dtype, cuda_graphs=graphs, cache_type_k="q8_0", cache_type_v="q8_0")
        eng = Engine(load_model(str(path), cfg), n_slots=1)
        assert (eng.graphs is not None) == graphs and eng.kv.quantized
        return list(eng.generate(ids, SamplingParams(temperature=0), 24))

    graphed, eager = run(True), run(False)
    if dtype == "float32":
        assert graphed == eager
    else:  # the graph attends over a masked power-of-two window, eager over the exact length: bf16 sums round
        # differently and a near-tie of this random model may flip late (seen at token 13); a wrong read of the
        # quantized cache diverges at once
        assert graphed[:8] == eager[:8]


@pytest.mark.parametrize("family", ["qwen3moe", "deepseek_v3", "qwen3next"])
def test_check_plans_the_bytes_the_engine_allocates(family, hf_and_gguf):
    """`strata check -ctk/-ctv` counts per token what the engine's cache of those types holds."""
    from strata.hub.check import model_footprint

    _, path = hf_and_gguf(family)
    lm = load_model(str(path), EngineConfig(device="cpu", dtype="float32", cache_type_k="q8_0", cache_type_v="q4_0"))
    kv = Engine(lm).kv
    per_token = lm.model.kv_bytes_per_token(torch.float32, "q8_0", "q4_0")
    assert model_footprint([path], "q8_0", "q4_0").kv_bytes_per_token == per_token
    assert kv.nbytes - (kv.recurrent.nbytes if kv.recurrent is not None else 0) == per_token * lm.max_ctx
