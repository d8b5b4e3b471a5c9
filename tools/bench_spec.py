"""Speculative decoding with n-gram drafts against plain decoding, on real code (the embedded model by default).

    python tools/bench_spec.py [engine flags: -m MODEL --device cuda --vram-gb 8 ...] [--drafts 0,4,8,16]
                               [--gen 200] [--runs 3] [--temperature 0.8 --seed 0] [--right-drafts] [--paired]
                               [--trace DIR]

Two prompts from Python's standard library (text nobody here wrote): `edit` — a module's source, then the same
source again up to its middle (an agent re-emitting a file it edits: the continuation repeats the context), and
`fresh` — the start of a source file to continue (little to copy). Greedy by default (`--temperature T` samples
with llama.cpp's default top-k/top-p/min-p and a fixed `--seed`: a drafted run must write the same text as the plain
one, since the target's own sample decides every token), one sequence; prints per prompt and draft setting: decode tok/s (median of --runs, after a warm-up), drafts accepted / proposed, tokens per forward,
and whether the text equals plain decoding's (it must); with `--paired`, each timed drafted run right after a
plain one and the ratio per pair (its median: on a machine whose speed drifts between runs, the ratio to trust).
`--right-drafts` (MTP drafts, greedy): every draft the
block makes is replaced by the plain text's next token, so every draft stands: what a drafted step costs at full
acceptance, the bound on what the drafter's quality can buy. List 0 first in --drafts (the plain text).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time

sys.path.insert(0, ".")
import strata  # noqa: F401,E402  (before torch: it sets the OpenMP runtime's environment)
import textwrap  # noqa: E402

from strata.engine.cli import add_engine_args, engine_config  # noqa: E402
from strata.engine.engine import Engine  # noqa: E402
from strata.engine.loader import load_model  # noqa: E402
from strata.engine.sampler import SamplingParams  # noqa: E402


# `--prompts suite`: more starts to continue, so that one text's quirks (greedy text that falls into a short cycle,
# where the draft length decides at which phase of it each chain starts) do not decide the result. They come from
# standard-library modules the embedded model's training held out (docs/strata-tiny/manifest.json, split "heldout");
# json and textwrap, `edit`'s and `fresh`'s, are in its training text.
SUITE = ("html.escape", "sched.scheduler.enterabs", "shelve.Shelf", "socket.create_connection",
         "logging.config.fileConfig", "email.parser.Parser", "asyncio.locks.Lock", "asyncio.transports.BaseTransport")


def _source_start(name: str) -> str:
    """The first 400 characters of a module's function, class or method (`module.attr[.attr]`)."""
    import importlib

    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest prefix that imports
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return textwrap.dedent(inspect.getsource(obj))[:400]
    raise ValueError(f"no module in {name!r}")


