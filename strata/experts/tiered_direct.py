"""Graphed decode with misses read in place (`--decode-misses direct`): no host hand-off inside the step.

The hand-off path (strata.experts.tiered_decode) cuts every MoE layer's step in pieces: the routing goes to the
host, which copies the misses into staging slots (or computes them on the CPU), and the GPU waits for both. Here
the expert kernel itself reads a missed expert's weights from the pinned host store, mapped into the GPU's
address space, so one launch serves every pair of a layer, hits from the slot pool and misses from host RAM
over the bus, and a decode step is one graph like a resident one:

    per MoE layer (GPU)   slots = expert_map[layer][ids]; y = two_tier_expert_ffn(x, pool, slots, store, ids);
                          ids and slots recorded in a device buffer [L, 2, N*k]
    after the launch      the buffer copied to pinned host memory (one copy per step, two host buffers used in
                          turn); then, while the GPU runs this step, the host settles the previous one: for each
                          layer it counts hits and misses (as the kernel saw them: the recorded slots), the policy
                          learns the routing and admits (copies on the side stream, after this step's reads),
                          finished copies become hits (expert_map uploads, read from the next step on)

A miss read over the bus costs more per byte than a DMA copy (docs/BENCHMARKS.md has both), but no layer waits
for the host, a layer whose experts all hit costs what a resident one does, and the host's bookkeeping overlaps
the next step instead of lying between steps. The cache therefore learns one step later than on the hand-off
path, which is harmless: it learns from counts decayed over many steps.

On the CPU the same code runs eagerly with the torch twin reading the store (what CI tests against the
all-resident oracle).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import numpy as np
import torch

from strata.experts.pipeline import admit
from strata.experts.resident import combine
from strata.experts.tiered_eager import PAIRS_MAX
from strata.ops import registry
from strata.ops.expert_gather import two_tier_expert_ffn, two_tier_fast

stage_misses = registry.op("stage_misses")
lookup_slots = registry.op("lookup_slots")  # (each a launch on a GPU: strata.ops.host_stage)
commit_prefetch = registry.op("commit_prefetch")

log = logging.getLogger("strata")

# The next-layer prefetch pays where a layer's input predicts the next layer's routing, as a trained router's does.
# Where it does not (routing forced uniform, layers that route independently) every prefetched expert left unused
# crosses the bus as a miss would, and the layer's own misses queue behind it. So by default (neither
# --expert-prefetch nor --no-expert-prefetch) it is measured: once PREFETCH_PROBE prefetched experts are settled,
# a share used under PREFETCH_MIN_USE turns it off, from the next request on (graphs are captured again then).
PREFETCH_MIN_USE = 0.25
PREFETCH_PROBE = 1024


def supported(tiered) -> str:
    """'' when the direct path can serve this backend's decode steps, else why not (one log line's reason)."""
    if tiered.acts:
        return "its experts have biases or a non-SwiGLU activation (no fused kernel takes them)"
    if not tiered.cuda:
        return ""  # the torch twin reads the store on the CPU
    if not tiered.store.pinned:
        return "the expert store is not pinned (--low-ram reads the mapped file)"
    for layer in tiered.layer_ids:
        ew = tiered.store[layer]
        if not two_tier_fast(ew.gate, ew.up, ew.down):
            return f"layer {layer}'s expert formats have no fused GPU kernel"
    return ""


class _Record:
    """A step's routing as the kernels saw it, for every MoE layer: device [L, 3, P] (ids, slots, and the
    experts a prefetch staged for the layer, -1 padded) and two pinned host copies used in turn (one is read while
    the next step's copy lands in the other)."""

    def __init__(self, L: int, P: int, device: torch.device, cuda: bool):
        self.dev = torch.zeros(L, 3, P, dtype=torch.int64, device=device)
        self.dev[:, 2].fill_(-1)
        self.host = [torch.zeros(L, 3, P, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self.np = [h.numpy() for h in self.host]
        self.events: list = [None, None]
        # the layers a step of this size runs (set as the forward passes them, in capture or eagerly; a replay
        # runs the same): a layer of the backend's outside the trunk (an MTP block's) has no rows to settle
        self.layers: set[int] = set()


class DirectDecode:
    """The one-graph decode path of a TieredExperts backend (`tiered`)."""

    def __init__(self, tiered, stage: bool = False):
        self.t = tiered
        self.stage = stage  # distinct misses first copied into staging slots by a kernel (--decode-misses staged)
        self.records: dict[int, _Record] = {}  # tokens per step -> its record buffers
        self.map_h: dict[tuple[int, int], torch.Tensor] = {}  # (layer index, turn) -> expert_map row upload buffer
        self.current: tuple[int, bool] | None = None  # (tokens, counting) of the step begun, not yet launched
        self.previous: tuple[int, bool, int] | None = None  # (tokens, counting, host buffer) launched, unsettled
        self.turn = 0
        # --expert-prefetch on the staged path: at each MoE layer of a one-token step, the next MoE layer's router
        # on this layer's input predicts its experts, and a side stream stages the predicted misses into that
        # layer's half of a prefetch region while this layer computes; pmap[layer index][expert] is where a
        # prefetched expert waits (-1: not prefetched this step)
        self.prefetch = bool(stage and tiered.ex.prefetch_next is not False)  # (None: on for the staged path)
        # steps of several sequences prefetch too (the first k of their predicted misses) only when asked for
        # explicitly (--expert-prefetch): measured to pay for one-token steps only so far
        self.prefetch_batches = self.prefetch and tiered.ex.prefetch_next is True
        self.pmap: torch.Tensor | None = None
        self.side = torch.cuda.Stream(tiered.device) if self.prefetch and tiered.cuda else None
        self.programs = _prefetch_programs(tiered)
        self._issued = -1  # the layer index this step's last prefetch was for
        self._hold: torch.Tensor | None = None
        # the prefetch's measured use while it is on by default: [issued, used] until the verdict, then why it
        # goes off (None: it stays on)
        self.gated = self.prefetch and tiered.ex.prefetch_next is None
        self.probe = [0, 0]
        self.off_reason: str | None = None

    def begin_step(self, ctx) -> None:
        """A step begins. One begun but never launched (a capture's warm-up) counts as launched now; a step that
        is not a graphed decode one (a prefill, a verify step) first settles every launched step (it reads and
        changes the cache itself)."""
        if self.current is not None:
            self.launched()
        N = ctx.n_tokens
        self._issued = -1
        if ctx.graphed and N * self.t.k <= PAIRS_MAX:
            self.current = (N, ctx.counting)
        else:
            self.settle()

    def launched(self) -> None:
        """The current step is queued: its record starts for the host, and the previous step is settled while
        the GPU runs this one."""
        if self.current is None:
            return
        N, counting = self.current
        self.current = None
        rec = self._record(N)
        turn = self.turn
        self.turn ^= 1
        rec.host[turn].copy_(rec.dev, non_blocking=True)
        if self.t.cuda:
            ev = rec.events[turn] = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.t.device))
        self.settle()
        self.previous = (N, counting, turn)

    def _record(self, N: int) -> _Record:
        rec = self.records.get(N)
        if rec is None:
            t = self.t
            rec = self.records[N] = _Record(len(t.layer_ids), N * t.k, t.device, t.cuda)
        return rec

    def forward(self, ctx, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [N, d], ids/w [N, k]: hits from the pool and misses from the store in one launch, recorded."""
        t = self.t
        N, k = ids.shape
        li = t.index[layer]
        rec = self._record(N)
        rec.layers.add(li)
        flat = ids.view(-1)  # [N*k], pair p = token p // k, choice p % k
        pool, ew = t.cache.pool_of[layer], t.store[layer]
        host = (ew.gate, ew.up, ew.down)
        stacks = (pool.gate, pool.up, pool.down)
        n_stage = pool.staging
        ahead = self.prefetch and (N == 1 or self.prefetch_batches) and pool.staging >= 3 * k
        pmap, fill = None, False
        if ahead:
            n_stage = pool.staging - 2 * k  # the last 2k slots: the prefetch regions of odd and even layers
            if self._issued == li:  # the previous layer staged this one's predicted misses: wait, then use them
                recorder = getattr(ctx, "recorder", None)
                capturing = recorder is not None and recorder.capturing
                # (a cut since the fork joined it already, as the piece ended: a capture may not wait on a stream
                # outside it, so then there is nothing to wait for here)
                if self.side is not None and (not capturing or self.side in recorder.forks):
                    torch.cuda.current_stream(t.device).wait_stream(self.side)
                    if capturing:
                        recorder.forks.remove(self.side)
                self._hold = None  # (main-stream work from here on is ordered after the side stream's reads)
                pmap = self.pmap[li]
            else:  # (the first MoE layer: nothing predicted for it)
                fill = True
        # the pairs' slots (a prefetched expert in its staging slot) and the record's rows: the experts, their slots
        # in the cache (its view: a prefetched expert still counts as a miss), -1 for nothing prefetched
        slots = lookup_slots(flat, t.cache.map[li], rec.dev[li], pmap, fill)
        nxt = t.next_moe.get(layer) if ahead else None
        if nxt is not None and nxt.layer in t.index:  # forked before this layer's own copies: the bus stays busy
            self._prefetch(t.index[nxt.layer], nxt, x, rec, getattr(ctx, "recorder", None))  # through this layer's compute
        if self.stage:  # (beyond the staging slots, misses are still read in place)
            slots = stage_misses(slots, flat, host, stacks, pool.stage_base, n_stage)
        y = two_tier_expert_ffn(x, pool.gate, pool.up, pool.down, slots, host, flat, repeat=k)  # (pair p: row p // k)
        return combine(y.view(N, k, -1), w, x.dtype)

    def _prefetch(self, nl: int, moe, x: torch.Tensor, rec: "_Record", recorder=None) -> None:
        """Stage the next MoE layer's (index nl) predicted misses into its prefetch region, on the side stream
        (after this layer's routing, on the main stream so far: the region's last reader, the layer two before, is
        queued before it)."""
        t = self.t
        k = t.k
        if self.pmap is None:
            self.pmap = torch.full((len(t.layer_ids), t.n_experts), -1, dtype=torch.int64, device=t.device)
        layer = t.layer_ids[nl]
        pool, ew = t.cache.pool_of[layer], t.store[layer]
        region = pool.stage_base + pool.staging - 2 * k + (nl % 2) * k
        main = torch.cuda.current_stream(t.device) if self.side is not None else None
        if main is not None:
            self.side.wait_stream(main)
            if recorder is not None:  # (a cut before the next layer joins it: the profiler's)
                recorder.fork(self.side)
        with torch.cuda.stream(self.side) if main is not None else nullcontext():
            # [N * k] the tokens' predicted experts; the first k distinct misses among them fit the region (a
            # one-token step: all of them), the rest are left to the layer's own staging
            pid = moe.route_ids(x).view(-1)
            s_n = t.cache.map[nl].index_select(0, pid)
            out = stage_misses(s_n, pid, (ew.gate, ew.up, ew.down), (pool.gate, pool.up, pool.down), region, k,
                               programs=self.programs)
            commit_prefetch(pid, s_n, out, self.pmap[nl], rec.dev[nl, 2, :pid.numel()])
        self._issued = nl
        # x was made on the main stream: held until the next layer joins the side stream, so that its memory is
        # not handed to main-stream work the side stream's reads could still overlap
        self._hold = x

    def settle(self) -> None:
        """The previous step's bookkeeping, layer by layer: hits and misses counted as its kernels saw them, the
        policy learns the routing and admits (copies on the side stream), finished copies become hits."""
        if self.previous is None:
            return
        N, counting, turn = self.previous
        self.previous = None
        t = self.t
        rec = self.records[N]
        if rec.events[turn] is not None:
            rec.events[turn].synchronize()  # (long done: the engine read that step's tokens)
        data = rec.np[turn]  # [L, 2, P]
        pol, cache = t.policy, t.cache
        k = t.k
        for li, layer in enumerate(t.layer_ids):
            if li not in rec.layers:
                continue
            ids_l = data[li, 0].tolist()
            slots_l = data[li, 1].tolist()
            missed = {e for e, s in zip(ids_l, slots_l) if s < 0}
            n_miss = sum(1 for s in slots_l if s < 0)
            pre = {e for e in data[li, 2].tolist() if e >= 0}  # staged ahead by the previous layer's prediction
            if counting:
                # bytes: each distinct missed expert once (what crossed the bus, as the PCIe lane counts), and the
                # prefetched experts the layer did not use (they crossed it too)
                t.count(N * k - n_miss, 0, n_miss, N, layer=layer, pcie_experts=len(missed | pre))
                if pre:
                    t.prefetch_issued += len(pre)
                    t.prefetch_used += len(pre & missed)
                    if self.gated:
                        self.probe[0] += len(pre)
                        self.probe[1] += len(pre & missed)
            swaps = admit(pol, li, ids_l)
            if swaps:
                cache.begin_copies()  # after the main stream's work so far: the step in flight reads victims
                # (the layer's admissions in one copy call and one event: the host's cost is per call, not per byte)
                admitted = [sw.admit for sw in swaps]
                ev = cache.copy_into(layer, admitted, [cache.slot(layer, sw.slot) for sw in swaps])
                for e in admitted:
                    t.pending[li][e] = ev
                if counting:
                    t.count(0, 0, 0, 0, swaps=len(swaps))
            if t.poll(li, upload=False) or swaps:  # victims leave the map, finished copies enter it
                self._upload(li, layer, turn)
        if self.gated and self.probe[0] >= PREFETCH_PROBE:
            self.gated = False
            issued, used = self.probe
            if used < PREFETCH_MIN_USE * issued:
                self.off_reason = (f"{used} of {issued} prefetched experts were used ({100 * used / issued:.0f}% < "
                                   f"{100 * PREFETCH_MIN_USE:.0f}%): a layer's input does not predict the next "
                                   "layer's routing here")

    def prefetch_off(self) -> bool:
        """Take the prefetch's measured verdict (off) when it has one: True when the decode path changed (the
        engine is at rest; graphs captured with the prefetch are captured again)."""
        if self.off_reason is None or not self.prefetch:
            return False
        self.prefetch = self.prefetch_batches = False
        with torch.inference_mode():  # (the record buffers are inference tensors)
            for rec in self.records.values():  # (no step prefetches any more: no stale prediction is settled)
                rec.dev[:, 2].fill_(-1)
        log.info("strata: next-layer expert prefetch off: %s", self.off_reason)
        return True

    @torch.inference_mode()  # (the record buffers are inference tensors; a request may end outside the mode)
    def flush(self) -> None:
        """Settle everything launched (a request ends: its counts are complete)."""
        if self.current is not None:
            self.launched()
        self.settle()

    def _upload(self, li: int, layer: int, turn: int) -> None:
        """expert_map[li] from the policy's row (on the main stream: steps queued after it read it). Uploads of
        consecutive settles use the two buffers of a row in turn: the settle that reuses one has waited for an
        event recorded after the upload that last read it."""
        t = self.t
        row = t.policy.expert_map()[li]
        buf = self.map_h.get((li, turn))
        if buf is None:
            buf = self.map_h[(li, turn)] = torch.empty(row.shape[0], dtype=torch.int64, pin_memory=t.cuda)
        np.copyto(buf.numpy(), t.cache.pool_rows(layer, row))
        t.cache.map[li].copy_(buf, non_blocking=True)


def _prefetch_programs(t) -> int:
    """--expert-prefetch-programs, or a quarter of the GPU's SMs: the copy must keep the link busy without taking
    the SMs the layer's own kernels run on (docs/BENCHMARKS.md, "The decode settings in process": a quarter of
    the SMs measured fastest of the counts tried)."""
    if t.ex.prefetch_programs is not None:
        return t.ex.prefetch_programs
    if not t.cuda:
        return 16
    return max(4, torch.cuda.get_device_properties(t.device).multi_processor_count // 4)
