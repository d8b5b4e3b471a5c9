"""`strata generate` and `strata chat`: text to stdout, everything else (progress, statistics) to stderr."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from strata import StrataError

if TYPE_CHECKING:
    from strata.config import EngineConfig
    from strata.engine.engine import Sequence


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that loads a model (generate, chat, serve, bench)."""
    from strata.config import EngineConfig, ExpertConfig

    d, e = EngineConfig(), ExpertConfig()
    p.add_argument("-m", "--model", default=None, help="GGUF file (first shard of a split set) or REPO:QUANT; "
                   "default: the embedded strata-tiny model")
    p.add_argument("--device", default=d.device, help=f"cpu or cuda[:N] (default {d.device})")
    p.add_argument("--dtype", default="auto", help="compute dtype: auto (f32 on CPU, bf16 on GPU), f32, bf16, f16")
    p.add_argument("--kv-dtype", default="auto", help="KV cache dtype: auto (= compute dtype), bf16, f16, f32")
    p.add_argument("-c", "--ctx-size", type=int, default=0, help="context length (default: min(model, 8192))")
    p.add_argument("--prefill-chunk", type=int, default=0,
                   help="prompt tokens per forward (default on a GPU with tiered experts: 4096, fewer on a small "
                        "budget, whose activations the expert cache leaves room for; else sized from memory; "
                        "halved on its own if the device runs out during a prompt)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay decode steps as CUDA graphs (default: on with a CUDA device and one slot; "
                        "--cuda-graphs with --parallel N also batches decoding sequences, resident experts)")
    p.add_argument("--draft-max", type=int, default=d.draft_max,
                   help="speculative decoding with n-gram drafts: at most N tokens guessed from earlier in the "
                        "context and verified in one forward per step (default 0: off; exact for any sampler; "
                        "pays where text repeats its context, as code edits do)")
    p.add_argument("--draft-ngram-min", type=int, default=d.draft_ngram_min,
                   help=f"shortest n-gram a draft is looked up by (default {d.draft_ngram_min})")
    p.add_argument("--draft-ngram-max", type=int, default=d.draft_ngram_max,
                   help=f"longest n-gram a draft is looked up by, tried first (default {d.draft_ngram_max})")
    g = p.add_argument_group("experts (tiered execution)")
    g.add_argument("--experts", dest="experts_mode", default=e.mode, choices=["auto", "resident", "tiered"])
    g.add_argument("--vram-gb", type=float, default=None, help="the whole process's VRAM budget (GiB): the CUDA context, weights, KV, a prefill chunk "
                        "and the expert cache fit in it, and torch's allocator is held to it")
    g.add_argument("--vram-reserve-mib", type=int, default=e.vram_reserve_mib,
                   help="VRAM headroom left free for decode activations, graphs and allocator slack (the CUDA "
                        "context and a prefill chunk are counted besides)")
    g.add_argument("--expert-slots", type=int, default=None, help="expert cache slots per layer (overrides budget)")
    g.add_argument("--cpu-threads", type=int, default=0, help="CPU lane threads (default: physical cores)")
    g.add_argument("--cpu-kernel", default=e.cpu_kernel, choices=["auto", "native", "int4", "ref"],
                   help="CPU lane kernel: native (Q4_K read in place, compiled once), int4 (torch, repacked copy), "
                        "ref (exact float32); auto: native, else int4, for bf16/f16, ref for float32")
    g.add_argument("--cpu-plan", default="auto", help="misses -> CPU share, e.g. 011223344, or auto (measured)")
    g.add_argument("--expert-prefetch", action=argparse.BooleanOptionalAction, default=e.prefetch_next,
                   help="decode: predict the next MoE layer's experts with its router on this layer's input and "
                        "start copying the uncached ones during this layer (off by default: not yet measured)")
    g.add_argument("--cpu-plan-tune", action=argparse.BooleanOptionalAction, default=e.plan_tune,
                   help="with --cpu-plan auto, time the measured plan, all-PCIe and all-CPU over the first decode "
                        "steps and keep the fastest (default: on with a GPU)")
    g.add_argument("--cache-policy", default=e.cache_policy, choices=["lfu-decay", "lru"])
    g.add_argument("--cache-layout", default=e.cache_layout, choices=["uniform", "profile"],
                   help="cache slots per layer: uniform, or spread as --expert-profile's routing predicts most hits")
    g.add_argument("--promote-min", type=float, default=0.0, help="decayed uses needed before an expert is cached")
    g.add_argument("--swap-budget", type=int, default=e.swap_budget, help="expert copies per layer per step")
    g.add_argument("--low-ram", action="store_true", help="read experts from the memory-mapped file (no pinned copy)")
    g.add_argument("--expert-profile", default=None, help="routing profile to fill the cache from")
    g.add_argument("--expert-profile-save", default=None, help="write the learned routing profile here on exit")
    g.add_argument("--profile", action="store_true", help="print the per-token time breakdown")


