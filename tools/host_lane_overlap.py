"""Does the CPU lane keep its speed at a decode's cadence and next to PCIe copies?

    python3 tools/host_lane_overlap.py [--threads 8,14,16] [--per-call 1,2,4] [--gap-us 300]

A decode step calls the CPU lane once per MoE layer with a few experts of one token, ~0.2-0.4 ms apart, while
the GPU's copy engine reads other experts from the same DRAM over PCIe. This times the native kernel's call
(Qwen3-30B-A3B expert shape, Q4_K, pinned host memory) in four settings:

    hot      calls back to back (the lane's best case, as tools/bench_cpu_lane.py measures)
    gap      a busy-wait of --gap-us between calls (the host doing the rest of a decode step)
    gap+dma  the same while a CUDA side stream copies pinned experts to the device without pause
    gap+tor  the same with a small torch CPU op before each call (torch's own OpenMP pool wakes up)

and the PCIe copy bandwidth alone and with the lane running. One JSON line per setting.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from strata.experts import cpu_native
from strata.quant import random_qtensor
from gguf import GGMLQuantizationType as Q


def spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--threads", default="8,14,16")
    ap.add_argument("--per-call", default="1,2,4")
    ap.add_argument("--gap-us", type=float, default=300.0)
    ap.add_argument("--calls", type=int, default=300)
    a = ap.parse_args()
    E, ff, d = a.experts, 768, 2048
    rng = np.random.default_rng(0)
    cuda = torch.cuda.is_available()

    def qt(shape):
        raw = random_qtensor(Q.Q4_K, shape, rng).raw.contiguous()
        return raw.pin_memory() if cuda else raw

    gate, up, down = qt((E, ff, d)), qt((E, ff, d)), qt((E, d, ff))
    expert_bytes = (gate[0].numel() + up[0].numel() + down[0].numel())
    x = torch.randn(1, d)
    out_h = torch.zeros(8, d)
    dev_buf = torch.empty(8, *gate.shape[1:], dtype=torch.uint8, device="cuda") if cuda else None
    side = torch.cuda.Stream() if cuda else None

    def dma_burst(n=8):  # n experts' gate projections, back to back on the side stream
        with torch.cuda.stream(side):
            for i in range(n):
                dev_buf[i % 8].copy_(gate[(i * 7) % E], non_blocking=True)

    def pcie_gbps(seconds=0.5, lane=None):
        torch.cuda.synchronize()
        t0, moved = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            dma_burst(16)
            moved += 16 * gate[0].numel()
            if lane is not None:
                lane()
            side.synchronize()
        return moved / (time.perf_counter() - t0) / 1e9

    for threads in (int(t) for t in a.threads.split(",")):
        k = cpu_native.NativeExperts(gate, up, down, threads=threads)
        for n in (int(v) for v in a.per_call.split(",")):
            ids = [list(rng.choice(E, n, replace=False)) for _ in range(a.calls)]
            rows = [0] * n
            res = {"threads": threads, "per_call": n}
            for mode in ("hot", "gap", "gap+dma", "gap+tor"):
                if mode == "gap+dma" and not cuda:
                    continue
                ts = []
                for i, e in enumerate(ids):
                    if mode != "hot":
                        spin(a.gap_us)
                    if mode == "gap+dma" and side.query():
                        dma_burst(64)  # ~170 MB: keeps the link busy across several calls
                    if mode == "gap+tor":
                        out_h[:n] = 0.0
                        x.float().mul_(1.0)
                    t0 = time.perf_counter()
                    k(e, x, rows)
                    ts.append(time.perf_counter() - t0)
                ts = np.array(ts[10:]) * 1e3
                med = float(np.median(ts))
                res[mode] = {"ms_p50": round(med, 4), "ms_p90": round(float(np.percentile(ts, 90)), 4),
                             "gbps": round(n * expert_bytes / (med * 1e-3) / 1e9, 1)}
            if cuda:
                torch.cuda.synchronize()
            print(json.dumps(res), flush=True)
        if cuda:
            e4 = [0, 1, 2, 3]
            res = {"threads": threads, "pcie_gbps_alone": round(pcie_gbps(), 1),
                   "pcie_gbps_with_lane": round(pcie_gbps(lane=lambda: k(e4, x, [0] * 4)), 1)}
            print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
