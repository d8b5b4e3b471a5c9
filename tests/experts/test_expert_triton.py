"""The fused Triton expert kernels, run in Triton's interpreter on the CPU against the torch grouped op.

Covers misses (negative slots), mixed formats (the K-quants, Q8_0, and the lookup formats IQ2_XXS, IQ3_XXS,
IQ4_XS, MXFP4, IQ2_S, IQ4_NL, IQ2_XS, IQ3_S, IQ1_S, IQ1_M), Q8_0 and MXFP4 down projections whose K (96) leaves a partial block tile,
N (ff = 96) not a multiple of the rows per program, K in several iterations (forced block_k), and misses read
from a second stack by expert id (the host store: `host=`, `eids=`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import numpy as np, torch
    from gguf import GGMLQuantizationType as Q
    from strata.ops.expert_gather import _torch_gather_ffn
    from strata.ops.expert_triton import plan, supports, triton_expert_ffn
    from strata.quant import random_qtensor
    rng = np.random.default_rng(0)
    cpu = torch.device("cpu")
    # block_n = 64: few programs (the interpreter is slow); one case takes the planner's choice
    for qg, qd, d, ff, bn, bk in ((Q.Q4_K, Q.Q4_K, 256, 256, 64, None), (Q.Q4_K, Q.Q8_0, 256, 96, 64, None),
                                  (Q.Q6_K, Q.Q6_K, 256, 256, 64, None), (Q.Q8_0, Q.Q6_K, 64, 256, None, None),
                                  (Q.Q4_K, Q.Q6_K, 512, 256, 64, 256),
                                  # the lookup-table formats (strata.ops.iquant_triton): an MXFP4 down whose K
                                  # (96) leaves a partial tile, an i-quant gate read in two iterations
                                  (Q.IQ4_XS, Q.IQ3_XXS, 256, 256, 64, None), (Q.IQ2_XXS, Q.IQ4_XS, 512, 256, 64, 256),
                                  (Q.MXFP4, Q.MXFP4, 64, 96, 64, None), (Q.IQ3_XXS, Q.IQ2_XXS, 256, 256, None, None),
                                  # Q5_K (the fifth bits): alone, and as the down of a Q4_K expert in 2 iterations
                                  (Q.Q5_K, Q.Q5_K, 256, 256, 64, None), (Q.Q4_K, Q.Q5_K, 512, 256, 64, 256),
                                  # IQ2_S (its 1024-entry grid, explicit sign bytes, two scales a sub-block)
                                  (Q.IQ2_S, Q.IQ2_S, 256, 256, 64, None), (Q.IQ2_S, Q.IQ3_XXS, 512, 256, 64, 256),
                                  # IQ4_NL: a down whose K (96) is not whole 256-blocks, as in B3's recipe; a gate
                                  # read in two iterations
                                  (Q.IQ2_XXS, Q.IQ4_NL, 256, 96, 64, None), (Q.IQ4_NL, Q.IQ4_NL, 128, 64, 64, 64),
                                  # Q2_K / Q3_K (llama.cpp's Q2_K and Q3_K_* mixes: the down a step up)
                                  (Q.Q2_K, Q.Q3_K, 512, 256, 64, 256), (Q.Q3_K, Q.Q4_K, 256, 256, None, None),
                                  # the other i-quants (strata.ops.iquant_x_triton)
                                  (Q.IQ2_XS, Q.IQ3_S, 256, 256, 64, None), (Q.IQ1_S, Q.IQ1_M, 512, 256, 64, 256),
                                  # the 32-weight formats of a K-quant file's short rows (a Q5_0 down of 96)
                                  (Q.Q4_K, Q.Q5_0, 256, 96, 64, None), (Q.Q4_1, Q.Q5_1, 64, 96, None, None)):
        if ff == 96:  # (a 32-block down: Q8_0, MXFP4, IQ4_NL, Q5_0, Q5_1)
            assert plan((qd,), d, ff, 3, cpu, bn, bk)[2] is False, "the down tile must have masked blocks"
        if bk:
            assert plan((qg, qg), ff, d, 3, cpu, bn, bk)[1] < d, "several iterations"
        g, u = (random_qtensor(qg, (2, ff, d), rng) for _ in range(2))
        dn = random_qtensor(qd, (2, d, ff), rng)
        assert supports(g, u, dn)
        slots = torch.tensor([1, -1, 0])
        x = torch.randn(3, d).bfloat16()
        y = triton_expert_ffn(x, g, u, dn, slots, block_n=bn, block_k=bk)
        ref = _torch_gather_ffn(x.float(), g, u, dn, slots.clamp(min=0))
        assert y.dtype == torch.float32 and torch.equal(y[1], torch.zeros(d)), "a miss gives zeros"
        for i in (0, 2):
            rel = ((y[i] - ref[i]).norm() / ref[i].norm()).item()
            assert rel < 1e-5, (qg.name, qd.name, i, rel)
        # misses read where the experts lie (the host store, by expert id) instead of giving zeros
        hg, hu = (random_qtensor(qg, (4, ff, d), rng) for _ in range(2))
        hd = random_qtensor(qd, (4, d, ff), rng)
        eids = torch.tensor([2, 3, 1])
        y = triton_expert_ffn(x, g, u, dn, slots, block_n=bn, block_k=bk, host=(hg, hu, hd), eids=eids)
        refh = _torch_gather_ffn(x.float(), hg, hu, hd, eids)
        for i, r in ((0, ref), (1, refh), (2, ref)):
            rel = ((y[i] - r[i]).norm() / r[i].norm()).item()
            assert rel < 1e-5, ("host", qg.name, qd.name, i, rel)
        # a token's choices read its one row of x (repeat=2: pairs 0, 1 row 0; pairs 2, 3 row 1), no copy made
        slots4 = torch.tensor([1, -1, 0, 1])
        y = triton_expert_ffn(x[:2], g, u, dn, slots4, block_n=bn, block_k=bk, repeat=2)
        ref4 = _torch_gather_ffn(x[:2].float().repeat_interleave(2, 0), g, u, dn, slots4.clamp(min=0))
        assert torch.equal(y[1], torch.zeros(d))
        for i in (0, 2, 3):
            rel = ((y[i] - ref4[i]).norm() / ref4[i].norm()).item()
            assert rel < 1e-5, ("repeat", qg.name, qd.name, i, rel)
    # the 2- and 3-bit formats' two tiles (strata.ops.iquant_triton): the packed ones ran above (the interpreter
    # takes them), the lookup ones (a GPU's until the packed pass there) give the same sums
    import triton.language as tl
    from strata.ops import iquant_triton
    assert iquant_triton.C_PACKED
    for qt in (Q.IQ2_XXS, Q.IQ2_S, Q.IQ3_XXS):
        g, u = (random_qtensor(qt, (2, 256, 512), rng) for _ in range(2))
        dn = random_qtensor(qt, (2, 512, 256), rng)
        x = torch.randn(3, 512).bfloat16()
        slots = torch.tensor([1, -1, 0])
        ref = _torch_gather_ffn(x.float(), g, u, dn, slots.clamp(min=0))
        for packed in (False, True):
            iquant_triton.C_PACKED = tl.constexpr(packed)
            y = triton_expert_ffn(x, g, u, dn, slots, block_n=64)
            for i in (0, 2):
                rel = ((y[i] - ref[i]).norm() / ref[i].norm()).item()
                assert rel < 1e-5, ("tiles", qt.name, packed, i, rel)
    print("ok")
""")


