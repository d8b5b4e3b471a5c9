"""KV cache types (-ctk/-ctv): GGML's Q8_0/Q4_0 blocks exactly, attention over a quantized cache close to the
float32 one, sizes, the decode write at a device-side position, and the flags."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata import StrataError
from strata.config import EngineConfig
from strata.kv.cache import KVCache, Segment
from strata.kv.quant import QuantRows, dequantize, quantize
from strata.ops.reference import gqa_attention

BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}


@pytest.mark.parametrize("kind,qt", [("q8_0", Q.Q8_0), ("q4_0", Q.Q4_0)])
def test_blocks_equal_gguf_py(kind, qt):
    """The values and scales are gguf-py's (= ggml's reference quantizer), byte for byte."""
    import gguf.quants

    x = torch.randn(9, 3, 128, generator=torch.Generator().manual_seed(0))
    x[0, 0, :32] = 0  # an all-zero block: scale 0, no division by it
    qs, d = quantize(x, kind)
    ref = gguf.quants.quantize(x.numpy(), qt).view(np.uint8).reshape(9, 3, 4, BLOCK_BYTES[kind])
    assert torch.equal(d, torch.from_numpy(ref[..., :2].copy()).view(torch.float16).squeeze(-1))
    assert torch.equal(qs, torch.from_numpy(ref[..., 2:].copy()).reshape(9, 3, -1))
    from strata.quant.dequant import dequantize as gguf_dequantize

    flat = torch.from_numpy(ref.reshape(-1, BLOCK_BYTES[kind]).copy())
    expect = gguf_dequantize(flat, qt, (9 * 3 * 4, 32)).reshape(9, 3, 128)
    assert torch.equal(dequantize(qs, d, kind, 128, torch.float32), expect)


def test_row_not_a_multiple_of_32_is_padded():
    x = torch.randn(5, 2, 40)
    qs, d = quantize(x, "q8_0")
    assert qs.shape == (5, 2, 64) and d.shape == (5, 2, 2)
    y = dequantize(qs, d, "q8_0", 40, torch.float32)
    assert y.shape == x.shape and (y - x).abs().max() <= x.abs().max() / 127


def _filled(k_type, v_type, k, v):
    kv = KVCache(1, 2, 64, tuple(k.shape[1:]), tuple(v.shape[1:]), torch.float32, "cpu", k_type, v_type)
    kv.write(0, Segment(1, 0, k.shape[0]), k, v)
    return kv


@pytest.mark.parametrize("k_type,v_type", [("q8_0", "q8_0"), ("q8_0", None), (None, "q8_0"), ("q4_0", "q8_0")])
def test_attention_over_quantized_cache_close_to_f32(k_type, v_type):
    """Q8_0 rounds each value by at most half a step, amax/254 of its block: for unit-normal keys and values the
    attention output moves by under 1e-2; Q4_0 (16 levels) by about fifteen times that. The bounds are 2-4x
    what these seeds give, and each case must differ from f32 (the rows really are quantized)."""
    g = torch.Generator().manual_seed(1)
    L, hkv, H, D = 48, 2, 8, 64
    k, v, q = torch.randn(L, hkv, D, generator=g), torch.randn(L, hkv, D, generator=g), torch.randn(6, H, D, generator=g)
    mask = torch.arange(L).unsqueeze(0) <= torch.arange(L - 6, L).unsqueeze(1)
    ref_kv = _filled(None, None, k, v)
    got_kv = _filled(k_type, v_type, k, v)
    ref = gqa_attention(q, *ref_kv.read(0, Segment(1, L - 6, 6)), mask, D ** -0.5)
    ks, vs = got_kv.read(0, Segment(1, L - 6, 6))
    assert ks.dtype == vs.dtype == torch.float32 and ks.shape == (L, hkv, D)
    got = gqa_attention(q, ks, vs, mask, D ** -0.5)
    err = (got - ref).abs().max().item()
    bound = 0.3 if k_type == "q4_0" else 0.03
    assert 0 < err <= bound, f"{k_type}/{v_type}: max error {err:.3g}"


def test_decode_write_at_equals_segment_write():
    """write_at (a device-side position: the captured decode step) stores what write stores."""
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(10, 2, 32, generator=g), torch.randn(10, 2, 32, generator=g)
    a = _filled("q8_0", "q4_0", k, v)
    b = KVCache(1, 2, 64, (2, 32), (2, 32), torch.float32, "cpu", "q8_0", "q4_0")
    for i in range(10):
        b.write_at(0, 1, torch.tensor([i]), k[i:i + 1], v[i:i + 1])
    for x, y in zip(a.read_window(0, 1, 16), b.read_window(0, 1, 16)):
        assert torch.equal(x, y)


def test_save_and_load_rows_copy_the_blocks_as_stored():
    k, v = torch.randn(12, 2, 32), torch.randn(12, 2, 32)
    kv = _filled("q8_0", "q8_0", k, v)
    rows = kv.save_rows(0, 1, 12, "k")
    assert [t.dtype for t in rows] == [torch.uint8, torch.float16] and rows[0].shape == (12, 2, 32)
    kv.load_rows(0, 0, 12, rows, "k")
    assert torch.equal(kv.k[0].qs[0, :12], kv.k[0].qs[1, :12]) and torch.equal(kv.k[0].d[0, :12], kv.k[0].d[1, :12])
    kv.copy_prefix(1, 0, 12)
    assert torch.equal(kv.read_window(0, 0, 12)[1], kv.read_window(0, 1, 12)[1])


def test_bytes_per_token_and_nbytes_follow_the_types():
    k_shape, v_shape = (4, 128), (4, 128)
    bf16 = KVCache.bytes_per_token(3, k_shape, v_shape, torch.bfloat16)
    q8 = KVCache.bytes_per_token(3, k_shape, v_shape, torch.bfloat16, "q8_0", "q8_0")
    assert bf16 == 3 * 2 * 4 * 128 * 2 and q8 == 3 * 2 * 4 * 4 * 34  # 34 bytes per 32 values
    assert 0.5 < q8 / bf16 < 0.54
    mixed = KVCache.bytes_per_token(3, k_shape, v_shape, torch.bfloat16, "q4_0", torch.float32)
    assert mixed == 3 * (4 * 4 * 18 + 4 * 128 * 4)
    kv = KVCache(3, 2, 16, k_shape, v_shape, torch.bfloat16, "cpu", "q8_0", "q8_0")
    assert kv.nbytes == q8 * 2 * 16 == sum(QuantRows.bytes_per_row(128, "q8_0") * 4 * 2 * 16 for _ in range(6))
    mla = KVCache.bytes_per_token(2, (1, 576), None, torch.bfloat16, "q8_0", "q8_0")  # the latent follows -ctk
    assert mla == 2 * 18 * 34


def test_default_cache_is_the_plain_one():
    kv = KVCache(2, 1, 8, (2, 16), (2, 16), torch.float32, "cpu")
    assert not kv.quantized and all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in kv.k + kv.v)
    cfg = EngineConfig(device="cpu")
    assert cfg.kv_cache_types == (torch.float32, torch.float32) == (cfg.torch_kv_dtype,) * 2


def test_flags_resolve_per_k_and_v():
    assert EngineConfig(device="cpu", cache_type_k="q8_0").kv_cache_types == ("q8_0", torch.float32)
    assert EngineConfig(device="cpu", kv_dtype="bf16", cache_type_v="q4_0").kv_cache_types == (torch.bfloat16,
                                                                                              "q4_0")
    both = EngineConfig(device="cpu", kv_dtype="q8_0")  # --kv-dtype sets both, reads in the compute dtype
    assert both.kv_cache_types == ("q8_0", "q8_0") and both.torch_kv_dtype == torch.float32
    same = EngineConfig(device="cpu", cache_type_k="f16", cache_type_v="f16")  # = --kv-dtype f16: the plain cache
    assert same.torch_kv_dtype == torch.float16 and same.kv_cache_types == (torch.float16, torch.float16)
    with pytest.raises(StrataError, match="--cache-type-k must be one of"):
        EngineConfig(device="cpu", cache_type_k="q5_1").validate()


def test_unknown_type_is_one_error_line(capsys):
    from strata.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "-p", "hi", "-ctk", "q5_1"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "error" in ln]
    assert e.value.code == 2 and len(lines) == 1
    assert "-ctk/--cache-type-k" in lines[0] and "'q5_1'" in lines[0] and "q8_0" in lines[0]


def test_hadamard_is_orthonormal_and_its_own_inverse():
    from strata.kv.quant import hadamard, rotation_order

    for n in (32, 64, 128, 256):
        h = hadamard(n)
        assert torch.allclose(h @ h, torch.eye(n), atol=1e-5) and torch.equal(h, h.T)
    assert [rotation_order(p) for p in (32, 64, 96, 128, 160, 256, 512, 576)] == [32, 64, 32, 128, 32, 256, 256, 64]
    with pytest.raises(ValueError):
        hadamard(48)


def _outlier_keys(g, L, hkv, D):
    """Keys as real models have them: a few channels many times larger than the rest."""
    k = torch.randn(L, hkv, D, generator=g)
    k[..., [3, 17, D - 5]] *= 25.0
    return k


@pytest.mark.parametrize("D", [128, 40])
def test_q4_0_rotation_tames_outlier_channels(D):
    """q4_0 rows are rotated before quantizing (strata.kv.quant): with outlier channels in the keys, attention
    over the rotated cache is markedly closer to float32 than over the same blocks unrotated."""
    g = torch.Generator().manual_seed(5)
    L, hkv, H = 64, 2, 8
    k, v, q = _outlier_keys(g, L, hkv, D), torch.randn(L, hkv, D, generator=g), torch.randn(4, H, D, generator=g)
    mask = torch.arange(L).unsqueeze(0) <= torch.arange(L - 4, L).unsqueeze(1)
    ref = gqa_attention(q, k, v, mask, D ** -0.5)
    errs = {}
    for rotated in (True, False):
        rk, rv = (QuantRows(1, L, (hkv, D), "q4_0", "cpu", rotated=rotated) for _ in range(2))
        rk.write(0, 0, L, k)
        rv.write(0, 0, L, v)
        ks, vs = rk.read(0, L, torch.float32), rv.read(0, L, torch.float32)
        assert ks.shape == (L, hkv, D)
        errs[rotated] = ((gqa_attention(q, ks, vs, mask, D ** -0.5) - ref).norm() / ref.norm()).item()
    assert QuantRows(1, 4, (hkv, D), "q4_0", "cpu").h is not None  # the default for q4_0
    assert QuantRows(1, 4, (hkv, D), "q8_0", "cpu").h is None
    assert errs[True] < 0.7 * errs[False], errs  # (seen: 0.18 against 0.33 at D = 128)
