"""The native CPU kernel's Q5_K and MXFP4 dot products (strata/ops/cpu_native_fmt.h), through the CPU lane's
entry (CpuLane -> NativeExperts), against gguf-py's dequantizer and a float matmul: at the tolerance the Q4_K tests
use, and tighter against the kernel's own activation rounding emulated in numpy (which isolates the weights'
decoding: a wrong fifth bit or exponent on a few weights fails it). The AVX2 build and the plain C loops agree."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from strata.experts.cpu_lane import CpuLane
from strata.experts.resident import ExpertWeights
from strata.ops import cpu_native
from strata.quant import QTensor, formats, random_qtensor

# gate/up format, down format: all-Q5_K, the K-quant mixes that keep Q5_K for some projections, all-MXFP4
MIXES = [pytest.param(gu, dn, id=f"{gu.name}-{dn.name}")
         for gu, dn in [(Q.Q5_K, Q.Q5_K), (Q.Q5_K, Q.Q6_K), (Q.Q4_K, Q.Q5_K), (Q.MXFP4, Q.MXFP4)]]
# (d, ff): K from 256 to 2048 for both the gate/up rows (K = d) and the down rows (K = ff)
SHAPES = [(256, 512), (768, 256), (1280, 1024), (2048, 768)]


def _native_or_skip():
    if cpu_native.load() is None:
        pytest.skip("no C compiler: the native CPU kernel is unavailable here")


def _mxfp4(shape, rng) -> QTensor:
    """MXFP4 weights with block scales spread over 2^-14..2^-1, and a few blocks at e = 0 and 1 (gguf-py's
    subnormal scales 2^-128, 2^-127) and e = 2 (the first normal one)."""
    rows, k = int(np.prod(shape[:-1])), shape[-1]
    blocks = rng.integers(0, 256, size=(rows * k // 32, 17), dtype=np.uint8)
    e = rng.integers(114, 128, size=blocks.shape[0])
    edge = rng.random(blocks.shape[0]) < 0.02
    e[edge] = rng.integers(0, 3, size=int(edge.sum()))
    blocks[:, 0] = e.astype(np.uint8)
    return QTensor.from_raw(torch.from_numpy(blocks.reshape(rows, -1)), Q.MXFP4, tuple(shape))


def _experts(gu, dn, E, d, ff, seed) -> ExpertWeights:
    rng = np.random.default_rng(seed)

    def one(qt, shape):
        return _mxfp4(shape, rng) if qt == Q.MXFP4 else random_qtensor(qt, shape, rng)

    return ExpertWeights(one(gu, (E, ff, d)), one(gu, (E, ff, d)), one(dn, (E, d, ff)))


def _deq(w: QTensor, e: int) -> np.ndarray:
    """Expert e's [rows, K] weight from gguf-py's dequantizer (the reference), float64."""
    rows, k = w.shape[1], w.shape[2]
    return dequantize(w[e].raw.numpy(), w.qtype).reshape(rows, k).astype(np.float64)


def _silu(g):
    return g / (1.0 + np.exp(-g))


def _reference(ew: ExpertWeights, e: int, x: np.ndarray) -> np.ndarray:
    """gguf-py dequantize + a float matmul: silu(x G^T) * (x U^T) D^T, x [T, d]."""
    g, u, dn = (_deq(w, e) for w in (ew.gate, ew.up, ew.down))
    return (_silu(x @ g.T) * (x @ u.T)) @ dn.T


def _int8_rows(x: np.ndarray) -> np.ndarray:
    """The kernel's quantize_row: per 256, int8 = rint(x * 127/amax) in float32, times amax/127 back (float32)."""
    x = x.astype(np.float32).reshape(x.shape[0], -1, 256)
    amax = np.abs(x).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(x * inv), -127, 127)
    return (q * (amax / np.float32(127))).reshape(x.shape[0], -1).astype(np.float64)


