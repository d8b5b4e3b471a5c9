"""Decode one step ahead: the next decode step is launched before the host reads this step's tokens.

A graphed decode step leaves the GPU idle while the host reads the sampled tokens, appends them, checks stops and
launches the next replay (a few hundred microseconds of Python per step, a sizeable share of a step when the
model is resident). Here, once a plain decode step's tokens are drawn (on the device), the next step is launched
at once with those tokens as its input (copied device to device into the graph's token buffer, its positions
advanced by one on the device) and its own tokens drawn; only then does the host wait for the first step's
tokens, handing the GPU the next step to run meanwhile. The following `Engine.step()` takes that step's tokens
(launching the one after it first, when it can), so a steady decode always has one step in flight.

A launched step is a guess that its sequences go on. One that stops at the token read next (a stop token, a
stop string found by the server, an abort) drops its ahead token: the token is never read, and the K/V row it
wrote, one past the sequence's end, is not in the slot's record (`Engine.slot_tokens`), so nothing reuses it.
The sampled draw is keyed by the drawn token's position (sampler.position_uniform), so seeded text is unchanged.

Taken only when nothing needs the host between the steps: every running sequence is decoding in the step (none
waits for its prompt), none asks for log-probabilities, a grammar or repetition penalties (whose window holds the
token not yet read), none may draft in the next step (n-gram drafts paused after failing, or paying at no length
at the sequence's acceptance: text that does not repeat its context then decodes at the plain speed), each has
room for two more tokens, the model has no MTP block (its drafts need the host each step), and no CPU/PCIe plan
is being tuned (the tuner fits each step's time to that step's misses, which a step in flight would blur).

A recurrent layer's state (gated delta-net) has no row to leave unread: the step ahead folds its input token into
the state in place. So before each launch the slots' states are copied aside on the device
(`RecurrentState.save`, one copy a step, in stream order), and a sequence that stops at the token read next takes
its state back from that copy when it is released (`Ahead.released`): the slot then holds the state after its
recorded content, which the conversation cache keeps and a follow-up prompt reuses.

An embedding table in host RAM is read by the graph itself from the token ids in device memory
(strata.ops.host_rows).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from strata.engine.sampler import sample
from strata.engine.spec import may_draft, pause_step

log = logging.getLogger("strata")


@dataclass
class _Pending:
    seqs: list  # the sequences, in the step's (slot) order
    drawn: list  # per sequence, its drawn token (0-d device tensor)
    host: torch.Tensor  # the drawn tokens, copied to host memory
    ready: object  # event after that copy (None on a CPU)
    restored: set  # slots whose recurrent state was put back (their sequence stopped before reading the step)


def _plain(s, eng) -> bool:
    """Nothing of the sequence's next step needs the host first. A drafting sequence qualifies when that step
    surely carries no drafts: its drafts paused (after drafts of which none stood) or none paying at its
    acceptance (strata.engine.spec.may_draft)."""
    p = s.params
    return (s.logprobs is None and s.logits_processor is None and not may_draft(eng, s)
            and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty)


class Ahead:
    def __init__(self, engine):
        self.eng = engine
        self.pending: _Pending | None = None
        self.launched = 0  # steps launched ahead (cumulative)
        self.dropped = 0  # ahead tokens dropped because their sequence stopped

    @staticmethod
    def usable(engine) -> bool:
        g = engine.graphs
        return g is not None and engine.mtp is None and getattr(engine.lm.cfg, "decode_ahead", True)

    def released(self, s) -> None:
        """A sequence leaves the engine: if the step in flight carries its (now unread) token, its recurrent
        state goes back to the one before that step (queued after the step; the step's other sequences go on)."""
        p, rec = self.pending, self.eng.recurrent
        if p is not None and rec is not None and s in p.seqs and s.slot not in p.restored:
            rec.load_saved(s.slot)
            p.restored.add(s.slot)

    def _can(self, seqs: list) -> bool:
        eng = self.eng
        if not seqs or len(seqs) > eng.graph_batch or eng.graphs is None:
            return False
        if len(eng.running) != len(seqs) or any(s not in eng.running for s in seqs):
            return False  # a new prompt waits (or a sequence left): the scheduler takes the next step
        experts = eng.model.experts
        if experts is not None and experts.tuning():
            return False  # the plan tuner fits each step's time to that step's misses: steps one at a time
        return all(not s.finished and s.prompt_done and _plain(s, eng) and len(s.output) + 2 <= s.max_tokens
                   and s.pos + 2 < eng.max_ctx for s in seqs)

    def after_draw(self, plan, picks) -> None:
        """Right after a step's tokens are drawn (before the host reads them): launch the next step when the step
        was a plain graphed decode step of every running sequence."""
        if self.pending is not None or plan.prefill is not None or plan.drafts:
            return
        if any(seg.n != 1 for seg in plan.segs) or len(picks) != len(plan.owners):
            return
        if [p[0] for p in picks] != plan.owners or any(len(p[3]) != 1 for p in picks):
            return
        if not getattr(plan, "graphed", False):
            return
        self._launch(plan.owners, [p[3][0] for p in picks])

    def _launch(self, seqs: list, toks: list) -> None:
        """seqs' next step (their tokens `toks` still on the device, each at its sequence's position s.pos)."""
        if not self._can(seqs):
            return
        eng = self.eng
        if eng.recurrent is not None:  # the states as they are before this step's token (released() puts them back)
            try:
                eng.recurrent.save([s.slot for s in seqs])
            except torch.OutOfMemoryError:  # no room for the copy: steps go one at a time from now on
                torch.cuda.empty_cache()
                eng.ahead = None
                log.warning("strata: no VRAM for a copy of the recurrent state: decode steps are no longer launched "
                            "one ahead")
                return
        for s in seqs:  # (a paused drafting sequence: this step is one of its steps without drafts)
            pause_step(eng, s)
        try:
            logits = eng.graphs.step_batch(torch.stack(toks), [s.pos for s in seqs], [s.slot for s in seqs])
        except torch.OutOfMemoryError:  # its capture does not fit: the scheduler's step runs it (eagerly)
            torch.cuda.empty_cache()
            return
        drawn = [sample(logits[i], s.params, None, u=s.seed_draw(s.pos + 1)) for i, s in enumerate(seqs)]
        vals = torch.stack(drawn)
        cuda = vals.is_cuda
        host = torch.empty(len(drawn), dtype=torch.long, pin_memory=cuda)
        host.copy_(vals, non_blocking=cuda)
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record()
        self.pending = _Pending(list(seqs), drawn, host, ready, set())
        self.launched += 1

    def collect(self) -> list:
        """The launched step's tokens as `Engine.step` returns them, launching the step after it first when it
        can. Sequences that stopped since the launch drop their token."""
        eng, p = self.eng, self.pending
        self.pending = None
        live = [s for s in p.seqs if s in eng.running and not s.finished]
        self.dropped += len(p.seqs) - len(live)
        if eng.recurrent is not None:  # (a stopped sequence not released yet: its state goes back now)
            for s in p.seqs:
                if s not in live and s.slot not in p.restored:
                    eng.recurrent.load_saved(s.slot)
                    p.restored.add(s.slot)
        for s in live:  # the step consumed each one's last token, at its position
            s.pos += 1
            eng.slot_tokens[s.slot].append(s.output[-1])
        if len(live) == len(p.seqs):
            self._launch(live, p.drawn)  # before the host waits for p's tokens
        if p.ready is not None:
            p.ready.synchronize()
        values = p.host.tolist()
        picks = [(s, [], [], [p.drawn[i]], None) for i, s in enumerate(p.seqs) if s in live]
        vals = [v for i, v in enumerate(values) if p.seqs[i] in live]
        return eng._postprocess(picks, None, vals) if picks else []
