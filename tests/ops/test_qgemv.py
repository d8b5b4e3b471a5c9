"""The decode GEMV on CUDA against the float32 reference (dequantize + matmul)."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata.quant import qmatmul, random_qtensor
from strata.quant.matmul import reference_qmatmul

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("qt", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
                                Q.IQ4_XS, Q.IQ4_NL, Q.IQ2_XXS, Q.IQ2_S, Q.IQ3_XXS, Q.MXFP4, Q.IQ2_XS, Q.IQ3_S,
                                Q.IQ1_S, Q.IQ1_M])
@pytest.mark.parametrize("rows", [1, 3, 8, 33])
def test_qgemv_matches_reference(qt, rows, monkeypatch):
    from strata.ops import expert_triton, iquant_triton, qgemv
    from strata.quant import matmul

    # every format with a tile, the ones not yet taken on GPUs (expert_triton.K_ON_GPU, LOOKUP_ON_GPU) too
    if qt in iquant_triton.FORMATS:
        monkeypatch.setattr(qgemv, "LOOKUP_GPU_TESTED", True)
        monkeypatch.setattr(expert_triton, "LOOKUP_ON_GPU", expert_triton.LOOKUP_ON_GPU | {qt})
    else:
        monkeypatch.setattr(expert_triton, "K_ON_GPU", expert_triton.K_ON_GPU | {qt})
    monkeypatch.setattr(matmul, "KERNELS", dict(matmul.KERNELS))
    assert qgemv.install()
    w = random_qtensor(qt, (1000, 2048), rng=1, scale=0.05)
    x = torch.randn(rows, 2048, generator=torch.Generator().manual_seed(2))
    ref = reference_qmatmul(x, w)
    out = qmatmul(x.cuda(), w.to("cuda")).cpu()
    rel = ((out - ref).norm() / ref.norm()).item()
    from strata.ops.dp4a_triton import rounds_activations

    assert rel < (1e-2 if rounds_activations(qt, x.dtype) else 1e-5), rel  # (x rounded to int8 by the dp4a tiles)
    out = qmatmul(x.cuda().bfloat16(), w.to("cuda")).float().cpu()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("qt", [Q.Q4_K, Q.Q6_K, Q.Q8_0])
@pytest.mark.parametrize("shape", [(1000, 2048), (8192, 384), (77, 768), (2048, 1408)])
def test_gemv_of_several_rows_matches_one_row_kernel(qt, shape):
    """kquant_rows (each block decoded once for 2-8 rows of x) against the one-row kernel and the reference, the
    rows test qgemv.ROWS_GPU_TESTED waits for; shapes: B1's, strata-tiny's head, a partial last program, and a
    row length of 44 Q8_0 blocks (GLM-4.5-Air's 1,408)."""
    from strata.ops import kquant_rows, qgemv

    N, K = shape
    if not kquant_rows.usable(2, qt, K):
        pytest.skip(f"{qt.name} rows of {K}")
    w = random_qtensor(qt, (N, K), rng=N + K, scale=0.05)
    wd = w.to("cuda")
    for T in range(2, 9):
        x = torch.randn(T, K, generator=torch.Generator().manual_seed(T))
        ref = reference_qmatmul(x, w)
        xd = x.cuda()
        rows = qgemv._gemv(xd, wd, rows=True).cpu()
        one = qgemv._gemv(xd, wd, rows=False).cpu()
        assert ((rows - ref).norm() / ref.norm()).item() < 1e-5, T
        from strata.ops.dp4a_triton import rounds_activations

        # (the one-row kernel's dp4a tiles, where taken, round x to int8: the rows kernel keeps floats)
        assert ((rows - one).norm() / ref.norm()).item() < (1e-2 if rounds_activations(qt, x.dtype) else 1e-6), T
        rb = qgemv._gemv(xd.bfloat16(), wd, rows=True).float().cpu()
        assert ((rb - ref).norm() / ref.norm()).item() < 1e-2, T
