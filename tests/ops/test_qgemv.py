"""The decode GEMV on CUDA against the float32 reference (dequantize + matmul)."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata.quant import qmatmul, random_qtensor
from strata.quant.matmul import reference_qmatmul

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("qt", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0])
@pytest.mark.parametrize("rows", [1, 3, 8, 33])
def test_qgemv_matches_reference(qt, rows, monkeypatch):
    from strata.ops import expert_triton, qgemv
    from strata.quant import matmul

    # every format with a tile, the ones not yet taken on GPUs (expert_triton.K_ON_GPU) too
    monkeypatch.setattr(expert_triton, "K_ON_GPU", expert_triton.K_ON_GPU | {qt})
    monkeypatch.setattr(matmul, "KERNELS", dict(matmul.KERNELS))
    assert qgemv.install()
    w = random_qtensor(qt, (1000, 2048), rng=1, scale=0.05)
    x = torch.randn(rows, 2048, generator=torch.Generator().manual_seed(2))
    ref = reference_qmatmul(x, w)
    out = qmatmul(x.cuda(), w.to("cuda")).cpu()
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 1e-5, rel
    out = qmatmul(x.cuda().bfloat16(), w.to("cuda")).float().cpu()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2
