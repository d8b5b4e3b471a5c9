"""A static (graphed) segment of several queries — a speculative verify step's — attends each query over its own
prefix with the decode step's one-query op (`strata.layers.attention._rows_one_query`), instead of SDPA over the
whole window under an [n, window] mask. Checked against that masked product (the path it replaces) for a plain
and a q8_0 cache, with stale rows past the queries' positions that must stay unread; on a GPU (marked) with the
Triton kernels, which `VERIFY_ROWS_GPU_TESTED` takes once this passes there."""

from __future__ import annotations

import pytest
import torch

from strata.kv.cache import KVCache, Segment
from strata.layers import attention as att

H, HKV, D, W = 8, 2, 32, 96


def _case(dev: str, dtype: torch.dtype, kv_type, n: int, start: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dev, dtype)

    kv = KVCache(1, 2, W, (HKV, D), (HKV, D), dtype, dev, k_type=kv_type, v_type=kv_type)
    # slot 1: a prefix of `start` rows, then stale rows (an earlier, longer sequence's) up to the window's end
    kv.write_at(0, 1, torch.arange(W, device=dev), rnd(W, HKV, D), rnd(W, HKV, D))
    pos = torch.arange(start, start + n, device=dev)
    seg = Segment(1, start, n, pos_t=pos, window=W)
    return kv, seg, rnd(n, H, D), rnd(n, HKV, D), rnd(n, HKV, D)


def _masked(kv: KVCache, seg: Segment, q, k, v, dtype):
    """The path the rows replace: K/V written, the window read, SDPA-style attention under the window mask."""
    ks, vs, mask = att._cache_step(kv, 0, seg, k, v)
    ks, vs = att._as_dtype(ks, vs, dtype)
    return att._gqa(q, ks, vs, mask, D ** -0.5)


def _both(dev, dtype, kv_type, n, start):
    kv_a, seg, q, k, v = _case(dev, dtype, kv_type, n, start)
    kv_b, *_ = _case(dev, dtype, kv_type, n, start)
    rows = att._rows_one_query(kv_a, 0, seg, q, k, v, D ** -0.5, dtype)
    return rows, _masked(kv_b, seg, q, k, v, dtype), kv_a, kv_b


@pytest.mark.parametrize("kv_type", [None, "q8_0"])
@pytest.mark.parametrize("n,start", [(2, 0), (4, 37), (8, W - 8)])
def test_rows_equal_the_masked_window_on_the_cpu(kv_type, n, start):
    rows, ref, kv_a, kv_b = _both("cpu", torch.float32, kv_type, n, start)
    assert rows.shape == (n, H, D)
    torch.testing.assert_close(rows, ref, rtol=1e-5, atol=1e-5)
    # the segment's own rows were written the same way by both paths
    for a, b in zip(kv_a.read_window(0, 1, W), kv_b.read_window(0, 1, W)):
        assert torch.equal(a, b)


def test_stale_rows_past_the_positions_are_not_read():
    kv, seg, q, k, v = _case("cpu", torch.float32, None, 3, 20)
    out = att._rows_one_query(kv, 0, seg, q, k, v, D ** -0.5, torch.float32)
    kv2, *_ = _case("cpu", torch.float32, None, 3, 20)
    kv2.write_at(0, 1, torch.arange(23, W), torch.full((W - 23, HKV, D), 50.0), torch.full((W - 23, HKV, D), -50.0))
    torch.testing.assert_close(att._rows_one_query(kv2, 0, seg, q, k, v, D ** -0.5, torch.float32), out)


def test_taken_on_a_gpu_only_once_tested(monkeypatch):
    seg = Segment(0, 5, 3, pos_t=torch.arange(5, 8), window=W)
    assert att._verify_rows(seg, torch.device("cpu"))
    monkeypatch.setattr(att, "VERIFY_ROWS_GPU_TESTED", False)
    assert not att._verify_rows(seg, torch.device("cuda"))
    monkeypatch.setattr(att, "VERIFY_ROWS_GPU_TESTED", True)
    assert att._verify_rows(seg, torch.device("cuda"))
    # one query (a decode step's), a prompt chunk (no window), past VERIFY_ROWS: not this path
    assert not att._verify_rows(Segment(0, 5, 1, pos_t=torch.arange(5, 6), window=W), torch.device("cpu"))
    assert not att._verify_rows(Segment(0, 5, 3), torch.device("cpu"))
    n = att.VERIFY_ROWS + 1
    assert not att._verify_rows(Segment(0, 5, n, pos_t=torch.arange(5, 5 + n), window=W), torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_type", [None, "q8_0"])
def test_rows_on_cuda(monkeypatch, kv_type):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setattr(att, "VERIFY_ROWS_GPU_TESTED", True)
    for n, start in ((2, 0), (4, 37), (8, W - 8)):
        rows, ref, _, _ = _both("cuda", torch.bfloat16, kv_type, n, start)
        err = ((rows.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        assert err < 2e-2, (n, start, err)
