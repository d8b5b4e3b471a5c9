"""The CPU lane's kernels against the reference expert FFN, the int4 repack against the reference dequantizer,
the grouped slot-pool op, and the cost measurements."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from strata import StrataError
from strata.experts import costs
from strata.experts.cpu_lane import CpuLane, _q4_0_unpack, _q4k_unpack, _q8_0_unpack, int4_supported
from strata.experts.resident import ExpertWeights, expert_ffn
from strata.ops.expert_gather import gather_expert_ffn
from strata.quant import random_qtensor
from tests.experts.tiered_model import Q

pytestmark = pytest.mark.exact_cpu  # float oracles: CPU qmatmul stays the float32 reference


def _experts(qtype, E=4, d=256, ff=256, seed=0) -> ExpertWeights:
    rng = np.random.default_rng(seed)
    return ExpertWeights(random_qtensor(qtype, (E, ff, d), rng), random_qtensor(qtype, (E, ff, d), rng),
                         random_qtensor(qtype, (E, d, ff), rng))


@pytest.fixture(scope="module")
def q4k():
    return _experts(Q.Q4_K)


@pytest.mark.parametrize("qtype,unpack", [(Q.Q4_K, _q4k_unpack), (Q.Q4_0, _q4_0_unpack)])
def test_int4_repack_is_the_format_exactly(qtype, unpack):
    # (q - 8) * scale + zero in float32 reproduces the reference dequantizer up to float32 rounding: the only
    # loss of the int4 kernel is the bf16 rounding of scale and zero
    w = random_qtensor(qtype, (128, 512), rng=3)
    q, scale, zero = unpack(w.raw.numpy(), 128, 512)
    assert q.min() >= 0 and q.max() <= 15 and scale.shape == (128, 16)
    rebuilt = (q.astype(np.float32).reshape(128, 16, 32) - 8) * scale[..., None] + zero[..., None]
    ref = w.dequantize().numpy()
    np.testing.assert_allclose(rebuilt.reshape(128, 512), ref, rtol=0, atol=4e-6 * np.abs(ref).max())


def test_q8_0_as_two_int4_halves_is_exact():
    w = random_qtensor(Q.Q8_0, (64, 128), rng=4)
    q, scale, zero = _q8_0_unpack(w.raw.numpy(), 64, 128)
    assert q.shape == (64, 256) and q.max() <= 15
    vals = (q.astype(np.float32).reshape(64, 8, 32) - 8) * scale[..., None] + zero[..., None]  # [64, 8 groups, 32]
    rebuilt = vals[:, :4].reshape(64, 128) + vals[:, 4:].reshape(64, 128)  # the two halves of the doubled k
    ref = w.dequantize().numpy()
    np.testing.assert_allclose(rebuilt, ref, rtol=0, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0])
def test_int4_kernel_matches_reference_in_bf16(q4k, qtype):
    ew = q4k if qtype == Q.Q4_K else _experts(Q.Q8_0, d=256, ff=128)
    lane = CpuLane({7: ew}, kernel="int4", dtype=torch.bfloat16)
    assert lane.kernel[7] == "int4"
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    for e in range(ew.n_experts):
        ref = expert_ffn(x, ew.gate[e], ew.up[e], ew.down[e])  # float32 oracle
        got = lane.expert(7, e, x.bfloat16())
        assert got.dtype == torch.float32
        rel = ((got - ref).norm() / ref.norm()).item()
        assert rel < 2e-2, rel  # bf16 activations, scales and output


def test_auto_kernel_choice_and_ref_is_exact(q4k):
    q8 = _experts(Q.Q8_0, d=64, ff=64)
    q6 = _experts(Q.Q6_K, d=256, ff=256, E=2)
    lane = CpuLane({0: q4k, 1: q8, 2: q6}, dtype=torch.bfloat16)
    from strata.ops import cpu_native

    q4k_kernel = "native" if cpu_native.load() is not None else "int4"  # native where a C compiler builds it
    q6k_kernel = "native" if cpu_native.load() is not None else "ref"
    assert lane.kernel == {0: q4k_kernel, 1: "int4", 2: q6k_kernel}
    assert CpuLane({0: q4k}, dtype=torch.float32).kernel == {0: "ref"}  # float32: the exact path
    assert not int4_supported(q6)
    with pytest.raises(StrataError, match="int4"):
        CpuLane({2: q6}, kernel="int4", dtype=torch.bfloat16)
    ref_lane = CpuLane({1: q8}, dtype=torch.float32)
    x = torch.randn(5, 64)
    jobs = [(2, torch.tensor([0, 3])), (0, torch.tensor([1, 2, 4]))]  # float32 activations: ref
    out = ref_lane.run(1, x, jobs)
    want = torch.cat([expert_ffn(x[t], q8.gate[e], q8.up[e], q8.down[e]) for e, t in jobs])
    assert torch.equal(out, want)


def test_prepare_repacks_every_expert_once(q4k):
    lane = CpuLane({0: q4k}, kernel="int4", dtype=torch.bfloat16)
    assert lane.nbytes() == 0
    lane.prepare()
    n = lane.nbytes()
    # 4 bits per weight + a bf16 scale and zero per 32 weights = 5 bits per weight
    assert n == q4k.n_experts * 3 * 256 * 256 * 5 // 8
    lane.prepare()
    assert lane.nbytes() == n


@pytest.mark.parametrize("qtype,dtype", [(Q.Q8_0, torch.float32), (Q.Q4_K, torch.float32), (Q.F16, torch.bfloat16)])
def test_gather_expert_ffn_matches_per_expert(qtype, dtype):
    ew = _experts(qtype, E=5, d=256, ff=256, seed=1)
    slots = torch.tensor([4, 0, 4, 2, 1, 3])
    x = torch.randn(len(slots), 256, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = gather_expert_ffn(x, ew.gate, ew.up, ew.down, slots)
    want = torch.stack([expert_ffn(x[i:i + 1].float(), ew.gate[s], ew.up[s], ew.down[s])[0]
                        for i, s in enumerate(slots.tolist())])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert ((got - want).norm() / want.norm()).item() < tol


def test_cost_measurements_are_positive(q4k):
    ms = costs.measure_cpu_expert_ms(q4k, threads=1, dtype=torch.bfloat16, passes=1)
    assert ms > 0 and math.isfinite(ms)
    assert torch.get_num_threads() >= 1
    assert costs.measure_pcie_expert_ms(q4k, "cpu", passes=1) > 0
    assert costs.measure_gpu_expert_ms(q4k, "cpu", passes=1) > 0
    assert 0 < costs.measure_gpu_pair_ms(q4k, "cpu", dtype=torch.float32, tokens=16, n=2, passes=1) < 1e3
    gap = costs.measure_cpu_expert_ms(q4k, threads=1, dtype=torch.bfloat16, passes=1, gap_ms=0.05)
    assert gap > 0 and math.isfinite(gap)
    ms, gbps, kind = costs.cpu_bandwidth(q4k, 1, passes=1)
    assert kind in ("int4", "native") and gbps > 0
    cm = costs.measure_cost_model(q4k, torch.device("cpu"), torch.bfloat16, threads=1)
    assert cm.cpu_ms_per_expert > 0 and cm.cpu_overhead_ms == 0.0


def _native_or_skip():
    from strata.ops import cpu_native

    if cpu_native.load() is None:
        pytest.skip("no C compiler: the native CPU kernel is unavailable here")


def test_native_kernel_matches_reference(q4k):
    """The compiled Q4_K kernel (int8 activations, the weights exactly) against the float32 reference: every
    expert, one token and several, one call for many experts, the lane's three entry points."""
    _native_or_skip()
    ew = _experts(Q.Q4_K, E=5, d=512, ff=256, seed=2)
    lane = CpuLane({3: ew}, kernel="auto", dtype=torch.bfloat16)
    assert lane.kernel[3] == "native" and lane.nbytes() == 0  # no repacked copy
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(1))
    ref = {e: expert_ffn(x, ew.gate[e], ew.up[e], ew.down[e]).float() for e in range(5)}
    for e in range(5):
        got = lane.expert(3, e, x)
        assert got.dtype == torch.float32 and got.shape == (4, 512)
        assert ((got - ref[e]).norm() / ref[e].norm()).item() < 3e-2
    many = lane.run_experts(3, x[1:2].bfloat16(), [4, 0, 2])
    for i, e in enumerate([4, 0, 2]):
        assert ((many[i] - ref[e][1]).norm() / ref[e][1].norm()).item() < 3e-2
    jobs = [(2, torch.tensor([0, 3])), (1, torch.tensor([2]))]
    out = lane.run(3, x, jobs)
    want = torch.stack([ref[2][0], ref[2][3], ref[1][2]])
    assert ((out - want).norm() / want.norm()).item() < 3e-2
    # float32 activations keep the exact reference under auto
    assert CpuLane({3: ew}, kernel="auto", dtype=torch.float32).kernel[3] == "ref"


