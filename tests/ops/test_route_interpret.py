"""The one-launch router choice (`strata.ops.route`) against its torch twin: in Triton's interpreter on the CPU
and (marked gpu) compiled on CUDA, inside a CUDA graph, for each gating the families use."""

from __future__ import annotations

import textwrap

import pytest
import torch

pytest.importorskip("triton")

from tests.ops.interpreted import assert_caught, assert_passes  # noqa: E402

CASES = textwrap.dedent("""
    import torch
    from strata.ops import reference, route

    def check(dev, kernel=route.route_topk):
        g = torch.Generator().manual_seed(0)
        # (tokens, experts, k, sigmoid, norm, scale, bias): Qwen3 (softmax, renormalized), Mixtral (8 experts,
        # top-2), DeepSeek/GLM (sigmoid + correction bias, scaled), Qwen3-Next (512 top-10), no renorm, odd E
        for n, E, k, sig, norm, scale, bias in ((3, 128, 8, False, True, 1.0, False), (2, 8, 2, False, True, 1.0, False),
                                                (4, 160, 8, True, True, 2.5, True), (2, 512, 10, False, True, 1.0, False),
                                                (3, 60, 4, False, False, 1.0, False), (1, 37, 3, True, False, 1.5, True)):
            logits = (torch.randn(n, E, generator=g) * 2).to(dev)
            b = (torch.rand(E, generator=g) * 0.1).to(dev) if bias else None
            ids, w = kernel(logits, k, sig, norm, scale, b)
            rids, rw = reference.route_topk(logits, k, sig, norm, scale, b)
            assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == (n, k)
            assert torch.equal(ids.cpu(), rids.cpu()), (E, k, ids, rids)
            assert torch.allclose(w.cpu(), rw.cpu(), rtol=2e-6, atol=1e-7), (E, k, (w - rw).abs().max())
        print("ok")

    def check_logits(dev, kernel=route.router_logits):
        from gguf import GGMLQuantizationType as Q
        from strata.quant.qtensor import QTensor
        g = torch.Generator().manual_seed(1)
        # (tokens, experts, d, router type, x dtype, bias): B1's router (F32, 128 x 2048), a bf16 router and
        # activations, gpt-oss's logit bias, odd E and d (partial row and column blocks)
        for n, E, d, wt, xt, bias in ((1, 128, 2048, torch.float32, torch.float32, False),
                                      (3, 128, 2048, torch.float32, torch.bfloat16, False),
                                      (2, 60, 640, torch.bfloat16, torch.bfloat16, True),
                                      (4, 37, 200, torch.float16, torch.float32, True)):
            w = torch.randn(E, d, generator=g).to(wt) * 0.05
            qw = QTensor(w.contiguous().view(torch.uint8).to(dev), {torch.float32: Q.F32, torch.bfloat16: Q.BF16,
                                                                   torch.float16: Q.F16}[wt], (E, d))
            x = torch.randn(n, d, generator=g).to(dev, xt)
            b = (torch.randn(E, generator=g) * 0.1).to(dev) if bias else None
            out = kernel(x, qw, b)
            ref = reference.router_logits(x, qw, b)
            assert out.dtype == torch.float32 and out.shape == (n, E)
            err = ((out.cpu() - ref.cpu()).abs().max() / ref.abs().max()).item()
            assert err < 1e-5, (n, E, d, wt, xt, err)
        print("ok")
""")


def test_route_kernel_matches_its_twin_in_the_interpreter():
    assert_passes(CASES + "\ncheck('cpu')\n")


def test_router_logits_kernel_matches_its_twin_in_the_interpreter():
    assert_passes(CASES + "\ncheck_logits('cpu')\n")


def test_the_comparison_catches_wrong_logits():
    broken = CASES + textwrap.dedent("""
        def no_bias(x, w, b):
            return route.router_logits(x, w, None)
        check_logits('cpu', no_bias)
    """)
    assert_caught(broken)


def test_the_comparison_catches_a_wrong_choice():
    """A kernel that drops the bias from the choice is caught (the check can fail)."""
    broken = CASES + textwrap.dedent("""
        def no_bias(logits, k, sig, norm, scale, b):
            return route.route_topk(logits, k, sig, norm, scale, None)
        check('cpu', no_bias)
    """)
    assert_caught(broken)


def test_moe_routing_takes_the_op_and_keeps_group_limited_routing_in_torch():
    from strata.layers.moe import Routing, route

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 64, generator=g)
    ids, w = route(logits, Routing(64, 6))
    assert ids.shape == (5, 6) and torch.allclose(w.sum(-1), torch.ones(5))
    ids, w = route(logits, Routing(64, 6, gating="sigmoid", n_groups=8, topk_groups=2), torch.zeros(64))
    groups = (ids // 8).unique(dim=None)
    assert all(len(set((row // 8).tolist())) <= 2 for row in ids), groups


@pytest.mark.gpu
def test_route_kernel_matches_its_twin_on_cuda_and_in_a_graph():
    ns: dict = {}
    exec(CASES, ns)
    ns["check"]("cuda")
    ns["check_logits"]("cuda")
    from strata.ops import reference, route

    dev = torch.device("cuda")
    logits = torch.randn(4, 128, device=dev)
    route.route_topk(logits, 8, False, True, 1.0)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, w = route.route_topk(logits, 8, False, True, 1.0)
    for s in range(3):
        logits.copy_(torch.randn(4, 128, device=dev, generator=torch.Generator(dev).manual_seed(s)))
        graph.replay()
        rids, rw = reference.route_topk(logits, 8, False, True, 1.0)
        assert torch.equal(ids, rids) and torch.allclose(w, rw, rtol=2e-6, atol=1e-7)
