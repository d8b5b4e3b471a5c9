"""Drawing a step's tokens (strata.engine.engine.Engine.step): each segment's position and the slot's record
advance by what the forward consumed, and each sequence that finished reading its prompt draws its token(s) on
the device: a plain segment one, a verify segment one at each of its rows (the target's draws that decide its
drafts). A sequence whose own logits processor fails is failed alone (`Engine.take_failed`)."""

from __future__ import annotations

import logging

import torch

from strata.engine.sampler import sample

log = logging.getLogger("strata")


def draw(eng, plan, logits: torch.Tensor) -> list:
    """Advance what the forward consumed and draw each sequence's token(s), on the device: [(sequence, its
    drafts, the segment's tokens, the tokens drawn at its rows, the logits row of a single draw)]."""
    picks = []
    r, at = 0, 0
    for s, seg in zip(plan.owners, plan.segs):
        seg_toks, at = plan.toks[at:at + seg.n], at + seg.n
        d = plan.drafts.get(s.id, [])
        r, mine = r + 1 + len(d), range(r, r + 1 + len(d))
        if not d:  # (a verify segment advances by what stands, once it is known)
            s.pos += seg.n
            eng.slot_tokens[s.slot] += seg_toks
        if not s.prompt_done:
            continue  # a middle prefill chunk: no token yet
        pr = s.params
        if d and pr.greedy and s.logits_processor is None and not (
                pr.penalty_last_n and (pr.repetition_penalty != 1.0 or pr.presence_penalty or pr.frequency_penalty)):
            # a greedy verify segment without penalties: every row's argmax in one op (one launch on a GPU)
            picks.append((s, d, seg_toks, list(logits[mine.start:mine.stop].float().argmax(-1).unbind(0)), None))
            continue
        ctx = s.context() if pr.penalty_last_n else []
        drawn = []
        try:  # a sequence's own logits processor (a grammar) may fail: that fails it, not the batch
            for j, i in enumerate(mine):  # row j predicts the token after the segment's first j + 1 tokens
                window = (ctx + d[:j])[-pr.penalty_last_n:] if pr.penalty_last_n else []
                recent = torch.tensor(window, device=eng.device, dtype=torch.long)
                row = logits[i] if s.logits_processor is None else s.logits_processor(logits[i])
                # the drawn token's position: a plain segment has advanced s.pos past its tokens already
                drawn.append(sample(row, pr, recent, u=s.seed_draw(s.pos + j + 1 if d else s.pos)))
        except Exception as e:  # noqa: BLE001 - reported with the sequence (take_failed)
            log.exception("strata: sequence %d failed drawing its token", s.id)
            if d:  # its state folded drafts in that will not be taken back
                eng._state_bad.add(s.slot)
            s.finished, s.finish_reason, s.error = True, "error", f"{type(e).__name__}: {e}"
            eng.failed.append(s)
            continue
        picks.append((s, d, seg_toks, drawn, i))
    return picks
