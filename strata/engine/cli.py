"""`strata generate` and `strata chat`: text to stdout, everything else (progress, statistics) to stderr.

`strata perplexity` lives in perplexity_cli and is registered from here."""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from typing import TYPE_CHECKING

from strata import StrataError

if TYPE_CHECKING:
    from strata.config import EngineConfig
    from strata.engine.engine import Sequence

log = logging.getLogger("strata")

# what ends `strata chat` besides Ctrl-D (llama.cpp's and Ollama's words for it)
QUIT = frozenset({"/exit", "/quit", "/bye"})
COMMANDS = "/reset starts over, /exit (or Ctrl-D) quits, Ctrl-C stops a reply"
# a line of one /word is a command: an unknown one is said, not sent to the model (as Ollama does); a message
# that starts with a slash goes as typed when it holds more, or after a leading space
COMMAND = re.compile(r"/[A-Za-z?]+")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that loads a model (generate, chat, serve, bench), generated from
    EngineConfig's and ExpertConfig's fields (help, type, default and choices are written there once)."""
    from strata.config import EngineConfig, ExpertConfig, add_flags

    add_flags(p.add_argument_group("model and engine"), EngineConfig)
    add_flags(p.add_argument_group("experts (tiered execution)"), ExpertConfig)


def engine_config(args) -> "EngineConfig":
    from strata.config import EngineConfig, ExpertConfig, check_at_least, from_flags

    # (serve's --threads: torch takes no negative count, and said so in a traceback)
    check_at_least(0, ("--threads", getattr(args, "threads", None)))
    cfg = from_flags(EngineConfig, args, experts=from_flags(ExpertConfig, args),
                     n_slots=getattr(args, "parallel", 1) or 1, seed=getattr(args, "seed", None))
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
    _say_gpu_only(cfg)  # (before a saved calibration sets any: the user's own flags)
    path = resolve_model_path(args.model)
    cfg.model = path
    _apply_saved_calibration(path, cfg)
    t0 = time.perf_counter()
    print(f"strata: loading {path}", file=sys.stderr)
    from strata.engine.pipeline import open_pipeline

    lm = open_pipeline(path, cfg) or load_model(path, cfg)
    print(f"strata: loaded {lm.gguf.arch} ({lm.args.n_layers} layers, {lm.args.n_experts} experts) in "
          f"{time.perf_counter() - t0:.1f}s on {cfg.device}", file=sys.stderr)
    return lm


def _say_gpu_only(cfg: "EngineConfig") -> None:
    """One line naming the GPU-only flags a CPU run was given. They stay accepted (the CPU tests take them to run
    the GPU paths' code eagerly), but a user who typed one should not think it did on the CPU what it does on a
    GPU."""
    from strata.config import gpu_only_flags

    flags = gpu_only_flags(cfg) if cfg.torch_device.type == "cpu" else []
    if flags:
        log.warning("strata: %s: GPU settings, no effect on the CPU (at most their GPU code paths run eagerly)",
                    ", ".join(flags))
    if cfg.torch_device.type == "cpu" and cfg.experts.vram_gb is not None and cfg.experts.tiered():
        # (the budget does act on a CPU: it is how the tiers' plans are tried without a GPU, but it is no speed-up)
        log.warning("strata: --vram-gb on the CPU: the experts run tiered in RAM as they would under that budget "
                    "(to try a plan), slower than the CPU's own decode; leave it out to run fastest")


def _apply_saved_calibration(path: str, cfg) -> None:
    """`strata calibrate` saves the best expert settings per machine + model + budget; use them unless the user
    set those flags (a flag moved from its default always wins)."""
    if not cfg.experts.tiered():
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
                          frequency_penalty=args.frequency_penalty,
                          seed=None if args.seed == -1 else args.seed)  # -1: a random seed, as llama.cpp's --seed


GENERATE_N, CHAT_N = 128, 512  # tokens generated when -n is not given (fewer where the context ends sooner)


def _add_sampling(p, n_help: str = "tokens to generate (-1: until the context is full; default: 128 for generate, "
                  "512 a chat reply, fewer where the context ends sooner)"):
    """The sampling flags (llama.cpp's names). `strata serve` takes them too, as a request's defaults."""
    from strata.engine.sampler import SamplingParams

    d = SamplingParams()
    p.add_argument("-n", "--n-predict", type=int, default=None, help=n_help)
    p.add_argument("--temperature", "--temp", type=float, default=d.temperature, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=d.top_k, help="sample among the K likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=d.top_p,
                   help="sample among the likeliest tokens that make up this probability (1: all)")
    p.add_argument("--min-p", type=float, default=d.min_p,
                   help="drop tokens less likely than this times the likeliest one (0: none)")
    p.add_argument("--repeat-penalty", type=float, default=d.repetition_penalty,
                   help="penalize the tokens of the last 64 by this factor, as llama.cpp does (1: off)")
    p.add_argument("--presence-penalty", type=float, default=d.presence_penalty,
                   help="subtract this from the logit of each token of the last 64 (0: off)")
    p.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty,
                   help="subtract this times its count in the last 64 from a token's logit (0: off)")
    p.add_argument("--seed", type=int, default=d.seed, help="sampling seed (-1 or unset: a random one)")


def check_sampling_args(args) -> None:
    """-n and the sampling flags: one clear line for a bad one, before the model loads."""
    if args.n_predict is not None and args.n_predict <= 0 and args.n_predict != -1:
        raise StrataError(f"-n/--n-predict must be a positive number of tokens (or -1: until the context is "
                          f"full), got {args.n_predict}")
    sampling_from_args(args).validate()


def check_run_args(args) -> None:
    """Reject bad generation settings before the model loads (one clear line, not a traceback minutes later)."""
    check_sampling_args(args)
    if args.draft_source != "auto" and not args.draft_max:  # (a server's requests may turn drafts on: not there)
        raise StrataError(f"--draft-source {args.draft_source} drafts nothing without --draft-max N (at most N "
                          "drafted tokens a step)")


def _n_predict(engine, n_prompt: int, args, default: int) -> int:
    """-n as given (the prompt and it must fit the context: one clear line if not), or `default` tokens, fewer
    where the context ends sooner."""
    if n_prompt == 0:
        raise StrataError("the prompt is empty")
    asked = None if args.n_predict == -1 else args.n_predict  # (-1: as many as the context leaves, as llama.cpp's)
    want = asked or 1  # (-n's words: max_tokens is the APIs' name for it)
    if n_prompt + want > engine.max_ctx:
        more = f" + -n {asked}" if asked is not None else ""
        raise StrataError(f"the prompt of {n_prompt} tokens{more} exceeds the context of {engine.max_ctx} tokens "
                          "(-c sets it)")
    if args.n_predict == -1:
        return engine.max_ctx - n_prompt
    return asked if asked is not None else min(default, engine.max_ctx - n_prompt)


def _hit_context(engine, seq, n_prompt: int) -> bool:
    """The output stopped because the context is full (not at the model's end of turn, nor at an -n that left
    room)."""
    return seq is not None and seq.finish_reason == "length" and n_prompt + len(seq.output) >= engine.max_ctx


def _to_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _stream(engine, tok, ids, params, n, put=_to_stdout) -> "Sequence":
    from strata.gguf.tokenizer import StreamDecoder

    dec = StreamDecoder(tok)
    for t in engine.generate(ids, params, n, stop_ids=tok.eot_ids):
        if t in tok.eot_ids:
            break
        put(dec.put(t))
    put(dec.flush())
    return engine.last


def _user_text(text: str) -> str:
    """Text the user typed (argv, stdin), undecodable bytes as U+FFFD: Python passes them on as lone surrogates,
    which the tokenizer cannot encode."""
    from strata.text import replace_surrogates

    return replace_surrogates(text)


def _lenient_stdout() -> None:
    """Text the terminal's encoding cannot show (a non-UTF-8 locale, PYTHONIOENCODING=ascii) written as '?': the
    model's text is whatever it is, and one character must not end a generation in a traceback."""
    for stream in (sys.stdout, sys.stderr):  # (stderr: chat's reasoning)
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")


def _lenient_stdin() -> None:
    """stdin's bytes that are not text in its encoding read as U+FFFD: under a strict locale they would raise in
    the middle of a chat instead."""
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")


DIM, RESET = "\x1b[2m", "\x1b[0m"


class Reply:
    """A chat reply as it streams, split as the server splits it (strata.reasoning): the answer to `out`,
    the model's reasoning (a `<think>` block; gpt-oss's analysis channel) to `err`, dimmed on a terminal, or
    nowhere when hidden; the reasoning never goes back into the conversation. The empty block that Qwen3-style
    templates have the model write before every answer shows nothing. `in_reasoning`: the prompt opened the
    block."""

    def __init__(self, template: str | None, in_reasoning: bool, show_reasoning: bool = True, out=None, err=None):
        from strata.reasoning import HarmonySplitter, ReasoningSplitter, uses_harmony

        self.split = (HarmonySplitter if uses_harmony(template) else ReasoningSplitter)(True, in_reasoning)
        self.show = show_reasoning
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.dim = self.err.isatty()
        self.content = ""  # the answer: what the conversation keeps
        self._thinking = ""  # the reasoning shown since the answer last wrote ("": none open)

    def put(self, text: str) -> None:
        self._write(*self.split.push(text))

    def end(self) -> None:
        """The end of the reply (or its interruption): held-back text out, the reasoning's styling closed."""
        self._write(*self.split.flush())
        self._close()

    def _write(self, reasoning: str, content: str) -> None:
        if reasoning and self.show:
            self.err.write((DIM if self.dim and not self._thinking else "") + reasoning)
            self.err.flush()
            self._thinking += reasoning
        if content:
            self._close()
            self.content += content
            self.out.write(content)
            self.out.flush()

    def _close(self) -> None:
        if self._thinking:  # the answer starts on a line of its own
            self.err.write((RESET if self.dim else "") + ("" if self._thinking.endswith("\n") else "\n"))
            self.err.flush()
            self._thinking = ""


def _say_split(engine) -> None:
    """How the VRAM budget was divided (tiered experts sized from a budget), on stderr before generating."""
    if engine.vram_split is not None:
        print(f"strata: {engine.vram_split.render()}", file=sys.stderr)
    if engine.kv_window_stats is not None:
        print(f"strata: {engine.kv.describe()}", file=sys.stderr)


def _report(seq, engine) -> None:
    pt = seq.prompt_n / (seq.prompt_ms / 1e3) if seq.prompt_ms else 0.0
    n = max(len(seq.output) - 1, 0)
    dt = n / (seq.predicted_ms / 1e3) if seq.predicted_ms else 0.0
    print(f"\nstrata: prompt {seq.prompt_n} tokens in {seq.prompt_ms:.0f} ms ({pt:.1f} tok/s), "
          f"generated {len(seq.output)} tokens, decode {dt:.1f} tok/s", file=sys.stderr)
    if seq.draft_n:
        print(f"strata: drafts accepted {seq.draft_accepted} of {seq.draft_n} "
              f"({seq.draft_accepted / seq.draft_n:.0%}) in {seq.draft_steps} verify steps", file=sys.stderr)
    experts = engine.model.experts  # an ExpertsBackend, None for a dense model
    if experts is not None and experts.stats is not None:
        print(f"strata: experts {experts.stats.summary()}", file=sys.stderr)
    if engine.kv_window_stats is not None:
        print(f"strata: KV window {engine.kv_window_stats.summary()}", file=sys.stderr)
    if seq.experts_decode is not None:  # this run's decode: what the CPU and PCIe lanes moved, in GB/s
        print(f"strata: {seq.experts_decode.lane_summary(seq.predicted_ms / 1e3)}", file=sys.stderr)
    r = experts.profile_report() if experts is not None else ""
    if r:
        print(r, file=sys.stderr)


def _census(engine, ids: list[int]) -> None:
    """--profile: what a decode step launches, per step and per layer (strata.engine.census)."""
    from strata.engine.census import decode_census, render

    if engine.max_ctx - len(ids) < 16:
        print("strata: no room in the context for the decode census", file=sys.stderr)
        return
    print(render(decode_census(engine, ids, steps=8)), file=sys.stderr)


def cmd_generate(args) -> int:
    from strata.engine.engine import Engine

    check_run_args(args)
    engine_config(args)  # bad engine flags fail here, before the model loads
    lm = load_from_args(args)
    _lenient_stdout()
    tok = lm.tokenizer
    if tok is None:
        raise StrataError(f"{lm.cfg.model}: the model has no tokenizer in its metadata")
    if args.prompt is None:
        _lenient_stdin()
        if sys.stdin.isatty():  # (a user who left out -p would otherwise wait on a silent terminal)
            print("strata: reading the prompt from the terminal: end it with Ctrl-D (or pass -p TEXT)",
                  file=sys.stderr, flush=True)
    prompt = _user_text(args.prompt if args.prompt is not None else sys.stdin.read())
    if args.chat:
        if lm.template is None:
            raise StrataError("the model has no chat template (tokenizer.chat_template); run without --chat")
        text = lm.template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = tok.encode(text, add_special=False)
    else:
        ids = tok.encode(prompt)
    engine = Engine(lm, n_slots=1)
    _say_split(engine)
    n = _n_predict(engine, len(ids), args, GENERATE_N)
    seq = _stream(engine, tok, ids, sampling_from_args(args), n)
    sys.stdout.write("\n")
    if _hit_context(engine, seq, len(ids)):
        print(f"strata: stopped at the end of the context ({engine.max_ctx} tokens; -c sets it)", file=sys.stderr)
    _report(seq, engine)
    if lm.cfg.experts.profile:
        _census(engine, ids)
    return 0


def cmd_chat(args) -> int:
    from strata.engine.engine import Engine

    check_run_args(args)
    engine_config(args)
    lm = load_from_args(args)
    if lm.template is None or lm.tokenizer is None:
        raise StrataError("the model has no chat template or tokenizer; use strata generate")
    engine = Engine(lm, n_slots=1)
    _say_split(engine)
    msgs = [{"role": "system", "content": _user_text(args.system)}] if args.system else []
    template = lm.gguf.get("tokenizer.chat_template")
    _lenient_stdin()
    _lenient_stdout()
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass
    print("strata chat: type a message, /reset to start over, Ctrl-C stops a reply, Ctrl-D or /exit quits",
          file=sys.stderr)
    while True:
        try:
            # the prompt only on a terminal: piped output is the replies alone
            line = input("> " if interactive else "")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 130
        if not line.strip():
            continue
        if line.strip() in QUIT:
            return 0
        if line.strip() == "/reset":
            msgs = msgs[:1] if args.system else []
            print("strata: a new conversation", file=sys.stderr)
            continue
        if COMMAND.fullmatch(line.rstrip()):
            unknown = line.strip() not in ("/help", "/?")
            print(f"strata: {f'unknown command {line.strip()}: ' if unknown else ''}{COMMANDS} (a message "
                  "that starts with / goes as typed after a space)", file=sys.stderr)
            continue
        msgs.append({"role": "user", "content": _user_text(line)})
        text = lm.template.render(msgs, add_generation_prompt=True)
        ids = lm.tokenizer.encode(text, add_special=False)
        want = args.n_predict if args.n_predict not in (None, -1) else 1
        if len(ids) + want > engine.max_ctx:  # said in the chat's terms, and the chat goes on
            more = f" and -n {want} more" if args.n_predict not in (None, -1) else ""
            print(f"strata: the conversation is {len(ids)} tokens with this message{more}, the context holds "
                  f"{engine.max_ctx}: /reset starts over (-c sets the context)", file=sys.stderr)
            msgs.pop()
            continue
        n = _n_predict(engine, len(ids), args, CHAT_N)
        reply = Reply(template, text.rstrip().endswith("<think>"), show_reasoning=not args.hide_reasoning)
        stopped = False
        try:
            seq = _stream(engine, lm.tokenizer, ids, sampling_from_args(args), n, put=reply.put)
        except KeyboardInterrupt:  # stop this reply, keep what was said, back to the prompt
            seq, stopped = engine.last, True
        reply.end()
        if stopped:
            print(" [stopped]", end="", file=sys.stderr)
        elif _hit_context(engine, seq, len(ids)):  # the reply is cut short: said, not left to look finished
            print(f" [the context of {engine.max_ctx} tokens is full: /reset starts over]", end="", file=sys.stderr)
        print()
        msgs.append({"role": "assistant", "content": reply.content})
        if args.verbose:
            _report(seq, engine)


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (text to stdout, statistics to stderr)")
    add_engine_args(p)
    p.add_argument("-p", "--prompt", default=None, help="the prompt (default: read stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_sampling(p.add_argument_group("sampling"))
    # generate and chat decode the user's text from their first step: the plan trials (all-CPU plans among them,
    # several times slower than the best) belong to the server's warm-up or `strata calibrate`, not to a user's
    # tokens; the plan comes from the cost model or an earlier run's verdict (--cpu-plan-tune runs them here)
    p.set_defaults(func=cmd_generate, cpu_plan_tune=False)
    p = sub.add_parser("chat", help="interactive chat in the terminal")
    add_engine_args(p)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("-v", "--verbose", action="store_true", help="print speed after each reply")
    p.add_argument("--hide-reasoning", action="store_true",
                   help="do not show the model's reasoning (<think> blocks; shown dimmed on stderr by default)")
    _add_sampling(p.add_argument_group("sampling"))
    p.set_defaults(func=cmd_chat, cpu_plan_tune=False)
    from strata.engine.perplexity_cli import register as register_perplexity

    register_perplexity(sub)
