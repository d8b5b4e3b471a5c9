"""Where a tiered run's device memory goes, stage by stage (GPU machine): the device's used memory (driver),
torch's allocated / reserved, and the difference (what torch's allocator does not see: the CUDA context, modules
loaded on first use, cuBLAS/cuBLASLt handles, graph executables).

    python tools/gpu/memdiag.py -m MODEL.gguf --vram-gb 8 --cpu-plan 000000000 [engine flags]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, ".")

from strata.engine.cli import add_engine_args, engine_config  # noqa: E402
from strata.engine.engine import Engine  # noqa: E402
from strata.engine.loader import load_model  # noqa: E402
from strata.engine.sampler import SamplingParams  # noqa: E402

G = 2**30
rows = []


def mark(stage: str, **extra) -> None:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    used, alloc, res = (total - free) / G, torch.cuda.memory_allocated() / G, torch.cuda.memory_reserved() / G
    peak = torch.cuda.max_memory_allocated() / G
    r = dict(stage=stage, used=round(used, 3), reserved=round(res, 3), allocated=round(alloc, 3),
             peak_alloc=round(peak, 3), outside_torch=round(used - res, 3), slack=round(res - alloc, 3), **extra)
    rows.append(r)
    print(json.dumps(r), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--long", type=int, default=4096)
    a = ap.parse_args()
    torch.zeros(1, device="cuda")
    mark("context")
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    (x @ x).sum().item()
    mark("cublas")
    lm = load_model(a.model, engine_config(a))
    mark("loaded")
    eng = Engine(lm, n_slots=1)
    ex = lm.model.experts
    kv = round(eng.kv.nbytes / G, 3)
    mark("engine", cache_gib=round(ex.cache.nbytes() / G, 3), slots=ex.cache.slots, chunk=eng.prefill_chunk, kv=kv)
    sp = SamplingParams(temperature=0)
    list(eng.generate(list(range(1, a.prompt_tokens + 1)), sp, 1))
    mark("prefill_1k")
    list(eng.generate(list(range(7, a.prompt_tokens + 7)), sp, 64))
    mark("decode_64")
    list(eng.generate(list(range(11, a.long + 11)), sp, 8))
    mark(f"prefill_{a.long}")
    list(eng.generate(list(range(13, a.prompt_tokens + 13)), sp, 64))
    mark("decode_again")
    torch.cuda.empty_cache()
    mark("after_empty_cache")
    print(torch.cuda.memory_summary(abbreviated=True), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
