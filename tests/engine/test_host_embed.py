"""The input embedding table in host RAM (`--host-embed`, on by default for tiered experts under a VRAM budget):
eager steps gather their rows on the host, captured decode steps read them inside the graph from the token ids in
device memory (strata.ops.host_rows; pinned host RAM on a GPU), so decode steps can be launched ahead. Both must
decode exactly what the table on the compute device does."""

from __future__ import annotations

import pytest
import torch

from strata.config import EngineConfig, ExpertConfig
from strata.engine.engine import Engine
from strata.engine.loader import _host_embed, embed_on_host, load_model
from strata.engine.sampler import SamplingParams
from tests.experts.tiered_model import write_moe_gguf

PROMPT = [5, 17, 3, 88, 41, 41, 9, 60, 2, 33, 71, 14]


@pytest.fixture(scope="module", params=["F32", "Q8_0"])
def model_path(tmp_path_factory, request):
    import gguf

    return write_moe_gguf(tmp_path_factory.mktemp("host_embed") / "moe.gguf", n_experts=8, k=2,
                          embed_type=gguf.GGMLQuantizationType[request.param])


def _tokens(path, device: str, graphs: bool, host: bool | None, **ex) -> tuple[list[int], object]:
    cfg = EngineConfig(model=str(path), device=device, dtype="float32", cuda_graphs=graphs, host_embed=host,
                       experts=ExpertConfig(**ex))
    lm = load_model(str(path), cfg, with_tokenizer=False)
    if host and device == "cpu":  # on the CPU the table is on the host already: take the host path anyway
        embed_on_host(lm.model, lm.gguf)
    eng = Engine(lm, n_slots=1)
    return list(eng.generate(PROMPT, SamplingParams(temperature=0), 16)), eng


@pytest.mark.parametrize("graphs", [False, True])
def test_host_rows_decode_like_the_table_on_the_device(model_path, graphs):
    ref, _ = _tokens(model_path, "cpu", graphs, False, mode="tiered", slots=3, cpu_plan="012")
    got, eng = _tokens(model_path, "cpu", graphs, True, mode="tiered", slots=3, cpu_plan="012")
    assert eng.model.host_embed and got == ref
    if graphs:  # the static step read its rows itself, and steps were launched ahead
        assert eng.graphs is not None and eng.graphs.host_rows and eng.ahead.launched > 0


def test_default_follows_the_budget(model_path):
    lm = load_model(str(model_path), EngineConfig(model=str(model_path), device="cpu", dtype="float32"),
                    with_tokenizer=False)
    cuda_like = type("M", (), {"device": torch.device("cuda"), "head": lm.model.head, "embed": lm.model.embed})()
    tight = EngineConfig(device="cpu", experts=ExpertConfig(mode="tiered", vram_gb=8))
    assert _host_embed(tight, cuda_like)
    assert not _host_embed(EngineConfig(device="cpu", experts=ExpertConfig(mode="resident")), cuda_like)
    assert not _host_embed(EngineConfig(device="cpu", host_embed=False, experts=ExpertConfig(mode="tiered",
                                                                                             vram_gb=8)), cuda_like)
    tied = type("M", (), {"device": torch.device("cuda"), "head": lm.model.embed, "embed": lm.model.embed})()
    assert not _host_embed(tight, tied)  # the table is the head too
    assert not _host_embed(tight, lm.model)  # on the CPU there is nothing to move


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_cuda_host_embed_equals_device_embed(model_path, graphs):
    assert torch.cuda.is_available()
    ref, _ = _tokens(model_path, "cuda", graphs, False, mode="tiered", slots=3, cpu_plan="012")
    got, eng = _tokens(model_path, "cuda", graphs, True, mode="tiered", slots=3, cpu_plan="012")
    assert eng.model.embed.raw.device.type == "cpu" and eng.model.embed.raw.is_pinned() and got == ref
    if graphs:
        assert eng.ahead is not None and eng.ahead.launched > 0

