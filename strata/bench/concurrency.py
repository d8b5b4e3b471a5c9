"""The concurrency sweep: W workers (1, 2, 4, 8 ...) each sending requests back to back.

Per level: aggregate generated tok/s over the level's wall time (first request sent to last stream closed),
request latency p50/p90, time to first token p50/p90 (client clock), errors. Every prompt is uncached (unique
first line, `cache_prompt: false`). Worker i sends seed `seed + i`: sampled workers draw different text rather than
W copies of one. A server with fewer slots than workers queues the rest: that is part of
what the level measures, so the server's slot count is recorded next to it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable

import httpx

from strata import StrataError
from strata.bench.client import BenchClient, Reply, sampling
from strata.bench.prompts import PromptBuilder
from strata.bench.record import expert_delta
from strata.bench.stats import latency
from strata.bench.sweep import check_uncached

DEFAULT_WORKERS = (1, 2, 4, 8)


@dataclass
class ConcurrencyConfig:
    workers: tuple[int, ...] = DEFAULT_WORKERS
    prompt_tokens: int = 512
    gen: int = 64
    requests_per_worker: int = 2
    tolerance: float = 0.01
    temperature: float = 0.0  # 0: greedy
    seed: int = 0  # worker i sends seed + i (the warm-up request: seed)


async def _level(client: BenchClient, prompts: list[list[str]], gen: int, temperature: float,
                 seed: int) -> list[Reply]:
    limits = httpx.Limits(max_connections=len(prompts) + 2, max_keepalive_connections=len(prompts) + 2)
    async with httpx.AsyncClient(timeout=client.timeout, limits=limits) as http:
        async def worker(texts: list[str], worker_seed: int) -> list[Reply]:
            out = []
            for t in texts:
                out.append(await client.achat(http, [{"role": "user", "content": t}], gen, cache_prompt=False,
                                              ignore_eos=True, seed=worker_seed, **sampling(temperature)))
            return out

        per = await asyncio.gather(*(worker(texts, seed + i) for i, texts in enumerate(prompts)))
    return [r for rs in per for r in rs]


def run_concurrency(client: BenchClient, cfg: ConcurrencyConfig, say: Callable[[str], None] = print,
                    tag: str = "conc") -> dict:
    builder = PromptBuilder(client.count_tokens, tag=tag, tolerance=cfg.tolerance)
    # one uncounted request first: the first level must not pay for a cold server
    first = builder.build(cfg.prompt_tokens)
    warm = client.chat([{"role": "user", "content": first.text}], cfg.gen, cache_prompt=False, ignore_eos=True,
                       seed=cfg.seed, **sampling(cfg.temperature))
    check_uncached(warm, "concurrency warm-up")
    offset = (warm.prompt_tokens - first.tokens) if warm.prompt_tokens is not None else 0
    props = client.props()
    levels = []
    for w in cfg.workers:
        prompts = [[builder.build(cfg.prompt_tokens, offset=offset).text for _ in range(cfg.requests_per_worker)]
                   for _ in range(w)]
        before = client.metrics()
        replies = asyncio.run(_level(client, prompts, cfg.gen, cfg.temperature, cfg.seed))
        after = client.metrics()
        lv = _summarise(w, replies, before, after)
        lv["seeds"] = [cfg.seed + i for i in range(w)]
        if lv["cached_requests"]:
            raise StrataError(f"concurrency {w}: the engine reused cached prompt tokens in {lv['cached_requests']} "
                              "requests despite unique first lines and cache_prompt false")
        levels.append(lv)
        say(f"concurrency {w}: {lv['aggregate_tok_s']:.1f} tok/s aggregate | latency p50 {lv['latency_s']['p50']:.2f} "
            f"p90 {lv['latency_s']['p90']:.2f} s | TTFT p50 {lv['ttft_s']['p50']:.3f} s | errors {lv['errors']}")
    return {"config": {"workers": list(cfg.workers), "prompt_tokens": cfg.prompt_tokens, "gen": cfg.gen,
                       "requests_per_worker": cfg.requests_per_worker, "cache_prompt": False,
                       "temperature": cfg.temperature, "seed": cfg.seed},
            "server_slots": props.get("total_slots"), "levels": levels}


def _summarise(workers: int, replies: list[Reply], before, after) -> dict:
    ok = [r for r in replies if not r.error and (r.completion_tokens or 0) > 0]
    errors = [r.error or "no tokens" for r in replies if r not in ok]
    cached = [r.cached_tokens for r in ok if r.cached_tokens]
    t0 = min(r.t_sent for r in replies)
    t1 = max(r.t_done for r in replies)
    wall = t1 - t0
    tokens = sum(r.completion_tokens or 0 for r in ok)
    return {"workers": workers, "requests": len(replies), "ok": len(ok), "errors": len(errors),
            "error_messages": sorted(set(errors))[:5], "wall_s": wall, "generated_tokens": tokens,
            "aggregate_tok_s": tokens / wall if wall > 0 else 0.0,
            "latency_s": latency([r.wall_s for r in ok]),
            "ttft_s": latency([r.ttft_s for r in ok if r.ttft_s is not None]),
            "decode_tok_s_per_request": latency([r.decode_tok_s for r in ok if r.decode_tok_s]),
            "cached_requests": len(cached), "experts": expert_delta(before, after)}
