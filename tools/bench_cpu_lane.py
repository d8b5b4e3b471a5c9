"""CPU lane bandwidth per weight format, kernel and thread count (one token through one expert, weights from RAM).

    .venv/bin/python tools/bench_cpu_lane.py [--experts 32] [--threads 1,2,4,8,16] [--ff 768 --d 2048]
    .venv/bin/python tools/bench_cpu_lane.py --alternate Q5_K,MXFP4 [--reps 15] [--per-call 4]

Prints ms per expert and GB/s of the bytes each kernel reads (packed int4 for `int4`, the stored blocks for
`ref`), next to the memory read bandwidth of a plain torch sum and a bf16 GEMV over dequantized copies (the
bar the fused kernels should beat), plus PCIe and GPU per-expert costs when CUDA is present. Default shapes
are Qwen3-30B-A3B's experts.

`--alternate FMT,...` times only the native kernel, each format against Q4_K in the same run: one pass over the
experts per format in turn, repeated, medians (a shared machine's load then falls on all of them alike).

`--gpt-oss` times gpt-oss-shaped experts (MXFP4 gate/up [2880, 2880] and down [2880, 2880], biases, the clamped
SwiGLU) through the CPU lane's native kernel and through the reference path, alternately, medians:

    .venv/bin/python tools/bench_cpu_lane.py --gpt-oss --threads 1 [--experts 8 --ref-experts 2 --reps 7]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from strata.experts import costs
from strata.ops import cpu_native
from strata.experts.cpu_lane import CpuLane
from strata.experts.resident import ExpertAct, ExpertWeights
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


def alternate(names: list[str], threads: list[int], n: int, ff: int, d: int, reps: int, per_call: int = 1) -> None:
    """The native kernel, one token through `per_call` experts a call (1: one expert, the call's fixed cost in
    every figure; a decode token-layer's CPU share is a few), each format of `names` and Q4_K timed in turn."""
    fmts = [Q.Q4_K] + [Q[f] for f in names if f != "Q4_K"]
    sets = {qt: experts(qt, n, ff, d, seed=i) for i, qt in enumerate(fmts)}
    x = torch.randn(1, d)
    print(f"{'thr':>3}  {'format':<8} {'MB/expert':>9} {'ms/expert':>10} {'GB/s':>7} {'Q4_K GB/s':>9} {'bytes/s vs Q4_K':>15}")
    for th in threads:
        torch.set_num_threads(th)
        ks = {qt: cpu_native.NativeExperts(ew.gate.raw, ew.up.raw, ew.down.raw, threads=th, fmt_gate_up=qt.name,
                                           fmt_down=qt.name) for qt, ew in sets.items()}
        times: dict = {qt: [] for qt in fmts}
        for r in range(reps + 1):
            for qt, k in ks.items():
                t0 = time.perf_counter()
                for e in range(0, n - per_call + 1, per_call):
                    k(list(range(e, e + per_call)), x, [0] * per_call)
                if r:  # the first round warms up
                    times[qt].append((time.perf_counter() - t0) / (n // per_call * per_call))
        gbps = {qt: sets[qt].expert_nbytes() / float(np.median(times[qt])) / 1e9 for qt in fmts}
        for qt in fmts:
            print(f"{th:>3}  {qt.name:<8} {sets[qt].expert_nbytes() / 1e6:>9.2f} {np.median(times[qt]) * 1e3:>10.3f} "
                  f"{gbps[qt]:>7.2f} {gbps[Q.Q4_K]:>9.2f} {gbps[qt] / gbps[Q.Q4_K]:>15.2f}")


def gpt_oss(threads: list[int], n: int, n_ref: int, reps: int) -> None:
    """gpt-oss-shaped MXFP4 experts, one token through one expert a call: the lane's native kernel and its
    reference path (what these experts took before the kernel computed biases and the clamped SwiGLU) in turn."""
    d = ff = 2880
    rng, g = np.random.default_rng(0), torch.Generator().manual_seed(0)
    ew = ExpertWeights(*(random_qtensor(Q.MXFP4, s, rng) for s in ((n, ff, d), (n, ff, d), (n, d, ff))),
                       act=ExpertAct("swiglu_oai", 1.702, 7.0, *(torch.randn(n, w, generator=g) for w in (ff, ff, d))))
    x = torch.randn(1, d, generator=g).bfloat16()
    mb = ew.expert_nbytes() / 1e6
    print(f"gpt-oss expert: MXFP4 gate/up [{ff}, {d}], down [{d}, {ff}], biases, swiglu_oai; {mb:.2f} MB an expert; "
          f"native over {n} experts, the reference over {n_ref}; {reps} rounds, medians")
    print(f"{'thr':>3}  {'kernel':<7} {'ms/expert':>10} {'GB/s':>7} {'speed-up':>8}")
    for th in threads:
        lanes = {k: CpuLane({0: ew}, threads=th, kernel=k, dtype=torch.bfloat16) for k in ("native", "ref")}
        assert lanes["native"].kernel[0] == "native"
        times: dict = {k: [] for k in lanes}
        for r in range(reps + 1):
            for k, lane in lanes.items():
                m = n if k == "native" else n_ref
                t0 = time.perf_counter()
                for e in range(m):
                    lane.expert(0, e, x)
                if r:  # the first round warms up
                    times[k].append((time.perf_counter() - t0) / m)
        med = {k: float(np.median(v)) for k, v in times.items()}
        for k in lanes:
            print(f"{th:>3}  {k:<7} {med[k] * 1e3:>10.3f} {mb / 1e3 / med[k]:>7.2f} {med['ref'] / med[k]:>8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--threads", default=None, help="comma-separated (default: 1 and all cores)")
    ap.add_argument("--ff", type=int, default=768)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--ref-experts", type=int, default=2, help="experts for the (slow) reference kernel")
    ap.add_argument("--alternate", default=None, help="comma-separated formats: the native kernel only, each "
                    "timed alternately with Q4_K")
    ap.add_argument("--per-call", type=int, default=1, help="--alternate: experts of one token a call (1: one "
                    "expert, its call's fixed cost in each figure; 4: a decode token-layer's CPU share)")
    ap.add_argument("--reps", type=int, default=15, help="rounds of --alternate or --gpt-oss (medians)")
    ap.add_argument("--gpt-oss", action="store_true", help="gpt-oss-shaped MXFP4 experts: native against the "
                    "reference path, alternately")
    a = ap.parse_args()
    cores = torch.get_num_threads()
    threads = [int(t) for t in a.threads.split(",")] if a.threads else sorted({1, cores})
    if a.gpt_oss:
        if cpu_native.load() is None:
            raise SystemExit(f"the native kernel is unavailable: {cpu_native.unavailable()}")
        return gpt_oss(threads, a.experts, a.ref_experts, a.reps)
    if a.alternate:
        if cpu_native.load() is None:
            raise SystemExit(f"the native kernel is unavailable: {cpu_native.unavailable()}")
        print(f"expert shape: gate/up [{a.ff}, {a.d}], down [{a.d}, {a.ff}]; {a.experts} experts cycled; "
              f"{a.reps} rounds, medians")
        return alternate(a.alternate.split(","), threads, a.experts, a.ff, a.d, a.reps, a.per_call)
    print(f"expert shape: gate/up [{a.ff}, {a.d}], down [{a.d}, {a.ff}]; {a.experts} experts cycled; "
          f"torch {torch.__version__}; {cores} threads available")
    rows = []
    sets = {qt: experts(qt, a.experts, a.ff, a.d, seed=i)
            for i, qt in enumerate((Q.Q4_K, Q.Q5_K, Q.MXFP4, Q.IQ4_XS, Q.IQ2_XXS, Q.IQ3_XXS, Q.Q3_K, Q.Q2_K, Q.Q4_0,
                                    Q.Q8_0))}
    native = {Q[n] for n in cpu_native.FORMATS}  # (the native kernel's; int4 repacks Q4_0/Q8_0/Q4_K)
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
