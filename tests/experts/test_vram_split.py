"""The VRAM split: how a --vram-gb budget divides between the context, dense weights, KV, the prefill chunk, the
chunk and staging rings, the expert cache and the reserve. `strata check` and the engine size it with the same
functions (strata.experts.sizing), so for the same byte counts they give the same split."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from strata.cli import main
from strata.config import EngineConfig, ExpertConfig
from strata.engine.engine import Engine
from strata.engine.loader import load_model
from strata.experts.cache import budget_slots
from strata.experts.sizing import (VramSplit, lent_slots, prefill_bytes_per_token, prefill_chunk_for, prefill_left,
                                   split_budget, staging_slots)
from strata.hub.check import CUDA_CONTEXT_ESTIMATE, VRAM_RESERVE, fit, model_footprint
from strata.hub.machine import CPUInfo, MachineInfo
from tests.experts.tiered_model import write_moe_gguf

GiB, MiB = 1 << 30, 1 << 20
CTX = 1024
K = 2


def _parts_sum(s: VramSplit) -> int:
    return sum(getattr(s, p) for p in s.PARTS)


def _machine() -> MachineInfo:
    return MachineInfo([], "none", 64 * GiB, 64 * GiB, CPUInfo("cpu", 8, 16), "/", 100 * GiB)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_moe_gguf(tmp_path_factory.mktemp("vram") / "moe.gguf", n_experts=8, k=K)


@pytest.fixture(scope="module")
def store(model_path):
    cfg = EngineConfig(model=str(model_path), device="cpu", dtype="float32", experts=ExpertConfig(mode="tiered"))
    return load_model(str(model_path), cfg, with_tokenizer=False).model.experts.store


@pytest.mark.parametrize("budget", [1 * GiB, 3 * GiB, 8 * GiB, 80 * GiB])
def test_the_split_adds_up_to_the_budget(budget):
    s = split_budget(budget, context=900 * MiB, dense=int(1.5 * GiB), kv=2 * GiB, other=30 * MiB,
                     reserve=VRAM_RESERVE, staging=16 * 3 * MiB, prefill=GiB, expert_bytes=3 * MiB,
                     per_slot=48 * 3 * MiB, n_experts=128)
    assert _parts_sum(s) == budget
    assert s.cache == s.slots * 48 * 3 * MiB and 0 <= s.slots <= 128
    assert s.cache_share == pytest.approx(s.cache / budget)
    if s.slots < 128:  # less than one more slot in every layer is left over (negative: the budget is short)
        assert s.unused < 48 * 3 * MiB
    d = s.as_dict()
    assert d["budget_gib"] == pytest.approx(budget / GiB, abs=1e-3) and d["slots_per_layer"] == s.slots
    assert sum(d[f"{p}_gib"] for p in s.PARTS) == pytest.approx(budget / GiB, abs=0.01)
    # itemizing the KV cache out of what torch held keeps the sum
    t = split_budget(budget, context=900 * MiB, dense=int(3.5 * GiB), other=30 * MiB, reserve=VRAM_RESERVE,
                     staging=16 * 3 * MiB, prefill=GiB, expert_bytes=3 * MiB, per_slot=48 * 3 * MiB, n_experts=128)
    assert t.itemized(2 * GiB, prefill_chunk=4096) == dataclasses.replace(s, prefill_chunk=4096)


def test_a_budget_below_what_is_held_gets_no_slots():
    s = split_budget(GiB, context=GiB, dense=GiB, reserve=VRAM_RESERVE, staging=MiB, prefill=0, expert_bytes=MiB,
                     per_slot=4 * MiB, n_experts=8)
    assert s.slots == 0 and s.cache == 0 and s.unused < 0 and _parts_sum(s) == GiB


def _held(fp):
    """The bytes a GPU would hold before the cache as check counts them: (context, dense, KV); the input
    embedding of a MoE model with its own head is read from host RAM under a budget."""
    assert fp.embed_bytes > 0 and fp.n_expert  # the test model has its own head: the host path is what is checked
    return CUDA_CONTEXT_ESTIMATE, fp.dense_bytes - fp.embed_bytes, fp.kv_bytes_per_token * CTX


@pytest.mark.parametrize("extra", [-MiB, 0, 200_000, 400_000, 10 * MiB])
def test_check_and_the_engine_split_a_budget_alike(model_path, store, monkeypatch, extra):
    """For the same byte counts (the engine's measured on a GPU: given here, as a CPU has no VRAM to measure),
    `strata check`'s fit and the engine's budget_slots give the same split and the same slots."""
    fp = model_footprint([model_path])
    context, dense, kv = _held(fp)
    bpt = prefill_bytes_per_token(fp.d_model, K)
    staging = staging_slots(K) * fp.slot_bytes
    fixed = context + dense + kv + VRAM_RESERVE + staging
    budget = fixed + prefill_chunk_for(prefill_left(fixed + extra, context + dense + kv, VRAM_RESERVE), bpt) * bpt
    budget += extra
    f = fit(fp, _machine(), CTX, vram_budget=budget)
    assert f.vram_split is not None and _parts_sum(f.vram_split) == budget
    assert (f.vram_split.context, f.vram_split.dense, f.vram_split.kv) == (context, dense, kv)
    assert f.slots == f.vram_split.slots

    # the engine on a GPU: mem_get_info counts the context and torch's tensors (dense weights and KV) as in use
    total = 80 * GiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - (context + dense + kv), total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: dense + kv)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: dense + kv)
    chunk = prefill_chunk_for(prefill_left(budget, context + dense + kv, VRAM_RESERVE), bpt)  # Engine._vram_left
    assert chunk == f.prefill_chunk
    cfg = ExpertConfig(mode="tiered", vram_gb=budget / GiB)
    slots, chunk_experts, split = budget_slots(cfg, store, torch.device("cuda"), staging_slots(K), chunk * bpt)
    # (the engine sets its lent slots once its cache is laid out: tests/experts/test_prefill_loan.py)
    engine_split = split.itemized(kv, chunk)
    assert dataclasses.replace(engine_split, lent_slots=f.vram_split.lent_slots) == f.vram_split
    assert f.vram_split.lent_slots == lent_slots(engine_split, fp.n_moe_layers, fp.expert_bytes // fp.n_expert)
    assert (slots, chunk_experts) == (f.slots, f.vram_split.chunk_experts)
    if extra == 400_000:
        assert 0 < slots < fp.n_expert  # some slots, not all: the test sizes a real partial cache


def test_the_engine_logs_and_keeps_its_split(model_path, caplog):
    """On a CPU the pool is in RAM and --vram-gb less the reserve sizes it as on a GPU: the engine still reports
    the split, and its slots are the cache's."""
    fp = model_footprint([model_path])
    per_slot = fp.expert_bytes // fp.n_expert
    budget = VRAM_RESERVE + staging_slots(K) * fp.slot_bytes + 5 * per_slot + 1000
    cfg = EngineConfig(model=str(model_path), device="cpu", dtype="float32",
                       experts=ExpertConfig(mode="tiered", vram_gb=budget / GiB, cpu_plan="011"))
    with caplog.at_level(logging.INFO, logger="strata"):
        eng = Engine(load_model(str(model_path), cfg, with_tokenizer=False), n_slots=1)
    s = eng.vram_split
    assert s is not None and _parts_sum(s) == budget and s.slots == 5
    assert eng.model.experts.cache.slots == 5 and s.cache == 5 * per_slot
    assert (s.context, s.dense, s.kv, s.chunk_buffers) == (0, 0, 0, 0)  # all of that is in RAM on a CPU
    line = next(r.getMessage() for r in caplog.records if "slots per layer" in r.getMessage())
    assert line.startswith("strata: VRAM ") and "expert cache" in line and "5 of 8 slots per layer" in line


def test_no_split_without_a_budget(model_path):
    cfg = EngineConfig(model=str(model_path), device="cpu", dtype="float32",
                       experts=ExpertConfig(mode="tiered", slots=3))
    assert Engine(load_model(str(model_path), cfg, with_tokenizer=False), n_slots=1).vram_split is None


def test_check_cli_prints_the_split(model_path, capsys):
    assert main(["check", "-m", str(model_path), "--vram-gb", "4", "-c", str(CTX)]) == 0
    text = capsys.readouterr().out
    assert "VRAM split" in text
    for label in ("CUDA context", "dense weights", "KV cache", "prefill activations", "staging ring",
                  "expert cache", "reserve", "budget"):
        assert label in text, label
    assert "8 of 8 slots per layer" in text
    assert main(["check", "-m", str(model_path), "--vram-gb", "4", "-c", str(CTX), "--json"]) == 0
    split = json.loads(capsys.readouterr().out)["fit"]["vram_split"]
    assert split["budget_gib"] == 4.0 and split["slots_per_layer"] == 8 and split["n_experts"] == 8
    parts = sum(split[f"{p}_gib"] for p in VramSplit.PARTS)
    assert parts == pytest.approx(4.0, abs=0.01)
