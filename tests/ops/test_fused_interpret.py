"""The fused RMSNorm and q/k norm+rotary kernels (`strata.ops.fused`) against their torch twins: in Triton's
interpreter on the CPU, and (marked gpu) compiled on CUDA, including a CUDA-graph replay at new positions."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

# Shared by both runs: DEV is "cpu" under the interpreter, "cuda" on the GPU.
CASES = textwrap.dedent("""
    import torch
    from strata.layers.norm import rms_norm_ref
    from strata.layers.rotary import Rotary
    from strata.models.args import RopeScaling
    from strata.ops import fused
    from strata.ops.reference import qk_norm_rope_kv as qk_norm_rope_kv_ref

    TOL = {torch.float32: 2e-6, torch.bfloat16: 2 ** -7}  # of the largest |value|: float32 rounding, 1 bf16 ulp

    def close(y, ref, dtype, what):
        assert y.dtype == ref.dtype == dtype and y.shape == ref.shape, (what, y.dtype, ref.dtype, y.shape)
        err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        assert err <= TOL[dtype], (what, dtype, err)
        if dtype == torch.bfloat16:  # one rounding apart only where the summation order tips it: a few elements
            assert (y != ref).float().mean().item() <= 0.02, (what, dtype, "elements differing")

    def check_rms_norm(dev):
        g = torch.Generator().manual_seed(0)
        # odd lengths, a 3-D input, a row slice (row stride != D), a row past the one-pass limit (two passes)
        for shape, dtype, sl in (((3, 7), torch.float32, None), ((2, 5, 128), torch.bfloat16, None),
                                 ((2, 2051), torch.bfloat16, None), ((3, 130), torch.float32, 100),
                                 ((2, 8193), torch.float32, None), ((1, 2048), torch.bfloat16, None)):
            x = (torch.randn(shape, generator=g) * 3).to(dev, dtype)
            if sl is not None:
                x = x[:, :sl]
            w = (torch.rand(x.shape[-1], generator=g) + 0.5).to(dev)
            close(fused.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), dtype, ("rms_norm", shape))

    def check_qk_norm_rope(dev):
        g = torch.Generator().manual_seed(1)
        yarn = RopeScaling(kind="yarn", factor=4.0, original_ctx=64)
        # (style, head dim, rotary dims, Hq, Hk, norm, scaling): full and partial rotary, odd head counts
        for style, D, rot, hq, hk, norm, sc in (("neox", 128, 128, 8, 2, True, None),
                                                 ("norm", 128, 128, 5, 1, True, None),
                                                 ("neox", 24, 16, 3, 3, False, None),
                                                 ("norm", 64, 32, 4, 2, True, yarn),
                                                 ("neox", 64, 32, 6, 2, False, yarn),
                                                 ("neox", 128, 64, 6, 2, True, None)):  # GLM-4.5's heads
            r = Rotary(rot, 10000.0, style, 300, sc)
            cos, sin = r._tables(torch.device(dev))
            for dtype in (torch.float32, torch.bfloat16):
                n = 3
                # q and k as views of one fused projection output (row stride != heads * D)
                qkv = torch.randn(n, (hq + 2 * hk) * D, generator=g).to(dev, dtype)
                q = qkv[:, : hq * D].view(n, hq, D)
                k = qkv[:, hq * D : (hq + hk) * D].view(n, hk, D)
                pos = torch.tensor([0, 131, 299]).to(dev)
                qn = (torch.rand(D, generator=g) + 0.5).to(dev) if norm else None
                kn = (torch.rand(D, generator=g) + 0.5).to(dev) if norm else None
                qo, ko = fused.qk_norm_rope(q, k, pos, cos, sin, rot, style == "neox", qn, kn, 1e-6)
                if norm:
                    rq, rk = r.rotate(rms_norm_ref(q, qn, 1e-6), pos), r.rotate(rms_norm_ref(k, kn, 1e-6), pos)
                else:
                    rq, rk = r.rotate(q, pos), r.rotate(k, pos)
                what = (style, D, rot, hq, hk, norm, sc is not None)
                close(qo, rq, dtype, ("q",) + what)
                close(ko, rk, dtype, ("k",) + what)
                # q alone (MLA's rotary): k=None
                qa, none = fused.qk_norm_rope(q, None, pos, cos, sin, rot, style == "neox")
                assert none is None
                close(qa, r.rotate(q, pos), dtype, ("q alone",) + what)
                # a decode step's k' and v written into the layer's cache at (slot t, pos[t]) in the same launch
                v = qkv[:, (hq + hk) * D :].view(n, hk, D)
                kc = torch.zeros(n + 1, 300, hk, D, dtype=dtype).to(dev)
                vc = torch.zeros(n + 1, 300, hk, D, dtype=dtype).to(dev)
                qf, none = fused.qk_norm_rope(q, k, pos, cos, sin, rot, style == "neox", qn, kn, 1e-6, v, kc, vc)
                assert none is None
                close(qf, rq, dtype, ("q, k into the cache",) + what)
                for t in range(n):
                    close(kc[t, pos[t]], rk[t], dtype, ("k in the cache",) + what)
                    assert torch.equal(vc[t, pos[t]], v[t]), what
                    kc[t, pos[t]] = 0
                    vc[t, pos[t]] = 0
                assert not kc.any() and not vc.any(), ("written elsewhere",) + what
                kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
                qr = qk_norm_rope_kv_ref(q, k, v, pos, cos, sin, rot, style == "neox", qn, kn, 1e-6, kr, vr)
                close(qr, rq, dtype, ("twin",) + what)
                assert torch.equal(vr[torch.arange(n), pos], v), what
                # a verify step's tokens, all in slot 1 at their own positions: the slot's rows expanded n times
                # (slot stride 0), kernel and twin
                for fn in (fused.qk_norm_rope_kv, qk_norm_rope_kv_ref):
                    kc = torch.zeros(2, 300, hk, D, dtype=dtype).to(dev)
                    vc = torch.zeros(2, 300, hk, D, dtype=dtype).to(dev)
                    qs = fn(q, k, v, pos, cos, sin, rot, style == "neox", qn, kn, 1e-6,
                            kc[1:2].expand(n, 300, hk, D), vc[1:2].expand(n, 300, hk, D))
                    close(qs, rq, dtype, ("verify rows",) + what)
                    for t in range(n):
                        close(kc[1, pos[t]], rk[t], dtype, ("verify k in the cache",) + what)
                        assert torch.equal(vc[1, pos[t]], v[t]), what
                        kc[1, pos[t]] = 0
                        vc[1, pos[t]] = 0
                    assert not kc.any() and not vc.any(), ("verify rows written elsewhere",) + what