@pytest.mark.parametrize("gu,dn", [(Q.Q6_K, Q.Q6_K), (Q.Q4_K, Q.Q6_K), (Q.Q8_0, Q.Q8_0), (Q.Q8_0, Q.Q6_K),
                                   (Q.IQ4_XS, Q.IQ4_XS), (Q.IQ4_XS, Q.Q6_K), (Q.IQ2_XXS, Q.IQ3_XXS),
                                   (Q.IQ3_XXS, Q.IQ3_XXS), (Q.IQ2_XXS, Q.IQ2_XXS)])
def test_native_kernel_takes_q6_k_and_q8_0(gu, dn):
    """Q6_K projections (the down projections of Q4_K_M files; all of a Q6_K file), Q8_0 ones and the i-quants
    (IQ4_XS; IQ2_XXS gate/up with IQ3_XXS down, the 2-bit mixes' recipe) against the reference."""
    _native_or_skip()
    rng = np.random.default_rng(7)
    E, d, ff = 3, 512, 256
    ew = ExpertWeights(random_qtensor(gu, (E, ff, d), rng), random_qtensor(gu, (E, ff, d), rng),
                       random_qtensor(dn, (E, d, ff), rng))
    lane = CpuLane({0: ew}, kernel="auto", dtype=torch.bfloat16)
    assert lane.kernel[0] == "native"
    x = torch.randn(2, d, generator=torch.Generator().manual_seed(3))
    for e in range(E):
        ref = expert_ffn(x, ew.gate[e], ew.up[e], ew.down[e]).float()
        got = lane.expert(0, e, x)
        assert ((got - ref).norm() / ref.norm()).item() < 3e-2


