"""Rows of a table in host RAM gathered by a kernel (strata.ops.host_rows) against the torch twin: in Triton's
interpreter on the CPU and (marked gpu) from pinned host memory on CUDA, inside a CUDA graph."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from strata.ops import host_rows, reference
    g = torch.Generator().manual_seed(0)
    for V, B in ((50, 2176), (7, 5000), (300, 18)):  # a Q8_0 row, a row past one block, a short odd one
        table = torch.randint(0, 256, (V, B), generator=g, dtype=torch.uint8)
        ids = torch.randint(0, V, (9,), generator=g)
        assert torch.equal(host_rows.triton_gather_rows(table, ids), reference.gather_rows(table, ids)), (V, B)
    print("ok")
""")


def test_gather_rows_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.gpu
def test_gather_rows_from_pinned_memory_in_a_cuda_graph():
    from strata.ops import reference, registry

    table = torch.randint(0, 256, (1000, 2176), dtype=torch.uint8).pin_memory()
    ids = torch.tensor([3, 999, 3, 0], device="cuda")
    op = registry.op("gather_rows")
    assert op.pick(table, ids).name == "triton"
    op(table, ids)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(table, ids)
    for new in ([5, 6, 7, 8], [999, 0, 1, 2]):
        ids.copy_(torch.tensor(new))
        graph.replay()
        assert torch.equal(out.cpu(), reference.gather_rows(table, ids.cpu()))
