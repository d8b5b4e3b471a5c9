"""The native CPU kernel's IQ2_S dot product (strata/ops/cpu_native_iq.h: IQ2_S's 1024-entry grid, sign bytes, two
scales a sub-block), through the CPU lane's entry (CpuLane -> NativeExperts), against gguf-py's dequantizer and a
float matmul: at the tolerance the other native tests use, and tighter against the kernel's own activation rounding
emulated in numpy (a wrong high index bit, sign or scale nibble on a few weights fails it). The AVX2 build
(-mno-avx512f), the plain C loops and the machine's build agree."""

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

# gate/up format, down format: all-IQ2_S, and IQ2_S gate/up with a Q4_K down
MIXES = [pytest.param(gu, dn, id=f"{gu.name}-{dn.name}") for gu, dn in [(Q.IQ2_S, Q.IQ2_S), (Q.IQ2_S, Q.Q4_K)]]
SHAPES = [(256, 512), (768, 256), (2048, 768)]  # (d, ff)


def _native_or_skip():
    if cpu_native.load() is None:
        pytest.skip("no C compiler: the native CPU kernel is unavailable here")


def _experts(gu, dn, E, d, ff, seed) -> ExpertWeights:
    rng = np.random.default_rng(seed)
    return ExpertWeights(random_qtensor(gu, (E, ff, d), rng), random_qtensor(gu, (E, ff, d), rng),
                         random_qtensor(dn, (E, d, ff), rng))


def _deq(w: QTensor, e: int) -> np.ndarray:
    rows, k = w.shape[1], w.shape[2]
    return dequantize(w[e].raw.numpy(), w.qtype).reshape(rows, k).astype(np.float64)


def _silu(g):
    return g / (1.0 + np.exp(-g))


def _reference(ew: ExpertWeights, e: int, x: np.ndarray) -> np.ndarray:
    g, u, dn = (_deq(w, e) for w in (ew.gate, ew.up, ew.down))
    return (_silu(x @ g.T) * (x @ u.T)) @ dn.T


def _int8_rows(x: np.ndarray) -> np.ndarray:
    """The kernel's quantize_row: per 256, int8 = rint(x * 127/amax) in float32, times amax/127 back."""
    x = x.astype(np.float32).reshape(x.shape[0], -1, 256)
    amax = np.abs(x).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(x * inv), -127, 127)
    return (q * (amax / np.float32(127))).reshape(x.shape[0], -1).astype(np.float64)


def _emulated(ew: ExpertWeights, e: int, x: np.ndarray) -> np.ndarray:
    g, u, dn = (_deq(w, e) for w in (ew.gate, ew.up, ew.down))
    xq = _int8_rows(x)
    return _int8_rows(_silu(xq @ g.T) * (xq @ u.T)) @ dn.T


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_the_grid_is_gguf_pys():
    """IQ2_S's grid really spans 1024 entries (a 10-bit index): the high bits of qh select distinct entries."""
    from gguf.quants import IQ2_S

    IQ2_S.init_grid()
    g = IQ2_S.grid.reshape(1024, 8)
    assert set(np.unique(g)) == {8.0, 25.0, 43.0}
    assert len({tuple(r) for r in g}) == 1024


@pytest.mark.parametrize("d,ff", SHAPES)
@pytest.mark.parametrize("gu,dn", MIXES)
def test_the_lane_takes_iq2s_and_matches_gguf_py(gu, dn, d, ff, caplog, monkeypatch):
    _native_or_skip()
    monkeypatch.setattr(formats, "_WARNED", set())
    E = 3
    ew = _experts(gu, dn, E, d, ff, seed=d + ff)
    with caplog.at_level(logging.WARNING, logger="strata"):
        lane = CpuLane({0: ew}, kernel="auto", dtype=torch.bfloat16)
    assert lane.kernel[0] == "native" and lane.nbytes() == 0
    assert not [r for r in caplog.records if "no fast kernel" in r.getMessage()]  # no reference-path warning
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    x = torch.randn(7, d, generator=torch.Generator().manual_seed(d))
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
        assert _rel(out, emu) < 2e-3  # the weights exactly; float order can flip a rounding tie
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
    """The AVX2 path (sign bytes by a shuffle and compare: -mno-avx512f), the machine's build (masked negation where
    it has AVX-512) and the plain C loops: the same integer sums, float order aside."""
    _native_or_skip()
    avx2 = _build([*cpu_native.FLAGS, "-mno-avx512f"])
    plain = _build([f for f in cpu_native.FLAGS if not f.startswith("-march")] + ["-mno-avx2", "-mno-fma"])
    E, d, ff = 3, 1280, 768
    ew = _experts(gu, dn, E, d, ff, seed=5)
    kw = dict(fmt_gate_up=gu.name, fmt_down=dn.name, threads=1)
    x = torch.randn(5, d, generator=torch.Generator().manual_seed(9))
    ex, rows = [0, 2, 1, 2, 0], [0, 1, 2, 3, 4]
    base = cpu_native.NativeExperts(ew.gate.raw, ew.up.raw, ew.down.raw, **kw)(ex, x, rows)
    a = cpu_native.NativeExperts(ew.gate.raw, ew.up.raw, ew.down.raw, lib=avx2, **kw)(ex, x, rows)
    assert torch.equal(a, base)  # the same integer sums, reduced in the same order
    c = cpu_native.NativeExperts(ew.gate.raw, ew.up.raw, ew.down.raw, lib=plain, **kw)(ex, x, rows)
    assert ((c - base).norm() / base.norm()).item() < 1e-4
    for i, e in enumerate(ex):
        assert _rel(base[i].numpy(), _reference(ew, e, x[i:i + 1].numpy().astype(np.float64))[0]) < 3e-2
