"""Expert statistics and the per-token time breakdown, first-class outputs of every run.

`ExpertStats` counts what happened to each routed expert (hit in the GPU cache, computed by the CPU,
copied over PCIe), the bytes each miss lane moved, and the cache swaps, per request and in total. `StepProfile` accumulates named
timing buckets per token and renders them as a bar table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Iterator, Mapping

_COUNTERS = ("lookups", "hits", "cpu", "pcie", "swaps", "tokens", "layers", "cpu_bytes", "pcie_bytes")
GB = 1e9  # bandwidths in decimal GB/s, as `strata calibrate` reports them


@dataclasses.dataclass
class ExpertStats:
    """Counts of expert lookups and where they ran; hits + cpu + pcie == lookups always.

    `layers` counts token-layers (one token through one MoE layer), so lookups / layers is the
    number of experts routed per token-layer. `cpu_bytes` / `pcie_bytes`: expert bytes each miss lane moved, an
    expert once per layer call however many of the call's tokens it served (the CPU lane reads it once for
    them, PCIe copies it once); in single-sequence decode that is the lane's count times its layer's expert bytes.
    """

    lookups: int = 0
    hits: int = 0
    cpu: int = 0
    pcie: int = 0
    swaps: int = 0
    tokens: int = 0
    layers: int = 0
    cpu_bytes: int = 0
    pcie_bytes: int = 0

    def __post_init__(self):
        self._check()

    def _check(self) -> None:
        for name in _COUNTERS:
            if getattr(self, name) < 0:
                raise ValueError(f"expert stats: {name} is negative ({getattr(self, name)})")
        if self.hits + self.cpu + self.pcie != self.lookups:
            raise ValueError(
                f"expert stats: hits {self.hits} + cpu {self.cpu} + pcie {self.pcie} != lookups {self.lookups}"
            )

    def add(
        self,
        *,
        hits: int = 0,
        cpu: int = 0,
        pcie: int = 0,
        lookups: int | None = None,
        swaps: int = 0,
        tokens: int = 0,
        layers: int = 0,
        cpu_bytes: int = 0,
        pcie_bytes: int = 0,
    ) -> None:
        """Count more lookups (default hits + cpu + pcie; a given value must agree) and events."""
        if lookups is None:
            lookups = hits + cpu + pcie
        if hits + cpu + pcie != lookups:
            raise ValueError(f"expert stats: hits {hits} + cpu {cpu} + pcie {pcie} != lookups {lookups}")
        if min(hits, cpu, pcie, swaps, tokens, layers, cpu_bytes, pcie_bytes) < 0:
            raise ValueError("expert stats: counts added must be >= 0")
        self.lookups += lookups
        self.hits += hits
        self.cpu += cpu
        self.pcie += pcie
        self.swaps += swaps
        self.tokens += tokens
        self.layers += layers
        self.cpu_bytes += cpu_bytes
        self.pcie_bytes += pcie_bytes

    def add_layer(self, hits: int, cpu: int, pcie: int, layers: int, cpu_bytes: int = 0, pcie_bytes: int = 0) -> None:
        """`add` for the decode hand-off (every layer of every step): lookups = hits + cpu + pcie by
        construction, no keyword parsing or checks."""
        self.lookups += hits + cpu + pcie
        self.hits += hits
        self.cpu += cpu
        self.pcie += pcie
        self.layers += layers
        self.cpu_bytes += cpu_bytes
        self.pcie_bytes += pcie_bytes

    def merge(self, other: ExpertStats) -> None:
        """Add another's counts into this one (e.g. a finished request into the total)."""
        for name in _COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self._check()

    def __add__(self, other: ExpertStats) -> ExpertStats:
        out = self.snapshot()
        out.merge(other)
        return out

    def __sub__(self, other: ExpertStats) -> ExpertStats:
        """What happened between an earlier snapshot `other` and now."""
        return ExpertStats(**{n: getattr(self, n) - getattr(other, n) for n in _COUNTERS})

    def snapshot(self) -> ExpertStats:
        return dataclasses.replace(self)

    def reset(self) -> None:
        for name in _COUNTERS:
            setattr(self, name, 0)

    @staticmethod
    def _ratio(a: int, b: int) -> float:
        return a / b if b else 0.0

    @property
    def hit_rate(self) -> float:
        return self._ratio(self.hits, self.lookups)

    @property
    def cpu_per_token(self) -> float:
        return self._ratio(self.cpu, self.tokens)

    @property
    def pcie_per_token(self) -> float:
        return self._ratio(self.pcie, self.tokens)

    @property
    def swaps_per_token(self) -> float:
        return self._ratio(self.swaps, self.tokens)

    @property
    def lookups_per_token(self) -> float:
        return self._ratio(self.lookups, self.tokens)

    def lane_gbps(self, seconds: float) -> dict[str, float]:
        """GB/s each miss lane moved over `seconds` (a request's decode time): `experts_cpu_gbps`,
        `experts_pcie_gbps` and both together, `experts_miss_gbps` (0 for no time)."""
        def rate(n: int) -> float:
            return round(n / seconds / GB, 4) if seconds > 0 else 0.0

        return {"experts_cpu_gbps": rate(self.cpu_bytes), "experts_pcie_gbps": rate(self.pcie_bytes),
                "experts_miss_gbps": rate(self.cpu_bytes + self.pcie_bytes)}

    def lane_summary(self, seconds: float) -> str:
        """One line, e.g. `miss lanes over 2.1 s of decode: CPU 38.2 GB/s (80.3 GB) | PCIe 11.5 GB/s (24.2 GB) |
        together 49.7 GB/s`."""
        g = self.lane_gbps(seconds)
        return (f"miss lanes over {seconds:.2f} s of decode: CPU {g['experts_cpu_gbps']:.2f} GB/s "
                f"({self.cpu_bytes / GB:.2f} GB) | PCIe {g['experts_pcie_gbps']:.2f} GB/s ({self.pcie_bytes / GB:.2f} "
                f"GB) | together {g['experts_miss_gbps']:.2f} GB/s")

    def as_dict(self) -> dict:
        d: dict = {n: getattr(self, n) for n in _COUNTERS}
        for name in ("hit_rate", "cpu_per_token", "pcie_per_token", "swaps_per_token", "lookups_per_token"):
            d[name] = getattr(self, name)
        return d

    def summary(self) -> str:
        """One line, e.g. `hit 71.3% | cpu 9.8/tok | pcie 4.0/tok | swaps 5.9/tok`."""
        return (
            f"hit {100 * self.hit_rate:.1f}% | cpu {self.cpu_per_token:.1f}/tok | "
            f"pcie {self.pcie_per_token:.1f}/tok | swaps {self.swaps_per_token:.1f}/tok"
        )


