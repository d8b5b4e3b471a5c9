"""A request as the server runs it: the engine's `Request` plus what the output pipeline needs, and the helpers
that turn a body's fields into its parts.

Adding an API field that the engine reads: declare it in protocol.py, give it a field of
strata.engine.request.Request, and set it where the API module builds the Job. The engine worker builds the
`Sequence` from the Job's Request fields by one generated copy (`Sequence.of`); nothing else changes.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Callable

from strata import StrataError
from strata.engine.request import Request
from strata.engine.sampler import SamplingParams
from strata.server.protocol import bad_request


@dataclass
class Job(Request):
    """An engine Request (prompt, params, max_tokens, stop_ids, draft_max, logprobs, ...) and, below, what only the
    server reads: its output pipeline (stop strings, reasoning, tool calls), the grammar, admission and metrics."""

    stop: list[str] = dataclasses.field(default_factory=list)
    logit_bias: dict | None = None
    grammar: str | None = None  # llguidance grammar (already compiled from lark / GBNF / JSON schema)
    grammar_what: str = "the output grammar"  # how a grammar error names it
    reasoning: bool = False  # split <think> blocks
    in_reasoning: bool = False  # the prompt already opened one
    tools: list[dict] | None = None  # parse tool calls against these (None: no parsing)
    forced: bool = False  # `grammar` forces tool calls: every character of the output is call markup
    # at most one tool call (OpenAI's parallel_tool_calls false, Anthropic's disable_parallel_tool_use): the
    # generation ends with the first call, as llama.cpp's call grammar ends it
    one_call: bool = False
    cache_prompt: bool = True  # reuse a slot's (or the prompt cache's) KV prefix
    kind: str = "chat"  # chat | completion (metrics)
    choice: int = 0  # which of the request's n choices (metrics count a request and its prompt at choice 0 only)
    # set by Server.finish_job: built (and the grammar checked) before any output; called on the engine thread
    # at admission with the new Sequence, returns its logits processor (or None)
    make_processor: Callable | None = None

    def copies(self, n: int) -> list["Job"]:
        """The request's n choices: the same job, each choice with its own seed (seed + index) when it has one, so
        that seeded choices differ from one another and repeat from one request to the next."""
        out = [self]
        for i in range(1, n):
            seed = self.params.seed
            if seed is not None:
                seed = (seed + i) % 2**64 if seed >= 0 else seed + i  # stays within what torch.Generator takes
            out.append(dataclasses.replace(self, params=dataclasses.replace(self.params, seed=seed), choice=i))
        return out


def sampling(body, defaults: SamplingParams | None = None) -> SamplingParams:
    d = defaults or SamplingParams()
    g = lambda name, default: default if getattr(body, name, None) is None else getattr(body, name)  # noqa: E731
    rep = getattr(body, "repetition_penalty", None) or getattr(body, "repeat_penalty", None) or d.repetition_penalty
    p = SamplingParams(temperature=float(g("temperature", d.temperature)), top_k=int(g("top_k", d.top_k)),
                       top_p=float(g("top_p", d.top_p)), min_p=float(g("min_p", d.min_p)),
                       repetition_penalty=float(rep),
                       presence_penalty=float(g("presence_penalty", d.presence_penalty)),
                       frequency_penalty=float(g("frequency_penalty", d.frequency_penalty)), seed=g("seed", d.seed))
    try:
        p.validate()
    except StrataError as e:
        raise bad_request(str(e)) from None
    return p


def stop_list(stop) -> list[str]:
    if stop is None:
        return []
    out = [stop] if isinstance(stop, str) else list(stop)
    if len(out) > 16:
        raise bad_request("stop: at most 16 stop sequences")
    return [s for s in out if s]


def parse_arguments(args) -> dict:
    """Tool-call arguments as a dict; a 400 unless they are a JSON object (strata.server.template_inputs decides
    whether the chat template gets this dict or the client's string)."""
    if isinstance(args, dict):
        return args
    try:
        v = json.loads(args) if args else {}
    except ValueError:
        raise bad_request("tool_calls: function.arguments must be a JSON object") from None
    if not isinstance(v, dict):
        raise bad_request("tool_calls: function.arguments must be a JSON object")
    return v
