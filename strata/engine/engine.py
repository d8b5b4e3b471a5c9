"""The engine: sequences in KV slots, one forward per step mixing a prefill chunk with batched decodes.

`step()` = schedule -> run -> postprocess. A step takes at most one prefill chunk (`prefill_chunk` tokens of the
sequences still reading their prompts, in arrival order) plus one token of every sequence that is generating,
flattened into one forward; each segment's last logits are sampled. Continuous batching falls out: sequences join and leave
between steps. Greedy output of a sequence does not depend on what it is batched with (attention runs per
segment; every other op is row-wise).
"""

from __future__ import annotations

import logging
import time
from typing import Iterator

import torch

from strata import StrataError
from strata.engine.ahead import Ahead
from strata.engine.draft_cost import DraftCost
from strata.engine.draw import draw
from strata.engine.loader import LoadedModel
from strata.engine.mtp import drafter_for
from strata.engine.request import Request
from strata.engine.sampler import SamplingParams, token_logprobs
from strata.engine.sequence import Sequence  # (the engine's sequence; callers import it from here too)
from strata.engine.slots import common_prefix as _common_prefix
from strata.engine.slots import compact
from strata.engine.spec_device import DeviceDrafts
from strata.engine.spec import accept, draft_for
from strata.engine.step_plan import StepPlan
from strata.experts.sizing import VramSplit, model_prefill_bytes, prefill_chunk_for, prefill_left
from strata.kv.window import new_kv_cache

log = logging.getLogger("strata")


