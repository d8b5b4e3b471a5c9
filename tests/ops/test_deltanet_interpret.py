"""The gated delta-net decode step in two launches (`strata.ops.deltanet`) against its torch twin: in Triton's
interpreter on the CPU and (marked gpu) compiled on CUDA, inside a CUDA graph; and the layer taking the op."""

from __future__ import annotations

import textwrap

import pytest
import torch

pytest.importorskip("triton")

from tests.ops.interpreted import assert_caught, assert_passes  # noqa: E402

CASES = textwrap.dedent("""
    import torch
    from strata.ops import deltanet, reference

    def check(dev, kernel=deltanet.delta_decode):
        g = torch.Generator().manual_seed(0)
        # (sequences, key heads, value heads, Dk, Dv, conv kernel, slots): Qwen3-Next's grouping (2 value heads a
        # key head), one value head a key head, 4 a key head, a conv of 2 taps, sequences in scattered slots
        for B, hk, hv, dk, dv, K, S, order in ((2, 2, 4, 16, 32, 4, 3, (2, 0)), (1, 1, 1, 32, 64, 4, 1, (0,)),
                                                (3, 1, 4, 16, 16, 2, 5, (4, 1, 3)), (1, 2, 4, 64, 64, 4, 2, (1,))):
            C = 2 * hk * dk + hv * dv
            # qkv and ba as column views of one product (the fused projection), as the layer passes them
            qkv, _, ba = torch.randn(B, C + 3 + 2 * hv, generator=g).to(dev).split([C, 3, 2 * hv], dim=-1)
            conv_w = (torch.randn(C, K, generator=g) * 0.5).to(dev)
            dt_bias = torch.randn(hv, generator=g).to(dev)
            a = -torch.rand(hv, generator=g).to(dev) * 2
            conv = torch.randn(S, K - 1, C, generator=g).to(dev)
            ssm = (torch.randn(S, hv, dk, dv, generator=g) * 0.3).to(dev)
            slots = torch.tensor(order, dtype=torch.int64, device=dev)
            c1, s1, c2, s2 = conv.clone(), ssm.clone(), conv.clone(), ssm.clone()
            o = kernel(qkv, ba, c1, conv_w, s1, slots, dt_bias, a, hk, dk, dv)
            ref = reference.delta_decode(qkv, ba, c2, conv_w, s2, slots, dt_bias, a, hk, dk, dv)
            assert o.shape == ref.shape == (B, hv, dv) and o.dtype == torch.float32
            assert torch.allclose(o.cpu(), ref.cpu(), rtol=1e-4, atol=1e-5), (B, hk, hv, (o - ref).abs().max())
            assert torch.allclose(s1.cpu(), s2.cpu(), rtol=1e-4, atol=1e-5), (B, hk, hv, (s1 - s2).abs().max())
            assert torch.equal(c1.cpu(), c2.cpu())  # the kept conv inputs: moved, not computed
            untouched = [s for s in range(S) if s not in order]
            assert torch.equal(s1[untouched].cpu(), ssm[untouched].cpu()) and torch.equal(c1[untouched].cpu(),
                                                                                         conv[untouched].cpu())
        print("ok")

    def check_norm(dev, kernel=deltanet.gated_rms_norm):
        g = torch.Generator().manual_seed(1)
        # (tokens, heads, D, out dtype): a decode row, a prompt chunk's transposed output, an odd D (masked block)
        for n, H, D, dt, transposed in ((1, 4, 128, torch.bfloat16, False), (5, 2, 64, torch.float32, True),
                                        (3, 3, 48, torch.float16, False)):
            o = torch.randn(H, n, D, generator=g).to(dev).transpose(0, 1) if transposed else \
                torch.randn(n, H, D, generator=g).to(dev)
            z = torch.randn(n, H * D + 7, generator=g).to(dev)[:, 7:].view(n, H, D)  # a view of the fused product
            w = torch.rand(D, generator=g).to(dev) + 0.5
            out = kernel(o, z, w, 1e-6, dt)
            ref = reference.gated_rms_norm(o, z, w, 1e-6, dt)
            assert out.dtype == dt and out.shape == (n, H * D)
            tol = 1e-5 if dt == torch.float32 else 1e-2
            assert torch.allclose(out.float().cpu(), ref.float().cpu(), rtol=tol, atol=tol), (n, H, D, dt)
        print("ok")
""")


def test_delta_decode_kernels_match_their_twin_in_the_interpreter():
    assert_passes(CASES + "\ncheck('cpu')\n")


def test_gated_norm_kernel_matches_its_twin_in_the_interpreter():
    assert_passes(CASES + "\ncheck_norm('cpu')\n")


def test_the_comparison_catches_a_norm_without_its_gate():
    broken = CASES + textwrap.dedent("""
        def no_gate(o, z, w, eps, dt):
            return deltanet.gated_rms_norm(o, torch.full_like(z, 30.0), w, eps, dt)  # silu(30) ~ 30: no gate
        check_norm('cpu', no_gate)
    """)
    assert_caught(broken)


