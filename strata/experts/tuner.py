"""`--cpu-plan auto`, refined by measuring: the first decode steps try a few plans and keep the fastest.

The cost model (`strata.experts.plan`) predicts a plan from per-expert costs measured in isolation, but a decode
step's real cost of a miss also holds the host hand-off, the CPU lane's thread wake-up and the copy latency
(in decode about twice what a miss costs timed in isolation: docs/BENCHMARKS.md, "Measurements behind the
engine's constants"), and those depend on the machine. So `auto` starts from the model's plan and then times decode steps
under each candidate — the model's plan, all misses over PCIe, all on the CPU — in interleaved trials (a round
visits every candidate for `trial` steps, in alternating order; `rounds` rounds, after `warmup` steps in which
the cache fills), and keeps the candidate whose misses cost least. Misses come in bursts (on greedy text the
median step has none, a few steps very many), so a trial's time says more about which steps it drew than about its
plan: a median ignored the misses altogether (every candidate's was the same), and a mean favoured whoever drew
the quiet steps. Given each step's miss count, the tuner fits
step time = base + cost_per_miss[candidate] · misses over all timed steps (one base shared by all) and keeps the
cheapest cost per miss among the candidates that drew enough misses to be priced (trialling on, up to 3x the
rounds, while fewer than two did); without counts, or with fewer than two priced, the lowest mean step time. (With the first version — two
rounds in one order after 8 steps — the last candidate of each round looked 25% faster than it was, while the
cache warmed up.) Steps are timed host-side between the starts of consecutive decode steps; intervals that include anything
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

import numpy as np
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


def lane_candidates(model_plan: CpuPlan, k: int, threads: int, native: bool = False) -> list[LaneSetting]:
    """The measured plan, all-PCIe, half-and-half and a third to the CPU at the lane's threads; all-CPU at the lane's
    threads, half and a quarter of them (a decode miss is a small GEMV whose best thread count is the machine's and
    the kernel's: docs/BENCHMARKS.md, "Measurements behind the engine's constants"). The third:
    the host's DRAM feeds both lanes, and next to PCIe copies the CPU lane read ~20% slower and the copies ~25%
    (tools/host_lane_overlap.py), so a smaller CPU share can beat both half-and-half and PCIe alone. With the
    native kernel (`native`) a quarter of the threads is left out: there it was always the slowest (sampled text,
    8 GiB: 42–53 ms a token against 23–37 for the others), and each candidate costs trial steps."""
    half = CpuPlan([(m + 1) // 2 for m in range(k + 1)])  # both lanes at once: the CPU takes half of the misses
    third = CpuPlan([m // 3 for m in range(k + 1)])
    out = [LaneSetting(model_plan, threads), LaneSetting(CpuPlan.all_pcie(k), threads), LaneSetting(half, threads),
           LaneSetting(third, threads)]
    fewer = {max(1, threads // 2)} if native else {max(1, threads // 2), max(1, threads // 4)}
    for t in sorted({threads} | fewer, reverse=True):
        out.append(LaneSetting(CpuPlan.all_cpu(k), t))
    return list(dict.fromkeys(out))  # the measured plan may be one of the others


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
        self.misses: list[list[int]] = [[] for _ in uniq]  # each timed step's expert misses (None: not given)
        self._fit: tuple[float, list[float]] | None = None
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

    def step(self, now: float, misses: int | None = None):
        """A decode step starts at `now` (seconds): the previous step's time — and its expert misses, when
        given — are recorded under the plan it ran with. Returns the plan for this step."""
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
            self.misses[self._current()].append(-1 if misses is None else int(misses))
        self._in_slot += 1
        if self._in_slot > self.trial:
            self._slot += 1
            self._in_slot = 0
            n = len(self.candidates)
            if self._slot >= self.rounds * n and self._slot % n == 0:
                # misses counted but fewer than two candidates drew enough of them to price: more rounds, up to 3x
                # (with two priced, the rest cannot win anyway: on repeating text the candidates tried late stay
                # quiet however long they are tried: 3x the rounds priced none more where it was measured)
                if self._counted() and sum(self.priced()) < 2 and self._slot < 3 * self.rounds * n:
                    return self.plan
                self._finish()
        return self.plan

    def means(self) -> list[float]:
        """Each candidate's mean step time (seconds; inf before it was timed)."""
        return [statistics.fmean(t) if t else float("inf") for t in self.times]

    def _counted(self) -> bool:
        return all(m >= 0 for ms in self.misses for m in ms)

    def priced(self) -> list[bool]:
        """Which candidates drew enough misses (one a step on average) for a cost per miss to be measured."""
        return [bool(ms) and sum(ms) >= len(ms) for ms in self.misses]

    def per_miss(self) -> tuple[float, list[float]] | None:
        """The joint fit (base seconds, [seconds per miss of each candidate; inf for one that drew too few misses
        to be priced]) over the priced candidates' steps; None without miss counts for every step, or with fewer
        than two priced candidates."""
        if not self._counted():
            return None
        ok = self.priced()
        rows = [(c, t, m) for c in range(len(self.candidates)) if ok[c] for t, m in zip(self.times[c], self.misses[c])]
        if sum(ok) < 2:
            return None
        X = np.zeros((len(rows), 1 + len(self.candidates)))
        X[:, 0] = 1.0
        for i, (c, _, m) in enumerate(rows):
            X[i, 1 + c] = m
        coef, *_ = np.linalg.lstsq(X, np.array([t for _, t, _ in rows]), rcond=None)
        return float(coef[0]), [float(b) if ok[i] else float("inf") for i, b in enumerate(coef[1:])]

    def scores(self) -> list[float]:
        """What the choice minimises, as seconds per step: with the per-miss fit, base + cost per miss × the mean
        misses per step over the priced candidates' trials (so they compare at the same misses; an unpriced
        candidate cannot be chosen: on repeating text the candidates tried late drew next to no misses, and their
        quiet steps said nothing about their lanes, and the tuner once chose a lane twice as slow a miss:
        docs/BENCHMARKS.md, "Measurements behind the engine's constants"); else the mean step time."""
        fit = self.per_miss()
        if fit is None:
            return self.means()
        base, per = fit
        ok = self.priced()
        m_all = [m for c, ms in enumerate(self.misses) if ok[c] for m in ms]
        mbar = statistics.fmean(m_all)
        return [base + b * mbar for b in per]

    def finish_now(self) -> None:
        """Stop the trials and keep the best candidate measured so far (the model's plan, the first, when none
        was timed): a bound on how long a warm-up may tune."""
        if not self.done:
            self._finish()

    def _finish(self) -> None:
        med = self.scores()
        if all(m == float("inf") for m in med):  # nothing timed: keep the cost model's plan
            self.chosen, self.done = self.candidates[0], True
            log.info("strata: cpu plan tuning stopped before any trial; kept %s", self.chosen)
            return
        best = min(range(len(med)), key=lambda i: med[i])
        self.chosen, self.done = self.candidates[best], True
        log.info("strata: cpu plan tuned to %s (%s ms/token)", self.chosen,
                 ", ".join(f"{c}: {m * 1e3:.2f}" for c, m in zip(self.candidates, med)))

    def report(self) -> dict:
        """The choice, each candidate's score, and what it rests on: timed steps, their misses and mean time,
        the fitted cost per miss (ms) and the shared base."""
        fit = self.per_miss()
        out = {"chosen": str(self.chosen) if self.chosen is not None else None,
               "ms_per_token": {str(c): round(m * 1e3, 3) if m < float("inf") else None
                                for c, m in zip(self.candidates, self.scores())},
               "evidence": {str(c): {"steps": len(t), "misses": int(sum(max(m, 0) for m in ms)),
                                     "mean_ms": round(statistics.fmean(t) * 1e3, 3) if t else None,
                                     "ms_per_miss": round(fit[1][i] * 1e3, 4) if fit and fit[1][i] < float("inf") else None}
                            for i, (c, t, ms) in enumerate(zip(self.candidates, self.times, self.misses))}}
        if fit:
            out["base_ms"] = round(fit[0] * 1e3, 3)
        return out