def _emulated(ew: ExpertWeights, e: int, x: np.ndarray) -> np.ndarray:
    """The reference with the kernel's int8 rounding of the activations and of the intermediate."""
    g, u, dn = (_deq(w, e) for w in (ew.gate, ew.up, ew.down))
    xq = _int8_rows(x)
    return _int8_rows(_silu(xq @ g.T) * (xq @ u.T)) @ dn.T


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("d,ff", SHAPES)
@pytest.mark.parametrize("gu,dn", MIXES)
def test_the_lane_takes_the_format_and_matches_gguf_py(gu, dn, d, ff, caplog, monkeypatch):
    _native_or_skip()
    monkeypatch.setattr(formats, "_WARNED", set())
    E = 3
    ew = _experts(gu, dn, E, d, ff, seed=d + ff)
    with caplog.at_level(logging.WARNING, logger="strata"):
        lane = CpuLane({0: ew}, kernel="auto", dtype=torch.bfloat16)
    assert lane.kernel[0] == "native" and lane.nbytes() == 0
    assert not [r for r in caplog.records if "no fast kernel" in r.getMessage()]  # no reference-path warning
    x = torch.randn(7, d, generator=torch.Generator().manual_seed(d))
    # 7 (expert, token) rows in one call, split over the lane's threads: rows of all three experts
    jobs = [(2, torch.tensor([0, 3, 6])), (0, torch.tensor([1, 2])), (1, torch.tensor([5, 4]))]
    got = lane.run(0, x, jobs).numpy()
    xn = x.numpy().astype(np.float64)
    r = 0
    for e, tok in jobs:
        idx = tok.numpy()
        ref, emu = _reference(ew, e, xn[idx]), _emulated(ew, e, xn[idx])
        out = got[r:r + len(idx)]
        r += len(idx)
        assert _rel(out, ref) < 3e-2  # the Q4_K tests' tolerance: int8 activations
        assert _rel(out, emu) < 2e-3  # the weights exactly (1e-7 here); float order can flip a rounding tie
    one = lane.expert(0, 1, x[:2])  # the one-expert entry too
    assert _rel(one.numpy(), _reference(ew, 1, xn[:2])) < 3e-2


def _build(flags):
    if not any(f.startswith("-march") for f in cpu_native.FLAGS):
        pytest.skip("the default build is already portable")
    lib = cpu_native.build(flags)
    if lib is None:
        pytest.skip(f"the build with {flags} failed here")
    return lib


@pytest.mark.parametrize("gu,dn", MIXES)
def test_avx2_and_plain_c_paths_agree(gu, dn):
    """The AVX2 path (also where the CPU has AVX-512: -mno-avx512f) and the plain C loops (no -march) give the
    machine's build's outputs: the same integer sums, float order aside."""
    _native_or_skip()
    avx2 = _build([*cpu_native.FLAGS, "-mno-avx512f"])
    plain = _build([f for f in cpu_native.FLAGS if not f.startswith("-march")] + ["-mno-avx2", "-mno-fma"])
    E, d, ff = 3, 1280, 768
    ew = _experts(gu, dn, E, d, ff, seed=5)
    kw = dict(fmt_gate_up=gu.name, fmt_down=dn.name, threads=1)
    x = torch.randn(5, d, generator=torch.Generator().manual_seed(9))
    ex, rows = [0, 2, 1, 2, 0], [0, 1, 2, 3, 4]
    base = cpu_native.NativeExperts(ew.gate.raw, ew.up.raw, ew.down.raw, **kw)(ex, x, rows)
    for lib in (avx2, plain):
        out = cpu_native.NativeExperts(ew.gate.raw, ew.up.raw, ew.down.raw, lib=lib, **kw)(ex, x, rows)
        assert ((out - base).norm() / base.norm()).item() < 1e-4
    for i, e in enumerate(ex):
        assert _rel(base[i].numpy(), _reference(ew, e, x[i:i + 1].numpy().astype(np.float64))[0]) < 3e-2


def test_mxfp4_subnormal_scales_are_gguf_pys():
    """Down rows made only of blocks at e = 0, 1, 2 (scales 2^-128, 2^-127, 2^-126: gguf-py's e8m0_to_fp32_half,
    the first two subnormal): their outputs are ~1e-36, far below the others, so compared element by element."""
    _native_or_skip()
    E, d, ff, tiny = 2, 512, 768, 8
    ew = _experts(Q.MXFP4, Q.MXFP4, E, d, ff, seed=13)
    raw = ew.down.raw.numpy().reshape(E, d, ff // 32, 17)  # a view: the experts' stored bytes
    raw[:, :tiny, :, 0] = np.random.default_rng(2).integers(0, 3, size=(E, tiny, ff // 32))
    lane = CpuLane({0: ew}, kernel="auto", dtype=torch.bfloat16)
    assert lane.kernel[0] == "native"
    x = torch.randn(3, d, generator=torch.Generator().manual_seed(6))
    for e in range(E):
        got = lane.expert(0, e, x).numpy()[:, :tiny].astype(np.float64)
        want = _emulated(ew, e, x.numpy().astype(np.float64))[:, :tiny]
        assert 0 < np.abs(want).max() < 1e-30
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
        ref = _reference(ew, e, x.numpy().astype(np.float64))[:, :tiny]
        assert _rel(got, ref) < 3e-2
