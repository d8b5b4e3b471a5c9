"""Replay a recorded routing through expert cache policies: hit rate and swaps a decode token for each setting.

    python tools/bench_decode.py -m MODEL.gguf --vram-gb 24 ... --dump-routing routing.npz     # on the GPU machine
    python tools/sim_expert_cache.py routing.npz --policy lfu-decay --decay 0.95,0.98,0.99,0.995 --margin 0.2

The dump holds every `observe` the policy got (prefill chunks and decode steps, in order). Each setting gets a
fresh policy of the recorded slot counts that sees the same observations: a decode observation (k ids) counts its
hits against the experts ready before it, then the policy learns and commits its swaps (within the swap budget),
which are ready from the next step on (a copy takes about a step). The static line is the best fixed cache
knowing the future: each layer's most routed experts over the decode steps counted. What this leaves out: the
staged path learns a step later than here, and a swap's copy and a miss share the link.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import numpy as np

sys.path.insert(0, ".")
from strata.experts.pipeline import admit  # noqa: E402
from strata.experts.policy import make_policy  # noqa: E402


def load(path: str) -> dict:
    d = np.load(path)
    return {k: d[k] for k in d.files}


def replay(d: dict, policy: str, skip_steps: int = 0, decode_only: bool = False, **kw) -> dict:
    L, E, k = len(d["slots"]), int(d["n_experts"]), int(d["k"])
    pol = make_policy(policy, L, E, [int(s) for s in d["slots"]], **kw)
    off, ids_all = d["offsets"], d["ids"]
    pending: list[tuple[int, int]] = []
    cur = None
    hits = misses = swaps = tokens = 0
    first = int(d["step"][0]) if len(d["step"]) else 0
    for i, (layer, step) in enumerate(zip(d["layer"].tolist(), d["step"].tolist())):
        if step != cur:
            cur = step
            for li, e in pending:  # the previous step's copies have landed
                pol.mark_ready(li, e)
            pending = []
            pol.tick()
        ids = ids_all[off[i]:off[i + 1]].tolist()
        if decode_only and len(ids) != k:
            continue
        decode = len(ids) == k and step - first >= skip_steps
        if decode:
            h = sum(1 for e in ids if pol.is_hit(layer, e))
            hits += h
            misses += len(ids) - h
            if layer == 0:
                tokens += 1
        sw = admit(pol, layer, ids)
        pending += [(layer, s.admit) for s in sw]
        if decode:
            swaps += len(sw)
    n = hits + misses
    return {"hit": hits / n if n else 0.0, "misses_per_token": misses / max(1, tokens),
            "swaps_per_token": swaps / max(1, tokens), "tokens": tokens}


def stand_in(spec: str, seed: int = 1) -> dict:
    """A routing made up where none was recorded, in a dump's layout: spec "E,k,layers,slots,zipf[,requests]":
    experts of Zipf(zipf) popularity, a third of them reshuffled per request, each request a 1,024-token prefill
    (one observation of every token's k choices a layer) and then 128 decode steps."""
    E, k, L, S, zipf, *rest = (float(v) for v in spec.split(","))
    E, k, L, S, R = int(E), int(k), int(L), int(S), int(rest[0]) if rest else 6
    rng = np.random.default_rng(seed)
    base = 1.0 / np.arange(1, E + 1) ** zipf
    layer, step, ids = [], [], []
    t = 0
    for _ in range(R):
        p = base.copy()
        idx = rng.choice(E, size=E // 3, replace=False)
        p[idx] = p[rng.permutation(idx)]
        p /= p.sum()
        for n in [1024] + [1] * 128:
            t += 1
            for li in range(L):
                layer.append(li)
                step.append(t)
                ids.append(np.concatenate([rng.choice(E, size=k, replace=False, p=p) for _ in range(n)]))
    lens = np.array([len(x) for x in ids])
    return {"layer": np.array(layer), "step": np.array(step), "offsets": np.concatenate([[0], np.cumsum(lens)]),
            "ids": np.concatenate(ids).astype(np.int32), "slots": np.full(L, S, dtype=np.int32), "n_experts": E,
            "k": k}


def static_best(d: dict, skip_steps: int = 0) -> float:
    L, E, k = len(d["slots"]), int(d["n_experts"]), int(d["k"])
    counts = np.zeros((L, E))
    off, ids_all = d["offsets"], d["ids"]
    first = int(d["step"][0]) if len(d["step"]) else 0
    for i, (layer, step) in enumerate(zip(d["layer"].tolist(), d["step"].tolist())):
        if off[i + 1] - off[i] == k and step - first >= skip_steps:
            np.add.at(counts[layer], ids_all[off[i]:off[i + 1]], 1)
    srt = -np.sort(-counts, axis=1)
    top = sum(srt[i, :int(s)].sum() for i, s in enumerate(d["slots"]))
    return float(top / counts.sum()) if counts.sum() else 0.0


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump", nargs="?", help="a bench_decode.py --dump-routing file")
    ap.add_argument("--stand-in", metavar="E,k,LAYERS,SLOTS,ZIPF[,REQUESTS]",
                    help="replay a made-up routing instead of a dump (see stand_in)")
    ap.add_argument("--policy", default="lfu-decay", help="lfu-decay or lru")
    ap.add_argument("--decay", default="0.95", help="comma-separated decays (lfu-decay)")
    ap.add_argument("--margin", default="0.2", help="comma-separated margins (lfu-decay)")
    ap.add_argument("--abs-margin", default="0.5", help="comma-separated absolute margins (lfu-decay)")
    ap.add_argument("--swap-budget", default="4", help="comma-separated swaps a layer a step")
    ap.add_argument("--skip-steps", type=int, default=0, help="policy steps left out of the counts at the start")
    ap.add_argument("--decode-only", action="store_true",
                    help="leave the prefill chunks out (the policy learns from decode steps only: a long generation's "
                         "steady state)")
    a = ap.parse_args()
    if (a.dump is None) == (a.stand_in is None):
        ap.error("give a dump file or --stand-in")
    d = load(a.dump) if a.dump else stand_in(a.stand_in)
    print(f"{a.dump or 'stand-in ' + a.stand_in}: {len(d['layer'])} observations, {len(d['slots'])} layers x {int(d['n_experts'])} experts, "
          f"top-{int(d['k'])}, slots {int(d['slots'].min())}-{int(d['slots'].max())}; static best hit "
          f"{static_best(d, a.skip_steps):.4f}")
    print("| policy | decay | margin | abs margin | swap budget | hit | misses/token | swaps/token |")
    print("|---|---|---|---|---|---|---|---|")
    for dec, m, am, b in itertools.product(_floats(a.decay), _floats(a.margin), _floats(a.abs_margin),
                                           [int(x) for x in a.swap_budget.split(",")]):
        kw = {"swap_budget": b}
        if a.policy == "lfu-decay":
            kw.update(decay=dec, margin=m, abs_margin=am)
        r = replay(d, a.policy, a.skip_steps, a.decode_only, **kw)
        print(f"| {a.policy} | {dec:g} | {m:g} | {am:g} | {b} | {r['hit']:.4f} | {r['misses_per_token']:.1f} | "
              f"{r['swaps_per_token']:.1f} |", flush=True)
        if a.policy != "lfu-decay":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
