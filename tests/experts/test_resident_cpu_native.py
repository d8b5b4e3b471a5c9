"""A decode step's experts on the CPU (strata.experts.resident): every (token, expert) pair in one call of the
native kernel, against the per-expert loop (the reference) — the same int8 rounding as the loop's decode-sized
qmatmul, so within float order of it, and within the int8 tolerance of the float32 reference; the float32 reference
itself where it is asked for (cpu_exact) and for prompt chunks; the plain loop for formats the kernel lacks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata.experts import resident
from strata.experts.resident import ExpertWeights, ResidentExperts, combine, expert_loop
from strata.quant import matmul, random_qtensor
from tests.ops.native_oracle import native_or_skip, rel

E, K, D, FF = 8, 2, 512, 256


def _layer(qt=Q.Q4_K, seed=0) -> ResidentExperts:
    rng = np.random.default_rng(seed)
    ew = ExpertWeights(random_qtensor(qt, (E, FF, D), rng), random_qtensor(qt, (E, FF, D), rng),
                       random_qtensor(qt, (E, D, FF), rng))
    return ResidentExperts({0: ew})


def _inputs(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    w = torch.softmax(torch.randn(n, K, generator=g), -1)
    return x, ids, w


def _loop(be, x, ids, w):
    return combine(expert_loop(be.layers[0], x, ids), w, x.dtype)


@pytest.mark.parametrize("n", [1, 3, resident.CPU_NATIVE_TOKENS])
def test_one_call_equals_the_loop_of_decode_sized_matmuls(n):
    native_or_skip()
    be = _layer()
    x, ids, w = _inputs(n)
    got = be.forward(0, x, ids, w)
    assert be.layers[0]._cpu_native is not None  # the one-call path ran
    assert rel(got.numpy(), _loop(be, x, ids, w).numpy()) < 1e-5  # same rounding, another float order
    matmul.CPU_EXACT = True
    try:
        exact = _loop(be, x, ids, w)
        assert torch.equal(be.forward(0, x, ids, w), exact)  # asked for: the float32 reference itself
    finally:
        matmul.CPU_EXACT = False
    assert 1e-5 < rel(got.numpy(), exact.numpy()) < 3e-2  # int8 activations: close, not equal


def test_a_prompt_chunk_and_other_formats_keep_the_loop():
    native_or_skip()
    be = _layer()
    x, ids, w = _inputs(resident.CPU_NATIVE_TOKENS + 1)
    assert torch.equal(be.forward(0, x, ids, w), _loop(be, x, ids, w))
    be3 = _layer(Q.F16)  # no native kernel for float experts
    x, ids, w = _inputs(2)
    assert torch.equal(be3.forward(0, x, ids, w), _loop(be3, x, ids, w))
    assert be3.layers[0]._cpu_native is None
