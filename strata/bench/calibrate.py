"""`strata calibrate -m MODEL`: measure this machine, then tune the tiered-expert knobs by short decode runs.

1. Costs: one expert's CPU time by thread count (the CPU lane's kernel, weights from RAM) and its PCIe copy
   time (`strata.experts.costs`).
2. Search, one knob at a time in a fixed order (CPU threads, plan, PCIe share, cache policy, promote-min, swap
   budget): each candidate runs against the current setting in interleaved A B B A blocks of short greedy
   decodes (a warm-up decode before every timed one, so a cold cache is never timed), and replaces it only if
   it is more than 3% faster in every block. Noise cannot ratchet the setting: a candidate must win clearly,
   against the current one, measured in the same minutes; a linear drift of the machine cancels in a block.
3. The kept setting is measured once more against where the search started (the gain printed is that
   measurement) and saved per machine + model + budget in the user's cache directory, with the cost model
   for its thread count where `--cpu-plan auto` reads it.

`strata serve` (and every engine command) picks the saved setting up through `load_calibration()` /
`apply_calibration()`: a flag the user set explicitly always wins.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from strata import StrataError
from strata.experts.calibration import (  # noqa: F401 - the saved calibration's format lives below the engine
    FORMAT, VERSION, Setting, apply_calibration, budget_key, calibration_dir, calibration_path, load_calibration,
    model_key, save_calibration)

log = logging.getLogger("strata")

THRESHOLD = 0.03  # a candidate must be > 3% faster than the current setting
KNOBS = ("threads", "plan", "pcie_share", "cache_policy", "promote_min", "swap_budget")
# the Setting field each knob's candidates vary (plan and pcie_share are both CPU plans)
KNOB_FIELD = {"threads": "threads", "plan": "cpu_plan", "pcie_share": "cpu_plan", "cache_policy": "cache_policy",
              "promote_min": "promote_min", "swap_budget": "swap_budget"}


@dataclass
class Trial:
    knob: str
    current: Setting
    candidate: Setting
    current_ms: list[float]  # per A B B A block: the two ms-per-token times of the current setting, summed
    candidate_ms: list[float]  # ... and of the candidate
    gain: float  # median over blocks of current / candidate, minus 1 (> 0: the candidate is faster)
    kept: bool  # faster by more than the threshold in every block

    def as_dict(self) -> dict:
        return {"knob": self.knob, "current": dataclasses.asdict(self.current),
                "candidate": dataclasses.asdict(self.candidate), "current_ms": self.current_ms,
                "candidate_ms": self.candidate_ms, "gain": self.gain, "kept": self.kept}


Measure = Callable[[Setting], float]  # ms per decoded token with this setting applied


def ab(measure: Measure, a: Setting, b: Setting, repeats: int) -> tuple[list[float], list[float]]:
    """`repeats` interleaved blocks A B B A: a drift in the machine's speed (heat, other load, a cache still
    filling) that is linear over a block costs both settings the same. Returns per block the sum of A's two
    times and of B's two times (ms per token)."""
    ta, tb = [], []
    for _ in range(repeats):
        a1 = measure(a)
        b1 = measure(b)
        b2 = measure(b)
        a2 = measure(a)
        ta.append(a1 + a2)
        tb.append(b1 + b2)
    return ta, tb


def _ms(block_sums: Sequence[float]) -> str:
    """ms per token over all of a setting's runs (each block holds two)."""
    return f"{sum(block_sums) / (2 * len(block_sums)):8.2f}"


def _gains(current_ms: Sequence[float], candidate_ms: Sequence[float]) -> str:
    return "gain per block " + ", ".join(f"{g:+.1%}" for g in block_gains(current_ms, candidate_ms))


def block_gains(current_ms: Sequence[float], candidate_ms: Sequence[float]) -> list[float]:
    """Per block, current / candidate time minus 1: +0.05 = the candidate is 5% faster."""
    return [c / d - 1.0 for c, d in zip(current_ms, candidate_ms)]


def paired_gain(current_ms: Sequence[float], candidate_ms: Sequence[float]) -> float:
    """The median block gain (what is reported)."""
    return statistics.median(block_gains(current_ms, candidate_ms))


