"""SwiGLU's silu(g) * u by the fused kernel (`silu_mul`), wired into a whole model with dense layers or shared
experts: with the kernel taken (Triton's interpreter on the CPU) the greedy tokens are the torch path's and the
kernel ran in every dense FFN / shared expert call."""

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
    from strata.engine.loader import load_model
    from strata.engine.sampler import SamplingParams
    from strata.ops import fused

    torch_rule, real = fused.use_for, fused.silu_mul
    calls = []

    def counted(g, u):
        calls.append(g.shape[0])
        return real(g, u)

    fused.silu_mul = counted
    import strata.ops.registry as registry
    registry.load()
    op = registry.op("silu_mul")
    op.kernels = [k if k.name != "triton" else type(k)(k.name, counted, k.when) for k in op.kernels]

    def run(path, fused_on):
        fused.SILU_MUL_GPU_TESTED = fused_on
        fused.use_for = (lambda x: True) if fused_on else torch_rule
        eng = Engine(load_model(path, EngineConfig(device="cpu", dtype="float32")), n_slots=1)
        g = torch.Generator().manual_seed(3)
        prompt = torch.randint(3, 200, (12,), generator=g).tolist()
        return list(eng.generate(prompt, SamplingParams(temperature=0), 8))

    for path in sys.argv[1:]:
        ref = run(path, False)
        calls.clear()
        got = run(path, True)
        assert got == ref, (path, got, ref)
        assert calls, (path, "the fused kernel never ran")
    print("ok")
""")


def test_swiglu_takes_the_fused_silu_mul(hf_and_gguf):
    paths = [str(hf_and_gguf(f)[1]) for f in ("glm4moe", "llama")]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", SCRIPT, *paths], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
