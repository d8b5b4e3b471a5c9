"""--expert-routing uniform (a benchmark switch): every MoE layer sends each token to k distinct random experts with
equal weights, in eager steps and in the static graph-piece steps that CUDA graphs replay, for every MoE family;
an expert cache of S slots then hits about S / experts of the time."""

from __future__ import annotations

import itertools
import logging
import math

import pytest
import torch

from strata import StrataError
from strata.bench.routing import record_routing
from strata.config import EngineConfig, ExpertConfig
from strata.engine.engine import Engine
from strata.engine.loader import forward_all, load_model
from strata.engine.sampler import SamplingParams
from strata.layers.moe import Routing, uniform_route
from tests.experts.tiered_model import write_moe_gguf

PROMPT = [5, 17, 3, 88, 41]
DECODE = 200  # tokens decoded in the hit-rate tests: enough lookups that the rate's spread is ~0.01


def chi2_critical(df: int, z: float = 3.72) -> float:
    """The chi-square quantile at the normal quantile z (3.72: p = 1e-4), by Wilson-Hilferty (no scipy)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2(counts: torch.Tensor) -> float:
    """Pearson's statistic of counts against equal expected counts."""
    counts = counts.double()
    e = counts.sum() / counts.numel()
    return float(((counts - e) ** 2 / e).sum())


def check_uniform_ids(ids: torch.Tensor, n_experts: int, k: int) -> None:
    """ids [N, k]: k distinct experts per row, in range, each expert (and each pair) about equally often."""
    assert ids.dtype == torch.int64 and ids.shape[1] == k
    assert int(ids.min()) >= 0 and int(ids.max()) < n_experts
    srt = ids.sort(dim=-1).values
    assert bool((srt[:, 1:] != srt[:, :-1]).all()), "an expert was picked twice for one token"
    per_expert = torch.bincount(ids.reshape(-1), minlength=n_experts)
    assert chi2(per_expert) < chi2_critical(n_experts - 1), per_expert.tolist()
    if k == 2:  # which pairs come up: an implementation drawing correlated experts (e, e+1) fails here
        pair = srt[:, 0] * n_experts + srt[:, 1]
        pairs = torch.bincount(pair, minlength=n_experts * n_experts)
        keep = torch.tensor([a * n_experts + b for a, b in itertools.combinations(range(n_experts), 2)])
        assert chi2(pairs[keep]) < chi2_critical(len(keep) - 1)


@pytest.mark.parametrize("n_experts,k", [(8, 2), (128, 8), (4, 4)])
def test_uniform_route_draws_k_distinct_experts_uniformly(n_experts, k):
    torch.manual_seed(0)
    n = 20000
    ids, w = uniform_route(n, Routing(n_experts, k), torch.device("cpu"))
    assert ids.shape == (n, k) and w.shape == (n, k) and w.dtype == torch.float32
    check_uniform_ids(ids, n_experts, k)
    assert torch.allclose(w.sum(-1), torch.ones(n)) and bool((w == 1.0 / k).all())
    again, _ = uniform_route(n, Routing(n_experts, k), torch.device("cpu"))
    if k < n_experts:
        assert not torch.equal(again.sort(-1).values, ids.sort(-1).values), "the same draw twice"


def test_the_statistic_catches_a_broken_draw():
    """The checks above are not vacuous: always the same experts, or a fixed neighbour, fail them."""
    n = 20000
    with pytest.raises(AssertionError):
        check_uniform_ids(torch.tensor([[0, 1]]).repeat(n, 1), 8, 2)
    first = torch.randint(0, 8, (n,), generator=torch.Generator().manual_seed(1))
    with pytest.raises(AssertionError):
        check_uniform_ids(torch.stack([first, (first + 1) % 8], 1), 8, 2)


@pytest.mark.parametrize("family", ["qwen3moe", "mixtral", "deepseek_v3"])
def test_every_family_routes_uniformly(family, hf_and_gguf, caplog):
    """A whole forward of each MoE family (softmax, renormalised, grouped sigmoid with a routed scale): the ids every
    MoE layer hands its experts backend are uniform draws, not the router's, and the model says so at load."""
    _, path = hf_and_gguf(family)
    prompt = torch.randint(0, 1001, (400,), generator=torch.Generator().manual_seed(3)).tolist()

    def trace(routing):
        cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", experts=ExpertConfig(routing=routing))
        lm = load_model(str(path), cfg, with_tokenizer=False)
        with record_routing(lm.model) as tr:
            logits = forward_all(lm, prompt)
        return tr, logits, lm.args

    with caplog.at_level(logging.WARNING, logger="strata"):
        torch.manual_seed(0)
        uni, uni_logits, args = trace("uniform")
    loud = [r for r in caplog.records if "--expert-routing uniform" in r.getMessage()]
    assert len(loud) == 1 and "NOT the model's" in loud[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="strata"):
        model, model_logits, _ = trace("model")
    assert not [r for r in caplog.records if "expert-routing" in r.getMessage()]
    e, k = args.n_experts, args.n_experts_used
    assert uni.layers == model.layers and uni.layers
    pooled = torch.cat([torch.from_numpy(uni.ids[layer]) for layer in uni.layers])
    check_uniform_ids(pooled, e, k)
    # the router's choice is dropped: a token's set equals the router's about 1 / C(E, k) of the time
    same = sum(int((torch.from_numpy(uni.ids[la]).sort(-1).values == torch.from_numpy(model.ids[la]).sort(-1).values)
                   .all(-1).sum()) for la in uni.layers)
    assert same / len(pooled) < 2.0 / math.comb(e, k)
    assert not torch.allclose(uni_logits, model_logits)  # it changes what the model says


