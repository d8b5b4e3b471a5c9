"""Dequantization is bit-exact with gguf-py's numpy reference, for every supported format."""

import warnings

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from strata import StrataError
from strata.quant import QTensor, bytes_for, dequantize, random_qtensor, type_name
from strata.quant import dequant as dequant_mod

from quant_helpers import ALL_TYPES, assert_bits_equal, block_len

SHAPES = [(1, 1), (7, 3), (3, 5, 2)]     # rows..., blocks per row (the 3-D one is an expert stack)


def _shape(qtype, spec):
    return (*spec[:-1], spec[-1] * block_len(qtype))


def _gguf(raw: torch.Tensor, qtype) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)       # inf * 0 in fully random blocks
        return gguf_dequantize(raw.numpy(), qtype)


@pytest.mark.parametrize("spec", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=type_name)
def test_random_blocks_match_gguf(qtype, spec):
    shape = _shape(qtype, spec)
    w = random_qtensor(qtype, shape, 7)
    ours = w.dequantize()
    ref = _gguf(w.raw, qtype)
    assert ref.shape == shape
    assert torch.isfinite(ours).all()
    assert_bits_equal(ours, ref)
    assert_bits_equal(dequantize(w.raw, qtype, shape), ref)


@pytest.mark.parametrize("spec", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=type_name)
def test_fully_random_bytes_match_gguf(qtype, spec):
    """Any byte pattern, f16 infs/NaNs and f16 subnormals included, decodes exactly as gguf-py decodes it."""
    shape = _shape(qtype, spec)
    rng = np.random.default_rng(int(qtype) * 100 + len(spec))
    n_rows = int(np.prod(shape[:-1]))
    raw = torch.from_numpy(rng.integers(0, 256, (n_rows, bytes_for(qtype, shape[-1])), dtype=np.uint8))
    raw = raw.view(*shape[:-1], -1)
    ref = _gguf(raw, qtype)
    assert_bits_equal(QTensor.from_raw(raw, qtype, shape).dequantize(), ref)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=type_name)
def test_special_scales(qtype):
    """Blocks whose bytes are all 0x00, all 0xFF, or f16 subnormal/inf patterns repeated."""
    n_bytes = 8 * bytes_for(qtype, 8 * block_len(qtype))
    for pattern in ([0x00], [0xFF], [0x01, 0x00], [0x00, 0x7C], [0x00, 0xFC], [0xFF, 0x03]):
        raw = torch.tensor((pattern * n_bytes)[:n_bytes], dtype=torch.uint8).view(8, -1)
        assert_bits_equal(QTensor.from_raw(raw, qtype, (8, 8 * block_len(qtype))).dequantize(), _gguf(raw, qtype))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=type_name)
def test_chunked_dequant_matches(qtype, monkeypatch):
    """Big tensors are dequantized a chunk at a time; chunk borders must not show."""
    shape = (5, 6 * block_len(qtype))
    w = random_qtensor(qtype, shape, 3)
    monkeypatch.setattr(dequant_mod, "CHUNK_ELEMENTS", 3 * block_len(qtype) + 1)
    assert_bits_equal(w.dequantize(), _gguf(w.raw, qtype))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=type_name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_other_dtypes_are_the_float32_result_cast(qtype, dtype):
    w = random_qtensor(qtype, (4, 2 * block_len(qtype)), 5)
    got = w.dequantize(dtype)
    assert got.dtype == dtype
    assert torch.equal(got, w.dequantize().to(dtype))


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=type_name)
def test_float_formats_at_unaligned_offsets(qtype):
    """Memory-mapped data need not start on an element boundary of the tensor's dtype view."""
    shape = (3, 64)
    n = bytes_for(qtype, 3 * 64)
    buf = torch.from_numpy(np.random.default_rng(0).integers(0, 256, n + 1, dtype=np.uint8))
    raw = buf[1:]
    w = QTensor.from_raw(raw, qtype, shape)
    assert w.raw.data_ptr() == raw.data_ptr()
    assert_bits_equal(w.dequantize(), _gguf(raw.clone().view(3, -1), qtype))


