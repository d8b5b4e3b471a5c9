"""Routing measured on real text: which experts each MoE layer picks, token after token, and what caches make of it.

- ``record_routing(model)``: a context manager that captures the router's expert ids per MoE layer from
  strata's own forward (it wraps the experts backend's ``forward(layer, x, ids, w)``, the one call every MoE
  block makes), as a ``RoutingTrace``.
- ``popularity(trace)``: per layer, each expert's share of the routed picks, sorted; the curve of the share
  covered by the most popular fraction of experts.
- ``lru_hit_rates(trace, fractions)``: an LRU cache per layer holding ``fraction`` of the experts, replayed
  over the id stream; the hit rate is the share of picks found in the cache before their token ran.
- ``reuse_distances(trace)``: tokens since the same expert of the same layer was last picked.
- ``routing_stats(trace)``: all of the above as plain JSON-able numbers (the doc tables and the tests use it).

Everything here is pure bookkeeping on integer ids; it runs anywhere and is unit-tested on hand-made streams.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

DEFAULT_FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@dataclass
class RoutingTrace:
    """Expert ids per MoE layer, in token order: ``ids[layer]`` is ``[T, k]`` (routing order within a row)."""

    n_experts: int
    ids: dict[int, np.ndarray] = field(default_factory=dict)

    def add(self, layer: int, ids: np.ndarray) -> None:
        prev = self.ids.get(layer)
        ids = np.asarray(ids, dtype=np.int64)
        self.ids[layer] = ids if prev is None else np.concatenate([prev, ids])

    @property
    def layers(self) -> list[int]:
        return sorted(self.ids)

    @property
    def n_tokens(self) -> int:
        return min((len(v) for v in self.ids.values()), default=0)


@contextlib.contextmanager
def record_routing(model) -> Iterator[RoutingTrace]:
    """Capture the expert ids that ``model`` (a strata ``CausalLM``) routes while the block runs."""
    backend = model.experts
    if backend is None:
        raise ValueError("the model has no MoE layers")
    n_experts = _n_experts(model)
    trace = RoutingTrace(n_experts)

    def tap(layer, ids):
        trace.add(layer, ids.detach().to("cpu").numpy())  # [N, k]

    with model.tap_routing(tap):
        yield trace


def _n_experts(model) -> int:
    args = getattr(model, "args", None)
    n = getattr(args, "n_experts", 0)
    if not n:
        raise ValueError("the model does not say how many experts it has")
    return int(n)


def popularity(trace: RoutingTrace) -> dict:
    """Per layer: expert shares of the picks sorted from most to least used; their mean over layers; coverage."""
    e = trace.n_experts
    per_layer = []
    for layer in trace.layers:
        counts = np.bincount(trace.ids[layer].reshape(-1), minlength=e)[:e].astype(np.float64)
        per_layer.append(np.sort(counts / max(counts.sum(), 1.0))[::-1])
    sorted_shares = np.mean(per_layer, axis=0) if per_layer else np.zeros(e)
    cum = np.cumsum(sorted_shares)

    def covered(frac: float) -> float:
        n = max(1, int(round(frac * e)))
        return float(cum[n - 1])

    return {
        "per_layer_sorted_share": [[float(x) for x in s] for s in per_layer],
        "mean_sorted_share": [float(x) for x in sorted_shares],
        "top_share": {f"{f:.2f}": covered(f) for f in (0.1, 0.25, 0.5)},
        "max_share": float(sorted_shares[0]) if e else 0.0,
        "min_share": float(sorted_shares[-1]) if e else 0.0,
        "unused_experts": int(sum(int((s == 0).sum()) for s in per_layer)),
    }


def lru_hits(stream: np.ndarray, capacity: int) -> tuple[int, int]:
    """Replay one layer's ``[T, k]`` id stream through an LRU cache of ``capacity`` experts.

    A pick hits when its expert was cached before its token ran; then the token's experts become the most
    recent (the top-ranked one last, so it is the most recent of all), evicting the least recent beyond
    capacity. Returns (hits, picks).
    """
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for row in stream.tolist():
        hits += sum(1 for x in row if x in cache)
        for x in reversed(row):
            cache[x] = None
            cache.move_to_end(x)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits, stream.size


def capacity_for(fraction: float, n_experts: int) -> int:
    return max(1, int(round(fraction * n_experts)))


def lru_hit_rates(trace: RoutingTrace, fractions: Sequence[float] = DEFAULT_FRACTIONS) -> dict:
    """Hit rate (all layers pooled) of a per-layer LRU cache holding each fraction of the experts."""
    out = {}
    for f in fractions:
        cap = capacity_for(f, trace.n_experts)
        hits = picks = 0
        for layer in trace.layers:
            h, p = lru_hits(trace.ids[layer], cap)
            hits, picks = hits + h, picks + p
        out[f"{f:.2f}"] = {"capacity": cap, "hit_rate": hits / picks if picks else 0.0,
                           "uniform": min(1.0, cap / trace.n_experts)}
    return out


def reuse_distances(trace: RoutingTrace) -> np.ndarray:
    """For every pick whose expert was picked before in the same layer: tokens since that last pick."""
    out = []
    for layer in trace.layers:
        last: dict[int, int] = {}
        for t, row in enumerate(trace.ids[layer].tolist()):
            for x in row:
                if x in last:
                    out.append(t - last[x])
                last[x] = t
    return np.asarray(out, dtype=np.int64)


def routing_stats(trace: RoutingTrace, fractions: Sequence[float] = DEFAULT_FRACTIONS) -> dict:
    """Popularity, LRU hit rates and reuse distances as plain JSON-able values."""
    d = reuse_distances(trace)
    k = int(next(iter(trace.ids.values())).shape[1]) if trace.ids else 0
    return {
        "tokens": trace.n_tokens,
        "moe_layers": len(trace.layers),
        "n_experts": trace.n_experts,
        "k": k,
        "popularity": popularity(trace),
        "lru": lru_hit_rates(trace, fractions),
        "reuse_distance": {
            "median": float(np.median(d)) if d.size else 0.0,
            "mean": float(d.mean()) if d.size else 0.0,
            "p90": float(np.percentile(d, 90)) if d.size else 0.0,
            "within_1": float((d <= 1).mean()) if d.size else 0.0,
            # with uniform random routing a pick is reused after E/k tokens on average
            "uniform_mean": trace.n_experts / k if k else 0.0,
        },
    }
