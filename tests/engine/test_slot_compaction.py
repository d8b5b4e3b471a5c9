"""Decoding sequences kept in the lowest KV slots (strata.engine.slots): with clients coming and going on a
4-slot engine, every graphed step sees the slots (0, ..., b-1), and each sequence's text is what it is decoded
alone — for attention-only, hybrid (recurrent state) and quantized-KV caches."""

from __future__ import annotations

import pytest
import torch

from strata.config import EngineConfig
from strata.engine.engine import Engine, Sequence
from strata.engine.loader import load_model
from strata.engine.sampler import SamplingParams


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1001, (int(x),), generator=g).tolist() for x in torch.randint(8, 60, (n,), generator=g)]


def _alone(lm, prompt, n):
    return list(Engine(lm, n_slots=1).generate(prompt, SamplingParams(temperature=0), n))


def _staggered(eng: Engine, prompts, lens, seen: list):
    """Sequences join while others decode and leave at different times (as a server's slots do)."""
    real = eng.graphs.step_batch

    def spy(toks, poss, slots, T=1):
        seen.append(tuple(slots))
        return real(toks, poss, slots, T)

    eng.graphs.step_batch = spy
    waiting = [Sequence(list(p), SamplingParams(temperature=0), n, set()) for p, n in zip(prompts, lens)]
    done = []
    running: list[Sequence] = []
    step = 0
    while waiting or running:
        # one arrival every third step while a slot is free
        if waiting and eng.free_slots and step % 3 == 0:
            s = waiting.pop(0)
            eng.add(s, reuse_prefix=True)
            running.append(s)
        eng.step()
        for s in [s for s in running if s.finished]:
            eng.release(s)
            running.remove(s)
            done.append(s)
        step += 1
    return done


@pytest.mark.parametrize("family,kv", [("qwen3moe", None), ("qwen3next", None), ("qwen3moe", "q8_0")])
def test_staggered_sequences_decode_in_the_lowest_slots(hf_and_gguf, family, kv):
    _, path = hf_and_gguf(family)
    cfg = EngineConfig(device="cpu", dtype="float32", cuda_graphs=True, **({"kv_dtype": kv} if kv else {}))
    lm = load_model(str(path), cfg)
    eng = Engine(lm, n_slots=4)
    assert eng.graphs is not None and eng.graph_batch == 4
    prompts = _prompts(7)
    lens = [5, 14, 9, 3, 12, 7, 10]
    seen: list = []
    import strata.engine.slots as slots_mod

    moves = []
    real_exchange = slots_mod._exchange
    slots_mod._exchange = lambda e, a, b, by: (moves.append((a, b)), real_exchange(e, a, b, by))
    try:
        done = _staggered(eng, prompts, lens, seen)
    finally:
        slots_mod._exchange = real_exchange
    assert moves, "no sequence had to move"
    assert {tuple(range(len(t))) for t in seen} == set(seen), "a graphed step outside slots 0 .. b-1"
    assert len({len(t) for t in seen}) >= 3  # steps of several sizes ran
    for s in done:
        assert s.output == _alone(lm, s.prompt, s.max_tokens), (family, kv, s.prompt[:4])
    # what the slots hold still matches their tokens: a prompt extending a finished one reuses its prefix
    last = done[-1]
    follow = Sequence(list(last.prompt) + last.output[:-1] + [7], SamplingParams(temperature=0), 4, set())
    eng.add(follow)
    assert follow.cached > len(last.prompt) or family == "qwen3next"
    while not follow.finished:
        eng.step()
    assert follow.output == _alone(lm, follow.prompt, 4)


@pytest.mark.gpu
def test_cuda_captures_one_set_per_count_and_window(hf_and_gguf):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _, path = hf_and_gguf("qwen3moe")
    lm = load_model(str(path), EngineConfig(device="cuda", dtype="float32", cuda_graphs=True))
    eng = Engine(lm, n_slots=4)
    assert eng.graphs.prepare([256]) == 4  # what the server captures before it says ready
    eng.model.experts.begin_request()  # outside inference mode, as the server's warm-up ends
    seen: list = []
    prompts = _prompts(7)
    lens = [5, 14, 9, 3, 12, 7, 10]
    done = _staggered(eng, prompts, lens, seen)
    keys = list(eng.graphs.graphs)
    assert all(slots == tuple(range(len(slots))) for slots, _ in keys), keys
    assert len(keys) == 4, "a step needed a capture the warm-up had not made"
    ref = Engine(lm, n_slots=1)
    for s in done:
        assert s.output == list(ref.generate(s.prompt, SamplingParams(temperature=0), s.max_tokens))
