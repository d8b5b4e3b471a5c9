"""Batch invariance on the CPU's default path (int8-rounded activations, not the float32 reference): a row's
logits do not depend on the rows computed beside it. A speculative verify step of T tokens must give each token
the logits a one-token step gives it (else a near tie in a router or a sampler resolves differently and the drafted
text parts from the plain text), and a decode step of several sequences each sequence's logits alone."""

from __future__ import annotations

import pytest
import torch

from strata.config import EngineConfig
from strata.engine.loader import load_model
from strata.kv.cache import Segment

# every family, with real models' widths (hf_fixtures says why)
FAMILIES = [f + "_aligned" for f in ("qwen3moe", "deepseek_v3", "glm4moe", "gpt_oss", "qwen3next", "mixtral")]


def _model(hf_and_gguf, family):
    _, path = hf_and_gguf(family, "q8_0")
    cfg = EngineConfig(model=str(path), device="cpu", ctx_size=256)
    return load_model(str(path), cfg, with_tokenizer=False).model


def _prefill(m, kv, slot, prompt):
    n = len(prompt)
    m.forward(torch.tensor(prompt), torch.arange(n), [Segment(slot, 0, n)], kv)


@pytest.mark.parametrize("family,kv_type", [(f, None) for f in FAMILIES]
                         + [("glm4moe_aligned", "q8_0"), ("qwen3next_aligned", "q4_0"), ("deepseek_v3_aligned", "q8_0")])
def test_a_verify_rows_logits_are_a_one_token_steps(family, kv_type, hf_and_gguf):
    """(kv_type: K and V stored quantized, read back dequantized)"""
    m = _model(hf_and_gguf, family)
    prompt = [(37 * i + 11) % 900 + 3 for i in range(70)]
    nxt = [5, 301, 77, 650, 12]
    n, T = len(prompt), len(nxt)
    kv = m.new_kv_cache(1, 256, k_type=kv_type, v_type=kv_type)
    _prefill(m, kv, 0, prompt)
    one = torch.cat([m.forward(torch.tensor([nxt[j]]), torch.tensor([n + j]), [Segment(0, n + j, 1)], kv,
                               all_logits=True) for j in range(T)])
    kv2 = m.new_kv_cache(1, 256, k_type=kv_type, v_type=kv_type)
    _prefill(m, kv2, 0, prompt)
    rows = m.forward(torch.tensor(nxt), torch.arange(n, n + T), [Segment(0, n, T)], kv2, all_logits=True)
    assert torch.equal(rows, one), (rows - one).abs().max().item()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_decode_steps_sequences_are_each_alone(family, hf_and_gguf):
    m = _model(hf_and_gguf, family)
    prompts = [[(37 * i + 11 * s) % 900 + 3 for i in range(20 + 9 * s)] for s in range(3)]
    nxt = [5, 301, 77]
    kv = m.new_kv_cache(3, 256)
    for s, p in enumerate(prompts):
        _prefill(m, kv, s, p)
    segs = [Segment(s, len(p), 1) for s, p in enumerate(prompts)]
    together = m.forward(torch.tensor(nxt), torch.tensor([len(p) for p in prompts]), segs, kv)
    for s, p in enumerate(prompts):
        kv1 = m.new_kv_cache(1, 256)
        _prefill(m, kv1, 0, p)
        alone = m.forward(torch.tensor([nxt[s]]), torch.tensor([len(p)]), [Segment(0, len(p), 1)], kv1)
        assert torch.equal(together[s:s + 1], alone), (family, s, (together[s] - alone[0]).abs().max().item())


@pytest.mark.parametrize("source", ["mtp", "ngram"])
def test_the_embedded_models_sampled_text_is_the_same_with_drafts(source):
    """The embedded default model on the default CPU path: seeded sampled text, token for token, with drafts of its
    MTP block or n-grams as without (before each token's logits were its own, a near tie between two experts could
    resolve one way in a verify step and the other in a one-token step, and the texts parted)."""
    from strata.engine.engine import Engine
    from strata.engine.sampler import SamplingParams
    from strata.models.default import default_model_path

    path = str(default_model_path(warn=False))
    plain = Engine(load_model(path, EngineConfig(model=path, device="cpu", ctx_size=512)), n_slots=1)
    drafted = Engine(load_model(path, EngineConfig(model=path, device="cpu", ctx_size=512, draft_max=3,
                                                   draft_source=source)), n_slots=1)
    tok = plain.lm.tokenizer
    drafts = 0
    for k, text in enumerate(("def add(a, b):", "class Stack:\n    def __init__(self):",
                              "import os\n\nfor name in os.listdir(")):
        prompt = tok.encode(text)
        for temperature in (0.8, 1.2):
            sp = SamplingParams(temperature=temperature, seed=3 + k)
            ref = list(plain.generate(prompt, sp, 60))
            assert list(drafted.generate(prompt, sp, 60)) == ref, (text, temperature)
            drafts += drafted.last.draft_n
    assert drafts > 0


