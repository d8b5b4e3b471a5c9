"""Random blocks: valid, finite, about the requested std, reproducible, and fast."""

import time

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata.quant import bytes_for, dequantize, random_qtensor, random_raw_bytes, type_name

from quant_helpers import ALL_TYPES, block_len


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=type_name)
@pytest.mark.parametrize("scale", [0.02, 1.0])
def test_std_and_finiteness(qtype, scale):
    w = random_qtensor(qtype, (64, 8 * block_len(qtype)), 0, scale=scale).dequantize()
    assert torch.isfinite(w).all()
    assert 0.85 * scale < w.std().item() < 1.15 * scale
    assert abs(w.mean().item()) < 0.15 * scale


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=type_name)
def test_raw_bytes_shape_and_seeds(qtype):
    row_len = 4 * block_len(qtype)
    a = random_raw_bytes(qtype, 6, row_len, np.random.default_rng(5))
    assert a.dtype == np.uint8 and a.shape == (6, bytes_for(qtype, row_len))
    assert np.array_equal(a, random_raw_bytes(qtype, 6, row_len, 5))
    assert not np.array_equal(a, random_raw_bytes(qtype, 6, row_len, 6))
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    assert torch.equal(random_qtensor(qtype, (6, row_len), g1).raw, random_qtensor(qtype, (6, row_len), g2).raw)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0, Q.BF16], ids=type_name)
def test_out_buffer_gives_the_same_bytes(qtype):
    a = random_raw_bytes(qtype, 3, 512, 1)
    buf = np.empty(a.size, dtype=np.uint8)
    b = random_raw_bytes(qtype, 3, 512, 1, out=buf)
    assert np.shares_memory(b, buf) and np.array_equal(a, b)
    with pytest.raises(ValueError):
        random_raw_bytes(qtype, 3, 512, 1, out=np.empty(a.size + 1, dtype=np.uint8))


def test_generation_speed():
    """Measured, not asserted (the machine may be busy): `strata synth` writes multi-GB models with this."""
    rng = np.random.default_rng(0)
    for qtype in (Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.BF16):
        random_raw_bytes(qtype, 64, 2048, rng)                  # warm-up (scale calibration)
        buf = np.empty(bytes_for(qtype, 2048 * 4096), dtype=np.uint8)
        for label, out in (("new array", None), ("reused out", buf)):
            t0 = time.perf_counter()
            n = 0
            for _ in range(4):
                n += random_raw_bytes(qtype, 2048, 4096, rng, out=out).nbytes
            dt = time.perf_counter() - t0
            print(f"\nrandom_raw_bytes {qtype.name} ({label}): {n / dt / 1e9:.2f} GB/s "
                  f"({n >> 20} MiB in {dt * 1e3:.0f} ms)", end="")


@pytest.mark.parametrize("qtype", [Q.TQ1_0, Q.TQ2_0], ids=type_name)
def test_ternary_blocks_hold_only_ternary_values(qtype):
    """TQ2_0's 2-bit codes leave one unused (a weight of 2d): random blocks never use it, in random_raw_bytes nor
    in the streaming writer's XOR'd chunks."""
    from strata.gguf.writer import RandomBlocks
    from strata.quant.formats import block_geometry

    w = random_qtensor(qtype, (16, 1024), 3)
    gen = RandomBlocks(qtype, seed=0, pool_bytes=1 << 18)
    buf = np.empty(gen.group * 16, np.uint8)
    gen.fill(buf, np.random.default_rng(2), 0.05)
    block, size = block_geometry(qtype)
    for raw in (w.raw.reshape(-1), torch.from_numpy(buf)):
        x = dequantize(raw, qtype, (raw.numel() // size * block,))
        d = x.abs().max()
        assert set(torch.unique(x / d).tolist()) == {-1.0, 0.0, 1.0}
