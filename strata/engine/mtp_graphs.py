"""The MTP block's small forwards as replayed CUDA graphs: the block over a verify step's rows that stood, and each
link of a draft chain (one row).

Run eagerly, one block forward launches ~100 small kernels from Python, several times a plain graphed trunk step
of a small model, and a drafted step runs it 1 + (drafts - 1) times. Captured, each is one replay. As for the
trunk's steps (strata.engine.graphs) the inputs live in static device buffers, the block's KV cache is read over
a fixed window masked beyond each row's own position (`Segment.pos_t`), and one capture serves every position up
to its window: a capture per (slot, window, rows). The block's cache keeps its own row convention: the pair
(h[i], token i + 1) at rotary position i + 1 sits in row i (strata.engine.mtp), so `rows` and `pos` are separate
buffers here.

Captured only where the block is capturable: its experts resident on the GPU (a tiered backend's hand-offs cut a
step into pieces: the block then runs eagerly) and the embedding table on the GPU. A forward of more rows than
`max_rows` (the block over a prompt) runs eagerly. On the CPU `static=True` runs the same static-buffer path
without capture (what the CPU tests exercise).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from strata.engine.graphs import collector_paused
from strata.kv.cache import KVCache, Segment

MIN_WINDOW = 256
MAX_CAPTURES = 32  # (slot, window, rows) sets kept, least recently used dropped


class MtpGraphs:
    def __init__(self, head, kv: KVCache, max_rows: int):
        self.head, self.kv, self.max_rows = head, kv, int(max_rows)
        dev, d = head.device, head.args.d_model
        self.cuda = dev.type == "cuda"
        self.h = torch.zeros(self.max_rows, d, dtype=head.dtype, device=dev)
        self.tok = torch.zeros(self.max_rows, dtype=torch.long, device=dev)
        self.rows = torch.zeros(self.max_rows, dtype=torch.long, device=dev)  # cache rows (Segment.pos_t)
        self.pos = torch.zeros(self.max_rows, dtype=torch.long, device=dev)  # rotary positions: rows + 1
        # a chain's input (the last prediction: logits [V], the block's output row) and its drafts with their
        # top-1 probabilities, all on the device: a chain of m drafts is one replay and one read
        self.c_logits = torch.zeros(head.head.shape[0], dtype=torch.float32, device=dev)
        self.c_h = torch.zeros(1, d, dtype=head.dtype, device=dev)
        self.c_tok = torch.zeros(self.max_rows, dtype=torch.long, device=dev)
        self.c_prob = torch.zeros(self.max_rows, dtype=torch.float32, device=dev)
        self.graphs: OrderedDict[tuple, tuple] = OrderedDict()
        self.replays = 0

    @staticmethod
    def capturable(head) -> bool:
        """The block's forward has no host read and no hand-off: resident experts and the embedding on its GPU."""
        from strata.experts.resident import ResidentExperts

        # (compared by type: the model's device may be "cuda" where a tensor on it says "cuda:0")
        return (head.device.type == "cuda" and isinstance(head.moe.experts, ResidentExperts)
                and head.embed.raw.device.type == "cuda")

    def window_for(self, row: int) -> int:
        w = MIN_WINDOW
        while w <= row:
            w *= 2
        return min(w, self.kv.max_ctx)

    def takes(self, n: int, start: int) -> bool:
        return 0 < n <= self.max_rows and start + n <= self.kv.max_ctx

    def forward(self, h: torch.Tensor, tokens: torch.Tensor, start: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block over rows start .. start + n - 1 of `slot` (h [n, d], tokens [n]: the tokens at rotary positions
        start + 1 ...): (the last row's logits [V] float32, the block's outputs [n, d]), copies the caller keeps."""
        n = h.shape[0]
        self.h[:n].copy_(h)
        self.tok[:n].copy_(tokens)
        self.rows[:n].copy_(torch.arange(start, start + n))
        torch.add(self.rows[:n], 1, out=self.pos[:n])
        key = (slot, self.window_for(start + n - 1), n)
        logits, x = self._forward(key) if not self.cuda else self._replay(key)[1:]
        return logits[-1].clone(), x.clone()

    def _replay(self, key: tuple):
        """The captured forward of `key` (captured now if it is not yet), replayed: (graph, its outputs ...)."""
        got = self.graphs.get(key)
        if got is None:
            got = self._capture(key)
        else:
            self.graphs.move_to_end(key)
        got[0].replay()
        self.replays += 1
        return got

    def chain(self, logits: torch.Tensor, h: torch.Tensor, p: int, slot: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """m drafts from the block's prediction at position p (logits [V], its output row h [d]), each further one
        the block run on its own output and the draft before it, at rows p + 1 ... (strata.engine.mtp): (tokens
        [m], their top-1 probabilities [m]) on the device, every one computed (a --draft-p-min cut is the
        caller's)."""
        self.c_logits.copy_(logits)
        self.c_h.copy_(h.view(1, -1))
        if m > 1:
            self.rows[:m - 1].copy_(torch.arange(p + 1, p + m))
            torch.add(self.rows[:m - 1], 1, out=self.pos[:m - 1])
        key = ("chain", slot, self.window_for(p + m - 1), m)
        if not self.cuda:
            self._chain(key)
        else:
            self._replay(key)
        return self.c_tok[:m].clone(), self.c_prob[:m].clone()

    def _chain(self, key: tuple):
        _, slot, window, m = key
        lg, h = self.c_logits, self.c_h
        for i in range(m):
            prob, tok = torch.softmax(lg.float(), -1).max(-1)
            self.c_tok[i].copy_(tok)
            self.c_prob[i].copy_(prob)
            if i == m - 1:
                break
            seg = Segment(slot, 0, 1, pos_t=self.rows[i:i + 1], window=window)
            lgs, h = self.head.forward(h, self.c_tok[i:i + 1], self.pos[i:i + 1], seg, self.kv, last_only=True)
            lg = lgs[-1]
        return self.c_tok, self.c_prob

    def _forward(self, key: tuple):
        if key[0] == "chain":
            return self._chain(key)
        slot, window, n = key
        seg = Segment(slot, 0, n, pos_t=self.rows[:n], window=window)
        return self.head.forward(self.h[:n], self.tok[:n], self.pos[:n], seg, self.kv, last_only=True)

    def _capture(self, key: tuple):
        side = torch.cuda.Stream(self.head.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up (Triton compiles, the allocator settles): rewrites the same rows
                self._forward(key)
            side.synchronize()
            g = torch.cuda.CUDAGraph()
            with collector_paused():
                g.capture_begin(pool=torch.cuda.graph_pool_handle(), capture_error_mode="thread_local")
                try:
                    logits, x = self._forward(key)
                finally:
                    g.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        got = (g, logits, x)
        self.graphs[key] = got
        while len(self.graphs) > MAX_CAPTURES:
            self.graphs.popitem(last=False)
        return got
