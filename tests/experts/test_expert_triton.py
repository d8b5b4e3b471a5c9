"""The fused Triton expert kernels, run in Triton's interpreter on the CPU against the torch grouped op.

Covers misses (negative slots), mixed formats, a Q8_0 down projection whose K (96) leaves a partial block tile,
N (ff = 96) not a multiple of the rows per program, and K in several iterations (forced block_k)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import numpy as np, torch
    from gguf import GGMLQuantizationType as Q
    from strata.ops.expert_gather import _torch_gather_ffn
    from strata.ops.expert_triton import plan, supports, triton_expert_ffn
    from strata.quant import random_qtensor
    rng = np.random.default_rng(0)
    cpu = torch.device("cpu")
    # block_n = 64: few programs (the interpreter is slow); one case takes the planner's choice
    for qg, qd, d, ff, bn, bk in ((Q.Q4_K, Q.Q4_K, 256, 256, 64, None), (Q.Q4_K, Q.Q8_0, 256, 96, 64, None),
                                  (Q.Q6_K, Q.Q6_K, 256, 256, 64, None), (Q.Q8_0, Q.Q6_K, 64, 256, None, None),
                                  (Q.Q4_K, Q.Q6_K, 512, 256, 64, 256)):
        if qd == Q.Q8_0:
            assert plan((qd,), d, ff, 3, cpu, bn, bk)[2] is False, "the down tile must have masked blocks"
        if bk:
            assert plan((qg, qg), ff, d, 3, cpu, bn, bk)[1] < d, "several iterations"
        g, u = (random_qtensor(qg, (2, ff, d), rng) for _ in range(2))
        dn = random_qtensor(qd, (2, d, ff), rng)
        assert supports(g, u, dn)
        slots = torch.tensor([1, -1, 0])
        x = torch.randn(3, d).bfloat16()
        y = triton_expert_ffn(x, g, u, dn, slots, block_n=bn, block_k=bk)
        ref = _torch_gather_ffn(x.float(), g, u, dn, slots.clamp(min=0))
        assert y.dtype == torch.float32 and torch.equal(y[1], torch.zeros(d)), "a miss gives zeros"
        for i in (0, 2):
            rel = ((y[i] - ref[i]).norm() / ref[i].norm()).item()
            assert rel < 1e-5, (qg.name, qd.name, i, rel)
    print("ok")
""")


def test_triton_kernels_match_the_torch_op_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
