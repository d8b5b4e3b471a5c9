"""`strata bench` (sweep, concurrency, needle, sanity; peers side by side) and `strata calibrate`."""

from __future__ import annotations

import argparse
from dataclasses import replace
import sys
from pathlib import Path

from strata import StrataError

SUITES = ("sweep", "concurrency", "needle", "sanity")
PEERS = ("llamacpp", "hf")
LONG = ("sweep", "needle", "sanity")  # suites served with one slot and a long context
ONE_SLOT = "concurrency-1slot"  # --one-slot-baseline: the concurrency suite's one worker on a 1-slot server
ROUTINGS = ("model", "uniform")  # strata.config.EXPERT_ROUTINGS (not imported: `strata --help` stays torch-free)


def _say(msg: str) -> None:
    print(f"strata bench: {msg}", file=sys.stderr, flush=True)


def register(sub) -> None:
    from strata.engine.cli import add_engine_args

    p = sub.add_parser("bench", help="measure a server honestly (sweep, concurrency, needle, sanity) and its peers",
                       description="Writes results.json, results.md and PNG plots under OUT/<date>-<name>/. Without "
                       "--url it starts `strata serve` with the engine flags given (one server with one slot for the "
                       "long-prompt suites, one with a slot per worker for the concurrency sweep).")
    p.add_argument("suites", nargs="*", metavar="SUITE", help=f"{', '.join(SUITES)} or all (default: sweep concurrency)")
    p.add_argument("--url", default=None, help="a running OpenAI-compatible server (default: start strata serve)")
    p.add_argument("--api-key", default=None, help="the server's API key")
    p.add_argument("--name", default=None, help="names the results directory (default: the model's file name)")
    p.add_argument("--out", default="bench/results", help="where result directories go (default bench/results)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the sweep and concurrency "
                   "requests (default 0: greedy; > 0 sends llama.cpp's default top-k/top-p/min-p with it, to every "
                   "server alike); needle and sanity stay greedy")
    p.add_argument("--seed", type=int, default=0, help="the seed every sweep and concurrency request sends (default "
                   "0); concurrency worker i sends seed + i, so sampled workers do not write the same text")
    p.add_argument("--routing", default="model", choices=ROUTINGS, help="expert routing of the strata server: model "
                   "(default), or uniform: each token to k random experts, an expert cache's worst case (passes "
                   "--expert-routing uniform; changes the output, so speed only; llama.cpp peers keep their model's "
                   "routing)")
    g = p.add_argument_group("sweep")
    g.add_argument("--lengths", default="1K,4K,16K,32K", help="prompt lengths (default 1K,4K,16K,32K)")
    g.add_argument("--runs", type=int, default=3, help="measured runs per length (default 3)")
    g.add_argument("--warmup", type=int, default=1, help="uncounted runs per length first (default 1)")
    g.add_argument("--gen", type=int, default=128, help="tokens generated per run (default 128)")
    g = p.add_argument_group("concurrency")
    g.add_argument("--workers", default="1,2,4,8", help="concurrent workers per level (default 1,2,4,8)")
    g.add_argument("--conc-prompt", type=int, default=512, help="prompt tokens per request (default 512)")
    g.add_argument("--conc-gen", type=int, default=64, help="tokens generated per request (default 64)")
    g.add_argument("--conc-requests", type=int, default=2, help="requests per worker (default 2)")
    g.add_argument("--one-slot-baseline", action="store_true", help="also one worker on a 1-slot server of each "
                   "engine, beside the many-slot server's 1-worker level: what parallel slots cost a lone client")
    g = p.add_argument_group("needle / sanity")
    g.add_argument("--needle-lengths", default="4K,16K", help="haystack lengths (default 4K,16K)")
    g.add_argument("--depths", default="10,50,90", help="needle depths in percent (default 10,50,90)")
    g.add_argument("--synthetic", action="store_true", help="the weights are synthetic (the needle says so; "
                   "detected for `strata synth` files)")
    g.add_argument("--baseline", default=None, help="a previous results.json: sanity compares answers with it")
    g.add_argument("--sanity-tokens", type=int, default=48, help="answer tokens per sanity case (default 48)")
    g = p.add_argument_group("peers (run after strata, same model file, same VRAM budget)")
    g.add_argument("--vs", action="append", default=[], choices=PEERS, help="also measure llama.cpp / transformers")
    g.add_argument("--llama-server", default=None, help="llama-server binary (default: peers/llama.cpp/build/bin; "
                   "without one, llama.cpp's CPU build from xllamacpp)")
    g.add_argument("--llama-bench", default=None, help="llama-bench binary (default: peers/llama.cpp/build/bin); "
                   "none: skip it (a 128K row's llama-bench adds two more 128K prefills)")
    g.add_argument("--n-cpu-moe", type=int, default=None, help="llama.cpp's --n-cpu-moe (default: fitted to --vram-gb)")
    g.add_argument("--peer-threads", type=int, default=0, help="peer CPU threads (default: physical cores)")
    g = p.add_argument_group("server started by the bench (strata serve flags)")
    g.add_argument("--serve-timeout", type=float, default=1800, help="seconds to wait for the model to load")
    add_engine_args(p)
    p.set_defaults(func=cmd_bench)

    c = sub.add_parser("calibrate", help="measure this machine's expert costs and tune the tiered-expert knobs",
                       description="Measures the per-expert CPU cost by thread count and the PCIe copy cost, then "
                       "searches CPU threads, the plan, the PCIe share and the cache policy's knobs with short decode "
                       "runs, keeping a setting only if it beats the current one by more than --threshold across "
                       "interleaved repeats. Saves the result per machine + model + budget; strata serve reads it.")
    add_engine_args(c)
    c.add_argument("--knobs", default=",".join(_knobs()), help=f"which knobs to search (default: all: "
                   f"{','.join(_knobs())})")
    c.add_argument("--repeats", type=int, default=2, help="interleaved A B B A blocks per candidate (default 2)")
    c.add_argument("--decode-tokens", type=int, default=32, help="tokens per timed decode (default 32)")
    c.add_argument("--prompt-tokens", type=int, default=64, help="prompt tokens before each decode (default 64)")
    c.add_argument("--threshold", type=float, default=0.03, help="minimum gain to keep a setting (default 0.03)")
    c.add_argument("--no-save", action="store_true", help="print the result without saving it")
    c.add_argument("--json", default=None, help="also write the full result (trials included) here")
    c.set_defaults(func=cmd_calibrate)