def test_the_comparison_catches_a_wrong_gate():
    """A kernel that writes with beta = 1 (no write strength) is caught: the check can fail."""
    broken = CASES + textwrap.dedent("""
        def no_beta(qkv, ba, *rest):
            hv = rest[2].shape[1]
            hk = rest[6]
            r = hv // hk
            ba = ba.clone().view(ba.shape[0], hk, 2 * r)
            ba[..., :r] = 50.0  # sigmoid -> 1
            return deltanet.delta_decode(qkv, ba.view(ba.shape[0], -1), *rest)
        check('cpu', no_beta)
    """)
    assert_caught(broken)


@pytest.mark.gpu
def test_delta_decode_kernels_match_their_twin_on_cuda_and_in_a_graph():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ns: dict = {}
    exec(CASES, ns)
    ns["check"]("cuda")
    ns["check_norm"]("cuda")
    from strata.ops import deltanet, reference

    dev = torch.device("cuda")
    B, hk, hv, dk, dv, K = 2, 16, 32, 128, 128, 4  # Qwen3-Next-80B's layer
    C = 2 * hk * dk + hv * dv
    qkv, ba = torch.randn(B, C, device=dev), torch.randn(B, 2 * hv, device=dev)
    conv_w, dt_bias, a = torch.randn(C, K, device=dev) * 0.5, torch.randn(hv, device=dev), -torch.rand(hv, device=dev)
    conv, ssm = torch.randn(3, K - 1, C, device=dev), torch.randn(3, hv, dk, dv, device=dev) * 0.3
    slots = torch.tensor([2, 0], device=dev)
    c2, s2 = conv.clone(), ssm.clone()
    deltanet.delta_decode(qkv, ba, conv.clone(), conv_w, ssm.clone(), slots, dt_bias, a, hk, dk, dv)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = deltanet.delta_decode(qkv, ba, conv, conv_w, ssm, slots, dt_bias, a, hk, dk, dv)
    graph.replay()
    ref = reference.delta_decode(qkv, ba, c2, conv_w, s2, slots, dt_bias, a, hk, dk, dv)
    torch.cuda.synchronize()
    assert torch.allclose(o, ref, rtol=1e-4, atol=1e-5) and torch.allclose(ssm, s2, rtol=1e-4, atol=1e-5)
    assert torch.equal(conv, c2)


def test_the_layer_decodes_through_the_op(monkeypatch):
    """A decode step of the layer (one sequence, or several) calls the op once; prompt chunks keep the chunked
    form."""
    from strata.layers import deltanet as layer_mod

    calls = []
    real = layer_mod.delta_decode

    def spy(*args, **kw):
        calls.append(args[0].shape[0])
        return real(*args, **kw)

    monkeypatch.setattr(layer_mod, "delta_decode", spy)
    from strata.kv.cache import Segment
    from strata.kv.recurrent import RecurrentState
    from strata.quant import QTensor

    g = torch.Generator().manual_seed(3)
    hk, hv, dk, dv, K, d = 1, 2, 8, 8, 4, 16
    C = 2 * hk * dk + hv * dv

    def qt(rows, cols):
        return QTensor.from_float(torch.randn(rows, cols, generator=g) * 0.2, "F32")

    w = {"qkv": qt(C, d), "z": qt(hv * dv, d), "ba": qt(2 * hv, d), "out": qt(d, hv * dv),
         "conv": torch.randn(C, K, generator=g) * 0.5, "dt_bias": torch.randn(hv, generator=g),
         "a": -torch.rand(hv, generator=g), "norm": torch.ones(dv)}
    dims = {"hk": hk, "hv": hv, "dk": dk, "dv": dv, "kernel": K}
    lay = layer_mod.GatedDeltaNet(0, dims, w, 1e-6)

    class KV:
        recurrent = RecurrentState([0], 2, *lay.state_shapes(dims), "cpu")

    x = torch.randn(5, d, generator=g)
    lay(x, torch.arange(5), [Segment(0, 0, 5)], KV)  # a prompt: chunked, not the op
    assert calls == []
    lay(x[:1], torch.tensor([5]), [Segment(0, 5, 1)], KV)
    lay(x[:2], torch.tensor([6, 0]), [Segment(0, 6, 1), Segment(1, 0, 1, window=0)], KV)
    # (a sequence's first token resets its state: the per-segment path, where on the CPU a continuation still goes
    # through the op token by token, as a decode step computes it: strata.layers.deltanet._stepwise)
    assert calls == [1, 1]
    lay(x[:2], torch.tensor([7, 1]), [Segment(0, 7, 1), Segment(1, 1, 1)], KV)
    assert calls == [1, 1, 2]