class Engine:
    def __init__(self, lm: LoadedModel, n_slots: int | None = None, prefill_chunk: int | None = None):
        self.lm, self.model = lm, lm.model
        self.n_slots = n_slots or lm.cfg.n_slots
        self.max_ctx = lm.max_ctx
        self.device = self.model.device  # before _default_chunk, which reads it
        kv_types = getattr(lm.cfg, "kv_cache_types", (None, None))  # -ctk/-ctv (None: the plain cache)
        # (--kv-vram-tokens: a window of it in VRAM, the whole in host RAM; its page hits in kv_window_stats)
        self.kv = new_kv_cache(self.model, self.n_slots, self.max_ctx, lm.cfg, lm.cfg.torch_kv_dtype, *kv_types)
        self.kv_window_stats = self.kv.stats if self.kv.eager_only else None
        # recurrent layers' state per slot (strata.kv.recurrent), None for a model of attention layers only. Such a
        # slot holds the state after its last token and nothing before it: a cached prefix is reused only when it
        # is the slot's whole content as of its release (_state_tokens), and a verify step keeps the state after
        # each token, of which the engine keeps the one after the tokens that stand (_verified)
        self.recurrent = self.kv.recurrent
        self._state_tokens: dict[int, tuple[int, ...]] = {}  # slot -> the tokens its state absorbed, when freed
        self._state_bad: set[int] = set()  # slots whose state a failed forward left half-advanced
        cfg = lm.cfg
        if self.recurrent is not None and self.device.type == "cuda" and not self.kv.eager_only \
                and getattr(cfg, "decode_ahead", True) \
                and getattr(cfg, "cuda_graphs", None) is not False and not (
                    getattr(cfg, "draft_max", 0) and getattr(cfg, "draft_source", "auto") != "ngram"):
            self.recurrent.reserve_saved()  # (steps launched ahead copy the states aside: in the KV's VRAM share)
        experts = self.model.experts  # an ExpertsBackend (strata.experts.backend), None for a dense model
        self.expert_stats = experts.stats if experts is not None else None  # cumulative counts, None: none kept
        chunk = prefill_chunk or lm.cfg.prefill_chunk
        # how the VRAM budget was divided (None: no budget was divided); .as_dict() for /props and /metrics
        self.vram_split: VramSplit | None = None
        if experts is not None and experts.sizes_cache:
            # size the expert cache from what is left after the KV cache and a prefill chunk
            act = 0
            cuda = self.device.type == "cuda"
            if cuda:  # room for a large chunk: each chunk streams the uncached experts once
                bpt = model_prefill_bytes(lm.args)
                chunk = chunk or prefill_chunk_for(self._vram_left(), bpt)
                act = chunk * bpt
            split = experts.setup(lm.args.n_experts_used, act)
            if split is not None:
                # on a CPU the KV cache and the weights are in RAM: the budget sizes the cache alone
                self.vram_split = split.itemized(self.kv.nbytes if cuda else 0, chunk if cuda else 0)
                log.info("strata: %s", self.vram_split.render())
        self.prefill_chunk = chunk or self._default_chunk()
        self.draft_max = getattr(cfg, "draft_max", 0)
        self.draft_ngram = (getattr(cfg, "draft_ngram_min", 2), getattr(cfg, "draft_ngram_max", 4))
        # what a step of T tokens of one sequence costs here, so drafts are made only where they pay
        # (strata.engine.draft_cost; None: the drafters' own lengths)
        self.draft_cost: DraftCost | None = DraftCost()
        self.mtp = drafter_for(self, getattr(cfg, "draft_source", "auto"))  # (strata.engine.mtp)
        self._hidden: torch.Tensor | None = None  # the last eager step's hidden states (MTP drafts read them)
        self.free_slots = list(range(self.n_slots))
        self.running: list[Sequence] = []
        self.failed: list[Sequence] = []  # failed in their own part of a step (take_failed), still in `running`
        self.slot_tokens: dict[int, list[int]] = {s: [] for s in range(self.n_slots)}  # what each slot's KV holds
        self.graphs = None
        # Decode steps replay captured graphs, by default on CUDA: eager steps launch thousands of small kernels
        # from Python and are host-bound. With several slots a graphed step decodes a batch of sequences (up to
        # the grouped kernel's pair count), captured once per set of slots and attention window.
        graphs = lm.cfg.cuda_graphs if lm.cfg.cuda_graphs is not None else self.device.type == "cuda"
        graphs = graphs and not self.kv.eager_only  # (a KV window's page tables are host values)
        self.graph_batch = 1
        graph_tokens = 1  # tokens one graphed step may carry (a verify step's drafts included)
        if graphs:
            from strata.experts.resident import DECODE_PAIRS

            k = max(1, lm.args.n_experts_used or 1)
            graph_tokens = max(1, experts.max_graph_batch(k) if experts is not None else DECODE_PAIRS // k)
            self.graph_batch = max(1, min(self.n_slots, graph_tokens))
            if self.recurrent is not None:  # (a verify step keeps each token's recurrent state: eager)
                graph_tokens = self.graph_batch
        if graphs:
            from strata.engine.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self.model, self.kv, slot=0, max_batch=self.graph_batch,
                                       max_tokens=graph_tokens)
            self.graphs.want_hidden = self.mtp is not None  # every step feeds the MTP block the trunk's states
        self.ahead = Ahead(self) if Ahead.usable(self) else None  # decode steps launched one ahead (ahead.py)
        # one greedy sequence's whole MTP-drafted step on the device (spec_device.py)
        self.device_drafts = DeviceDrafts(self, self.draft_max) if DeviceDrafts.usable(self) else None

    def _vram_left(self) -> int:
        """Bytes of VRAM the prefill chunk and the expert cache share: free VRAM (or --vram-gb less what the device
        holds now), less the reserve."""
        ex = self.lm.cfg.experts
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total if ex.vram_gb is None else min(total, int(ex.vram_gb * (1 << 30)))
        return prefill_left(budget, total - free, ex.vram_reserve_mib * (1 << 20))

    def _default_chunk(self) -> int:
        # Largest transient per chunk is the attention score block [H, chunk, ctx] in float32; give it a budget
        # (a quarter of free VRAM on GPU, 256 MiB on CPU) so a long prompt never builds one giant activation.
        a = self.lm.args
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = max(free // 4, 256 << 20)
        else:
            budget = 256 << 20
        per_token = a.n_heads * self.max_ctx * 4 + a.d_model * 64
        return int(max(16, min(4096, budget // per_token)))

    # -- admission ---------------------------------------------------------------------------------------------
    def check_fits(self, n_prompt: int, max_tokens: int) -> None:
        if n_prompt == 0:
            raise StrataError("the prompt is empty")
        if n_prompt + max_tokens > self.max_ctx:
            raise StrataError(
                f"prompt of {n_prompt} tokens + max_tokens {max_tokens} exceeds the context of {self.max_ctx} tokens"
            )

    def add(self, seq: Sequence, reuse_prefix: bool = True) -> None:
        """Place a sequence in a free slot, reusing the longest KV prefix a free slot already holds."""
        self.check_fits(len(seq.prompt), seq.max_tokens)
        if not self.free_slots:
            raise StrataError("no free slot")
        if not self.running and self.model.experts is not None:
            self.model.experts.at_rest()  # nothing decoding: a decided path change may be taken
        best, best_n = self.free_slots[0], 0
        if reuse_prefix:
            for s in self.free_slots:
                n = _common_prefix(self.slot_tokens[s], seq.prompt)
                if n > best_n and (self.recurrent is None or self._state_reusable(s, n, len(seq.prompt))):
                    best, best_n = s, n
        self.free_slots.remove(best)
        self._state_tokens.pop(best, None)
        self._state_bad.discard(best)
        seq.slot = best
        # keep at least the last prompt token to compute: its logits start generation
        seq.cached = min(best_n, len(seq.prompt) - 1)
        seq.pos = seq.cached
        self.slot_tokens[best] = self.slot_tokens[best][: seq.cached]
        seq.params.validate()
        if not seq.params.greedy:
            seq.sample_seed = seq.params.seed if seq.params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        seq.t_start = time.perf_counter()
        self.running.append(seq)

    def _state_reusable(self, slot: int, n: int, n_prompt: int) -> bool:
        """A recurrent slot's state serves a prompt sharing n tokens with the slot when those are all the slot
        absorbed (its state is at their end), the prompt goes on past them, and nothing but this engine's steps
        (a conversation cache restoring KV rows, say) has changed the slot since it was freed."""
        held = self.slot_tokens[slot]
        return n == len(held) < n_prompt and self._state_tokens.get(slot) == tuple(held)

    def reusable_prefix(self, slot: int, prompt: list[int]) -> int:
        """Tokens of `prompt` a free slot's content serves (a recurrent slot: all it holds, or none)."""
        n = _common_prefix(self.slot_tokens[slot], prompt)
        return n if self.recurrent is None or self._state_reusable(slot, n, len(prompt)) else 0

    def slot_state(self, slot: int) -> dict | None:
        """A free slot's recurrent state, copied to the host, when it is the state after the slot's whole content
        (the conversation cache keeps it beside the KV rows); None otherwise, or for a model without one."""
        if self.recurrent is None or self._state_tokens.get(slot) != tuple(self.slot_tokens[slot]):
            return None
        snap = self.recurrent.snapshot([slot], host=True)
        return {k: snap[k] for k in ("conv", "ssm")}

    def load_slot(self, slot: int, tokens: list[int], state: dict | None = None) -> None:
        """A free slot now holds `tokens` (their KV rows written by the caller) and, for a recurrent model, the
        state after them (`slot_state`'s; None: no usable state, so no prefix of the slot is reused)."""
        self.slot_tokens[slot] = list(tokens)
        if self.recurrent is None:
            return
        if state is None:
            self._state_tokens.pop(slot, None)
            return
        self.recurrent.restore({"slots": [slot], **state})
        self._state_tokens[slot] = tuple(tokens)
        self._state_bad.discard(slot)

    def release(self, seq: Sequence, reason: str | None = None) -> None:
        if reason and not seq.finished:
            seq.finished, seq.finish_reason = True, reason
        if seq.experts_at_first is not None and seq.experts_decode is None:
            seq.experts_decode = self.expert_stats - seq.experts_at_first
        if self.mtp is not None:
            self.mtp.forget(seq)
        if seq in self.running:
            if self.ahead is not None:  # (a step in flight may hold its unread token: strata.engine.ahead)
                self.ahead.released(seq)
            self.running.remove(seq)
            self.free_slots.append(seq.slot)
            if self.recurrent is not None and seq.slot not in self._state_bad:
                self._state_tokens[seq.slot] = tuple(self.slot_tokens[seq.slot])

    # -- one step ----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[tuple[Sequence, int]]:
        """Run one forward; returns (sequence, new token) for every token produced (a verify step of speculative
        decoding gives a sequence several)."""
        if self.ahead is not None and self.ahead.pending is not None:
            return self.ahead.collect()  # the step launched ahead (it may launch the next one)
        if self.device_drafts is not None and (done := self.device_drafts.step()) is not None:
            return done
        if not self.running:
            return []
        t0 = time.perf_counter()
        captures = self.graphs.captures if self.graphs is not None else 0
        plan = self._schedule()
        logits = self._run(plan)
        if logits is None:  # out of memory (a prefill chunk: smaller chunks; a decode step: the lent VRAM back)
            return self.step()
        picks = self._draw(plan, logits)
        if self.ahead is not None and picks:
            self.ahead.after_draw(plan, picks)  # the next step queued before this one's tokens are read
        out = self._postprocess(picks, self._logprobs(picks, logits)) if picks else []
        if self.draft_cost is not None and plan.prefill is None and len(plan.segs) == 1 \
                and (self.graphs is None or self.graphs.captures == captures):  # (a capture's time: no sample)
            self.draft_cost.record(plan.segs[0].n, (time.perf_counter() - t0) * 1e3)
        if self.mtp is not None and self._hidden is not None:  # the MTP block reads what this step settled
            at = 0
            for s, seg in zip(plan.owners, plan.segs):
                if not s.finished:
                    self.mtp.observe(s, self._hidden[at:at + seg.n], seg.start)
                at += seg.n
        return out

    def _schedule(self) -> "StepPlan":
        """One prefill chunk, then one token (with its drafts, if any) of every generating sequence. The chunk's
        `prefill_chunk` tokens are filled from the prompts waiting, in arrival order (a prompt's next piece each):
        prompts that arrive together share one chunk, so a budgeted model streams each missed expert once for all
        of them, not once per prompt."""
        plan = StepPlan()
        room = self.prefill_chunk
        for pf in self.running:
            if room <= 0:
                break
            if pf.prompt_done:
                continue
            n = min(room, len(pf.prompt) - pf.pos)
            plan.prefill = plan.prefill or pf
            plan.add(pf, pf.pos, pf.prompt[pf.pos : pf.pos + n])
            room -= n
        for s in self.running:
            if s.prompt_done and not s.finished:
                d = self._draft(s) if self.draft_max or s.draft_max else []
                if d:
                    plan.drafts[s.id] = d
                plan.add(s, s.pos, [s.output[-1], *d])
        if plan.drafts:  # logits of every position of a verify segment, of the last of any other
            plan.rows, at = [], 0
            for s, seg in zip(plan.owners, plan.segs):
                plan.rows += range(at, at + seg.n) if s.id in plan.drafts else [at + seg.n - 1]
                at += seg.n
        return plan

    def _run(self, plan: "StepPlan") -> torch.Tensor | None:
        """The step's forward: replayed graphs for plain decode steps, else eager. None after running out of memory
        in a prefill chunk (the chunk was halved: KV rows are simply rewritten)."""
        if self.recurrent is not None:
            self.recurrent.pending.clear()
            self.recurrent.track = {s.slot for s in plan.owners if s.id in plan.drafts}
        try:
            return self._forward(plan)
        except BaseException:
            self._state_bad.update(seg.slot for seg in plan.segs)  # (only read for a model with recurrent state)
            raise
        finally:
            if self.recurrent is not None:
                self.recurrent.track = set()

    def _forward(self, plan: "StepPlan") -> torch.Tensor | None:
        segs, toks, poss = plan.segs, plan.toks, plan.poss
        T = segs[0].n if segs else 0  # a verify step is graphed when every sequence verifies as many tokens
        if self.graphs is not None and plan.prefill is None and 0 < len(segs) <= self.graph_batch \
                and all(seg.n == T for seg in segs) and len(toks) <= self.graphs.max_tokens \
                and (T == 1 or self.graphs.verify) \
                and (not plan.drafts or max(seg.end for seg in segs) <= self.max_ctx):
            if self.n_slots > 1:  # the sequences moved into slots 0 .. b-1, in slot order: one capture per b
                compact(self, plan)  # (the plan's owners and segments reordered alike: logits rows follow)
                segs, toks, poss = plan.segs, plan.toks, plan.poss
            slots = [seg.slot for seg in segs]
            starts = [seg.start for seg in segs]
            try:  # [B, V], or a verify step's [B * T, V] (its rows: every position), from replayed graphs
                out = self.graphs.step_batch(toks, starts, slots, T)
                self._hidden, plan.graphed = self.graphs.last_hidden, True
                return out
            except Exception as e:  # a model whose step cannot be captured still runs, eagerly
                if isinstance(e, torch.OutOfMemoryError) and not self.graphs.captured(starts, slots, T):
                    # no room for this capture beside the others: this step runs eagerly, the captures stay
                    torch.cuda.empty_cache()
                elif self.graphs.cuda and T > 1 and not self.graphs.captured(starts, slots, T):
                    log.warning("strata: capturing a verify step failed (%s: %s); verify steps run eagerly",
                                type(e).__name__, e)
                    self.graphs.verify = False  # (decode steps keep their graphs)
                elif self.graphs.cuda and not self.graphs.captured(starts, slots, T):
                    log.warning("strata: CUDA graph capture failed (%s: %s); decoding without graphs",
                                type(e).__name__, e)
                    self.graphs = None
                else:
                    raise
        t = torch.tensor(toks, device=self.device)
        p = torch.tensor(poss, device=self.device)
        phase = "decode" if plan.prefill is None else "prefill" if all(not s.prompt_done for s in plan.owners) \
            else "mixed"
        ctx = self.model.step_context(segs, len(toks), phase=phase, graphs=self.graphs is not None)
        # a prefill chunk out of memory runs again in smaller chunks: a recurrent state is put back first (its layers
        # before the failure folded the chunk in); the copy in host memory (the lent VRAM is not borrowed back yet)
        snap = None
        if self.recurrent is not None and plan.prefill is not None and self.prefill_chunk > 256:
            snap = self.recurrent.snapshot([seg.slot for seg in segs], host=True)
        hidden = [] if self.mtp is not None else None
        try:
            logits = self.model.forward(t, p, segs, self.kv, rows=plan.rows, ctx=ctx, hidden_out=hidden)
            self._hidden = hidden[0] if hidden else None
            return logits  # [len(segs) or len(rows), V]
        except torch.OutOfMemoryError:
            self._out_of_memory(plan.prefill)
            if snap is not None:
                self.recurrent.restore(snap)
            return None

    def _draw(self, plan: "StepPlan", logits: torch.Tensor) -> list:
        return draw(self, plan, logits)  # (strata.engine.draw)

    def take_failed(self) -> list[Sequence]:
        """The sequences that failed in their own part of the last steps (finish_reason "error", `error` says why);
        the caller releases them."""
        out, self.failed = self.failed, []
        return out

    def _logprobs(self, picks: list, logits: torch.Tensor) -> dict[int, list[float]] | None:
        """For the sequences that asked (they draw one row, never drafts): {sequence id: [lp, top values, top
        ids]}, read in one go; None when none asked (no work, no extra read)."""
        asked = [(s, drawn[0], row) for s, d, _, drawn, row in picks if s.logprobs is not None and not d]
        if not asked:
            return None
        got = token_logprobs([logits[i] for *_, i in asked], [t for _, t, _ in asked], [s.logprobs for s, *_ in asked])
        flat = torch.cat(got).tolist()
        out, at = {}, 0
        for (s, *_), g in zip(asked, got):
            out[s.id], at = flat[at:at + g.numel()], at + g.numel()
        return out

    def _postprocess(self, picks: list, lps: dict[int, list[float]] | None = None,
                     values: list[int] | None = None) -> list[tuple[Sequence, int]]:
        if values is None:  # (a step launched ahead has read its tokens already)
            values = torch.stack([x for p in picks for x in p[3]]).tolist()  # the one host read per step
        now = time.perf_counter()
        out = []
        v = 0
        for s, d, seg_toks, drawn, _ in picks:
            got, v = values[v:v + len(drawn)], v + len(drawn)
            if d:
                got = self._verified(s, d, seg_toks, got)
            for tok in got:
                if not s.output:
                    s.prompt_ms = (now - s.t_start) * 1e3
                    s.t_first = now
                    if self.expert_stats is not None:  # the prefill's counts are in; decode's start now
                        s.experts_at_first = self.expert_stats.snapshot()
                else:
                    s.predicted_ms = (now - s.t_first) * 1e3
                s.output.append(tok)
                if lps is not None and s.id in lps:
                    f, k = lps[s.id], s.logprobs
                    s.token_logprobs.append((f[0], [(int(i), lp) for lp, i in zip(f[1:1 + k], f[1 + k:])]))
                out.append((s, tok))
                if tok in s.stop_ids:
                    s.finished, s.finish_reason = True, "stop"
                # (the context's end by the tokens taken so far: a verify step advanced s.pos past all it keeps)
                elif len(s.output) >= s.max_tokens or len(s.prompt) + len(s.output) >= self.max_ctx:
                    s.finished, s.finish_reason = True, "length"
                if s.finished:
                    self.release(s)
                    break
        return out

    def _verified(self, s: Sequence, d: list[int], seg_toks: list[int], got: list[int]) -> list[int]:
        """A verify segment's outcome: the drafts that equal the drawn tokens stand, then the first drawn token that
        differs (or the bonus token after them all). Advances the sequence by what stands; returns its new tokens."""
        a = accept(d, got)
        s.draft_acc.add(len(d), a)
        s.draft_steps += 1
        s.draft_n += len(d)
        s.draft_accepted += a
        if self.draft_cost is not None and self.draft_cost.line() is not None:
            # steps timed: the costs and each depth's acceptance choose the length (strata.engine.draft_cost), not
            # the rule below, which cut a chain to one draft after its first failed even where two pay
            s.draft_len = 0
        else:
            # the next draft's length follows the runs that stand: doubled while every draft stands, else one past
            # this run (a verify token costs compute and, on a budget, its experts' reads)
            limit = self.draft_max if s.draft_max is None else s.draft_max
            cur = s.draft_len or limit
            s.draft_len = min(limit, max(cur, 2 * len(d))) if a == len(d) else a + 1
        # none stood: pause drafting for 1, 2, 4 ... 64 steps; text that does not repeat its context keeps finding
        # short n-grams whose continuations fail
        s.draft_backoff = min(64, max(1, 2 * s.draft_backoff)) if a == 0 else 0
        s.draft_pause = s.draft_backoff
        s.pos += a + 1  # the KV rows of rejected drafts are stale: later steps overwrite them
        if self.recurrent is not None:  # a recurrent state is not overwritten: take it back to what stands
            self.recurrent.keep(s.slot, a + 1)
        self.slot_tokens[s.slot] += seg_toks[:a + 1]
        return got[:a + 1]

    def _draft(self, s: Sequence) -> list[int]:
        return draft_for(self, s)  # (strata.engine.spec)

    def _out_of_memory(self, prefill) -> None:
        """The device ran out within its budget. A prefill chunk's activations are the one large, elastic part:
        halve the chunk (down to 256 tokens) and go on; anything else is one clear error."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        budget = getattr(getattr(self.lm.cfg, "experts", None), "vram_gb", None)
        where = f"within --vram-gb {budget:g}" if budget is not None else "on the GPU"
        if prefill is not None and self.prefill_chunk > 256:
            self.prefill_chunk //= 2
            log.warning("strata: out of memory %s during a prefill chunk: chunks of %d tokens from now on "
                        "(--prefill-chunk sets it)", where, self.prefill_chunk)
            return
        # a decode step beside the prompt activations' VRAM lent to the cache: that VRAM back, the step again (not
        # with recurrent layers: those before the failure folded the step's tokens in)
        if prefill is None and self.recurrent is None and getattr(self.model.experts, "give_back_loan", bool)():
            log.warning("strata: out of memory %s in a decode step: the prompt activations' VRAM lent to the expert "
                        "cache goes back to the device from now on (--prefill-loan off: from the start)", where)
            return
        raise StrataError(f"out of memory {where}: lower --ctx-size, --parallel or --prefill-chunk, or raise the "
                          "budget (--vram-gb / --vram-reserve-mib)")

    # -- convenience -------------------------------------------------------------------------------------------
    def generate(self, prompt: list[int], params: SamplingParams | None = None, max_tokens: int = 256,
                 stop_ids: set[int] | None = None) -> Iterator[int]:
        """Generate for one prompt (alone in the engine), yielding token ids as they come."""
        seq = Sequence.of(Request(prompt, params or SamplingParams(), max_tokens, set(stop_ids or ())))
        # set before the first token: a caller that stops iterating early (at the end of a turn) closes the
        # generator, and code after the loop would never run
        self.last = seq
        self.add(seq)
        try:
            while not seq.finished:
                for s, tok in self.step():
                    if s is seq:
                        yield tok
            self.take_failed()
            if seq.error is not None:
                raise StrataError(f"generation failed: {seq.error}")
        finally:
            self.release(seq, "abort")