def engine_config(args) -> "EngineConfig":
    from strata.config import EngineConfig, ExpertConfig

    ex = ExpertConfig(
        mode=args.experts_mode, vram_gb=args.vram_gb, vram_reserve_mib=args.vram_reserve_mib,
        cpu_threads=args.cpu_threads, cpu_kernel=getattr(args, "cpu_kernel", "auto"), cpu_plan=args.cpu_plan, cache_policy=args.cache_policy,
        cache_layout=getattr(args, "cache_layout", "uniform"),
        promote_min=args.promote_min, swap_budget=args.swap_budget, low_ram=args.low_ram,
        expert_profile=args.expert_profile, expert_profile_save=args.expert_profile_save, profile=args.profile,
        slots=args.expert_slots, plan_tune=getattr(args, "cpu_plan_tune", True),
        prefetch_next=getattr(args, "expert_prefetch", False),
    )
    cfg = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, kv_dtype=args.kv_dtype,
                       ctx_size=args.ctx_size, prefill_chunk=args.prefill_chunk,
                       n_slots=getattr(args, "parallel", 1) or 1, seed=getattr(args, "seed", None), experts=ex,
                       cuda_graphs=getattr(args, "cuda_graphs", None), draft_max=getattr(args, "draft_max", 0),
                       draft_ngram_min=getattr(args, "draft_ngram_min", 2),
                       draft_ngram_max=getattr(args, "draft_ngram_max", 4))
    cfg.validate()
    return cfg


def resolve_model_path(spec: str | None) -> str:
    if spec is None:
        from strata.models.default import default_model_path

        return str(default_model_path())
    try:
        from strata.hub.local import resolve_model
    except ImportError:
        return spec
    paths = resolve_model(spec)
    return str(paths[0]) if isinstance(paths, (list, tuple)) else str(paths)


def load_from_args(args):
    from strata.engine.loader import load_model

    cfg = engine_config(args)
    path = resolve_model_path(args.model)
    cfg.model = path
    _apply_saved_calibration(path, cfg)
    t0 = time.perf_counter()
    print(f"strata: loading {path}", file=sys.stderr)
    lm = load_model(path, cfg)
    print(f"strata: loaded {lm.gguf.arch} ({lm.args.n_layers} layers, {lm.args.n_experts} experts) in "
          f"{time.perf_counter() - t0:.1f}s on {cfg.device}", file=sys.stderr)
    return lm


def _apply_saved_calibration(path: str, cfg) -> None:
    """`strata calibrate` saves the best expert settings per machine + model + budget; use them unless the user
    set those flags (a flag moved from its default always wins)."""
    if cfg.experts.mode == "resident" or (cfg.experts.vram_gb is None and cfg.experts.slots is None
                                           and cfg.experts.mode != "tiered"):
        return
    from strata.experts.calibration import apply_calibration, load_calibration

    calib = load_calibration(path, cfg)
    if calib:
        changed = apply_calibration(cfg, calib)
        if changed:
            desc = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
            print(f"strata: using the saved calibration: {desc}", file=sys.stderr)


def sampling_from_args(args):
    from strata.engine.sampler import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repeat_penalty, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, seed=args.seed)


