"""`--cpu-plan auto`, refined by measuring: the first decode steps try a few plans and keep the fastest.

The cost model (`strata.experts.plan`) predicts a plan from per-expert costs measured in isolation, but a decode
step's real cost of a miss also holds the host hand-off, the CPU lane's thread wake-up and the copy latency
(measured on the H200: 0.14 ms per PCIe miss and 0.18 ms per CPU miss in decode, against 0.06 and 0.13 in
isolation), and those depend on the machine. So `auto` starts from the model's plan and then times decode steps
under each candidate — the model's plan, all misses over PCIe, all on the CPU — in interleaved trials (a round
visits every candidate for `trial` steps, in alternating order; `rounds` rounds, after `warmup` steps in which
the cache fills), and keeps the candidate with the lowest median step time. (Measured on the H200 with the
first version — two rounds in one order after 8 steps — the last candidate of each round looked 25% faster than
it was, while the cache warmed up.) Steps are timed host-side between the starts of consecutive decode steps; intervals that include anything
else (a prefill chunk, an idle server) are dropped.

The candidates are any values (the backend gives `LaneSetting`s: a plan and the CPU lane's thread count, since a
decode miss is a small GEMV whose best thread count is the machine's). Pure Python, no tensors: the backend calls
`step(now)` at the start of every decode step and `interrupt()` when something else ran, and reads `plan` (the
current candidate).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from typing import Sequence

from strata.experts.plan import CpuPlan

log = logging.getLogger("strata")


@dataclasses.dataclass(frozen=True)
class LaneSetting:
    """A candidate of the tuner: the CPU plan and the CPU lane's thread count (0: leave it)."""

    plan: CpuPlan
    threads: int = 0

    def __str__(self) -> str:
        return f"{self.plan}@{self.threads}" if self.threads else str(self.plan)


def lane_candidates(model_plan: CpuPlan, k: int, threads: int) -> list[LaneSetting]:
    """The measured plan and all-PCIe at the lane's threads; all-CPU at the lane's threads, half and a quarter of
    them (a decode miss is a small GEMV: fewer threads often win, measured 4 > 8 > 14 > 16 on the H200 machine)."""
    out = [LaneSetting(model_plan, threads), LaneSetting(CpuPlan.all_pcie(k), threads)]
    for t in sorted({threads, max(1, threads // 2), max(1, threads // 4)}, reverse=True):
        out.append(LaneSetting(CpuPlan.all_cpu(k), t))
    return out


class PlanTuner:
    def __init__(self, candidates: Sequence, trial: int = 16, rounds: int = 4, warmup: int = 32,
                 max_step_s: float = 1.0):
        uniq: list[CpuPlan] = []
        for c in candidates:
            if c not in uniq:
                uniq.append(c)
        if not uniq:
            raise ValueError("PlanTuner needs at least one candidate plan")
        if trial < 2 or rounds < 1 or warmup < 0:
            raise ValueError("trial >= 2, rounds >= 1 and warmup >= 0 required")
        self.candidates = uniq
        self.trial, self.rounds, self.warmup, self.max_step_s = trial, rounds, warmup, max_step_s
        self.times: list[list[float]] = [[] for _ in uniq]  # step seconds measured under each candidate
        self._last: float | None = None
        self._seen = 0  # decode steps started (warm-up included)
        self._slot = 0  # trial index: candidate = slot % len, round = slot // len
        self._in_slot = 0  # timed steps in the current trial
        self.done = len(uniq) == 1
        self.chosen = uniq[0] if self.done else None

    def _current(self) -> int:
        """The candidate of the current trial: rounds alternate their order (A B C, C B A, ...), so a steady
        drift (the cache still warming up) does not favour the candidate that comes last."""
        n = len(self.candidates)
        r, i = divmod(self._slot, n)
        return i if r % 2 == 0 else n - 1 - i

    @property
    def plan(self):
        if self.chosen is not None:
            return self.chosen
        return self.candidates[self._current()]

    def interrupt(self) -> None:
        """Something other than a decode step ran since the last one: do not time that interval."""
        self._last = None

    def step(self, now: float):
        """A decode step starts at `now` (seconds): the previous step's time is recorded under the plan it ran
        with. Returns the plan for this step."""
        if self.done:
            return self.plan
        last, self._last = self._last, now
        self._seen += 1
        if last is None or self._seen <= self.warmup:
            return self.plan
        dt = now - last
        if dt <= 0 or dt > self.max_step_s:
            return self.plan
        if self._in_slot > 0:  # the first step of a trial still carries the previous plan's copies
            self.times[self._current()].append(dt)
        self._in_slot += 1
        if self._in_slot > self.trial:
            self._slot += 1
            self._in_slot = 0
            if self._slot >= self.rounds * len(self.candidates):
                self._finish()
        return self.plan

    def medians(self) -> list[float]:
        return [statistics.median(t) if t else float("inf") for t in self.times]

    def _finish(self) -> None:
        med = self.medians()
        best = min(range(len(med)), key=lambda i: med[i])
        self.chosen, self.done = self.candidates[best], True
        log.info("strata: cpu plan tuned to %s (%s ms/token)", self.chosen,
                 ", ".join(f"{c}: {m * 1e3:.2f}" for c, m in zip(self.candidates, med)))

    def report(self) -> dict:
        return {"chosen": str(self.chosen) if self.chosen is not None else None,
                "ms_per_token": {str(c): round(m * 1e3, 3) for c, m in zip(self.candidates, self.medians())}}
