"""What strata-tiny's recorded numbers mean, computed one way for the training script and for CI.

- ``windows(ids, ctx)``: the held-out ids cut into consecutive windows of ``ctx`` tokens; every window predicts
  its tokens 1..n-1 from the ones before (the first token of a window is not scored).
- ``strata_eval(gguf, text, ctx)``: strata's own forward (CPU, float32, all experts resident) over those windows:
  perplexity, the routing trace (``strata.bench.routing``), and greedy completions of ``PROMPTS``.
- ``hf_perplexity(hf_dir, ids, ctx)``: transformers' ``Qwen3MoeForCausalLM`` on the same windows, float32 (the
  oracle that the exported checkpoint is the trained model).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

# Three fixed prompts whose greedy completions are recorded at training time and checked in CI.
PROMPTS = (
    {"name": "fibonacci", "kind": "text",
     "prompt": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'},
    {"name": "list_files", "kind": "text",
     "prompt": "import os\n\n\ndef list_python_files(directory):\n"},
    {"name": "palindrome_chat", "kind": "chat",
     "prompt": "Write a function that checks whether a string is a palindrome."},
)
N_PREDICT = 40


def windows(ids: list[int], ctx: int) -> list[list[int]]:
    return [w for w in (ids[i : i + ctx] for i in range(0, len(ids), ctx)) if len(w) >= 2]


def nll_of_logits(logits: torch.Tensor, w: list[int]) -> float:
    """Summed negative log-likelihood of w[1:] given logits [len(w), V] (float32)."""
    tgt = torch.tensor(w[1:], dtype=torch.long, device=logits.device)
    return float(F.cross_entropy(logits[:-1].float(), tgt, reduction="sum"))


def load_cpu(gguf: str | Path, ctx: int):
    from strata.config import EngineConfig
    from strata.engine.loader import load_model

    cfg = EngineConfig(model=str(gguf), device="cpu", dtype="f32", ctx_size=ctx)
    return load_model(str(gguf), cfg)


def prompt_ids(lm, p: dict) -> list[int]:
    tok = lm.tokenizer
    if p["kind"] == "chat":
        text = lm.template.render([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True)
        return tok.encode_prompt(text)
    return tok.encode(p["prompt"])


def greedy(lm, ids: list[int], n: int) -> list[int]:
    from strata.engine.engine import Engine
    from strata.engine.sampler import SamplingParams

    eng = Engine(lm, n_slots=1)
    out = []
    for t in eng.generate(ids, SamplingParams(temperature=0.0), n, stop_ids=set(lm.tokenizer.eot_ids)):
        out.append(int(t))
    return out


def completions(lm, prompts=PROMPTS, n: int = N_PREDICT) -> list[dict]:
    res = []
    for p in prompts:
        out = greedy(lm, prompt_ids(lm, p), n)
        text = lm.tokenizer.decode([t for t in out if t not in lm.tokenizer.eot_ids])
        res.append({**p, "n_predict": n, "ids": out, "text": text})
    return res


@torch.inference_mode()
def strata_perplexity(lm, ids: list[int], ctx: int, trace: bool = True) -> tuple[float, int, dict | None]:
    """(perplexity, scored tokens, routing stats or None) from strata's forward over ``windows(ids, ctx)``."""
    from strata.bench.routing import record_routing, routing_stats
    from strata.engine.loader import forward_all

    nll, n = 0.0, 0
    if trace:
        with record_routing(lm.model) as tr:
            for w in windows(ids, ctx):
                nll += nll_of_logits(forward_all(lm, w), w)
                n += len(w) - 1
        stats = routing_stats(tr)
    else:
        for w in windows(ids, ctx):
            nll += nll_of_logits(forward_all(lm, w), w)
            n += len(w) - 1
        stats = None
    return math.exp(nll / n), n, stats


def strata_eval(gguf: str | Path, text: str, ctx: int, prompts=PROMPTS, n_predict: int = N_PREDICT, lm=None) -> dict:
    lm = lm or load_cpu(gguf, ctx)
    ids = lm.tokenizer.encode(text)
    ppl, n, stats = strata_perplexity(lm, ids, ctx)
    return {"ids": ids, "perplexity": ppl, "scored_tokens": n, "windows": len(windows(ids, ctx)),
            "routing": stats, "completions": completions(lm, prompts, n_predict)}


