"""qmatmul: x @ W.T equals float32 matmul over gguf-py's dequantized weight, on every format."""

import warnings

import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf import GGMLQuantizationType as Q

from strata import StrataError
from strata.quant import QTensor, qmatmul, random_qtensor, type_name
from strata.quant import dequant as dequant_mod
from strata.quant import matmul as matmul_mod

from quant_helpers import ALL_TYPES, block_len

pytestmark = pytest.mark.exact_cpu  # float oracles: CPU qmatmul stays the float32 reference


def _oracle(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        wf = torch.from_numpy(gguf_dequantize(w.raw.cpu().numpy(), w.qtype))      # [out, in] float32
    return x.cpu().float() @ wf.T


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float().cpu() - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=type_name)
def test_qmatmul_matches_gguf_dequant(qtype):
    w = random_qtensor(qtype, (40, 3 * block_len(qtype)), 2)
    x = torch.randn(2, 3, w.shape[1], generator=torch.Generator().manual_seed(0))   # [B, T, in]
    y = qmatmul(x, w)
    assert y.shape == (2, 3, 40) and y.dtype == torch.float32
    assert _rel(y, _oracle(x, w)) <= 1e-5


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.BF16], ids=type_name)
def test_chunked_rows_match(qtype, monkeypatch):
    w = random_qtensor(qtype, (37, 2 * block_len(qtype)), 4)
    x = torch.randn(5, w.shape[1])
    monkeypatch.setattr(dequant_mod, "CHUNK_ELEMENTS", 3 * w.shape[1])            # 3 rows per chunk
    assert _rel(qmatmul(x, w), _oracle(x, w)) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_output_in_input_dtype(dtype):
    w = random_qtensor(Q.Q4_K, (16, 512), 0)
    x = torch.randn(4, 512).to(dtype)
    y = qmatmul(x, w)
    assert y.dtype == dtype and y.shape == (4, 16)
    assert _rel(y, _oracle(x, w)) <= 1e-2


def test_expert_view_and_single_token():
    w = random_qtensor(Q.Q5_K, (6, 24, 256), 3)                                    # [n_expert, out, in]
    x = torch.randn(256)
    y = qmatmul(x, w[4])
    assert y.shape == (24,)
    assert _rel(y, _oracle(x[None], w[4])[0]) <= 1e-5


def test_kernels_plug_in_by_device_and_format(monkeypatch):
    calls = []

    def fake(x2d, w):
        calls.append(w.qtype)
        return torch.zeros(x2d.shape[0], w.shape[0])

    monkeypatch.setitem(matmul_mod.KERNELS, ("cpu", Q.Q8_0), fake)
    w8, w4 = random_qtensor(Q.Q8_0, (8, 64), 0), random_qtensor(Q.Q4_0, (8, 64), 0)
    x = torch.randn(3, 64)
    assert torch.equal(qmatmul(x, w8), torch.zeros(3, 8))
    assert qmatmul(x, w4).abs().sum() > 0                                          # others keep the default
    assert calls == [Q.Q8_0]


def test_bad_shapes_are_refused():
    w = random_qtensor(Q.Q8_0, (2, 8, 64), 0)
    with pytest.raises(StrataError, match="2-D"):
        qmatmul(torch.randn(3, 64), w)
    with pytest.raises(StrataError, match="features"):
        qmatmul(torch.randn(3, 32), w[0])


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=type_name)
def test_cuda_qmatmul(qtype):
    w = random_qtensor(qtype, (48, 2 * block_len(qtype)), 5)
    x = torch.randn(7, w.shape[1])
    ref = _oracle(x, w)
    wc = w.to("cuda")
    y32 = qmatmul(x.cuda(), wc)
    assert y32.device.type == "cuda" and y32.dtype == torch.float32
    from strata.ops.dp4a_triton import rounds_activations

    # TF32 may be on for float32 GEMMs on the GPU; float32 activations keep the float tiles (the dp4a tiles round
    # half-precision ones to int8 per 32)
    assert _rel(y32, ref) <= (1e-2 if rounds_activations(qtype, x.dtype) else 1e-3)
    y16 = qmatmul(x.cuda().bfloat16(), wc)
    assert y16.dtype == torch.bfloat16
    assert _rel(y16, ref) <= 2e-2
