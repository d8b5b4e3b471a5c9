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


def _run(device: str, interpret: bool, script: str = SCRIPT) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, "-c", f"DEVICE = {device!r}\n" + script], env=env, capture_output=True,
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


BOOKKEEPING = textwrap.dedent("""
    import torch
    from strata.ops.host_stage import triton_commit_prefetch, triton_lookup_slots
    from strata.ops.reference import commit_prefetch, lookup_slots
    dev = torch.device(DEVICE)
    g = torch.Generator().manual_seed(0)
    E = 40
    for P in (1, 8, 10, 80):  # a token's k, and several tokens' pairs (not a power of two)
        for trial in range(4):
            smap = torch.randint(-1, 30, (E,), generator=g)
            smap[torch.rand(E, generator=g) < 0.5] = -1  # half the experts not cached
            pmap = torch.full((E,), -1, dtype=torch.int64)
            pmap[torch.randperm(E, generator=g)[:6]] = torch.arange(50, 56)
            flat = torch.randint(0, E, (P,), generator=g)
            for mode in ("plain", "prefetched", "fill"):
                outs = []
                for fn, d in ((lookup_slots, torch.device("cpu")), (triton_lookup_slots, dev)):
                    rec = torch.full((3, P), 7, dtype=torch.int64, device=d)
                    got = fn(flat.to(d), smap.to(d), rec, pmap.to(d) if mode == "prefetched" else None,
                             mode == "fill")
                    outs.append((got.cpu().tolist(), rec.cpu().tolist()))
                assert outs[0] == outs[1], (P, mode, outs)
            # a prefetch's result: predicted experts (repeats), the cache's slots, stage_misses' output
            pid = torch.randint(0, E, (P,), generator=g)
            cached = smap[pid]
            staged = torch.where(cached < 0, torch.randint(-3, 9, (P,), generator=g), cached)
            ref = []
            for e in set(pid.tolist()):  # (the kernel stages one slot an expert: its pairs agree)
                staged[pid == e] = staged[pid == e][0]
            for fn, d in ((commit_prefetch, torch.device("cpu")), (triton_commit_prefetch, dev)):
                pm = torch.randint(0, 9, (E,), dtype=torch.int64, device=d)
                rec2 = torch.full((P,), 7, dtype=torch.int64, device=d)
                fn(pid.to(d), cached.to(d), staged.to(d), pm, rec2)
                ref.append((pm.cpu().tolist(), rec2.cpu().tolist()))
            assert ref[0] == ref[1], (P, ref)
    print("ok")
""")


def test_bookkeeping_kernels_match_their_twins_in_the_interpreter():
    """lookup_slots and commit_prefetch (a MoE layer's cache lookups and a prefetch's map, one launch each)."""
    pytest.importorskip("triton")
    _run("cpu", interpret=True, script=BOOKKEEPING)


@pytest.mark.gpu
def test_bookkeeping_kernels_match_their_twins_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _run("cuda", interpret=False, script=BOOKKEEPING)
