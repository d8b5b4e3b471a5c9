"""Under a --vram-gb budget, a long prompt arriving while another sequence decodes: the process stays inside the
budget (torch's allocator held to it: strata.experts.cache.cap_to_budget), nothing fails, and both texts are what
each gives alone. GPU only (the budget is VRAM's)."""

from __future__ import annotations

import gc

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata.config import EngineConfig, ExpertConfig
from strata.engine.engine import Engine, Sequence
from strata.engine.loader import load_model
from strata.engine.sampler import SamplingParams
from tests.experts.tiered_model import write_moe_gguf

pytestmark = pytest.mark.gpu
CTX = 8192


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    # 64 experts of 1024 x 512 Q8_0 in 4 layers (~0.3 GiB of experts): a budget a little over the CUDA context
    # holds only part of them
    return write_moe_gguf(tmp_path_factory.mktemp("budget") / "moe.gguf", n_layers=4, d=1024, ff=512, n_experts=64,
                          k=4, heads=8, kv_heads=2, head_dim=128, expert_type=Q.Q8_0, ctx=CTX)


def _engine(path, budget_gb: float | None) -> Engine:
    ex = ExpertConfig(mode="tiered", vram_gb=budget_gb) if budget_gb else ExpertConfig(mode="resident")
    cfg = EngineConfig(model=str(path), device="cuda", dtype="float32", ctx_size=CTX, experts=ex)
    return Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=2)


def test_a_long_prompt_arriving_while_another_decodes_stays_in_the_budget(model_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(0)
    short = torch.randint(0, 96, (40,), generator=g).tolist()
    long = torch.randint(0, 96, (CTX - 64,), generator=g).tolist()
    sp = SamplingParams(temperature=0)
    alone = [list(_engine(model_path, None).generate(p, sp, 24)) for p in (short, long)]
    gc.collect()  # (those engines hold reference cycles: their VRAM is not "held" by what is measured next)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    held = (total - free) / 2**30  # the CUDA context and whatever else this process holds already
    # (what torch's allocator holds of that: the peak below counts it too, so the bound adds it)
    reserved_before = torch.cuda.memory_reserved() / 2**30
    budget = held + 0.45
    eng = _engine(model_path, budget)
    assert eng.vram_split is not None and 0 < eng.model.experts.cache.slots < 64
    torch.cuda.reset_peak_memory_stats()
    a = Sequence(list(short), sp, 24, set())
    b = Sequence(list(long), sp, 24, set())
    eng.add(a, reuse_prefix=False)
    for _ in range(6):  # a decodes a few tokens first
        eng.step()
    eng.add(b, reuse_prefix=False)  # the long prompt's chunks run beside a's decode steps
    while eng.running:
        eng.step()
    assert [a.output, b.output] == alone
    free, total = torch.cuda.mem_get_info()
    assert (total - free) / 2**30 <= budget + 0.05, ("the process grew past its budget", (total - free) / 2**30)
    assert torch.cuda.max_memory_reserved() / 2**30 <= reserved_before + budget - held + 0.05
