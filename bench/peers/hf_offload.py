#!/usr/bin/env python
"""The naive baseline a Python user has: transformers + accelerate offloading (`device_map="auto"` with
`max_memory`), on the same GGUF file, under the same VRAM budget.

    python bench/peers/hf_offload.py MODEL.gguf --budget-gib 8 --lengths 1024,4096 --gen 32 --runs 3 --out hf.json

transformers dequantizes the GGUF weights to --dtype at load (bf16 on a GPU: ~2 bytes per weight in host RAM).
accelerate places whole modules on the GPU until `max_memory[0]` (the budget less --reserve-gib for the CUDA
context, activations and the KV cache) is used, the rest in host RAM, copied in for every forward.

Per length: 1 warm-up + --runs measured passes of one prefill forward over exactly L tokens (the bench's filler
text) and --gen greedy decode steps with the KV cache; prefill tok/s = L / prefill time, decode tok/s = gen /
decode time, TTFT = prefill time (the first token comes out of the prefill). Writes a peer record in the
sweep's shape (what `strata bench --vs hf` reads). Peak VRAM is torch's max reserved plus the context.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # strata (for the filler text and the GGUF header reader)


def summary(xs: list[float]) -> dict:
    from strata.bench.stats import Summary

    return Summary.of(xs).as_dict()


def load(model: Path, budget_gib: float | None, reserve_gib: float, dtype_name: str, cpu_gib: float | None):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from strata.hub.verify import read_gguf_header

    meta = read_gguf_header(model).metadata
    arch = meta.get("general.architecture")
    cfg = AutoConfig.from_pretrained(model.parent, gguf_file=model.name)
    # transformers' GGUF mapping leaves the expert FFN width at the config default for some families (qwen3moe:
    # 768 whatever the file says): set it from the file
    eff = meta.get(f"{arch}.expert_feed_forward_length")
    if eff and hasattr(cfg, "moe_intermediate_size"):
        cfg.moe_intermediate_size = int(eff)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[dtype_name]
    kw: dict = {"config": cfg, "dtype": dtype}
    cuda = torch.cuda.is_available()
    if cuda and budget_gib is not None:
        gpu = max(budget_gib - reserve_gib, 0.1)
        cpu = f"{cpu_gib}GiB" if cpu_gib else f"{int(_ram_gib() * 0.9)}GiB"
        kw.update(device_map="auto", max_memory={0: f"{gpu:.2f}GiB", "cpu": cpu})
    elif cuda:
        kw.update(device_map="cuda")
    t0 = time.perf_counter()
    m = AutoModelForCausalLM.from_pretrained(model.parent, gguf_file=model.name, **kw).eval()
    load_s = time.perf_counter() - t0
    tok = AutoTokenizer.from_pretrained(model.parent, gguf_file=model.name)
    placement: dict[str, int] = {}
    for dev in (getattr(m, "hf_device_map", None) or {"": "cpu" if not cuda else "cuda"}).values():
        placement[str(dev)] = placement.get(str(dev), 0) + 1
    return m, tok, load_s, placement


def _ram_gib() -> float:
    import psutil

    return psutil.virtual_memory().available / 2**30


def prompt_ids(tok, n: int, seed: int) -> list[int]:
    from strata.bench.prompts import filler_words, join_words

    words = max(64, n)
    while True:
        ids = tok(join_words(filler_words(words, seed)), add_special_tokens=False)["input_ids"]
        if len(ids) >= n:
            return ids[:n]
        words *= 2


def one_pass(m, ids: list[int], gen: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds for `gen` tokens)."""
    import torch

    from transformers import DynamicCache

    dev = m.get_input_embeddings().weight.device
    x = torch.tensor([ids], device=dev)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    # newer transformers name the KV cache argument `cache` (and warn on `past_key_values`)
    key = "cache" if "cache" in inspect.signature(m.forward).parameters else "past_key_values"
    with torch.inference_mode():
        try:
            cache = DynamicCache(config=m.config)
        except TypeError:  # older transformers
            cache = DynamicCache()
        sync()
        t0 = time.perf_counter()
        out = m(input_ids=x, use_cache=True, **{key: cache})
        nxt = out.logits[:, -1:].argmax(-1)
        sync()
        t1 = time.perf_counter()
        for _ in range(gen):
            out = m(input_ids=nxt.to(dev), use_cache=True, **{key: cache})  # the cache grows in place
            nxt = out.logits[:, -1:].argmax(-1)
        sync()
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--budget-gib", type=float, default=None, help="VRAM budget of the whole process")
    p.add_argument("--reserve-gib", type=float, default=1.5, help="kept out of max_memory for context/activations/KV")
    p.add_argument("--cpu-gib", type=float, default=None, help="host RAM for offloaded weights (default 90%% free)")
    p.add_argument("--lengths", default="1024,4096")
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dtype", default=None, help="bf16 (GPU default) | f16 | f32 (CPU default)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    cuda = torch.cuda.is_available()
    dtype = a.dtype or ("bf16" if cuda else "f32")
    model = Path(a.model).resolve()
    lengths = [int(x) for x in a.lengths.split(",") if x]
    m, tok, load_s, placement = load(model, a.budget_gib, a.reserve_gib, dtype, a.cpu_gib)
    print(f"hf: loaded in {load_s:.1f}s, modules per device {placement}", file=sys.stderr)
    ctx = getattr(m.config, "max_position_embeddings", None)
    rows, skipped = [], []
    for n in lengths:
        if ctx and n + a.gen > ctx:
            skipped.append({"length": n, "why": f"exceeds the model's context of {ctx}"})
            continue
        for i in range(a.warmup):
            one_pass(m, prompt_ids(tok, n, 1000 + i), a.gen)
        runs = []
        for i in range(a.runs):
            pf, dc = one_pass(m, prompt_ids(tok, n, i), a.gen)
            runs.append({"prompt_tokens": n, "prefill_s": pf, "decode_s": dc, "prefill_tok_s": n / pf,
                         "decode_tok_s": a.gen / dc if dc else None, "ttft_s": pf})
        rows.append({"length": n, "prompt_tokens": [n] * a.runs, "runs": runs, "experts": {},
                     "prefill_tok_s": summary([r["prefill_tok_s"] for r in runs]),
                     "decode_tok_s": summary([r["decode_tok_s"] for r in runs if r["decode_tok_s"]]),
                     "ttft_s": summary([r["ttft_s"] for r in runs])})
        r = rows[-1]
        print(f"hf L={n}: prefill {r['prefill_tok_s']['median']:.1f} tok/s, decode {r['decode_tok_s']['median']:.2f} "
              f"tok/s", file=sys.stderr)
    peak = None
    if cuda:
        # reserved by torch's allocator plus the CUDA context torch does not count
        free, total = torch.cuda.mem_get_info()
        peak = torch.cuda.max_memory_reserved() + (total - free - torch.cuda.memory_reserved())
    res = {"how": f"transformers + accelerate (device_map auto, max_memory GPU = budget - {a.reserve_gib} GiB), "
                  f"{dtype} weights dequantized from the GGUF file; modules per device {placement}",
           "budget_gib": a.budget_gib, "vram_peak_bytes": peak, "load_s": load_s, "placement": placement,
           "torch_threads": torch.get_num_threads(), "pid": os.getpid(),
           "suites": {"sweep": {"config": {"lengths": lengths, "runs": a.runs, "warmup": a.warmup, "gen": a.gen,
                                           "tolerance": 0.0, "cache_prompt": False, "tool": "hf_offload"},
                                "rows": rows, "skipped": skipped}}}
    text = json.dumps(res, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
