"""`strata perplexity` against llama.cpp (the `xllamacpp` CPU build): the same GGUF, the same text.

xllamacpp exposes no perplexity tool, so llama.cpp's side is built from its server: for every scored position
of every chunk, the full next-token distribution (n_probs = the vocabulary) after the chunk's prefix, as
llama.cpp computes it. The test applies llama-perplexity's chunking itself (written out here, not taken from
strata) and compares the PPL and its error with what the `strata perplexity` command prints.
"""

from __future__ import annotations

import math
import re

import pytest

pytest.importorskip("xllamacpp")

from .llamacpp import VOCAB, llamacpp_activation_rounding, make_checkpoint, run_llamacpp  # noqa: E402

N_CTX, N_CHUNKS = 32, 2
# Float weights: both engines compute in float32, so the PPLs agree up to summation order (measured ~1e-6
# relative); F32_RTOL is the 0.5% asked of the command with a tighter check beside it.
F32_RTOL, F32_TIGHT = 0.005, 1e-4
# strata-tiny is a q8_0 MoE: llama.cpp rounds the activations to 8 bits before each matmul (reproduced here
# with llamacpp_activation_rounding), and float32 summation order still tips an occasional rounding step and
# with it a router's choice, so the two differ by a fraction of a percent (measured 0.35% at -c 32, 0.8% at 64).
Q8_RTOL = 0.015


def _text() -> str:
    import argparse
    import inspect
    import json

    return "\n\n".join(inspect.getdoc(m) for m in (json, argparse))  # real English prose, a few KB


def _llamacpp_ppl(model, tok, text: str, workdir) -> tuple[float, float]:
    """llama-perplexity's chunking over llama.cpp's own log-probs -> (PPL, its error)."""
    toks = tok.encode(text, add_special=False, parse_special=False)
    if tok.add_bos:
        toks = [tok.bos_id] + toks
    prompts, targets = [], []
    for c in range(N_CHUNKS):  # chunks of N_CTX with BOS first; logits at N_CTX/2 .. N_CTX-2 scored
        chunk = toks[c * N_CTX:(c + 1) * N_CTX]
        if tok.add_bos:
            chunk[0] = tok.bos_id
        for j in range(N_CTX // 2, N_CTX - 1):
            prompts.append(chunk[:j + 1])
            targets.append(chunk[j + 1])
    force = tok.encode("a", add_special=False)[0]  # a token whose text is complete UTF-8
    res = run_llamacpp(model, [{"op": "top", "prompts": prompts, "k": tok.vocab_size}], force, workdir)
    nll = [-dict((i, v) for i, v in top)[t] for top, t in zip(res[0]["top"], targets)]
    mean = sum(nll) / len(nll)
    var = sum(v * v for v in nll) / len(nll) - mean * mean
    ppl = math.exp(mean)
    return ppl, ppl * math.sqrt(var / (len(nll) - 1))


def _strata_ppl(model, text_file, capsys) -> tuple[float, float]:
    from strata.cli import main

    capsys.readouterr()
    assert main(["perplexity", "-m", str(model), "-f", str(text_file), "-c", str(N_CTX), "--chunks",
                 str(N_CHUNKS), "--device", "cpu", "--dtype", "f32"]) == 0
    out = capsys.readouterr().out
    assert re.match(r"\[1\][0-9.]+,\[2\][0-9.]+,\n", out), out
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out)
    assert m, out
    return float(m.group(1)), float(m.group(2))


def _tokenizer(model):
    from strata.gguf.reader import open_gguf
    from strata.gguf.tokenizer import Tokenizer

    return Tokenizer.from_metadata(open_gguf(model).metadata)


def test_ppl_matches_llamacpp_float_weights(tmp_path, capsys):
    from strata.gguf.convert import convert
    from strata.gguf.tokenizer_hf import make_tiny_hf_tokenizer

    tok_dir = make_tiny_hf_tokenizer(tmp_path / "tok", VOCAB)
    model = convert(make_checkpoint("qwen3moe", tmp_path / "hf", tok_dir), tmp_path / "m.f32.gguf", "f32")
    text = _text()
    f = tmp_path / "text.txt"
    f.write_text(text)
    ref, ref_err = _llamacpp_ppl(model, _tokenizer(model), text, tmp_path)
    got, err = _strata_ppl(model, f, capsys)
    assert abs(got - ref) / ref < F32_RTOL
    assert got == pytest.approx(ref, rel=F32_TIGHT)
    assert err == pytest.approx(ref_err, rel=1e-3)


def test_ppl_matches_llamacpp_strata_tiny(tmp_path, capsys):
    from strata.models.default import default_model_path

    model = default_model_path()
    text = _text()
    f = tmp_path / "text.txt"
    f.write_text(text)
    ref, _ = _llamacpp_ppl(model, _tokenizer(model), text, tmp_path)
    with llamacpp_activation_rounding():
        got, _ = _strata_ppl(model, f, capsys)
    assert abs(got - ref) / ref < Q8_RTOL, (got, ref)
