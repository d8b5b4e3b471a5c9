"""A static decode step's one query: the split kernel reads the position on the device, so the window's mask (three
launches a layer) is built only when the reference runs instead."""

from __future__ import annotations

import torch

from strata.kv.cache import Segment
from strata.layers.attention import _one_query
from strata.ops import registry
from strata.ops.reference import one_query_attention


def _case():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 16, generator=g)
    ks, vs = torch.randn(32, 2, 16, generator=g), torch.randn(32, 2, 16, generator=g)
    pos = torch.tensor([9])
    return q, ks, vs, Segment(0, 0, 1, pos_t=pos, window=32)


def test_no_mask_when_a_kernel_takes_the_query():
    q, ks, vs, seg = _case()
    op = registry.op("one_query_attention")
    seen = []

    def kernel(q, ks, vs, mask, pos_t, scale):
        seen.append(mask)
        return one_query_attention(q, ks[: int(pos_t[0]) + 1], vs[: int(pos_t[0]) + 1], None, pos_t, scale)

    saved = list(op.kernels)
    op.register("test-split", kernel, lambda *a: True)
    try:
        got = _one_query(q, ks, vs, seg, 0.25, q.dtype)
    finally:
        op.kernels = saved
    assert seen == [None]
    want = _one_query(q, ks, vs, seg, 0.25, q.dtype)  # the reference, with the window's mask
    assert torch.allclose(got, want, atol=1e-6)


def test_the_reference_gets_the_window_mask():
    q, ks, vs, seg = _case()
    out = _one_query(q, ks, vs, seg, 0.25, q.dtype)
    ref = one_query_attention(q, ks[:10], vs[:10], None, seg.pos_t, 0.25)  # keys 0..9 only
    assert torch.allclose(out, ref, atol=1e-6)
