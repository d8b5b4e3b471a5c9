"""Every expert on the compute device: the reference backend, and the oracle for every offload plan.

Per-(token, choice) outputs are gathered into [N, k, d] and summed over k in routing order, the same order the
tiered backend uses, so both produce bit-identical sums for the same expert outputs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from strata.experts.backend import StepProfiler
from strata.experts.stats import StepProfile
from strata.ops import registry
from strata.quant import QTensor, qmatmul
from strata.quant.matmul import group_slices

log = logging.getLogger("strata")
ACTS = ("swiglu_oai",)


@dataclass
class ExpertAct:
    """An expert FFN other than plain SwiGLU: biases on the projections and another gated activation.

    kind `swiglu_oai` (gpt-oss): gate clamped above at `limit`, up clamped to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate). The biases ([E, ff], [E, ff], [E, d] float32) are indexed by expert
    id and stay whole wherever the experts' outputs are computed (they are small): they never go through the slot
    cache, so each path adds them from the pair's expert id, not its slot."""

    kind: str
    alpha: float = 1.702
    limit: float = 7.0
    gate_b: torch.Tensor | None = None
    up_b: torch.Tensor | None = None
    down_b: torch.Tensor | None = None

    def __post_init__(self):
        if self.kind not in ACTS:
            raise ValueError(f"expert activation must be one of {', '.join(ACTS)}, got {self.kind!r}")

    def to(self, device) -> "ExpertAct":
        mv = {n: getattr(self, n).to(device) for n in ("gate_b", "up_b", "down_b") if getattr(self, n) is not None}
        return replace(self, **mv)

    def bias(self, name: str, e, dtype: torch.dtype) -> torch.Tensor | None:
        """Expert e's (an int, or ids [P] of each row) bias `name` in dtype, None if the layer has none."""
        b = getattr(self, name)
        if b is None:
            return None
        return (b[e] if isinstance(e, int) else b.index_select(0, e)).to(dtype)

    def glu(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        g = g.clamp(max=self.limit)
        u = u.clamp(min=-self.limit, max=self.limit)
        return (u + 1) * (g * torch.sigmoid(g * self.alpha))


def _add(y: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return y if b is None else y + b


def expert_ffn(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor, act: ExpertAct | None = None,
               e: int | None = None) -> torch.Tensor:
    """One expert over x [T, d]; with `act`, expert e's biases and activation."""
    if act is None:  # (op silu_mul: row-invariant on the CPU, where torch's silu is not)
        return qmatmul(registry.op("silu_mul")(qmatmul(x, gate), qmatmul(x, up)), down)
    g = _add(qmatmul(x, gate), act.bias("gate_b", e, x.dtype))
    u = _add(qmatmul(x, up), act.bias("up_b", e, x.dtype))
    h = act.glu(g, u).to(x.dtype)
    return _add(qmatmul(h, down), act.bias("down_b", e, x.dtype))


_SAID: set[str] = set()


def reference_fallback(what: str) -> None:
    """One log line the first time a fast GPU path gives way to the reference for an expert activation."""
    if what not in _SAID:
        _SAID.add(what)
        log.info("strata: %s: no fast GPU kernel for this expert activation; using the torch reference", what)


def gather_pairs(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor, slots: torch.Tensor,
                 act: ExpertAct | None = None, eids: torch.Tensor | None = None) -> torch.Tensor:
    """`gather_expert_ffn` (x [P, d], slots [P], a miss (-1) gives 0 -> [P, d] float32), and with `act` the
    batched torch reference taking each pair's biases by its expert id eids [P]."""
    from strata.ops.expert_gather import gather_expert_ffn
    from strata.ops.reference import torch_gather_ffn

    if act is None:
        return gather_expert_ffn(x, gate, up, down, slots)
    if x.is_cuda:
        reference_fallback("gathered expert FFN")
    y = torch_gather_ffn(x, gate, up, down, slots.clamp(min=0), act=act, eids=eids)
    return torch.where((slots >= 0).unsqueeze(1), y, 0.0)


def combine(y: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y [N, k, d] per-choice expert outputs, w [N, k] -> [N, d], summed in routing order in float32 (the op
    `combine_choices`: one launch on a GPU once tested there, else torch's product and sum)."""
    return registry.op("combine_choices")(y, w, dtype)


DECODE_PAIRS = 64  # up to this many (token, expert) pairs the grouped kernel beats per-expert GEMMs
# up to this many tokens a CPU step's experts run in one call of the native kernel (every (token, expert) pair a
# row set: a decode or verify step); a prompt chunk keeps the per-expert loop, which reads each expert once for all
# of its tokens
CPU_NATIVE_TOKENS = 16


def _cpu_native(ew: "ExpertWeights"):
    """The native kernel's calls for these experts (made once, kept on them), or None: a format or activation it
    does not read, no compiler here, or the float32 reference asked for (strata.quant.matmul.cpu_exact, which the
    tests against float oracles and llama.cpp's emulated rounding rely on)."""
    from strata.quant.matmul import cpu_exact

    if cpu_exact():
        return None
    got = getattr(ew, "_cpu_native", False)
    if got is False:
        from strata.experts.cpu_lane import _native_act, _native_lib, native_supported

        got = None
        if native_supported(ew) and _native_lib() is not None:
            from strata.ops.cpu_native import NativeExperts

            got = NativeExperts(ew.gate.raw, ew.up.raw, ew.down.raw, fmt_gate_up=ew.gate.qtype.name,
                                fmt_up=ew.up.qtype.name, fmt_down=ew.down.qtype.name, **_native_act(ew))
        ew._cpu_native = got
    return got


class ExpertWeights:
    """One MoE layer's stacked expert tensors, each `[E, out, in]` in its stored format; `act` the biases and
    activation of a family whose experts are not plain SwiGLU (None: plain)."""

    def __init__(self, gate: QTensor, up: QTensor, down: QTensor, act: ExpertAct | None = None):
        self.gate, self.up, self.down, self.act = gate, up, down, act

    @property
    def n_experts(self) -> int:
        return self.gate.shape[0]

    def expert_nbytes(self) -> int:
        return (self.gate.nbytes + self.up.nbytes + self.down.nbytes) // self.n_experts

    def to(self, device) -> "ExpertWeights":
        act = self.act.to(device) if self.act is not None else None
        return ExpertWeights(self.gate.to(device), self.up.to(device), self.down.to(device), act)


class ResidentExperts:
    """Every expert on the compute device (an `ExpertsBackend`): nothing to cache, plan or count. profile: the
    --profile timer (attention, dense, the experts' own time), for a CPU run; on a GPU only the tiered backend's
    graphed steps have been timed piece by piece, so there the loader leaves it off."""

    sizes_cache = False
    stats = None

    def __init__(self, layers: dict[int, ExpertWeights], profile: bool = False):
        self.layers = layers
        self.profile = StepProfile()
        self.profiling = profile
        # (decode steps alone: the first prompt's one-time start-up costs would swamp a short run's breakdown)
        self.profiler = StepProfiler(self.profile, torch.device("cpu"), decode_only=True) if profile else None

    def setup(self, k: int, act_bytes: int = 0) -> None:
        pass

    def max_graph_batch(self, k: int) -> int:
        return max(1, DECODE_PAIRS // max(k, 1))

    def set_routers(self, moes: dict) -> None:
        pass

    def begin_step(self, ctx) -> None:
        if self.profiler is not None and self.profiler.times(ctx):  # (the tokens the breakdown divides by)
            self.profile.add_tokens(ctx.n_tokens)

    def launched(self) -> None:
        pass

    def cache_view(self) -> dict:
        ids = sorted(self.layers)
        E = self.layers[ids[0]].n_experts if ids else 0
        return {"layers": len(ids), "experts": E, "layer_ids": ids, "resident": [1] * (len(ids) * E), "heat": None,
                "slots_per_layer": E}

    def at_rest(self) -> None:
        pass

    def begin_request(self) -> None:
        return None

    def profile_report(self, measured_ms: float | None = None) -> str:
        """The per-token time breakdown (with --profile), '' otherwise."""
        return self.profiler.report(measured_ms) if self.profiler is not None else ""

    def tuning(self) -> bool:
        return False

    def end_tuning(self) -> str:
        return ""

    def close(self) -> None:
        pass

    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, ctx=None) -> torch.Tensor:
        if self.profiler is None:
            return self._forward(layer, x, ids, w)
        with self.profiler.timing("experts"):
            return self._forward(layer, x, ids, w)

    def _forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ew = self.layers[layer]
        n, k = ids.shape
        parts = None if x.is_cuda else group_slices(n, CPU_NATIVE_TOKENS)
        if parts is not None:  # several sequences (a shared prompt chunk): each one's tokens as its step alone
            return torch.cat([self._forward(layer, x[p], ids[p], w[p]) for p in parts])
        if not x.is_cuda and n <= CPU_NATIVE_TOKENS:
            native = _cpu_native(ew)
            if native is not None:  # a decode step on the CPU: all its (token, expert) pairs in one kernel call
                rows = torch.arange(n).repeat_interleave(k)
                y = native(ids.reshape(-1), x.float().contiguous(), rows)
                return combine(y.view(n, k, -1), w, x.dtype)
        if ew.act is not None and x.is_cuda and n * k <= DECODE_PAIRS:
            # biases and another activation: the batched reference over the pairs (no host sync: capturable)
            flat = ids.reshape(-1)
            y = gather_pairs(x.repeat_interleave(k, 0), ew.gate, ew.up, ew.down, flat, ew.act, flat)
            return combine(y.view(n, k, -1), w, x.dtype)
        if ew.act is not None:  # a chunk: the reference loop on every device
            if x.is_cuda:
                reference_fallback("resident experts (chunk)")
            return combine(expert_loop(ew, x, ids), w, x.dtype)
        if x.is_cuda and n * k <= DECODE_PAIRS:
            # Decode: every (token, choice) pair through the grouped kernel over the whole expert stack (the
            # "slot pool" is all experts): a constant number of launches and no host sync.
            from strata.ops.expert_gather import gather_expert_ffn

            y = gather_expert_ffn(x, ew.gate, ew.up, ew.down, ids.reshape(-1), repeat=k)
            return combine(y.view(n, k, -1), w, x.dtype)
        # A chunk on the GPU: pairs sorted by expert, experts in batches of batched matmuls (a constant number
        # of launches per batch). On the CPU the per-expert loop through qmatmul stays: it is the reference
        # (and qmatmul's kernel registry is where tests swap in llama.cpp's activation rounding).
        if not x.is_cuda:
            return combine(expert_loop(ew, x, ids), w, x.dtype)
        from strata.ops.moe_prefill import grouped_expert_ffn

        # every expert resident: no budget shared with a cache, the larger batches
        return combine(grouped_expert_ffn(x, ew.gate, ew.up, ew.down, ids, roomy=True), w, x.dtype)


def expert_loop(ew: ExpertWeights, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x [N, d], ids [N, k] -> [N, k, d] float32: `expert_ffn` once per used expert on its tokens (the
    reference for the grouped prefill path; one host read of the counts, then a Python loop)."""
    n, k = ids.shape
    y = torch.zeros(n, k, x.shape[-1], dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1)
    # Tokens grouped by expert: one matmul chain per used expert.
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=ew.n_experts).tolist()
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        sel = order[start : start + c]
        start += c
        tok = sel // k
        out = expert_ffn(x[tok], ew.gate[e], ew.up[e], ew.down[e], ew.act, e)
        y.view(n * k, -1)[sel] = out.float()
    return y
