"""Tiered expert execution against the all-resident oracle: same logits for every plan and cache size."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from strata import StrataError
from strata.config import EngineConfig, ExpertConfig
from strata.engine.loader import load_model
from strata.experts.plan import CostModel
from strata.experts.profile import RoutingProfile
from strata.experts.tiered import TieredExperts
from strata.kv.cache import Segment
from tests.experts.tiered_model import Q, write_moe_gguf

pytestmark = pytest.mark.exact_cpu  # float oracles: CPU qmatmul stays the float32 reference

PROMPT = [5, 17, 3, 88, 41, 41, 9, 60, 2, 33, 71, 14]
DECODE = [7, 50, 23, 91, 4, 66]
# CPU expert cheap vs PCIe dear, and the reverse: `--cpu-plan auto` must follow either
CHEAP_CPU = CostModel(cpu_ms_per_expert=0.05, pcie_ms_per_expert=1.0, gpu_ms_per_expert=0.01)
DEAR_CPU = CostModel(cpu_ms_per_expert=5.0, pcie_ms_per_expert=0.1, gpu_ms_per_expert=0.01)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_moe_gguf(tmp_path_factory.mktemp("tiered") / "moe.gguf", n_experts=8, k=2)


def _load(path, backend_kw=None, **ex):
    mode = ex.pop("mode", "tiered")
    cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", experts=ExpertConfig(mode=mode, **ex))
    if backend_kw:
        import strata.engine.loader as loader

        real = loader.make_experts_factory

        def factory(c):
            return lambda layers: TieredExperts(layers, c, progress=False, **backend_kw)

        loader.make_experts_factory = factory
        try:
            return load_model(str(path), cfg, with_tokenizer=False)
        finally:
            loader.make_experts_factory = real
    return load_model(str(path), cfg, with_tokenizer=False)


@torch.inference_mode()
def _run(lm, prompt=PROMPT, decode=DECODE) -> torch.Tensor:
    """Logits of a prefill chunk then single-token decode steps: [len(prompt) + len(decode), V]."""
    m = lm.model
    kv = m.new_kv_cache(1, 64)
    out = [m.forward(torch.tensor(prompt), torch.arange(len(prompt)), [Segment(0, 0, len(prompt))], kv,
                     all_logits=True)]
    for i, t in enumerate(decode):
        p = len(prompt) + i
        out.append(m.forward(torch.tensor([t]), torch.tensor([p]), [Segment(0, p, 1)], kv, all_logits=True))
    return torch.cat(out)


@pytest.fixture(scope="module")
def reference(model_path):
    return _run(_load(model_path, mode="resident"))


def _check_stats(ex: TieredExperts, n_tokens: int, n_layers: int = 3, k: int = 2):
    s = ex.stats
    assert s.hits + s.cpu + s.pcie == s.lookups == n_tokens * n_layers * k
    assert s.tokens == n_tokens and s.layers == n_tokens * n_layers


@pytest.mark.parametrize("plan", ["012", "000", "011", "001", "auto"])
@pytest.mark.parametrize("slots", [0, 3, 8])
def test_plans_and_cache_sizes_match_resident(model_path, reference, plan, slots):
    kw = {"cost_model": CHEAP_CPU} if plan == "auto" else None
    lm = _load(model_path, kw, slots=slots, cpu_plan=plan)
    out = _run(lm)
    assert (out - reference).abs().max().item() <= 1e-5
    ex = lm.model.experts
    n = len(PROMPT) + len(DECODE)
    _check_stats(ex, n)
    s = ex.stats
    if slots == 0:
        assert s.hits == 0 and s.swaps == 0
    if plan == "012":
        assert s.pcie == 0 and s.cpu == s.lookups - s.hits
    if plan == "000":
        assert s.cpu == 0 and s.pcie == s.lookups - s.hits
    if plan in ("011", "001") and slots == 0:
        assert s.cpu > 0 and s.pcie > 0
    if slots == 8:
        assert s.hits > 0


def test_auto_plan_follows_the_costs(model_path, reference):
    cheap = _load(model_path, {"cost_model": CHEAP_CPU}, slots=0, cpu_plan="auto")
    dear = _load(model_path, {"cost_model": DEAR_CPU}, slots=0, cpu_plan="auto")
    for lm in (cheap, dear):
        assert (_run(lm) - reference).abs().max().item() <= 1e-5
    assert str(cheap.model.experts.plan) == "012" and str(dear.model.experts.plan) == "000"
    assert cheap.model.experts.stats.cpu > dear.model.experts.stats.cpu
    assert dear.model.experts.stats.pcie > cheap.model.experts.stats.pcie


def test_auto_plan_measured_on_this_machine(model_path, reference, tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    lm = _load(model_path, slots=2, cpu_plan="auto")
    assert (_run(lm) - reference).abs().max().item() <= 1e-5
    cm = lm.model.experts.costs
    assert cm is not None and cm.cpu_ms_per_expert > 0 and math.isfinite(cm.pcie_ms_per_expert)
    assert list((tmp_path / "costs").glob("*.json")), "the measurement is cached"
    again = _load(model_path, slots=2, cpu_plan="auto")
    _run(again, decode=[])
    assert again.model.experts.costs == cm  # read back from the cache, not re-measured


def test_staging_ring_in_batches_and_lru(model_path, reference):
    # a ring of 3 slots: a prefill streaming up to 8 experts per layer goes through it in batches
    lm = _load(model_path, {"staging": 3}, slots=2, cpu_plan="000", cache_policy="lru")
    assert (_run(lm) - reference).abs().max().item() <= 1e-5
    _check_stats(lm.model.experts, len(PROMPT) + len(DECODE))


def test_budget_smaller_than_the_experts_runs(model_path, reference):
    lm0 = _load(model_path, slots=0, cpu_plan="000")
    _run(lm0, decode=[])  # sets up the cache
    probe = lm0.model.experts
    per_slot = sum(probe.store.expert_nbytes(i) for i in probe.layer_ids)
    staging = probe.cache.staging * probe.store.expert_nbytes()
    budget = (3 * per_slot + staging + per_slot // 2) / 2**30  # room for 3 of 8 experts per layer
    lm = _load(model_path, vram_gb=budget, vram_reserve_mib=0, cpu_plan="011")
    assert (_run(lm) - reference).abs().max().item() <= 1e-5
    ex = lm.model.experts
    assert ex.cache.slots == 3
    assert ex.cache.nbytes() < ex.store.nbytes()


def test_cache_learns_over_a_repeated_prompt(model_path):
    lm = _load(model_path, slots=4, cpu_plan="012", swap_budget=1)
    ex = lm.model.experts
    rates = []
    for _ in range(3):
        ex.begin_request()
        _run(lm, prompt=PROMPT[:2], decode=PROMPT[2:] + DECODE)
        rates.append(ex.request.hit_rate)
    assert rates[0] < rates[1] <= rates[2] + 1e-9, rates
    assert ex.stats.swaps > 0


def test_a_cold_cache_fills_in_its_first_prompt(model_path, reference):
    """Empty slots take the prompt's experts at once (a fill evicts nothing, so the swap budget does not hold it
    back): after one prompt every slot holds an expert, and the logits are still the oracle's."""
    lm = _load(model_path, slots=4, cpu_plan="012", swap_budget=1)
    ex = lm.model.experts
    ex.begin_request()
    out = _run(lm, decode=[])
    torch.testing.assert_close(out, reference[:len(PROMPT)], rtol=1e-4, atol=1e-4)
    pol = ex.policy
    for li in range(len(ex.layer_ids)):
        held = len(pol.resident(li)) + len(pol.pending(li))
        assert held == pol.capacity(li) == 4, (li, held)  # (a budget of 1 a step once left 3 of 4 empty)


