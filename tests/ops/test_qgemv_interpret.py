"""The decode GEMV (`qgemv._gemv`, the kernel qmatmul takes on CUDA) run in Triton's interpreter on the CPU
against gguf-py's dequantizer: x @ dequantize(W).T in float64.

Shapes cover the tiles' edges: N not a multiple of the rows per program (masked store of the last tile), K in
several iterations with KW dividing K (no masks), and K whose block count the per-iteration block count does
not divide (masked blocks past the row's end), with the planner's choices and forced ones."""

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
    cpu = torch.device("cpu")
    cases = (  # qtype, N, K, block_n, block_k -> the plan asserted below
        (Q.Q6_K, 40, 512, None, None),   # one iteration, N = 5 tiles of 8
        (Q.Q6_K, 17, 768, None, 512),    # 2 iterations, the second half masked; N tail of 1
        (Q.Q6_K, 5, 768, 2, None),       # 3 even iterations of 256
        (Q.Q4_K, 24, 256, None, None),
        (Q.Q4_K, 7, 768, None, 512),
        (Q.Q4_K, 9, 768, 4, None),
        (Q.Q8_0, 20, 96, None, None),    # 3 blocks in a tile of 4
        (Q.Q8_0, 9, 800, None, 256),     # 25 blocks in tiles of 8: 4 iterations, the last 1/8
        (Q.Q8_0, 9, 256, 2, None),
        (Q.Q5_K, 24, 256, None, None),
        (Q.Q5_K, 7, 768, None, 512),
        (Q.Q2_K, 24, 256, None, None),   # the low K-quants: 2-bit values, Q3_K's third bit and 6-bit scales
        (Q.Q2_K, 7, 768, None, 512),
        (Q.Q3_K, 24, 256, None, None),
        (Q.Q3_K, 9, 768, 4, None),
        (Q.Q3_K, 7, 768, None, 512),
        (Q.Q4_0, 9, 96, None, None),     # the 32-weight formats: a partial tile, K of 1,408 (GLM-4.5-Air's downs)
        (Q.Q4_1, 9, 800, None, 256),
        (Q.Q5_0, 20, 1408, None, None),
        (Q.Q5_1, 7, 256, 2, None),
        (Q.IQ4_XS, 9, 512, None, None),  # dense weights in the lookup formats (qgemv.LOOKUP_GPU_TESTED)
        (Q.IQ2_XXS, 7, 768, None, 512),
        (Q.IQ3_S, 5, 256, None, None),
        (Q.MXFP4, 9, 96, None, None),
    )
    plans = [expert_triton.plan((qt,), N, K, 3, cpu, bn, bk) for qt, N, K, bn, bk in cases]
    assert plans[1][1:3] == (512, False) and plans[2][:3] == (2, 256, True), plans
    assert plans[6][1:3] == (128, False) and plans[7][1:3] == (256, False), plans
    assert any(N % p[0] for (_, N, *_), p in zip(cases, plans)), "some N must end in a partial tile"
    for (qt, N, K, bn, bk), plan in zip(cases, plans):
        w = random_qtensor(qt, (N, K), rng=int(qt) * 1000 + K, scale=0.05)
        ref_w = torch.from_numpy(dequantize(w.raw.numpy(), qt).astype(np.float64)).reshape(N, K)  # [N, K]
        x = torch.randn(3, K, generator=torch.Generator().manual_seed(K))                       # [T, K]
        ref = x.double() @ ref_w.T                                                               # [T, N]
        scale = x.double().abs() @ ref_w.abs().T                                                 # [T, N]
        y = qgemv._gemv(x, w, block_n=bn, block_k=bk)
        assert y.shape == (3, N) and y.dtype == torch.float32
        err = ((y.double() - ref).abs() / scale).max().item()
        assert err < 1e-6, (qt.name, N, K, plan, err)
        if bn or bk:
            continue
        # bf16 activations are read as is and the result is stored in bf16 (float32 sums, one rounding: to
        # nearest on the GPU, truncated by the interpreter, hence 2^-7)
        xb = x.bfloat16()
        yb = qgemv._gemv(xb, w, block_n=bn, block_k=bk)
        assert yb.dtype == torch.bfloat16
        refb = xb.double() @ ref_w.T
        errb = ((yb.double() - refb).abs() - 2.0 ** -7 * refb.abs()).max().item()
        assert errb <= 1e-6 * scale.max().item(), (qt.name, N, K, plan, errb)
    print("ok")
""")


def test_gemv_matches_gguf_dequant_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


ROWS = textwrap.dedent("""
    import numpy as np, torch
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize
    from strata.ops import kquant_rows, qgemv
    from strata.quant import random_qtensor
    cpu = torch.device("cpu")
    cases = (  # qtype, N, K, rows of x, block_n
        (Q.Q8_0, 20, 96, 2, None),    # 3 blocks, KW 32: 3 iterations
        (Q.Q8_0, 9, 1408, 5, 4),      # 44 blocks, KW 128 (4 blocks), N tail of 1
        (Q.Q4_K, 17, 768, 3, None),   # 3 iterations of one superblock
        (Q.Q4_K, 8, 512, 8, 2),
        (Q.Q6_K, 13, 512, 4, None),
        (Q.Q6_K, 5, 768, 7, 4),
    )
    for qt, N, K, T, bn in cases:
        assert kquant_rows.usable(T, qt, K)
        w = random_qtensor(qt, (N, K), rng=int(qt) * 1000 + K + T, scale=0.05)
        ref_w = torch.from_numpy(dequantize(w.raw.numpy(), qt).astype(np.float64)).reshape(N, K)
        x = torch.randn(T, K, generator=torch.Generator().manual_seed(K + T))
        ref = x.double() @ ref_w.T
        scale = x.double().abs() @ ref_w.abs().T
        y = qgemv._gemv(x, w, block_n=bn, rows=True)
        assert y.shape == (T, N) and y.dtype == torch.float32
        err = ((y.double() - ref).abs() / scale).max().item()
        assert err < 1e-6, (qt.name, N, K, T, err)
        one = qgemv._gemv(x, w, rows=False)  # the one-row kernel: the same sums up to float32 rounding
        assert ((y.double() - one.double()).abs() / scale).max().item() < 1e-6
        # bf16 activations and output, as the engine calls it
        yb = qgemv._gemv(x.bfloat16(), w, block_n=bn, rows=True)
        refb = x.bfloat16().double() @ ref_w.T
        assert yb.dtype == torch.bfloat16
        assert ((yb.double() - refb).abs() - 2.0 ** -7 * refb.abs()).max().item() <= 1e-6 * scale.max().item()
    assert not kquant_rows.usable(1, Q.Q4_K, 256) and not kquant_rows.usable(9, Q.Q4_K, 256)
    assert not kquant_rows.usable(2, Q.Q5_K, 256) and not kquant_rows.usable(2, Q.Q4_K, 96)
    print("ok")
""")


def test_gemv_of_several_rows_decodes_once_and_matches_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", ROWS], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
