"""The statistics every bench table shows: median and min-max of repeats, latency percentiles, ratios.

Percentiles interpolate linearly between order statistics (numpy's default, "linear"), so p50 of an even
count is the mean of the two middle values and a percentile of one value is that value.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100) of values, linear between order statistics; NaN for no values."""
    xs = sorted(float(v) for v in values)
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in 0..100, got {q}")
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Iterable[float]) -> float:
    return percentile(values, 50)


@dataclass(frozen=True)
class Summary:
    """Median and range of repeated measurements of one quantity."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> "Summary":
        xs = [float(v) for v in values]
        if not xs:
            return cls(math.nan, math.nan, math.nan, 0)
        return cls(median(xs), min(xs), max(xs), len(xs))

    @property
    def spread(self) -> float:
        """(max - min) / median: how much the repeats disagree (0 = not at all)."""
        return (self.max - self.min) / self.median if self.median else math.nan

    def as_dict(self) -> dict:
        return asdict(self)

    def fmt(self, digits: int = 1) -> str:
        """`123.4 (120.1-125.0)`; `-` when nothing was measured."""
        if not self.n or math.isnan(self.median):
            return "-"
        if self.n == 1:
            return f"{self.median:,.{digits}f}"
        return f"{self.median:,.{digits}f} ({self.min:,.{digits}f}-{self.max:,.{digits}f})"


def latency(values: Sequence[float]) -> dict:
    """p50 / p90 / max / mean of latencies (whatever unit they come in)."""
    xs = [float(v) for v in values]
    if not xs:
        return {"p50": math.nan, "p90": math.nan, "max": math.nan, "mean": math.nan, "n": 0}
    return {"p50": percentile(xs, 50), "p90": percentile(xs, 90), "max": max(xs), "mean": sum(xs) / len(xs),
            "n": len(xs)}


def ratio(a: float | None, b: float | None) -> float:
    """a / b, NaN when either is missing or b is 0 (a ratio that cannot be computed is shown, not hidden)."""
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b