def test_dequantize_never_aliases_raw():
    raw = torch.from_numpy(np.random.default_rng(0).standard_normal((4, 32), dtype=np.float32))
    w = QTensor.from_raw(raw, Q.F32, (4, 32))
    out = w.dequantize()
    out.zero_()
    assert raw.abs().sum() > 0


@pytest.mark.parametrize("qtype", [Q.NVFP4, Q.Q1_0, Q.Q8_1, Q.Q8_K, Q.I8])
def test_unsupported_types_are_named(qtype):
    raw = torch.zeros(4, 256, dtype=torch.uint8)
    for call in (lambda: QTensor.from_raw(raw, qtype, (4, 256)),
                 lambda: dequantize(raw, qtype, (4, 256)),
                 lambda: random_qtensor(qtype, (4, 256), 0)):
        with pytest.raises(StrataError, match=qtype.name):
            call()


@pytest.mark.parametrize("number", [99, 1000])
def test_unknown_type_numbers_are_named(number):
    """A qtype number gguf does not know either: one clear error with the number in it."""
    raw = torch.zeros(4, 256, dtype=torch.uint8)
    for call in (lambda: QTensor.from_raw(raw, number, (4, 256)),
                 lambda: dequantize(raw, number, (4, 256)),
                 lambda: random_qtensor(number, (4, 256), 0)):
        with pytest.raises(StrataError, match=f"unknown GGML weight type {number}"):
            call()


def test_type_helpers():
    assert type_name(Q.Q4_K) == "Q4_K" and type_name(12) == "Q4_K" and type_name("q6_k") == "Q6_K"
    assert bytes_for(Q.Q4_K, 512) == 288
    assert bytes_for(Q.Q8_0, 64) == 68
    assert bytes_for(Q.BF16, 10) == 20
    with pytest.raises(StrataError, match="Q4_K"):
        bytes_for(Q.Q4_K, 100)
    with pytest.raises(StrataError, match="NOPE"):
        type_name("NOPE")


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=type_name)
def test_cuda_matches_gguf(qtype):
    shape = (3, 5, 4 * block_len(qtype))
    w = random_qtensor(qtype, shape, 11)
    wc = w.to("cuda")
    assert wc.device.type == "cuda"
    assert_bits_equal(wc.dequantize(), _gguf(w.raw, qtype))
    raw = torch.from_numpy(np.random.default_rng(1).integers(0, 256, w.nbytes, dtype=np.uint8)).view(w.raw.shape)
    assert_bits_equal(QTensor.from_raw(raw, qtype, shape).to("cuda").dequantize(), _gguf(raw, qtype))


def test_codebooks_come_from_gguf_py():
    """The lookup tables are gguf-py's own (built once per device), not copies that could drift from the oracle."""
    import gguf.quants as gq

    from strata.quant import iquants

    gq.IQ2_XXS.init_grid()
    grid = iquants.table("IQ2_XXS", torch.device("cpu"))
    assert grid.shape == (256, 8) and np.array_equal(grid.numpy(), gq.IQ2_XXS.grid.reshape(256, 8))
    assert iquants.table("IQ2_XXS", torch.device("cpu")) is grid
    assert iquants.table("iq4nl", torch.device("cpu")).tolist() == list(gq.IQ4_NL.kvalues)
    assert iquants.table("mxfp4", torch.device("cpu")).tolist() == list(gq.MXFP4.kvalues)
    signs = iquants.table("ksigns", torch.device("cpu"))                          # [128, 8] of +-1
    bits = np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8)
    assert np.array_equal(signs.numpy() < 0, (bits[:, None] >> np.arange(8)) & 1 == 1)
    for qt in iquants.FORMAT_TABLES:                                              # every format's tables build
        iquants.prepare(qt, torch.device("cpu"))
