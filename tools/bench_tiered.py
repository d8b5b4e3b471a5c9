"""Decode speed of the tiered experts backend alone, on B1-shaped MoE layers with synthetic routing.

    .venv/bin/python tools/bench_tiered.py --layers 8 --slots 32 --cpu-plan auto --steps 200 [--device cuda]

Builds `--layers` MoE layers of `--experts` random Q4_K experts (Qwen3-30B-A3B shapes by default), routes
each decode step's token to k experts drawn from a Zipf-skewed popularity per layer (`--skew`; 0 = uniform),
and times `TieredExperts.forward` per layer-step after `--warmup` steps. Prints ms per layer-step, the
projection to a 48-layer token, hit rate, CPU / PCIe experts per token, swaps, and the backend's time
breakdown. Everything outside the experts (attention, router, head) is not run: compare the projection with
the roofline's expert part, not with a whole-model tok/s.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from strata.config import EngineConfig, ExpertConfig
from strata.experts.resident import ExpertWeights
from strata.experts.tiered import TieredExperts
from strata.quant import random_qtensor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--ff", type=int, default=768)
    ap.add_argument("--qtype", default="Q4_K")
    ap.add_argument("--slots", type=int, default=None, help="slots per layer (default: from --vram-gb)")
    ap.add_argument("--vram-gb", type=float, default=None)
    ap.add_argument("--cpu-plan", default="auto")
    ap.add_argument("--cpu-threads", type=int, default=0)
    ap.add_argument("--swap-budget", type=int, default=4)
    ap.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of expert popularity (0 = uniform)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bf16 on CUDA, f32 on CPU")
    a = ap.parse_args()

    qt = Q[a.qtype]
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    layers = {i: ExpertWeights(random_qtensor(qt, (a.experts, a.ff, a.d), rng),
                               random_qtensor(qt, (a.experts, a.ff, a.d), rng),
                               random_qtensor(qt, (a.experts, a.d, a.ff), rng)) for i in range(a.layers)}
    print(f"made {a.layers} layers x {a.experts} {a.qtype} experts "
          f"({layers[0].expert_nbytes() / 1e6:.2f} MB each) in {time.perf_counter() - t0:.1f}s")
    dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    cfg = EngineConfig(device=a.device, dtype=dtype, experts=ExpertConfig(
        mode="tiered", vram_gb=a.vram_gb, slots=a.slots, cpu_plan=a.cpu_plan, cpu_threads=a.cpu_threads,
        swap_budget=a.swap_budget, profile=True))
    t0 = time.perf_counter()
    ex = TieredExperts(layers, cfg)
    print(f"backend ready in {time.perf_counter() - t0:.1f}s (store pinned: {ex.store.pinned})")
    dev, dt = cfg.torch_device, cfg.torch_dtype
    # per-layer popularity: Zipf over a random permutation of the experts
    pops = []
    for _ in range(a.layers):
        p = 1.0 / np.arange(1, a.experts + 1) ** a.skew
        pops.append(rng.permutation(p / p.sum()))
    x = torch.randn(1, a.d, device=dev).to(dt)
    w = torch.full((1, a.k), 1.0 / a.k, device=dev)

    def step():
        for li in range(a.layers):
            ids = rng.choice(a.experts, size=a.k, replace=False, p=pops[li])
            ex.forward(li, x, torch.as_tensor(ids, device=dev).view(1, -1), w)

    for _ in range(a.warmup):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    ex.stats.reset()
    ex.profile.reset()
    ex._events.clear()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    ms = (time.perf_counter() - t0) * 1e3 / (a.steps * a.layers)
    s = ex.stats
    print(f"slots/layer {ex.cache.slots}, plan {ex.plan}, CPU kernel "
          f"{','.join(sorted(set(ex.lane.kernel.values()))) if ex.lane else '-'}, threads {torch.get_num_threads()}")
    if ex.costs is not None:
        c = ex.costs
        print(f"costs: cpu {c.cpu_ms_per_expert:.3f} ms/expert, pcie {c.pcie_ms_per_expert:.3f}, "
              f"gpu {c.gpu_ms_per_expert:.3f}, hand-off {c.cpu_overhead_ms:.3f}")
    print(f"{ms:.3f} ms per layer-step -> {48 * ms:.1f} ms per 48-layer token ({1e3 / (48 * ms):.1f} tok/s "
          f"experts only); {s.summary()} (per layer: cpu {s.cpu / max(s.layers, 1):.2f}, "
          f"pcie {s.pcie / max(s.layers, 1):.2f})")
    print("note: --profile events add one sync per step")
    print(ex.profile_report())


if __name__ == "__main__":
    main()