def _knobs():
    from strata.bench.calibrate import KNOBS

    return KNOBS


# ---------------------------------------------------------------------------------------------------------------
# strata bench


def engine_argv(args) -> list[str]:
    """The engine flags given on the command line, as `strata serve` arguments (defaults left out)."""
    from strata.engine.cli import add_engine_args

    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p)
    out: list[str] = []
    for act in p._actions:
        if not act.option_strings or act.dest in ("model", "ctx_size"):
            continue
        v = getattr(args, act.dest, act.default)
        if v == act.default:
            continue
        if isinstance(act, argparse.BooleanOptionalAction):  # --x / --no-x: the one that says v
            pos = max((o for o in act.option_strings if not o.startswith("--no-")), key=len)
            out.append(pos if v else f"--no-{pos[2:]}")
            continue
        flag = max(act.option_strings, key=len)
        if act.nargs == 0:
            out.append(flag)
        else:
            out += [flag, str(v)]
    return out


def _suites(names: list[str]) -> list[str]:
    if not names:
        return ["sweep", "concurrency"]
    if "all" in names:
        return list(SUITES)
    bad = [n for n in names if n not in SUITES]
    if bad:
        raise StrataError(f"unknown suite {bad[0]!r} (suites: {', '.join(SUITES)}, all)")
    return [n for n in SUITES if n in names]