def test_the_embedded_models_sampled_text_is_the_same_beside_other_sequences():
    """Four seeded sampled requests decoding together in one engine write, each, the text it writes alone."""
    from strata.engine.engine import Engine, Sequence
    from strata.engine.sampler import SamplingParams
    from strata.models.default import default_model_path

    path = str(default_model_path(warn=False))
    lm = load_model(path, EngineConfig(model=path, device="cpu", ctx_size=512))
    tok = lm.tokenizer
    prompts = [tok.encode(t) for t in ("def add(a, b):", "class Stack:", "import os\n", "# parse the")]
    params = [SamplingParams(temperature=1.2, seed=s) for s in (1, 2, 3, 4)]
    alone = [list(Engine(lm, n_slots=1).generate(p, sp, 120)) for p, sp in zip(prompts, params)]
    eng = Engine(lm, n_slots=4)
    seqs = [Sequence(list(p), sp, 120, set()) for p, sp in zip(prompts, params)]
    for s in seqs:
        eng.add(s)
    while any(not s.finished for s in seqs):
        eng.step()
    assert [s.output for s in seqs] == alone


@pytest.mark.parametrize("family", ["glm4moe_aligned", "qwen3moe_aligned", "deepseek_v3_aligned"])
def test_a_prompt_chunk_of_several_sequences_gives_each_its_logits_alone(family, hf_and_gguf):
    """Prompts that arrive together share a prefill chunk: a short one beside a long one (the chunk's rows past the
    decode-sized products, whose path a short prompt alone would not take) gets the logits and KV it gets alone
    (its rows took the long one's float path, and its text and the prompt cache's copy of it differed)."""
    m = _model(hf_and_gguf, family)
    long, short = [(37 * i + 11) % 900 + 3 for i in range(120)], [5, 301, 77, 650]
    kv = m.new_kv_cache(2, 256)
    segs = [Segment(0, 0, len(long)), Segment(1, 0, len(short))]
    together = m.forward(torch.tensor(long + short), torch.cat([torch.arange(len(long)), torch.arange(len(short))]),
                         segs, kv, all_logits=True)
    for slot, p, rows in ((0, long, together[:len(long)]), (1, short, together[len(long):])):
        kv1 = m.new_kv_cache(1, 256)
        alone = m.forward(torch.tensor(p), torch.arange(len(p)), [Segment(0, 0, len(p))], kv1, all_logits=True)
        assert torch.equal(rows, alone), (family, slot, (rows - alone).abs().max().item())
        # and the next token's step reads the KV the prompt left: the same
        nxt = m.forward(torch.tensor([9]), torch.tensor([len(p)]), [Segment(slot, len(p), 1)], kv)
        assert torch.equal(nxt, m.forward(torch.tensor([9]), torch.tensor([len(p)]), [Segment(0, len(p), 1)], kv1))


def test_the_embedded_models_text_is_the_same_beside_a_long_prompt():
    """The engine's scheduling as a server meets it: a long and a short prompt added together share a prefill chunk,
    and each writes, greedy, the text it writes alone."""
    from strata.engine.engine import Engine, Sequence
    from strata.engine.sampler import SamplingParams
    from strata.models.default import default_model_path

    path = str(default_model_path(warn=False))
    lm = load_model(path, EngineConfig(model=path, device="cpu", ctx_size=1024))
    tok = lm.tokenizer
    import inspect
    import json

    prompts = [tok.encode(inspect.getsource(json.dumps))[:314], tok.encode("class Foo:")]
    greedy = SamplingParams(temperature=0)
    alone = [list(Engine(lm, n_slots=1).generate(p, greedy, 40)) for p in prompts]
    eng = Engine(lm, n_slots=2)
    seqs = [Sequence(list(p), greedy, 40, set()) for p in prompts]
    for s in seqs:
        eng.add(s)
    while any(not s.finished for s in seqs):
        eng.step()
    assert [s.output for s in seqs] == alone
