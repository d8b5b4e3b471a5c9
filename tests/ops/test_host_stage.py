"""`stage_misses`: the distinct missed experts of a step copied into staging slots, decided on the device.

The Triton kernel runs in Triton's interpreter on the CPU (and on the GPU where there is one) against the torch
twin: the rewritten slots, the bytes that land in the staging slots, a repeated expert staged once, more distinct
misses than staging slots (the rest stay misses), hits untouched, and the slots beyond the staged ones unwritten;
with one program per part and with a bounded grid of programs looping over the parts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata.ops import registry
from strata.quant import random_qtensor

SCRIPT = textwrap.dedent("""
    import numpy as np, torch
    from gguf import GGMLQuantizationType as Q
    from strata.ops.host_stage import triton_stage_misses
    from strata.ops.reference import stage_misses
    from strata.quant import random_qtensor
    from strata.quant.qtensor import QTensor
    rng = np.random.default_rng(0)
    dev = torch.device(DEVICE)
    host = [random_qtensor(Q.Q4_K, (6, 8, 256), rng), random_qtensor(Q.Q4_K, (6, 8, 256), rng),
            random_qtensor(Q.Q8_0, (6, 256, 64), rng)]
    if dev.type == "cuda":
        host = [QTensor(t.raw.pin_memory(), t.qtype, t.shape) for t in host]
    def pools(on=dev):
        return [QTensor(torch.zeros((7,) + tuple(t.raw.shape[1:]), dtype=torch.uint8, device=on), t.qtype,
                        (7,) + tuple(t.shape[1:])) for t in host]
    cases = [([2, -1, -1, 0, -1, -1], [4, 1, 3, 0, 1, 5], 3, 4),   # expert 1 twice: staged once
             ([-1, -1, -1, -1, -1], [5, 4, 3, 2, 1], 2, 3),         # more distinct misses than slots
             ([0, 1], [0, 1], 3, 4),                               # all hits
             ([-1] * 9, [3, 3, 3, 0, 3, 0, 2, 2, 2], 0, 7)]       # 9 pairs, 3 experts, the whole pool
    for slots, eids, base, n in cases:
        s = torch.tensor(slots, device=dev)
        e = torch.tensor(eids, device=dev)
        pr, pt = pools(torch.device("cpu")), pools()
        ref = stage_misses(s.cpu(), e.cpu(), [QTensor(t.raw.cpu(), t.qtype, t.shape) for t in host], pr, base, n)
        assert any(t.raw.any() for t in pr) or all(v >= 0 for v in slots), "the twin staged nothing"
        pr = [t.raw for t in pr]
        for programs in (0, 1, 2, 5):  # one program per part; a bounded grid looping over the parts
            pt = pools()
            got = triton_stage_misses(s, e, host, pt, base, n, programs=programs)
            assert got.cpu().tolist() == ref.tolist(), (slots, eids, programs, got.tolist(), ref.tolist())
            for a, b in zip(pt, pr):
                assert torch.equal(a.raw.cpu(), b), (slots, eids, programs)
    print("ok")
""")


def _run(device: str, interpret: bool) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, "-c", f"DEVICE = {device!r}\n" + SCRIPT], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_kernel_matches_the_torch_twin_in_the_interpreter():
    pytest.importorskip("triton")
    _run("cpu", interpret=True)


@pytest.mark.gpu
def test_kernel_matches_the_torch_twin_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _run("cuda", interpret=False)


def test_twin_stages_each_distinct_miss_once():
    host = [random_qtensor(Q.Q8_0, (5, 4, 32), rng=i) for i in range(3)]
    from strata.quant.qtensor import QTensor

    pool = [QTensor(torch.zeros((6,) + tuple(t.raw.shape[1:]), dtype=torch.uint8), t.qtype, (6,) + tuple(t.shape[1:]))
            for t in host]
    out = registry.op("stage_misses")(torch.tensor([-1, 0, -1, -1]), torch.tensor([3, 1, 3, 4]), host, pool, 2, 4)
    assert out.tolist() == [2, 0, 2, 3]
    for src, dst in zip(host, pool):
        assert torch.equal(dst.raw[2], src.raw[3]) and torch.equal(dst.raw[3], src.raw[4])
        assert not dst.raw[4].any() and not dst.raw[0].any()