# Buckets every decode step reports, in display order for ties; others may be added freely.
BUCKETS: dict[str, str] = {
    "pcie_wait": "PCIe wait",
    "pcie_staged": "PCIe wait + staged experts",
    "attention": "attention",
    "linear_attention": "linear attention",
    "mla": "MLA",
    "gpu_experts": "GPU experts",
    "experts": "experts",  # (every expert resident: their whole time, on whichever device)
    "router_shared": "router/shared",
    "cpu_wait": "CPU wait",
    "dense_other": "dense/other",
    "sampling": "sampling",
    "policy": "policy (host)",
}

_BAR = " ▏▎▍▌▋▊▉█"  # eighths of a cell


def _bar(frac: float, width: int) -> str:
    eighths = max(0, min(round(frac * width * 8), width * 8))
    full, part = divmod(eighths, 8)
    return "█" * full + (_BAR[part] if part else "")


class StepProfile:
    """Milliseconds per named bucket, accumulated over tokens; read per token."""

    def __init__(self, labels: Mapping[str, str] | None = None):
        self.labels = dict(BUCKETS if labels is None else labels)
        self.ms: dict[str, float] = {}
        self.tokens = 0

    def add(self, bucket: str, ms: float) -> None:
        if ms < 0:
            raise ValueError(f"negative time {ms} ms for {bucket}")
        self.ms[bucket] = self.ms.get(bucket, 0.0) + ms

    def add_tokens(self, n: int = 1) -> None:
        self.tokens += n

    @contextlib.contextmanager
    def timed(self, bucket: str) -> Iterator[None]:
        """Add the host wall time of the block (GPU work needs its own events and a sync)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(bucket, (time.perf_counter() - t0) * 1e3)

    def per_token(self) -> dict[str, float]:
        """ms per token for each bucket, largest first."""
        n = max(self.tokens, 1)
        order = list(self.labels)
        items = sorted(self.ms.items(), key=lambda kv: (-kv[1], order.index(kv[0]) if kv[0] in order else len(order)))
        return {k: v / n for k, v in items}

    def total_ms(self) -> float:
        """Accounted ms per token."""
        return sum(self.ms.values()) / max(self.tokens, 1)

    def coverage(self, measured_ms: float) -> float:
        """The share of a measured ms/token the buckets account for (1.0 = all of it)."""
        return self.total_ms() / measured_ms if measured_ms > 0 else 0.0

    def merge(self, other: StepProfile) -> None:
        for k, v in other.ms.items():
            self.add(k, v)
        self.tokens += other.tokens

    def reset(self) -> None:
        self.ms.clear()
        self.tokens = 0

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "ms_per_token": self.per_token(), "total_ms": self.total_ms()}

    def render(self, measured_ms: float | None = None, width: int = 30) -> str:
        """A table of ms/token and % per bucket with bars; % of `measured_ms` when given.

        With a measurement, time the buckets missed shows as `unaccounted`.
        """
        rows = [(self.labels.get(k, k), v) for k, v in self.per_token().items()]
        total = self.total_ms()
        base = measured_ms if measured_ms and measured_ms > 0 else total
        if measured_ms and measured_ms > total + 1e-9:
            rows.append(("unaccounted", measured_ms - total))
        name_w = max([len(r[0]) for r in rows] + [len("total")])
        title = f"{'':<{name_w}}  {'ms/tok':>7}  {'%':>5}"
        lines = [title]
        for name, ms in rows:
            frac = ms / base if base else 0.0
            lines.append(f"{name:<{name_w}}  {ms:7.2f}  {100 * frac:5.1f}  {_bar(frac, width)}".rstrip())
        shown = measured_ms if measured_ms and measured_ms > 0 else total
        lines.append(f"{'total':<{name_w}}  {shown:7.2f}  {100.0 if base else 0.0:5.1f}")
        if measured_ms and measured_ms > 0:
            lines.append(f"coverage {100 * self.coverage(measured_ms):.1f}% of {measured_ms:.2f} ms measured")
        return "\n".join(lines)