def prompts(tok, names: str = "edit,fresh") -> dict[str, list[int]]:
    out = {}
    for name in names.split(","):
        if name == "suite":
            out.update(prompts(tok, ",".join(("edit", "fresh") + SUITE)))
        elif name == "edit":
            src = inspect.getsource(json.dumps)
            out[name] = tok.encode(src + "\n\n# the same function, reformatted:\n" + src[: len(src) // 2])
        elif name == "fresh":
            out[name] = tok.encode(textwrap.dedent(inspect.getsource(textwrap.indent))[:400])
        else:  # module.function: its source's start, to continue
            out[name] = tok.encode(_source_start(name))
    return out


def _right(draft, plain: list[int]):
    """The MTP drafter with its drafts replaced by the plain text's next tokens (the block still runs)."""

    def right(s, room):
        got = draft(s, room)
        at = len(s.output)
        return plain[at:at + len(got)] if got else []

    return right


def _trace(eng, ids, sampling, gen: int, path: str, forwards: int) -> None:
    """One more run under torch.profiler: what a forward (a plain or a drafted step) costs on the GPU. Graph
    replays show their kernels one by one (CUPTI), so the count is the step's launches, graphed or not."""
    import os
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        list(eng.generate(ids, sampling, gen))
        wall = time.perf_counter() - t0 - eng.last.prompt_ms / 1e3
    prof.export_chrome_trace(path + ".json")
    with open(path + ".json") as f:  # the trace's kernel records (graph replays' kernels each their own)
        kernels = [e for e in json.load(f).get("traceEvents", []) if e.get("cat") == "kernel"]
    # (the prompt's one forward is in the figures too, among the ~gen others)
    busy, n = Counter(), Counter()
    for e in kernels:
        busy[e["name"]] += float(e.get("dur", 0.0))
        n[e["name"]] += 1
    total_us = sum(busy.values())
    print(json.dumps({"trace": path + ".json", "forwards": forwards, "kernels": len(kernels),
                      "kernels_per_forward": round(len(kernels) / forwards, 1),
                      "gpu_busy_us_per_forward": round(total_us / forwards, 1),
                      "wall_us_per_forward": round(wall * 1e6 / forwards, 1),
                      "top": [[k[:60], n[k], round(v / forwards, 1)] for k, v in busy.most_common(12)]}),
          flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(ap)
    ap.add_argument("--drafts", default="0,4,8,16")
    ap.add_argument("--prompts", default="edit,fresh", help="comma-separated: edit, fresh, module.function (the "
                    "start of its source, continued), or suite (edit, fresh and %d such starts from modules the embedded "
                    "model's training held out); with "
                    "--paired and more than one prompt, a last line gives each draft setting's geometric mean of "
                    "the prompts' paired ratios" % len(SUITE))
    ap.add_argument("--gen", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    ap.add_argument("--seed", type=int, default=0, help="the sampler's seed when --temperature > 0")
    ap.add_argument("--right-drafts", action="store_true", help="MTP drafts replaced by the plain text's tokens")
    ap.add_argument("--paired", action="store_true", help="each timed drafted run right after a plain one (its own "
                    "engine): the ratio per pair, for a machine whose speed drifts between one setting's runs")
    ap.add_argument("--trace", metavar="DIR", default=None, help="CUDA: after the timed runs, one more run of each "
                    "setting under torch.profiler: a Chrome trace in DIR and, per setting, the GPU kernels a forward "
                    "launches, their busy time and the wall time a forward, and the kernels that take the most")
    a = ap.parse_args()
    if a.model is None:
        from strata.models.default import default_model_path

        a.model = str(default_model_path())
    base = engine_config(a)
    lm = load_model(a.model, base)
    ref: dict[str, list[int]] = {}
    sampling = SamplingParams(temperature=a.temperature, seed=a.seed if a.temperature > 0 else None)
    def timed(eng, ids) -> tuple[list[int], float]:
        t0 = time.perf_counter()
        out = list(eng.generate(ids, sampling, a.gen))
        return out, (len(out) - 1) / (time.perf_counter() - t0 - eng.last.prompt_ms / 1e3)  # decode only

    ratios: dict[int, list[float]] = {}
    for name, ids in prompts(lm.tokenizer, a.prompts).items():
        plain = None
        if a.paired:
            lm.cfg.draft_max = 0
            plain = Engine(lm, n_slots=1)
            timed(plain, ids)  # (its warm-up)
        for dm in (int(x) for x in a.drafts.split(",")):
            lm.cfg.draft_max = dm
            eng = Engine(lm, n_slots=1)
            if a.right_drafts and dm and eng.mtp is not None and name in ref:
                eng.draft_cost = None  # every draft verified: the cost at full acceptance, not the policy's choice
                eng.mtp.draft = _right(eng.mtp.draft, ref[name])
            speeds, pairs, seq = [], [], None
            for r in range(a.runs + 1):
                base = timed(plain, ids)[1] if plain is not None and r and dm else None
                out, speed = timed(eng, ids)
                seq = eng.last
                if r:
                    speeds.append(speed)
                if base:
                    pairs.append(speed / base)
            ref.setdefault(name, out)
            if pairs:
                ratios.setdefault(dm, []).append(statistics.median(pairs))
            steps = (len(out) - 1 - seq.draft_accepted) or 1  # forwards after the first token
            if a.trace and eng.device.type == "cuda":
                _trace(eng, ids, sampling, a.gen, f"{a.trace}/{name}-draft{dm}", steps)
            print(json.dumps({"prompt": name, "prompt_tokens": len(ids), "temperature": a.temperature, "draft_max": dm,
                              "decode_tok_s": round(statistics.median(speeds), 1),
                              "accepted": seq.draft_accepted, "drafted": seq.draft_n,
                              "tokens_per_forward": round((len(out) - 1) / steps, 2),
                              "same_text": out == ref[name],
                              **({"paired_x_plain": round(statistics.median(pairs), 3),
                                  "pairs": [round(x, 2) for x in pairs]} if pairs else {}),
                              # what chose the draft lengths (strata.engine.draft_cost): the fitted step cost (ms of
                              # a one-token step, ms per further token) and the sequence's acceptance estimate
                              "cost_fit": [round(v, 4) for v in fit] if (fit := eng.draft_cost and
                                                                          eng.draft_cost.line()) else None,
                              "acceptance_p": round(seq.draft_acc.p, 3),
                              # graph captures over the warm-up and the timed runs (each timed run should add none)
                              "captures": eng.graphs.captures if eng.graphs is not None else None,
                              "verify_graphed": eng.graphs.verify if eng.graphs is not None else None}), flush=True)
    if any(len(v) > 1 for v in ratios.values()):
        print(json.dumps({"prompts": len(ratios[next(iter(ratios))]), "paired_x_plain_geomean": {
            dm: round(statistics.geometric_mean(v), 3) for dm, v in ratios.items()},
            "paired_x_plain_min": {dm: round(min(v), 3) for dm, v in ratios.items()}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