def row_label(knob: str, diff: dict) -> str:
    """A search row's label: the knob being searched when the candidate changes it, else the fields it does change.
    A promote-min candidate carries lfu-decay with it: under lru, promote-min 0 changes only the policy, and a row
    "promote_min  cache_policy lru -> lfu-decay" named a knob that row does not show."""
    return knob if KNOB_FIELD.get(knob, knob) in diff else ", ".join(diff)


def try_candidate(measure: Measure, knob: str, current: Setting, candidate: Setting, repeats: int,
                  threshold: float = THRESHOLD) -> Trial:
    """Kept only if the candidate beats the current setting by more than `threshold` in every block."""
    cur, cand = ab(measure, current, candidate, repeats)
    gains = block_gains(cur, cand)
    return Trial(knob, current, candidate, cur, cand, statistics.median(gains), min(gains) > threshold)


def search(measure: Measure, start: Setting, space: Iterable[tuple[str, list[Setting | dict]]], repeats: int = 2,
           threshold: float = THRESHOLD, say: Callable[[str], None] = print) -> tuple[Setting, list[Trial]]:
    """Coordinate search: for each (knob, candidates), each candidate (a Setting, or a dict of fields to change
    in the current one) against the current setting; kept only if it wins by more than `threshold`."""
    current, trials = start, []
    for knob, cands in space:
        for c in cands:
            cand = dataclasses.replace(current, **c) if isinstance(c, dict) else c
            if cand == current:
                continue
            t = try_candidate(measure, knob, current, cand, repeats, threshold)
            trials.append(t)
            diff = current.diff(cand)
            change = ", ".join(f"{k} {v[0]} -> {v[1]}" for k, v in diff.items())
            say(f"  {row_label(knob, diff):<12} {change:<44} {_ms(t.current_ms)} -> {_ms(t.candidate_ms)} ms/token, "
                f"{_gains(t.current_ms, t.candidate_ms)} {'KEPT' if t.kept else ''}".rstrip())
            if t.kept:
                current = cand
    return current, trials


# ---------------------------------------------------------------------------------------------------------------
# the candidate space


def share_plan(k: int, pcie_share: float) -> str:
    """A plan sending `pcie_share` of each token-layer's misses over PCIe (rounded half up), the rest to the CPU."""
    from strata.experts.plan import CpuPlan

    shares = [m - int(pcie_share * m + 0.5) for m in range(k + 1)]
    return str(CpuPlan(shares))


def thread_candidates(cpu_ms: dict[int, float], keep: int = 3) -> list[int]:
    """The thread counts with the fastest per-expert CPU time (measured), fastest first."""
    return [t for t, _ in sorted(cpu_ms.items(), key=lambda kv: (kv[1], -kv[0]))[:keep]]


def thread_counts(physical: int) -> list[int]:
    """1, 2, 4, ... up to the physical cores, and the physical count itself."""
    out, t = [], 1
    while t < physical:
        out.append(t)
        t *= 2
    return out + [physical]


def candidate_space(k: int, cpu_ms: dict[int, float], knobs: Sequence[str] = KNOBS,
                    has_lane: bool = True) -> list[tuple[str, list[dict]]]:
    space: list[tuple[str, list[dict]]] = []
    if "threads" in knobs and has_lane:
        space.append(("threads", [{"threads": t} for t in thread_candidates(cpu_ms)]))
    if "plan" in knobs and has_lane:
        space.append(("plan", [{"cpu_plan": p} for p in ("auto", share_plan(k, 0.0), share_plan(k, 1.0))]))
    if "pcie_share" in knobs and has_lane:
        space.append(("pcie_share", [{"cpu_plan": share_plan(k, s)} for s in (0.25, 0.5, 0.75)]))
    if "cache_policy" in knobs:
        space.append(("cache_policy", [{"cache_policy": p} for p in ("lfu-decay", "lru")]))
    if "promote_min" in knobs:
        space.append(("promote_min", [{"promote_min": v, "cache_policy": "lfu-decay"} for v in (0.0, 0.5, 1.0, 2.0)]))
    if "swap_budget" in knobs:
        space.append(("swap_budget", [{"swap_budget": v} for v in (1, 2, 4, 8, 16)]))
    return space


# where results live, and how the engine reads them: strata.experts.calibration


# ---------------------------------------------------------------------------------------------------------------
# driving the engine


