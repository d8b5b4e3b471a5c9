"""Drafts from the model's own multi-token-prediction block (`--draft-source mtp`; strata.models.mtp.MtpHead).

After each step the block reads what the trunk computed for each drafting sequence: for every position i the step
settled (prompt positions, and of a verify segment the ones that stood), the trunk's hidden state h[i] and the
token at i + 1 — now known, the token just drawn included. The pair sits at the block's position i + 1 (the
embedded token's, as llama.cpp's MTP driver places it; its rotary position), in row i of the block's cache, so
that the rows the block attends over are all written ones (llama.cpp's cache masks cells never written). That writes the block's own KV cache there (with the true
hidden states: rows a chain of drafts wrote before are replaced) and leaves, for the last position p, its
prediction of the token at p + 2. A draft whose probability under the block falls below --draft-p-min ends the
chain (none at all if the first does). The next step feeds the token at p + 1 (the one just drawn) and
the drafts: the first is that prediction; each further one runs the block once more at the next position, on its
own previous output for h and the draft before it for the token (the chain). The trunk verifies them in one
forward as it does n-gram drafts (strata.engine.spec): exact for any sampler, whatever the drafts' quality.
"""

from __future__ import annotations

import logging

import torch

from strata import StrataError
from strata.kv.cache import Segment

log = logging.getLogger("strata")

# the block's graphed forwards are taken by default on a GPU once their GPU test has passed there
# (tools/gpu/test.sh tests/engine/test_mtp.py); --cuda-graphs given takes them before that
GRAPHS_GPU_TESTED = True


class MtpDrafter:
    """Per engine: the MTP head, its KV cache (one layer, the engine's slots and context) and, per sequence, the
    block's last prediction (logits row, output row, position)."""

    def __init__(self, head, n_slots: int, max_ctx: int, p_min: float = 0.0, static: bool | None = None,
                 max_rows: int = 8):
        """static: the block's small forwards (max_rows rows at most) through static buffers, replayed as CUDA
        graphs (strata.engine.mtp_graphs); None: where the block is capturable (once GRAPHS_GPU_TESTED). True on a
        CPU: the same path run eagerly (tests)."""
        self.head, self.p_min = head, float(p_min)
        self.kv = head.new_kv_cache(n_slots, max_ctx + 2)  # (its rows sit one past the trunk's)
        self.last: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # sequence id -> (logits, h, position)
        self.proposed = self.runs = 0
        self.graphs = None
        from strata.engine.mtp_graphs import MtpGraphs

        capturable = MtpGraphs.capturable(head)
        if static is None:
            static = capturable and GRAPHS_GPU_TESTED
        if static and (capturable or head.device.type != "cuda"):
            self.graphs = MtpGraphs(head, self.kv, max_rows)

    def _block(self, h: torch.Tensor, toks: torch.Tensor, start: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block over rows start .. start + n - 1 of `slot`: (the last row's logits [V], outputs [m, d] whose last
        row is the last row's: m = n through the static buffers, else 1, the other rows' K/V alone computed)."""
        g = self.graphs
        if g is not None and g.takes(h.shape[0], start):
            try:
                return g.forward(h, toks, start, slot)
            except Exception as e:  # noqa: BLE001 - a block that cannot be captured still drafts, eagerly
                if not g.cuda:
                    raise
                log.warning("strata: capturing the MTP block failed (%s: %s); it runs eagerly", type(e).__name__, e)
                self.graphs = None
        n = h.shape[0]
        pos = torch.arange(start + 1, start + 1 + n, device=self.head.device)
        logits, out = self.head.forward(h, toks, pos, Segment(slot, start, n), self.kv, last_only=True, tail=True)
        return logits[-1], out

    def observe(self, s, hidden: torch.Tensor, start: int) -> None:
        """The trunk ran positions start .. start + len(hidden) - 1 of sequence s (rows of `hidden` [n, d]); those
        before s.pos stand. Runs the block over them (where the token after is known) and keeps its last
        prediction."""
        n = min(hidden.shape[0], s.pos - start, len(s.prompt) + len(s.output) - 1 - start)
        if n <= 0:
            return
        toks = torch.tensor(s.tokens(start + 1, start + 1 + n), device=self.head.device)
        # the pair (h[i], token i + 1) at the block's position i + 1, in its cache's row i: rows from 0 up are all
        # written, so attention over them sees no unwritten row (llama.cpp masks cells never written)
        logits, out = self._block(hidden[:n], toks, start, s.slot)
        self.runs += 1
        self.last[s.id] = (logits, out[-1], start + n - 1)

    def draft(self, s, room: int) -> list[int]:
        """Up to `room` tokens to follow s's last token: the block's prediction, then the chain."""
        got = self.last.get(s.id)
        if got is None or room <= 0:
            return []
        logits, h, p = got
        if p != s.pos - 1:  # not the prediction from the position before the token to be fed (stale)
            return []
        g = self.graphs
        if g is not None and room <= g.max_rows and p + room <= g.kv.max_ctx:
            try:  # the whole chain on the device, one read: (tokens, top-1 probabilities)
                toks, probs = g.chain(logits, h, p, s.slot, room)
            except Exception as e:  # noqa: BLE001 - as for _block: eagerly from here on
                if not g.cuda:
                    raise
                log.warning("strata: capturing the MTP chain failed (%s: %s); it runs eagerly", type(e).__name__, e)
                self.graphs = None
            else:
                vals = torch.cat([toks.to(torch.float32), probs]).tolist()
                out = []
                for t, prob in zip(vals[:room], vals[room:]):
                    if self.p_min > 0 and prob < self.p_min:
                        break
                    out.append(int(t))
                self.proposed += len(out)
                return out
        out: list[int] = []
        while True:
            prob, tok = torch.softmax(logits.float(), -1).max(-1)
            if self.p_min > 0 and float(prob) < self.p_min:
                break
            out.append(int(tok))
            if len(out) >= room:
                break
            at = p + 1 + len(out)  # the block's position of the draft just made (the token it embeds), row at - 1
            logits, hh = self._block(h[None], torch.tensor([out[-1]], device=self.head.device), at - 1, s.slot)
            h = hh[0]
        self.proposed += len(out)
        return out

    def forget(self, s) -> None:
        self.last.pop(s.id, None)


def drafter_for(engine, source: str) -> MtpDrafter | None:
    """The engine's MTP drafter when drafts come from the model's MTP block (--draft-source mtp, or auto and the
    model has one, with --draft-max on), else None."""
    blocks = getattr(engine.model, "nextn", None) or []
    if source == "mtp" and not blocks:
        raise StrataError("--draft-source mtp: this model has no multi-token-prediction block")
    if not engine.draft_max or source == "ngram" or not blocks:
        return None
    from strata.models.mtp import MtpHead

    log.info("strata: drafts from the model's MTP block (layer %d)", blocks[0].layer)
    cfg = engine.lm.cfg  # cuda_graphs None: graphed where the block is capturable; True on a CPU: the static path
    return MtpDrafter(MtpHead(engine.model, blocks[0], engine.max_ctx + 2), engine.n_slots, engine.max_ctx,
                      getattr(cfg, "draft_p_min", 0.0), static=cfg.cuda_graphs, max_rows=engine.draft_max + 1)
