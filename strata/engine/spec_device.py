"""MTP drafting with the whole drafted step on the device: one replay and one read a step.

A drafted step on the host's path (strata.engine.engine, strata.engine.mtp) is: the chain of drafts (one replay,
one read), the trunk's verify step (one replay, one read of the drawn tokens), the host deciding what stood, then
the block over what stood (one replay). On a GPU each of those turns costs more than a small model's step. Here,
for one sequence, a single captured graph does all of it, in place on static buffers:

    verify     the trunk over [t0, d1 .. dm] at positions p .. p + m     -> logits, hidden states [m + 1]
    accept     drawn = argmax(logits) (or sampled); a = how many d_i equal drawn_{i-1} from the first on (cumprod)
    observe    the block over rows p .. p + m, pairs (h_i, drawn_i)       (rows past p + a: rewritten later)
    predict    the block's output at row p + a -> logits -> the next first draft, then the chain (rows p + a + 1 ...)
    advance    t0 = drawn_a, d = the new drafts, p += a + 1

and the host reads the drawn tokens and a (what stood: drawn_0 .. drawn_a), then does the bookkeeping of a
verify step (Engine._postprocess: stops, counts, the KV record). The next step needs nothing from the host, so it is
launched before that read (a stop or an abort read there drops it, as strata.engine.ahead does for plain steps). Rows written past what stood are stale exactly as
on the host's path: later steps rewrite them before any query reads them. The text is plain decoding's (the
trunk's draw decides every token).

Taken for one running sequence, greedy or sampled (no penalties, log-probabilities or grammar, no --draft-p-min;
a sampled row drawn at its token's position as the host draws it, sampler.position_uniform_t) with the MTP
block's graphs (strata.engine.mtp_graphs) and the trunk's (resident experts: no hand-off inside a step), while its
budget of tokens and context leaves room for a whole step; anything else takes the host's path, which picks up
from the block's last prediction this path leaves behind. One capture per (slot, window). On the CPU the
same code runs eagerly (tests).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from strata.engine.graphs import collector_paused
from strata.engine.sampler import position_uniform_t, sample_rows
from strata.kv.cache import Segment

log = logging.getLogger("strata")


class _NoCapture(RuntimeError):
    """A drafted step's capture failed (out of VRAM, or a step that cannot be captured)."""


@dataclass
class _Launched:
    seq: object
    host: torch.Tensor  # the step's results (drawn tokens, what stood, the drafts verified), copied to the host
    ready: object  # an event after that copy (None on a CPU)
    logits: torch.Tensor  # the block's prediction at the last position that stood, and its output row
    h: torch.Tensor


