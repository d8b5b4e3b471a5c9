"""One-token decode through the tiered experts, shaped for CUDA-graph pieces (`strata.engine.graphs`).

Per MoE layer the step is cut into three pieces around two host hand-offs:

    piece A (GPU)   ... router -> ids; ids and x copied into this layer's pinned host buffers (with
                    --expert-prefetch also the next MoE layer's router on x: its likely experts)
    cut: ready      host records an event (the routing is on the host once it fires)
    piece H (GPU)   hits: every choice from the slot pool through the device expert_map (misses give 0)
    cut: handoff    host waits for `ready` (not for H), reads the ids; when every one is a hit (the common
                    step) only the bookkeeping follows; else it splits the misses by the plan:
                      PCIe share: copied into staging slots (urgent stream; or already there, prefetched
                        during the previous layer), slots written to a pinned table
                      CPU share: computed now by the CPU lane while H runs, outputs written to a pinned buffer
                    the main stream waits for the copies; with --expert-prefetch the next layer's predicted
                    misses start their copies; returns `post` (the policy's bookkeeping and the cache
                    admissions — from a staging slot on the device when the expert just came up), run after
                    piece B is launched
    piece B (GPU)   staging table and CPU outputs copied up (captured H2D copies from the pinned buffers);
                    staged experts computed from the pool; y = hits + staged + cpu; combined in routing order
                    ... the next layer's attention, router ...

The GPU never waits for the host except for the CPU share and the PCIe copies of this layer, and the host
never waits for the GPU's hits. Each choice's output comes from exactly one of the three tensors (the other two
hold zeros), so the sum equals the resident backend's per-choice outputs and `combine` gives the same result.

Without CUDA the same code runs eagerly (cuts run their hand-offs inline): that is what CI tests against the
all-resident oracle.
"""

from __future__ import annotations

import numpy as np
import torch

from strata.experts.pipeline import admit, plan_handoff
from strata.experts.resident import combine, gather_pairs


class _Buffers:
    """One MoE layer's static buffers for n tokens of k choices (P = n*k pairs): host ones pinned on CUDA
    (captured copies read/write them)."""

    def __init__(self, n: int, k: int, d: int, dtype: torch.dtype, device: torch.device, cuda: bool):
        pin = dict(pin_memory=True) if cuda else {}
        P = n * k
        self.ids_h = torch.zeros(P, dtype=torch.int64, **pin)
        self.x_h = torch.zeros(n, d, dtype=dtype, **pin)
        self.stage_h = torch.full((P,), -1, dtype=torch.int64, **pin)
        self.ycpu_h = torch.zeros(P, d, dtype=torch.float32, **pin)
        self.stage_d = torch.full((P,), -1, dtype=torch.int64, device=device)
        self.ycpu_d = torch.zeros(P, d, dtype=torch.float32, device=device)
        self.map_h = torch.zeros(0, dtype=torch.int64, **pin)  # the expert_map row upload buffer
        self.ready = torch.cuda.Event() if cuda else None
        self.cpu_rows: list[int] = []  # rows of ycpu_h written last time (zeroed before the next use)
        self.pred_h = torch.zeros(P, dtype=torch.int64, **pin)  # the next MoE layer's predicted ids
        self.ids_np = self.ids_h.numpy()  # numpy views of the host buffers, made once (the hand-off is hot)
        self.stage_np = self.stage_h.numpy()
        self.pred_np = self.pred_h.numpy()
        self.stage_dirty = False  # stage_h holds slots from its last use (reset to -1 before the next)


