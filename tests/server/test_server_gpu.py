"""The server on a CUDA device, where single-sequence decode replays CUDA graphs (on by default): a real server
on loopback, the official client, answers equal to the same server decoding eagerly."""

from __future__ import annotations

import openai
import pytest
import torch

from .conftest import CTX, serve

MSG = [{"role": "user", "content": "What is the weather in Paris?"}]


def _lm(path, graphs: bool, **ex):
    from strata.config import EngineConfig, ExpertConfig
    from strata.engine.loader import load_model

    cfg = EngineConfig(model=str(path), device="cuda", dtype="float32", ctx_size=CTX, cuda_graphs=graphs,
                       experts=ExpertConfig(**ex))
    return load_model(str(path), cfg)


def _answers(lm) -> list[str]:
    with serve(lm, parallel=1) as r:
        oai = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
        out = []
        for n in (5, 40):  # 40 tokens cross no window; several requests reuse the captured graphs
            c = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=n, temperature=0, seed=1)
            out.append(c.choices[0].message.content)
        stream = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=12, temperature=0, stream=True)
        out.append("".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices))
        # log-probabilities are drawn from the replayed graphs' logits too
        lp = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=8, temperature=0, logprobs=True,
                                         top_logprobs=3).choices[0].logprobs.content
        out.append([(e.token, round(e.logprob, 3), [t.token for t in e.top_logprobs]) for e in lp])
        return out


@pytest.mark.gpu
@pytest.mark.parametrize("experts", [dict(mode="resident"), dict(mode="tiered", slots=2, cpu_plan="auto")])
def test_graphed_server_answers_like_eager(tiny_gguf, experts):
    assert torch.cuda.is_available()
    eager = _answers(_lm(tiny_gguf, False, **experts))
    graphed_lm = _lm(tiny_gguf, True, **experts)
    graphed = _answers(graphed_lm)
    assert graphed == eager and all(graphed) and len(graphed[-1]) == 8


def _parallel_answers(lm, n_clients: int = 4) -> tuple[list[str], list[str]]:
    """Greedy answers to distinct prompts, asked one at a time and then all at once, on a 4-slot server."""
    from concurrent.futures import ThreadPoolExecutor

    msgs = [[{"role": "user", "content": f"Tell me about the number {i}."}] for i in range(n_clients)]
    with serve(lm, parallel=n_clients) as r:
        oai = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)

        def ask(m):
            return oai.chat.completions.create(model="tiny", messages=m, max_tokens=24, temperature=0,
                                               extra_body={"ignore_eos": True}).choices[0].message.content

        alone = [ask(m) for m in msgs]
        with ThreadPoolExecutor(n_clients) as pool:
            together = list(pool.map(ask, msgs))
        engine = r.state.server.worker.engine
        assert engine.graphs is not None and engine.graph_batch == n_clients  # on by default with --parallel
        batched = [k for k in engine.graphs.graphs if len(k[0]) > 1]
        assert batched, "four clients at once never shared a graphed step"
    return alone, together


@pytest.mark.gpu
@pytest.mark.parametrize("experts", [dict(mode="resident"), dict(mode="tiered", slots=2, cpu_plan="auto")])
def test_parallel_slots_decode_in_one_graphed_step(tiny_gguf, experts):
    """--parallel 4 decodes its sequences together in replayed graphs (the default on CUDA): the answers equal
    the same prompts asked one at a time."""
    assert torch.cuda.is_available()
    alone, together = _parallel_answers(_lm(tiny_gguf, None, **experts))
    assert together == alone and all(alone)