def setting_of(ex) -> Setting:
    """The Setting an ExpertConfig describes (0 threads = the physical cores, written out)."""
    return Setting(ex.cpu_threads or physical_cores(), ex.cpu_plan, ex.cache_policy, float(ex.promote_min),
                   int(ex.swap_budget))


def physical_cores() -> int:
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


class EngineBench:
    """Short greedy decodes on a loaded model whose tiered-experts knobs can be switched in place."""

    def __init__(self, lm, prompt: list[int], decode_tokens: int):
        from strata.engine.engine import Engine

        self.lm = lm
        self.engine = Engine(lm, n_slots=1)
        self.backend = lm.model.experts
        if not hasattr(self.backend, "policy") or not hasattr(self.backend, "lane"):
            raise StrataError("calibrate tunes tiered experts: pass --vram-gb (the VRAM budget) or --expert-slots")
        self.prompt, self.n = prompt, decode_tokens
        self.runs = 0
        self.decode()  # sets the backend up (cache, policy, plan) before anything is switched
        self.applied: Setting = setting_of(self.backend.ex)

    @property
    def k(self) -> int:
        return self.backend.k

    def decode(self) -> float:
        """ms per token of one greedy decode of `n` tokens after the prompt (the prefill is not timed)."""
        from strata.engine.engine import Sequence
        from strata.engine.sampler import SamplingParams

        seq = Sequence(list(self.prompt), SamplingParams(temperature=0.0), self.n, set())
        self.engine.add(seq, reuse_prefix=False)
        try:
            while not seq.finished:
                self.engine.step()
        finally:
            self.engine.release(seq, "abort")
        self.runs += 1
        steps = len(seq.output) - 1
        if steps < 1:
            raise StrataError("calibrate: a decode produced fewer than 2 tokens")
        return seq.predicted_ms / steps

    def apply(self, s: Setting) -> None:
        if s == self.applied:
            return
        import torch

        b = self.backend
        with torch.inference_mode():  # the device map was made in inference mode: update it in kind
            if hasattr(b, "reconfigure"):  # the backend's own switch, where it has one
                b.reconfigure(threads=s.threads, cpu_plan=s.cpu_plan, cache_policy=s.cache_policy,
                              promote_min=s.promote_min, swap_budget=s.swap_budget)
            else:
                _reconfigure(b, s, self.applied)
        self.applied = s

    def measure(self, s: Setting) -> float:
        self.apply(s)
        self.decode()  # warm-up: caches and threads settle after a switch
        return self.decode()


def _reconfigure(b, s: Setting, old: Setting) -> None:
    """Switch a TieredExperts backend's knobs in place (threads, plan, policy); a new policy starts empty."""
    import torch

    from strata.experts.plan import CpuPlan
    from strata.experts.policy import make_policy

    ex = b.ex
    if b.lane is not None:
        torch.set_num_threads(s.threads or physical_cores())
        b.lane.threads = torch.get_num_threads()
    ex.cpu_threads = s.threads
    ex.cpu_plan = s.cpu_plan
    if s.cpu_plan.strip() == "auto":
        from strata.experts.costs import cost_model_for

        b.costs = cost_model_for(b)  # the costs of the current thread count (cached per machine)
        b.plan = b.costs.cpu_plan(b.k)
    else:
        b.plan = CpuPlan.parse(s.cpu_plan, b.k)
    if b.lane is None and any(b.plan.shares):
        raise StrataError("the CPU lane is off (the model was loaded with an all-PCIe plan)")
    policy_old = (old.cache_policy, old.promote_min, old.swap_budget)
    policy_new = (s.cache_policy, s.promote_min, s.swap_budget)
    if policy_old != policy_new:
        if b.cuda:
            torch.cuda.synchronize(b.device)  # no copy may still be landing in a slot the new policy reassigns
        ex.cache_policy, ex.promote_min, ex.swap_budget = s.cache_policy, s.promote_min, s.swap_budget
        L, E = len(b.layer_ids), b.n_experts
        kw = {"swap_budget": s.swap_budget}
        if s.cache_policy == "lfu-decay":
            kw["promote_min"] = s.promote_min
            kw["decay"] = ex.decay_value(E, b.k)
        b.policy = make_policy(s.cache_policy, L, E, b.cache.slots, **kw)
        b.pending = [{} for _ in b.layer_ids]
        for li in range(L):
            b.cache.upload_map(li, b.policy.expert_map()[li])