def test_triton_kernels_match_the_torch_op_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("qg,qd,d,ff", [("Q4_K", "Q4_K", 2048, 768), ("Q8_0", "Q6_K", 512, 256),
                                        ("IQ2_XXS", "IQ3_XXS", 2048, 768),
                                        ("IQ4_XS", "MXFP4", 512, 288), ("Q5_K", "Q5_K", 2048, 768),
                                        ("IQ2_S", "IQ2_S", 2048, 768), ("IQ2_XXS", "IQ4_NL", 2048, 1408),
                                        ("Q2_K", "Q3_K", 2048, 768), ("Q3_K", "Q3_K", 2048, 768),
                                        ("IQ2_XS", "IQ3_S", 2048, 768), ("IQ1_S", "IQ1_M", 2048, 768),
                                        ("Q4_K", "Q5_0", 2048, 1408), ("Q4_1", "Q5_1", 2048, 768)])
def test_cuda_misses_read_from_pinned_host_memory(qg, qd, d, ff, monkeypatch):
    """On the GPU the kernels read a missed expert from pinned host RAM (mapped over the bus), through the op
    the direct decode path calls, and equal the torch reference; a pageable stack is left to the reference."""
    import torch
    from gguf import GGMLQuantizationType as Q

    from strata.ops import registry
    from strata.ops.expert_gather import _torch_gather_ffn, two_tier_expert_ffn
    from strata.quant import random_qtensor
    from strata.quant.qtensor import QTensor

    from strata.ops import expert_triton

    # every format's tiles, compiled (those not yet taken on GPUs too)
    monkeypatch.setattr(expert_triton, "LOOKUP_ON_GPU", frozenset(expert_triton.iquant_triton.FORMATS))
    monkeypatch.setattr(expert_triton, "K_ON_GPU", expert_triton.K_ON_GPU | {Q.Q5_K, Q.Q2_K, Q.Q3_K,
                                                                            *expert_triton.Q32})
    dev = torch.device("cuda")
    qg, qd = Q[qg], Q[qd]
    pool = [random_qtensor(qg, (3, ff, d), 1, device=dev), random_qtensor(qg, (3, ff, d), 2, device=dev),
            random_qtensor(qd, (3, d, ff), 3, device=dev)]
    host = [random_qtensor(qg, (6, ff, d), 4), random_qtensor(qg, (6, ff, d), 5), random_qtensor(qd, (6, d, ff), 6)]
    pinned = tuple(QTensor(t.raw.pin_memory(), t.qtype, t.shape) for t in host)
    slots = torch.tensor([2, -1, 0, -1, -1], device=dev)
    eids = torch.tensor([1, 5, 0, 2, 5], device=dev)
    x = torch.randn(5, d, device=dev).bfloat16()
    assert registry.op("two_tier_expert_ffn").pick(x, *pool, slots, pinned, eids).name == "triton"
    assert registry.op("two_tier_expert_ffn").pick(x, *pool, slots, tuple(host), eids) is None
    y = two_tier_expert_ffn(x, *pool, slots, pinned, eids)
    hit = _torch_gather_ffn(x.float(), *pool, slots.clamp(min=0))
    miss = _torch_gather_ffn(x.float(), *[QTensor(t.raw.to(dev), t.qtype, t.shape) for t in host], eids)
    from strata.ops.dp4a_triton import rounds_activations

    tol = 3e-2 if rounds_activations(qg) or rounds_activations(qd) else 1e-5  # (the dp4a tiles round x to int8)
    for i in range(5):
        ref = hit[i] if slots[i] >= 0 else miss[i]
        assert ((y[i] - ref).norm() / ref.norm()).item() < tol, i
    yr = two_tier_expert_ffn(x, *pool, slots, tuple(host), eids)  # the reference twin (bf16 matmuls), pageable
    assert ((yr - y).norm() / y.norm()).item() < 2e-2


