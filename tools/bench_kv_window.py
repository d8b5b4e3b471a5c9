"""What the KV window costs a decode step's KV reads and writes, against the full cache, without a model.

    python tools/bench_kv_window.py --ctx 32768 --window 8192 --types q8_0,bf16

B1's attention shapes by default (48 layers, 4 KV heads x 128). For each KV type, a full cache and a window of
--window tokens a layer each get a prompt of nearly --ctx tokens, written in chunks of 4,096 (each chunk read
back as attention would). Then decode steps are timed to the device's completion: each step writes one token and
reads the slot's whole context, in every layer. Attention itself is left out (it is the same work for both).
Prints a line per cache: the step's time, the VRAM held, and for the window its page hits and the PCIe bytes a
step reads.
"""

from __future__ import annotations

import argparse
import sys
import time

sys.path.insert(0, ".")
import strata  # noqa: F401,E402  (before torch: it sets the OpenMP runtime's environment)
import torch  # noqa: E402

from strata.kv.cache import KVCache, Segment  # noqa: E402
from strata.kv.window import WindowKVCache  # noqa: E402


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def step(kv, layers: int, pos: int, x: torch.Tensor) -> None:
    """One decode step's KV work: a token written and the context read, in every layer."""
    for layer in range(layers):
        kv.write(layer, Segment(0, pos, 1), x[:1], x[:1])
        kv.read(layer, Segment(0, pos, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--window", type=int, default=8192)
    ap.add_argument("--page", type=int, default=256)
    ap.add_argument("--types", default="q8_0,bf16", help="KV types, comma-separated: bf16, f16, q8_0, q4_0")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    dev, dt = torch.device(a.device), torch.bfloat16
    shape = (a.heads, a.head_dim)
    chunk = 4096
    x = torch.randn(chunk, *shape, device=dev, dtype=dt)
    prompt = a.ctx - a.steps - 2
    for name in a.types.split(","):
        kind = {"bf16": None, "f16": torch.float16}.get(name, name)
        for make in (lambda: KVCache(a.layers, 1, a.ctx, shape, shape, dt, dev, kind, kind),
                     lambda: WindowKVCache(a.layers, 1, a.ctx, shape, shape, dt, dev, a.window, a.page, kind, kind)):
            kv = make()
            for layer in range(a.layers):
                for p in range(0, prompt, chunk):
                    n = min(chunk, prompt - p)
                    kv.write(layer, Segment(0, p, n), x[:n], x[:n])
                    kv.read(layer, Segment(0, p, n))

            step(kv, a.layers, prompt, x)  # (a first step settles the pool)
            _sync(dev)
            st = getattr(kv, "stats", None)
            before = (st.hits, st.misses, st.miss_bytes) if st is not None else None
            t = time.perf_counter()
            for i in range(a.steps):
                step(kv, a.layers, prompt + 1 + i, x)
            _sync(dev)
            ms = (time.perf_counter() - t) / a.steps * 1e3
            line = f"{name:5s} {type(kv).__name__:14s} {ms:7.1f} ms a step  VRAM {kv.nbytes / 2**20:7.0f} MiB"
            if st is not None:
                hits, misses, nbytes = (now - b for now, b in zip((st.hits, st.misses, st.miss_bytes), before))
                line += (f"  pages hit {100 * hits / max(1, hits + misses):.1f}%  PCIe "
                         f"{nbytes / a.steps / 1e9:.2f} GB a step")
            print(line, flush=True)
            del kv
            if dev.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