def test_native_kernel_is_deterministic_and_thread_count_free(q4k):
    _native_or_skip()
    from strata.ops.cpu_native import NativeExperts

    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(5))
    a = NativeExperts(q4k.gate.raw, q4k.up.raw, q4k.down.raw, threads=1)([1, 3], x)
    b = NativeExperts(q4k.gate.raw, q4k.up.raw, q4k.down.raw, threads=2)([1, 3], x)
    assert torch.equal(a, b)  # rows are split across threads, each row summed in one order
    with pytest.raises(ValueError, match="out of range"):
        NativeExperts(q4k.gate.raw, q4k.up.raw, q4k.down.raw)([9], x[:1])


def test_native_kernel_unavailable_falls_back(q4k, monkeypatch):
    import strata.ops.cpu_native as native

    monkeypatch.setattr(native, "_tried", True)
    monkeypatch.setattr(native, "_lib", None)
    assert CpuLane({0: q4k}, kernel="auto", dtype=torch.bfloat16).kernel[0] == "int4"
    with pytest.raises(StrataError, match="native CPU kernel"):
        CpuLane({0: q4k}, kernel="native", dtype=torch.bfloat16)


@pytest.mark.parametrize("gu,dn", [(Q.Q4_K, Q.Q4_K), (Q.Q4_K, Q.Q6_K), (Q.Q8_0, Q.Q8_0), (Q.IQ2_XXS, Q.IQ3_XXS),
                                   (Q.IQ4_XS, Q.IQ4_XS)])
