"""Tiered expert execution: hot experts in a VRAM slot cache, every expert in host RAM, misses on the CPU or
streamed over PCIe, all behind the `ExpertsBackend` interface (strata.experts.backend).

This module holds the backend's state and its set-up: the host store, the VRAM cache and its policy, the plan
(and the tuner that may change it between decode steps), the CPU lane, the statistics (counted here, in
`count`, for every path), the profile and routing profiles. Each MoE layer's decision is taken in
strata.experts.pipeline and carried out by an executor:

    eager layer      strata.experts.tiered_eager    prefill chunks (with tiered_chunk's chunk buffers), eager decode
    graphed decode   strata.experts.tiered_decode   one-token steps cut into CUDA-graph pieces around the hand-off

The model begins each step (`begin_step(ctx)`). `stats` counts every lookup (hits + cpu + pcie = lookups);
`profiler` (with --profile) is the StepProfiler the model also feeds (attention, dense) and `profile_report()`
renders it (GPU buckets come from CUDA events, resolved with one sync per step).
"""

from __future__ import annotations

import atexit
import logging
import time
from contextlib import nullcontext
from dataclasses import replace
from typing import Callable

import numpy as np
import torch

from strata import StrataError
from strata.config import EngineConfig, alloc_cap_enabled
from strata.experts.backend import StepContext, StepProfiler
from strata.experts.cache import ExpertCache, budget_slots, cap_to_budget
from strata.experts.cpu_lane import CpuLane
from strata.experts.plan import NO_PCIE_TRIAL, CostModel, CpuPlan, decode_path, handoff_after_tuning
from strata.experts.policy import CachePolicy, make_policy
from strata.experts.profile import RoutingProfile, layer_slots, warm_policy
from strata.experts.resident import ExpertWeights
from strata.experts.sizing import VramSplit, staging_slots
from strata.experts.stats import ExpertStats, StepProfile
from strata.experts.store import ExpertStore
from strata.experts.tiered_decode import GraphedDecode
from strata.experts.tiered_direct import DirectDecode, supported as direct_supported
from strata.experts.loan import end_activation_loan, loan_tested, loan_turn, prefill_loan_slots
from strata.experts.tiered_eager import PAIRS_MAX, EagerLayer
from strata.experts.tuner import LaneSetting, PlanTuner, lane_candidates

log = logging.getLogger("strata")

