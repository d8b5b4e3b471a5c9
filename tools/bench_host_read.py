"""GPU micro-benchmark: expert FFN kernels reading missed experts straight from pinned host RAM (CUDA only).

    python tools/bench_host_read.py [--experts 1024] [--reps 30]

A decode step's missed expert can reach the GPU two ways: the host copies it into a staging slot (a DMA copy,
after the routing has crossed to the host and back) and a kernel reads the slot, or the kernel reads the
expert's bytes where they lie in pinned host memory (mapped into the GPU's address space), with no copy and no
host in the loop. This times `strata.ops.expert_triton.triton_expert_ffn` for P pairs of B1's Q4_K experts
(768 x 2048) three ways, each a CUDA graph of calls over different experts:

    hbm    the experts in device memory (a cache hit)
    host   the same kernel on the pinned host copy (every pair a miss read over PCIe)
    copy   cudaMemcpyAsync of the P experts into device slots, then the kernel on them (the staging lane)
    stage  `stage_misses` (a kernel copying each distinct missed expert from pinned host RAM into a device slot,
           decided on the device), then the kernel on the slots; "dup" rows route the P pairs to P/3 distinct
           experts (several sequences sharing misses), which host reads once per pair and stage once per expert

and prints us per call and GB/s of expert bytes, checking each result against the torch reference.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

sys.path.insert(0, ".")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from strata.ops import expert_triton  # noqa: E402
from strata.ops.host_stage import triton_stage_misses  # noqa: E402
from strata.ops.expert_gather import _torch_gather_ffn  # noqa: E402
from strata.quant import random_qtensor  # noqa: E402
from strata.quant.qtensor import QTensor  # noqa: E402


def graph_time(calls, reps: int) -> float:
    """Median seconds of one replay of a CUDA graph of `calls`."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in calls:
            f()
    for _ in range(3):
        g.replay()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=1024, help="experts in the host store (cycled through)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--pairs", default="1,4,8,32")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_host_read: needs a CUDA GPU", file=sys.stderr)
        return 1
    dev = torch.device("cuda")
    E, d, ff = a.experts, 2048, 768
    host = [random_qtensor(Q.Q4_K, (E, ff, d), rng=1), random_qtensor(Q.Q4_K, (E, ff, d), rng=2),
            random_qtensor(Q.Q4_K, (E, d, ff), rng=3)]
    host = [QTensor(t.raw.pin_memory(), t.qtype, t.shape) for t in host]  # [E, rows, row_bytes] pinned
    devw = [QTensor(t.raw.to(dev), t.qtype, t.shape) for t in host]
    per_expert = sum(t.raw[0].numel() for t in host)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {expert_triton.triton.__version__}; "
          f"{E} experts of {per_expert / 1e6:.2f} MB, pinned: {host[0].raw.is_pinned()}")
    ok = True
    gen = torch.Generator().manual_seed(0)
    for P in [int(p) for p in a.pairs.split(",")]:
        calls_n = max(1, min(64, E // P))
        sets = [torch.randperm(E, generator=gen)[:P].to(dev) for _ in range(calls_n)]
        x = torch.randn(P, d, device=dev).bfloat16()
        stage = [QTensor(torch.empty((P,) + tuple(t.raw.shape[1:]), dtype=torch.uint8, device=dev), t.qtype,
                         (P,) + tuple(t.shape[1:])) for t in host]
        ident = torch.arange(P, device=dev)
        ref = _torch_gather_ffn(x.float(), *devw, sets[0])
        for name, w in (("hbm", devw), ("host", host)):
            y = expert_triton.triton_expert_ffn(x, *w, sets[0])
            err = ((y - ref).norm() / ref.norm()).item()
            ok &= err < 1e-5
            t = graph_time([(lambda s=s, w=w: expert_triton.triton_expert_ffn(x, *w, s)) for s in sets], a.reps)
            t /= len(sets)
            print(f"P={P:<3} {name:<5} {t * 1e6:9.1f} us/call  {P * per_expert / t / 1e9:7.1f} GB/s  err {err:.1e}")
        miss = torch.full((P,), -1, dtype=torch.long, device=dev)

        def stage_then(s, w=stage):
            sl = triton_stage_misses(miss, s, host, w, 0, P)
            return expert_triton.triton_expert_ffn(x, *w, sl)

        for name, ss in (("stage", sets), ("dup", [s[torch.arange(P, device=dev) % max(1, P // 3)] for s in sets])):
            y = stage_then(ss[0])
            r = _torch_gather_ffn(x.float(), *devw, ss[0])
            err = ((y - r).norm() / r.norm()).item()
            ok &= err < 1e-5
            t = graph_time([(lambda s=s: stage_then(s)) for s in ss], a.reps) / len(ss)
            th = graph_time([(lambda s=s: expert_triton.triton_expert_ffn(x, *devw, miss, host=host, eids=s))
                             for s in ss], a.reps) / len(ss) if name == "dup" else None
            extra = f"   (host reads of the same pairs: {th * 1e6:.1f} us)" if th else ""
            print(f"P={P:<3} {name:<5} {t * 1e6:9.1f} us/call  {P * per_expert / t / 1e9:7.1f} GB/s of pairs  "
                  f"err {err:.1e}{extra}")
        cpu_sets = [s.cpu() for s in sets]

        def copy_then(s_cpu):
            for j, e in enumerate(s_cpu.tolist()):
                for dst, src in zip(stage, host):
                    dst.raw[j].copy_(src.raw[e], non_blocking=True)
            return expert_triton.triton_expert_ffn(x, *stage, ident)

        t = graph_time([(lambda s=s: copy_then(s)) for s in cpu_sets], a.reps) / len(sets)
        y = copy_then(cpu_sets[0])
        torch.cuda.synchronize()
        err = ((y - ref).norm() / ref.norm()).item()
        ok &= err < 1e-5
        print(f"P={P:<3} copy  {t * 1e6:9.1f} us/call  {P * per_expert / t / 1e9:7.1f} GB/s  err {err:.1e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
