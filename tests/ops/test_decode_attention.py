"""The split-key one-query attention kernel (`strata.ops.decode_attention`) against SDPA with the window mask: in
Triton's interpreter on the CPU, and (marked gpu) compiled on CUDA inside a captured graph at new positions."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

CASES = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from strata.ops.decode_attention import decode_attention, splits_for

    def reference(q, ks, vs, pos, scale):
        # GQA by repeating KV heads; keys 0..pos; float32 math
        H, hkv = q.shape[1], ks.shape[1]
        L = ks.shape[0]
        k = ks[: pos + 1].float().repeat_interleave(H // hkv, dim=1).transpose(0, 1)  # [H, n, D]
        v = vs[: pos + 1].float().repeat_interleave(H // hkv, dim=1).transpose(0, 1)
        o = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, scale=scale)  # [H, 1, Dv]
        return o.transpose(0, 1)

    def check(dev, dtype=torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        # (H, Hkv, D, Dv, window, positions): Qwen3-30B's 32/4 heads, one head per group, MHA, a window that
        # is not a whole number of splits
        for H, hkv, D, DV, L, poss in ((32, 4, 128, 128, 2048, (0, 5, 700, 2047)), (4, 4, 64, 64, 256, (63, 255)),
                                        (16, 2, 64, 32, 300, (1, 299)), (8, 1, 128, 128, 96, (95,))):
            cache_k = (torch.randn(3, L, hkv, D, generator=g) * 2).to(dev, dtype)  # 3 slots: strided views
            cache_v = torch.randn(3, L, hkv, DV, generator=g).to(dev, dtype)
            ks, vs = cache_k[1], cache_v[1]
            for pos in poss:
                q = torch.randn(1, H, D, generator=g).to(dev, dtype)
                pos_t = torch.tensor([pos], device=dev)
                out = decode_attention(q, ks, vs, pos_t, D ** -0.5)
                ref = reference(q, ks, vs, pos, D ** -0.5)
                assert out.shape == (1, H, DV) and out.dtype == dtype
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                assert err < 2e-2, (H, hkv, D, L, pos, err, splits_for(L, hkv))
            # a verify step's queries at ascending positions in one call: each row its own prefix
            for nq, first in ((2, 0), (4, 3), (3, L - 3)):
                if nq * (H // hkv) > 64:
                    continue
                q = torch.randn(nq, H, D, generator=g).to(dev, dtype)
                pos_t = torch.arange(first, first + nq, device=dev)
                out = decode_attention(q, ks, vs, pos_t, D ** -0.5)
                assert out.shape == (nq, H, DV)
                for j in range(nq):
                    ref = reference(q[j:j + 1], ks, vs, first + j, D ** -0.5)
                    err = ((out[j:j + 1].float() - ref).abs().max() / ref.abs().max()).item()
                    assert err < 2e-2, (H, hkv, D, L, nq, first, j, err)
""")


def test_decode_attention_in_the_interpreter():
    # (f16 caches: the lean tiles' 16-bit dots, which the interpreter computes for f16 operands; bf16: float32 dots)
    code = CASES + "\ncheck('cpu')\ncheck('cpu', torch.float16)\nprint('ok')\n"
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic,lean", [(False, False), (True, False), (True, True)],
                         ids=["fixed-splits", "dynamic-splits", "dynamic-splits-lean-tiles"])
def test_decode_attention_on_cuda_and_in_a_graph(monkeypatch, dynamic, lean):
    """(dynamic: each split's keys from the position on the device, strata.ops.decode_attention's
    DYNAMIC_SPLITS_GPU_TESTED; lean: the cache's 16-bit rows as the dots' operands, its LEAN_GPU_TESTED; replays
    at positions far below the window's end and at it)"""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from strata.ops import decode_attention as da

    monkeypatch.setattr(da, "DYNAMIC_SPLITS_GPU_TESTED", dynamic)
    monkeypatch.setattr(da, "LEAN_GPU_TESTED", lean)
    ns: dict = {}
    exec(CASES, ns)
    ns["check"]("cuda")
    # captured once, replayed at new positions written into the device tensor
    from strata.ops.decode_attention import decode_attention

    g = torch.Generator().manual_seed(3)
    ks = torch.randn(1024, 4, 128, generator=g).cuda().bfloat16()
    vs = torch.randn(1024, 4, 128, generator=g).cuda().bfloat16()
    q = torch.randn(1, 32, 128, generator=g).cuda().bfloat16()
    pos_t = torch.tensor([10], device="cuda")
    decode_attention(q, ks, vs, pos_t, 0.088)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, ks, vs, pos_t, 0.088)
    for pos in (10, 511, 1023):
        pos_t.fill_(pos)
        graph.replay()
        ref = ns["reference"](q, ks, vs, pos, 0.088)
        assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 2e-2