def _all_cpu_zero(text: str) -> bool:
    t = text.replace(",", "").strip()
    return bool(t) and set(t) == {"0"}


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
        self._handoff_chosen = False  # `auto` found the hand-off faster on this machine (plan.decode_path)
        # bumped when the decode path changes after captures may exist (the tuner's verdict): graphs recapture
        self.path_epoch = 0
        self._to_direct: str | None = None  # the tuner's verdict for the staged path, taken when at rest
        self._switch_ready = False  # at_rest() came after the verdict: the next step switches
        self.path_reason = ""  # why the decode path changed (or stayed) after the tuner's trials
        self.loans = 0  # prompts that borrowed the lent chunk buffers back
        self.loan_ms = 0.0  # the time those borrows took, waits included
        self._make_policy = policy
        self.store = ExpertStore(layers, pin=None if self.cuda else False, low_ram=self.ex.low_ram, progress=progress)
        self.layer_ids = self.store.layer_ids
        # biases and activation of experts that are not plain SwiGLU, whole on the device (by expert id, not slot)
        self.acts = {i: ew.act.to(self.device) for i, ew in layers.items() if ew.act is not None}
        self.index = {layer: li for li, layer in enumerate(self.layer_ids)}
        self.n_experts = self.store.n_experts
        # bytes of one expert per layer (a layer's experts all have the same formats and shapes): what a miss moves
        self.expert_bytes = {layer: self.store.expert_nbytes(layer) for layer in self.layer_ids}
        self.lane: CpuLane | None = None
        if not _all_cpu_zero(self.ex.cpu_plan):  # a plan that never uses the CPU needs no lane (nor repacking)
            self.lane = CpuLane(self.store.layers, self.ex.cpu_threads, cpu_kernel or self.ex.cpu_kernel, self.dtype,
                                host=not self.cuda)
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
        self.vram_split: VramSplit | None = None  # how setup divided the VRAM budget
        self.policy = None
        self.plan: CpuPlan | None = None
        self.tuner: PlanTuner | None = None  # --cpu-plan auto on a GPU: decode steps pick among candidate plans
        self._tuner_misses = 0  # CPU + PCIe misses counted when the tuner last timed a step
        self.k = 0
        self.pending: list[dict[int, object]] = [{} for _ in self.layer_ids]  # li -> expert -> copy event
        self._loaded_profile: RoutingProfile | None = None
        self._saved = False
        # measured / estimated time of the CPU lane on chunks (--cpu-plan auto): the split prices the CPU with it
        self.chunk_cpu_scale = 1.0
        self.graphed = GraphedDecode(self)  # the executors
        self.direct: DirectDecode | None = None  # --decode-misses direct (set up with the cache)
        self.eager = EagerLayer(self)
        self.next_moe: dict[int, object] = {}  # MoE layer -> the next MoE layer's block (its router predicts)
        self.prefetch_issued = self.prefetch_used = 0  # decode: next-layer experts copied ahead / then routed to

    def set_routers(self, moes: dict) -> None:
        """The model's MoE blocks by layer: with --expert-prefetch, each layer's input also goes through the next
        MoE layer's router (`route_ids`) to start that layer's likely misses early."""
        layers = sorted(moes)
        self.next_moe = {a: moes[b] for a, b in zip(layers, layers[1:])}

    # --- set-up -----------------------------------------------------------------------------------------------
    def setup(self, k: int, act_bytes: int = 0) -> VramSplit | None:
        """Size and fill the cache, pick the plan. Called by the first forward (or by the engine after it
        allocated the KV cache, so the VRAM budget sees it, with the VRAM its prefill chunk needs). Returns how
        the VRAM budget was divided (None with --expert-slots, or on a CPU without a budget)."""
        if self.cache is not None:
            return self.vram_split
        self.k = k
        staging = self._staging or staging_slots(k)
        if self.ex.prefetch_next:  # a layer's own stream, the next layer's prefetch and its own: 3k in flight
            staging = max(staging, 4 * k)
        if self._wants_direct() and self.ex.decode_misses != "direct" and self.cuda:  # staged: a batch step's
            # distinct misses (any more are read in place); with the next-layer prefetch (on unless
            # --no-expert-prefetch) 2k more, the next layer's predicted misses (odd and even layers' regions)
            staging = max(staging, (4 if self.ex.prefetch_next is False else 6) * k)
        slots, chunk, self.vram_split = budget_slots(self.ex, self.store, self.device, staging, act_bytes)
        L, E = len(self.layer_ids), self.n_experts
        if self.ex.cache_layout == "profile":  # the same bytes, spread over the layers as the profile routes
            if not self.ex.expert_profile:
                raise StrataError("--cache-layout profile needs a routing profile (--expert-profile FILE)")
            prof = RoutingProfile.load(self.ex.expert_profile, L, E)
            sizes = [self.store.expert_nbytes(i) for i in self.layer_ids]
            slots = layer_slots(prof.counts, sum(slots * b for b in sizes), sizes)
        self.cache = ExpertCache(self.store, slots, staging, self.device, chunk_experts=chunk, loan=self._loan_wanted(),
                                 act_slots=prefill_loan_slots(self, act_bytes))
        # the policy's slots per layer: its own and, between prompts, its share of the lent chunk buffers
        caps = [self.cache.layer_slots[i] + self.cache.loan_slots[i] for i in self.layer_ids]
        if self.vram_split is not None:
            self.vram_split = replace(self.vram_split, lent_slots=self.cache.loan_slots[self.layer_ids[0]])
        slots = caps[0] if len(set(caps)) == 1 else caps
        if self.cuda and self.ex.vram_gb is not None and alloc_cap_enabled():
            cap = cap_to_budget(self.device, self.ex.vram_gb)
            log.info("strata: torch's allocator held to %.2f GiB of the %g GiB budget", cap, self.ex.vram_gb)
        kw = dict(swap_budget=self.ex.swap_budget)
        if self.ex.cache_policy == "lfu-decay":
            kw["promote_min"] = self.ex.promote_min
            kw["decay"] = self.ex.decay_value(E, k)
        if self._make_policy is not None:
            self.policy = self._make_policy(L, E, slots)
        else:
            self.policy = make_policy(self.ex.cache_policy, L, E, slots, **kw)
        if self.ex.cpu_plan.strip() == "auto":
            if self.costs is None:
                from strata.experts.costs import cost_model_for

                self.costs = cost_model_for(self)
            self.plan = self.costs.cpu_plan(k)
            saved = self._saved_verdict(k)
            if saved is None and self.ex.plan_tune and self.cuda and self.lane is not None:
                # the model's plan, then what the first decode steps measure (strata.experts.tuner)
                native = "native" in self.lane.kernel.values()
                self.tuner = PlanTuner(lane_candidates(self.plan, k, self.lane.threads, native), trial=20, rounds=2)
        else:
            saved = None
            self.plan = CpuPlan.parse(self.ex.cpu_plan, k)
        if self.lane is None and any(self.plan.shares):
            raise StrataError("internal: the CPU lane is off but the plan uses the CPU")
        if saved is not None:  # an earlier run's trials on this machine decided (strata.experts.costs.save_verdict)
            self._handoff_chosen = saved["path"] == "handoff" and self.ex.decode_misses == "auto"
            self.path_reason = f"from the trials of an earlier run ({saved['file']}): {saved.get('why', '')}"
            log.info("strata: decode misses %s, plan %s, %s", saved["path"], self.plan, self.path_reason)
        elif self.ex.decode_misses == "auto" and self.cuda and self.costs is not None and self.lane is not None:
            path, staged_ms, handoff_ms = decode_path(self.costs, self.plan, k)
            if path == "handoff":  # this machine's CPU lane beats its link: the host splits the misses
                log.info("strata: decode misses handed off: the CPU lane takes %d of %d misses (cost model: %.3f "
                         "ms a token-layer, %.3f staged)", self.plan.shares[max(1, k // 2)], max(1, k // 2),
                         handoff_ms, staged_ms)
                self._handoff_chosen = True
        if self._wants_direct():
            self._enable_direct()
        if self.cache.loan:
            log.info("strata: the prefill chunk buffers (%d experts) lent to the cache between prompts: %s more slots "
                     "a layer while decoding", self.cache.ring[0] * self.cache.ring[1],
                     self.cache.loan_slots[self.layer_ids[0]])
        log.info("strata: expert cache %s slots/layer (%.2f GiB, %s), decode misses %s, plan %s, CPU kernel %s",
                 slots, self.cache.nbytes() / 2**30, self.ex.cache_policy + (
                     f" decay {kw['decay']:.4g}" if "decay" in kw else ""), ("staged by the GPU (staged)" if self.direct.stage else "read in place (direct)")
                 if self.direct else "handed off", self.plan,
                 ",".join(sorted(set(self.lane.kernel.values()))) if self.lane else "-")
        if self.ex.expert_profile:
            self.load_profile(self.ex.expert_profile)
        if self.ex.expert_profile_save:
            atexit.register(self.close)
        return self.vram_split

    def _enable_direct(self) -> bool:
        """The one-graph decode path (misses staged by a kernel, or read in place with --decode-misses direct);
        False when this model or store cannot take it (the hand-off stays)."""
        why = direct_supported(self)
        if why:
            say = log.warning if self.ex.decode_misses in ("direct", "staged") else log.info
            say("strata: --decode-misses direct: %s; graphed decode hands misses to the host", why)
            return False
        # decode plans do not apply (prefill chunks still split by the plan)
        stage = self.ex.decode_misses != "direct" and (not self.cuda or self._stageable())
        self.direct = DirectDecode(self, stage=stage)
        if self.tuner is not None and not self.tuner.done:
            self.tuner = None
        return True

    def _saved_verdict(self, k: int) -> dict | None:
        """An earlier run's verdict of the plan trials on this machine for these experts (a GPU under
        `--decode-misses auto`), its plan applied; None when there is none (or it does not fit this model)."""
        if not (self.cuda and self.ex.decode_misses == "auto" and self.ex.plan_tune and self.lane is not None):
            return None
        from strata.experts.costs import load_verdict

        saved = load_verdict(self)
        if saved is None:
            return None
        try:
            self.plan = CpuPlan.parse(saved["plan"], k)
        except (StrataError, KeyError, TypeError):
            return None
        return saved

    def _tuned(self) -> None:
        """The plan tuner has chosen. Under `--decode-misses auto` the hand-off was taken because the cost model
        expected the CPU lane to pay; the trials measured it. The staged path moves the same misses over PCIe
        without leaving the graph, so it costs what the all-PCIe trial cost less the hand-off's own share
        (plan.handoff_overhead_ms a layer): the hand-off stays only if its best plan still beats that clearly."""
        if not (self._handoff_chosen and self.ex.decode_misses == "auto"):  # (chosen on a GPU only)
            return
        stay, why = handoff_after_tuning(self.tuner, len(self.layer_ids), self.costs)
        self.path_reason = ("hand-off kept: " if stay else "staged after the trials: ") + why
        if why != NO_PCIE_TRIAL:  # the trials measured both: later runs on this machine start from the verdict
            from strata.experts.costs import save_verdict

            chosen = self.tuner.chosen
            save_verdict(self, "handoff" if stay else "staged", str(getattr(chosen, "plan", chosen)), why)
        if stay:
            log.info("strata: decode misses stay handed off: %s", why)
            return
        # taken once the engine is at rest (at_rest: no sequence decoding, e.g. before a request or after the
        # server's warm-up), at the next step's start: decode graphs see the new epoch and capture anew then,
        # never in the middle of a generation the hand-off's graphs are running
        self._to_direct = why

    @property
    def decode_misses_path(self) -> str | None:
        """How graphed decode steps take their misses: "staged" (copied by a kernel inside the step), "direct"
        (read in place over the bus) or "handoff" (the host splits them between the CPU lane and PCIe copies);
        None before the backend is set up."""
        if self.cache is None:
            return None
        if self.direct is not None:
            return "staged" if self.direct.stage else "direct"
        return "handoff"

    def _stageable(self) -> bool:
        """Every layer's expert stacks and its pool can be staged by the copy kernel (else misses are read in
        place: the torch twin of the copy cannot run inside a captured step)."""
        from strata.ops.expert_gather import stage_fast

        for layer in self.layer_ids:
            ew, pool = self.store[layer], self.cache.pool_of[layer]
            if not stage_fast((ew.gate, ew.up, ew.down, pool.gate, pool.up, pool.down)):
                return False
        return True

    def _wants_direct(self) -> bool:
        """--decode-misses direct or staged, or auto on a CUDA GPU (= staged: misses staged by a kernel beat both
        the per-layer hand-off and reads in place there: docs/BENCHMARKS.md)."""
        return self.ex.decode_misses in ("direct", "staged") or (
            self.ex.decode_misses == "auto" and self.cuda and not self._handoff_chosen)

    def cache_view(self) -> dict | None:
        """What the expert cache holds, for a live view (the web monitor): per MoE layer and expert, whether it is
        in a VRAM slot (`resident`, 0/1) and how hot the policy rates it (`heat`, 0..255 of the layer's hottest),
        row-major [layers, experts]. Read from another thread without a lock: a torn row only shows a step late."""
        if self.policy is None:
            return None
        L, E = len(self.layer_ids), self.n_experts
        resident = (np.asarray(self.policy.expert_map()) >= 0).astype(np.uint8).reshape(-1).tolist()
        heat = []
        for li in range(L):
            s = np.asarray(self.policy.scores(li), dtype=np.float64)
            top = s.max() if s.size and s.max() > 0 else 1.0
            heat += np.clip(s / top * 255, 0, 255).astype(np.uint8).tolist()
        return {"layers": L, "experts": E, "layer_ids": list(self.layer_ids), "resident": resident, "heat": heat,
                "slots_per_layer": self.policy.capacity(0)}

    def vram_bytes(self) -> int:
        """VRAM the expert cache holds (its slot pools and chunk buffers; 0 on a CPU, where they are in RAM)."""
        return self.cache.nbytes() if self.cache is not None and self.cuda else 0

    def max_graph_batch(self, k: int) -> int:
        """Decoding sequences one graphed step may take: within the grouped kernel's pair count, and without a
        CPU lane within the staging ring (every miss must then cross PCIe)."""
        n = max(1, PAIRS_MAX // max(k, 1))
        if self.lane is None and not (self._wants_direct() and not direct_supported(self)):
            n = min(n, max(1, (self._staging or staging_slots(k)) // max(k, 1)))
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
    def at_rest(self) -> None:
        """No sequence is decoding (the engine takes a request while idle; the server's warm-up ended): a path
        change the plan trials decided is taken from the next step on."""
        if self._to_direct is not None and not self._switch_ready:
            self._switch_ready = True
            self.path_epoch += 1
        if self.direct is not None and self.direct.prefetch_off():
            self.path_epoch += 1

    def begin_request(self) -> ExpertStats:
        """Start counting a new request; returns the finished one's counts."""
        if self.direct is not None:  # its last steps are counted when settled
            self.direct.flush()
        done, self.request = self.request, ExpertStats()
        return done

    def begin_step(self, ctx: StepContext) -> None:
        """A step starts: the policy ages, the tuner times decode steps, the counts and the profile go on."""
        if self.cache is None:  # set up by the first MoE layer (k is known there); the step begins then
            self._deferred = ctx
            return
        if self._to_direct is not None and self._switch_ready:
            why, self._to_direct, self._switch_ready = self._to_direct, None, False
            if self._enable_direct():
                self._handoff_chosen = False
                log.info("strata: decode misses staged by the GPU from now on: %s", why)
        if ctx.graphed:
            self.graphed.new_step()
        if self.direct is not None:  # the last step's routing is learnt before the policy ages
            self.direct.begin_step(ctx)
        if self.cache.loan:  # after the direct path has settled what it launched (its admissions)
            loan_turn(self, ctx)
        if ctx.counting:
            self._begin_step(ctx)

    def give_back_loan(self) -> bool:
        """Out of VRAM in a decode step: the prompt activations' VRAM lent to the cache goes back for good
        (strata.experts.loan.end_activation_loan); False when none was lent."""
        return end_activation_loan(self)

    def _loan_wanted(self) -> bool:
        """--chunk-buffer-loan: on, off, or auto (on for a GPU: its GPU test has passed there, loan.GPU_TESTED)."""
        want = self.ex.chunk_loan
        return want == "on" or (want == "auto" and self.cuda and loan_tested())

    def launched(self) -> None:
        """A graphed decode step is queued: the direct path settles the previous one meanwhile."""
        if self.direct is not None:
            self.direct.launched()

    def _begin_step(self, ctx: StepContext) -> None:
        n_tokens = ctx.n_tokens
        if self.tuner is not None and not self.tuner.done:
            if n_tokens == 1 and ctx.timed:  # a decode step: time it
                misses = self.stats.cpu + self.stats.pcie  # the previous step's are all counted by now
                self._apply(self.tuner.step(time.perf_counter(), misses - self._tuner_misses))
                self._tuner_misses = misses
                if self.tuner.done:
                    self._tuned()
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

    def poll(self, li: int, upload: bool = True) -> bool:
        """Mark experts whose copy finished as ready (event.query(): no sync); returns whether any was."""
        pend = self.pending[li]
        if not pend:
            return False
        done = [e for e, ev in pend.items() if ev is None or ev.query()]
        for e in done:
            del pend[e]
            self.policy.mark_ready(li, e)
        if done and upload:
            self.cache.upload_map(li, self.policy.expert_map()[li])
        return bool(done)

    def tuning(self) -> bool:
        return self.tuner is not None and not self.tuner.done

    def end_tuning(self) -> str:
        if self.tuner is None:
            return ""
        if not self.tuner.done:
            self.tuner.finish_now()
            self._apply(self.tuner.plan)
            self._tuned()
        self.at_rest()  # (called between requests: the server's warm-up, or before any)
        return str(self.tuner.chosen)

    def profile_report(self, measured_ms: float | None = None) -> str:
        """The per-token time breakdown (with --profile), '' otherwise."""
        return self.profiler.report(measured_ms) if self.profiler is not None else ""

    # --- the MoE layer --------------------------------------------------------------------------------------------
    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                ctx: StepContext) -> torch.Tensor:
        N, k = ids.shape
        if self.cache is None:
            self.setup(k)
        if self._deferred is not None:
            begun, self._deferred = self._deferred, None
            self.begin_step(begun)
        if ctx.graphed and N * k <= PAIRS_MAX:
            # (a CPU runs a static step eagerly, where no graph cut times it: the layer's experts are timed whole)
            with self.profiler.timing("gpu_experts") if self.profiler is not None and not self.cuda else nullcontext():
                return (self.direct or self.graphed).forward(ctx, layer, x, ids, w)
        return self.eager.forward(layer, x, ids, w)

    def count(self, hits: int, cpu: int, pcie: int, layers: int, swaps: int = 0, *, layer: int | None = None,
              cpu_experts: int | None = None, pcie_experts: int | None = None) -> None:
        """Statistics, in one place for every path: a layer's lookups by where they ran (`layers` token-layers)
        and the swaps it committed, in the totals and the current request's. The bytes each miss lane moved:
        `cpu_experts` / `pcie_experts` distinct experts of `layer` (default: one per lookup, as in a one-token
        step), each the layer's expert bytes."""
        if layer is None:
            if cpu or pcie:
                raise ValueError("TieredExperts.count: misses need their layer (its expert bytes)")
            cpu_b = pcie_b = 0
        else:
            eb = self.expert_bytes[layer]
            cpu_b = eb * (cpu if cpu_experts is None else cpu_experts)
            pcie_b = eb * (pcie if pcie_experts is None else pcie_experts)
        for s in (self.stats, self.request):
            s.add_layer(hits, cpu, pcie, layers, cpu_b, pcie_b)
            s.swaps += swaps

    def learn_chunk_cpu(self, measured_ms: float, estimate_ms: float) -> None:
        """Fold a chunk's measured CPU lane time into the split's price of the CPU (a running geometric mean of
        measured / estimated). The one-token costs come from decode-sized calls, and a chunk's CPU share can take
        many times its price while the GPU idles (docs/BENCHMARKS.md has the measured case). Once the CPU is
        priced out it gets no more chunk work, so the price stays: chunks stream."""
        ratio = min(max(measured_ms / estimate_ms, 0.05), 1e4)
        self.chunk_cpu_scale = float(self.chunk_cpu_scale ** 0.25 * ratio ** 0.75)  # mostly the latest
