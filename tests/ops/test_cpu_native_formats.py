"""The native CPU kernel's Q5_K, MXFP4 (strata/ops/cpu_native_fmt.h), IQ4_NL, Q2_K, Q3_K (cpu_native_kq.h) and
IQ2_XS, IQ3_S, IQ1_S, IQ1_M (cpu_native_iqx.h), Q4_0, Q4_1, Q5_0, Q5_1 (cpu_native_q32.h) dot products, through the CPU lane's
entry (CpuLane -> NativeExperts), against gguf-py's dequantizer and a float matmul: at the tolerance the Q4_K tests
use, and tighter against the kernel's own activation rounding emulated in numpy (which isolates the weights'
decoding: a wrong fifth bit or exponent on a few weights fails it). The AVX2 build and the plain C loops agree."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata.experts.cpu_lane import CpuLane
from strata.experts.resident import ExpertWeights
from strata.quant import QTensor, formats, random_qtensor
from tests.ops.native_oracle import check_builds, check_lane
from tests.ops.native_oracle import native_or_skip as _native_or_skip
from tests.ops.native_oracle import reference, rel as _rel

# gate/up format, down format: all-Q5_K, the K-quant mixes that keep Q5_K for some projections, all-MXFP4, an
# i-quant mix's IQ4_NL downs (its rows not whole 256-blocks), and the low K-quants of llama.cpp's Q2_K and Q3_K_*
# files (Q2_K or Q3_K gate/up, the downs one step up), and the i-quants of llama.cpp's IQ2_XS / IQ3_S / IQ3_M /
# IQ1_S / IQ1_M files, and the downs of a K-quant file whose rows are not whole 256-blocks (Q5_0, Q5_1, Q4_0)
MIXES = [pytest.param(gu, dn, id=f"{gu.name}-{dn.name}")
         for gu, dn in [(Q.Q5_K, Q.Q5_K), (Q.Q5_K, Q.Q6_K), (Q.Q4_K, Q.Q5_K), (Q.MXFP4, Q.MXFP4),
                        (Q.IQ2_XXS, Q.IQ4_NL), (Q.IQ4_NL, Q.IQ4_NL), (Q.Q2_K, Q.Q3_K), (Q.Q3_K, Q.Q4_K),
                        (Q.Q3_K, Q.Q2_K), (Q.IQ2_XS, Q.IQ3_S), (Q.IQ3_S, Q.IQ4_XS), (Q.IQ1_S, Q.IQ1_M),
                        (Q.IQ1_M, Q.IQ2_XS),
                        # the 32-wide formats llama.cpp writes for rows that are not whole 256-blocks
                        (Q.Q4_K, Q.Q5_0), (Q.Q5_K, Q.Q5_1), (Q.Q3_K, Q.Q4_0), (Q.Q4_1, Q.Q4_1),
                        # the ternary TQ2_0 and TQ1_0
                        (Q.TQ2_0, Q.TQ2_0), (Q.TQ1_0, Q.TQ1_0), (Q.TQ1_0, Q.TQ2_0)]]
# (d, ff): K from 256 to 2048 for both the gate/up rows (K = d) and the down rows (K = ff)
SHAPES = [(256, 512), (768, 256), (1280, 1024), (2048, 768)]


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
    check_lane(lane, ew, d)


@pytest.mark.parametrize("gu,dn", MIXES)
def test_avx2_and_plain_c_paths_agree(gu, dn):
    """The AVX2 path (also where the CPU has AVX-512: -mno-avx512f) and the plain C loops (no -march) give the
    machine's build's outputs: the same integer sums, float order aside."""
    _native_or_skip()
    E, d, ff = 3, 1280, 768
    ew = _experts(gu, dn, E, d, ff, seed=5)
    check_builds(ew, gu.name, dn.name, d, avx2_exact=False)


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
        want = reference(ew, e, x.numpy().astype(np.float64), emulate=True)[:, :tiny]
        assert 0 < np.abs(want).max() < 1e-30
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
        ref = reference(ew, e, x.numpy().astype(np.float64))[:, :tiny]
        assert _rel(got, ref) < 3e-2


def test_iq4_nl_down_rows_that_are_not_whole_256_blocks():
    """GLM-4.5-Air's experts: 1,408-wide down rows (44 IQ4_NL blocks, the activations' last 256-block partial)."""
    _native_or_skip()
    ew = _experts(Q.IQ2_XXS, Q.IQ4_NL, 3, 512, 1408, seed=7)
    lane = CpuLane({0: ew}, kernel="auto", dtype=torch.bfloat16)
    assert lane.kernel[0] == "native"
    check_lane(lane, ew, 512)


def test_k_quant_downs_of_glm_4_5_air_rows():
    """GLM-4.5-Air in a Q4_K_M / Q5_K_M file: 1,408-wide down rows, which llama.cpp's quantizer writes as Q5_0 / Q5_1
    (44 blocks of 32, the activations' last 256-block partial)."""
    _native_or_skip()
    for gu, dn in ((Q.Q4_K, Q.Q5_0), (Q.Q5_K, Q.Q5_1)):
        ew = _experts(gu, dn, 3, 512, 1408, seed=11)
        lane = CpuLane({0: ew}, kernel="auto", dtype=torch.bfloat16)
        assert lane.kernel[0] == "native"
        check_lane(lane, ew, 512)


def test_q4_0_experts_take_the_native_kernel():
    """Q4_0 experts (all of them, or a Q3_K file's downs) are read in place by the native kernel, no int4 repack."""
    _native_or_skip()
    for gu, E in ((Q.Q4_0, 3), (Q.Q3_K, 3)):
        ew = _experts(gu, Q.Q4_0, E, 256, 256, seed=4)
        lane = CpuLane({0: ew}, kernel="auto", dtype=torch.bfloat16)
        assert lane.kernel[0] == "native" and lane.nbytes() == 0
        check_lane(lane, ew, 256)


def test_gate_and_up_in_different_formats():
    """A file whose gate and up projections differ (an override such as llama-quant's --tensor-type): the native
    kernel reads each in its own format."""
    _native_or_skip()
    rng = np.random.default_rng(9)
    E, d, ff = 3, 512, 768
    ew = ExpertWeights(random_qtensor(Q.Q2_K, (E, ff, d), rng), random_qtensor(Q.Q3_K, (E, ff, d), rng),
                       random_qtensor(Q.Q4_K, (E, d, ff), rng))
    lane = CpuLane({0: ew}, kernel="auto", dtype=torch.bfloat16)
    assert lane.kernel[0] == "native"
    check_lane(lane, ew, d)
