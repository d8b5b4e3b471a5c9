"""Prefill building blocks on CUDA: one-launch Triton dequantization and the grouped expert FFN.

    .venv/bin/python tools/bench_prefill_ops.py [--tokens 4096 --k 8 --experts 128 --d 2048 --ff 768]

1. `dequantize_flat` (Triton, one launch) against the torch reference path (~20 ops per chunk) on a 4096x2048
   Q8_0 weight and a 128 x 768x2048 Q4_K expert stack, to float32 and bfloat16: ms and GB/s written.
2. A prefill chunk's experts (Qwen3-30B-A3B shapes by default, Q4_K, bf16 activations, uniform top-k routing):
   `grouped_expert_ffn` against the per-expert loop (`resident.expert_loop`), the loop also with the torch
   dequantizer (the state before the Triton dequant): ms and TFLOPS (2 * 3 * N * k * d * ff flops).
CUDA only; about half a minute.
"""

from __future__ import annotations

import argparse
import contextlib

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from strata.experts.resident import ExpertWeights, expert_loop
from strata.ops import dequant_triton
from strata.ops.moe_prefill import grouped_expert_ffn
from strata.quant import random_qtensor
from strata.quant.dequant import dequantize_flat


def timed(fn, reps: int = 5) -> float:
    """Median ms of fn() over reps, after one warm-up call (compiles, allocator)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


@contextlib.contextmanager
def torch_dequant():
    """dequantize_flat without its Triton kernels: the torch reference path."""
    real = dequant_triton.available
    dequant_triton.available = lambda: False
    try:
        yield
    finally:
        dequant_triton.available = real


def bench_dequant(rng) -> None:
    print("dequantize_flat                           triton ms   GB/s | torch ms   GB/s | speed-up")
    for name, qt, shape in (("Q8_0 4096x2048", Q.Q8_0, (4096, 2048)),
                            ("Q4_K 128 x 768x2048", Q.Q4_K, (128, 768, 2048))):
        w = random_qtensor(qt, shape, rng).to("cuda")
        for dtype in (torch.float32, torch.bfloat16):
            out = torch.empty(w.numel(), dtype=dtype, device="cuda")
            gb = out.numel() * out.element_size() / 1e9
            # the lambdas bind w and out now: they are deleted after the loop
            t_tri = timed(lambda w=w, out=out: dequantize_flat(w.raw, qt, dtype, out=out))
            with torch_dequant():
                t_ref = timed(lambda w=w, out=out: dequantize_flat(w.raw, qt, dtype, out=out))
            label = f"{name} -> {str(dtype).split('.')[-1]}"
            print(f"  {label:39s} {t_tri:8.3f} {gb / t_tri * 1e3:6.0f} | {t_ref:8.3f} {gb / t_ref * 1e3:6.0f} |"
                  f" {t_ref / t_tri:6.1f}x")
        del w, out


def bench_experts(rng, N: int, k: int, E: int, d: int, ff: int) -> None:
    ew = ExpertWeights(random_qtensor(Q.Q4_K, (E, ff, d), rng), random_qtensor(Q.Q4_K, (E, ff, d), rng),
                       random_qtensor(Q.Q4_K, (E, d, ff), rng)).to("cuda")
    gen = torch.Generator().manual_seed(0)
    ids = torch.rand(N, E, generator=gen).topk(k, dim=1).indices.cuda()  # [N, k] uniform, distinct per token
    x = torch.randn(N, d, generator=gen).to("cuda", torch.bfloat16)
    tflop = 2 * 3 * N * k * d * ff / 1e12
    print(f"experts of a chunk: N={N} k={k} E={E} d={d} ff={ff}, Q4_K, bf16 ({tflop * 1e3:.0f} GFLOP)")
    results = {"grouped_expert_ffn": timed(lambda: grouped_expert_ffn(x, ew.gate, ew.up, ew.down, ids), reps=3),
               "per-expert loop": timed(lambda: expert_loop(ew, x, ids), reps=3)}
    with torch_dequant():
        results["per-expert loop, torch dequant"] = timed(lambda: expert_loop(ew, x, ids), reps=3)
    base = results["grouped_expert_ffn"]
    for name, ms in results.items():
        print(f"  {name:32s} {ms:9.2f} ms  {tflop / ms * 1e3:6.1f} TFLOPS  {ms / base:6.1f}x grouped")
    y = grouped_expert_ffn(x, ew.gate, ew.up, ew.down, ids)
    ref = expert_loop(ew, x, ids)
    print(f"  max relative difference per pair, grouped vs loop: "
          f"{((y - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item():.2e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--ff", type=int, default=768)
    a = ap.parse_args()
    if not torch.cuda.is_available() or not dequant_triton.available():
        raise SystemExit("bench_prefill_ops needs CUDA and Triton")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    rng = np.random.default_rng(0)
    bench_dequant(rng)
    bench_experts(rng, a.tokens, a.k, a.experts, a.d, a.ff)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
