"""Tiered expert execution: hot experts in a VRAM slot cache, every expert in host RAM, misses on the CPU or
streamed over PCIe, all behind `forward(layer, x, ids, w)`.

Per MoE layer and step (one forward of the engine):

 1. (CUDA) ids and x start their copy to the host; the GPU computes every (token, choice) pair from the slot
    pool through the device `expert_map`, misses masked to zero (`gather_expert_ffn`: a few batched calls,
    no per-expert launches) -- queued before the host knows anything.
 2. Host sync #1: wait for ids/x on the host (the one sync of the decode step's hand-off).
 3. The host mirror of the map gives hits; misses are split by the plan (`--cpu-plan` per token, or the
    measured cost model: `CpuPlan.auto` for one token, `prefill_split` for a chunk) into a CPU share and
    experts streamed over PCIe. The policy observes the routing and admits experts within the swap budget.
 4. Copies (admissions into cache slots, streamed experts into the staging ring) go out on the side stream;
    the main stream waits on their events and computes the streamed experts.
 5. The CPU lane computes its share on the host meanwhile; its results go back (pinned, async) and are
    scattered into the [N, k, d] outputs, summed in routing order in float32 (`combine`, as resident).

On a CPU-only machine the same tiers run with the "GPU" being the host (pool = host tensor, synchronous
copies), and hits are computed per expert exactly as the resident backend does, so logits match it.

The model begins each step (`begin_step(ctx)`, strata.experts.backend). `stats` counts every lookup (hits + cpu +
pcie = lookups); `profiler` (with --profile) is the StepProfiler the model also feeds (attention, dense) and
`profile_report()` renders it (GPU buckets come from CUDA events, resolved with one sync per step).
"""

from __future__ import annotations

import atexit
import logging
import time
from typing import Callable

import numpy as np
import torch

from strata import StrataError
from strata.config import EngineConfig, env
from strata.experts.backend import StepContext, StepProfiler
from strata.experts.cache import ExpertCache, budget_slots, cap_to_budget
from strata.experts.cpu_lane import CpuLane
from strata.experts.plan import CostModel, CpuPlan
from strata.experts.policy import CachePolicy, make_policy
from strata.experts.profile import RoutingProfile, layer_slots, warm_policy
from strata.experts.resident import ExpertWeights, combine, expert_ffn
from strata.experts.stats import ExpertStats, StepProfile
from strata.experts.store import ExpertStore
from strata.experts.tiered_chunk import prefetch, stream_chunk
from strata.experts.tiered_decode import GraphedDecode
from strata.experts.tuner import LaneSetting, PlanTuner, lane_candidates
from strata.ops.expert_gather import gather_expert_ffn

log = logging.getLogger("strata")

# A chunk whose pairs number this many per expert (nearly every expert routed) prefetches the next layer's experts
PREFETCH_PAIRS_PER_EXPERT = 2
PAIRS_MAX = 64  # (token, choice) pairs up to which CUDA computes all pairs from the map before the host sync
# The CPU computes chunks per expert through qmatmul (the reference); tests turn the GPU's grouped path on there.
GROUPED_CHUNKS_ON_CPU = False


def _all_cpu_zero(text: str) -> bool:
    t = text.replace(",", "").strip()
    return bool(t) and set(t) == {"0"}


def by_expert(flat_ids: np.ndarray, pairs: np.ndarray | None = None) -> list[tuple[int, np.ndarray]]:
    """Pairs grouped by expert, in expert order: [(expert, flat pair indices)] for `pairs` (default: all) of
    flat_ids [N*k]. A stable radix sort on 16-bit ids (numpy sorts those in linear time; on int64 it merge-sorts:
    2.2 of the 3.8 ms a 4K chunk's grouping took on the development machine)."""
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


