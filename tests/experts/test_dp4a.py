"""The dp4a tiles of Q8_0, Q4_K, IQ2_XXS, IQ2_S and IQ3_XXS (`strata.ops.dp4a_triton`: four weights a step
against activations rounded to int8 per 32), in Triton's interpreter on the CPU and compiled on a GPU.

Two oracles: with activations the int8 rounding leaves unchanged (int8 values times a power of two per 32) the tiles
equal the float64 product with gguf-py's dequantized weights; with any activations they equal W @ quantize_x(x)
(the rounding's torch twin) up to a rounding tie decided the other way (a GPU's division is not IEEE's), and stay
within the rounding's error of the float product."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

COMMON = textwrap.dedent("""
    import numpy as np, torch, triton, triton.language as tl
    from gguf import GGMLQuantizationType as Q
    from strata.ops import dp4a_triton as dp
    import sys
    # iq: the i-quants' tiles, kq: the K-quants', all: both, wide: the i-quants' with 64-bit table reads (C_WIDE),
    # signs: those with IQ2_XXS's and IQ3_XXS's signs computed from their index (C_ASIGN), parts: every tile, signs
    # computed, Q8_0's and the i-quants' summed once after the loop (C_PARTS), sel: as parts, IQ2_XXS's and IQ2_S's
    # weights by byte permutes (C_SEL)
    KIND = sys.argv[1] if len(sys.argv) > 1 else "all"
    dp.C_DP4A = tl.constexpr(KIND != "kq")  # before any kernel compiles in this process
    dp.C_KQ = tl.constexpr(KIND in ("kq", "all", "parts", "sel"))
    dp.C_WIDE = tl.constexpr(KIND in ("wide", "signs", "parts", "sel"))
    dp.C_ASIGN = tl.constexpr(KIND in ("signs", "parts", "sel"))
    dp.C_PARTS = tl.constexpr(KIND in ("parts", "sel"))
    dp.C_SEL = tl.constexpr(KIND == "sel")
    IQ = [Q.IQ2_XXS, Q.IQ2_S, Q.IQ3_XXS] if KIND != "kq" else []
    KQ = [Q.Q4_K, Q.Q8_0, Q.Q6_K, Q.Q5_K, Q.Q2_K, Q.Q3_K] if KIND in ("kq", "all", "parts") else []
    if KIND == "sel":
        IQ, KQ = [Q.IQ2_XXS, Q.IQ2_S], [Q.Q8_0]
    from strata.ops import expert_triton as et
    from strata.ops.expert_gather import _torch_gather_ffn
    from strata.quant import random_qtensor
    from strata.quant.dequant import dequantize

    def deq(t, s):
        return dequantize(t.raw[s].cpu(), t.qtype, tuple(t.shape[1:])).double()

    def exact_x(n, k, gen):
        # int8 values (each block's largest 127) times 2^e per 32: the int8 rounding leaves them as they are
        q = torch.randint(-127, 128, (n, k // 32, 32), generator=gen).float()
        q[:, :, 7] = 127.0 * torch.where(torch.rand(n, k // 32, generator=gen) < 0.5, -1.0, 1.0)
        e = torch.randint(-8, 3, (n, k // 32, 1), generator=gen).float()
        return (q * 2.0 ** e).reshape(n, k)

    def gemv(x, w, slots, bn, kw):
        # the gathered GEMV (the down projection's kernel) of x [P, K] against pool w [S, N, K]
        P, (N, K) = x.shape[0], w.shape[1:]
        out = torch.empty(P, N, device=x.device)
        tab = et.codebooks_for((w.qtype,), out)
        even = K % kw == 0
        et._gemv_kernel[(P * triton.cdiv(N, bn),)](x, dp.quantize_rows(x), w.raw, slots, w.raw, slots, tab, out, P, N, K, w.raw[0].numel(),
                                                   w.raw.shape[-1], QT=int(w.qtype), BN=bn, KW=kw, EVEN=even,
                                                   GATHER=True, HOST=False)
        return out

    def q8_ffn(x, g, u, dn, slots):
        # the expert FFN with x and the GLU's output rounded as the tiles round them, in float64
        out = torch.zeros(len(slots), dn.shape[1], dtype=torch.float64)
        for i, s in enumerate(slots.tolist()):
            if s >= 0:
                xq = dp.quantize_x(x[i].cpu().float()).double()
                a, b = deq(g, s) @ xq, deq(u, s) @ xq
                out[i] = deq(dn, s) @ dp.quantize_x((a / (1 + torch.exp(-a)) * b).float()).double()
        return out

    def rel(a, b):
        return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()
""")

INTERPRETED = COMMON + textwrap.dedent("""
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(0)
    # the rounding kernel against its torch twin: rows of 1,088 (a last program of 2 of its 32 sub-blocks), a zero
    # sub-block, bf16 and float32 x
    for dt in (torch.bfloat16, torch.float32):
        x = torch.randn(3, 1088, generator=gen).to(dt)
        x[1, 64:96] = 0
        words = dp.quantize_rows(x).reshape(3, 34, 9)
        back = words[:, :, :8].contiguous().view(torch.int8).float() * words[:, :, 8:].contiguous().view(torch.float32)
        assert torch.equal(back.reshape(3, 1088), dp.quantize_x(x)), dt
    # exact: every format, one iteration and several, a partial last tile (K = 768 in tiles of 512)
    for qt in IQ + KQ:
        for K, kw in ((512, 512), (512, 256), (768, 512)):
            w = random_qtensor(qt, (2, 64, K), rng)
            x = exact_x(3, K, gen)
            slots = torch.tensor([1, 0, 1])
            y = gemv(x, w, slots, 32, kw)
            for i, s in enumerate(slots.tolist()):
                r = deq(w, s) @ x[i].double()
                assert rel(y[i], r) < 1e-6, (qt.name, K, kw, i, rel(y[i], r))
            # the tile's own rounding differs from x's: the float product is no longer the answer
            xr = torch.randn(1, K)
            yr = gemv(xr, w, slots[:1], 32, kw)
            assert rel(yr[0], deq(w, 1) @ dp.quantize_x(xr[0]).double()) < 5e-3
            assert 1e-5 < rel(yr[0], deq(w, 1) @ xr[0].double()) < 3e-2, qt.name
    # the GLU kernel (gate and up in these formats, x exact) under an IQ4_XS down, which reads its input as floats:
    # the float product, with a miss, misses read from a host stack, a token's choices on its one row of x
    for qg, d in ((Q.IQ2_XXS, 512), (Q.IQ2_S, 256), (Q.IQ3_XXS, 768), (Q.Q4_K, 512), (Q.Q8_0, 256), (Q.Q6_K, 256),
                  (Q.Q5_K, 512), (Q.Q2_K, 256), (Q.Q3_K, 512)):
        ff = 256
        g, u = (random_qtensor(qg, (2, ff, d), rng) for _ in range(2))
        dn = random_qtensor(Q.IQ4_XS, (2, d, ff), rng)
        # (bf16 activations, exact in bf16: float32 ones keep the float tiles, dp4a_triton.rounds_activations)
        x = exact_x(4, d, gen).bfloat16()
        slots = torch.tensor([1, -1, 0, 1])
        y = et.triton_expert_ffn(x, g, u, dn, slots, block_n=32)
        ref = _torch_gather_ffn(x.float(), g, u, dn, slots.clamp(min=0))
        assert torch.equal(y[1], torch.zeros(d))
        for i in (0, 2, 3):
            assert rel(y[i], ref[i]) < 1e-5, (qg.name, i, rel(y[i], ref[i]))
        hg, hu = (random_qtensor(qg, (3, ff, d), rng) for _ in range(2))
        hd = random_qtensor(Q.IQ4_XS, (3, d, ff), rng)
        eids = torch.tensor([2, 0, 1, 2])
        yh = et.triton_expert_ffn(x, g, u, dn, slots, block_n=32, host=(hg, hu, hd), eids=eids)
        refh = _torch_gather_ffn(x.float(), hg, hu, hd, eids)
        assert rel(yh[1], refh[1]) < 1e-5 and rel(yh[0], ref[0]) < 1e-5
        y2 = et.triton_expert_ffn(x[:2], g, u, dn, slots, block_n=32, repeat=2)
        ref2 = _torch_gather_ffn(x[:2].float().repeat_interleave(2, 0), g, u, dn, slots.clamp(min=0))
        for i in (0, 2, 3):
            assert rel(y2[i], ref2[i]) < 1e-5, ("repeat", qg.name, i)
    # the whole FFN in these formats with any activations: the rounding's error, no more (a tie in the GLU's output
    # decided the other way moves a result by ~0.5%)
    for qg, qd, d, ff in ((Q.IQ2_XXS, Q.IQ3_XXS, 512, 256), (Q.IQ2_S, Q.IQ2_XXS, 256, 256), (Q.IQ3_XXS, Q.IQ2_S, 256, 512),
                          (Q.Q4_K, Q.Q8_0, 512, 256), (Q.Q8_0, Q.Q4_K, 256, 512), (Q.Q6_K, Q.Q6_K, 256, 256),
                          (Q.Q5_K, Q.Q6_K, 512, 256), (Q.Q2_K, Q.Q3_K, 512, 256)):
        g, u = (random_qtensor(qg, (2, ff, d), rng) for _ in range(2))
        dn = random_qtensor(qd, (2, d, ff), rng)
        x = torch.randn(3, d).bfloat16()
        slots = torch.tensor([1, -1, 0])
        y = et.triton_expert_ffn(x, g, u, dn, slots, block_n=64)
        ref = q8_ffn(x, g, u, dn, slots)
        fl = _torch_gather_ffn(x.float(), g, u, dn, slots.clamp(min=0))
        for i in (0, 2):
            assert rel(y[i], ref[i]) < 2e-2 and rel(y[i], fl[i]) < 5e-2, (qg.name, qd.name, i)
    # float32 activations keep the float tiles (the exact path by choice), half-precision ones are rounded to int8
    for qt in IQ[:1] + KQ[:1]:
        g, u, dn = (random_qtensor(qt, (2, 256, 256), rng) for _ in range(3))
        x, slots = torch.randn(2, 256, generator=gen), torch.tensor([0, 1])
        assert not dp.rounds_activations(qt, torch.float32) and dp.rounds_activations(qt, torch.bfloat16)
        y32 = et.triton_expert_ffn(x, g, u, dn, slots, block_n=64)
        y16 = et.triton_expert_ffn(x.bfloat16(), g, u, dn, slots, block_n=64)
        fl32 = _torch_gather_ffn(x, g, u, dn, slots)
        fl16 = _torch_gather_ffn(x.bfloat16().float(), g, u, dn, slots)
        for i in range(2):
            assert rel(y32[i], fl32[i]) < 1e-5 and 1e-4 < rel(y16[i], fl16[i]) < 5e-2, (qt.name, i)
    print("ok")
""")

GPU = COMMON + textwrap.dedent("""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    for qt in IQ + KQ:
        for K, kw in ((2048, 512), (2048, 2048), (768, 512)):
            w = random_qtensor(qt, (3, 768, K), 1, device=dev)
            x = exact_x(4, K, gen).to(dev)
            slots = torch.tensor([2, 0, 1, 2], device=dev)
            y = gemv(x, w, slots, 8, kw)
            for i, s in enumerate(slots.tolist()):
                assert rel(y[i], deq(w, s) @ x[i].cpu().double()) < 1e-6, (qt.name, K, kw, i)
    cases = [(Q.IQ2_XXS, Q.IQ3_XXS, 2048, 768), (Q.IQ2_S, Q.IQ2_S, 2048, 768), (Q.IQ3_XXS, Q.IQ2_XXS, 768, 512),
             (Q.Q4_K, Q.Q4_K, 2048, 768), (Q.Q8_0, Q.Q8_0, 2048, 768), (Q.Q6_K, Q.Q6_K, 2048, 768),
             (Q.Q5_K, Q.Q5_K, 2048, 768), (Q.Q2_K, Q.Q3_K, 2048, 768)]
    for qg, qd, d, ff in [c for c in cases if c[0] in IQ + KQ]:
        g, u = (random_qtensor(qg, (4, ff, d), s, device=dev) for s in (1, 2))
        dn = random_qtensor(qd, (4, d, ff), 3, device=dev)
        x = torch.randn(6, d, generator=gen).bfloat16().to(dev)
        slots = torch.tensor([3, -1, 0, 2, 1, 0], device=dev)
        for bk in (None, 256):
            y = et.triton_expert_ffn(x, g, u, dn, slots, block_k=bk)
            ref = q8_ffn(x, g, u, dn, slots.cpu())
            assert torch.equal(y[1], torch.zeros_like(y[1]))
            # (the reference rounds the GLU's output as the tiles do, but a value the float32 sums put on the other
            # side of a rounding step moves its block by 1/127 of the block's largest: up to ~0.5% of a row)
            for i in (0, 2, 3, 4, 5):
                assert rel(y[i], ref[i]) < 1e-2, (qg.name, qd.name, bk, i, rel(y[i], ref[i]))
    print("ok")
""")


def _run(script: str, interpret: bool, kind: str = "all"):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, "-c", script, kind], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.parametrize("kind", ["all", "wide", "signs", "parts", "sel"])
def test_dp4a_tiles_in_the_interpreter(kind):
    _run(INTERPRETED, True, kind)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["iq", "kq", "wide", "signs", "parts", "sel"])
def test_cuda_dp4a_tiles(kind):
    """The tiles compiled for the GPU, in a process of their own so that they are what compiles: the i-quants' (iq:
    DP4A_GPU_TESTED is set once it passes), the K-quants' (kq: KQ_DP4A_GPU_TESTED) and the i-quants' with 64-bit
    table reads (wide: WIDE_GPU_TESTED), and with their signs computed (signs: ARITH_SIGNS_GPU_TESTED), Q8_0's and
    the i-quants' summed after the loop (parts: PARTS_GPU_TESTED), IQ2_XXS's and IQ2_S's by byte permutes (sel: SEL_GPU_TESTED)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _run(GPU, False, kind)


def test_quantize_x_rounds_half_away_from_zero():
    import torch

    from strata.ops.dp4a_triton import quantize_x

    x = torch.zeros(32)
    x[0], x[1], x[2], x[3] = 127.0, 0.5, -0.5, 1.5  # scale 1: ties go away from zero
    assert quantize_x(x)[:4].tolist() == [127.0, 1.0, -1.0, 2.0]
    assert torch.equal(quantize_x(torch.zeros(64)), torch.zeros(64))


def test_glu_plan_of_the_dp4a_iquant_tiles(monkeypatch):
    """The expert GLU over gate and up in an i-quant takes 1024 weights a row per iteration where the dp4a tiles
    read it (half-precision activations), 512 otherwise (float32, the K-quants, a single weight)."""
    import torch
    from gguf import GGMLQuantizationType as Q

    from strata.ops import dp4a_triton, expert_triton

    cpu = torch.device("cpu")
    monkeypatch.setattr(dp4a_triton, "C_DP4A", True)
    glu = expert_triton.plan((Q.IQ2_XXS, Q.IQ2_XXS), 768, 2048, 8, cpu, dtype=torch.bfloat16)
    assert glu[1] == expert_triton.KW_DECODE_DP4A_IQ == 1024
    assert expert_triton.plan((Q.IQ2_XXS, Q.IQ2_XXS), 768, 2048, 8, cpu, dtype=torch.float32)[1] == 512
    monkeypatch.setattr(dp4a_triton, "C_KQ", False)
    assert expert_triton.plan((Q.Q4_K, Q.Q4_K), 768, 2048, 8, cpu, dtype=torch.bfloat16)[1] == 512
    assert expert_triton.plan((Q.IQ2_XXS,), 2048, 2048, 8, cpu, dtype=torch.bfloat16)[1] == 512
    monkeypatch.setattr(dp4a_triton, "C_DP4A", False)
    assert expert_triton.plan((Q.IQ2_XXS, Q.IQ2_XXS), 768, 2048, 8, cpu, dtype=torch.bfloat16)[1] == 512


def test_glu_plan_of_the_dp4a_kquant_tiles(monkeypatch):
    """Where Q4_K's and Q8_0's dp4a tiles read the GLU's gate and up, a launch takes twice the programs
    (DP4A_KQ_GLU_PROGRAMS a SM: fewer rows each) and Q4_K 1024 weights a row per iteration up to K = 2048; the
    down projection, float32 activations and the other K-quants keep the plan they had (on a 132-SM GPU: B1's
    GLU (2, 1024) where it was (4, 512))."""
    import torch
    from gguf import GGMLQuantizationType as Q

    from strata.ops import dp4a_triton, expert_triton

    gpu = torch.device("cuda", 0)  # (the plan reads only the SM count, set here: no GPU is touched)
    monkeypatch.setattr(expert_triton, "_sm_count", lambda index: 132)
    monkeypatch.setattr(dp4a_triton, "C_KQ", True)
    bf16 = torch.bfloat16
    assert expert_triton.plan((Q.Q4_K, Q.Q4_K), 768, 2048, 8, gpu, dtype=bf16)[:2] == (2, 1024)  # B1
    assert expert_triton.plan((Q.Q4_K, Q.Q4_K), 512, 2048, 10, gpu, dtype=bf16)[:2] == (2, 1024)  # B2
    assert expert_triton.plan((Q.Q4_K, Q.Q4_K), 1536, 4096, 8, gpu, dtype=bf16)[:2] == (4, 512)  # K = 4096
    # four sequences' experts (P = 32, 40): 4 rows a program at most (8 before)
    assert expert_triton.plan((Q.Q4_K, Q.Q4_K), 768, 2048, 32, gpu, dtype=bf16)[:2] == (4, 1024)
    assert expert_triton.plan((Q.Q4_K, Q.Q4_K), 512, 2048, 40, gpu, dtype=bf16)[:2] == (4, 1024)
    assert expert_triton.plan((Q.Q4_K, Q.Q4_K), 1536, 4096, 32, gpu, dtype=bf16)[:2] == (4, 512)
    assert expert_triton.plan((Q.Q8_0, Q.Q8_0), 768, 2048, 32, gpu, dtype=bf16)[:2] == (8, 512)  # (not measured)
    assert expert_triton.plan((Q.Q8_0, Q.Q8_0), 768, 2048, 8, gpu, dtype=bf16)[:2] == (2, 512)
    assert expert_triton.plan((Q.Q4_K,), 2048, 768, 8, gpu, dtype=bf16)[:2] == (8, 256)  # the down: as before
    assert expert_triton.plan((Q.Q6_K, Q.Q6_K), 768, 2048, 8, gpu, dtype=bf16)[:2] == (4, 512)
    assert expert_triton.plan((Q.Q4_K, Q.Q4_K), 768, 2048, 8, gpu, dtype=torch.float32)[:2] == (4, 512)
    monkeypatch.setattr(dp4a_triton, "C_KQ", False)  # (the float tiles: the plan they were measured with)
    assert expert_triton.plan((Q.Q4_K, Q.Q4_K), 768, 2048, 8, gpu, dtype=bf16)[:2] == (4, 512)


def test_glu_plan_with_sums_after_the_loop(monkeypatch):
    """With the tiles' sums after the loop (C_PARTS) the i-quants' GLU takes one row a program where a row is 4
    iterations or more (K = 4096 at 1024 weights an iteration), two at K = 2048; without them, the rows as before."""
    import torch
    from gguf import GGMLQuantizationType as Q

    from strata.ops import dp4a_triton, expert_triton

    cpu = torch.device("cpu")
    monkeypatch.setattr(dp4a_triton, "C_DP4A", True)
    monkeypatch.setattr(dp4a_triton, "C_PARTS", True)
    iq = (Q.IQ2_XXS, Q.IQ2_XXS)
    assert expert_triton.plan(iq, 1536, 4096, 8, cpu, dtype=torch.bfloat16)[:2] == (1, 1024)
    short = expert_triton.plan(iq, 768, 2048, 8, cpu, dtype=torch.bfloat16)
    assert short[0] > 1 and short[1] == 1024
    assert expert_triton.plan((Q.Q4_K, Q.Q4_K), 1536, 4096, 8, cpu, dtype=torch.bfloat16)[0] > 1
    monkeypatch.setattr(dp4a_triton, "C_PARTS", False)
    assert expert_triton.plan(iq, 1536, 4096, 8, cpu, dtype=torch.bfloat16)[0] > 1
