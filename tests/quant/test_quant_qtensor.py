"""QTensor: zero-copy wrapping, expert views, device moves, and quantizing with gguf-py's bytes."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize as gguf_quantize

from strata import StrataError
from strata.quant import QTensor, bytes_for, random_qtensor, type_name
from strata.quant.qtensor import QUANTIZABLE_TYPES

from quant_helpers import ALL_TYPES, block_len

QUANTIZABLE = sorted(QUANTIZABLE_TYPES, key=int)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=type_name)
def test_from_memory_mapped_file_without_copy(qtype, tmp_path):
    shape = (4, 3, 2 * block_len(qtype))                 # [n_expert, out, in]
    src = random_qtensor(qtype, shape, 1)
    path = tmp_path / "w.bin"
    path.write_bytes(b"\0" * 32 + src.raw.numpy().tobytes())
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=32)     # read-only, like gguf's reader
    w = QTensor.from_raw(mm, qtype, shape)
    assert w.raw.data_ptr() == mm.ctypes.data                     # no copy
    assert w.raw.shape == (4, 3, bytes_for(qtype, shape[-1]))
    assert w.row_bytes == bytes_for(qtype, shape[-1])
    assert w.nbytes == src.nbytes == 4 * 3 * w.row_bytes
    assert w.shape == shape and w.qtype == qtype and w.device == torch.device("cpu")
    full = w.dequantize()
    assert torch.equal(full, src.dequantize())
    for e in (0, 3, -1):                                         # one expert: a view of its bytes
        ex = w[e]
        assert ex.shape == shape[1:]
        assert ex.raw.data_ptr() == mm.ctypes.data + (e % 4) * 3 * w.row_bytes
        assert torch.equal(ex.dequantize(), full[e])
    assert torch.equal(w[1:3].dequantize(), full[1:3])


def test_float_arrays_are_viewed_as_bytes():
    x = np.random.default_rng(0).standard_normal((5, 32)).astype(np.float16)
    w = QTensor.from_raw(x, Q.F16, (5, 32))
    assert w.raw.dtype == torch.uint8 and w.raw.shape == (5, 64)
    assert w.raw.data_ptr() == x.ctypes.data
    assert torch.equal(w.dequantize(), torch.from_numpy(x.astype(np.float32)))
    t = torch.randn(5, 32)
    assert torch.equal(QTensor.from_raw(t, Q.F32, (5, 32)).dequantize(), t)


def test_flat_bytes_take_the_logical_shape():
    src = random_qtensor(Q.Q4_K, (2, 3, 512), 0)
    w = QTensor.from_raw(src.raw.reshape(-1), Q.Q4_K, (2, 3, 512))
    assert w.raw.shape == (2, 3, 288)
    assert torch.equal(w.dequantize(), src.dequantize())


def test_wrong_sizes_are_refused():
    raw = torch.zeros(4, 144, dtype=torch.uint8)
    with pytest.raises(StrataError, match="bytes"):
        QTensor.from_raw(raw, Q.Q4_K, (4, 512))
    with pytest.raises(StrataError, match="block size"):
        QTensor.from_raw(raw, Q.Q4_K, (4, 100))


def test_to_and_pin_memory_keep_format():
    w = random_qtensor(Q.Q6_K, (2, 256), 0)
    assert w.to("cpu") is w
    moved = w.to(torch.device("cpu"), non_blocking=True)
    assert moved.qtype == Q.Q6_K and moved.shape == w.shape
    pinned = w.pin_memory()
    assert torch.equal(pinned.raw, w.raw) and pinned.qtype == w.qtype and pinned.shape == w.shape
    if torch.cuda.is_available():
        assert pinned.raw.is_pinned()


@pytest.mark.parametrize("shape", [(8, 256), (3, 4, 64)], ids=str)
@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=type_name)
def test_from_float_matches_gguf_quantize(qtype, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(int(qtype))) * 0.05
    x[0, ..., :3] = 0.0                                    # an all-zero run exercises the d == 0 case
    w = QTensor.from_float(x, qtype)
    ref = np.ascontiguousarray(gguf_quantize(x.numpy(), qtype)).view(np.uint8)
    assert w.shape == shape and w.qtype == qtype
    assert w.raw.shape == ref.shape
    assert np.array_equal(w.raw.numpy(), ref)
    err = (w.dequantize() - x).abs().max().item()
    assert err <= {Q.F32: 0.0, Q.F16: 1e-4, Q.BF16: 1e-3, Q.Q8_0: 2e-3}.get(qtype, 0.05)


def test_from_float_refuses_other_formats():
    with pytest.raises(StrataError, match="Q4_K"):
        QTensor.from_float(torch.randn(2, 256), Q.Q4_K)
    with pytest.raises(StrataError, match="Q8_0"):
        QTensor.from_float(torch.randn(2, 48), Q.Q8_0)


@pytest.mark.gpu
def test_cuda_round_trip():
    w = random_qtensor(Q.Q4_K, (4, 8, 256), 0)
    wc = w.pin_memory().to("cuda", non_blocking=True)
    assert wc.device.type == "cuda"
    assert torch.equal(wc[2].dequantize().cpu(), w[2].dequantize())
    assert torch.equal(wc.to("cpu").raw, w.raw)
