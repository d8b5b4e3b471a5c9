"""The server chooses its CPU/PCIe plan on its own warm-up text, before it says ready: no request decodes under a
trial plan. A real server on loopback with a real tiered model and the real plan tuner; on the CPU the tuner is
not made by default (its PCIe lane is a GPU's), so the tests give the backend one after its set-up."""

from __future__ import annotations

import openai
import pytest

from strata.experts.plan import CpuPlan
from strata.experts.tiered import TieredExperts
from strata.experts.tuner import PlanTuner

from .conftest import CTX, serve

MSG = [{"role": "user", "content": "Say something."}]


@pytest.fixture
def tiered_lm(tiny_gguf):
    from strata.config import EngineConfig, ExpertConfig
    from strata.engine.loader import load_model

    cfg = EngineConfig(model=str(tiny_gguf), device="cpu", dtype="float32", ctx_size=CTX,
                       experts=ExpertConfig(mode="tiered", slots=2, cpu_plan="0" * 5))
    return load_model(str(tiny_gguf), cfg)


@pytest.fixture
def with_tuner(monkeypatch):
    """Each TieredExperts set up from now on tunes between all-PCIe (its plan, first) and all-CPU, quickly."""
    made = []
    setup = TieredExperts.setup

    def tuned_setup(self, k, act_bytes=0):
        setup(self, k, act_bytes)
        if self.tuner is None:
            from strata.experts.cpu_lane import CpuLane

            if self.lane is None:  # an all-PCIe plan needs no lane; the all-CPU candidate does
                self.lane = CpuLane(self.store.layers, 1, "auto", self.dtype)
                self.lane.prepare(progress=False)
            self.tuner = PlanTuner([CpuPlan.all_pcie(k), CpuPlan.all_cpu(k)], trial=3, rounds=1, warmup=2)
            made.append(self)

    monkeypatch.setattr(TieredExperts, "setup", tuned_setup)
    return made


def _timed(tuner: PlanTuner) -> int:
    return sum(len(t) for t in tuner.times)


def test_the_plan_is_chosen_before_ready_and_requests_never_run_trials(tiered_lm, with_tuner):
    with serve(tiered_lm, parallel=1, warmup=True, warmup_tune_s=120) as r:
        (experts,) = with_tuner
        tuner = experts.tuner
        assert tuner.done and tuner.chosen is not None  # decided before the server took a request
        assert _timed(tuner) >= 2 * tuner.trial  # from measured warm-up steps, both candidates
        warm = r.state.metrics.settings["warmup"]
        assert warm["tuned"] == str(tuner.chosen) and warm["steps"] > 0
        chosen, timed = experts.plan, _timed(tuner)
        assert chosen == tuner.chosen
        # the warm-up's text is in no slot and in no request's counts
        assert all(not t for t in r.state.server.worker.engine.slot_tokens.values())
        oai = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
        for n in (4, 16):
            c = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=n, temperature=0.8, seed=n)
            assert c.usage.completion_tokens >= 1
        assert experts.plan == chosen and _timed(tuner) == timed  # requests ran the chosen plan, no trial


def test_the_warmup_bound_keeps_the_best_measured(tiered_lm, with_tuner):
    with serve(tiered_lm, parallel=1, warmup=True, warmup_tune_s=0) as r:
        (experts,) = with_tuner
        assert experts.tuner.done and not experts.tuning()
        # nothing was timed within a zero bound: the cost model's plan (the first candidate) is kept
        assert experts.plan == experts.tuner.candidates[0]
        assert r.state.metrics.settings["warmup"]["tuned"] == str(experts.tuner.candidates[0])


def test_without_warmup_the_cost_models_plan_is_kept(tiered_lm, with_tuner):
    with serve(tiered_lm, parallel=1, warmup=False) as r:
        (experts,) = with_tuner
        assert experts.tuner.done and experts.plan == experts.tuner.candidates[0]
        oai = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
        oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=12, temperature=0.8, seed=3)
        assert _timed(experts.tuner) == 0


def test_warm_up_prompts_run_alone_and_together_and_leave_nothing_behind(tiered_lm):
    """The prompts a GPU server runs before ready (kernels compiled for the prompt path before a request needs
    them): both lengths alone, then one per slot at once; afterwards no slot holds their text and the engine
    generates what a fresh one does."""
    from strata.engine.engine import Engine
    from strata.engine.sampler import SamplingParams
    from strata.server.warmup import WARM_PROMPT_TOKENS, warm_up

    said: list[str] = []
    eng = Engine(tiered_lm, n_slots=3)
    out = warm_up(eng, tiered_lm.tokenizer, said.append, 0, prompts=True)
    assert out["prompts"] == len(WARM_PROMPT_TOKENS) + 3
    assert any("warm-up prompts" in m for m in said)
    assert not eng.running and sorted(eng.free_slots) == [0, 1, 2]
    assert all(not t for t in eng.slot_tokens.values())
    prompt = tiered_lm.tokenizer.encode("def add(a, b):", add_special=False)
    greedy = SamplingParams(temperature=0)
    fresh = Engine(tiered_lm, n_slots=3)
    assert list(eng.generate(prompt, greedy, 12)) == list(fresh.generate(prompt, greedy, 12))
    # a CPU server skips them by default (nothing is compiled on first use there)
    assert "prompts" not in warm_up(Engine(tiered_lm, n_slots=1), tiered_lm.tokenizer, said.append, 0)


@pytest.mark.parametrize("family", ["qwen3next", "gpt_oss"])
def test_warm_up_prompts_leave_recurrent_and_windowed_families_as_fresh(hf_and_gguf, family):
    """The same for a family with recurrent state kept per slot (qwen3next) and one with sliding-window layers
    (gpt-oss): after the warm-up prompts on every slot, greedy text equals a fresh engine's."""
    from strata.config import EngineConfig
    from strata.engine.engine import Engine
    from strata.engine.loader import load_model
    from strata.engine.sampler import SamplingParams
    from strata.server.warmup import warm_up

    path = str(hf_and_gguf(family)[1])
    lm = load_model(path, EngineConfig(model=path, device="cpu", dtype="float32", ctx_size=CTX))
    eng = Engine(lm, n_slots=2)
    assert warm_up(eng, lm.tokenizer, lambda m: None, 0, prompts=True)["prompts"] == 4
    prompt = lm.tokenizer.encode("def add(a, b):", add_special=False)
    greedy = SamplingParams(temperature=0)
    assert list(eng.generate(prompt, greedy, 10)) == list(Engine(lm, n_slots=2).generate(prompt, greedy, 10))


@pytest.mark.gpu
def test_cuda_vram_after_warm_up_is_measured_against_the_budget():
    import torch

    from strata.experts.sizing import GiB, MiB, split_budget
    from strata.server.warmup import vram_after_warm_up

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda", torch.cuda.current_device())
    split = split_budget(8 * GiB, context=GiB, reserve=700 * MiB, staging=0, prefill=0, expert_bytes=MiB,
                         per_slot=48 * MiB, n_experts=128)
    x = torch.ones(64 * MiB // 4, device=dev)
    out: dict = {}
    line = vram_after_warm_up(dev, split, out)
    assert "of the 8.00 GiB budget in use" in line and "the reserve 700 MiB" in line
    assert out["torch_allocated_gib"] >= 64 / 1024 and out["vram_used_gib"] > 0
    del x
