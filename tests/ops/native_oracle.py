"""What the native CPU kernel's tests compare with (tests/ops/test_cpu_native_*.py): gguf-py's dequantizer and float64
math, and the same with the kernel's int8 rounding of the activations emulated (which isolates the weights'
decoding: a wrong bit on a few weights fails it), plus the builds the portability checks use."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.quants import dequantize

from strata.experts.resident import ExpertWeights
from strata.ops import cpu_native
from strata.quant import QTensor


def native_or_skip() -> None:
    if cpu_native.load() is None:
        pytest.skip("no C compiler: the native CPU kernel is unavailable here")


def build(flags):
    """The kernel built with other flags (-mno-avx512f: the AVX2 path; none: the plain C loops)."""
    if not any(f.startswith("-march") for f in cpu_native.FLAGS):
        pytest.skip("the default build is already portable")
    lib = cpu_native.build(flags)
    if lib is None:
        pytest.skip(f"the build with {flags} failed here")
    return lib


def deq(w: QTensor, e: int) -> np.ndarray:
    """Expert e's [rows, K] weight from gguf-py's dequantizer (the reference), float64."""
    rows, k = w.shape[1], w.shape[2]
    return dequantize(w[e].raw.numpy(), w.qtype).reshape(rows, k).astype(np.float64)


def silu(g):
    return g / (1.0 + np.exp(-g))


def int8_rows(x: np.ndarray) -> np.ndarray:
    """The kernel's quantize_row: per 256 (the last block partial where a row is not a multiple of 256), int8 =
    rint(x * 127/amax) in float32, times amax/127 back."""
    x = x.astype(np.float32)
    out = np.empty(x.shape, dtype=np.float64)
    for b in range(0, x.shape[1], 256):
        blk = x[:, b:b + 256]
        amax = np.abs(blk).max(-1, keepdims=True)
        inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
        out[:, b:b + 256] = np.clip(np.rint(blk * inv), -127, 127) * (amax / np.float32(127))
    return out


def reference(ew: ExpertWeights, e: int, x: np.ndarray, emulate: bool = False) -> np.ndarray:
    """gguf-py dequantize + float64 math: silu(x G^T) * (x U^T) D^T, x [T, d]; with `emulate`, x and the
    intermediate rounded to int8 as the kernel rounds them."""
    g, u, dn = (deq(w, e) for w in (ew.gate, ew.up, ew.down))
    xq = int8_rows(x) if emulate else x
    h = silu(xq @ g.T) * (xq @ u.T)
    return (int8_rows(h) if emulate else h) @ dn.T


def rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def check_lane(lane, ew: ExpertWeights, d: int) -> None:
    """7 (expert, token) rows of three experts in one call of the lane (split over its threads), and the one-expert
    entry: each within the int8 activations' tolerance of gguf-py + float math (3e-2, the Q4_K tests'), and within
    2e-3 of the same with the kernel's rounding emulated (the weights exactly; float order can tip a rounding)."""
    import torch

    x = torch.randn(7, d, generator=torch.Generator().manual_seed(d))
    jobs = [(2, torch.tensor([0, 3, 6])), (0, torch.tensor([1, 2])), (1, torch.tensor([5, 4]))]
    got = lane.run(0, x, jobs).numpy()
    xn = x.numpy().astype(np.float64)
    r = 0
    for e, tok in jobs:
        idx = tok.numpy()
        out = got[r:r + len(idx)]
        r += len(idx)
        assert rel(out, reference(ew, e, xn[idx])) < 3e-2
        assert rel(out, reference(ew, e, xn[idx], emulate=True)) < 2e-3
    one = lane.expert(0, 1, x[:2])
    assert rel(one.numpy(), reference(ew, 1, xn[:2])) < 3e-2


def check_builds(ew: ExpertWeights, gate_up: str, down: str, d: int, avx2_exact: bool = False) -> None:
    """The AVX2 path (-mno-avx512f; bit-exact with the machine's build where `avx2_exact`) and the plain C loops
    (no -march) give the machine's build's outputs, float order aside."""
    import torch

    avx2 = build([*cpu_native.FLAGS, "-mno-avx512f"])
    plain = build([f for f in cpu_native.FLAGS if not f.startswith("-march")] + ["-mno-avx2", "-mno-fma"])
    kw = dict(fmt_gate_up=gate_up, fmt_down=down, threads=1)
    x = torch.randn(5, d, generator=torch.Generator().manual_seed(9))
    ex, rows = [0, 2, 1, 2, 0], [0, 1, 2, 3, 4]
    base = cpu_native.NativeExperts(ew.gate.raw, ew.up.raw, ew.down.raw, **kw)(ex, x, rows)
    for lib, exact in ((avx2, avx2_exact), (plain, False)):
        out = cpu_native.NativeExperts(ew.gate.raw, ew.up.raw, ew.down.raw, lib=lib, **kw)(ex, x, rows)
        assert torch.equal(out, base) if exact else ((out - base).norm() / base.norm()).item() < 1e-4
    for i, e in enumerate(ex):
        assert rel(base[i].numpy(), reference(ew, e, x[i:i + 1].numpy().astype(np.float64))[0]) < 3e-2
