"""The one-launch Triton dequantizers run in Triton's interpreter on the CPU, bit for bit against the torch
reference (`strata.quant.dequant`, itself bit-exact with gguf-py) in float32, bfloat16 and float16."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import warnings
    import numpy as np, torch
    from gguf import GGMLQuantizationType as Q
    from strata.ops import dequant_triton as dt
    from strata.quant import random_qtensor
    from strata.quant.dequant import dequantize_flat
    from strata.quant.formats import block_geometry
    warnings.simplefilter("ignore", RuntimeWarning)  # inf * 0 in fully random blocks
    assert dt.SUPPORTED == {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4,
                            Q.IQ2_XXS, Q.IQ3_XXS, Q.IQ2_S, Q.IQ2_XS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M}, dt.SUPPORTED
    rng = np.random.default_rng(0)

    def same(ours, ref, what):
        # bit for bit, except that NaNs only need to be NaN in the same places
        assert ours.dtype == ref.dtype and ours.shape == ref.shape, what
        nan = torch.isnan(ref)
        assert torch.equal(torch.isnan(ours), nan), what
        bits = torch.int32 if ref.dtype == torch.float32 else torch.int16
        bad = int((ours.view(bits) != ref.view(bits))[~nan].sum())
        assert bad == 0, (what, bad)

    for qt in sorted(dt.SUPPORTED):
        block, size = block_geometry(qt)
        _, _, _, bb = dt.KERNELS[qt]
        # one block; a partial last program; the fully random bytes (f16 infs, NaNs, subnormals included)
        for n in (1, bb + 5):
            valid = random_qtensor(qt, (n, block), rng).raw.reshape(-1)
            noise = torch.from_numpy(rng.integers(0, 256, n * size, dtype=np.uint8))
            for kind, raw in (("valid", valid), ("random", noise)):
                for dtype in (torch.float32, torch.bfloat16, torch.float16):
                    ref = dequantize_flat(raw, qt, dtype)  # the torch reference (a CPU tensor)
                    same(dt.dequantize_blocks(raw, qt, dtype=dtype), ref, (qt.name, n, kind, dtype))
        # odd byte alignment (f16 fields read bytewise) and a non-contiguous out
        buf = torch.cat([torch.zeros(1, dtype=torch.uint8), valid])
        ref = dequantize_flat(valid, qt)
        same(dt.dequantize_blocks(buf[1:], qt), ref, (qt.name, "odd offset"))
        out = torch.empty(ref.numel(), 2)[:, 1]
        assert dt.dequantize_blocks(valid, qt, out=out) is out
        same(out.contiguous(), ref, (qt.name, "strided out"))
    print("ok")
""")


def test_triton_dequant_is_bit_exact_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_formats_without_a_kernel_are_not_claimed():
    import torch
    from gguf import GGMLQuantizationType as Q

    from strata.ops import dequant_triton as dt

    assert dt.supports(Q.Q4_K, torch.bfloat16) and dt.supports(Q.Q8_0, torch.float32)
    assert dt.supports(Q.IQ4_NL, torch.float16) and dt.supports(Q.IQ4_XS, torch.bfloat16)
    assert dt.supports(Q.MXFP4, torch.float32)
    assert dt.supports(Q.Q2_K, torch.float32) and dt.supports(Q.Q3_K, torch.bfloat16)
    assert not dt.supports(Q.Q4_K, torch.float64) and dt.supports(Q.Q5_0, torch.float32)
    assert dt.supports(Q.IQ2_XXS, torch.float32) and dt.supports(Q.IQ3_XXS, torch.bfloat16)
    assert dt.supports(Q.IQ2_S, torch.float16)
    assert dt.supports(Q.IQ1_S, torch.float32) and dt.supports(Q.IQ3_S, torch.bfloat16)
    assert not dt.supports(Q.TQ1_0, torch.float32) and not dt.supports(Q.TQ2_0, torch.float32)