class GraphedDecode:
    """The graph-piece decode path of a TieredExperts backend (`tiered`)."""

    def __init__(self, tiered):
        self.t = tiered
        self.bufs: dict[tuple[int, int], _Buffers] = {}  # (layer index, tokens) -> buffers
        # --expert-prefetch: layer index -> (expert -> staging slot, copy event) started during the previous
        # layer's hand-off of the same step (`_step` tells steps apart: a prefill between steps reuses the ring)
        self.prefetched: dict[int, tuple[int, dict[int, int], object]] = {}
        self._step = 0

    def new_step(self) -> None:
        """A graphed step begins (its prefetches are told apart from the previous step's)."""
        self._step += 1

    def _bufs(self, li: int, n: int, k: int, x: torch.Tensor) -> _Buffers:
        b = self.bufs.get((li, n))
        if b is None:
            b = self.bufs[(li, n)] = _Buffers(n, k, x.shape[-1], x.dtype, x.device, self.t.cuda)
        return b

    def forward(self, ctx, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [N, d], ids/w [N, k]: N decoding sequences' tokens (N*k pairs within the grouped kernel's size), in
        the graphed step `ctx` (its recorder takes the cuts)."""
        t, rec = self.t, ctx.recorder
        N, k = ids.shape
        li = t.index[layer]
        b = self._bufs(li, N, k, x)
        pool = t.cache.pool_of[layer]
        # piece A ends: the routing and the activations start for the host
        b.ids_h.copy_(ids.view(-1), non_blocking=True)
        if t.lane is not None:
            b.x_h.copy_(x, non_blocking=True)
        nxt = t.next_moe.get(layer) if t.ex.prefetch_next and N == 1 else None
        if nxt is not None:  # the next MoE layer's router on this layer's input: its likely experts
            b.pred_h.copy_(nxt.route_ids(x).view(-1), non_blocking=True)
        rec.cut(self._ready(b), label="router_shared")
        # piece H: hits from the device map (no host involvement)
        xs = x.repeat_interleave(k, dim=0) if N > 1 else x.expand(k, -1).contiguous()  # [N*k, d]
        act, flat = t.acts.get(layer), ids.view(-1)  # (act: biases by expert id, flat: each pair's expert)
        y_hit = gather_pairs(xs, pool.gate, pool.up, pool.down, t.cache.map[li].index_select(0, flat), act, flat)
        rec.cut(self._handoff(li, layer, N, k, b, ctx.counting), label="gpu_experts")
        # piece B: what the host decided comes up, staged experts run, all three parts summed
        b.stage_d.copy_(b.stage_h, non_blocking=True)
        b.ycpu_d.copy_(b.ycpu_h, non_blocking=True)
        y_stage = gather_pairs(xs, pool.gate, pool.up, pool.down, b.stage_d, act, flat)
        y = y_hit + y_stage + b.ycpu_d  # [N*k, d] float32: one of the three is each choice's output
        out = combine(y.view(N, k, -1), w, x.dtype)
        if t.profiler is not None:
            rec.cut(None, label="pcie_staged")  # waiting for this layer's copies, staged compute, combine
        return out

    def _ready(self, b: _Buffers):
        def fn():
            if b.ready is not None:
                b.ready.record()
            return None

        fn.bucket = "router_shared"
        return fn

    def _handoff(self, li: int, layer: int, N: int, k: int, b: _Buffers, counting: bool):
        t = self.t

        def fn():
            if b.ready is not None:
                b.ready.synchronize()  # the routing is on the host; piece H may still be running
            pol, cache = t.policy, t.cache
            # plain Python on a few ids: numpy's per-call costs would dominate (this runs for every layer)
            row = pol.hit_row(li)  # the host mirror, as the device map was when piece H was queued
            ids_l = b.ids_np.tolist()  # [N*k], pair p = token p // k, choice p % k
            hit = [row[e] >= 0 for e in ids_l]
            got = self.prefetched.pop(li, None) if self.prefetched else None
            if all(hit):  # the common step: nothing to stream or compute here, only the bookkeeping
                streamed, n_cpu, n_pcie, cpu_experts = {}, 0, 0, 0
                if b.stage_dirty:
                    b.stage_np.fill(-1)
                    b.stage_dirty = False
                if b.cpu_rows:  # last step's CPU rows back to 0
                    b.ycpu_h[b.cpu_rows] = 0.0
                    b.cpu_rows = []
            else:
                pre, pre_ev = (got[1], got[2]) if got is not None and got[0] == self._step else ({}, None)
                streamed, n_cpu, n_pcie, cpu_experts = self._serve_misses(li, layer, N, k, b, ids_l, hit, pre,
                                                                          pre_ev)
            if N == 1 and t.ex.prefetch_next and li + 1 < len(t.layer_ids) and t.next_moe.get(layer) is not None:
                self._prefetch_next(li + 1, b)
            if counting:
                # bytes: each distinct expert once (`streamed` holds the staged and the prefetched ones)
                t.count(N * k - n_cpu - n_pcie, n_cpu, n_pcie, N, layer=layer, cpu_experts=cpu_experts,
                        pcie_experts=len(streamed))

            def post():  # after piece B is launched: learn from this routing, admit, refresh the map
                swaps = admit(pol, li, ids_l)
                if swaps:
                    cache.begin_copies()  # victims may still be read by queued pieces
                    for sw in swaps:
                        dst = cache.slot(layer, sw.slot)
                        src = streamed.get(sw.admit)
                        if src is not None:  # it came up this step: copied on the device, not over PCIe again
                            t.pending[li][sw.admit] = cache.promote(layer, src, dst)
                        else:
                            t.pending[li][sw.admit] = cache.copy(layer, sw.admit, dst)
                    if counting:
                        t.count(0, 0, 0, 0, swaps=len(swaps))
                if t.poll(li, upload=False) or swaps:  # copies done (always, on the host): ready from now
                    self._upload(li, b)

            return post

        fn.bucket = "cpu_wait"
        return fn

    def _serve_misses(self, li: int, layer: int, N: int, k: int, b: _Buffers, ids_l: list, hit: list, pre: dict,
                      pre_ev) -> tuple[dict[int, int], int, int, int]:
        """A hand-off with misses: the plan's decision (strata.experts.pipeline.plan_handoff) carried out -- the
        PCIe share started into staging slots (or taken from the previous layer's prefetch), the CPU share
        computed now while piece H runs, the staging table and the CPU outputs written for piece B. Returns
        (expert -> staging slot, CPU pairs, PCIe pairs, distinct CPU experts)."""
        t = self.t
        pol, cache = t.policy, t.cache
        ring = cache.staging_for(layer)
        # ranks as the scores do (the coldest misses go to the CPU)
        dec = plan_handoff(ids_l, hit, N, k, pol.rank_keys(li), t.plan, prefetched=pre, ring=ring,
                           lane=t.lane is not None)
        stage = b.stage_np
        stage.fill(-1)
        streamed: dict[int, int] = {}  # expert -> staging slot
        if dec.stream:
            # Staging slots were last read by an earlier layer's piece B, which finished before piece A
            # of this layer (we waited for it), so the copies need not wait for the main stream.
            slots = cache.stage_slots(layer, len(dec.stream))
            streamed = dict(zip(dec.stream, slots))
            cache.wait(cache.copy_slots(layer, dec.stream, slots))  # piece B waits for them; the host does not
        for e in {e for h, e in zip(hit, ids_l) if not h and e in pre}:  # prefetched during the previous layer
            streamed.setdefault(e, pre[e])
        cpu_pairs = dec.cpu_pairs
        for p, e in enumerate(ids_l):
            if not hit[p]:
                s = streamed.get(e)
                if s is not None:
                    stage[p] = s
        b.stage_dirty = dec.pcie_pairs > 0
        if dec.prefetched_pairs:
            cache.wait(pre_ev)
            t.prefetch_used += dec.prefetched_pairs
        ycpu = b.ycpu_h
        if b.cpu_rows:  # last step's CPU rows back to 0 (one indexed write)
            ycpu[b.cpu_rows] = 0.0
        b.cpu_rows = []
        if cpu_pairs:  # computed now, on the host, while piece H runs on the GPU
            if N == 1:
                out = t.lane.run_experts(layer, b.x_h, [ids_l[p] for p in cpu_pairs])  # [n, d] float32
                rows = cpu_pairs
            else:
                by_expert: dict[int, list[int]] = {}
                for p in cpu_pairs:
                    by_expert.setdefault(ids_l[p], []).append(p)
                jobs = [(e, torch.tensor([p // k for p in ps])) for e, ps in by_expert.items()]
                out = t.lane.run(layer, b.x_h, jobs)  # [n, d] float32 in job order
                rows = [p for ps in by_expert.values() for p in ps]
            ycpu[rows] = out
            b.cpu_rows = rows
        return streamed, len(cpu_pairs), dec.pcie_pairs, len(dec.cpu)

    def _prefetch_next(self, nl: int, b: _Buffers) -> None:
        """Start copying the next MoE layer's predicted experts that its cache lacks into its staging ring (the
        urgent stream, as the layer's own misses). The ring holds 4k slots; between this allocation and the next
        layer's piece B at most 2k more are taken (its own misses, the prefetch after it), so none is reused
        early. The staging slots' last readers finished before this layer's piece A, as for a layer's own."""
        t, cache = self.t, self.t.cache
        nrow = t.policy.hit_row(nl)
        want = [e for e in dict.fromkeys(b.pred_np.tolist()) if nrow[e] < 0]
        if not want:
            return
        nlayer = t.layer_ids[nl]
        slots = cache.stage_slots(nlayer, len(want))
        ev = cache.copy_slots(nlayer, want, slots)
        self.prefetched[nl] = (self._step, dict(zip(want, slots)), ev)
        t.prefetch_issued += len(want)

    def _upload(self, li: int, b: _Buffers) -> None:
        """expert_map[li] from the policy's row, through this layer's pinned buffer (on the main stream: the
        next step's piece H of this layer reads it; this step's copy ran before we synced on this layer)."""
        t = self.t
        row = t.policy.expert_map()[li]
        layer = t.layer_ids[li]
        if b.map_h.numel() != row.shape[0]:
            b.map_h = torch.empty(row.shape[0], dtype=torch.int64, pin_memory=t.cuda)
        m = b.map_h.numpy()
        np.copyto(m, t.cache.pool_rows(layer, row))
        t.cache.map[li].copy_(b.map_h, non_blocking=True)
