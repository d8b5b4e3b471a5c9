"""Per-token log-probabilities from the engine: the log-softmax of the raw logits of the row each token was drawn
from, only for the sequences that ask, without changing what is drawn."""

import math

import pytest
import torch

from strata.config import EngineConfig
from strata.engine.engine import Engine, Sequence
from strata.engine.loader import load_model
from strata.engine.sampler import SamplingParams
from strata.kv.cache import Segment


def _decode(eng, prompts, params, n, logprobs):
    seqs = [Sequence(list(p), params, n, set()) for p in prompts]
    for s, k in zip(seqs, logprobs):
        s.logprobs = k
        eng.add(s, reuse_prefix=False)
    while any(not s.finished for s in seqs):
        eng.step()
    return seqs


@torch.inference_mode()
def _oracle(lm, ids: list[int], n_prompt: int, k: int):
    """Each position's log-softmax from one prefill forward of the whole sequence, in float64."""
    kv = lm.model.new_kv_cache(1, len(ids) + 1, lm.cfg.torch_kv_dtype)
    logits = lm.model.forward(torch.tensor(ids, device=lm.model.device),
                              torch.arange(len(ids), device=lm.model.device), [Segment(0, 0, len(ids))], kv,
                              all_logits=True)
    lp = torch.log_softmax(logits.double().cpu(), -1)
    out = []
    for j in range(n_prompt, len(ids)):
        row = lp[j - 1]
        top = row.topk(k)
        out.append((float(row[ids[j]]), list(zip(top.indices.tolist(), top.values.tolist()))))
    return out


def _check(lm, seq, k, tol):
    want = _oracle(lm, seq.prompt + seq.output, len(seq.prompt), k)
    assert len(seq.token_logprobs) == len(seq.output) == len(want)
    for (lp, top), (wlp, wtop) in zip(seq.token_logprobs, want):
        assert math.isclose(lp, wlp, abs_tol=tol), (lp, wlp)
        assert [i for i, _ in top] == [i for i, _ in wtop]
        assert all(math.isclose(a, b, abs_tol=tol) for (_, a), (_, b) in zip(top, wtop))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0),
                                    SamplingParams(temperature=1.3, top_k=8, seed=5, repetition_penalty=1.3)])
def test_logprobs_only_where_asked_and_draws_unchanged(hf_and_gguf, params):
    _, path = hf_and_gguf("qwen3moe")
    lm = load_model(str(path), EngineConfig(device="cpu", dtype="float32"))
    prompts = [list(range(10, 40)), list(range(300, 317))]
    plain = _decode(Engine(lm, n_slots=2), prompts, params, 10, [None, None])
    asked = _decode(Engine(lm, n_slots=2), prompts, params, 10, [4, None])
    assert [s.output for s in asked] == [s.output for s in plain]  # reporting changes nothing drawn
    assert asked[1].token_logprobs == [] and plain[0].token_logprobs == []
    _check(lm, asked[0], 4, 2e-3)  # sampled with penalties too: the raw distribution, as OpenAI reports it


def test_logprobs_turn_drafts_off(hf_and_gguf):
    _, path = hf_and_gguf("qwen3moe")
    lm = load_model(str(path), EngineConfig(device="cpu", dtype="float32", draft_max=4))
    (ref,) = _decode(Engine(lm, n_slots=1), [list(range(10, 20)) * 4], SamplingParams(temperature=0), 12, [None])
    assert ref.draft_n > 0  # this prompt does draft
    (s,) = _decode(Engine(lm, n_slots=1), [list(range(10, 20)) * 4], SamplingParams(temperature=0), 12, [2])
    assert s.draft_n == 0 and len(s.token_logprobs) == 12 and s.output == ref.output


@pytest.mark.gpu
def test_logprobs_from_cuda_graphs(hf_and_gguf):
    _, path = hf_and_gguf("qwen3moe")
    lm = load_model(str(path), EngineConfig(device="cuda", dtype="float32", cuda_graphs=True))
    eng = Engine(lm, n_slots=1)
    assert eng.graphs is not None
    (s,) = _decode(eng, [list(range(10, 40))], SamplingParams(temperature=0), 12, [3])
    _check(lm, s, 3, 2e-3)
