"""The native CPU kernel's speed per weight format in one build: `native` (-march=native, as strata builds it) or
`avx2` (the same with -mno-avx512f: what a CPU without AVX-512 runs). One token through one B1-shaped expert a call
(gate/up [768, 2048], down [2048, 768]), 32 experts cycled from RAM, one thread, rounds alternating the formats,
medians; bytes/s against Q4_K's.

    .venv/bin/python tools/bench_cpu_builds.py avx2
    .venv/bin/python tools/bench_cpu_builds.py native --formats Q4_K,IQ2_XXS,IQ3_XXS
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_cpu_lane import experts  # noqa: E402

from strata.ops import cpu_native  # noqa: E402
from strata.ops.cpu_native import NativeExperts  # noqa: E402

FORMATS = "Q4_K,Q6_K,Q8_0,Q3_K,Q2_K,Q5_0,IQ4_XS,IQ2_XXS,IQ3_XXS,IQ2_S,IQ1_S"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build", choices=("native", "avx2"))
    ap.add_argument("--formats", default=FORMATS, help="comma-separated, Q4_K first (the baseline)")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    torch.set_num_threads(1)
    lib = cpu_native.build(cpu_native.FLAGS + (["-mno-avx512f"] if a.build == "avx2" else []))
    if lib is None:
        raise SystemExit(f"the {a.build} build failed: {cpu_native.unavailable()}")
    fmts = [Q[f.strip()] for f in a.formats.split(",")]
    lanes = {}
    for qt in fmts:
        ew = experts(qt, a.experts, 768, 2048)
        lanes[qt] = (NativeExperts(ew.gate.raw, ew.up.raw, ew.down.raw, threads=1, fmt_gate_up=qt.name,
                                   fmt_down=qt.name, lib=lib), ew.expert_nbytes())
    x = torch.randn(1, 2048)
    times: dict = {qt: [] for qt in fmts}
    for _ in range(a.rounds):
        for qt in fmts:
            ne = lanes[qt][0]
            t0 = time.perf_counter()
            for e in range(a.experts):
                ne([e], x)
            times[qt].append((time.perf_counter() - t0) / a.experts)
    base = lanes[fmts[0]][1] / statistics.median(times[fmts[0]])
    for qt in fmts:
        ms, nbytes = statistics.median(times[qt]), lanes[qt][1]
        print(f"{a.build} {qt.name:8s} {ms * 1e3:.3f} ms  {nbytes / ms / 1e9:5.1f} GB/s  "
              f"{nbytes / ms / base:.2f}x {fmts[0].name}'s bytes/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
