"""Decode steps replayed as CUDA graphs: captured per (KV slots, attention window), in pieces.

A Python decode step launches thousands of small kernels, and its host time far exceeds its GPU time; replaying
captured graphs launches them at once (the measured counts and speed-ups are in docs/BENCHMARKS.md). Capture
needs static shapes and no host reads: the token and position live in device buffers, attention spans a fixed
window of the KV cache masked beyond the position (`Segment.window`).
Windows are powers of two, so a sequence re-captures at most log2(context) times. Several decoding sequences
(`--parallel N`, resident or tiered experts) share one step: each has its own device position and is
masked within the window of the furthest one; a set of slots is captured once per window.

Tiered experts must hand each MoE layer's routing to the host (the CPU lane computes misses where they lie,
the host picks and copies what crosses PCIe). The step's `StepContext` carries the recorder to the experts
backend, which marks those points with `recorder.cut(fn)`: while
capturing, a cut ends the current graph and starts the next one, and `fn` is remembered; a replay runs
graph 0, fn 0, graph 1, fn 1, ... A hand-off `fn` may return a `post` callable, run right after the next
graph is launched (bookkeeping that should not delay the GPU). All pieces of one window share a private
memory pool and are replayed in capture order, so tensors passed from one piece to the next stay valid.
Outside capture (warm-up, CPU, and `cut` calls during an eager static step) a cut runs `fn` and its `post`
at once: the same code path, which is what the CPU tests exercise. The capture's forward does not begin a step
on the experts backend (its hand-offs do not run then); each replay does, before its first piece.

`--profile` with graphs: every piece and hand-off is timed on the host with a device sync after it, and the
time goes to the bucket the cut names (so the breakdown adds up to the step).
"""

from __future__ import annotations

import gc
import logging
import time
from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable

import torch

from strata.experts.backend import StepContext
from strata.kv.cache import KVCache, Segment
from strata.ops import registry

log = logging.getLogger("strata")

MIN_WINDOW = 256
MAX_CAPTURES = 32  # captured sets kept (least recently used dropped): slot combinations x windows can be many

Handoff = Callable[[], "Callable[[], None] | None"]


