"""The IQ2_XXS / IQ3_XXS dot products of the native CPU kernel: the AVX-512 path (grid lookups by byte permutes,
masked signs; where the CPU has VBMI and BITALG), the AVX2 path and the plain C loops must give the same integer
sums, so the same outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata.experts.resident import ExpertWeights
from strata.ops import cpu_native
from strata.quant import random_qtensor


def _build(extra, march=True):
    if cpu_native.load() is None:
        pytest.skip("no C compiler: the native CPU kernel is unavailable here")
    if not any(f.startswith("-march") for f in cpu_native.FLAGS):
        pytest.skip("the default build is already portable")
    lib = cpu_native.build([f for f in cpu_native.FLAGS if march or not f.startswith("-march")] + extra)
    if lib is None:
        pytest.skip(f"the build with {extra} failed here")
    return lib


# (d, ff): odd and even numbers of super-blocks a row, so that IQ2_XXS's pairs of rows (a gate row and its up row,
# two down rows) meet both a last super-block of each row paired across the rows and none
@pytest.mark.parametrize("d,ff", [(768, 512), (512, 768)])
@pytest.mark.parametrize("gu,dn", [(Q.IQ2_XXS, Q.IQ3_XXS), (Q.IQ3_XXS, Q.IQ2_XXS), (Q.IQ2_XXS, Q.IQ2_XXS)])
def test_avx2_and_avx512_paths_agree(gu, dn, d, ff):
    avx2 = _build(["-mno-avx512f"])  # the AVX2 path, also on a CPU with AVX-512
    rng = np.random.default_rng(21)
    E = 3
    ew = ExpertWeights(random_qtensor(gu, (E, ff, d), rng), random_qtensor(gu, (E, ff, d), rng),
                       random_qtensor(dn, (E, d, ff), rng))
    kw = dict(fmt_gate_up=gu.name, fmt_down=dn.name, threads=1)
    x = torch.randn(3, d, generator=torch.Generator().manual_seed(8))
    a = cpu_native.NativeExperts(ew.gate.raw, ew.up.raw, ew.down.raw, lib=avx2, **kw)([0, 1, 2], x)
    b = cpu_native.NativeExperts(ew.gate.raw, ew.up.raw, ew.down.raw, **kw)([0, 1, 2], x)
    assert torch.equal(a, b)  # the same integer sums, reduced in the same order
    plain = _build(["-mno-avx2", "-mno-fma"], march=False)
    c = cpu_native.NativeExperts(ew.gate.raw, ew.up.raw, ew.down.raw, lib=plain, **kw)([0, 1, 2], x)
    assert ((c - b).norm() / b.norm()).item() < 1e-4  # the plain loops sum in float per sub-block
