"""The fused kernels wired into the layers: whole tiny models run with every RMSNorm and rotary on the Triton
kernels (in the interpreter, on the CPU) give the logits and greedy tokens of the torch path. Covers GQA with
per-head q/k norm (Qwen3-MoE, neox rotary), GQA without it (Llama, pair-order rotary) and MLA (DeepSeek-V3:
rotary of strided q/k slices, RMSNorm of a row slice), prefill and the static-shape (windowed) decode step."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from strata.config import EngineConfig
    from strata.engine.engine import Engine
    from strata.engine.loader import forward_all, load_model
    from strata.engine.sampler import SamplingParams
    from strata.ops import fused

    calls = []
    torch_path = fused.use_for

    def run(path, kernels):
        # on the CPU use_for says no; saying yes sends the layers' CPU tensors through the interpreted kernels
        fused.use_for = (lambda x: calls.append(1) or True) if kernels else torch_path
        lm = load_model(path, EngineConfig(device="cpu", dtype="float32", cuda_graphs=True))
        ids = [3, 5, 7, 9, 11]
        logits = forward_all(lm, ids)
        eng = Engine(lm, n_slots=1)
        assert eng.graphs is not None  # the decode below is the static-shape (windowed, masked) step
        toks = list(eng.generate(ids, SamplingParams(temperature=0), 4))
        return logits, toks

    for path in sys.argv[1:]:
        ref_logits, ref_toks = run(path, False)
        assert not calls
        logits, toks = run(path, True)
        assert calls, "the layers did not ask for the fused kernels"
        calls.clear()
        err = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
        assert err < 1e-5, (path, err)
        assert toks == ref_toks, (path, toks, ref_toks)
    print("ok")
""")


def test_models_on_the_fused_kernels_match_the_torch_path(hf_and_gguf):
    paths = [str(hf_and_gguf(f)[1]) for f in ("qwen3moe", "llama", "deepseek_v3")]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", SCRIPT, *paths], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