class TieredExperts:
    """The tiered experts backend (an `ExpertsBackend`). layers: model layer -> ExpertWeights on the host (mapped file views).

    policy: a factory (n_layers, n_experts, slots) -> CachePolicy used instead of --cache-policy.
    cpu_kernel: the CPU lane's kernel (auto | native | int4 | ref; default --cpu-kernel); cost_model: use these costs for `--cpu-plan auto`
    instead of measuring (or loading the machine's cached measurement); staging: slots of the ring that
    streamed experts land in (default max(2k, 8)).
    """

    sizes_cache = True

    def __init__(self, layers: dict[int, ExpertWeights], cfg: EngineConfig, *, cpu_kernel: str | None = None,
                 cost_model: CostModel | None = None, staging: int | None = None, progress: bool = True,
                 policy: Callable[..., CachePolicy] | None = None):
        self.cfg, self.ex = cfg, cfg.experts
        self.device, self.dtype = cfg.torch_device, cfg.torch_dtype
        self.cuda = self.device.type == "cuda"
        self.progress = progress
        self._staging = staging
        self._make_policy = policy
        self.store = ExpertStore(layers, pin=None if self.cuda else False, low_ram=self.ex.low_ram, progress=progress)
        self.layer_ids = self.store.layer_ids
        self.index = {layer: li for li, layer in enumerate(self.layer_ids)}
        self.n_experts = self.store.n_experts
        self.lane: CpuLane | None = None
        if not _all_cpu_zero(self.ex.cpu_plan):  # a plan that never uses the CPU needs no lane (nor repacking)
            self.lane = CpuLane(self.store.layers, self.ex.cpu_threads, cpu_kernel or self.ex.cpu_kernel, self.dtype)
            if not self.ex.low_ram:
                self.lane.prepare(progress=progress)
        self.costs = cost_model
        self.stats = ExpertStats()  # cumulative
        self.request = ExpertStats()  # since begin_request()
        self.profile = StepProfile()
        self.profiling = bool(self.ex.profile)
        self.profiler = StepProfiler(self.profile, self.device) if self.profiling else None
        self._deferred: StepContext | None = None  # a step begun before the cache was set up
        self.cache: ExpertCache | None = None  # set up at the first forward, once KV and buffers exist
        self.policy = None
        self.plan: CpuPlan | None = None
        self.tuner: PlanTuner | None = None  # --cpu-plan auto on a GPU: decode steps pick among candidate plans
        self._tuner_misses = 0  # CPU + PCIe misses counted when the tuner last timed a step
        self.k = 0
        self._pending: list[dict[int, object]] = [{} for _ in self.layer_ids]  # li -> expert -> copy event
        self._loaded_profile: RoutingProfile | None = None
        self._pin_bufs: dict[str, torch.Tensor] = {}
        self._saved = False
        self._chunk = False  # this layer call is a chunk (grouped calls, chunk buffers)
        # measured / estimated time of the CPU lane on chunks (--cpu-plan auto): the split prices the CPU with it
        self.chunk_cpu_scale = 1.0
        self._cpu_estimate_ms = 0.0  # the last chunk split's CPU lane, unscaled
        self.graphed = GraphedDecode(self)
        self.next_moe: dict[int, object] = {}  # MoE layer -> the next MoE layer's block (its router predicts)
        self.prefetch_issued = self.prefetch_used = 0  # decode: next-layer experts copied ahead / then routed to

    def set_routers(self, moes: dict) -> None:
        """The model's MoE blocks by layer: with --expert-prefetch, each layer's input also goes through the next
        MoE layer's router (`route_ids`) to start that layer's likely misses early."""
        layers = sorted(moes)
        self.next_moe = {a: moes[b] for a, b in zip(layers, layers[1:])}

    # --- set-up -----------------------------------------------------------------------------------------------
    def setup(self, k: int, act_bytes: int = 0) -> None:
        """Size and fill the cache, pick the plan. Called by the first forward (or by the engine after it
        allocated the KV cache, so the VRAM budget sees it, with the VRAM its prefill chunk needs)."""
        if self.cache is not None:
            return
        self.k = k
        staging = self._staging or max(2 * k, 8)
        if self.ex.prefetch_next:  # a layer's own stream, the next layer's prefetch and its own: 3k in flight
            staging = max(staging, 4 * k)
        slots, chunk = budget_slots(self.ex, self.store, self.device, staging, act_bytes)
        L, E = len(self.layer_ids), self.n_experts
        if self.ex.cache_layout == "profile":  # the same bytes, spread over the layers as the profile routes
            if not self.ex.expert_profile:
                raise StrataError("--cache-layout profile needs a routing profile (--expert-profile FILE)")
            prof = RoutingProfile.load(self.ex.expert_profile, L, E)
            sizes = [self.store.expert_nbytes(i) for i in self.layer_ids]
            slots = layer_slots(prof.counts, sum(slots * b for b in sizes), sizes)
        self.cache = ExpertCache(self.store, slots, staging, self.device, chunk_experts=chunk)
        if self.cuda and self.ex.vram_gb is not None and env("STRATA_ALLOC_CAP", "1") != "0":
            cap = cap_to_budget(self.device, self.ex.vram_gb)
            log.info("strata: torch's allocator held to %.2f GiB of the %g GiB budget", cap, self.ex.vram_gb)
        kw = dict(swap_budget=self.ex.swap_budget)
        if self.ex.cache_policy == "lfu-decay":
            kw["promote_min"] = self.ex.promote_min
        if self._make_policy is not None:
            self.policy = self._make_policy(L, E, slots)
        else:
            self.policy = make_policy(self.ex.cache_policy, L, E, slots, **kw)
        if self.ex.cpu_plan.strip() == "auto":
            if self.costs is None:
                from strata.experts.costs import cost_model_for

                self.costs = cost_model_for(self)
            self.plan = self.costs.cpu_plan(k)
            if self.ex.plan_tune and self.cuda and self.lane is not None:
                # the model's plan, then what the first decode steps measure (strata.experts.tuner)
                native = "native" in self.lane.kernel.values()
                self.tuner = PlanTuner(lane_candidates(self.plan, k, self.lane.threads, native), trial=20, rounds=2)
        else:
            self.plan = CpuPlan.parse(self.ex.cpu_plan, k)
        if self.lane is None and any(self.plan.shares):
            raise StrataError("internal: the CPU lane is off but the plan uses the CPU")
        log.info("strata: expert cache %s slots/layer (%.2f GiB), plan %s, CPU kernel %s", slots,
                 self.cache.nbytes() / 2**30, self.plan,
                 ",".join(sorted(set(self.lane.kernel.values()))) if self.lane else "-")
        if self.ex.expert_profile:
            self.load_profile(self.ex.expert_profile)
        if self.ex.expert_profile_save:
            atexit.register(self.close)

    def max_graph_batch(self, k: int) -> int:
        """Decoding sequences one graphed step may take: within the grouped kernel's pair count, and without a
        CPU lane within the staging ring (every miss must then cross PCIe)."""
        n = max(1, PAIRS_MAX // max(k, 1))
        if self.lane is None:
            n = min(n, max(1, (self._staging or max(2 * k, 8)) // max(k, 1)))
        return n

    def load_profile(self, path) -> None:
        """Fill the cache from a routing profile: each layer's top-ranked experts copied in before serving."""
        prof = RoutingProfile.load(path, len(self.layer_ids), self.n_experts)
        warm_policy(self.policy, prof)
        self._loaded_profile = prof
        self.cache.begin_copies()
        for li, layer in enumerate(self.layer_ids):
            for e, slot in self.policy.resident(li).items():
                self.cache.copy(layer, e, self.cache.slot(layer, slot))
            self.cache.upload_map(li, self.policy.expert_map()[li])
        if self.cuda:
            self.cache.side.synchronize()

    def routing_profile(self) -> RoutingProfile:
        """What was routed so far (merged with the profile the cache was filled from)."""
        # counts per routed token (a prefill chunk is many tokens in one policy step)
        prof = RoutingProfile(self.policy.n_layers, self.n_experts, self.policy.usage(), tokens=self.stats.tokens,
                              model=self.cfg.model or "")
        return prof.merge(self._loaded_profile) if self._loaded_profile is not None else prof

    def save_profile(self, path=None) -> None:
        """Write the learned routing profile atomically (to --expert-profile-save by default)."""
        path = path or self.ex.expert_profile_save
        if path and self.policy is not None:
            self.routing_profile().save(path)

    def close(self) -> None:
        if not self._saved and self.ex.expert_profile_save:
            self._saved = True
            self.save_profile()

    # --- requests and steps -----------------------------------------------------------------------------------
    def begin_request(self) -> ExpertStats:
        """Start counting a new request; returns the finished one's counts."""
        done, self.request = self.request, ExpertStats()
        return done

    def begin_step(self, ctx: StepContext) -> None:
        """A step starts: the policy ages, the tuner times decode steps, the counts and the profile go on."""
        if self.cache is None:  # set up by the first MoE layer (k is known there); the step begins then
            self._deferred = ctx
            return
        if ctx.graphed:
            self.graphed.new_step()
        if ctx.counting:
            self._begin_step(ctx)

    def _begin_step(self, ctx: StepContext) -> None:
        n_tokens = ctx.n_tokens
        if self.tuner is not None and not self.tuner.done:
            if n_tokens == 1 and ctx.timed:  # a decode step: time it
                misses = self.stats.cpu + self.stats.pcie  # the previous step's are all counted by now
                self._apply(self.tuner.step(time.perf_counter(), misses - self._tuner_misses))
                self._tuner_misses = misses
            else:
                self.tuner.interrupt()
        self.policy.tick()
        self.stats.add(tokens=n_tokens)
        self.request.add(tokens=n_tokens)
        # with decode graphs the profile is of graphed decode steps (timed per piece), not of prefill chunks
        if self.profiler is not None and ctx.timed:
            self.profiler.resolve()
            self.profile.add_tokens(n_tokens)

    def _apply(self, setting) -> None:
        """A tuner candidate: a CpuPlan, or a LaneSetting (plan and the CPU lane's threads)."""
        if isinstance(setting, LaneSetting):
            if setting.threads and self.lane is not None and setting.threads != self.lane.threads:
                self.lane.set_threads(setting.threads)
            setting = setting.plan
        self.plan = setting

    def _poll(self, li: int, upload: bool = True) -> bool:
        """Mark experts whose copy finished as ready (event.query(): no sync); returns whether any was."""
        pend = self._pending[li]
        if not pend:
            return False
        done = [e for e, ev in pend.items() if ev is None or ev.query()]
        for e in done:
            del pend[e]
            self.policy.mark_ready(li, e)
        if done and upload:
            self.cache.upload_map(li, self.policy.expert_map()[li])
        return bool(done)

    def profile_report(self, measured_ms: float | None = None) -> str:
        """The per-token time breakdown (with --profile), '' otherwise."""
        return self.profiler.report(measured_ms) if self.profiler is not None else ""

    # --- the MoE layer --------------------------------------------------------------------------------------------
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
        if not self.cuda:
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                ctx: StepContext) -> torch.Tensor:
        N, k = ids.shape
        if self.cache is None:
            self.setup(k)
        if self._deferred is not None:
            begun, self._deferred = self._deferred, None
            self.begin_step(begun)
        if ctx.graphed and N * k <= PAIRS_MAX:
            return self.graphed.forward(ctx, layer, x, ids, w)
        li = self.index[layer]
        self._poll(li)
        cache, pool = self.cache, self.cache.pool_of[layer]
        d = x.shape[-1]
        row = self.policy.expert_map()[li].copy()  # [E] host mirror of the device map row: slot or -1
        prof = self.profiler
        t_hits = prof.mark() if prof else None
        y = None  # [N*k, d] float32 on the device
        if self.cuda:
            # hits from the device map, queued before the host looks at the routing (no sync yet)
            ids_h = self._pinned("ids", ids)
            # a chunk copies x to the host only if its split gives the CPU a share (rare: priced serially below)
            x_h = self._pinned("x", x) if self.lane is not None and N * k <= PAIRS_MAX else None
            ready = torch.cuda.Event()
            ready.record()
            if N * k <= PAIRS_MAX:
                gslot = cache.map[li].index_select(0, ids.reshape(-1))  # [N*k]
                xs = x.repeat_interleave(k, dim=0)  # [N*k, d]
                y = gather_expert_ffn(xs, pool.gate, pool.up, pool.down, gslot)  # misses (-1) give 0
            ready.synchronize()  # host sync #1: the routing (and x for the CPU lane) on the host
            ids_np = ids_h.numpy().copy()
        else:
            x_h = x
            ids_np = ids.numpy().copy()
        hit = row[ids_np] >= 0  # [N, k]
        # a chunk: y gets a spare row past the pairs (grouped calls write their padding there), and the streamed
        # experts go through the chunk buffers
        self._chunk = y is None and self._grouped_chunks()
        grouped = None
        if y is None:
            y = torch.zeros(N * k + 1, d, dtype=torch.float32, device=x.device)
            if self._grouped_chunks() and (not self.cuda or int(hit.sum()) > PAIRS_MAX):
                # the GPU idles from the routing's host sync to this launch: each pair's slot straight from the
                # map row, no grouping on the way
                sid = np.where(row >= 0, cache.slot(layer, 0) + row.astype(np.int64), -1)[ids_np].reshape(-1)
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

        # misses: CPU share and PCIe share
        cpu_experts, stream = self._split(li, ids_np, hit)
        pol = self.policy
        pol.observe(li, ids_np.reshape(-1))
        swaps = pol.plan_swaps(li)
        pol.commit(li, swaps)
        cache.begin_copies()
        admitted: dict[int, tuple[int, object]] = {}
        for sw in swaps:
            gs = cache.slot(layer, sw.slot)
            admitted[sw.admit] = (gs, cache.copy(layer, sw.admit, gs))
            self._pending[li][sw.admit] = admitted[sw.admit][1]
        t_pcie = prof.mark() if prof else None
        if stream:
            self._stream(layer, pool, x, self._select(grouped, stream, int), admitted, y, t_pcie)
        if self._chunk and N * k >= PREFETCH_PAIRS_PER_EXPERT * self.n_experts and li + 1 < len(self.layer_ids):
            prefetch(self, li + 1)  # the next layer's copies run during this layer's rest and its attention
        if not self.cuda:
            self._poll(li)  # host copies are done: admitted experts are hits from the next step on
        elif swaps:
            cache.upload_map(li, pol.expert_map()[li])  # victims are misses from now on

        n_cpu = 0
        if cpu_experts:
            t_cpu = prof.mark() if prof else None
            groups = self._select(grouped, cpu_experts, int)
            jobs = [(e, torch.from_numpy(tok)) for e, tok, _ in groups]
            run = self.lane.run_chunk if N > 1 else self.lane.run  # a chunk at the lane's full thread count
            t0 = time.perf_counter()
            if x_h is None:
                x_h = x.to("cpu")
            out = run(layer, x_h, jobs)  # [P, d] float32 on the host
            if N > 1 and self._cpu_estimate_ms > 0:
                self._learn_chunk_cpu((time.perf_counter() - t0) * 1e3)
            idx = np.concatenate([p for _, _, p in groups])
            n_cpu = len(idx)
            if prof:
                prof.span("cpu_wait", t_cpu)
            y[self._to_dev(idx)] = self._to_dev(out)
        n_hit = int(hit.sum())
        counts = dict(hits=n_hit, cpu=n_cpu, pcie=N * k - n_hit - n_cpu, swaps=len(swaps), layers=N)
        self.stats.add(**counts)
        self.request.add(**counts)
        return combine(y[:N * k].view(N, k, d), w, x.dtype)

    # --- helpers --------------------------------------------------------------------------------------------
    def _learn_chunk_cpu(self, measured_ms: float) -> None:
        """Fold a chunk's measured CPU lane time into the split's price of the CPU (a running geometric mean of
        measured / estimated). The one-token costs come from decode-sized calls; on the H200 machine a 4K
        prompt's CPU share then took ~40 ms a layer where it was priced at a few, and the GPU idled meanwhile
        (2,104 tok/s against 6,333 streaming everything). Once the CPU is priced out it gets no more chunk work,
        so the price stays: chunks stream."""
        ratio = min(max(measured_ms / self._cpu_estimate_ms, 0.05), 1e4)
        self.chunk_cpu_scale = float(self.chunk_cpu_scale ** 0.25 * ratio ** 0.75)  # mostly the latest
        self._cpu_estimate_ms = 0.0

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
        if self.cuda and n_pairs <= PAIRS_MAX:  # decode-sized: one grouped call over all pairs
            slots = np.concatenate([np.full(len(p), s) for s, _, p in groups])
            tok = np.concatenate([t for _, t, _ in groups])
            pairs = np.concatenate([p for _, _, p in groups])
            st = self._to_dev(np.stack([slots, tok, pairs]))
            y[st[2]] = gather_expert_ffn(x.index_select(0, st[1]), pool.gate, pool.up, pool.down, st[0])
            return
        if self._grouped_chunks():  # chunk-sized: these slots' pairs in one grouped call (batched matmuls)
            self._grouped(pool.gate, pool.up, pool.down, x, groups, y)
            return
        for s, tok, pairs in groups:  # chunk-sized: a matmul per expert over its tokens
            ti = self._to_dev(tok)
            y[self._to_dev(pairs)] = expert_ffn(x.index_select(0, ti), *pool.expert(s)).float()

    def _grouped_chunks(self) -> bool:
        return self.cuda or GROUPED_CHUNKS_ON_CPU

    def _grouped(self, gate, up, down, x: torch.Tensor, groups, y: torch.Tensor) -> None:
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
        """`_grouped` from each pair's slot (sid [N*k], -1: not computed here); the counts from a bincount."""
        from strata.ops.moe_prefill import grouped_expert_ffn

        N = x.shape[0]
        on = sid[sid >= 0]
        counts = np.bincount(on, minlength=gate.shape[0]).tolist() if on.size else [0] * gate.shape[0]
        grouped_expert_ffn(x, gate, up, down, self._to_dev(sid).view(N, -1), counts=counts, out=y)

    def _split(self, li: int, ids_np: np.ndarray, hit: np.ndarray) -> tuple[set[int], set[int]]:
        """Missed experts -> (computed on the CPU, streamed over PCIe)."""
        miss = ~hit
        if not miss.any():
            return set(), set()
        N = ids_np.shape[0]
        missed = ids_np[miss]
        # experts already copied ahead for this chunk cost no PCIe: they are computed on the GPU
        pre = set(self.cache.chunk_stage(self.layer_ids[li]).peek(self.layer_ids[li])) if self._chunk else set()
        if self.ex.cpu_plan.strip() == "auto" and N > 1:
            counts = np.bincount(ids_np.reshape(-1), minlength=self.n_experts)
            used = np.flatnonzero(counts)
            tpe = dict(zip(used.tolist(), counts[used].tolist()))
            split = self.costs.prefill_split(tpe, resident=set(np.unique(ids_np[hit]).tolist()) | pre,
                                             cpu_scale=self.chunk_cpu_scale, serial=self.cuda)
            self._cpu_estimate_ms = split.cpu_ms / max(self.chunk_cpu_scale, 1e-9)  # unscaled: for the update
            return set(split.cpu), set(split.stream) | (pre & set(missed.tolist()))
        scores = self.policy.scores(li)
        if N > 1:
            cpu, stream = self.plan.split_rows(ids_np, miss, scores)
            moved = cpu & pre
            return cpu - moved, stream | moved
        stream: set[int] = set()
        for t in range(N):
            _, pcie = self.plan.choose(ids_np[t][miss[t]].tolist(), scores)
            stream.update(pcie)
        cpu = set(missed.tolist()) - stream
        return cpu, stream

    def _stream(self, layer: int, pool, x, groups, admitted, y, t_pcie) -> None:
        """Copy the streamed experts (groups: [(expert, tokens, pairs)]; admitted ones into their cache slot,
        others through the staging ring, in batches that overlap the next batch's copy with this one's compute)
        and compute them on the device."""
        cache = self.cache
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
            if self.profiler and not waited:
                self.profiler.span("pcie_wait", t_pcie)
                waited = True
            self._compute(pool, x, g, y)
            if i + 2 < len(batches):
                cache.begin_copies()  # the next copy into this half waits for this compute
        if self.profiler and not waited:
            self.profiler.span("pcie_wait", t_pcie)