""")

# The interpreter truncates float32 -> bfloat16 where compiled Triton rounds to nearest even (its default for
# downcasts, as torch's): make it round as the GPU does, so bf16 outputs can be compared tightly.
RNE = textwrap.dedent("""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter as _ti
    _cast = _ti.InterpreterBuilder.cast_impl

    def _cast_rne(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            t = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return _ti.TensorHandle(t.view(torch.int16).numpy().view(np.uint16), dst_type.scalar)
        return _cast(self, src, dst_type)

    _ti.InterpreterBuilder.cast_impl = _cast_rne
""")

INTERPRET = RNE + CASES + textwrap.dedent("""
    check_rms_norm("cpu")
    check_qk_norm_rope("cpu")
    print("ok")
""")


def test_fused_kernels_match_their_twins_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", INTERPRET], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_the_checks_can_fail():
    """The comparison rejects a kernel that is off by more than rounding (here: the wrong rotary order)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    broken = RNE + CASES + textwrap.dedent("""
        import torch
        r = Rotary(64, 10000.0, "norm", 16)
        cos, sin = r._tables(torch.device("cpu"))
        q, pos = torch.randn(2, 3, 64), torch.tensor([5, 9])
        qo, _ = fused.qk_norm_rope(q, None, pos, cos, sin, 64, True)  # neox order against a norm-order twin
        close(qo, r.rotate(q, pos), torch.float32, "swapped")
    """)
    r = subprocess.run([sys.executable, "-c", broken], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "swapped" in r.stderr, r.stderr[-3000:]


@pytest.mark.gpu
def test_fused_kernels_match_their_twins_on_cuda():
    ns: dict = {}
    exec(CASES, ns)
    ns["check_rms_norm"]("cuda")
    ns["check_qk_norm_rope"]("cuda")


@pytest.mark.gpu
def test_fused_rope_replays_in_a_cuda_graph_at_new_positions():
    """The position is read on the device: one captured launch serves every position."""
    from strata.layers.norm import rms_norm_ref
    from strata.layers.rotary import Rotary

    dev = torch.device("cuda")
    r = Rotary(128, 1e6, "neox", 4096)
    q = torch.randn(1, 32, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, 4, 128, device=dev, dtype=torch.bfloat16)
    qn, kn = torch.rand(128, device=dev) + 0.5, torch.rand(128, device=dev) + 0.5
    pos = torch.zeros(1, dtype=torch.long, device=dev)
    r.qk(q, k, pos, qn, kn, 1e-6)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        qo, ko = r.qk(q, k, pos, qn, kn, 1e-6)
    for p in (7, 4095, 1000):
        pos.fill_(p)
        g.replay()
        rq = r.rotate(rms_norm_ref(q, qn, 1e-6), pos)
        rk = r.rotate(rms_norm_ref(k, kn, 1e-6), pos)
        assert ((qo.float() - rq.float()).abs().max() / rq.float().abs().max()).item() <= 2 ** -7, p
        assert ((ko.float() - rk.float()).abs().max() / rk.float().abs().max()).item() <= 2 ** -7, p


ADD_NORM = textwrap.dedent("""
    import torch
    from strata.ops import fused, reference

    def check_add_rms_norm(dev):
        g = torch.Generator().manual_seed(2)
        for shape, dtype in (((3, 64), torch.float32), ((2, 2048), torch.bfloat16), ((1, 5, 130), torch.bfloat16)):
            x = (torch.randn(shape, generator=g) * 3).to(dev, dtype)
            a = torch.randn(shape, generator=g).to(dev, dtype)
            w = (torch.rand(shape[-1], generator=g) + 0.5).to(dev)
            h, y = fused.add_rms_norm(x, a, w, 1e-6)
            rh, ry = reference.add_rms_norm(x, a, w, 1e-6)
            assert torch.equal(h, rh), shape  # the residual exactly as torch's add rounds it
            err = ((y.float() - ry.float()).abs().max() / ry.float().abs().max()).item()
            assert y.dtype == dtype and err <= (2e-6 if dtype == torch.float32 else 2 ** -7), (shape, err)
        print("ok")
""")


SILU_MUL = textwrap.dedent("""
    import torch
    from strata.ops import fused, reference

    def check_silu_mul(dev):
        g = torch.Generator().manual_seed(3)
        # (rows, width, dtype): one row, several, a width past one program's block, an odd one
        for rows, n, dtype in ((1, 96, torch.bfloat16), (3, 768, torch.bfloat16), (2, 2100, torch.float32),
                               (4, 77, torch.bfloat16)):
            gu = (torch.randn(rows, 2 * n, generator=g) * 4).to(dev, dtype)  # one gate|up output, split in views
            gate, up = gu.split([n, n], dim=-1)
            y, ry = fused.silu_mul(gate, up), reference.silu_mul(gate, up)
            assert y.dtype == dtype and y.shape == ry.shape and y.is_contiguous(), (rows, n)
            err = ((y.float() - ry.float()).abs().max() / ry.float().abs().max()).item()
            assert err <= (2e-6 if dtype == torch.float32 else 2 ** -7), (rows, n, err)
            if dtype == torch.bfloat16:  # one rounding apart at most, and rarely
                assert (y != ry).float().mean().item() <= 0.02, (rows, n)
        print("ok")
""")


def test_silu_mul_matches_its_twin_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", RNE + SILU_MUL + "\ncheck_silu_mul('cpu')\n"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.gpu
def test_silu_mul_matches_its_twin_on_cuda():
    ns: dict = {}
    exec(SILU_MUL, ns)
    ns["check_silu_mul"]("cuda")


def test_add_rms_norm_matches_its_twin_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", ADD_NORM + "\ncheck_add_rms_norm('cpu')\n"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.gpu
def test_add_rms_norm_on_cuda():
    ns: dict = {}
    exec(ADD_NORM, ns)
    ns["check_add_rms_norm"]("cuda")