PACKED_GPU = textwrap.dedent("""
    import torch, triton.language as tl
    from gguf import GGMLQuantizationType as Q
    from strata.ops import iquant_triton
    iquant_triton.C_PACKED = tl.constexpr(True)  # before any kernel compiles in this process
    from strata.ops import dp4a_triton
    dp4a_triton.C_DP4A = tl.constexpr(False)  # (which would take precedence)
    from strata.ops.expert_gather import _torch_gather_ffn
    from strata.ops.expert_triton import triton_expert_ffn
    from strata.quant import random_qtensor
    dev = torch.device("cuda")
    for qg, qd, d, ff in ((Q.IQ2_XXS, Q.IQ3_XXS, 2048, 768), (Q.IQ2_S, Q.IQ2_S, 2048, 768),
                          (Q.IQ3_XXS, Q.IQ2_XXS, 768, 512)):
        g, u = (random_qtensor(qg, (4, ff, d), s, device=dev) for s in (1, 2))
        dn = random_qtensor(qd, (4, d, ff), 3, device=dev)
        x = torch.randn(6, d, device=dev).bfloat16()
        slots = torch.tensor([3, -1, 0, 2, 1, 0], device=dev)
        for bk in (None, 256):  # one iteration and several
            y = triton_expert_ffn(x, g, u, dn, slots, block_k=bk)
            ref = _torch_gather_ffn(x.float(), g, u, dn, slots.clamp(min=0))
            assert torch.equal(y[1], torch.zeros_like(y[1]))
            for i in (0, 2, 3, 4, 5):
                rel = ((y[i] - ref[i]).norm() / ref[i].norm()).item()
                assert rel < 1e-5, (qg.name, qd.name, bk, i, rel)
    print("ok")
""")


@pytest.mark.gpu
def test_cuda_packed_iquant_tiles_match_the_torch_op():
    """The packed IQ2_XXS / IQ2_S / IQ3_XXS tiles compiled for the GPU (strata.ops.iquant_triton: taken there
    once this passes, PACKED_GPU_TESTED), in a process of their own so that they are what compiles."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", PACKED_GPU], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
