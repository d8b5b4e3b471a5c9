"""Ops `qk_norm_rope` and `silu_mul` on the CPU (strata.ops.cpu_fused: one native call each) against their torch
twins: both rotary styles, with and without the per-head norms, partial rotary, q/k as views of one fused
projection's output, positions far into the table; a row's result the same bits alone or beside other rows; and
what the kernels do not take left to the twins."""

from __future__ import annotations

import pytest
import torch

from strata.ops import registry
from strata.ops import reference as R
from tests.ops.native_oracle import native_or_skip

QK = registry.op("qk_norm_rope")


def _qk(n, hq, hk, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(n, (hq + 2 * hk) * D, generator=g) * 3  # one fused q|k|v projection's output
    q, k, _ = y.split([hq * D, hk * D, hk * D], -1)
    return q.view(n, hq, D), k.view(n, hk, D)


def _tables(dim):
    angle = torch.arange(4096).float()[:, None] / (10000 ** (torch.arange(dim // 2).float() / (dim // 2)))
    return torch.cos(angle), torch.sin(angle)


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "pairs"])
@pytest.mark.parametrize("shape", [(1, 6, 2, 64, 32, True), (4, 6, 2, 64, 64, False), (3, 8, 2, 128, 64, True),
                                   (1, 4, 4, 80, 80, True), (9, 2, 1, 64, 16, False)], ids=str)
def test_qk_norm_rope_matches_twin(shape, neox):
    native_or_skip()
    n, hq, hk, D, dim, norm = shape
    q, k = _qk(n, hq, hk, D)
    cos_t, sin_t = _tables(dim)
    pos = torch.tensor([4095, 0, 17, 2048, 5, 6, 7, 8, 9][:n])
    qn = torch.randn(D) if norm else None
    kn = torch.randn(D) if norm else None
    args = (q, k, pos, cos_t, sin_t, dim, neox, qn, kn, 1e-6)
    assert QK.pick(*args) is not None
    (qo, ko), (qr, kr) = QK(*args), R.qk_norm_rope(*args)
    assert qo.shape == qr.shape and ko.shape == kr.shape
    assert torch.allclose(qo, qr, atol=1e-5, rtol=1e-5) and torch.allclose(ko, kr, atol=1e-5, rtol=1e-5)
    # q alone (k None: the rotary of one tensor) and each row alone: the same bits
    qa, none = QK(q, None, pos, cos_t, sin_t, dim, neox, qn, kn, 1e-6)
    assert none is None and torch.equal(qa, qo)
    for j in range(n):
        qj, kj = QK(q[j:j + 1], k[j:j + 1], pos[j:j + 1], cos_t, sin_t, dim, neox, qn, kn, 1e-6)
        assert torch.equal(qj[0], qo[j]) and torch.equal(kj[0], ko[j])


def test_what_the_kernels_do_not_take_goes_to_the_twins():
    native_or_skip()
    q, k = _qk(2, 6, 2, 64)
    cos_t, sin_t = _tables(32)
    pos = torch.tensor([1, 2])
    assert QK.pick(q.double(), k.double(), pos, cos_t.double(), sin_t.double(), 32, True) is None
    assert QK.pick(q, k, pos.int(), cos_t, sin_t, 32, True) is None  # int32 positions
    assert QK.pick(q, k, pos, cos_t, sin_t, 31, True) is None  # odd rotary width
    assert QK.pick(q, k, pos, cos_t, sin_t, 32, True, torch.ones(64), None, 1e-6) is None  # q's norm, not k's
    assert registry.op("rms_norm").pick(torch.randn(3, 64), torch.ones(64), 1e-5) is None  # torch's (see the module)
    with pytest.raises(IndexError):
        QK(q, k, torch.tensor([1, 4096]), cos_t, sin_t, 32, True)


@pytest.mark.parametrize("ff", [24, 52, 96])
def test_silu_mul_matches_twin_and_a_row_gets_its_bits_alone(ff):
    """torch's silu gives the elements past a multiple of its vector width other bits (another exp): a row of an
    odd width got other values in a verify step's batch than alone; the kernel's do not move."""
    native_or_skip()
    g = torch.Generator().manual_seed(ff)
    h = torch.randn(5, 2 * ff, generator=g) * 4  # one gate|up output
    gate, up = h[:, :ff], h[:, ff:]
    op = registry.op("silu_mul")
    assert op.pick(gate, up) is not None
    got = op(gate, up)
    assert torch.allclose(got, R.silu_mul(gate, up), atol=1e-5, rtol=1e-5)
    assert all(torch.equal(op(gate[j:j + 1], up[j:j + 1])[0], got[j]) for j in range(5))
