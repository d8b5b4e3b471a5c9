"""In-process decode/prefill measurement for one model and one engine setting (the numbers in docs/BENCHMARKS.md).

    python tools/bench_decode.py -m MODEL.gguf [engine flags...] --prompt-tokens 1024 --gen 256 --runs 3

Greedy; 1 warm-up request then `--runs` measured ones, each with a fresh prompt (unique first tokens, no prefix
reuse). Prints one JSON line per setting: median/min/max decode tok/s (engine clock), prefill tok/s, expert
statistics of the measured runs, and the --profile breakdown when asked.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, ".")
import strata  # noqa: F401,E402  (before torch: it sets the OpenMP runtime's environment)
import numpy as np  # noqa: E402
import torch  # noqa: E402

from strata.engine.cli import add_engine_args, engine_config  # noqa: E402
from strata.engine.engine import Engine, Sequence  # noqa: E402
from strata.engine.loader import load_model  # noqa: E402
from strata.engine.sampler import SamplingParams  # noqa: E402


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def make_prompt(tok, n: int, salt: int) -> list[int]:
    if not tok:
        return list(range(1, n + 1))
    src = open(__file__).read()
    reps = 20
    while True:  # this file repeated until it is n tokens long (a 128K prompt needs ~30 copies)
        ids = tok.encode(f"Request {salt}: " + src * reps, add_special=False)
        if len(ids) >= n:
            return ids[:n]
        reps = reps * n // max(1, len(ids)) + 1


def main() -> int:
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prefill-only", type=int, default=0, help="also time a prefill of this many tokens")
    ap.add_argument("--prefill-runs", type=int, default=1, help="long prefills timed (median)")
    ap.add_argument("--trace-prefill", action="store_true",
                    help="one more long prefill under torch.profiler: the top ops by GPU and by host time (stderr)")
    ap.add_argument("--trace-out", default="",
                    help="with --trace-prefill: also write the timeline as a Chrome trace (.json.gz) for "
                         "tools/trace_timeline.py")
    ap.add_argument("--trace-decode", type=int, default=0, metavar="N",
                    help="also trace N decode steps under torch.profiler (after the timed runs): kernels per step "
                         "and per layer, GPU busy / idle time, copies (tools/trace_timeline.py's summary)")
    ap.add_argument("--parallel", type=int, default=1, metavar="N",
                    help="N sequences decode together (N slots, one step for all, as `strata serve --parallel N` "
                         "with N busy clients): aggregate tok/s, step time, distinct misses per step")
    ap.add_argument("--label", default="")
    ap.add_argument("--salt", type=int, default=0,
                    help="vary the prompts (a routing profile recorded on one salt, measured on another)")
    ap.add_argument("--sweep-plans", default="", help="comma-separated --cpu-plan values measured in turn (one load)")
    ap.add_argument("--sweep-threads", default="", help="comma-separated CPU lane thread counts measured in turn")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample the continuation (seeded per run) instead of greedy: a synthetic model's greedy "
                         "text repeats, which flatters an expert cache")
    ap.add_argument("--sweep", default="", help="comma-separated PLAN@THREADS settings measured in turn")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="run Python's profiler over the measured decode steps: the host's top N functions by their "
                         "own time, in ms a step (stderr and the JSON line's host_profile)")
    ap.add_argument("--dump-routing", default="", metavar="FILE.npz",
                    help="save every routing the expert cache's policy observed (prefill chunks and decode steps, "
                         "warm-up included): input for tools/sim_expert_cache.py")
    ap.add_argument("--cpu-exact", action="store_true", help="CPU qmatmul as the float32 reference for every batch "
                    "(no native int8-activation GEMV for decode): the baseline of a CPU run's decode")
    a = ap.parse_args()
    if a.cpu_exact:
        from strata.quant import matmul

        matmul.CPU_EXACT = True
    cfg = engine_config(a)
    t0 = time.perf_counter()
    lm = load_model(a.model, cfg)
    load_s = time.perf_counter() - t0
    eng = Engine(lm, n_slots=max(1, a.parallel))
    dev = lm.model.device
    experts = lm.model.experts
    routing = RoutingLog(getattr(experts, "policy", None)) if a.dump_routing else None
    combos = [(p or None, None) for p in a.sweep_plans.split(",") if p] or [(None, None)]
    if a.sweep_threads:
        combos = [(p, int(t)) for p, _ in combos for t in a.sweep_threads.split(",") if t]
    if a.sweep:
        combos = [(c.split("@")[0], int(c.split("@")[1]) if "@" in c else None) for c in a.sweep.split(",") if c]
    for plan, th in combos:
        label = a.label + (f" plan={plan}" if plan else "") + (f" threads={th}" if th else "")
        if plan and plan != "default":
            from strata.experts.plan import CpuPlan

            experts.plan = CpuPlan.parse(plan, lm.args.n_experts_used)
            experts.tuner = None  # a plan set by hand stays
        if th:
            torch.set_num_threads(th)
        (measure_parallel if a.parallel > 1 else measure)(a, lm, eng, experts, dev, label, load_s)
    if routing is not None:
        routing.save(a.dump_routing, lm.args.n_experts_used)
    if callable(getattr(experts, "close", None)):
        experts.close()  # writes --expert-profile-save
    return 0


class RoutingLog:
    """--dump-routing: every `observe` the cache policy gets, in order, with the policy's step count (one decode
    step's layers share a step; a prefill chunk's layers too, with many ids each)."""

    def __init__(self, policy):
        if policy is None:
            raise SystemExit("--dump-routing: this model's experts have no cache policy (all resident?)")
        self.layer, self.step, self.ids = [], [], []
        inner = policy.observe

        def observe(layer, ids):
            self.layer.append(int(layer))
            self.step.append(int(policy.steps))
            self.ids.append(np.asarray(ids, dtype=np.int32).reshape(-1).copy())
            return inner(layer, ids)

        policy.observe = observe
        self.policy = policy

    def save(self, path: str, k: int) -> None:
        pol = self.policy
        lens = np.array([len(x) for x in self.ids], dtype=np.int64)
        np.savez_compressed(path, layer=np.array(self.layer, dtype=np.int32), step=np.array(self.step, np.int64),
                            offsets=np.concatenate([[0], np.cumsum(lens)]),
                            ids=np.concatenate(self.ids) if self.ids else np.zeros(0, np.int32),
                            slots=np.array([pol.capacity(i) for i in range(pol.n_layers)], dtype=np.int32),
                            n_experts=pol.n_experts, k=k)
        print(f"bench_decode: wrote {len(self.layer)} observations to {path}", file=sys.stderr)


class HostProfile:
    """--host-profile: cProfile switched on around the measured decode steps only."""

    def __init__(self, n: int):
        import cProfile

        self.n, self.prof, self.steps = n, cProfile.Profile(), 0

    def __enter__(self):
        self.prof.enable()
        return self

    def __exit__(self, *exc):
        self.prof.disable()

    def report(self) -> list:
        import io
        import pstats

        st = pstats.Stats(self.prof, stream=io.StringIO())
        rows = []
        for (file, line, fn), (_cc, nc, tt, ct, _callers) in st.stats.items():
            rows.append((tt, ct, nc, f"{Path(file).name}:{line}({fn})"))
        rows.sort(reverse=True)
        steps = max(1, self.steps)
        out = [{"fn": name, "calls_per_step": round(nc / steps, 1), "own_ms_per_step": round(tt * 1e3 / steps, 3),
                "cum_ms_per_step": round(ct * 1e3 / steps, 3)} for tt, ct, nc, name in rows[:self.n]]
        total = sum(r[0] for r in rows) * 1e3 / steps
        print(f"host profile: {total:.2f} ms of Python a decode step (profiled; the profiler adds its own)",
              file=sys.stderr)
        for r in out:
            print(f"  {r['own_ms_per_step']:8.3f} own {r['cum_ms_per_step']:8.3f} cum {r['calls_per_step']:8.1f} "
                  f"calls  {r['fn']}", file=sys.stderr)
        return out


class GcClock:
    """Python's garbage collections while it is on: count and milliseconds per generation (a collection of the
    old generation stops a decode step for milliseconds when the heap holds many objects)."""

    def __init__(self):
        self.on, self.t0 = False, 0.0
        self.n, self.ms = [0, 0, 0], [0.0, 0.0, 0.0]
        gc.callbacks.append(self._cb)

    def _cb(self, phase, info):
        if not self.on:
            return
        if phase == "start":
            self.t0 = time.perf_counter()
        else:
            g = info["generation"]
            self.n[g] += 1
            self.ms[g] += (time.perf_counter() - self.t0) * 1e3

    def report(self) -> dict:
        return {f"gen{g}": [self.n[g], round(self.ms[g], 2)] for g in range(3)}


def routing_skew(routed: np.ndarray, layer_slots: dict) -> dict:
    """How concentrated the measured steps' routing was: the share of uses that the most-used experts of each
    layer took — for as many experts as the cache has slots (the hit rate of the best static cache, knowing the
    future) and for a quarter of the experts — and the experts used at all per layer."""
    srt = -np.sort(-routed.astype(np.float64), axis=1)  # [L, E] each layer's counts, descending
    tot = srt.sum(axis=1)
    slots = list(layer_slots.values())
    top_s = np.array([srt[i, :s].sum() for i, s in enumerate(slots)])
    q = max(1, routed.shape[1] // 4)
    return {"static_best_hit": round(float(top_s.sum() / tot.sum()), 4),
            "top_quarter_share": round(float(srt[:, :q].sum() / tot.sum()), 4),
            "experts_used_per_layer": round(float((routed > 0).sum(axis=1).mean()), 1)}


def measure(a, lm, eng, experts, dev, label, load_s) -> None:
    res = {"label": label, "load_s": round(load_s, 1), "device": str(dev)}
    if getattr(experts, "cache", None) is not None:
        res.update(plan=str(experts.plan), slots_per_layer=experts.cache.slots,
                   cache_gib=round(experts.cache.nbytes() / 2**30, 2))
    if eng.vram_split is not None:  # how the budget was divided (GiB per part), as the engine logged it
        res["vram_split"] = eng.vram_split.as_dict()
    decode, prefill = [], []
    steps_ms: list[float] = []  # every measured decode step's wall time (the distribution shows stalls)
    gcc = GcClock()
    step_misses: list[int] = []  # each measured step's expert misses (CPU + PCIe), beside its time
    pol = getattr(experts, "policy", None)
    routed = None  # [L, E] expert uses of the measured decode steps (the routing skew on these prompts)
    stats = None  # expert statistics of the measured runs' decode steps (prefill chunks excluded)
    decode_s = 0.0  # the measured runs' decode time (first token to last), for the miss lanes' GB/s
    hp = HostProfile(a.host_profile) if a.host_profile else None
    for r in range(a.runs + 1):
        ids = make_prompt(lm.tokenizer, a.prompt_tokens, salt=r * 7919 + 13 + a.salt)
        sp = SamplingParams(temperature=a.temperature, seed=1000 + r) if a.temperature else SamplingParams(temperature=0)
        seq = Sequence(ids, sp, a.gen, set())
        eng.add(seq, reuse_prefix=False)
        if r == 1 and getattr(experts, "profile", None) is not None:
            experts.profile.reset()
        while not seq.output:  # prefill (one or more chunks) up to the first token
            eng.step()
        before = experts.stats.snapshot() if getattr(experts, "stats", None) is not None else None
        t_prev = time.perf_counter()
        run_steps = []
        gcc.on = r > 0
        st = getattr(experts, "stats", None)
        run_misses = []
        u0 = pol.usage().copy() if pol is not None and r > 0 else None
        while not seq.finished:
            m0 = st.cpu + st.pcie if st is not None else 0
            if hp is not None and r > 0:
                with hp:
                    eng.step()
                hp.steps += 1
            else:
                eng.step()
            t_now = time.perf_counter()
            run_steps.append((t_now - t_prev) * 1e3)
            run_misses.append((st.cpu + st.pcie - m0) if st is not None else 0)
            t_prev = t_now
        gcc.on = False
        sync(dev)
        if r == 0:
            continue
        steps_ms += run_steps
        step_misses += run_misses
        if u0 is not None:
            du = pol.usage() - u0
            routed = du if routed is None else routed + du
        if before is not None:
            d = experts.stats - before
            stats = d if stats is None else stats + d
            decode_s += seq.predicted_ms / 1e3
        prefill.append(seq.prompt_n / (seq.prompt_ms / 1e3))
        decode.append((len(seq.output) - 1) / (seq.predicted_ms / 1e3))
        if seq.draft_n:  # --draft-max: the measured runs' drafts
            dr = res.setdefault("drafts", {"steps": 0, "proposed": 0, "accepted": 0})
            dr["steps"] += seq.draft_steps
            dr["proposed"] += seq.draft_n
            dr["accepted"] += seq.draft_accepted
    if decode:  # --runs 0: the warm-up only (a prefill-only measurement)
        res["decode_tok_s"] = {"median": round(statistics.median(decode), 2), "min": round(min(decode), 2),
                               "max": round(max(decode), 2)}
        res["prefill_tok_s"] = {"median": round(statistics.median(prefill), 1)}
        q = statistics.quantiles(steps_ms, n=100, method="inclusive") if len(steps_ms) >= 2 else steps_ms * 99
        res["step_ms"] = {"mean": round(statistics.fmean(steps_ms), 3), "p10": round(q[9], 3),
                          "p50": round(q[49], 3), "p90": round(q[89], 3), "p99": round(q[98], 3),
                          "max": round(max(steps_ms), 3), "gc_count_ms": gcc.report()}
        if any(step_misses) and len(set(step_misses)) > 1:
            # step time against its misses: the intercept is a step without misses, the slope one miss's cost
            slope, icpt = np.polyfit(np.asarray(step_misses, float), np.asarray(steps_ms), 1)
            r = float(np.corrcoef(step_misses, steps_ms)[0, 1])
            res["step_ms"]["vs_misses"] = {"ms_at_0": round(float(icpt), 3), "ms_per_miss": round(float(slope), 4),
                                           "r": round(r, 3), "misses_p50_p90": [
                                               float(np.percentile(step_misses, 50)),
                                               float(np.percentile(step_misses, 90))]}
    if stats is not None:
        # with the CPU and PCIe lanes' GB/s over the decode time (experts_cpu_gbps, experts_pcie_gbps, together
        # experts_miss_gbps)
        res["experts_decode"] = {**stats.as_dict(), **stats.lane_gbps(decode_s)}
    if routed is not None and routed.sum() > 0:
        res["routing"] = routing_skew(routed, experts.cache.layer_slots)
    if a.prefill_only:
        ids = make_prompt(lm.tokenizer, a.prefill_only, salt=99991)
        if len(ids) >= a.prefill_only:  # always: make_prompt repeats its text until it is long enough
            cache = getattr(experts, "cache", None)
            pre0 = (cache.copied_bytes, cache.prefetched, cache.prefetch_used) if cache is not None else None
            st0 = experts.stats.cpu if getattr(experts, "stats", None) is not None else 0

            def long_prefill():
                seq = Sequence(ids, SamplingParams(temperature=0), 1, set())
                eng.add(seq, reuse_prefix=False)
                while not seq.finished:
                    eng.step()
                sync(dev)
                return seq.prompt_n / (seq.prompt_ms / 1e3)

            if dev.type == "cuda":  # the prefill's own peak: what a chunk's activations take above the held bytes
                sync(dev)
                held = torch.cuda.memory_allocated(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            runs = [long_prefill() for _ in range(max(1, a.prefill_runs))]
            if dev.type == "cuda":
                res["prefill_peak_gib"] = {
                    "allocated_above_held": round((torch.cuda.max_memory_allocated(dev) - held) / 2**30, 3),
                    "reserved_above_held": round((torch.cuda.max_memory_reserved(dev) - held) / 2**30, 3)}
            res["prefill_long"] = {"tokens": len(ids), "tok_s": round(statistics.median(runs), 1),
                                   "runs": [round(r, 1) for r in runs]}
            if pre0 is not None:
                n = len(runs)
                res["prefill_long"].update(
                    copied_gb_per_prefill=round((cache.copied_bytes - pre0[0]) / n / 1e9, 2),
                    prefetched=(cache.prefetched - pre0[1]) // n, prefetch_used=(cache.prefetch_used - pre0[2]) // n,
                    cpu_pairs=(experts.stats.cpu - st0) // n, chunk_cpu_scale=round(experts.chunk_cpu_scale, 2))
            if a.trace_prefill:
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
                with profile(activities=acts) as prof:
                    long_prefill()
                if a.trace_out:
                    prof.export_chrome_trace(a.trace_out)
                ka = prof.key_averages()
                if dev.type == "cuda":
                    print(ka.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60),
                          file=sys.stderr)
                print(ka.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60),
                      file=sys.stderr)
    if hp is not None:
        res["host_profile"] = hp.report()
    if a.trace_decode and dev.type == "cuda":
        res["decode_trace"] = trace_decode(a, lm, eng, a.trace_decode)
    if getattr(experts, "cache", None) is not None:
        res["admitted_from_staging"] = experts.cache.promoted  # cumulative: swaps that needed no PCIe copy
        if experts.prefetch_issued:  # cumulative: next-layer experts copied ahead, and routed to when they came
            res["prefetch_next"] = {"issued": experts.prefetch_issued, "used": experts.prefetch_used}
    if getattr(experts, "tuner", None) is not None:
        res["plan_tuner"] = experts.tuner.report()
    if dev.type == "cuda":
        res["max_vram_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
        free, total = torch.cuda.mem_get_info(dev)  # what --vram-gb bounds: the allocator's pool and the context
        res["device_used_gib"] = round((total - free) / 2**30, 2)
    print(json.dumps(res), flush=True)
    rep = getattr(experts, "profile_report", None)
    if a.profile and callable(rep):
        ms = 1e3 / res["decode_tok_s"]["median"] if decode else None
        print(rep(ms), file=sys.stderr)


def measure_parallel(a, lm, eng, experts, dev, label, load_s) -> None:
    """--parallel N: N fresh prompts prefilled, then decoded together (one step serves all N) until all finish;
    1 warm-up round then --runs measured ones. Aggregate tok/s over the rounds' decode wall time."""
    N = a.parallel
    res = {"label": label, "parallel": N, "load_s": round(load_s, 1), "device": str(dev),
           "graph_batch": eng.graph_batch}
    if getattr(experts, "cache", None) is not None:
        res.update(slots_per_layer=experts.cache.slots, cache_gib=round(experts.cache.nbytes() / 2**30, 2))
    agg, steps_ms, per_seq = [], [], []
    st = getattr(experts, "stats", None)
    stats = None
    for r in range(a.runs + 1):
        seqs = []
        for i in range(N):
            ids = make_prompt(lm.tokenizer, a.prompt_tokens, salt=(r * N + i) * 7919 + 13 + a.salt)
            sp = SamplingParams(temperature=a.temperature, seed=1000 + r * N + i) if a.temperature \
                else SamplingParams(temperature=0)
            s = Sequence(ids, sp, a.gen, set())
            eng.add(s, reuse_prefix=False)
            seqs.append(s)
        while not all(s.output for s in seqs):  # every prompt prefilled (the first tokens drawn)
            eng.step()
        sync(dev)
        before = st.snapshot() if st is not None else None
        n0 = sum(len(s.output) for s in seqs)
        t0 = t_prev = time.perf_counter()
        run_steps = []
        while not all(s.finished for s in seqs):
            eng.step()
            t_now = time.perf_counter()
            run_steps.append((t_now - t_prev) * 1e3)
            t_prev = t_now
        sync(dev)
        wall = time.perf_counter() - t0
        if r == 0:
            continue
        steps_ms += run_steps
        agg.append((sum(len(s.output) for s in seqs) - n0) / wall)
        per_seq += [(len(s.output) - 1) / (s.predicted_ms / 1e3) for s in seqs]
        if before is not None:
            d = st - before
            stats = d if stats is None else stats + d
    res["aggregate_tok_s"] = {"median": round(statistics.median(agg), 2), "min": round(min(agg), 2),
                              "max": round(max(agg), 2)}
    res["per_sequence_tok_s"] = round(statistics.median(per_seq), 2)
    q = statistics.quantiles(steps_ms, n=100, method="inclusive") if len(steps_ms) >= 2 else steps_ms * 99
    res["step_ms"] = {"mean": round(statistics.fmean(steps_ms), 3), "p50": round(q[49], 3),
                      "p90": round(q[89], 3), "max": round(max(steps_ms), 3), "steps": len(steps_ms)}
    if stats is not None:
        res["experts_decode"] = stats.as_dict()
    if eng.graphs is not None:
        res["graphs_captured"] = len(eng.graphs.graphs)
    if dev.type == "cuda":
        res["max_vram_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
    print(json.dumps(res), flush=True)
    rep = getattr(experts, "profile_report", None)
    if a.profile and callable(rep):
        print(rep(None), file=sys.stderr)


def trace_decode(a, lm, eng, n: int) -> dict:
    """n decode steps (after a prompt and a few untraced steps) under torch.profiler: the trace's summary
    (strata's tools/trace_timeline.py) with per-step and per-layer kernel counts."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from trace_timeline import load, summarize

    ids = make_prompt(lm.tokenizer, a.prompt_tokens, salt=4242)
    sp = SamplingParams(temperature=a.temperature, seed=7) if a.temperature else SamplingParams(temperature=0)
    seq = Sequence(ids, sp, n + 8, set())
    eng.add(seq, reuse_prefix=False)
    while len(seq.output) < 4:  # prefill and a few steps: graphs captured, the window settled
        eng.step()
    sync(lm.model.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            eng.step()
        sync(lm.model.device)
    eng.release(seq, "abort")
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "decode.json")
        prof.export_chrome_trace(path)
        out = summarize(load(path))
    if a.trace_out:
        prof.export_chrome_trace(a.trace_out.replace(".json", ".decode.json"))
    n_layers = len(lm.model.blocks)
    out["steps"] = n
    out["kernels_per_step"] = round(out["kernel_count"] / n, 1)
    out["kernels_per_layer"] = round(out["kernel_count"] / n / n_layers, 1)
    out["span_ms_per_step"] = round(out["span_ms"] / n, 3)
    out["kernels_ms_per_step"] = round(out["kernels_ms"] / n, 3)
    out["idle_ms_per_step"] = round(out["idle_ms"] / n, 3)
    print(json.dumps({"decode_trace": out}, indent=1), file=sys.stderr)
    return out


if __name__ == "__main__":
    sys.exit(main())