def measure_costs(backend, threads_list: list[int], say=print) -> dict:
    """Per-expert CPU ms by thread count, and PCIe copy ms, on this machine."""
    import torch

    from strata.experts.costs import measure_cpu_expert_ms, measure_pcie_expert_ms

    layer = backend.layer_ids[0]
    ew = backend.store[layer]
    cpu: dict[int, float] = {}
    before = torch.get_num_threads()
    if backend.lane is not None:
        for t in threads_list:
            cpu[t] = measure_cpu_expert_ms(ew, t, dtype=backend.dtype, lane=backend.lane, layer=layer)
            nbytes = ew.expert_nbytes()
            say(f"  CPU   {t:3d} threads: {cpu[t]:8.4f} ms/expert ({nbytes / (cpu[t] * 1e-3) / 1e9:6.1f} GB/s of "
                "stored weights)")
    torch.set_num_threads(before)
    if backend.lane is not None:
        backend.lane.threads = before
    pcie = measure_pcie_expert_ms(ew, backend.device)
    say(f"  PCIe  one expert ({ew.expert_nbytes() / 2**20:.2f} MiB): {pcie:8.4f} ms "
        f"({ew.expert_nbytes() / (pcie * 1e-3) / 1e9:6.1f} GB/s){'' if backend.cuda else ' (no GPU: a host copy)'}")
    return {"cpu_ms_per_expert": cpu, "pcie_ms_per_expert": pcie, "expert_bytes": ew.expert_nbytes(),
            "kernel": backend.lane.kernel[layer] if backend.lane is not None else None}


def save_cost_model(backend) -> Path | None:
    """Measure the cost model at the backend's current thread count and store it where `--cpu-plan auto` looks
    (the path scheme of strata.experts.costs.cost_model_for)."""
    import dataclasses as dc

    from strata.experts.costs import cache_dir, machine_id, measure_cost_model, model_id

    if backend.lane is None:
        return None
    layer = backend.layer_ids[0]
    ew = backend.store[layer]
    machine = machine_id(backend.device)
    model = model_id(ew, backend.dtype, backend.lane.threads, backend.lane.kernel[layer])
    path = cache_dir() / "costs" / (hashlib.sha256(f"{machine}\n{model}".encode()).hexdigest()[:24] + ".json")
    cm = measure_cost_model(ew, backend.device, backend.dtype, backend.lane.threads, lane=backend.lane, layer=layer)
    dc.replace(cm, machine=machine, model=model).save(path)
    return path


