"""Host time of the tiered chunk path (no GPU needed): one MoE layer of a 4,096-token prefill chunk with B1's
routing shape (128 experts, top-8, 25 cache slots), the device's work (the grouped FFN, the combine) stubbed out
so only the host's work is timed — the part that leaves a GPU idle between a layer's routing sync and its
launches. Prints the median per MoE layer (whole layer, and up to the layer's first launch) for PCIe only and
auto.

    python tools/host_chunk.py
"""
import sys
import time
sys.path.insert(0, ".")
import torch
import numpy as np
from pathlib import Path
import strata.experts.tiered as T
import strata.ops.moe_prefill as MP
from strata.config import EngineConfig, ExpertConfig
from strata.engine.loader import load_model
from strata.kv.cache import Segment
from tests.experts.tiered_model import write_moe_gguf

T.GROUPED_CHUNKS_ON_CPU = True
first = []
def _fake(x, g, u, d, ids, counts=None, out=None):  # the device's work: not timed here
    if first and first[-1] is None:
        first[-1] = time.perf_counter()
    return out
MP.grouped_expert_ffn = _fake
T.combine = lambda y, w, dt: torch.zeros(y.shape[0], y.shape[2], dtype=dt)
p = Path("scratch/b1shape-host.gguf")
p.parent.mkdir(exist_ok=True)
if not p.exists():
    write_moe_gguf(p, n_layers=4, d=64, ff=32, n_experts=128, k=8, vocab=96, router_std=0.05)
res = {}
for plan in ("000000000", "auto"):
    cfg = EngineConfig(model=str(p), device="cpu", dtype="float32", ctx_size=8192,
                       experts=ExpertConfig(mode="tiered", slots=25, cpu_plan=plan))
    lm = load_model(str(p), cfg, with_tokenizer=False)
    m, ex = lm.model, lm.model.experts
    if plan == "auto":
        from strata.experts.plan import CostModel
        ex.costs = CostModel(cpu_ms_per_expert=0.1, pcie_ms_per_expert=0.08, gpu_ms_per_expert=0.01,
                             cpu_ms_per_token_expert=0.01, gpu_ms_per_token_expert=0.0005)
    ex.lane = None if plan != "auto" else ex.lane
    times, orig = [], ex.forward
    firsts = []
    def timed(layer, x, ids, w, orig=orig):
        t0 = time.perf_counter()
        first.append(None)
        out = orig(layer, x, ids, w)
        times.append(time.perf_counter() - t0)
        firsts.append((first[-1] or time.perf_counter()) - t0)
        return out
    ex.forward = timed
    N = 4096
    toks = torch.randint(0, 96, (N,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for r in range(4):
            m.forward(toks, torch.arange(N), [Segment(0, 0, N)], m.new_kv_cache(1, 8192))
    res[plan] = (round(float(np.median(times[4:])) * 1e3, 2), round(float(np.median(firsts[4:])) * 1e3, 2))
print("host ms per MoE layer of a 4096-token chunk (128 experts, top-8, 25 slots) (whole layer, to the first launch):", res)
