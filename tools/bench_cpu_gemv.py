"""The CPU's decode-sized qmatmul (strata.ops.cpu_gemv, the native kernel) by rows of x: what a verify step's or a
batch's extra rows cost against one.

    python tools/bench_cpu_gemv.py [--formats Q4_K,Q6_K,Q8_0] [--shape 2048x4096] [--rows 1,2,3,4] [--threads 2]

Per format: several random weights of the shape, cycled so that they do not stay in the CPU's caches; per row count,
the best of --repeats timings of --calls calls; prints µs a call and the ratio to the first row count.
"""

from __future__ import annotations

import argparse
import sys
import time

sys.path.insert(0, ".")
import strata  # noqa: F401,E402  (before torch: it sets the OpenMP runtime's environment)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402

from strata.ops.cpu_gemv import native_qmatmul  # noqa: E402
from strata.quant import random_qtensor  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="Q4_K,Q6_K,Q8_0")
    ap.add_argument("--shape", default="2048x4096", help="N x K of each weight")
    ap.add_argument("--rows", default="1,2,3,4")
    ap.add_argument("--weights", type=int, default=4, help="weights cycled (their bytes past the caches)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    N, K = (int(v) for v in a.shape.lower().split("x"))
    rows = [int(r) for r in a.rows.split(",")]
    for name in a.formats.split(","):
        ws = [random_qtensor(Q[name], (N, K), np.random.default_rng(i)) for i in range(a.weights)]
        us = []
        for T in rows:
            x = torch.randn(T, K)
            for w in ws:
                native_qmatmul(x, w)
            best = float("inf")
            for _ in range(a.repeats):
                t = time.perf_counter()
                for _ in range(a.calls):
                    for w in ws:
                        native_qmatmul(x, w)
                best = min(best, (time.perf_counter() - t) / (a.calls * len(ws)))
            us.append(best * 1e6)
        print(f"{name} {N}x{K}: " + "  ".join(f"T {T}: {v:.0f} us ({v / us[0]:.2f}x)" for T, v in zip(rows, us)),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
