"""The prefill/decode sweep: for each prompt length, 1 warm-up and N measured requests, none of them cached.

Per length: prefill tok/s (engine: prompt_n / prompt_ms), decode tok/s (engine: (predicted_n - 1) /
predicted_ms) and the client's time to first token, as median (min-max); the exact prompt sizes; the expert
statistics of the measured requests. The traps this avoids:

- a cached prompt fakes prefill speed: every prompt has its own first line, is sent with `cache_prompt: false`,
  and the run aborts if the engine reports a single cached token;
- a cold expert cache reads 20-30% slow: the warm-up request of each length is not counted;
- speculative decoding makes decode speed depend on content: the filler is the same for every request of a
  length and draft acceptance is recorded;
- client wall time is not decode time: decode speed comes from the engine's own timings;
- greedy text can fall into loops that n-gram drafts predict: `temperature` > 0 measures sampled text, with the
  same sampler chain sent to every server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from strata import StrataError
from strata.bench.client import BenchClient, Reply, sampling
from strata.bench.prompts import Prompt, PromptBuilder, fmt_size
from strata.bench.record import expert_delta, kv_window_delta
from strata.bench.stats import Summary

DEFAULT_LENGTHS = (1024, 4096, 16384, 32768)


@dataclass
class SweepConfig:
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    runs: int = 3
    warmup: int = 1
    gen: int = 128
    tolerance: float = 0.01  # prompt sizes within 1% of the target
    temperature: float = 0.0  # 0: greedy
    seed: int = 0  # sent with every request (what a sampled run draws from)


def check_uncached(rep: Reply, where: str) -> None:
    """Abort when the engine reused cached prompt tokens: prefill speed would be fake."""
    if rep.cached_tokens:
        raise StrataError(f"{where}: the engine reused {rep.cached_tokens} cached prompt tokens although the request "
                          "had a unique first line and cache_prompt false: its prefill numbers would be fake")


def check_reply(rep: Reply, where: str) -> None:
    if rep.error:
        raise StrataError(f"{where}: the server reported an error: {rep.error}")
    if not rep.timings:
        raise StrataError(f"{where}: the server sent no `timings` (the engine's own clock): cannot measure honestly")
    check_uncached(rep, where)


def run_record(rep: Reply, prompt: Prompt) -> dict:
    t = rep.timings
    return {"target": prompt.target, "prompt_tokens": rep.prompt_tokens, "prompt_n": t.get("prompt_n"),
            "prompt_ms": t.get("prompt_ms"), "predicted_n": t.get("predicted_n"), "predicted_ms": t.get("predicted_ms"),
            "cache_n": rep.cached_tokens, "prefill_tok_s": rep.prefill_tok_s, "decode_tok_s": rep.decode_tok_s,
            "ttft_s": rep.ttft_s, "wall_s": rep.wall_s, "finish_reason": rep.finish_reason,
            "draft_n": t.get("draft_n"), "draft_n_accepted": t.get("draft_n_accepted")}


def server_ctx(client: BenchClient) -> int | None:
    props = client.props()
    n = (props.get("default_generation_settings") or {}).get("n_ctx") or props.get("n_ctx")
    return int(n) if n else None


def run_sweep(client: BenchClient, cfg: SweepConfig, say: Callable[[str], None] = print, tag: str = "sweep") -> dict:
    builder = PromptBuilder(client.count_tokens, tag=tag, tolerance=cfg.tolerance)
    ctx = server_ctx(client)
    rows, skipped = [], []
    for length in cfg.lengths:
        if ctx and length + cfg.gen > ctx:
            skipped.append({"length": length, "why": f"prompt + {cfg.gen} generated exceeds the context of {ctx}"})
            say(f"sweep {fmt_size(length)}: skipped (context {ctx})")
            continue
        rows.append(_one_length(client, builder, length, cfg, say))
    return {"config": {"lengths": list(cfg.lengths), "runs": cfg.runs, "warmup": cfg.warmup, "gen": cfg.gen,
                       "tolerance": cfg.tolerance, "cache_prompt": False, "temperature": cfg.temperature,
                       "seed": cfg.seed},
            "n_ctx": ctx, "rows": rows, "skipped": skipped}


def _one_length(client: BenchClient, builder: PromptBuilder, length: int, cfg: SweepConfig, say) -> dict:
    where = f"sweep {fmt_size(length)}"
    offset = 0  # tokens the engine counts beyond the counter's (checked on the warm-up)
    warm: list[dict] = []
    for i in range(cfg.warmup):
        p = builder.build(length, offset=offset)
        rep = _send(client, p, cfg)
        check_reply(rep, where + " warm-up")
        if rep.prompt_tokens is not None and i == 0:
            offset += rep.prompt_tokens - p.tokens
        warm.append(run_record(rep, p))
    before = client.metrics()
    runs: list[dict] = []
    for i in range(cfg.runs):
        p = builder.build(length, offset=offset)
        rep = _send(client, p, cfg)
        check_reply(rep, f"{where} run {i + 1}")
        r = run_record(rep, p)
        n = rep.prompt_tokens or 0
        r["size_error"] = (n - length) / length
        if abs(r["size_error"]) > cfg.tolerance and not (abs(n - length) <= 1):
            raise StrataError(f"{where}: the prompt has {n} tokens, more than {cfg.tolerance:.0%} off the target "
                              f"{length} (the counter said {p.tokens})")
        runs.append(r)
    after = client.metrics()
    row = {"length": length, "runs": runs, "warmup": warm,
           "prefill_tok_s": Summary.of([r["prefill_tok_s"] for r in runs if r["prefill_tok_s"]]).as_dict(),
           "decode_tok_s": Summary.of([r["decode_tok_s"] for r in runs if r["decode_tok_s"]]).as_dict(),
           "ttft_s": Summary.of([r["ttft_s"] for r in runs if r["ttft_s"] is not None]).as_dict(),
           "prompt_tokens": [r["prompt_tokens"] for r in runs],
           "generated": [r["predicted_n"] for r in runs],
           "experts": expert_delta(before, after)}
    if kv_window_delta(before, after):  # (--kv-vram-tokens: the window's page hits over these runs)
        row["kv_window"] = kv_window_delta(before, after)
    short = [r["predicted_n"] for r in runs if (r["predicted_n"] or 0) < cfg.gen]
    if short:
        row["note"] = (f"generation stopped before {cfg.gen} tokens ({short}): the server ignored ignore_eos; "
                       "decode speed is over fewer tokens")
    drafts = sum(r["draft_n"] or 0 for r in runs)
    if drafts:
        row["draft_acceptance"] = sum(r["draft_n_accepted"] or 0 for r in runs) / drafts
    pf, dc, tt = (Summary(**row[k]) for k in ("prefill_tok_s", "decode_tok_s", "ttft_s"))
    say(f"{where}: prefill {pf.fmt()} tok/s | decode {dc.fmt()} tok/s | TTFT {tt.fmt(3)} s "
        f"| prompt {row['prompt_tokens']} tokens")
    return row


def _send(client: BenchClient, p: Prompt, cfg: SweepConfig) -> Reply:
    return client.chat([{"role": "user", "content": p.text}], cfg.gen, cache_prompt=False, ignore_eos=True,
                       seed=cfg.seed, **sampling(cfg.temperature))
