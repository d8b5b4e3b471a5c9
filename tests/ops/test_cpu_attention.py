"""Op `rows_attention` on the CPU (strata.ops.cpu_attention: the native kernel over a step's few queries, each key
and value row read once for all of them) against its twin (SDPA one query at a time) and float64 math, over head
sizes, GQA groups, prefixes shorter and longer than the kernel's key chunk, and strided cache views; and the
property a verify step relies on: a query's output is the same bits whatever queries share its call, and whatever
the thread count."""

from __future__ import annotations

import pytest
import torch

from strata.ops import cpu_attention, registry
from strata.ops.reference import rows_attention as twin
from strata.quant.matmul import exact_cpu
from tests.ops.native_oracle import native_or_skip

OP = registry.op("rows_attention")


def _float64(q, ks, vs, start, scale):
    n, H, D = q.shape
    G = H // ks.shape[1]
    out = torch.empty(n, H, vs.shape[2], dtype=torch.float64)
    for j in range(n):
        k = ks[: start + j + 1].double().repeat_interleave(G, 1)  # [L, H, D]
        v = vs[: start + j + 1].double().repeat_interleave(G, 1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[j].double(), k) * scale, -1)
        out[j] = torch.einsum("hl,lhd->hd", p, v)
    return out


def _case(n, H, hkv, D, Dv, start, seed=0, cap=1100):
    g = torch.Generator().manual_seed(seed)
    # a slot's cache [positions, heads, D] with room past the step (the op reads only up to start + n)
    kc = torch.randn(cap, hkv, D, generator=g)
    vc = torch.randn(cap, hkv, Dv, generator=g)
    q = torch.randn(n, H, D, generator=g) * 2
    return q, kc[: start + n], vc[: start + n]


SHAPES = [  # n, H, Hkv, D, Dv, start
    (1, 6, 2, 64, 64, 0), (1, 6, 2, 64, 64, 1000), (4, 6, 2, 64, 64, 1000), (3, 8, 8, 128, 128, 300),
    (2, 4, 1, 80, 80, 5), (9, 6, 2, 64, 64, 254), (5, 6, 3, 64, 64, 251), (cpu_attention.MAX_ROWS, 4, 2, 64, 64, 600),
    (2, 16, 2, 72, 40, 513),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_native_rows_attention_matches_twin_and_float64(shape):
    native_or_skip()
    n, H, hkv, D, Dv, start = shape
    q, ks, vs = _case(*shape)
    assert OP.pick(q, ks, vs, start, 0.125) is not None
    got = OP(q, ks, vs, start, 0.125)
    assert got.shape == (n, H, Dv) and got.dtype == torch.float32
    ref = _float64(q, ks, vs, start, 0.125)
    assert (got.double() - ref).abs().max().item() < 2e-5
    assert (got - twin(q, ks, vs, start, 0.125)).abs().max().item() < 2e-5


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_query_gets_the_same_bits_alone_or_beside_others(shape):
    native_or_skip()
    n, H, hkv, D, Dv, start = shape
    q, ks, vs = _case(*shape, seed=1)
    together = OP(q, ks, vs, start, 0.1)
    for j in range(n):  # as a one-token step at its position computes it
        alone = OP(q[j:j + 1], ks[: start + j + 1], vs[: start + j + 1], start + j, 0.1)
        assert torch.equal(alone[0], together[j]), j


def test_thread_count_does_not_change_the_bits():
    native_or_skip()
    q, ks, vs = _case(4, 6, 2, 64, 64, 900, seed=2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = OP(q, ks, vs, 900, 0.125)
        torch.set_num_threads(max(2, before))
        many = OP(q, ks, vs, 900, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


def test_what_the_kernel_does_not_take_goes_to_the_twin():
    native_or_skip()
    q, ks, vs = _case(2, 6, 2, 64, 64, 40)
    assert OP.pick(q.double(), ks.double(), vs.double(), 40, 0.1) is None  # not float32
    assert OP.pick(q, ks[:, :, ::2], vs, 40, 0.1) is None  # key rows not contiguous
    assert OP.pick(q, ks[:41], vs[:41], 40, 0.1) is None  # fewer keys than the last query sees
    big = torch.randn(cpu_attention.MAX_ROWS + 1, 6, 64)
    assert OP.pick(big, ks, vs, 0, 0.1) is None  # a prompt chunk: one SDPA call
    with exact_cpu():  # the float oracles' tests keep SDPA
        assert OP.pick(q, ks, vs, 40, 0.1) is None
