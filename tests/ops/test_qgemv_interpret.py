"""The decode GEMV (`qgemv._gemv`, the kernel qmatmul takes on CUDA) run in Triton's interpreter on the CPU
against gguf-py's dequantizer: x @ dequantize(W).T in float64."""

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
    from gguf.quants import dequantize
    from strata.ops import expert_triton, qgemv
    from strata.quant import random_qtensor
    assert Q.Q6_K in expert_triton.SUPPORTED
    # N not a multiple of BLOCK_N (masked tail rows); K of 1 and 2 blocks for the 256-weight formats
    for qt, N, K in ((Q.Q6_K, 40, 512), (Q.Q6_K, 17, 256), (Q.Q4_K, 24, 256), (Q.Q8_0, 20, 96)):
        w = random_qtensor(qt, (N, K), rng=int(qt) * 1000 + K, scale=0.05)
        ref_w = torch.from_numpy(dequantize(w.raw.numpy(), qt).astype(np.float64)).reshape(N, K)  # [N, K]
        x = torch.randn(3, K, generator=torch.Generator().manual_seed(K))                       # [T, K]
        ref = x.double() @ ref_w.T                                                               # [T, N]
        y = qgemv._gemv(x, w)
        assert y.shape == (3, N) and y.dtype == torch.float32
        err = ((y.double() - ref).abs() / (x.double().abs() @ ref_w.abs().T)).max().item()
        assert err < 1e-6, (qt.name, N, K, err)
        # bf16 activations are read as is (converted in registers)
        xb = x.bfloat16()
        yb = qgemv._gemv(xb, w)
        refb = xb.double() @ ref_w.T
        assert ((yb.double() - refb).abs() / (xb.double().abs() @ ref_w.abs().T)).max().item() < 1e-6, qt.name
    print("ok")
""")


def test_gemv_matches_gguf_dequant_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