def test_profile_save_load_round_trip_fills_the_cache(model_path, reference, tmp_path):
    path = tmp_path / "routing.json"
    lm = _load(model_path, slots=3, cpu_plan="012", expert_profile_save=str(path))
    _run(lm)
    lm.model.experts.close()
    prof = RoutingProfile.load(path, 3, 8)
    assert prof.tokens == len(PROMPT) + len(DECODE) and prof.counts.sum() == prof.tokens * 2 * 3

    warm = _load(model_path, slots=3, cpu_plan="012", expert_profile=str(path))
    cold = _load(model_path, slots=3, cpu_plan="012")
    for lm2 in (warm, cold):
        assert (_run(lm2) - reference).abs().max().item() <= 1e-5
    ex = warm.model.experts
    for li in range(3):
        assert sorted(ex.policy.resident(li)) == sorted(prof.ranking(li)[:3]) or ex.stats.swaps > 0
    assert ex.stats.hits > cold.model.experts.stats.hits
    # the first step already hits: the cache was filled before serving
    first = _load(model_path, slots=3, cpu_plan="012", expert_profile=str(path))
    _run(first, decode=[])
    assert first.model.experts.stats.hits > 0


def test_profile_report_has_the_backend_buckets(model_path):
    lm = _load(model_path, slots=2, cpu_plan="011", profile=True)
    _run(lm)
    rep = lm.model.experts.profile_report()
    for label in ("GPU experts", "CPU wait", "PCIe wait", "total"):
        assert label in rep, rep
    assert lm.model.experts.profile.tokens == len(PROMPT) + len(DECODE)
    off = _load(model_path, slots=2, cpu_plan="011")
    _run(off, decode=[])
    assert off.model.experts.profile_report() == ""


