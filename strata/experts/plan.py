"""Where a token's missed experts run: on the CPU where they lie, or copied over PCIe to the GPU.

Decode: a token-layer routes k experts; the hits run on the GPU from the slot pool and the m misses
are split. The CPU lane (computing its share from host RAM) runs at the same time as the GPU lane
(copying the rest over PCIe, then computing them and the hits), so the best split minimizes the
slower lane. `CpuPlan` holds that split for every m, written as one digit per m (`--cpu-plan
011223344`: 0 of 0 misses, 1 of 1, 1 of 2, 2 of 3, ...), or derived from a measured `CostModel`.

Prefill: a chunk routes many tokens to each expert, so an expert streamed to the GPU once serves all
of them; `prefill_split` leaves only experts with few tokens to the CPU.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from typing import Mapping, NamedTuple, Sequence

from strata import StrataError
from strata.experts.profile import atomic_write_text

COST_FORMAT = "strata-cost-model"
COST_VERSION = 2  # 2: the one-token CPU cost is measured as decode calls it (after idling)


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Measured per-expert costs on one machine for one expert size (from `strata calibrate`)."""

    cpu_ms_per_expert: float  # CPU computes one token through one expert read from RAM
    pcie_ms_per_expert: float  # one expert's weights host -> GPU
    gpu_ms_per_expert: float  # GPU computes one token through one expert in a slot
    cpu_ms_per_token_expert: float | None = None  # each further token of a prefill chunk; None: as one
    gpu_ms_per_token_expert: float | None = None  # each further token of a prefill chunk; None: as one
    cpu_overhead_ms: float = 0.0  # per token-layer handing misses to the CPU and its result back
    machine: str = ""  # what was measured: the cache is only valid on the same machine ...
    model: str = ""  # ... and for the same expert shape and format

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type.startswith("float") and v is not None:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    raise ValueError(f"{f.name} must be a finite number >= 0, got {v!r}")

    @property
    def cpu_token_ms(self) -> float:
        return self.cpu_ms_per_expert if self.cpu_ms_per_token_expert is None else self.cpu_ms_per_token_expert

    @property
    def gpu_token_ms(self) -> float:
        return self.gpu_ms_per_expert if self.gpu_ms_per_token_expert is None else self.gpu_ms_per_token_expert

    def matches(self, machine: str, model: str) -> bool:
        return (self.machine, self.model) == (machine, model)

    def decode_lanes_ms(self, k: int, misses: int, cpu: int) -> tuple[float, float]:
        """(CPU lane, GPU lane) in ms for one token-layer: k routed, `misses` missed, `cpu` on the CPU."""
        return decode_lanes_ms(
            k,
            misses,
            cpu,
            self.cpu_ms_per_expert,
            self.pcie_ms_per_expert,
            self.gpu_ms_per_expert,
            self.cpu_overhead_ms,
        )

    def cpu_plan(self, k: int) -> CpuPlan:
        return CpuPlan.auto(
            k,
            self.cpu_ms_per_expert,
            self.pcie_ms_per_expert,
            self.gpu_ms_per_expert,
            cpu_overhead_ms=self.cpu_overhead_ms,
        )

    def prefill_split(self, tokens_per_expert: Mapping[int, int], resident: Sequence[int] = (),
                      cpu_scale: float = 1.0, serial: bool = False) -> PrefillSplit:
        """`cpu_scale`: measured over estimated CPU lane time of earlier chunks (the backend's correction: the
        one-token costs are measured as decode calls the lane, a chunk calls it with many tokens at once)."""
        # the first token pays for reading the weights, the rest only for the arithmetic
        c = max(float(cpu_scale), 0.0)
        return prefill_split(
            tokens_per_expert,
            cpu_ms_per_token_expert=c * self.cpu_token_ms,
            pcie_ms_per_expert=self.pcie_ms_per_expert,
            gpu_ms_per_token_expert=self.gpu_token_ms,
            cpu_ms_per_expert=c * max(self.cpu_ms_per_expert - self.cpu_token_ms, 0.0),
            gpu_ms_per_expert=max(self.gpu_ms_per_expert - self.gpu_token_ms, 0.0),
            resident=resident,
            cpu_overhead_ms=c * self.cpu_overhead_ms,
            cpu_max_tokens=CPU_MEASURED_TOKENS,
            serial=serial,
        )

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically (temp file, fsync, rename)."""
        data = {"format": COST_FORMAT, "version": COST_VERSION, **dataclasses.asdict(self)}
        atomic_write_text(path, json.dumps(data, indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike) -> CostModel:
        path = pathlib.Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise StrataError(f"cost model not found: {path} (run `strata calibrate`)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StrataError(f"cost model {path} is unreadable: {e}") from None
        if not isinstance(data, dict) or data.get("format") != COST_FORMAT:
            raise StrataError(f"{path} is not a strata cost model")
        if data.get("version") != COST_VERSION:
            raise StrataError(f"cost model {path} has version {data.get('version')}, this strata reads {COST_VERSION}")
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except (TypeError, ValueError) as e:
            raise StrataError(f"cost model {path} is malformed: {e}") from None


def decode_lanes_ms(
    k: int,
    misses: int,
    cpu: int,
    cpu_ms_per_expert: float,
    pcie_ms_per_expert: float,
    gpu_ms_per_expert: float,
    cpu_overhead_ms: float = 0.0,
) -> tuple[float, float]:
    """(CPU lane, GPU lane) in ms; the GPU lane ends the token-layer. The GPU computes the k - misses hits while
    the link copies the misses - cpu streamed experts and the host computes the CPU's share (all three start when
    the host has read the routing: the hits are queued before it); the streamed experts are computed after the
    copies and after the host's hand-off, which the CPU share holds up (the host issues the next GPU work when it
    is done)."""
    if not 0 <= cpu <= misses <= k:
        raise ValueError(f"need 0 <= cpu <= misses <= k, got cpu={cpu} misses={misses} k={k}")
    cpu_lane = cpu_overhead_ms + cpu * cpu_ms_per_expert if cpu else 0.0
    streamed = misses - cpu
    gpu_lane = max((k - misses) * gpu_ms_per_expert, streamed * pcie_ms_per_expert, cpu_lane) \
        + streamed * gpu_ms_per_expert
    return cpu_lane, gpu_lane


HANDOFF_MARGIN = 0.9  # the hand-off must be expected this much faster than staging to be chosen by `auto`
# What leaving the one-graph step costs a token-layer beyond its lanes: the graph cut in pieces around the host's
# turn, the host's planning, DMA copies instead of the staging kernel: the two paths' tokens timed for the same
# misses (docs/BENCHMARKS.md, "Measurements behind the engine's constants"). Without it `auto` picked the hand-off
# (the lanes alone looked faster), and decode ran at ~2/3 of the staged rate.
HANDOFF_STEP_MS = 0.14


def decode_path(costs: CostModel, plan: "CpuPlan", k: int, misses: int | None = None) -> tuple[str, float, float]:
    """`--decode-misses auto` on a GPU: ("staged" or "handoff", staged ms, hand-off ms) for a token-layer with
    `misses` misses (default half of k: a tight budget on text that routes widely).

    Staged (one graph, no host): the misses cross the link, then all k pairs are computed. Hand-off: the host
    splits the misses by `plan` between the CPU lane and PCIe copies (decode_lanes_ms), plus a round trip every
    layer (cpu_overhead_ms: a token's activations to the host and back) and the cost of the graph's pieces
    (HANDOFF_STEP_MS). The hand-off is chosen only when the
    plan gives the CPU a share and it is clearly faster: a machine whose CPU reads RAM faster than its link
    (PCIe 4.0 beside DDR5), never one whose link outruns its cores."""
    m = max(1, min(k, k // 2 if misses is None else int(misses)))
    staged = m * costs.pcie_ms_per_expert + k * costs.gpu_ms_per_expert
    cpu = plan.shares[m] if m < len(plan.shares) else 0
    handoff = max(costs.decode_lanes_ms(k, m, cpu)) + (0.0 if cpu else costs.cpu_overhead_ms) + HANDOFF_STEP_MS
    choice = "handoff" if cpu > 0 and handoff < HANDOFF_MARGIN * staged else "staged"
    return choice, staged, handoff


def handoff_overhead_ms(costs: CostModel | None) -> float:
    """What the hand-off path costs a token-layer beyond the staged path when both send every miss over PCIe:
    the round trip of the activations (cpu_overhead_ms) and the graph's pieces (HANDOFF_STEP_MS)."""
    return (costs.cpu_overhead_ms if costs is not None else 0.0) + HANDOFF_STEP_MS


NO_PCIE_TRIAL = "no all-PCIe trial was timed"


def handoff_after_tuning(tuner, n_layers: int, costs: CostModel | None) -> tuple[bool, str]:
    """After the plan tuner's trials (strata.experts.tuner.PlanTuner, run on the hand-off path): (whether the
    hand-off stays, why). The staged path's step is estimated from the all-PCIe trial less the hand-off's own
    overhead on every layer; the hand-off stays only when a plan that gives the CPU a share beat that by the
    margin `auto` asks of it (HANDOFF_MARGIN). Without an all-PCIe trial that was timed, the hand-off stays."""
    scores = tuner.scores()
    plans = [getattr(c, "plan", c) for c in tuner.candidates]
    zero = [i for i, p in enumerate(plans) if not any(p.shares) and scores[i] != float("inf")]
    if not zero:
        return True, NO_PCIE_TRIAL
    pcie_ms = min(scores[i] for i in zero) * 1e3
    staged_ms = max(pcie_ms - n_layers * handoff_overhead_ms(costs), 0.0)
    best = min(range(len(scores)), key=lambda i: scores[i])
    best_ms = scores[best] * 1e3
    text = (f"best hand-off plan {tuner.candidates[best]} {best_ms:.2f} ms a token, all-PCIe {pcie_ms:.2f}, "
            f"staged estimated {staged_ms:.2f}")
    stay = any(plans[best].shares) and best_ms < HANDOFF_MARGIN * staged_ms
    return stay, text


class CpuPlan:
    """How many of a token-layer's misses the CPU computes, for each miss count 0..k."""

    def __init__(self, shares: Sequence[int], *, monotone: bool = True):
        shares = tuple(int(s) for s in shares)
        text = ",".join(map(str, shares))
        if not shares:
            raise StrataError("cpu plan is empty; give one share per miss count 0..k, e.g. 011223344")
        for m, c in enumerate(shares):
            if not 0 <= c <= m:
                raise StrataError(f"cpu plan {text}: with {m} misses the CPU can take 0..{m}, not {c}")
            if monotone and m and c < shares[m - 1]:
                raise StrataError(
                    f"cpu plan {text}: shares must not decrease ({shares[m - 1]} with {m - 1} misses, {c} with {m})"
                )
        self.shares = shares

    @property
    def k(self) -> int:
        return len(self.shares) - 1

    @classmethod
    def parse(cls, text: str, k: int | None = None) -> CpuPlan:
        """`011223344` (one digit per miss count) or `0,1,1,2,...,10` when k > 9."""
        t = text.strip()
        parts = [p.strip() for p in t.split(",")] if "," in t else list(t)
        if not parts or any(not p.isdigit() for p in parts):
            raise StrataError(f"cpu plan {text!r}: want digits (e.g. 011223344) or comma-separated counts")
        plan = cls([int(p) for p in parts])
        if k is not None and plan.k != k:
            raise StrataError(
                f"cpu plan {text!r} covers {plan.k} routed experts, the model routes {k} (need {k + 1} entries)"
            )
        return plan

    @classmethod
    def auto(
        cls,
        k: int,
        cpu_ms_per_expert: float,
        pcie_ms_per_expert: float,
        gpu_ms_per_expert: float,
        cpu_overhead_ms: float = 0.0,
    ) -> CpuPlan:
        """For each miss count, the CPU share minimizing max(CPU lane, GPU lane).

        Ties go to the larger CPU share, which leaves the PCIe link free for cache swaps.
        """
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        shares = []
        for m in range(k + 1):
            best, best_c = None, 0
            for c in range(m + 1):
                lanes = decode_lanes_ms(
                    k, m, c, cpu_ms_per_expert, pcie_ms_per_expert, gpu_ms_per_expert, cpu_overhead_ms
                )
                t = max(lanes)
                if best is None or t <= best + 1e-12:
                    best, best_c = t, c
            # (the CPU lane holding up the staged experts can make the optimum step back as m grows)
            shares.append(best_c)
        return cls(shares, monotone=False)

    @classmethod
    def all_cpu(cls, k: int) -> CpuPlan:
        return cls(range(k + 1))

    @classmethod
    def all_pcie(cls, k: int) -> CpuPlan:
        return cls([0] * (k + 1))

    def cpu_count(self, misses: int) -> int:
        if not 0 <= misses <= self.k:
            raise ValueError(f"{misses} misses out of range 0..{self.k}")
        return self.shares[misses]

    def choose(self, misses: Sequence[int], scores=None) -> tuple[list[int], list[int]]:
        """Split missed experts into (cpu, pcie), each in the given order.

        The coldest misses (lowest `scores[e]`, e.g. a policy's `scores(layer)`) go to the CPU; the
        hottest go over PCIe, where the cache may keep them. Without scores the last misses go to
        the CPU.
        """
        n_cpu = self.cpu_count(len(misses))
        if n_cpu == 0:
            return [], list(misses)
        if scores is None:
            cut = len(misses) - n_cpu
            return list(misses[cut:]), list(misses[:cut])
        coldest = sorted(range(len(misses)), key=lambda i: (scores[misses[i]], i))[:n_cpu]
        to_cpu = set(coldest)
        cpu = [e for i, e in enumerate(misses) if i in to_cpu]
        pcie = [e for i, e in enumerate(misses) if i not in to_cpu]
        return cpu, pcie

    def split_rows(self, ids, miss, scores) -> tuple[set[int], set[int]]:
        """`choose` for every row of a batch at once: ids [N, k] routed experts, miss [N, k] which of them
        missed, scores [E] (coldest to the CPU). Returns the experts (computed on the CPU, streamed over PCIe):
        an expert streamed for one row serves every row, so it is on the CPU only if no row streams it."""
        import numpy as np

        ids, miss = np.asarray(ids), np.asarray(miss, dtype=bool)
        N, k = ids.shape
        if k != self.k:
            raise ValueError(f"plan covers {self.k} routed experts, the rows have {k}")
        missed = _present(ids[miss])
        if not any(self.shares):  # all over PCIe (the common plan on a fast link): no per-row ranking
            return set(), missed
        share = np.asarray(self.shares)[miss.sum(1)]  # [N] CPU count of each row
        key = np.where(miss, np.asarray(scores, dtype=np.float64)[ids], np.inf)
        order = np.argsort(key, axis=1, kind="stable")  # coldest misses first, ties in routing order
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.broadcast_to(np.arange(k), (N, k)), axis=1)
        to_cpu = miss & (rank < share[:, None])
        stream = _present(ids[miss & ~to_cpu])
        return missed - stream, stream

    def __str__(self) -> str:
        if all(s < 10 for s in self.shares):
            return "".join(map(str, self.shares))
        return ",".join(map(str, self.shares))

    def __repr__(self) -> str:
        return f"CpuPlan({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CpuPlan) and self.shares == other.shares

    def __hash__(self) -> int:
        return hash(self.shares)