def _ints(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise StrataError(f"{what}: want comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise StrataError(f"{what}: want positive integers, got {text!r}")
    return out


def _routing(args) -> str:
    """--routing, or the engine's own --expert-routing given to the bench (the same switch). Left in
    args.expert_routing, which `engine_argv` passes to the strata server."""
    engine = getattr(args, "expert_routing", "model")
    routing = args.routing if args.routing != "model" else engine
    args.expert_routing = routing
    return routing


class Plan:
    """What one bench invocation will do, parsed and checked before any server starts."""

    def __init__(self, args):
        from strata.bench.concurrency import ConcurrencyConfig
        from strata.bench.needle import NeedleConfig
        from strata.bench.prompts import parse_sizes
        from strata.bench.sweep import SweepConfig

        self.suites = _suites(args.suites)
        if args.runs < 1 or args.warmup < 0 or args.gen < 2:
            raise StrataError("--runs must be >= 1, --warmup >= 0 and --gen >= 2 (decode speed needs 2 tokens)")
        if not 0 <= args.temperature <= 2:
            raise StrataError(f"--temperature must be within 0..2, got {args.temperature}")
        if args.seed < 0:
            raise StrataError(f"--seed must be >= 0, got {args.seed}")
        self.seed = args.seed
        self.routing = _routing(args)
        self.sweep = SweepConfig(tuple(sorted(parse_sizes(args.lengths))), args.runs, args.warmup, args.gen,
                                 temperature=args.temperature, seed=args.seed)
        self.conc = ConcurrencyConfig(tuple(_ints(args.workers, "--workers")), args.conc_prompt, args.conc_gen,
                                      args.conc_requests, temperature=args.temperature, seed=args.seed)
        self.needle = NeedleConfig(tuple(sorted(parse_sizes(args.needle_lengths))), tuple(_ints(args.depths, "--depths")))
        if any(not 0 <= d <= 100 for d in self.needle.depths):
            raise StrataError("--depths are percentages (0..100)")
        self.one_slot = bool(getattr(args, "one_slot_baseline", False))
        if self.one_slot and ("concurrency" not in self.suites or max(self.conc.workers) < 2 or args.url):
            raise StrataError("--one-slot-baseline needs the concurrency suite with more than one worker, on "
                              "servers the bench starts (not --url)")
        self.sanity_tokens = args.sanity_tokens
        if self.sanity_tokens < 1:
            raise StrataError("--sanity-tokens must be >= 1")
        self.baseline = None
        if args.baseline and "sanity" in self.suites:
            from strata.bench.sanity import load_baseline

            self.baseline = load_baseline(args.baseline)

    def long_ctx(self, model_ctx: int | None) -> int:
        need = 256
        if "sweep" in self.suites:
            need = max(need, max(self.sweep.lengths) + self.sweep.gen)
        if "needle" in self.suites:
            need = max(need, max(self.needle.lengths) + self.needle.gen)
        if "sanity" in self.suites:
            need = max(need, 2048)
        need = -(-(need + 64) // 256) * 256
        return min(need, model_ctx) if model_ctx else need

    def conc_ctx(self, model_ctx: int | None) -> int:
        need = -(-(self.conc.prompt_tokens + self.conc.gen + 64) // 256) * 256
        return min(need, model_ctx) if model_ctx else need


def run_suites(client, plan: Plan, suites: list[str], synthetic: bool | None, tag: str) -> dict:
    from strata.bench.concurrency import run_concurrency
    from strata.bench.needle import run_needle
    from strata.bench.sanity import run_sanity
    from strata.bench.sweep import run_sweep

    out = {}
    for s in suites:
        if s == "sweep":
            out[s] = run_sweep(client, plan.sweep, _say, tag=tag)
        elif s == "concurrency":
            out[s] = run_concurrency(client, plan.conc, _say, tag=tag)
        elif s == ONE_SLOT:
            out[s] = run_concurrency(client, replace(plan.conc, workers=(1,)), _say, tag=f"{tag}, 1 slot")
        elif s == "needle":
            out[s] = run_needle(client, plan.needle, synthetic, _say, tag=tag)
        elif s == "sanity":
            out[s] = run_sanity(client, plan.baseline, _say, plan.sanity_tokens)
    return out


def _server_info(client) -> dict:
    props = client.props()
    m = client.metrics() or {}
    keep = ("model_path", "model_alias", "total_slots", "build_info", "chat_template_caps")
    info = {k: props[k] for k in keep if k in props}
    gen = props.get("default_generation_settings") or {}
    if "n_ctx" in gen:
        info["n_ctx"] = gen["n_ctx"]
    if m.get("settings"):
        info["settings"] = m["settings"]
    if m.get("experts"):
        info["experts_total"] = m["experts"]
    return info


def _phases(plan: Plan) -> list[tuple[list[str], int]]:
    """(suites, slots) per server started: the long-prompt suites on one slot, concurrency on a slot per worker."""
    out = []
    long = [s for s in plan.suites if s in LONG]
    if long:
        out.append((long, 1))
    if "concurrency" in plan.suites:
        out.append((["concurrency"], max(plan.conc.workers)))
    if plan.one_slot:
        out.append(([ONE_SLOT], 1))
    return out


def _past_context(plan: Plan, model_ctx: int | None) -> None:
    """A suite whose every length lies past the model's trained context would start both servers only to skip it
    all: said at once, with the flag that runs it anyway (the servers then get that context, as llama.cpp's -c past
    n_ctx_train). Where some lengths fit, the others are skipped with a note, as before."""
    if not model_ctx:
        return
    for name, c in (("sweep", plan.sweep), ("needle", plan.needle)):
        if name in plan.suites and c.lengths and min(c.lengths) + c.gen > model_ctx:
            need = -(-(max(c.lengths) + c.gen + 64) // 256) * 256  # (as the servers' context is rounded)
            raise StrataError(f"{name}: every length asked for needs more context than the model's trained "
                              f"{model_ctx} tokens (up to {need} with the tokens generated): pass -c {need} to run "
                              f"them there anyway (speed only: past its trained context a model's text is its own), "
                              f"or shorter lengths")


def _phase_ctx(args, plan: Plan, model_ctx: int | None, names: list[str]) -> int:
    """A phase's context per slot: -c where given, else what its suites need (at most the trained context)."""
    return args.ctx_size or (plan.conc_ctx(model_ctx) if names[0] in ("concurrency", ONE_SLOT)
                             else plan.long_ctx(model_ctx))


def peer_kv_tokens(args, plan: Plan, model_ctx: int | None) -> int:
    """The most KV tokens any phase's server holds (llama.cpp's -c: the context per slot times the slots), for the
    peer's VRAM fit: -c where given, past the trained context too."""
    return max(_phase_ctx(args, plan, model_ctx, names) * parallel for names, parallel in _phases(plan))


def _run_started(args, plan: Plan, model: str, model_ctx: int | None, synthetic, out_dir: Path, label: str,
                 start) -> tuple[dict, dict]:
    """Run the plan's phases on servers made by `start(parallel, ctx, log) -> (ServerProcess, description)`."""
    from strata.bench.client import BenchClient
    from strata.bench.record import VramPeak

    suites, phases = {}, []
    for names, parallel in _phases(plan):
        ctx = _phase_ctx(args, plan, model_ctx, names)
        log = out_dir / "logs" / f"{label}-{names[0]}.log"
        proc, how = start(parallel, ctx, log)
        _say(f"{label}: starting {how} (log {log})")
        with VramPeak() as peak, proc:
            client = BenchClient(proc.url, timeout=args.serve_timeout)
            try:
                info = _server_info(client)
                suites.update(run_suites(client, plan, names, synthetic, tag=label))
                after = client.metrics() or {}
                info["experts_total_after"] = after.get("experts")
                # how its decode steps ran (graphs, launched ahead, the misses' path): strata's /props only
                info["decode_steps"] = client.props().get("decode_steps")
                if after.get("profile"):  # the per-token time breakdown (a server run with --profile)
                    info["profile"] = after["profile"]
            finally:
                client.close()
        phases.append({"suites": names, "parallel": parallel, "ctx": ctx, "how": how, "argv": proc.argv,
                       "vram_peak_bytes": peak.peak, "server": info})
    return suites, {"phases": phases}


def cmd_bench(args) -> int:
    from strata.bench import outdir, report
    from strata.bench.client import BenchClient, strata_server
    from strata.bench.record import VramPeak, command_line, machine_record, model_record, now_stamp

    plan = Plan(args)
    date, stamp = now_stamp()
    eargv = engine_argv(args)
    model_path = None
    if args.url:
        if args.model or eargv:
            _say("note: with --url the engine flags are the running server's; the ones given here are ignored")
    else:
        from strata.engine.cli import resolve_model_path

        model_path = resolve_model_path(args.model)
    client0 = None
    if args.url:
        client0 = BenchClient(args.url, args.api_key)
        status, _ = client0.health()
        if status != 200:
            raise StrataError(f"{args.url} is not ready (/health answered {status or 'nothing'})")
        model_path = model_path or client0.props().get("model_path")
        served = ((client0.metrics() or {}).get("settings") or {}).get("expert_routing")
        if plan.routing != "model" and served != plan.routing:
            raise StrataError(f"--routing {plan.routing}: the server at {args.url} routes by "
                              f"{served or 'a rule it does not report'}; start it with --expert-routing "
                              f"{plan.routing} (with --url the bench cannot change it)")
        plan.routing = served  # None: a server that does not say (a peer's routing is its model's)
    mrec = model_record(model_path, args.vram_gb, args.ctx_size) if model_path else {}
    synthetic = True if args.synthetic else mrec.get("synthetic")
    model_ctx = (mrec.get("footprint") or {}).get("context_length")
    if not args.url and not args.ctx_size:
        _past_context(plan, model_ctx)
    if args.vs and model_path is None:
        raise StrataError("--vs needs the model file (give -m, or a server whose /props names its model_path)")
    if "llamacpp" in args.vs:
        from strata.bench.peers.llamacpp import check_peer

        server_bin, bench_bin = check_peer(args.llama_server, args.llama_bench)
        args.llama_server, args.llama_bench = str(server_bin) if server_bin else None, str(bench_bin or "none")
    name = args.name or (Path(model_path).stem if model_path else "server")
    out_dir = outdir.fresh_dir(Path(args.out), f"{date}-{name}")
    _say(f"results go to {out_dir}")
    with outdir.unfinished(out_dir, _say):
        results = {"name": name, "date": stamp, "command": command_line(), "machine": machine_record(),
                   "model": mrec, "seed": plan.seed, "temperature": args.temperature, "routing": plan.routing,
                   "vram_budget_gib": args.vram_gb,
                   "suites": {}, "peers": {}}
        if args.url:
            try:
                info = _server_info(client0)
                with VramPeak() as peak:
                    results["suites"] = run_suites(client0, plan, plan.suites, synthetic, tag="strata")
                results["server"] = {"url": args.url, "started": False, "flags": [], **info,
                                     "vram_peak_bytes": peak.peak}
                after = client0.metrics() or {}
                if after.get("profile"):
                    results["server"]["profile"] = after["profile"]
            finally:
                client0.close()
        else:
            def start(parallel, ctx, log):
                proc = strata_server(model_path, [*eargv, "-c", str(ctx)], log, parallel=parallel)
                proc.ready_timeout = args.serve_timeout
                return proc, f"strata serve -np {parallel} -c {ctx} {' '.join(eargv)}".rstrip()

            suites, srv = _run_started(args, plan, model_path, model_ctx, synthetic, out_dir, "strata", start)
            results["suites"] = suites
            results["server"] = {"url": "started per phase", "started": True, "flags": eargv, **srv}
        for peer in dict.fromkeys(args.vs):
            got = _run_peer(peer, args, plan, model_path, model_ctx, synthetic, out_dir, _device(results["server"], args))
            for rec in got.values():  # no peer has a routing override: each runs the router of the model file
                rec["routing"] = "model"
            results["peers"].update(got)
        paths = report.write(results, out_dir)
    _print_summary(results, out_dir, paths)
    return 0


def peer_cache_types(args) -> tuple[str, str] | None:
    """The KV cache types strata's server was given (-ctk / -ctv, or --kv-dtype naming one), for llama.cpp's
    server the same: both engines then hold the same KV. None: neither was set (llama.cpp's default, f16)."""
    base = getattr(args, "kv_dtype", "auto") or "auto"
    k, v = getattr(args, "cache_type_k", None), getattr(args, "cache_type_v", None)
    if k is None and v is None and base == "auto":
        return None
    # llama.cpp's names for the float types strata also spells out
    fallback = "f16" if base == "auto" else {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(base, base)
    return k or fallback, v or fallback


def _run_peer(peer: str, args, plan: Plan, model: str, model_ctx, synthetic, out_dir: Path, device: str) -> dict:
    from strata.bench.peers import hf, llamacpp
    from strata.bench.calibrate import physical_cores

    threads = args.peer_threads or physical_cores()
    out: dict = {}
    if peer == "hf":
        if "sweep" not in plan.suites:
            return {"hf": {"how": "transformers + accelerate", "error": "runs the sweep only: add the sweep suite"}}
        _say("hf: transformers + accelerate offload (a child process)")
        try:
            out["hf"] = hf.run_hf(model, budget_gib=args.vram_gb, lengths=list(plan.sweep.lengths), gen=plan.sweep.gen,
                                  runs=plan.sweep.runs, threads=args.peer_threads, log_path=out_dir / "logs" / "hf.log")
        except StrataError as e:
            out["hf"] = {"how": "transformers + accelerate", "error": str(e)}
        return out
    # llama.cpp: its server through the same suites; llama-bench too where it is built
    server_bin = llamacpp.find_binary("llama-server", args.llama_server)
    if server_bin is None and device.startswith("cuda"):  # strata on the GPU against llama.cpp's CPU build: a straw man
        return {"llamacpp": {"how": "llama.cpp", "error": f"strata ran on {device}, and there is no GPU llama-server at "
                             f"{llamacpp.BUILD_BIN} (bench/peers/llamacpp.sh build, or --llama-server PATH)"}}
    n_cpu_moe = args.n_cpu_moe
    fit = None
    kv_types = peer_cache_types(args)
    if n_cpu_moe is None and server_bin is not None and args.vram_gb is not None:
        sizes = llamacpp.layer_sizes(model, kv_types or ("f16", "f16"))
        ctx = peer_kv_tokens(args, plan, model_ctx)
        n_cpu_moe, est = llamacpp.fit_n_cpu_moe(sizes, int(args.vram_gb * llamacpp.GiB), ctx)
        fit = {"n_cpu_moe": n_cpu_moe, "estimated_vram_bytes": est, "ctx": ctx}
        _say(f"llama.cpp: --n-cpu-moe {n_cpu_moe} fits {args.vram_gb} GiB (estimated {est / llamacpp.GiB:.2f} GiB)")

    def start(parallel, ctx, log):
        return llamacpp.llamacpp_server(model, log, parallel=parallel, ctx=ctx, threads=threads, n_cpu_moe=n_cpu_moe,
                                        binary=server_bin, cache_types=kv_types)

    try:
        suites, srv = _run_started(args, plan, model, model_ctx, synthetic, out_dir, "llamacpp", start)
        out["llamacpp"] = {"how": srv["phases"][0]["how"] if srv["phases"] else "llama.cpp", "suites": suites,
                           "n_cpu_moe": n_cpu_moe, "fit": fit, **srv}
    except StrataError as e:
        out["llamacpp"] = {"how": "llama.cpp server", "error": str(e)}
    bench_bin = None if args.llama_bench == "none" else llamacpp.find_binary("llama-bench", args.llama_bench)
    if bench_bin is not None and "sweep" in plan.suites:
        try:
            out["llama-bench"] = llamacpp.run_llama_bench(
                bench_bin, model, budget_gib=args.vram_gb, lengths=list(plan.sweep.lengths), gen=plan.sweep.gen,
                threads=threads, reps=plan.sweep.runs, n_cpu_moe=args.n_cpu_moe, cache_types=kv_types, log=_say)
        except StrataError as e:
            out["llama-bench"] = {"how": "llama-bench", "error": str(e)}
    return out


def _device(server: dict, args) -> str:
    """Where strata ran: its server's settings, else the --device it was started with."""
    for info in [server, *[ph.get("server") or {} for ph in server.get("phases", [])]]:
        dev = (info.get("settings") or {}).get("device")
        if dev:
            return str(dev)
    return str(args.device)


def _print_summary(results: dict, out_dir: Path, paths: dict) -> None:
    import json

    from strata.bench.prompts import fmt_size

    md = paths["markdown"].read_text(encoding="utf-8")
    print(md)
    ratios = json.loads(paths["json"].read_text(encoding="utf-8")).get("ratios") or {}
    for peer, r in ratios.items():
        parts = [f"{fmt_size(x['length'])}: prefill {_x(x['prefill'])} decode {_x(x['decode'])}" for x in r["sweep"]]
        parts += [f"{x['workers']} workers: {_x(x['aggregate'])} tok/s" for x in r["concurrency"]]
        if parts:
            print(f"strata / {peer}: " + " | ".join(parts))
    _say(f"wrote {', '.join(str(p) for p in paths.values())}")


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


# ---------------------------------------------------------------------------------------------------------------
# strata calibrate


def cmd_calibrate(args) -> int:
    from strata.bench.calibrate import cmd_calibrate as run  # (the engine's imports only when it runs)

    return run(args)