def test_quantized_experts_match_resident(tmp_path):
    path = write_moe_gguf(tmp_path / "q8.gguf", d=64, ff=64, n_experts=8, k=2, expert_type=Q.Q8_0)
    ref = _run(_load(path, mode="resident"), decode=DECODE[:2])
    for plan, slots in (("011", 2), ("000", 0)):
        out = _run(_load(path, slots=slots, cpu_plan=plan), decode=DECODE[:2])
        assert (out - ref).abs().max().item() <= 1e-5


def test_bad_plan_is_a_clear_error(model_path):
    from strata import StrataError

    lm = _load(model_path, slots=2, cpu_plan="0123")  # covers k=3, the model routes 2
    with pytest.raises(StrataError, match="routes 2"):
        _run(lm, decode=[])


@pytest.mark.gpu
@pytest.mark.parametrize("plan,slots", [("012", 0), ("000", 0), ("011", 3), ("000", 8)])
def test_cuda_tiered_matches_resident(model_path, plan, slots):
    ref = _run_cuda(_load_cuda(model_path, "resident"))
    lm = _load_cuda(model_path, "tiered", slots=slots, cpu_plan=plan)
    out = _run_cuda(lm)
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    ex = lm.model.experts
    assert ex.store.pinned and ex.cache.side is not None
    _check_stats(ex, len(PROMPT) + len(DECODE))
    # a second pass after the side-stream copies landed: hits come from the slots
    out2 = _run_cuda(lm)
    assert ((out2 - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    if slots:
        assert ex.stats.hits > 0


@pytest.mark.gpu
def test_cuda_bf16_tiered_runs(model_path):
    cfg = EngineConfig(model=str(model_path), device="cuda", dtype="bfloat16",
                       experts=ExpertConfig(mode="tiered", slots=3, cpu_plan="011", profile=True))
    lm = load_model(str(model_path), cfg, with_tokenizer=False)
    ref = _run_cuda(load_model(str(model_path), EngineConfig(model=str(model_path), device="cuda", dtype="bfloat16",
                                                             experts=ExpertConfig(mode="resident")),
                               with_tokenizer=False))
    out = _run_cuda(lm)
    assert torch.isfinite(out).all()
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 5e-2
    assert "GPU experts" in lm.model.experts.profile_report()


@torch.inference_mode()
def _load_cuda(path, mode, **ex):
    cfg = EngineConfig(model=str(path), device="cuda", dtype="float32", experts=ExpertConfig(mode=mode, **ex))
    return load_model(str(path), cfg, with_tokenizer=False)


def _run_cuda(lm, prompt=PROMPT, decode=DECODE):
    m, dev = lm.model, lm.model.device
    kv = m.new_kv_cache(1, max(64, len(prompt) + len(decode)))
    out = [m.forward(torch.tensor(prompt, device=dev), torch.arange(len(prompt), device=dev),
                     [Segment(0, 0, len(prompt))], kv, all_logits=True)]
    for i, t in enumerate(decode):
        p = len(prompt) + i
        out.append(m.forward(torch.tensor([t], device=dev), torch.tensor([p], device=dev), [Segment(0, p, 1)], kv,
                             all_logits=True))
    return torch.cat(out).float().cpu()


@pytest.mark.parametrize("kernel", ["int4", "native"])
def test_bf16_with_a_fast_cpu_lane_stays_close_to_resident(tmp_path, kernel):
    if kernel == "native":
        from strata.ops import cpu_native

        if cpu_native.load() is None:
            pytest.skip("no C compiler: the native CPU kernel is unavailable here")
    path = write_moe_gguf(tmp_path / "q4k.gguf", d=256, ff=256, n_layers=2, n_experts=4, k=2, heads=4, kv_heads=2,
                          head_dim=64, expert_type=Q.Q4_K)

    def load(**ex):
        cfg = EngineConfig(model=str(path), device="cpu", dtype="bfloat16", experts=ExpertConfig(**ex))
        return load_model(str(path), cfg, with_tokenizer=False)

    ref = _run(load(mode="resident"), prompt=PROMPT[:4], decode=DECODE[:2]).float()
    import strata.engine.loader as loader

    real = loader.make_experts_factory
    loader.make_experts_factory = lambda c: (lambda layers: TieredExperts(layers, c, progress=False, cpu_kernel=kernel))
    try:
        lm = load(mode="tiered", slots=1, cpu_plan="012")
    finally:
        loader.make_experts_factory = real
    assert set(lm.model.experts.lane.kernel.values()) == {kernel}
    out = _run(lm, prompt=PROMPT[:4], decode=DECODE[:2]).float()
    assert lm.model.experts.stats.cpu > 0
    assert ((out - ref).norm() / ref.norm()).item() < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("plan,slots", [("012", 3), ("000", 0), ("auto", 3), ("000", 6)])
def test_cuda_chunk_path_matches_resident(model_path, plan, slots):
    """A prompt whose pairs exceed the decode size takes the grouped chunk path (hits, staged batches, CPU; with 6
    of 8 experts cached the hits alone pass the decode size: they launch from the map row)."""
    prompt = [(7 * i + 3) % 96 for i in range(90)]  # 90 tokens x k=2 = 180 pairs > PAIRS_MAX
    ref = _run_cuda(_load_cuda(model_path, "resident"), prompt=prompt, decode=DECODE[:2])
    lm = _load_cuda(model_path, "tiered", slots=slots, cpu_plan=plan)
    out = _run_cuda(lm, prompt=prompt, decode=DECODE[:2])
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    s = lm.model.experts.stats
    assert s.hits + s.cpu + s.pcie == s.lookups


@pytest.mark.gpu
@pytest.mark.parametrize("stage_mib,plan,slots", [("0.0001", "000", 0), ("0.0001", "auto", 2), ("0.0001", "012", 3)])
def test_cuda_chunk_ring_matches_resident(model_path, monkeypatch, stage_mib, plan, slots):
    """The chunk ring on CUDA, where its copies run on their own stream: buffers smaller than a layer's misses
    (the ring wraps within a layer, and the next layer's prefetch waits for this layer's readers), prefetched
    layers ahead; two prompts in a row (the second starts on a ring the first left mid-way)."""
    monkeypatch.setenv("STRATA_CHUNK_STAGE_MIB", stage_mib)

    prompt = [(7 * i + 3) % 96 for i in range(90)]  # 90 tokens x k=2 = 180 pairs > PAIRS_MAX
    ref = _run_cuda(_load_cuda(model_path, "resident"), prompt=prompt, decode=DECODE[:2])
    lm = _load_cuda(model_path, "tiered", slots=slots, cpu_plan=plan)
    for _ in range(2):
        out = _run_cuda(lm, prompt=prompt, decode=DECODE[:2])
        assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    ex = lm.model.experts
    stage = next(iter(ex.cache._chunk_stage.values()))
    assert len(stage.bufs) >= 2 and stage.capacity < ex.n_experts
    assert 0 < ex.cache.prefetch_used <= ex.cache.prefetched
    s = ex.stats
    assert s.hits + s.cpu + s.pcie == s.lookups


@pytest.mark.parametrize("plan,slots", [("012", 3), ("000", 0), ("001", 8)])
def test_grouped_chunk_path_matches_resident(model_path, reference, monkeypatch, plan, slots):
    """The GPU's chunk path (hits and staged batches through the grouped FFN, masked pairs 0), run on the CPU."""
    import strata.experts.tiered_eager as tiered

    monkeypatch.setattr(tiered, "GROUPED_CHUNKS_ON_CPU", True)
    lm = _load(model_path, slots=slots, cpu_plan=plan)
    out = _run(lm)
    assert (out - reference).abs().max().item() <= 1e-5
    _check_stats(lm.model.experts, len(PROMPT) + len(DECODE))


@pytest.mark.parametrize("stage_mib,plan", [("0.0001", "000"), ("0.02", "000"), ("0.02", "012"), ("0.02", "auto")])
def test_chunk_buffers_match_resident(model_path, reference, monkeypatch, stage_mib, plan):
    """More streamed experts than the staging ring: the chunk's experts go through the two chunk buffers in
    batches (one expert per buffer, then a few), each batch one grouped call writing its pairs."""
    import strata.experts.tiered_eager as tiered

    monkeypatch.setattr(tiered, "GROUPED_CHUNKS_ON_CPU", True)
    monkeypatch.setenv("STRATA_CHUNK_STAGE_MIB", stage_mib)
    lm = _load(model_path, backend_kw=dict(staging=2), slots=0, cpu_plan=plan)
    out = _run(lm)
    assert (out - reference).abs().max().item() <= 1e-5
    ex = lm.model.experts
    assert ex.cache._chunk_stage, "the chunk path did not run"
    stage = next(iter(ex.cache._chunk_stage.values()))
    assert stage.experts < ex.n_experts
    assert 0 < ex.cache.prefetch_used <= ex.cache.prefetched  # the prompt chunk copied layers ahead
    _check_stats(ex, len(PROMPT) + len(DECODE))


def test_experts_copied_ahead_are_admitted_from_their_chunk_buffer(model_path, reference, monkeypatch):
    """A prompt chunk fills the empty cache with experts the next-layer prefetch already copied into a chunk
    buffer: those go into their slots on the device (no second copy from the host), and decoding from those slots
    gives the oracle's logits."""
    import strata.experts.tiered_eager as tiered

    monkeypatch.setattr(tiered, "GROUPED_CHUNKS_ON_CPU", True)
    monkeypatch.setenv("STRATA_CHUNK_STAGE_MIB", "0.02")
    lm = _load(model_path, backend_kw=dict(staging=2), slots=4, cpu_plan="000")
    ex = lm.model.experts
    out = _run(lm)
    assert (out - reference).abs().max().item() <= 1e-5
    assert ex.cache.prefetched > 0 and ex.cache.promoted > 0  # (the chunk path promotes nothing otherwise)
    _check_stats(ex, len(PROMPT) + len(DECODE))


def test_runs_of_consecutive_experts():
    from strata.experts.cache import _runs

    assert _runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert _runs([]) == []


def test_plan_tuner_switches_plans_during_decode(model_path, reference):
    """The tuner (on by default with a GPU; attached by hand here) changes the plan between decode steps and
    settles on one; logits stay the resident ones whichever plan ran."""
    from strata.experts.plan import CpuPlan
    from strata.experts.tuner import PlanTuner

    lm = _load(model_path, slots=1, cpu_plan="auto")
    ex = lm.model.experts
    ex.setup(2)
    plans = [CpuPlan.all_pcie(2), CpuPlan.all_cpu(2)]
    ex.tuner = PlanTuner(plans, trial=2, rounds=1, warmup=0)
    seen = []
    real = ex._begin_step

    def spy(ctx):
        real(ctx)
        seen.append(str(ex.plan))

    ex._begin_step = spy
    out = _run(lm, decode=DECODE * 2)  # 12 decode steps: 1 + 2 trials of 3 steps, then the choice
    n = len(PROMPT) + len(DECODE)
    assert (out[:n] - reference).abs().max().item() <= 1e-5
    assert ex.tuner.done and ex.plan in plans
    assert {"000", "012"} <= set(seen)  # both candidates ran
    _check_stats(ex, len(PROMPT) + 2 * len(DECODE))


def test_profile_cache_layout_spreads_slots_and_matches_resident(model_path, reference, tmp_path):
    """--cache-layout profile: the uniform budget's bytes spread over the layers as a routing profile predicts
    most hits (a layer routing to few experts gets few slots); logits stay the resident ones."""
    counts = np.zeros((3, 8))
    counts[0, :2] = [50, 50]  # layer 0 routes to two experts
    counts[1] = 10  # layer 1 spreads over all eight
    counts[2, :4] = 25  # layer 2 over four
    path = tmp_path / "prof.json"
    RoutingProfile(3, 8, counts, tokens=100).save(path)
    lm = _load(model_path, slots=3, cpu_plan="012", expert_profile=str(path), cache_layout="profile")
    ex = lm.model.experts
    ex.setup(2)
    per = [ex.cache.layer_slots[i] for i in ex.layer_ids]
    assert sum(per) == 9 and per[0] == 2 and per[2] == 4 and per[1] == 3  # shares 0.5 > 0.25 > 0.125
    assert [ex.policy.capacity(li) for li in range(3)] == per
    out = _run(lm)
    assert (out - reference).abs().max().item() <= 1e-5
    _check_stats(ex, len(PROMPT) + len(DECODE))
    with pytest.raises(StrataError, match="needs a routing profile"):
        _load(model_path, slots=3, cpu_plan="012", cache_layout="profile").model.experts.setup(2)


def test_tuner_sets_the_lane_threads(model_path, reference):
    from strata.experts.tuner import PlanTuner, lane_candidates

    before = torch.get_num_threads()
    try:
        lm = _load(model_path, slots=1, cpu_plan="auto", cpu_threads=2)
        ex = lm.model.experts
        ex.setup(2)
        ex.tuner = PlanTuner(lane_candidates(ex.plan, 2, 2), trial=2, rounds=1, warmup=0)
        seen = set()
        real = ex._begin_step

        def spy(ctx):
            real(ctx)
            seen.add((str(ex.plan), ex.lane.threads, torch.get_num_threads()))

        ex._begin_step = spy
        out = _run(lm, decode=DECODE * 3)
        assert (out[:len(PROMPT) + len(DECODE)] - reference).abs().max().item() <= 1e-5
        assert ("012", 1, 1) in seen and ("012", 2, 2) in seen  # all-CPU at 2 and at 1 thread
        assert ex.tuner.done
    finally:
        torch.set_num_threads(before)


_BUDGET_CHILD = r"""
import subprocess, sys
import torch
from strata.config import EngineConfig, ExpertConfig
from strata.engine.engine import Engine
from strata.engine.loader import load_model
from strata.engine.sampler import SamplingParams

def used_mib():  # the whole device as the driver reports it, without a CUDA context of our own
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, check=True).stdout
    return float(out.split()[0])

path, allowance = sys.argv[1], float(sys.argv[2])
base = used_mib()  # before this process touches CUDA: its context is to come out of the budget
cfg = EngineConfig(model=path, device="cuda", dtype="bfloat16",
                   experts=ExpertConfig(mode="tiered", vram_gb=base / 1024 + allowance, cpu_plan="00000"))
eng = Engine(load_model(path, cfg, with_tokenizer=False), n_slots=1)
out = list(eng.generate([(5 * i + 1) % 256 for i in range(200)], SamplingParams(temperature=0), 24))
torch.cuda.synchronize()
print(eng.model.experts.cache.slots, len(out), (used_mib() - base) / 1024)
"""


@pytest.mark.gpu
def test_cuda_budget_holds_the_whole_process(tmp_path):
    """--vram-gb is the whole process's budget: a fresh process (its own CUDA context, which torch's allocator
    does not count) loads a model whose experts exceed what is left, prefills and decodes, and the device then
    holds no more than the budget allowed it — context, dense weights, KV, cache, a prefill chunk's activations
    and the reserve all inside. Measured with nvidia-smi, outside any CUDA context."""
    import shutil
    import subprocess
    import sys

    import gguf as _gguf

    from tests.experts.tiered_model import write_moe_gguf

    if shutil.which("nvidia-smi") is None:
        pytest.skip("needs nvidia-smi to read the device's memory from outside the process")
    path = write_moe_gguf(tmp_path / "big.gguf", n_layers=4, d=1024, ff=1024, n_experts=128, k=4, vocab=256,
                          heads=8, kv_heads=4, head_dim=128, expert_type=_gguf.GGMLQuantizationType.Q4_K)
    allowance = 2.0  # GiB for the child: its context, ~50 MB dense, reserve, prefill chunk, part of 906 MB experts
    r = subprocess.run([sys.executable, "-c", _BUDGET_CHILD, str(path), str(allowance)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    slots, n_out, used_gib = r.stdout.split()[-3:]
    assert 0 < int(slots) < 128 and int(n_out) == 24  # the budget, not the model, limited the cache
    assert float(used_gib) <= allowance, f"the process used {float(used_gib):.2f} GiB of its {allowance} GiB budget"


def test_pairs_grouped_by_expert_in_order():
    """by_expert: every selected pair once, grouped by expert in expert order, pairs in their order within an
    expert — as a stable sort by expert id gives (ids past 16 bits too)."""
    from strata.experts.tiered_eager import by_expert

    rng = np.random.default_rng(5)
    for E in (128, 70000):
        flat = rng.integers(0, E, size=4096 * 8)
        for pairs in (None, np.flatnonzero(rng.random(flat.size) < 0.3), np.array([], dtype=np.int64)):
            sel = np.arange(flat.size) if pairs is None else pairs
            want = {}
            for q in sel[np.argsort(flat[sel], kind="stable")].tolist():
                want.setdefault(int(flat[q]), []).append(q)
            got = by_expert(flat, pairs)
            assert [e for e, _ in got] == sorted(want)
            assert all(p.tolist() == want[e] for e, p in got)


def test_a_long_chunk_gives_the_cpu_only_experts_within_its_measured_tokens(model_path, reference):
    """CPU cheap, PCIe dear: the split would hand a chunk's experts to the CPU lane, but only those routed at most
    CPU_MEASURED_TOKENS of the chunk's tokens may go there (its per-token cost was measured up to that many);
    the rest stream. The logits stay those of the all-resident run."""
    from strata.experts.plan import CPU_MEASURED_TOKENS

    lm = _load(model_path, {"cost_model": CHEAP_CPU}, slots=0, cpu_plan="auto")
    ex = lm.model.experts
    seen = []
    inner = ex.lane.run_chunk
    ex.lane.run_chunk = lambda layer, x, jobs: (seen.extend(int(t.numel()) for _, t in jobs), inner(layer, x, jobs))[1]
    long_prompt = (PROMPT * 6)[:64]  # 64 tokens x top-2 over 8 experts: most experts get far more than 8
    m = lm.model
    with torch.inference_mode():
        kv = m.new_kv_cache(1, 128)
        got = m.forward(torch.tensor(long_prompt), torch.arange(64), [Segment(0, 0, 64)], kv, all_logits=True)
        ref_lm = _load(model_path, mode="resident")
        want = ref_lm.model.forward(torch.tensor(long_prompt), torch.arange(64), [Segment(0, 0, 64)],
                                    ref_lm.model.new_kv_cache(1, 128), all_logits=True)
    assert (got - want).abs().max().item() <= 1e-5
    assert all(n <= CPU_MEASURED_TOKENS for n in seen)
    assert ex.stats.pcie > 0  # the busy experts streamed


def test_chunk_cpu_share_priced_by_measurement(model_path, reference, monkeypatch):
    """--cpu-plan auto on chunks: a CPU lane far slower on a chunk than its one-token costs say gets priced out
    (measured / estimated folds into the split), and the chunks stream; logits stay the resident ones."""
    import time as _time

    import strata.experts.tiered_eager as tiered

    monkeypatch.setattr(tiered, "GROUPED_CHUNKS_ON_CPU", True)
    lm = _load(model_path, {"cost_model": CHEAP_CPU}, slots=0, cpu_plan="auto")
    ex = lm.model.experts
    real = ex.lane.run_chunk

    def slow(*a, **kw):
        _time.sleep(0.05)  # 50 ms a call: far above CHEAP_CPU's price of a chunk's few experts
        return real(*a, **kw)

    monkeypatch.setattr(ex.lane, "run_chunk", slow)
    out = _run(lm, decode=[])
    assert (out - reference[:len(PROMPT)]).abs().max().item() <= 1e-5
    first = ex.stats.cpu
    assert first > 0 and ex.chunk_cpu_scale > 10  # priced as measured at one token first, then corrected
    out = _run(lm, decode=[])
    assert (out - reference[:len(PROMPT)]).abs().max().item() <= 1e-5
    assert ex.stats.cpu - first < first / 2  # the second prompt's chunk gave the slow lane far less
    _check_stats(ex, 2 * len(PROMPT))
