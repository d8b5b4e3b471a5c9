"""qmatmul on the CPU for decode-sized batches (strata.ops.cpu_gemv: the native kernel's dot products over each
weight row once for all rows of x) against its twin, gguf-py's dequantizer and float64 math: within 2e-3 with the
kernel's int8 rounding of the activations emulated (a wrong block, scale or row offset fails it), within the int8
tolerance of the exact product, and the exact reference itself past MAX_ROWS and for formats the kernel lacks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata.ops import cpu_gemv, cpu_native
from strata.quant import qmatmul, random_qtensor
from strata.quant.matmul import reference_qmatmul
from tests.ops.native_oracle import int8_rows, native_or_skip, rel

FORMATS = [Q[name] for name in cpu_native.FORMATS]


def _deq(w) -> np.ndarray:
    from gguf.quants import dequantize

    return dequantize(w.raw.numpy(), w.qtype).reshape(w.shape).astype(np.float64)


@pytest.mark.parametrize("T", [1, 3, cpu_gemv.MAX_ROWS])
@pytest.mark.parametrize("qt", FORMATS, ids=lambda q: q.name)
def test_native_qmatmul_matches_gguf_py(qt, T):
    native_or_skip()
    K = 512 if cpu_native.WIDTHS[qt.name] == 256 else 352  # 352: a partial last block of the activations' 256
    N = 37  # odd: rows split unevenly over threads
    w = random_qtensor(qt, (N, K), np.random.default_rng(K + T))
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(T))
    got = qmatmul(x, w)
    assert got.shape == (T, N) and got.dtype == torch.float32
    ref = x.numpy().astype(np.float64) @ _deq(w).T
    assert rel(got.numpy(), int8_rows(x.numpy()) @ _deq(w).T) < 2e-3
    assert rel(got.numpy(), ref) < 3e-2


def test_the_kernel_is_what_cpu_qmatmul_runs():
    native_or_skip()
    w = random_qtensor(Q.Q8_0, (64, 256), np.random.default_rng(0))
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(1))
    assert torch.equal(qmatmul(x, w), cpu_gemv.native_qmatmul(x, w))
    assert not torch.equal(qmatmul(x, w), reference_qmatmul(x, w))  # int8 activations: not the float product


def test_large_batches_and_other_formats_take_the_reference():
    native_or_skip()
    w = random_qtensor(Q.Q4_K, (16, 256), np.random.default_rng(2))
    x = torch.randn(cpu_gemv.MAX_ROWS + 1, 256, generator=torch.Generator().manual_seed(3))
    assert torch.equal(qmatmul(x, w), reference_qmatmul(x, w))  # prefill: dequantize, then one GEMM
    w5 = random_qtensor(Q.F16, (16, 256), np.random.default_rng(4))  # a format the kernel does not read
    assert torch.equal(qmatmul(x[:2], w5), reference_qmatmul(x[:2], w5))


def test_threads_agree():
    """Rows split over two threads give the one-thread result exactly (each row's dot product is one thread's)."""
    native_or_skip()
    w = random_qtensor(Q.Q4_K, (1024, 512), np.random.default_rng(5))  # past PARALLEL_MIN
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(6))
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gemv.native_qmatmul(x, w)
        torch.set_num_threads(2)
        two = cpu_gemv.native_qmatmul(x, w)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, two)


def test_an_exact_cpu_block_takes_the_reference_in_its_thread_only():
    """The CPU lane's `ref` kernel promises float32 math: inside `exact_cpu()` this thread's qmatmul is the
    reference; another thread at the same time still takes the native kernel."""
    import threading

    from strata.quant.matmul import exact_cpu

    native_or_skip()
    w = random_qtensor(Q.Q8_0, (64, 256), np.random.default_rng(7))
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(8))
    other = {}
    with exact_cpu():
        assert torch.equal(qmatmul(x, w), reference_qmatmul(x, w))
        t = threading.Thread(target=lambda: other.setdefault("y", qmatmul(x, w)))
        t.start()
        t.join()
    assert torch.equal(other["y"], cpu_gemv.native_qmatmul(x, w))
    assert torch.equal(qmatmul(x, w), cpu_gemv.native_qmatmul(x, w))


@pytest.mark.parametrize("T", [2, 3, 4, 5, 9])
@pytest.mark.parametrize("qt", FORMATS, ids=lambda q: q.name)
def test_each_row_of_several_is_bit_for_bit_its_own_call(qt, T):
    """A verify step's or a batch's rows (Q8_0's several-row dot product reads each block once for all of them)
    give exactly what each row alone gives: drafted text equals plain text."""
    native_or_skip()
    K = 512 if cpu_native.WIDTHS[qt.name] == 256 else 352
    w = random_qtensor(qt, (29, K), np.random.default_rng(T))
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(10 + T)) * 3
    many = cpu_gemv.native_qmatmul(x, w)
    for t in range(T):
        assert torch.equal(many[t], cpu_gemv.native_qmatmul(x[t:t + 1], w)[0]), t


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_several_rows_in_the_avx2_and_plain_builds(qt):
    """The AVX2 path (-mno-avx512f) and the plain C loops: several rows give each row's own result there too,
    and both agree with the machine's build (float order aside for the plain loops)."""
    from tests.ops.native_oracle import build

    native_or_skip()
    avx2 = build([*cpu_native.FLAGS, "-mno-avx512f"])
    plain = build([f for f in cpu_native.FLAGS if not f.startswith("-march")] + ["-mno-avx2", "-mno-fma"])
    K, N, T = 512, 23, 5
    w = random_qtensor(qt, (N, K), np.random.default_rng(3))
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(4))

    def gemv(lib, xs):
        n = xs.shape[0]
        out = torch.empty(n, N, dtype=torch.float32)
        ws = torch.empty(int(lib.strata_native_gemv_scratch(n, K)) + 64, dtype=torch.uint8)
        rc = lib.strata_native_gemv(n, w.raw.data_ptr(), N, K, cpu_native.FORMATS[qt.name], xs.data_ptr(),
                                    out.data_ptr(), 1, (ws.data_ptr() + 63) // 64 * 64)
        assert rc == 0
        return out

    base = cpu_gemv.native_qmatmul(x, w)
    for lib in (avx2, plain):
        many = gemv(lib, x)
        for t in range(T):
            assert torch.equal(many[t], gemv(lib, x[t:t + 1].contiguous())[0]), t
        assert ((many - base).norm() / base.norm()).item() < 1e-5


@pytest.mark.parametrize("T", [1, 4])
def test_q8_0_with_and_without_vnni_is_the_same_bits(T):
    """Q8_0's four-byte sums by VNNI's one instruction (where -march=native has it) or AVX2's two: the same int32
    lanes, so the same results bit for bit, weights of -128 and activations at their clamp included."""
    from tests.ops.native_oracle import build

    native_or_skip()
    avx2 = build([*cpu_native.FLAGS, "-mno-avx512f"])
    K, N = 352, 37
    w = random_qtensor(Q.Q8_0, (N, K), np.random.default_rng(7))
    raw = w.raw.view(N, K // 32, 34)
    raw[::3, :, 2::5] = 128  # int8 -128
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(8))
    x[:, ::7] = 50.0  # (quantized to +-127)
    out = torch.empty(T, N, dtype=torch.float32)
    ws = torch.empty(int(avx2.strata_native_gemv_scratch(T, K)) + 64, dtype=torch.uint8)
    assert avx2.strata_native_gemv(T, w.raw.data_ptr(), N, K, cpu_native.FORMATS["Q8_0"], x.data_ptr(),
                                   out.data_ptr(), 1, (ws.data_ptr() + 63) // 64 * 64) == 0
    assert torch.equal(out, cpu_gemv.native_qmatmul(x, w))
