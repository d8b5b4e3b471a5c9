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

from strata.experts.cpu_lane import CpuLane
from strata.experts.resident import ExpertWeights
from strata.quant import formats, random_qtensor
from tests.ops.native_oracle import check_builds, check_lane
from tests.ops.native_oracle import native_or_skip as _native_or_skip

# gate/up format, down format: all-IQ2_S, and IQ2_S gate/up with a Q4_K down
MIXES = [pytest.param(gu, dn, id=f"{gu.name}-{dn.name}") for gu, dn in [(Q.IQ2_S, Q.IQ2_S), (Q.IQ2_S, Q.Q4_K)]]
SHAPES = [(256, 512), (768, 256), (2048, 768)]  # (d, ff)



def _experts(gu, dn, E, d, ff, seed) -> ExpertWeights:
    rng = np.random.default_rng(seed)
    return ExpertWeights(random_qtensor(gu, (E, ff, d), rng), random_qtensor(gu, (E, ff, d), rng),
                         random_qtensor(dn, (E, d, ff), rng))








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
    check_lane(lane, ew, d)



@pytest.mark.parametrize("gu,dn", MIXES)
def test_avx2_and_plain_c_paths_agree(gu, dn):
    """The AVX2 path (sign bytes by a shuffle and compare: -mno-avx512f), the machine's build (masked negation where
    it has AVX-512) and the plain C loops: the same integer sums, float order aside."""
    _native_or_skip()
    E, d, ff = 3, 1280, 768
    ew = _experts(gu, dn, E, d, ff, seed=5)
    check_builds(ew, gu.name, dn.name, d, avx2_exact=True)
