"""What a speculative verify step costs, by its length: the table issue 21's draft-length choice rests on.

    python tools/bench_verify.py -m MODEL.gguf [engine flags, e.g. --vram-gb 8] --tokens 1,2,3,4,6,8 --steps 24

A sampled continuation of a prompt is generated first (T 0.8, seeded); then, for each T, the same text is replayed
as verify steps of T tokens (the continuation's own tokens as the draft: every one accepted, so each step routes as
real text does) through the engine's graphed verify path where it has one (a CUDA GPU), and each step is timed to
the device's completion. Per T: the median step time, the distinct experts each step missed (summed over layers:
what crossed PCIe) against T = 1's, and from them the decode rate a drafter of per-token acceptance a would give:
E(tokens a step) = (1 - a^T) / (1 - a) for a draft of T - 1 tokens, over the step's time. Prints one JSON line
(and a table on stderr).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

sys.path.insert(0, ".")
import strata  # noqa: F401,E402  (before torch: it sets the OpenMP runtime's environment)
import torch  # noqa: E402

from strata.engine.cli import add_engine_args, engine_config  # noqa: E402
from strata.engine.engine import Engine  # noqa: E402
from strata.engine.loader import load_model  # noqa: E402
from strata.engine.sampler import SamplingParams  # noqa: E402
from strata.kv.cache import Segment  # noqa: E402

ACCEPTANCE = (0.5, 0.7, 0.9)


def expected_tokens(a: float, T: int) -> float:
    """Tokens a verify step of T (a draft of T - 1 plus the target's own) yields at per-token acceptance a."""
    return float(T) if a >= 1.0 else (1.0 - a ** T) / (1.0 - a)


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _missed_experts(experts) -> float:
    """Distinct experts moved over PCIe so far, summed over layers (the statistics' bytes over an expert's)."""
    if experts is None or getattr(experts, "stats", None) is None:
        return 0.0
    if getattr(experts, "direct", None) is not None:
        experts.direct.flush()  # the direct path counts a step when it settles it
    eb = max(1, next(iter(experts.expert_bytes.values())))
    return experts.stats.pcie_bytes / eb


def measure(eng: Engine, prompt: list[int], text: list[int], T: int, steps: int) -> dict:
    """Verify steps of T tokens over `text` after `prompt` (slot 0): median ms, distinct misses a step."""
    m = eng.model
    dev = m.device
    experts = m.experts
    with torch.inference_mode():
        m.forward(torch.tensor(prompt, device=dev), torch.arange(len(prompt), device=dev),
                  [Segment(0, 0, len(prompt))], eng.kv)
        pos, times, misses = len(prompt), [], []
        graphs = eng.graphs if eng.graphs is not None and (T == 1 or eng.graphs.verify) else None
        for i in range(steps + 2):  # the first two: captures and warm-up, not counted
            if pos + T > len(prompt) + len(text):
                break
            toks = text[pos - len(prompt):pos - len(prompt) + T]
            _sync(dev)
            before = _missed_experts(experts)
            t0 = time.perf_counter()
            if graphs is not None:
                graphs.step_batch(toks, [pos], [0], T)
            else:
                m.forward(torch.tensor(toks, device=dev), torch.arange(pos, pos + T, device=dev),
                          [Segment(0, pos, T)], eng.kv, all_logits=True)
            _sync(dev)
            dt = time.perf_counter() - t0
            after = _missed_experts(experts)
            if i >= 2:
                times.append(dt * 1e3)
                misses.append(after - before)
            pos += T
    if not times:
        raise SystemExit(f"bench_verify: the continuation is too short for steps of {T} tokens; raise --gen")
    return {"T": T, "steps": len(times), "graphed": graphs is not None, "ms": round(statistics.median(times), 3),
            "ms_min": round(min(times), 3), "missed_experts": round(statistics.fmean(misses), 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(ap)
    ap.add_argument("--tokens", default="1,2,3,4,6,8", help="verify step lengths T (1: a plain decode step)")
    ap.add_argument("--steps", type=int, default=24, help="timed steps per T (after two warm-up steps)")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen", type=int, default=0, help="continuation length (default: enough for every T)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    Ts = sorted({int(t) for t in a.tokens.split(",") if t.strip()})
    if not Ts or Ts[0] < 1:
        raise SystemExit("bench_verify: --tokens takes step lengths >= 1, e.g. 1,2,4,8")
    lm = load_model(a.model, engine_config(a))
    eng = Engine(lm, n_slots=1)
    tok = lm.tokenizer
    text = open(__file__).read() * 4
    prompt = (tok.encode(text, add_special=False) if tok else list(range(1, a.prompt_tokens + 1)))[:a.prompt_tokens]
    gen = a.gen or (a.steps + 2) * max(Ts) + 1
    if len(prompt) + gen > eng.max_ctx:
        raise SystemExit(f"bench_verify: {len(prompt)} + {gen} tokens exceed the context ({eng.max_ctx}); "
                         "raise --ctx-size or lower --steps")
    cont = list(eng.generate(prompt, SamplingParams(temperature=a.temperature, seed=7), gen))
    rows = [measure(eng, prompt, cont, T, a.steps) for T in Ts]
    base = rows[0]
    for r in rows:
        r["misses_vs_T1"] = round(r["missed_experts"] / base["missed_experts"], 2) if base["missed_experts"] else None
        r["tok_s"] = {f"{acc:.0%}": round(expected_tokens(acc, r["T"]) / (r["ms"] / 1e3), 1) for acc in ACCEPTANCE}
    out = {"label": a.label, "model": a.model, "device": str(lm.model.device), "temperature": a.temperature,
           "rows": rows}
    print(json.dumps(out))
    head = f"{'T':>3} {'ms/step':>9} {'missed':>8} {'vs T=1':>7}  " + "  ".join(f"tok/s@{acc:.0%}" for acc in ACCEPTANCE)
    print(head, file=sys.stderr)
    for r in rows:
        rate = "  ".join(f"{r['tok_s'][f'{acc:.0%}']:>10}" for acc in ACCEPTANCE)
        print(f"{r['T']:>3} {r['ms']:>9} {r['missed_experts']:>8} {str(r['misses_vs_T1']):>7}  {rate}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