def _present(ids) -> set[int]:
    """The distinct values of a flat id array (a count per id: linear, where np.unique sorts)."""
    import numpy as np

    if ids.size == 0:
        return set()
    return set(np.flatnonzero(np.bincount(ids.reshape(-1))).tolist())


CPU_MEASURED_TOKENS = 8  # the cost model times the CPU lane at 1 and 8 tokens (strata.experts.costs)


class PrefillSplit(NamedTuple):
    stream: list[int]  # non-resident experts copied to the GPU once for the chunk
    cpu: list[int]  # experts the CPU computes for the chunk
    cpu_ms: float  # estimated CPU lane
    gpu_ms: float  # estimated GPU lane (copies + all GPU compute, resident experts included)


def prefill_split(
    tokens_per_expert: Mapping[int, int],
    cpu_ms_per_token_expert: float,
    pcie_ms_per_expert: float,
    gpu_ms_per_token_expert: float = 0.0,
    *,
    cpu_ms_per_expert: float = 0.0,
    gpu_ms_per_expert: float = 0.0,
    resident: Sequence[int] = (),
    cpu_overhead_ms: float = 0.0,
    cpu_max_tokens: int | None = None,
    serial: bool = False,
) -> PrefillSplit:
    """Split a prefill chunk's non-resident experts between streaming to the GPU and the CPU.

    `cpu_max_tokens`: experts routed more tokens than this always stream (the CPU's per-token cost was measured
    up to that many; past it the straight line is an extrapolation, which once put enough of a 4K chunk on the CPU
    to halve the prefill: docs/BENCHMARKS.md, "Measurements behind the engine's constants").

    An expert with n tokens costs the CPU `cpu_ms_per_expert + n * cpu_ms_per_token_expert` and the
    GPU `pcie_ms_per_expert + gpu_ms_per_expert + n * gpu_ms_per_token_expert`; the CPU's relative
    cost grows with n, so the CPU takes the experts with the fewest tokens. Every cut point is
    tried and the one with the smallest max(CPU lane, GPU lane) wins (ties: fewer on the CPU).

    `serial`: the lanes do not overlap — the smallest CPU lane + GPU lane wins. So it is when the thread that
    computes the CPU share is the one that issues the GPU's work and the GPU's queue is short (a CUDA chunk,
    bound by the host's launches: a few CPU pairs a prompt, priced as parallel, made it measurably slower).
    """
    res = set(resident)
    gpu_base = 0.0
    missed: list[tuple[int, int]] = []  # (tokens, expert)
    for e, n in tokens_per_expert.items():
        if n < 0:
            raise ValueError(f"expert {e} has {n} tokens")
        if n == 0:
            continue
        if e in res:
            gpu_base += gpu_ms_per_expert + n * gpu_ms_per_token_expert
        else:
            missed.append((n, e))
    missed.sort()
    gpu_cost = [pcie_ms_per_expert + gpu_ms_per_expert + n * gpu_ms_per_token_expert for n, _ in missed]
    gpu_lane = gpu_base + sum(gpu_cost)
    cpu_lane = 0.0
    cost = (lambda c, g: c + g) if serial else max
    best_t, best_cpu, best_gpu = 0, cpu_lane, gpu_lane
    for t, (n, _) in enumerate(missed, start=1):
        if cpu_max_tokens is not None and n > cpu_max_tokens:
            break  # sorted by tokens: none further is eligible either
        cpu_lane += cpu_ms_per_expert + n * cpu_ms_per_token_expert + (cpu_overhead_ms if t == 1 else 0.0)
        gpu_lane -= gpu_cost[t - 1]
        if cost(cpu_lane, gpu_lane) < cost(best_cpu, best_gpu) - 1e-12:
            best_t, best_cpu, best_gpu = t, cpu_lane, gpu_lane
    cpu = sorted(e for _, e in missed[:best_t])
    stream = sorted(e for _, e in missed[best_t:])
    return PrefillSplit(stream, cpu, best_cpu, best_gpu)
