"""The tiered backend's eager executor: one MoE layer of a prefill chunk or of an eager (ungraphed) decode step.

Per layer:

 1. (CUDA) ids and x start their copy to the host; the GPU computes every (token, choice) pair from the slot
    pool through the device `expert_map`, misses masked to zero (`gather_expert_ffn`: a few batched calls,
    no per-expert launches) -- queued before the host knows anything.
 2. Host sync #1: wait for ids/x on the host (the one sync of the decode step's hand-off).
 3. `plan_layer` (strata.experts.pipeline) decides: the host mirror of the map gives hits; misses are split by
    the plan (`--cpu-plan` per token, or the measured cost model: `CpuPlan.auto` for one token, `prefill_split`
    for a chunk) into a CPU share and experts streamed over PCIe; the policy observes the routing and admits
    experts within the swap budget.
 4. Copies (admissions into cache slots, streamed experts into the staging ring or, for a chunk, the chunk
    buffers: strata.experts.tiered_chunk) go out on the side stream; the main stream waits on their events and
    computes the streamed experts.
 5. The CPU lane computes its share on the host meanwhile; its results go back (pinned, async) and are
    scattered into the [N, k, d] outputs, summed in routing order in float32 (`combine`, as resident).

On a CPU-only machine the same tiers run with the "GPU" being the host (pool = host tensor, synchronous
copies), and every pair (hit, streamed, or the CPU lane's) is computed as the resident backend computes it on the
CPU (strata.experts.cpu_mirror), so logits equal it bit for bit whatever the cache holds.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from strata.experts.cpu_mirror import pool_fused, resident_rows
from strata.experts.pipeline import plan_layer
from strata.experts.resident import combine, expert_ffn, gather_pairs, reference_fallback
from strata.experts.tiered_chunk import prefetch, stream_chunk

# A chunk whose pairs number this many per expert (nearly every expert routed) prefetches the next layer's experts
PREFETCH_PAIRS_PER_EXPERT = 2
PAIRS_MAX = 64  # (token, choice) pairs up to which CUDA computes all pairs from the map before the host sync
# The CPU computes chunks per expert through qmatmul (the reference); tests turn the GPU's grouped path on there.
GROUPED_CHUNKS_ON_CPU = False


def by_expert(flat_ids: np.ndarray, pairs: np.ndarray | None = None) -> list[tuple[int, np.ndarray]]:
    """Pairs grouped by expert, in expert order: [(expert, flat pair indices)] for `pairs` (default: all) of
    flat_ids [N*k]. A stable radix sort on 16-bit ids (numpy sorts those in linear time; on int64 it merge-sorts,
    which was most of a long chunk's grouping time)."""
    if pairs is None:
        pairs = np.arange(flat_ids.size)
    if pairs.size == 0:
        return []
    ex = flat_ids[pairs]
    order = np.argsort(ex.astype(np.uint16) if flat_ids.size and int(ex.max()) < 65536 else ex, kind="stable")
    pairs, ex = pairs[order], ex[order]
    cut = np.flatnonzero(ex[1:] != ex[:-1]) + 1
    starts, ends = np.concatenate(([0], cut)).tolist(), np.concatenate((cut, [ex.size])).tolist()
    first = ex[starts].tolist()
    return [(e, pairs[a:b]) for e, a, b in zip(first, starts, ends)]


class EagerLayer:
    """Carries out one MoE layer's decision eagerly for a TieredExperts backend (`tiered`)."""

    def __init__(self, tiered):
        self.t = tiered
        self._pin_bufs: dict[str, torch.Tensor] = {}
        self._chunk = False  # this layer call is a chunk (grouped calls, chunk buffers)
        self._cpu_estimate_ms = 0.0  # the last chunk split's CPU lane, unscaled
        self._act = None  # this layer call's ExpertAct (None: plain SwiGLU experts)
        self._flat: np.ndarray | None = None  # this layer call's expert id of each pair [N*k]
        self._layer = -1  # this layer call's model layer
        self._fused: dict = {}  # a CPU's fused calls over the slot pools (strata.experts.cpu_mirror.pool_fused)

    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [N, d], ids/w [N, k] -> [N, d]."""
        N, k = ids.shape
        t = self.t
        li = t.index[layer]
        t.poll(li)
        cache, pool = t.cache, t.cache.pool_of[layer]
        d = x.shape[-1]
        row = t.policy.expert_map()[li].copy()  # [E] host mirror of the device map row: slot or -1
        self._act = t.acts.get(layer)
        self._layer = layer
        prof = t.profiler
        t_hits = prof.mark() if prof else None
        y = None  # [N*k, d] float32 on the device
        if t.cuda:
            # hits from the device map, queued before the host looks at the routing (no sync yet)
            ids_h = self._pinned("ids", ids)
            # a chunk copies x to the host only if its split gives the CPU a share (rare: priced serially below)
            x_h = self._pinned("x", x) if t.lane is not None and N * k <= PAIRS_MAX else None
            ready = torch.cuda.Event()
            ready.record()
            if N * k <= PAIRS_MAX:
                gslot = cache.map[li].index_select(0, ids.reshape(-1))  # [N*k]
                xs = x.repeat_interleave(k, dim=0)  # [N*k, d]
                flat = ids.reshape(-1)
                y = gather_pairs(xs, pool.gate, pool.up, pool.down, gslot, self._act, flat)  # misses (-1) give 0
            ready.synchronize()  # host sync #1: the routing (and x for the CPU lane) on the host
            ids_np = ids_h.numpy().copy()
        else:
            x_h = x
            ids_np = ids.numpy().copy()
        hit = row[ids_np] >= 0  # [N, k]
        self._flat = ids_np.reshape(-1)
        # a chunk: y gets a spare row past the pairs (grouped calls write their padding there), and the streamed
        # experts go through the chunk buffers
        # (not while the chunk buffers are lent to the cache: a decode step, which never needs them)
        self._chunk = y is None and self._grouped_chunks() and not cache.lent
        grouped = None
        if y is None:
            y = torch.zeros(N * k + 1, d, dtype=torch.float32, device=x.device)
            if self._grouped_chunks() and (not t.cuda or int(hit.sum()) > PAIRS_MAX):
                # the GPU idles from the routing's host sync to this launch: each pair's slot straight from the
                # map row, no grouping on the way
                sid = cache.pool_rows(layer, row)[ids_np].reshape(-1)
                self._grouped_sid(pool.gate, pool.up, pool.down, x, sid, y)
            else:
                grouped = [(e, p // k, p) for e, p in by_expert(ids_np.reshape(-1))]
                groups = self._select(grouped, lambda e: row[e] >= 0, lambda e: cache.slot(layer, int(row[e])))
                self._compute(pool, x, groups, y)
        if grouped is None:
            # every routed pair grouped by expert once; a layer's hit/miss is per expert, so the CPU share and the
            # streamed share are selections of these groups (a 4K chunk: ~32K pairs, sorted once)
            grouped = [(e, p // k, p) for e, p in by_expert(ids_np.reshape(-1))]
        if prof:
            prof.span("gpu_experts", t_hits)

        # misses: the CPU share, the PCIe share and the admissions, decided on the host (strata.experts.pipeline)
        # experts already copied ahead for this chunk (looked up only when something missed)
        pre = set(cache.chunk_stage(layer).peek(layer)) if self._chunk and not hit.all() else set()
        auto = t.ex.cpu_plan.strip() == "auto"
        dec = plan_layer(ids_np, row, t.policy, li, t.plan, hit=hit, prefetched=pre, costs=t.costs if auto else None,
                         cpu_scale=t.chunk_cpu_scale, serial=t.cuda)
        if dec.cpu_estimate_ms is not None:
            self._cpu_estimate_ms = dec.cpu_estimate_ms
        cpu_experts, stream, swaps = dec.cpu, set(dec.stream), dec.swaps
        cache.begin_copies()
        admitted: dict[int, tuple[int, object]] = {}
        stage = cache.chunk_stage(layer) if pre else None
        for sw in swaps:
            gs = cache.slot(layer, sw.slot)
            held = stage.held(layer, sw.admit) if stage is not None else None
            if held is not None:  # copied ahead into a chunk buffer for this chunk: into its slot on the device
                ev = cache.promote_row(layer, held[0], held[1], gs, after=held[2])
            else:
                ev = cache.copy(layer, sw.admit, gs)
            admitted[sw.admit] = (gs, ev)
            t.pending[li][sw.admit] = ev
        t_pcie = prof.mark() if prof else None
        if stream:
            self._stream(layer, pool, x, self._select(grouped, stream, int), admitted, y, t_pcie)
        if self._chunk and N * k >= PREFETCH_PAIRS_PER_EXPERT * t.n_experts and li + 1 < len(t.layer_ids):
            prefetch(t, li + 1)  # the next layer's copies run during this layer's rest and its attention
        if not t.cuda:
            t.poll(li)  # host copies are done: admitted experts are hits from the next step on
        elif swaps:
            cache.upload_map(li, t.policy.expert_map()[li])  # victims are misses from now on

        n_cpu = 0
        if cpu_experts:
            t_cpu = prof.mark() if prof else None
            groups = self._select(grouped, cpu_experts, int)
            jobs = [(e, torch.from_numpy(tok)) for e, tok, _ in groups]
            run = t.lane.run_chunk if N > 1 else t.lane.run  # a chunk at the lane's full thread count
            t0 = time.perf_counter()
            if x_h is None:
                x_h = x.to("cpu")
            out = run(layer, x_h, jobs)  # [P, d] float32 on the host
            if N > 1 and self._cpu_estimate_ms > 0:
                t.learn_chunk_cpu((time.perf_counter() - t0) * 1e3, self._cpu_estimate_ms)
                self._cpu_estimate_ms = 0.0
            idx = np.concatenate([p for _, _, p in groups])
            n_cpu = len(idx)
            if prof:
                prof.span("cpu_wait", t_cpu)
            y[self._to_dev(idx)] = self._to_dev(out)
        n_hit = int(hit.sum())
        # the lanes moved each distinct expert once for all the call's pairs (the stream includes the prefetched)
        t.count(n_hit, n_cpu, N * k - n_hit - n_cpu, N, swaps=len(swaps), layer=layer,
                cpu_experts=len(cpu_experts), pcie_experts=len(stream))
        return combine(y[:N * k].view(N, k, d), w, x.dtype)

    # --- helpers --------------------------------------------------------------------------------------------
    def _pinned(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """t (device) copied into a reusable pinned host buffer, asynchronously."""
        buf = self._pin_bufs.get(name)
        if buf is None or buf.numel() < t.numel() or buf.dtype != t.dtype:
            buf = torch.empty(max(t.numel(), 1 << 16), dtype=t.dtype, pin_memory=True)
            self._pin_bufs[name] = buf
        out = buf[: t.numel()].view(t.shape)
        out.copy_(t, non_blocking=True)
        return out

    def _to_dev(self, a) -> torch.Tensor:
        """A host array/tensor on the device; on CUDA through pinned memory, asynchronously (a pageable copy
        could wait for the stream, and with it for the GPU work this layer queued to overlap the CPU lane)."""
        t = torch.from_numpy(a) if isinstance(a, np.ndarray) else a
        if not self.t.cuda:
            return t
        return t.pin_memory().to(self.t.device, non_blocking=True)

    @staticmethod
    def _select(grouped, experts, key) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """The groups of `experts` (a set, or a predicate on the expert id) from a layer's `grouped` pairs."""
        keep = experts if callable(experts) else experts.__contains__
        return [(key(e), t, p) for e, t, p in grouped if keep(e)]

    def _compute(self, pool, x: torch.Tensor, groups, y: torch.Tensor) -> None:
        """On the device: groups [(slot, token idx, pair idx)] -> y[pair idx] (float32)."""
        if not groups:
            return
        n_pairs = sum(len(p) for _, _, p in groups)
        if self.t.cuda and n_pairs <= PAIRS_MAX:  # decode-sized: one grouped call over all pairs
            slots = np.concatenate([np.full(len(p), s) for s, _, p in groups])
            tok = np.concatenate([t for _, t, _ in groups])
            pairs = np.concatenate([p for _, _, p in groups])
            st = self._to_dev(np.stack([slots, tok, pairs]))
            eids = self._to_dev(self._flat[pairs]) if self._act is not None else None
            y[st[2]] = gather_pairs(x.index_select(0, st[1]), pool.gate, pool.up, pool.down, st[0], self._act, eids)
            return
        if self._grouped_chunks():  # chunk-sized: these slots' pairs in one grouped call (batched matmuls)
            self.grouped(pool.gate, pool.up, pool.down, x, groups, y)
            return
        if not self.t.cuda:  # the host: each pair as the resident backend computes it here (cpu_mirror)
            layer = self._layer
            fused = pool_fused(self._fused, pool, self.t.store[layer], self._act)
            groups_t = [(s, int(self._flat[p[0]]), torch.from_numpy(tok)) for s, tok, p in groups]
            out = resident_rows(x, groups_t, pool.expert, fused, self._act)
            y[torch.from_numpy(np.concatenate([p for _, _, p in groups]))] = out
            return
        if self._act is not None:
            reference_fallback("tiered experts (chunk)")
        for s, tok, pairs in groups:  # chunk-sized: a matmul per expert over its tokens
            ti = self._to_dev(tok)
            e = int(self._flat[pairs[0]]) if self._act is not None else None  # (a group is one expert's pairs)
            y[self._to_dev(pairs)] = expert_ffn(x.index_select(0, ti), *pool.expert(s), self._act, e).float()

    def _grouped_chunks(self) -> bool:
        # the grouped calls (and the chunk buffers they read) compute plain SwiGLU experts only
        return (self.t.cuda or GROUPED_CHUNKS_ON_CPU) and self._act is None

    def grouped(self, gate, up, down, x: torch.Tensor, groups, y: torch.Tensor) -> None:
        """groups [(slot of the stacks, token idx, pair idx)] computed in one grouped call, written into their
        rows of y ([N*k + 1, d]: the last row takes the padding). The pair counts per slot are known here, so
        nothing waits for the GPU: copies and compute of successive calls stay queued."""
        from strata.ops.moe_prefill import grouped_expert_ffn

        N = x.shape[0]
        k = (y.shape[0] - 1) // N
        sid = np.full(N * k, -1, dtype=np.int64)  # [N*k] slot of each pair computed here, -1 elsewhere
        counts = [0] * gate.shape[0]
        for s, _, pairs in groups:
            sid[pairs] = s
            counts[s] += len(pairs)
        grouped_expert_ffn(x, gate, up, down, self._to_dev(sid).view(N, k), counts=counts, out=y)

    def _grouped_sid(self, gate, up, down, x: torch.Tensor, sid: np.ndarray, y: torch.Tensor) -> None:
        """`grouped` from each pair's slot (sid [N*k], -1: not computed here); the counts from a bincount."""
        from strata.ops.moe_prefill import grouped_expert_ffn

        N = x.shape[0]
        on = sid[sid >= 0]
        counts = np.bincount(on, minlength=gate.shape[0]).tolist() if on.size else [0] * gate.shape[0]
        grouped_expert_ffn(x, gate, up, down, self._to_dev(sid).view(N, -1), counts=counts, out=y)

    def _stream(self, layer: int, pool, x, groups, admitted, y, t_pcie) -> None:
        """Copy the streamed experts (groups: [(expert, tokens, pairs)]; admitted ones into their cache slot,
        others through the staging ring, in batches that overlap the next batch's copy with this one's compute)
        and compute them on the device."""
        be = self.t
        cache = be.cache
        pre = cache.chunk_stage(layer).prefetched_for(layer) if self._chunk else None
        pre_idx = pre.index if pre is not None else {}
        # an expert already copied ahead for this chunk is computed from the chunk buffer, admitted or not
        in_slot = [(e, t, p) for e, t, p in groups if e in admitted and e not in pre_idx]
        staged = [(e, t, p) for e, t, p in groups if e not in admitted or e in pre_idx]
        waited = False
        if in_slot:
            for e, _, _ in in_slot:
                cache.wait(admitted[e][1])
            waited = True
            self._compute(pool, x, [(admitted[e][0], t, p) for e, t, p in in_slot], y)
        if self._chunk and (pre is not None or len(staged) > cache.staging_for(layer)):
            stream_chunk(self, layer, x, staged, y, t_pcie, waited, pre)
            return
        ring = cache.staging_for(layer)
        batch = ring if len(staged) <= ring else max(1, ring // 2)
        batches = [staged[i:i + batch] for i in range(0, len(staged), batch)]
        issued: list = []  # per batch: (slot groups, events)

        def issue(b):
            slots = cache.stage_slots(layer, len(b))
            evs = [cache.copy(layer, e, s) for (e, _, _), s in zip(b, slots)]
            return [(s, t, p) for s, (_, t, p) in zip(slots, b)], evs

        if batches:
            issued.append(issue(batches[0]))
        for i in range(len(batches)):
            if i + 1 < len(batches):
                issued.append(issue(batches[i + 1]))  # the ring's other half; its readers ran before begin_copies
            g, evs = issued[i]
            for ev in evs:
                cache.wait(ev)
            if be.profiler and not waited:
                be.profiler.span("pcie_wait", t_pcie)
                waited = True
            self._compute(pool, x, g, y)
            if i + 2 < len(batches):
                cache.begin_copies()  # the next copy into this half waits for this compute
        if be.profiler and not waited:
            be.profiler.span("pcie_wait", t_pcie)