def _add_sampling(p):
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate")
    p.add_argument("--temperature", "--temp", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)


def _stream(engine, tok, ids, params, n, out=sys.stdout) -> "Sequence":
    from strata.gguf.tokenizer import StreamDecoder

    dec = StreamDecoder(tok)
    for t in engine.generate(ids, params, n, stop_ids=tok.eot_ids):
        if t in tok.eot_ids:
            break
        out.write(dec.put(t))
        out.flush()
    out.write(dec.flush())
    out.flush()
    return engine.last


def _report(seq, engine) -> None:
    pt = seq.prompt_n / (seq.prompt_ms / 1e3) if seq.prompt_ms else 0.0
    n = max(len(seq.output) - 1, 0)
    dt = n / (seq.predicted_ms / 1e3) if seq.predicted_ms else 0.0
    print(f"\nstrata: prompt {seq.prompt_n} tokens in {seq.prompt_ms:.0f} ms ({pt:.1f} tok/s), "
          f"generated {len(seq.output)} tokens, decode {dt:.1f} tok/s", file=sys.stderr)
    if seq.draft_n:
        print(f"strata: drafts accepted {seq.draft_accepted} of {seq.draft_n} "
              f"({seq.draft_accepted / seq.draft_n:.0%}) in {seq.draft_steps} verify steps", file=sys.stderr)
    stats = getattr(engine.model.experts, "stats", None)
    if stats is not None and hasattr(stats, "summary"):
        print(f"strata: experts {stats.summary()}", file=sys.stderr)
    prof = getattr(engine.model.experts, "profile_report", None)
    if callable(prof):
        r = prof()
        if r:
            print(r, file=sys.stderr)


def cmd_generate(args) -> int:
    from strata.engine.engine import Engine

    lm = load_from_args(args)
    tok = lm.tokenizer
    if tok is None:
        raise StrataError(f"{lm.cfg.model}: the model has no tokenizer in its metadata")
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if args.chat:
        if lm.template is None:
            raise StrataError("the model has no chat template (tokenizer.chat_template); run without --chat")
        text = lm.template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = tok.encode(text, add_special=False)
    else:
        ids = tok.encode(prompt)
    engine = Engine(lm, n_slots=1)
    engine.check_fits(len(ids), args.n_predict)
    seq = _stream(engine, tok, ids, sampling_from_args(args), args.n_predict)
    sys.stdout.write("\n")
    _report(seq, engine)
    return 0


def cmd_chat(args) -> int:
    from strata.engine.engine import Engine

    lm = load_from_args(args)
    if lm.template is None or lm.tokenizer is None:
        raise StrataError("the model has no chat template or tokenizer; use strata generate")
    engine = Engine(lm, n_slots=1)
    msgs = [{"role": "system", "content": args.system}] if args.system else []
    print("strata chat: type a message, /reset to start over, Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() == "/reset":
            msgs = msgs[:1] if args.system else []
            continue
        msgs.append({"role": "user", "content": line})
        ids = lm.tokenizer.encode(lm.template.render(msgs, add_generation_prompt=True), add_special=False)
        try:
            engine.check_fits(len(ids), args.n_predict)
        except StrataError as e:
            print(f"strata: {e} (use /reset)", file=sys.stderr)
            msgs.pop()
            continue
        seq = _stream(engine, lm.tokenizer, ids, sampling_from_args(args), args.n_predict)
        print()
        reply = lm.tokenizer.decode([t for t in seq.output if t not in lm.tokenizer.eot_ids])
        msgs.append({"role": "assistant", "content": reply})
        if args.verbose:
            _report(seq, engine)


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (text to stdout, statistics to stderr)")
    add_engine_args(p)
    p.add_argument("-p", "--prompt", default=None, help="the prompt (default: read stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_sampling(p)
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("chat", help="interactive chat in the terminal")
    add_engine_args(p)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("-v", "--verbose", action="store_true", help="print speed after each reply")
    _add_sampling(p)
    p.set_defaults(func=cmd_chat, n_predict=512)
