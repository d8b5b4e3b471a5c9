"""CPU lane bandwidth per weight format, kernel and thread count (one token through one expert, weights from RAM).

    .venv/bin/python tools/bench_cpu_lane.py [--experts 32] [--threads 1,2,4,8,16] [--ff 768 --d 2048]

Prints ms per expert and GB/s of the bytes each kernel reads (packed int4 for `int4`, the stored blocks for
`ref`), next to the memory read bandwidth of a plain torch sum and a bf16 GEMV over dequantized copies (the
bar the fused kernels should beat), plus PCIe and GPU per-expert costs when CUDA is present. Default shapes
are Qwen3-30B-A3B's experts.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from strata.experts import costs
from strata.ops import cpu_native
from strata.experts.resident import ExpertWeights
from strata.quant import random_qtensor
from gguf import GGMLQuantizationType as Q


def experts(qtype, E, ff, d, seed=0) -> ExpertWeights:
    rng = np.random.default_rng(seed)
    return ExpertWeights(random_qtensor(qtype, (E, ff, d), rng), random_qtensor(qtype, (E, ff, d), rng),
                         random_qtensor(qtype, (E, d, ff), rng))


def read_gbps(threads: int, nbytes: int = 1 << 30) -> float:
    torch.set_num_threads(threads)
    t = torch.ones(nbytes // 4)
    t.sum()
    t0 = time.perf_counter()
    for _ in range(3):
        t.sum()
    return 3 * nbytes / (time.perf_counter() - t0) / 1e9


def bf16_gemv_gbps(ew: ExpertWeights, threads: int, n: int) -> float:
    torch.set_num_threads(threads)
    ws = [(torch.cat([ew.gate[e].dequantize(torch.bfloat16), ew.up[e].dequantize(torch.bfloat16)]),
           ew.down[e].dequantize(torch.bfloat16)) for e in range(n)]
    x = torch.randn(1, ew.gate.shape[-1]).bfloat16()
    ff = ew.gate.shape[1]

    def run():
        for gu, dn in ws:
            h = F.linear(x, gu)
            F.linear(F.silu(h[:, :ff]) * h[:, ff:], dn)

    run()
    t0 = time.perf_counter()
    run()
    dt = (time.perf_counter() - t0) / n
    return sum(a.numel() + b.numel() for a, b in ws[:1]) * 2 / dt / 1e9


def native_batched(ew: ExpertWeights, threads: int, n: int, per_call: int) -> tuple[float, float]:
    """(ms per expert, GB/s) of the native kernel taking `per_call` experts of one token per call (a decode
    token-layer's CPU share)."""
    k = cpu_native.NativeExperts(ew.gate.raw, ew.up.raw, ew.down.raw, threads=threads,
                                 fmt_gate_up=ew.gate.qtype.name, fmt_down=ew.down.qtype.name)
    x = torch.randn(1, ew.gate.shape[-1])
    rows = np.zeros(per_call, dtype=np.int64)
    calls = [list(range(i, i + per_call)) for i in range(0, n - per_call + 1, per_call)]
    for c in calls:
        k(c, x, rows)
    t0 = time.perf_counter()
    for _ in range(3):
        for c in calls:
            k(c, x, rows)
    dt = (time.perf_counter() - t0) / (3 * len(calls) * per_call)
    return dt * 1e3, ew.expert_nbytes() / dt / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--threads", default=None, help="comma-separated (default: 1 and all cores)")
    ap.add_argument("--ff", type=int, default=768)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--ref-experts", type=int, default=2, help="experts for the (slow) reference kernel")
    a = ap.parse_args()
    cores = torch.get_num_threads()
    threads = [int(t) for t in a.threads.split(",")] if a.threads else sorted({1, cores})
    print(f"expert shape: gate/up [{a.ff}, {a.d}], down [{a.d}, {a.ff}]; {a.experts} experts cycled; "
          f"torch {torch.__version__}; {cores} threads available")
    rows = []
    sets = {qt: experts(qt, a.experts, a.ff, a.d, seed=i)
            for i, qt in enumerate((Q.Q4_K, Q.IQ4_XS, Q.IQ2_XXS, Q.IQ3_XXS, Q.Q4_0, Q.Q8_0))}
    native = {Q.Q4_K, Q.IQ4_XS, Q.IQ2_XXS, Q.IQ3_XXS, Q.Q8_0}  # (the native kernel's; int4 repacks Q4_0/Q8_0/Q4_K)
    for th in threads:
        rows.append((th, "memory read (torch sum)", "-", 0.0, read_gbps(th)))
        rows.append((th, "bf16 GEMV, dequantized copy", "bf16", 0.0, bf16_gemv_gbps(sets[Q.Q4_K], th, min(a.experts, 8))))
        for qt, ew in sets.items():
            for dtype in (torch.bfloat16, torch.float32):
                fast = dtype == torch.bfloat16
                kernels = ((["native"] if qt in native else []) + (["int4"] if qt in (Q.Q4_K, Q.Q4_0, Q.Q8_0) else [])) \
                    if fast else ["ref"]
                for kernel in kernels:
                    if kernel == "native" and cpu_native.load() is None:
                        continue
                    n = a.experts if fast and kernel != "ref" else a.ref_experts
                    ms, gbps, kind = costs.cpu_bandwidth(ew, th, dtype=dtype, kernel=kernel, passes=2, n_experts=n)
                    rows.append((th, f"{qt.name} {str(dtype)[6:]} activations", kind, ms, gbps))
                if qt in native - {Q.Q8_0} and fast and cpu_native.load() is not None:
                    ms, gbps = native_batched(ew, th, a.experts, 4)
                    rows.append((th, f"{qt.name}, 4 experts per call", "native", ms, gbps))
    print(f"{'thr':>3}  {'what':<32} {'kernel':<6} {'ms/expert':>10} {'GB/s':>7}")
    for th, what, kind, ms, gbps in rows:
        print(f"{th:>3}  {what:<32} {kind:<6} {ms:>10.3f} {gbps:>7.2f}")
    if torch.cuda.is_available():
        ew = sets[Q.Q4_K]
        print(f"PCIe: {costs.measure_pcie_expert_ms(ew, 'cuda'):.3f} ms/expert "
              f"({ew.expert_nbytes() / 1e6:.2f} MB); GPU grouped: {costs.measure_gpu_expert_ms(ew, 'cuda'):.3f} ms/expert")


if __name__ == "__main__":
    main()
