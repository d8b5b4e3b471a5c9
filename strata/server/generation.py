"""What both APIs share: chat messages -> prompt tokens, constraints -> a Job's logits processor, and the output
pipeline (tokens -> text -> stop strings -> reasoning / answer -> tool calls) as a stream of events.

Events: ("reasoning", text), ("content", text), ("tool_call", ParsedCall), ("done", Result), and with
`Job.logprobs` set, ("logprobs", entry, offset) for each generated token, before the text it decodes to (which may
be held back: a stop string or a tool-call marker is decided by later tokens). `offset` is how many characters the
tokens before it decoded to: where the token's text starts in the output, or for bytes of a character that later
tokens complete, where that character starts.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from strata.engine.sampler import SamplingParams
from strata.server.grammar import bias_processor, chain, constrained_available
from strata.server.job import Job
from strata.server.protocol import APIError, bad_request
from strata.reasoning import HarmonySplitter, ReasoningSplitter, RunEnd, partial_suffix, uses_harmony
from strata.server.template_inputs import needs_short_ids, new_short_id, shorten_ids, variants
from strata.server.toolcalls import closed, tool_grammar, tool_stream
from strata.server.worker import Ticket


@dataclass
class Result:
    finish_reason: str  # stop | length | tool_calls | abort
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    timings: dict
    stop_word: str | None = None


class GenerationError(Exception):
    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status  # 503: the server is shutting down (worth a retry elsewhere); 500: it failed


# How often (seconds of wall time) a non-streaming request asks whether its client is still there: a client that
# hung up frees its slot within this, however fast tokens come
HANGUP_CHECK_S = 0.25


class StopStrings:
    """Cuts the output at the first stop string, holding back text that may be the start of one."""

    def __init__(self, stops: list[str]):
        self.stops, self._buf, self.hit = stops, "", None

    def push(self, text: str) -> str:
        if not self.stops or self.hit:
            return "" if self.hit else text
        self._buf += text
        first = None
        for s in self.stops:
            i = self._buf.find(s)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, s)
        if first is not None:
            self.hit = first[1]
            out, self._buf = self._buf[: first[0]], ""
            return out
        keep = max(partial_suffix(self._buf, s) for s in self.stops)
        out, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return out

    def flush(self) -> str:
        out, self._buf = self._buf, ""
        return "" if self.hit else out


class Server:
    """The loaded model and its engine worker, as the API modules see them (set up in app.py)."""

    def __init__(self, lm, worker, metrics, grammars, tool_format: str, model_id: str, ctx: int,
                 defaults: SamplingParams | None = None, n_predict: int | None = None):
        self.lm, self.worker, self.metrics, self.grammars = lm, worker, metrics, grammars
        # a request's sampling and max_tokens where it sets none (`strata serve --temp/--seed/-n ...`)
        self.defaults, self.n_predict = defaults or SamplingParams(), n_predict
        self.tok, self.template = lm.tokenizer, lm.template
        self.tool_format, self.model_id, self.ctx = tool_format, model_id, ctx
        # gpt-oss's harmony messages carry the reasoning in the analysis channel, not in <think> tags
        self.splitter = HarmonySplitter if uses_harmony(lm.gguf.get("tokenizer.chat_template")) else ReasoningSplitter
        self.vocab_size = getattr(lm.args, "vocab_size", None) or self.tok.vocab_size
        # Mistral's templates take only 9-character tool-call ids: the server makes such ids, and maps the ids
        # clients send to 9 characters before rendering
        self.short_ids = needs_short_ids(getattr(self.template, "source", None))
        self.ping_s = 5.0  # (ServeConfig.ping_s)

    # -- prompts -------------------------------------------------------------------------------------------------
    def render(self, messages: list[dict], tools: list[dict] | None, enable_thinking: bool | None,
               continue_final: bool = False, generation_prompt: bool = True) -> str:
        """The prompt text. continue_final: the last (assistant) message is left open, so the reply continues it
        (a prefill); it takes no generation prompt."""
        if self.template is None:
            raise bad_request("this model has no chat template; use /v1/completions")
        if self.short_ids:
            messages = shorten_ids(messages)
        errors = []
        # the tool calls' content / arguments in the shape this template takes (strata.server.template_inputs)
        for msgs, null_content in variants(messages):
            try:
                return self.template.render(msgs, tools=tools or None,
                                            add_generation_prompt=generation_prompt and not continue_final,
                                            enable_thinking=enable_thinking, continue_final_message=continue_final,
                                            null_content=null_content)
            except APIError:
                raise
            except Exception as e:  # noqa: BLE001 - a template that rejects the conversation says why
                errors.append(e)
        # the reason given is the conventional input's (content "", arguments a dict: the one but last variant),
        # not an artefact of the other shapes tried
        e = errors[-2] if len(errors) > 1 else errors[0]
        raise bad_request(f"the chat template rejected the messages: {str(e)[:300]}") from None

    def encode_chat(self, text: str) -> list[int]:
        if hasattr(self.tok, "encode_prompt"):  # BOS as the GGUF says, unless the template wrote it
            return self.tok.encode_prompt(text)
        ids = self.tok.encode(text, add_special=False)
        if self.tok.add_bos and self.tok.bos_id is not None and (not ids or ids[0] != self.tok.bos_id):
            ids = [self.tok.bos_id] + ids
        return ids

    def check_size(self, text: str) -> None:
        """Refuse, before tokenizing it, a prompt that cannot fit the context whatever its tokens: tokenizing
        megabytes holds the interpreter for seconds, stalling every other client. A text of B bytes has at least
        B / (the longest token's bytes) tokens (strata.gguf.tokenizer.Tokenizer.max_token_bytes)."""
        longest = getattr(self.tok, "max_token_bytes", None)
        if not longest or len(text) < self.ctx:  # a text this short tokenizes fast: the exact check follows
            return
        n_bytes = len(text.encode("utf-8", errors="surrogatepass"))
        at_least = -(-n_bytes // longest)
        if at_least >= self.ctx:
            raise bad_request(f"the prompt of at least {at_least} tokens (a lower bound: {n_bytes} bytes, no token "
                              f"longer than {longest} bytes) does not fit the context of {self.ctx} tokens")

    def stop_ids(self, ignore_eos: bool = False) -> set[int]:
        """The tokens that end a generation: the model's end-of-turn tokens, or none with `ignore_eos`."""
        return set() if ignore_eos else set(self.tok.eot_ids)

    def max_tokens(self, n_prompt: int, asked: int | None) -> int:
        """The tokens a request may generate: what it asked for, up to what the context (each slot's: n choices
        run in n slots) leaves after the prompt, as llama.cpp does. A reply the context end cuts short ends with
        finish_reason "length"; clients ask for more than any context holds (Claude Code sends 32000). A prompt
        that leaves no room is refused: it is never cut."""
        if n_prompt == 0:
            raise bad_request("the prompt is empty")
        if n_prompt >= self.ctx:
            raise bad_request(f"the prompt of {n_prompt} tokens does not fit the context of {self.ctx} tokens")
        left = self.ctx - n_prompt
        return left if asked is None else min(asked, left)

    # -- constraints ---------------------------------------------------------------------------------------------
    def tool_call_grammar(self, tools: list[dict], only: str | None, parallel: bool, in_reasoning: bool = False
                          ) -> str | None:
        if not constrained_available():
            return None
        try:
            src = tool_grammar(self.tool_format, tools, only, self.grammars.literal, parallel)
        except RecursionError:
            raise bad_request("tools: a function's parameters schema is nested too deeply") from None
        if in_reasoning:  # the prompt opened a reasoning block: a forced call closes it first
            src = src.replace("start:", "call_start:", 1)
            src = f"start: {self.grammars.literal('</think>')} \"\\n\\n\" call_start\n" + src
        return self.grammars.lark(src)

    def gbnf_grammar(self, src: str) -> str:
        if not constrained_available():  # a grammar is a contract: unconstrained output would break it silently
            raise bad_request("grammar needs llguidance, which this server lacks (pip install llguidance)")
        return self.grammars.gbnf(src)

    def json_grammar(self, schema: dict | None, strict: bool) -> str | None:
        if not constrained_available():
            return None
        if schema is None:
            schema = {"type": "object"}
        try:
            return self.grammars.json_schema(closed(schema) if strict else schema)
        except RecursionError:
            raise bad_request("the JSON schema is nested too deeply") from None

    # -- running -------------------------------------------------------------------------------------------------
    def finish_job(self, job: Job) -> Job:
        job.make_processor = self._processor_factory(job)
        return job

    def _processor_factory(self, job: Job):
        if not job.logit_bias and not job.grammar:
            return None
        bias = bias_processor(job.logit_bias, self.vocab_size, self.worker.engine.device) if job.logit_bias else None
        proc = self.grammars.processor(job.grammar, job.grammar_what) if job.grammar else None  # 400 if bad

        def make(seq):
            return chain(bias, proc().bind(seq) if proc is not None else None)

        return make

    async def run(self, job: Job, request=None, idle_s: float | None = None):
        """Generate; yield events. Cancels the generation when the consumer stops early or the client leaves.
        With `idle_s`, also ("start", seq) once the job has its slot (seq.cached: the prompt tokens reused), and
        ("idle",) after each `idle_s` seconds without an event (a stream's keep-alive: a long prefill, a queue)."""
        req = self.worker.submit(job)
        dec = self.tok.stream_decoder()
        stops = StopStrings(job.stop)
        rs = self.splitter(job.reasoning, job.in_reasoning, calls=job.tools is not None)
        run_end = RunEnd()  # a reasoning run's trailing newlines, streamed or not (strata.reasoning.RunEnd)
        tc = tool_stream(self.tool_format, job.tools, enabled=job.tools is not None, forced=job.forced)
        hangup = _Hangup(request)
        n_calls = 0
        cut = False  # the one call allowed has come: the rest of the output is dropped
        n_tok = 0  # token events seen: the index of the next one in seq.output (and seq.token_logprobs)
        n_chars = 0  # characters decoded so far (the legacy API's text_offset of the next token)
        # the tokens of the reply: up to the one that matched a stop string (or ended the one call allowed). The
        # engine runs on until the cancel reaches it, and what it drew past that point is no part of the reply
        n_used = None
        done = False

        def pipeline(text: str, final: bool):
            nonlocal n_calls
            out = []
            text = stops.push(text)
            if final:
                text += stops.flush()
            r, c = rs.push(text)
            if final:
                r2, c2 = rs.flush()
                r, c = r + r2, c + c2
            r = run_end.reasoning(r) if r else r
            if r:
                out.append(("reasoning", r))
            if c:
                run_end.end()
            t, calls = tc.push(c)
            if final:
                t2, calls2 = tc.flush()
                t, calls = t + t2, calls + calls2
            if t:
                out.append(("content", t))
            if job.one_call:
                calls = calls[: 1 - n_calls] if n_calls < 1 else []
            for call in calls:
                if self.short_ids:
                    call.id = new_short_id()
                out.append(("tool_call", call))
            n_calls += len(calls)
            return out

        try:
            while True:
                ev = await self._next(req, hangup, idle_s)
                kind = ev[0]
                if kind in ("start", "idle"):
                    if idle_s is not None:
                        yield ev
                    continue
                if kind == "token":
                    k, n_tok = n_tok, n_tok + 1
                    if stops.hit or cut or ev[1] in job.stop_ids:
                        continue
                    if job.logprobs is not None and k < len(req.seq.token_logprobs):
                        yield ("logprobs", self.logprob_entry(ev[1], *req.seq.token_logprobs[k]), n_chars)
                    text = dec.put(ev[1])
                    n_chars += len(text)
                    for e in pipeline(text, False):
                        yield e
                    if job.one_call and n_calls:
                        cut = True  # what follows the one call is neither text nor another call
                    if stops.hit or cut:
                        n_used = n_tok
                        self.worker.cancel(req, "stop")
                    continue
                if kind == "error":
                    done = True
                    raise GenerationError(*ev[1:])
                # done
                done = True
                for e in pipeline(dec.flush(), True) if not cut else ():
                    yield e
                reason = "stop" if stops.hit else ev[1]
                if reason == "stop" and n_calls:
                    reason = "tool_calls"
                yield ("done", self._result(req, reason, stops.hit, n_used))
                return
        finally:
            if not done:
                self.worker.cancel(req, "abort")

    def _token(self, tid: int, lp: float) -> dict:
        b = self.tok.token_bytes(tid) if 0 <= tid < self.tok.vocab_size else b""
        # JSON has no -inf; OpenAI writes -9999.0 for a token that cannot be drawn
        return {"token": b.decode("utf-8", errors="replace"), "logprob": max(lp, -9999.0), "bytes": list(b)}

    def logprob_entry(self, tid: int, lp: float, top: list[tuple[int, float]]) -> dict:
        """OpenAI's chat entry: {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}."""
        return {**self._token(tid, lp), "top_logprobs": [self._token(i, v) for i, v in top]}

    async def _next(self, req: Ticket, hangup: "_Hangup", idle_s: float | None = None):
        if hangup.request is None and idle_s is None:
            return await req.events.get()
        due = None if idle_s is None else time.monotonic() + idle_s
        while True:  # a non-streaming client that hangs up frees its slot too
            # asked on the clock, not only when no event came: while tokens flow, a wait never times out
            if await hangup.gone():
                self.worker.cancel(req, "abort")
                raise GenerationError("client disconnected")
            wait = HANGUP_CHECK_S if hangup.request is not None else None
            if due is not None:
                left = due - time.monotonic()
                if left <= 0:
                    return ("idle",)
                wait = left if wait is None else min(wait, left)
            try:
                return await asyncio.wait_for(req.events.get(), wait)
            except asyncio.TimeoutError:
                continue

    def _result(self, req: Ticket, reason: str, stop_word: str | None, n_used: int | None = None) -> Result:
        seq = req.seq
        n_out = len(seq.output) if seq else 0
        if n_used is not None:
            n_out = min(n_out, n_used)
        prompt_n = seq.prompt_n if seq else len(req.job.prompt)
        p_ms, g_ms = (seq.prompt_ms, seq.predicted_ms) if seq else (0.0, 0.0)
        timings = {
            "prompt_n": prompt_n, "prompt_ms": p_ms,
            "prompt_per_token_ms": p_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n / (p_ms / 1e3) if p_ms else 0.0,
            "predicted_n": n_out, "predicted_ms": g_ms,
            # predicted_ms runs from the first token (sampled off the prompt) to the last: n - 1 decode steps
            "predicted_per_token_ms": g_ms / (n_out - 1) if n_out > 1 else 0.0,
            "predicted_per_second": (n_out - 1) / (g_ms / 1e3) if g_ms and n_out > 1 else 0.0,
            "cache_n": seq.cached if seq else 0, "draft_n": seq.draft_n if seq else 0,
            "draft_n_accepted": seq.draft_accepted if seq else 0,
            # where the drafts came from (strata.engine.spec.draft_for): the model's MTP block or n-gram lookup
            "draft_source": (("mtp" if self.worker.engine.mtp is not None else "ngram")
                             if seq and seq.draft_n else None),
        }
        ex = seq.experts_decode if seq else None
        if ex is not None:  # tiered experts: what the miss lanes moved while this request decoded, and how fast
            timings.update(experts_cpu_bytes=ex.cpu_bytes, experts_pcie_bytes=ex.pcie_bytes, **seq.lane_gbps)
        return Result(reason if reason != "stop" or not stop_word else "stop", len(req.job.prompt), n_out,
                      seq.cached if seq else 0, timings, stop_word)


class _Hangup:
    """Whether a non-streaming request's client has gone, asked at most every HANGUP_CHECK_S (asking costs a trip
    through the ASGI receive channel). A streaming response learns it from its failed writes instead."""

    def __init__(self, request):
        self.request = request
        self.due = time.monotonic() + HANGUP_CHECK_S

    async def gone(self) -> bool:
        if self.request is None or time.monotonic() < self.due:
            return False
        self.due = time.monotonic() + HANGUP_CHECK_S
        return await self.request.is_disconnected()