def calibrate(lm, model_path: str, *, knobs: Sequence[str] = KNOBS, repeats: int = 2, decode_tokens: int = 32,
              prompt_tokens: int = 64, threshold: float = THRESHOLD, save: bool = True, say=print) -> dict:
    """The whole procedure on a loaded model (see the module docstring); returns what is saved."""
    from strata.bench.prompts import filler_words, join_words

    if prompt_tokens + decode_tokens > lm.max_ctx:  # (checked before the filler text is built for it)
        raise StrataError(f"--prompt-tokens {prompt_tokens} + --decode-tokens {decode_tokens} exceeds the context "
                          f"of {lm.max_ctx} tokens")
    tok = lm.tokenizer
    if tok is not None:
        prompt = tok.encode(join_words(filler_words(prompt_tokens * 2)))[:prompt_tokens]
    else:
        prompt = [(7 * i + 3) % max(lm.args.vocab_size - 1, 2) + 1 for i in range(prompt_tokens)]
    t0 = time.perf_counter()
    bench = EngineBench(lm, prompt, decode_tokens)
    b = bench.backend
    start = setting_of(b.ex)  # what the flags asked for: the search starts there
    say(f"strata calibrate: {Path(model_path).name} on {b.device}, {len(b.layer_ids)} MoE layers x {b.n_experts} "
        f"experts (top-{bench.k}), {b.cache.slots} cache slots per layer")
    say("costs:")
    threads_list = thread_counts(physical_cores())
    costs = measure_costs(b, threads_list, say)
    space = candidate_space(bench.k, costs["cpu_ms_per_expert"], knobs, has_lane=b.lane is not None)
    say(f"search ({repeats} A B B A blocks per candidate, {decode_tokens}-token decodes, keep if > "
        f"{threshold:.0%} faster in every block):")
    best, trials = search(bench.measure, start, space, repeats, threshold, say)
    final_start, final_best = ab(bench.measure, start, best, repeats) if best != start else ([], [])
    gain = paired_gain(final_start, final_best) if final_start else 0.0
    reverted = None
    if final_start and min(block_gains(final_start, final_best)) <= threshold:
        # the steps each won, their sum does not, measured again: keep what the user had
        reverted = dataclasses.asdict(best)
        say(f"the kept setting does not beat the start by more than {threshold:.0%} when measured again "
            f"({gain:+.1%}): keeping the start")
        best = start
    bench.apply(best)
    cost_path = save_cost_model(b) if save else None
    result = {"model": model_key(model_path), "model_path": str(model_path),
              "setting": dataclasses.asdict(best), "start": dataclasses.asdict(start),
              "changed": {k: list(v) for k, v in start.diff(best).items()},
              "gain": gain, "start_ms": final_start, "best_ms": final_best, "costs": costs,
              "trials": [t.as_dict() for t in trials], "repeats": repeats, "decode_tokens": decode_tokens,
              "threshold": threshold, "seconds": time.perf_counter() - t0, "decode_runs": bench.runs,
              "cost_model_path": str(cost_path) if cost_path else None, "flags": best.flags(),
              "reverted": reverted}
    if save:
        path = calibration_path(model_path, lm.cfg)
        save_calibration(path, result)
        result["path"] = str(path)
    if result["changed"]:
        say("changed: " + ", ".join(f"{k} {v[0]} -> {v[1]}" for k, v in result["changed"].items())
            + f"; measured again against the start: {_ms(final_start).strip()} -> {_ms(final_best).strip()} ms/token, "
              f"{_gains(final_start, final_best)}")
    else:
        say("no setting beat the current one by more than "
            f"{threshold:.0%}: nothing changed")
    say(f"flags: {' '.join(best.flags())}")
    if save:
        say(f"saved {result['path']}")
    return result


def cmd_calibrate(args) -> int:
    """`strata calibrate`: the checks on its flags, then calibrate() on the loaded model."""
    import json

    from strata.bench.outdir import write_text
    from strata.engine.cli import load_from_args

    knobs = [k.strip() for k in args.knobs.split(",") if k.strip()]
    bad = [k for k in knobs if k not in KNOBS]
    if bad:
        raise StrataError(f"unknown knob {bad[0]!r} (knobs: {', '.join(KNOBS)})")
    if args.repeats < 1 or args.decode_tokens < 2 or args.prompt_tokens < 1:
        raise StrataError("--repeats >= 1, --decode-tokens >= 2 and --prompt-tokens >= 1 are needed")
    if args.experts_mode == "resident":
        raise StrataError("calibrate tunes tiered experts: drop --experts resident")
    if args.expert_routing != "model" and not args.no_save:  # it would become this model's saved setting
        raise StrataError(f"calibrate with --expert-routing {args.expert_routing} tunes for random routing, not the "
                          "model's: add --no-save (the result is not saved as this model's calibration)")
    if args.vram_gb is None and args.expert_slots is None:
        raise StrataError("calibrate tunes the tiered experts for a VRAM budget: pass --vram-gb (or --expert-slots)")
    if args.json:
        _check_writable(args.json)
    lm = load_from_args(args)
    res = calibrate(lm, str(lm.cfg.model), knobs=knobs, repeats=args.repeats, decode_tokens=args.decode_tokens,
                    prompt_tokens=args.prompt_tokens, threshold=args.threshold, save=not args.no_save,
                    say=lambda m: print(m, flush=True))
    if args.json:
        write_text(Path(args.json), json.dumps(res, indent=1, default=str))
    return 0


def _check_writable(path: str) -> None:
    """--json's file, checked before the model loads: a bad path is said before minutes of measuring."""
    p = Path(path)
    if p.is_dir():
        raise StrataError(f"--json {path} is a directory: give a file to write the result to")
    if not p.parent.is_dir():
        raise StrataError(f"--json {path}: the directory {p.parent} does not exist")
    if not os.access(p.parent, os.W_OK):
        raise StrataError(f"--json {path}: no permission to create files in {p.parent}")
