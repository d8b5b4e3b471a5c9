"""The one-launch weighted sum of a MoE layer's choices (strata.ops.combine) against its torch twin: in Triton's
interpreter on the CPU and (marked gpu) compiled on CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

CASES = textwrap.dedent("""
    import torch
    from strata.ops import combine, reference

    def check(dev):
        g = torch.Generator().manual_seed(0)
        for N, k, d, dtype in ((1, 8, 2048, torch.bfloat16), (5, 2, 100, torch.float32), (3, 10, 1500, torch.float16)):
            y = torch.randn(N, k, d, generator=g).to(dev)
            w = torch.rand(N, k, generator=g).to(dev)
            got, want = combine.triton_combine_choices(y, w, dtype), reference.combine_choices(y, w, dtype)
            assert got.dtype == want.dtype == dtype and got.shape == want.shape == (N, d)
            tol = 1e-6 if dtype == torch.float32 else 2 ** -7
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            assert err <= tol, (N, k, d, dtype, err)
        print("ok")
""")


def test_combine_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", CASES + "\ncheck('cpu')\n"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_the_twin_sums_a_large_chunk_in_parts_as_in_one():
    from strata.ops import reference

    g = torch.Generator().manual_seed(1)
    y, w = torch.randn(40, 4, 64, generator=g), torch.rand(40, 4, generator=g)
    whole = reference.combine_choices(y, w, torch.float32)
    old = reference.COMBINE_ELEMENTS
    try:
        reference.COMBINE_ELEMENTS = 4 * 64 * 7  # slices of 7 tokens
        assert torch.equal(reference.combine_choices(y, w, torch.float32), whole)
    finally:
        reference.COMBINE_ELEMENTS = old


@pytest.mark.gpu
def test_combine_on_cuda():
    ns: dict = {}
    exec(CASES, ns)
    ns["check"]("cuda")