@torch.inference_mode()
def module_perplexity(forward, ids: list[int], ctx: int, device) -> float:
    """Perplexity of any ``forward(tokens [1, T]) -> logits [1, T, V]`` over ``windows(ids, ctx)``."""
    nll, n = 0.0, 0
    for w in windows(ids, ctx):
        logits = forward(torch.tensor([w], device=device))[0]
        nll += nll_of_logits(logits, w)
        n += len(w) - 1
    return math.exp(nll / n)


def hf_perplexity(hf_dir: str | Path, ids: list[int], ctx: int, device: str = "cpu") -> float:
    import transformers

    m = transformers.Qwen3MoeForCausalLM.from_pretrained(str(hf_dir)).float().to(device).eval()
    return module_perplexity(lambda t: m(t).logits, ids, ctx, device)


# --------------------------------------------------------------------------------------------------------------
# checking a recorded run against a recomputation (CI and the toy end-to-end test)

def recompute(lm, text: str, rec: dict) -> dict:
    """strata's numbers for ``text`` with the recorded context and completion lengths (``lm``: ``load_cpu``)."""
    n = rec["completions"][0]["n_predict"] if rec["completions"] else N_PREDICT
    prompts = [{k: c[k] for k in ("name", "kind", "prompt")} for c in rec["completions"]]
    return strata_eval(None, text, rec["heldout"]["ctx"], prompts, n, lm=lm)


def routing_diffs(recorded: dict, got: dict, tol: float = 0.02) -> list[str]:
    """Every routing statistic that moved by more than ``tol`` (fractions: 0.02 = 2 points)."""
    out = []

    def cmp(label, a, b):
        if abs(a - b) > tol:
            out.append(f"{label}: recomputed {b:.4f}, recorded {a:.4f}")

    for f, v in recorded["lru"].items():
        cmp(f"LRU hit rate at {f}", v["hit_rate"], got["lru"][f]["hit_rate"])
    for f, v in recorded["popularity"]["top_share"].items():
        cmp(f"share of the top {f} experts", v, got["popularity"]["top_share"][f])
    for key in ("max_share", "min_share"):
        cmp(key, recorded["popularity"][key], got["popularity"][key])
    cmp("reuses by the next token", recorded["reuse_distance"]["within_1"], got["reuse_distance"]["within_1"])
    return out


def completion_diff(lm, recorded: dict, got: list[int], tie: float = 1e-3) -> str | None:
    """None when ``got`` is the recorded greedy completion, or parts from it only at a near tie (the two tokens'
    logits within ``tie``: float summation order on another machine may pick either); else what differs."""
    from strata.engine.loader import forward_all

    want = recorded["ids"]
    i = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), None)
    if i is None:
        return None if len(want) == len(got) else f"{recorded['name']}: {len(got)} tokens, recorded {len(want)}"
    logits = forward_all(lm, prompt_ids(lm, recorded) + want[:i])[-1]
    gap = abs(float(logits[want[i]]) - float(logits[got[i]]))
    if gap <= tie * max(1.0, float(logits.abs().max())):
        return None
    return (f"{recorded['name']}: token {i} is {got[i]}, recorded {want[i]} (logit gap {gap:.4f}); "
            f"got {lm.tokenizer.decode(got)!r}, recorded {recorded['text']!r}")


def fill_strata_numbers(record: dict, gguf: str | Path, text: str, n_predict: int = N_PREDICT, log=print) -> None:
    """Measure ``gguf`` with strata on the held-out ``text`` and write the numbers into ``record`` (in place):
    perplexity, routing, completions, and the held-out slice's token counts (``heldout.ids`` too, for checks)."""
    ctx = record["heldout"]["ctx"]
    ev = strata_eval(gguf, text, ctx, n_predict=n_predict)
    record["heldout"].update({"ids": ev["ids"], "tokens": len(ev["ids"]), "scored_tokens": ev["scored_tokens"],
                              "windows": ev["windows"]})
    record["perplexity"].update({"strata": ev["perplexity"], "strata_device": "cpu", "strata_dtype": "f32"})
    record["routing"] = ev["routing"]
    record["completions"] = ev["completions"]
    log(f"eval: strata perplexity {ev['perplexity']:.3f} over {ev['scored_tokens']} tokens "
        f"({ev['windows']} windows of {ctx})")
    for c in ev["completions"]:
        log(f"eval: greedy [{c['name']}] {c['prompt']!r} -> {c['text']!r}")
    r = ev["routing"]
    log("eval: LRU hit rate by capacity " + ", ".join(f"{k}: {v['hit_rate']:.3f}" for k, v in r["lru"].items())
        + f"; median reuse distance {r['reuse_distance']['median']}")