class DeviceDrafts:
    def __init__(self, engine, m: int):
        self.eng, self.m = engine, int(m)
        g = engine.mtp.graphs
        self.mg, self.tg = g, engine.graphs
        dev = engine.device
        T = self.m + 1
        self.cuda = dev.type == "cuda"
        self.tok = torch.zeros(T, dtype=torch.long, device=dev)  # t0, d1 .. dm (the step's input)
        self.p = torch.zeros(1, dtype=torch.long, device=dev)  # t0's position
        self.seed = torch.zeros(1, dtype=torch.long, device=dev)  # a sampled sequence's seed (sampler.position_uniform)
        self.out = torch.zeros(T + 1 + self.m, dtype=torch.long, device=dev)  # drawn [T], a, the drafts verified [m]
        # the block's rows (the cache's) and rotary positions: the observed T, then the chain's m - 1
        self.rows = torch.zeros(2 * T, dtype=torch.long, device=dev)
        self.pos = torch.zeros(2 * T, dtype=torch.long, device=dev)
        self.last_logits = torch.zeros_like(g.c_logits)  # the block's prediction at p + a (for the host's path)
        self.last_h = torch.zeros_like(g.c_h)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.live: tuple[int, int] | None = None  # (sequence id, t0's position) the buffers hold
        self.steps = self.dropped = 0  # steps launched; launched ahead and dropped (their sequence stopped)
        self.ahead = bool(getattr(engine.lm.cfg, "decode_ahead", True))
        self.pending: _Launched | None = None  # the step in flight, its tokens not read yet

    @staticmethod
    def usable(engine) -> bool:
        from strata.experts.resident import ResidentExperts

        m, ex = engine.mtp, engine.model.experts
        return (m is not None and m.graphs is not None and engine.graphs is not None and engine.recurrent is None
                and (ex is None or isinstance(ex, ResidentExperts))  # (a tiered step hands off inside itself)
                and engine.draft_max > 0 and m.p_min == 0 and engine.draft_max + 1 <= m.graphs.max_rows
                and engine.draft_max + 1 <= engine.graphs.max_tokens and engine.graphs.verify)

    def _takes(self, s, ahead: int = 0) -> bool:
        """The sequence's next step is this path's; ahead = 1: the step after it too (launched before this one's
        tokens are read: room for two steps' tokens and rows)."""
        eng, pr, n = self.eng, s.params, (1 + ahead) * (self.m + 1)
        return (len(eng.running) == 1 and eng.running[0] is s and s.prompt_done and not s.finished
                and s.logits_processor is None and s.logprobs is None and s.draft_max in (None, self.m)
                and (pr.greedy or not (pr.repetition_penalty != 1.0 or pr.presence_penalty or pr.frequency_penalty))
                and len(s.output) + n <= s.max_tokens and s.pos + n + self.m + 1 < eng.max_ctx)

    def step(self):
        """The one running sequence's drafted step, or None when this path does not take it. A steady run keeps
        one step in flight: the next step is launched (its input already on the device) before this one's tokens
        are read, as strata.engine.ahead does for plain steps; a stop read in this step's tokens drops it."""
        eng = self.eng
        p = self.pending
        if p is None:
            s = eng.running[0] if len(eng.running) == 1 else None
            if s is None or not self._takes(s):
                self.live = None
                return None
            if self.live != (s.id, s.pos) and not self._enter(s):
                return None
            try:
                p = self._launch(s, s.pos)
            except _NoCapture as e:  # (the host's drafted steps take over: nothing of this step was kept)
                log.warning("strata: capturing the drafted step failed (%s); drafted steps run from the host", e)
                self.live, eng.device_drafts = None, None
                return None
        self.pending = None
        s = p.seq
        if self.ahead and self._takes(s, ahead=1):
            try:
                self.pending = self._launch(s, s.pos + self.m + 1)  # (its start: at most this far)
            except _NoCapture:  # (this window's capture does not fit: steps one at a time from here)
                self.pending, self.ahead = None, False
        out = self._collect(p)
        if self.pending is not None and (s.finished or s not in eng.running):
            self.pending = None  # its rows lie past the sequence's end, in nobody's record
            self.dropped += 1
        self.live = (s.id, s.pos) if s in eng.running and not s.finished else None
        return out

    def _launch(self, s, far: int) -> _Launched:
        """Queue one step from the buffers (the sequence's t0 at a position up to `far`) and its results' copy."""
        W = self.tg.window_for(far + 2 * self.m + 1)  # (the trunk's cache is the shorter)
        pr = s.params  # (the sampler's settings are constants of a capture)
        how = None if pr.greedy else (pr.temperature, pr.top_k, pr.top_p, pr.min_p)
        if not self.cuda:
            self._body(s.slot, W, pr)
        else:
            key = (s.slot, W, how)
            g = self.graphs.get(key)
            if g is None:
                try:
                    g = self._capture(key, pr)
                except Exception as e:  # noqa: BLE001 - out of VRAM, or a step that cannot be captured
                    if isinstance(e, torch.OutOfMemoryError):
                        torch.cuda.empty_cache()
                    raise _NoCapture(f"{type(e).__name__}: {str(e).split(chr(10))[0]}") from e
            g.replay()
        self.steps += 1
        host = torch.empty(self.out.shape, dtype=torch.long, pin_memory=self.cuda)
        host.copy_(self.out, non_blocking=self.cuda)
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record()
        return _Launched(s, host, ready, self.last_logits.clone(), self.last_h[0].clone())

    def _collect(self, p: _Launched) -> list:
        """A launched step's tokens, as Engine.step returns them (none for a sequence gone meanwhile)."""
        eng, s = self.eng, p.seq
        if p.ready is not None:
            p.ready.synchronize()
        if s.finished or s not in eng.running:
            self.dropped += 1
            return []
        vals = p.host.tolist()
        T = self.m + 1
        drawn, a, drafts = vals[:T], vals[T], vals[T + 1:]
        seg_toks = [s.output[-1], *drafts]
        # the block's prediction for the host's path to take over from: at the last position that stood
        eng.mtp.last[s.id] = (p.logits, p.h, s.pos + a)
        return eng._postprocess([(s, drafts, seg_toks, drawn, None)], None, values=drawn)

    def _enter(self, s) -> bool:
        """Fill the buffers from the host's state: t0 = the last token, the first drafts from the block's last
        prediction (the chain on the device). False when there is no prediction for this position."""
        mtp = self.eng.mtp
        got = mtp.last.get(s.id)
        if got is None or got[2] != s.pos - 1:
            return False
        toks, _ = self.mg.chain(got[0], got[1], got[2], s.slot, self.m)
        self.tok[0] = s.output[-1]
        self.tok[1:].copy_(toks)
        self.p.fill_(s.pos)
        self.seed.fill_(s.sample_seed)
        self.live = (s.id, s.pos)
        return True

    def _body(self, slot: int, W: int, pr) -> None:
        """The step on the static buffers (captured once per (slot, window, sampler settings); run as is on the
        CPU). pr: the sequence's SamplingParams (greedy: argmax; else each row drawn at its token's position)."""
        m, T = self.m, self.m + 1
        tg, mg, head = self.tg, self.mg, self.eng.mtp.head
        rows, pos = self.rows, self.pos
        ar = torch.arange(T, device=self.tok.device)
        # verify: the trunk's static step over T tokens (its own buffers, filled on the device)
        tg.tok[:T].copy_(self.tok)
        torch.add(self.p, ar, out=tg.pos[:T])
        logits = tg._forward(tg._segments(W, (slot,), T))  # [T, V]
        hidden = tg.last_hidden  # [T, d]
        if pr.greedy:
            drawn = logits.argmax(-1)  # [T]
        else:  # row i draws the token at position p + i + 1, as the host's path draws it
            drawn = sample_rows(logits, pr, position_uniform_t(self.seed, self.p + 1 + ar))
        a = torch.cumprod((self.tok[1:] == drawn[:m]).long(), 0).sum()  # drafts that stood
        self.out[:T].copy_(drawn)
        self.out[T].copy_(a)
        self.out[T + 1:].copy_(self.tok[1:])
        # observe: the block over rows p .. p + m with the drawn tokens (those past a are rewritten later)
        torch.add(self.p, ar, out=rows[:T])
        torch.add(rows[:T], 1, out=pos[:T])
        seg = Segment(slot, 0, T, pos_t=rows[:T], window=W)
        _, x = head.forward(hidden, drawn, pos[:T], seg, mg.kv, logits=False)  # (row a's logits below)
        xa = x.index_select(0, a.view(1))  # [1, d] the block's output at the last row that stood
        la = head.logits(xa)[0]
        self.last_logits.copy_(la)
        self.last_h.copy_(xa)
        # the chain from p + a, as MtpGraphs.chain does it, its rows on the device
        pa = self.p + a  # [1]
        nxt = self.tok[1:]
        lg, h = la, xa
        for i in range(m):
            nxt[i:i + 1].copy_(lg.argmax(-1, keepdim=True))
            if i == m - 1:
                break
            r = rows[T + i:T + i + 1]
            torch.add(pa, i + 1, out=r)
            torch.add(r, 1, out=pos[T + i:T + i + 1])
            seg = Segment(slot, 0, 1, pos_t=r, window=W)
            lgs, h = head.forward(h, nxt[i:i + 1], pos[T + i:T + i + 1], seg, mg.kv, last_only=True)
            lg = lgs[-1]
        self.tok[0:1].copy_(drawn.index_select(0, a.view(1)))
        self.p.add_(a + 1)

    def _capture(self, key: tuple, pr):
        slot, W = key[0], key[1]
        side = torch.cuda.Stream(self.eng.device)
        side.wait_stream(torch.cuda.current_stream())
        saved = (self.tok.clone(), self.p.clone())
        with torch.cuda.stream(side):
            # warm-up (compiles, allocator): it advances the buffers; they are put back, and the rows it wrote
            # are the ones the replay rewrites
            self._body(slot, W, pr)
            self.tok.copy_(saved[0])
            self.p.copy_(saved[1])
            side.synchronize()
            g = torch.cuda.CUDAGraph()
            with collector_paused():
                g.capture_begin(pool=torch.cuda.graph_pool_handle(), capture_error_mode="thread_local")
                try:
                    self._body(slot, W, pr)
                finally:
                    g.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        self.graphs[key] = g
        return g