def test_native_kernel_portable_path(gu, dn):
    """The kernel built without -march=native (no AVX2: the plain C loops other CPUs run) against the reference
    and against the machine's build."""
    _native_or_skip()
    from strata.ops import cpu_native

    if not any(f.startswith("-march") for f in cpu_native.FLAGS):
        pytest.skip("the default build is already portable")
    plain = cpu_native.build([f for f in cpu_native.FLAGS if not f.startswith("-march")] + ["-mno-avx2", "-mno-fma"])
    if plain is None:
        pytest.skip("the portable build failed here")
    rng = np.random.default_rng(11)
    E, d, ff = 2, 512, 256
    ew = ExpertWeights(random_qtensor(gu, (E, ff, d), rng), random_qtensor(gu, (E, ff, d), rng),
                       random_qtensor(dn, (E, d, ff), rng))
    kw = dict(fmt_gate_up=gu.name, fmt_down=dn.name, threads=1)
    x = torch.randn(2, d, generator=torch.Generator().manual_seed(4))
    a = cpu_native.NativeExperts(ew.gate.raw, ew.up.raw, ew.down.raw, lib=plain, **kw)([0, 1], x)
    b = cpu_native.NativeExperts(ew.gate.raw, ew.up.raw, ew.down.raw, **kw)([0, 1], x)
    for i, e in enumerate([0, 1]):
        ref = expert_ffn(x[i:i + 1], ew.gate[e], ew.up[e], ew.down[e]).float()[0]
        assert ((a[i] - ref).norm() / ref.norm()).item() < 3e-2
    assert ((a - b).norm() / b.norm()).item() < 1e-4  # the same integer sums, float order aside


def test_a_chunk_runs_at_the_start_up_thread_count(q4k):
    """The decode tuner may set the lane to fewer threads (best for one-token GEMVs); a prefill chunk's CPU share
    still runs at the count the cost model measured, and decode's count is restored after it."""
    before = torch.get_num_threads()
    try:
        lane = CpuLane({0: q4k}, threads=2, dtype=torch.float32)
        lane.set_threads(1)
        seen = []
        inner = lane.run
        lane.run = lambda *a: (seen.append(torch.get_num_threads()), inner(*a))[1]
        x = torch.randn(3, q4k.gate.shape[-1])
        out = lane.run_chunk(0, x, [(1, torch.tensor([0, 2])), (3, torch.tensor([1]))])
        assert seen == [2] and torch.get_num_threads() == 1 and lane.threads == 1
        assert torch.allclose(out[2], lane.expert(0, 3, x[1:2])[0])
    finally:
        torch.set_num_threads(before)


def test_openmp_threads_spin_between_calls_where_a_gpu_is():
    """With a GPU the CPU lane's OpenMP threads keep spinning between a decode's per-layer calls (GOMP_SPINCOUNT,
    set when strata is imported, before torch); without one they spin briefly (the cores are shared with the host's
    work); with a count or wait policy the user set, the environment is left alone."""
    import strata

    env = {}
    strata.omp_spin_default(env, gpu=True)
    assert int(env["GOMP_SPINCOUNT"]) == strata.OMP_SPINCOUNT
    env = {}
    strata.omp_spin_default(env, gpu=False)
    assert int(env["GOMP_SPINCOUNT"]) == strata.CPU_OMP_SPINCOUNT < strata.OMP_SPINCOUNT
    env = {"GOMP_SPINCOUNT": "1000"}
    strata.omp_spin_default(env, gpu=True)
    assert env == {"GOMP_SPINCOUNT": "1000"}
    env = {"OMP_WAIT_POLICY": "passive"}
    strata.omp_spin_default(env, gpu=True)
    assert env == {"OMP_WAIT_POLICY": "passive"}
