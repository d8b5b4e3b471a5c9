"""What strata-tiny's recorded numbers mean, computed one way for the training script and for CI.

- ``windows(ids, ctx)``: the held-out ids cut into consecutive windows of ``ctx`` tokens; every window predicts
  its tokens 1..n-1 from the ones before (the first token of a window is not scored).
- ``strata_eval(gguf, text, ctx)``: strata's own forward (CPU, float32, all experts resident) over those windows:
  perplexity, the routing trace (``strata.bench.routing``), and greedy completions of ``PROMPTS``.
- ``hf_perplexity(hf_dir, ids, ctx)``: transformers' causal LM of the checkpoint's family
  (``Glm4MoeForCausalLM``, which ignores the MTP block, or ``Qwen3MoeForCausalLM``) on the same windows, float32
  (the oracle that the exported checkpoint is the trained model).
- ``mtp_eval(lm, ids, ctx)`` (a model with an MTP block): the block's teacher-forced top-1 accuracy for the token
  after next over the same windows, then strata's engine decoding greedily from held-out prompts with
  ``--draft-source mtp --draft-max 0..3``: drafts proposed and accepted, tokens per trunk forward, decode tok/s.
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
    import json

    import transformers

    cls = json.loads((Path(hf_dir) / "config.json").read_text())["architectures"][0]
    m = getattr(transformers, cls).from_pretrained(str(hf_dir)).float().to(device).eval()
    return module_perplexity(lambda t: m(t).logits, ids, ctx, device)


# --------------------------------------------------------------------------------------------------------------
# the MTP block as a draft model

DRAFT_MAX = (1, 2, 3)
# a few held-out prompts: strata's CPU decode of this model runs at some 10-40 tokens/s, and the training run
# measures all of it within its time limit
MTP_PROMPTS, MTP_PROMPT_TOKENS, MTP_NEW_TOKENS = 4, 96, 48


@torch.inference_mode()
def strata_mtp_top1(lm, ids: list[int], ctx: int) -> tuple[float, int]:
    """Teacher-forced top-1 accuracy of strata's MTP head (strata.models.mtp.MtpHead) over ``windows(ids, ctx)``:
    for every position i of a window, the block reads the trunk's h[i] and the true t[i+1] and guesses t[i+2]
    (the drafter's first draft). -> (accuracy, positions scored)."""
    from strata.kv.cache import Segment
    from strata.models.mtp import MtpHead

    m = lm.model
    head = MtpHead(m, m.nextn[0], ctx + 2)
    hit = n = 0
    for w in windows(ids, ctx):
        if len(w) < 3:
            continue
        kv, hid = m.new_kv_cache(1, ctx), []
        t = torch.tensor(w, device=m.device)
        m.forward(t, torch.arange(len(w), device=m.device), [Segment(0, 0, len(w))], kv, all_logits=True,
                  hidden_out=hid)
        k = len(w) - 1  # pairs (h[i], t[i+1]) at the block's positions i + 1, rows i (as MtpDrafter places them)
        logits, _ = head.forward(hid[0][:k], t[1:], torch.arange(1, k + 1, device=m.device), Segment(0, 0, k),
                                 head.new_kv_cache(1, ctx + 2))
        hit += int((logits[: k - 1].argmax(-1) == t[2:]).sum())
        n += k - 1
    return hit / max(1, n), n


@torch.inference_mode()
def module_mtp_accuracy(model, ids: list[int], ctx: int, device) -> float:
    """The same teacher-forced top-1 accuracy from the training module (tools/tiny/glm.py), float32."""
    hit = n = 0
    for w in windows(ids, ctx):
        if len(w) < 3:
            continue
        t = torch.tensor([w], device=device)
        h, _, _ = model.trunk(t)
        logits, _ = model.mtp_logits(h[:, :-1], t[:, 1:])
        hit += int((logits[0, :-1].argmax(-1) == t[0, 2:]).sum())
        n += len(w) - 2
    return hit / max(1, n)


def mtp_prompts(ids: list[int], n: int = MTP_PROMPTS, length: int = MTP_PROMPT_TOKENS) -> list[list[int]]:
    """n prompts of ``length`` held-out tokens, evenly spaced over the slice."""
    n = max(1, min(n, len(ids) // (2 * length)))
    step = len(ids) // n
    return [ids[i * step : i * step + length] for i in range(n)]


def draft_run(lm, prompts: list[list[int]], n_new: int, draft_max: int, policy: bool = True) -> dict:
    """Greedy decoding of every prompt by strata's engine, with MTP drafts of at most ``draft_max`` (0: none).
    policy: the engine's own choice of how many drafts pay (strata.engine.draft_cost), as `strata generate` runs;
    False: every draft the drafter offers is verified (its acceptance alone). -> tokens, trunk forwards (steps),
    drafts proposed / accepted, decode seconds (after each prompt's first token), and the token ids."""
    import time

    from strata.engine.engine import Engine
    from strata.engine.sampler import SamplingParams

    lm.cfg.draft_max, lm.cfg.draft_source = draft_max, "mtp"
    try:
        eng = Engine(lm, n_slots=1)
    finally:
        lm.cfg.draft_max, lm.cfg.draft_source = 0, "auto"
    if not policy:
        eng.draft_cost = None
    steps = [0]
    real_step = eng.step

    def step():
        steps[0] += 1
        return real_step()

    eng.step = step
    out = {"draft_max": draft_max, "policy": policy, "prompts": len(prompts), "tokens": 0, "steps": 0,
           "proposed": 0, "accepted": 0, "decode_tokens": 0, "decode_seconds": 0.0, "ids": []}
    for p in prompts:
        steps[0] = 0
        got, t_first = [], None
        for tok in eng.generate(p, SamplingParams(temperature=0.0), n_new):
            got.append(int(tok))
            if t_first is None:
                t_first = time.perf_counter()
        out["decode_seconds"] += time.perf_counter() - t_first
        out["decode_tokens"] += len(got) - 1
        s = eng.last
        out["tokens"] += len(got)
        out["steps"] += steps[0]
        out["proposed"] += s.draft_n
        out["accepted"] += s.draft_accepted
        out["ids"].append(got)
    out["acceptance"] = out["accepted"] / out["proposed"] if out["proposed"] else None
    out["tokens_per_forward"] = out["tokens"] / max(1, out["steps"])
    out["tok_per_s"] = out["decode_tokens"] / out["decode_seconds"] if out["decode_seconds"] else None
    out["decode_seconds"] = round(out["decode_seconds"], 3)
    return out


def mtp_eval(lm, ids: list[int], ctx: int, n_prompts: int = MTP_PROMPTS, prompt_tokens: int = MTP_PROMPT_TOKENS,
             n_new: int = MTP_NEW_TOKENS, speed: bool = True, budget_s: float | None = None, log=print) -> dict:
    """The MTP block's numbers on held-out ids: teacher-forced top-1, then drafting by the engine (greedy; the
    drafted text is checked to be the plain greedy text), timed: the drafter's own lengths at each --draft-max
    (every draft verified), and with speed, the engine's draft policy at the largest (as `strata generate
    --draft-source mtp --draft-max 3` runs). budget_s: no further decoding run starts after this many seconds
    (a slow CPU must not push a training run past its time limit; the runs left out are listed)."""
    import platform
    import time

    from strata.quant.matmul import exact_cpu

    t0 = time.perf_counter()
    with exact_cpu():  # (as the other recorded numbers; the timed runs below take the default CPU path)
        top1, n = strata_mtp_top1(lm, ids, ctx)
    prompts = mtp_prompts(ids, n_prompts, prompt_tokens)
    plain = draft_run(lm, prompts, n_new, 0)
    res = {"teacher_forced": {"strata_top1": top1, "positions": n},
           "drafting": {"prompts": len(prompts), "prompt_tokens": prompt_tokens, "new_tokens": n_new,
                        "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
                        "plain": {k: v for k, v in plain.items() if k != "ids"}, "drafter": [], "engine": []}}
    log(f"eval: MTP teacher-forced top-1 (t[i+2]) {top1:.3f} over {n} positions; plain decode "
        f"{plain['tok_per_s'] or 0:.1f} tok/s")
    runs = [("drafter", k, False) for k in DRAFT_MAX] + ([("engine", DRAFT_MAX[-1], True)] if speed else [])
    for i, (kind, k, policy) in enumerate(runs):
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            res["drafting"]["skipped"] = [f"{kd} --draft-max {kk}" for kd, kk, _ in runs[i:]]
            log(f"eval: MTP drafting stopped by its {budget_s:.0f} s budget: {res['drafting']['skipped']} not run")
            break
        r = draft_run(lm, prompts, n_new, k, policy)
        if r["ids"] != plain["ids"]:
            raise AssertionError(f"--draft-source mtp --draft-max {k}: the greedy text differs from plain decoding")
        res["drafting"][kind].append({x: v for x, v in r.items() if x != "ids"})
        log(f"eval: MTP drafts ({kind}) --draft-max {k}: {r['accepted']}/{r['proposed']} accepted, "
            f"{r['tokens_per_forward']:.2f} tokens per forward, {r['tok_per_s'] or 0:.1f} tok/s")
    return res


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


def fill_strata_numbers(record: dict, gguf: str | Path, text: str, n_predict: int = N_PREDICT, log=print,
                        speed: bool = True, mtp_budget_s: float | None = None) -> None:
    """Measure ``gguf`` with strata on the held-out ``text`` and write the numbers into ``record`` (in place):
    perplexity, routing, completions, the held-out slice's token counts (``heldout.ids`` too, for checks), and
    for a model with an MTP block its numbers (``mtp_eval``; a toy run's are smaller)."""
    from strata.quant.matmul import exact_cpu

    ctx = record["heldout"]["ctx"]
    lm = load_cpu(gguf, ctx)
    # the recorded numbers are the float32 reference's (what CI recomputes, under its exact_cpu marker): the native
    # kernel's int8 activations would move near-tie greedy tokens from one CPU to another
    with exact_cpu():
        ev = strata_eval(gguf, text, ctx, n_predict=n_predict, lm=lm)
    record["heldout"].update({"ids": ev["ids"], "tokens": len(ev["ids"]), "scored_tokens": ev["scored_tokens"],
                              "windows": ev["windows"]})
    record["perplexity"].update({"strata": ev["perplexity"], "strata_device": "cpu", "strata_dtype": "f32"})
    record["routing"] = ev["routing"]
    record["completions"] = ev["completions"]
    log(f"eval: strata perplexity {ev['perplexity']:.3f} over {ev['scored_tokens']} tokens "
        f"({ev['windows']} windows of {ctx})")
    for c in ev["completions"]:
        log(f"eval: greedy [{c['name']}] {c['prompt']!r} -> {c['text']!r}")
    if getattr(lm.model, "nextn", None):
        toy = record["training"].get("toy")
        kw = dict(n_prompts=2, prompt_tokens=24, n_new=n_predict) if toy else {}
        try:
            record["mtp"] = mtp_eval(lm, ev["ids"], ctx, speed=speed, budget_s=mtp_budget_s, log=log, **kw)
        except Exception as e:  # (the other numbers stand; tools/tiny/evaluate.py can measure these later)
            record["mtp"] = {"error": f"{e.__class__.__name__}: {e}"[:500]}
            log(f"eval: the MTP evaluation FAILED: {record['mtp']['error']}")
    r = ev["routing"]
    log("eval: LRU hit rate by capacity " + ", ".join(f"{k}: {v['hit_rate']:.3f}" for k, v in r["lru"].items())
        + f"; median reuse distance {r['reuse_distance']['median']}")