def test_a_bad_routing_is_one_clear_error():
    with pytest.raises(StrataError, match="--expert-routing must be one of model, uniform"):
        ExpertConfig(routing="random").validate()


def test_the_flag_reaches_the_config():
    import argparse

    from strata.engine.cli import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args(["--device", "cpu"])).experts.routing == "model"
    assert engine_config(p.parse_args(["--device", "cpu", "--expert-routing", "uniform"])).experts.routing == "uniform"
    assert "--expert-routing" in p.format_help()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_moe_gguf(tmp_path_factory.mktemp("uniform") / "moe.gguf", n_experts=8, k=2)


def _hit_rate(path, routing: str, graphs: bool, device: str = "cpu", slots: int = 2):
    """Greedy decode of DECODE tokens with a tiered cache of `slots` of 8 experts: (engine, hit rate, output)."""
    # (no loans: on a GPU the prefill chunk buffers and activations are lent to the cache as extra slots between
    # prompts by default, which would hold all 8 experts and hit ~always whatever the routing)
    cfg = EngineConfig(model=str(path), device=device, dtype="float32", cuda_graphs=graphs,
                       experts=ExpertConfig(mode="tiered", slots=slots, routing=routing, chunk_loan="off",
                                            prefill_loan="off"))
    eng = Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=1)
    torch.manual_seed(0)
    out = list(eng.generate(PROMPT, SamplingParams(temperature=0), DECODE))
    s = eng.model.experts.stats
    assert s.hits + s.cpu + s.pcie == s.lookups == (len(PROMPT) + DECODE - 1) * 3 * 2
    return eng, s.hits / s.lookups, out


@pytest.fixture(scope="module")
def model_rate(model_path):
    return _hit_rate(model_path, "model", False)[1]


@pytest.mark.parametrize("graphs", [False, True])
def test_uniform_routing_holds_the_cache_to_slots_over_experts(model_path, model_rate, graphs):
    """2 slots of 8 experts: under uniform routing the hit rate is about 2/8 whatever the cache learns (a draw
    frozen across static steps would let it learn them all), and the model's own routing gives another rate."""
    eng, rate, out = _hit_rate(model_path, "uniform", graphs)
    assert (eng.graphs is not None) == graphs
    if graphs:  # the decode steps took the graph-piece path (its static buffers exist for every MoE layer)
        assert len(eng.model.experts.graphed.bufs) == 3
    assert len(out) == DECODE
    assert abs(rate - 2 / 8) < 0.06, rate
    assert abs(model_rate - rate) > 0.1, (model_rate, rate)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["tiered", "resident"])
def test_cuda_graphs_replay_fresh_uniform_draws(model_path, mode):
    """On CUDA the draw is captured inside the decode graphs: each replay must draw anew (the generator's offset
    advances per replay), which the tiered cache's hit rate shows: frozen ids would be learned and hit ~always."""
    if mode == "tiered":
        eng, rate, out = _hit_rate(model_path, "uniform", True, device="cuda")
        assert abs(rate - 2 / 8) < 0.06, rate
    else:
        cfg = EngineConfig(model=str(model_path), device="cuda", dtype="float32", cuda_graphs=True,
                           experts=ExpertConfig(mode="resident", routing="uniform"))
        eng = Engine(load_model(str(model_path), cfg, with_tokenizer=False), n_slots=1)
        out = list(eng.generate(PROMPT, SamplingParams(temperature=0), DECODE))
        ref = Engine(load_model(str(model_path), EngineConfig(model=str(model_path), device="cuda", dtype="float32",
                                                              cuda_graphs=True, experts=ExpertConfig(mode="resident")),
                                with_tokenizer=False), n_slots=1)
        assert out != list(ref.generate(PROMPT, SamplingParams(temperature=0), DECODE))
    assert eng.graphs is not None and eng.graphs.graphs, "no graph was captured"
    assert len(out) == DECODE
