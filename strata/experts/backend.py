"""The experts backend interface: what the engine and the model call, and the step context they pass down.

The engine (or whoever runs a forward: a captured decode graph, a bench, a test) builds one `StepContext` per
step and hands it to `CausalLM.forward`; the model begins the step on its backend (`begin_step`) and passes the
context to every MoE block, which calls `backend.forward(layer, x, ids, w, ctx)`. A backend learns everything
about the step from the context: nothing is probed with `getattr`, nothing is guessed from the layer index,
nothing is set on the backend from outside.

Backends: `strata.experts.resident.ResidentExperts` (every expert on the compute device, the oracle) and
`strata.experts.tiered.TieredExperts` (a VRAM slot cache, every expert in host RAM, misses on the CPU lane or
over PCIe). A new backend (a pipeline stage, say) implements `ExpertsBackend`; `tests/experts/test_backend.py`
runs a minimal one through the engine.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch

from strata.experts.sizing import VramSplit
from strata.experts.stats import ExpertStats, StepProfile

PHASES = ("prefill", "decode", "mixed")


@dataclass
class StepContext:
    """One forward step as the engine runs it.

    n_tokens: rows of the forward (tokens of every segment); phase: prefill (only prompt chunks), decode (one or
    more tokens per generating sequence, no prompt), mixed. recorder: the graph-piece recorder of a static decode
    step (`strata.engine.graphs.PieceRecorder`), None for an eager step. graphs: this engine decodes through CUDA
    graphs (its eager steps are then prefill/verify steps, which --profile and the plan tuner leave out). live:
    the step's hand-offs run now (False while a graph is being captured: they run at each replay, where the
    replaying code begins the step). counting: statistics count this step (False for a capture's warm-up).
    profiler: the --profile timer (None when off). on_route: called with (layer, ids [N, k]) after each MoE
    router (routing traces; None when nobody listens).
    """

    n_tokens: int
    phase: str = "mixed"
    recorder: object | None = None
    graphs: bool = False
    live: bool = True
    counting: bool = True
    profiler: "StepProfiler | None" = None
    on_route: Callable[[int, torch.Tensor], None] | None = None

    def __post_init__(self):
        if self.phase not in PHASES:
            raise ValueError(f"step phase must be one of {', '.join(PHASES)}, got {self.phase!r}")

    @property
    def graphed(self) -> bool:
        """A static decode step recorded (or run) as graph pieces."""
        return self.recorder is not None

    @property
    def timed(self) -> bool:
        """Whether --profile and the plan tuner count this step: graphed decode steps when the engine decodes
        through graphs (its eager steps are prefill), every step otherwise."""
        return self.recorder is not None or not self.graphs

    @classmethod
    def for_segments(cls, segments, n_tokens: int, **kw) -> "StepContext":
        """The context of a forward over `segments` (strata.kv.cache.Segment): its phase read from their sizes
        (a segment of one token is a decode step's; drafts make a decode segment longer: pass phase)."""
        if "phase" not in kw:
            one = [s.n == 1 for s in segments]
            kw["phase"] = "decode" if all(one) else "prefill" if not any(one) else "mixed"
        return cls(n_tokens=n_tokens, **kw)


class StepProfiler:
    """The --profile timer shared by the model (attention, dense) and the experts backend: spans into a
    `StepProfile`'s buckets. On CUDA the spans are event pairs resolved with one sync per step (`resolve`); in a
    graphed step a span's boundary is a graph cut, timed per piece by the graph runner; in an eager step of an
    engine that decodes through graphs nothing is timed (those are prefill steps)."""

    def __init__(self, profile: StepProfile, device: torch.device, decode_only: bool = False):
        """decode_only: time decode steps alone (prompt chunks left out), as a GPU's graphed decode is timed."""
        self.profile, self.device, self.cuda = profile, device, device.type == "cuda"
        self.decode_only = decode_only
        self._events: list[tuple[str, object, object]] = []  # (bucket, start, end) CUDA events to resolve
        self._rec = None
        self._on = True

    def begin(self, ctx: StepContext) -> None:
        """How this step's spans are timed (called once per forward, before the first span)."""
        # (a CPU never captures: its static decode steps run eagerly, so they are timed span by span as eager ones)
        self._rec = ctx.recorder if self.cuda else None
        self._on = self.times(ctx)

    def times(self, ctx: StepContext) -> bool:
        """Whether this step is timed (and its tokens counted)."""
        return ctx.timed and (ctx.phase == "decode" or not self.decode_only)

    def mark(self):
        """A span's start (None in a graphed step: the span ends at a cut)."""
        if self._rec is not None:  # a graphed step is timed per piece: a span boundary is a cut
            self._rec.cut(label="dense_other")
            return None
        if not self._on:
            return None
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def span(self, bucket: str, start, end=None) -> None:
        """Charge the time since `start` (to `end`, default now) to `bucket`."""
        if self._rec is not None:
            self._rec.cut(label=bucket)
            return
        if not self._on:
            return
        end = self.mark() if end is None else end
        if self.cuda:
            self._events.append((bucket, start, end))
        else:
            self.profile.add(bucket, (end - start) * 1e3)

    @contextlib.contextmanager
    def timing(self, bucket: str):
        """The block's time charged to `bucket` (a mark before it, a span after)."""
        start = self.mark()
        yield
        self.span(bucket, start)

    def resolve(self) -> None:
        """Fold the recorded CUDA event pairs into the profile (one device sync; profiling only)."""
        if not self._events:
            return
        torch.cuda.synchronize(self.device)
        for bucket, a, b in self._events:
            self.profile.add(bucket, max(a.elapsed_time(b), 0.0))
        self._events.clear()

    def report(self, measured_ms: float | None = None) -> str:
        self.resolve()
        return self.profile.render(measured_ms)


@runtime_checkable
class ExpertsBackend(Protocol):
    """What the engine and the model call on an experts backend (and nothing else)."""

    # the backend sizes a VRAM expert cache in `setup` (the engine then leaves room for it and a prefill chunk)
    sizes_cache: bool
    profiler: StepProfiler | None  # the --profile timer, None when off
    stats: ExpertStats | None  # cumulative counts (None: nothing to count, every expert is resident)

    def setup(self, k: int, act_bytes: int = 0) -> VramSplit | None:
        """Once, after the KV cache is allocated: k experts per token, act_bytes of VRAM for a prefill chunk.
        Returns how the VRAM budget was divided (strata.experts.sizing.VramSplit), None if the backend sized
        nothing from a budget."""

    def max_graph_batch(self, k: int) -> int:
        """Decoding sequences one graphed step may take."""

    def set_routers(self, moes: dict) -> None:
        """The model's MoE blocks by layer (a backend may route ahead with the next layer's router)."""

    def begin_step(self, ctx: StepContext) -> None:
        """A step starts (before its first MoE layer; for a replayed graph, before the replay)."""

    def launched(self) -> None:
        """A graphed decode step's work is all queued (after its replay): host work that may overlap it."""

    def cache_view(self) -> dict | None:
        """Which experts sit in VRAM and how hot each is, for a live view ({layers, experts, layer_ids,
        resident, heat}: flat row-major lists; heat None when nothing is rated)."""

    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                ctx: StepContext) -> torch.Tensor:
        """x [N, d], ids/w [N, k] -> [N, d]: the routed experts' outputs summed with their weights."""

    def at_rest(self) -> None:
        """No sequence is decoding (the engine is about to take one while idle): work that must not run inside
        a generation may run from the next step on."""

    def begin_request(self) -> ExpertStats | None:
        """Start counting a new request; returns the finished one's counts."""

    def profile_report(self, measured_ms: float | None = None) -> str:
        """The --profile breakdown ('' when off)."""

    def tuning(self) -> bool:
        """Whether decode steps are still trying candidate plans (the server decodes warm-up text until they are
        done, so that no request runs under a trial plan)."""

    def end_tuning(self) -> str:
        """Stop trying plans now and keep the best measured so far; returns what was chosen ('' if nothing was
        being tuned)."""

    def close(self) -> None:
        """Release what the backend holds open (saves a routing profile when asked to)."""
