"""Host time of the graphed decode hand-off (no GPU needed): a layer's host work between piece H and piece B
(the split, the staging, the statistics) and after piece B (the policy, admissions, the map), per MoE layer of a
decode step with B1's routing shape (128 experts, top-8, 25 cache slots; near-uniform routing: a few misses a
layer, as on sampled text). On a GPU the hand-off's first part lies on the step's critical path.

    python tools/host_handoff.py [--plan 000000000] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


sys.path.insert(0, ".")

from strata.config import EngineConfig, ExpertConfig  # noqa: E402
from strata.engine.engine import Engine  # noqa: E402
from strata.engine.loader import load_model  # noqa: E402
from strata.experts import tiered_decode  # noqa: E402
from tests.experts.tiered_model import write_moe_gguf  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", default="000000000")
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    p = Path("scratch/b1shape-handoff.gguf")
    p.parent.mkdir(exist_ok=True)
    if not p.exists():
        write_moe_gguf(p, n_layers=8, d=64, ff=32, n_experts=128, k=8, vocab=96, router_std=0.02)
    cfg = EngineConfig(model=str(p), device="cpu", dtype="float32", cuda_graphs=True, ctx_size=1024,
                       experts=ExpertConfig(mode="tiered", slots=25, cpu_plan=a.plan))
    eng = Engine(load_model(str(p), cfg, with_tokenizer=False), n_slots=1)
    first, after = [], []
    inner = tiered_decode.GraphedDecode._handoff

    def timed(self, *args):
        fn = inner(self, *args)

        def run():
            t0 = time.perf_counter()
            post = fn()
            first.append(time.perf_counter() - t0)
            if post is None:
                return None

            def run_post():
                t1 = time.perf_counter()
                post()
                after.append(time.perf_counter() - t1)

            return run_post

        run.bucket = getattr(fn, "bucket", None)
        return run

    tiered_decode.GraphedDecode._handoff = timed
    toks = [(13 * i + 5) % 96 for i in range(32)]
    out = list(eng.generate(toks, None, a.steps))
    ex = eng.model.experts
    n = max(1, ex.stats.tokens)
    print(f"{len(out)} steps, {(ex.stats.cpu + ex.stats.pcie) / n / len(ex.layer_ids):.2f} misses a layer: hand-off "
          f"before piece B {statistics.median(first) * 1e6:.0f} us, after {statistics.median(after) * 1e6:.0f} us "
          f"(medians per MoE layer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