@contextmanager
def collector_paused():
    """Python's cycle collector held off while a graph captures: a collection mid-capture can free pinned host
    buffers of objects dropped earlier (an engine of a previous request or test), and the host allocator's event
    calls for them are not allowed while this thread's stream captures: the capture fails ("operation not
    permitted when stream is capturing"). What it would have collected waits for the next collection (no collection
    is forced here: a full one takes tens of milliseconds on a loaded heap)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class PieceRecorder:
    """Collects the pieces of one capture; outside capture, runs hand-offs inline."""

    def __init__(self):
        self.capturing = False
        self.pieces: list[tuple[torch.cuda.CUDAGraph, Handoff | None, str]] = []
        self._g: torch.cuda.CUDAGraph | None = None
        self._pool = None
        self.profile: Callable[[str, float], None] | None = None  # (bucket, ms) sink when profiling
        self.forks: list = []  # side streams forked from the capture since the last cut (joined before a cut)

    def fork(self, stream) -> None:
        """`stream` now waits on the capture (a prefetch forked from it): a piece must not end before the capture
        stream has joined it back (CUDA refuses to end a capture with unjoined work), so the next cut joins it.
        Only a cut inside the fork's span needs it: the profiler's per-span cuts."""
        if self.capturing:
            self.forks.append(stream)

    def _join(self) -> None:
        cur = torch.cuda.current_stream()
        for s in self.forks:
            cur.wait_stream(s)
        self.forks = []

    def cut(self, fn: Handoff | None = None, label: str = "dense_other") -> None:
        """End the current piece here (its work counts as `label`); `fn` runs on the host after it."""
        if not self.capturing:
            if fn is not None:
                post = fn()
                if post is not None:
                    post()
            return
        self._join()
        self._g.capture_end()
        self.pieces.append((self._g, fn, label))
        self._begin()

    def _begin(self) -> None:
        self._g = torch.cuda.CUDAGraph()
        # thread_local: only this thread's calls may end the capture. In the default (global) mode any other thread's
        # CUDA call that is unsafe while a stream captures (a context-wide synchronize, an allocation) invalidates
        # it, and the engine then decodes eagerly; nothing another thread does belongs in the engine's graphs
        self._g.capture_begin(pool=self._pool, capture_error_mode="thread_local")

    def start(self, pool) -> None:
        self.pieces, self._pool, self.capturing = [], pool, True
        self._begin()

    def abort(self) -> None:
        """End a failed capture (the stream must leave capture mode) and drop its pieces."""
        if self._g is not None:
            try:
                self._g.capture_end()
            except Exception:  # the capture was already invalidated: nothing to end
                pass
        self._g, self.capturing, self.pieces, self.forks = None, False, [], []

    def finish(self, label: str = "dense_other") -> list:
        self._join()
        self._g.capture_end()
        self.pieces.append((self._g, None, label))
        self._g, self.capturing = None, False
        return self.pieces


class DecodeGraphs:
    """Captured decode steps of `max_batch` sequences at most (one token each), keyed by their KV slots and the
    attention window. slot: the default slot of `step` (one sequence)."""

    def __init__(self, model, kv: KVCache, slot: int = 0, max_batch: int = 1, max_tokens: int | None = None):
        self.model, self.kv, self.slot, self.max_batch = model, kv, slot, max_batch
        # tokens one step may carry in all (a verify step: T tokens of each of its sequences)
        self.max_tokens = max(max_batch, int(max_tokens or 0))
        self.dropped_for_memory = 0  # captures dropped to make room for another (out of VRAM)
        self.no_room: set[tuple] = set()  # steps whose capture did not fit: they run eagerly
        self.verify = True  # verify steps (T > 1 tokens a sequence) captured too; off after a failed capture
        self.captures = 0  # captures tried (a step that captured is no sample of a step's cost: draft_cost)
        dev = model.device
        n = self.max_tokens
        self.tok = torch.zeros(n, dtype=torch.long, device=dev)  # static inputs
        self.pos = torch.zeros(n, dtype=torch.long, device=dev)
        self.cuda = dev.type == "cuda"
        # an embedding table in (pinned) host RAM: the step's rows, still quantized (a few KB), are read over the
        # bus inside the graph by a kernel taking the token ids in device memory (strata.ops.host_rows), and
        # dequantized on the GPU
        self.host_rows = bool(model.host_embed)
        self.rec = PieceRecorder()
        # the trunk's last hidden states of every token of the step, kept for a reader after it (an MTP drafter):
        # a graph's output like its logits, valid until the next replay
        self.want_hidden = False
        self.last_hidden: torch.Tensor | None = None
        self.experts = model.experts  # an ExpertsBackend, or None for a dense model
        # the backend's decode path as captured (a tiered backend may leave the hand-off once its plan is tuned)
        self.epoch = getattr(self.experts, "path_epoch", 0)
        # (slots, window) -> (pieces, logits), least recently used first
        self.graphs: OrderedDict[tuple, tuple[list, torch.Tensor]] = OrderedDict()
        self.profiler = self.experts.profiler if self.experts is not None else None
        self.profiling = self.profiler is not None
        if self.profiling:
            self.rec.profile = self.profiler.profile.add

    def window_for(self, pos: int) -> int:
        w = MIN_WINDOW
        while w <= pos:
            w *= 2
        return min(w, self.kv.max_ctx)

    def _segments(self, window: int, slots: tuple[int, ...], T: int = 1) -> list[Segment]:
        """T tokens of each slot's sequence (T > 1: a verify step), positions on the device."""
        return [Segment(s, 0, T, pos_t=self.pos[i * T:(i + 1) * T], window=window) for i, s in enumerate(slots)]

    def _context(self, b: int, live: bool = True, counting: bool = True) -> StepContext:
        return StepContext(n_tokens=b, phase="decode", recorder=self.rec, graphs=True, live=live, counting=counting,
                           profiler=self.profiler)

    def _forward(self, segs, live: bool = True, counting: bool = True):
        n = sum(seg.n for seg in segs)
        ctx = self._context(n, live, counting)
        embeds = None
        if self.host_rows:
            embeds = self.model.embed_rows(registry.op("gather_rows")(self.model.embed.raw, self.tok[:n]))
        # a verify step scores every position (its logits rows in segment order), a decode step its one token
        hidden = [] if self.want_hidden else None
        out = self.model.forward(self.tok[:n], self.pos[:n], segs, self.kv, ctx=ctx, embeds=embeds,
                                 all_logits=n > len(segs), hidden_out=hidden)
        self.last_hidden = hidden[0] if hidden else None
        return out

    @staticmethod
    def _key(slots, window: int, T: int = 1) -> tuple:
        return (tuple(slots), window) if T == 1 else (tuple(slots), window, T)

    def _capture(self, key: tuple):
        """Capture `key`'s step; out of VRAM, the least recently used captures are dropped (their pools freed) and
        it is tried once more: a budget holds the captures that fit, not all of them (OutOfMemoryError when even
        one does not)."""
        if key in self.no_room:  # (its warm-up forwards and capture are not tried again at every step)
            raise torch.OutOfMemoryError(f"no VRAM for the capture of {key} beside the model")
        self.captures += 1
        try:
            try:
                return self._capture_once(key)
            except torch.OutOfMemoryError:
                if not self.graphs:
                    raise
                n = max(1, len(self.graphs) // 2)
                for _ in range(n):
                    self.graphs.popitem(last=False)
                torch.cuda.empty_cache()
                self.dropped_for_memory += n
                return self._capture_once(key)
        except torch.OutOfMemoryError:
            self.no_room.add(key)
            raise

    def _capture_once(self, key: tuple):
        slots, window = key[0], key[1]
        segs = self._segments(window, slots, key[2] if len(key) > 2 else 1)
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream())
        # a recurrent state (strata.kv.recurrent) is not rewritten but advanced by a forward: the warm-up's
        # steps are taken back, in place (the graphs capture these buffers)
        rec = self.kv.recurrent
        with torch.cuda.stream(side):  # warm-up: Triton compiles, allocator settles (rewrites the same K/V)
            # (the states' copy in host memory: the budget's room is for the graphs, not for a second state)
            saved = rec.snapshot(list(slots), host=True) if rec is not None else None
            try:
                for _ in range(2):
                    self._forward(segs, counting=False)  # statistics skip the warm-up
            finally:
                if saved is not None:
                    rec.restore(saved)
            side.synchronize()
            with collector_paused():
                self.rec.start(torch.cuda.graph_pool_handle())
                try:
                    out = self._forward(segs, live=False)  # the hand-offs run at each replay
                except BaseException:
                    self.rec.abort()
                    raise
                pieces = self.rec.finish()
        torch.cuda.current_stream().wait_stream(side)
        entry = (pieces, out, self.last_hidden)
        self.remember(key, entry)
        return entry

    def remember(self, key: tuple, entry) -> None:
        """Keep a captured set, dropping the least recently used beyond MAX_CAPTURES (its memory pool is freed
        with it)."""
        self.graphs[key] = entry
        self.graphs.move_to_end(key)
        while len(self.graphs) > MAX_CAPTURES:
            self.graphs.popitem(last=False)

    @torch.inference_mode()
    def prepare(self, windows: list[int], deadline: float | None = None) -> int:
        """Capture the steps of 1 .. max_batch sequences in slots 0 .. b-1 (where the engine keeps decoding
        sequences) for each window, smallest first, until `deadline` (time.perf_counter()); the server does this
        before it says ready, so no request waits for a capture of a short context. The steps write K/V rows at
        position 0 of those slots: call it while no slot holds anything worth keeping. Returns the count captured."""
        if not self.cuda:
            return 0
        self._sync_path()
        n = 0
        self.pos.zero_()
        self.tok.zero_()
        for w in sorted(set(min(int(w), self.kv.max_ctx) for w in windows)):
            for b in range(1, self.max_batch + 1):
                if (deadline is not None and time.perf_counter() > deadline) or len(self.graphs) >= MAX_CAPTURES:
                    return n
                key = (tuple(range(b)), w)
                if key not in self.graphs:
                    try:
                        self._capture(key)
                    except torch.OutOfMemoryError as e:  # the rest are captured when first needed (or run eagerly)
                        log.warning("strata: decode-step capture stopped after %d of them: out of VRAM (%s)", n,
                                    str(e).split(".")[0])
                        torch.cuda.empty_cache()
                        return n
                    n += 1
        return n

    @torch.inference_mode()
    def step(self, token: int, pos: int) -> torch.Tensor:
        """Logits [1, V] for `token` at `pos` of this slot (its K/V written into the cache)."""
        return self.step_batch([token], [pos], [self.slot])

    def _sync_path(self) -> None:
        """Drop the captures when the backend's decode path changed since they were made (they hold its pieces)."""
        epoch = getattr(self.experts, "path_epoch", 0)
        if epoch != self.epoch:
            if self.cuda:  # (once: the old path's last replay and its copies finish before its graphs go)
                torch.cuda.synchronize(self.model.device)
            self.graphs.clear()
            self.no_room.clear()
            if self.cuda:  # their pools' memory goes back now, not by a free inside the next capture
                torch.cuda.empty_cache()
            self.epoch = epoch

    def captured(self, positions: list[int], slots: list[int], T: int = 1) -> bool:
        self._sync_path()
        return self._key(slots, self.window_for(max(positions) + T - 1), T) in self.graphs

    @torch.inference_mode()
    def step_batch(self, tokens: list[int] | torch.Tensor, positions: list[int], slots: list[int],
                   T: int = 1) -> torch.Tensor:
        """Logits [B, V] for one token of each of B sequences (token, position, KV slot); one captured graph
        set per (slots, window), the window covering the furthest position (the others are masked).

        T > 1, a verify step: `tokens` holds T tokens of each sequence (B * T, sequence after sequence) and
        `positions` each sequence's first position; logits [B * T, V], every position's. One graph set per
        (slots, window, T): each query sees the keys up to its own position (the window's mask per query).
        `tokens` may be a device tensor [n] (tokens sampled by the previous step, not yet read by the host): the
        step then follows a one-token step of the same sequences in the same order, and their device positions
        advance by one there (a copy from host memory could wait for the stream)."""
        b = len(slots)
        n = b * T
        if not 0 < b <= self.max_batch or n > self.max_tokens or len(positions) != b or len(tokens) != n:
            raise ValueError(f"a graphed step takes 1..{self.max_batch} sequences and {self.max_tokens} tokens, "
                             f"got {b} x {T}")
        if isinstance(tokens, torch.Tensor):
            if T != 1:
                raise ValueError("device tokens follow a one-token step")
            self.tok[:n].copy_(tokens.view(-1), non_blocking=True)
            self.pos[:n].add_(1)
        elif n == 1:
            self.tok[:1].fill_(tokens[0])
            self.pos[:1].fill_(positions[0])
        else:
            self.tok[:n].copy_(torch.tensor(tokens))
            self.pos[:n].copy_(torch.tensor([p + j for p in positions for j in range(T)]))
        key = self._key(slots, self.window_for(max(positions) + T - 1), T)
        self._sync_path()
        if not self.cuda:
            out = self._forward(self._segments(key[1], key[0], T))
            if self.experts is not None:
                self.experts.launched()
            return out
        got = self.graphs.get(key)
        if got is not None:
            self.graphs.move_to_end(key)
        entry = got or self._capture(key)
        pieces, out = entry[0], entry[1]
        self.last_hidden = entry[2] if len(entry) > 2 else None
        if self.experts is not None:
            self.experts.begin_step(self._context(n))
        if self.profiling:
            self._replay_timed(pieces)
        else:
            post = None
            for g, fn, _ in pieces:
                g.replay()
                if post is not None:
                    post()
                    post = None
                if fn is not None:
                    post = fn()
        if self.experts is not None:
            self.experts.launched()  # host work of the backend's that may overlap the step
        return out

    def _replay_timed(self, pieces) -> None:
        """Replay with a sync after every piece and hand-off, charging each one's wall time to its bucket."""
        add = self.rec.profile
        dev = self.model.device
        torch.cuda.synchronize(dev)
        post = None
        for g, fn, label in pieces:
            t = time.perf_counter()
            g.replay()
            torch.cuda.synchronize(dev)
            add(label, (time.perf_counter() - t) * 1e3)
            if post is not None:
                t = time.perf_counter()
                post()
                add("policy", (time.perf_counter() - t) * 1e3)
                post = None
            if fn is not None:
                t = time.perf_counter()
                post = fn()
                torch.cuda.synchronize(dev)
                add(getattr(fn, "bucket", "cpu_wait"), (time.perf_counter() - t) * 1e3)
