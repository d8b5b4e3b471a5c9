"""Which layers each pipeline stage computes (`--layer-split`); torch-free, so `strata check` can judge a split
before anything loads (strata.engine.pipeline runs it)."""

from __future__ import annotations

from strata import StrataError


def layer_split(n_layers: int, size: int, spec: str = "auto") -> list[range]:
    """Each stage's layers: `auto` as equal as possible (the first stages take one more when it does not divide),
    or `K1,K2,...` counts (one per stage, each >= 1, summing to the model's layers)."""
    if size < 1:
        raise StrataError(f"--pipeline-parallel-size must be >= 1, got {size}")
    if size > n_layers:
        raise StrataError(f"--pipeline-parallel-size {size} exceeds the model's {n_layers} layers")
    spec = (spec or "auto").strip()
    if spec == "auto":
        base, extra = divmod(n_layers, size)
        counts = [base + (1 if r < extra else 0) for r in range(size)]
    else:
        try:
            counts = [int(c) for c in spec.split(",")]
        except ValueError:
            raise StrataError(f"--layer-split must be auto or comma-separated layer counts, got {spec!r}") from None
        if len(counts) != size or min(counts) < 1 or sum(counts) != n_layers:
            raise StrataError(f"--layer-split {spec}: need {size} counts >= 1 summing to the model's {n_layers} "
                              f"layers (got {len(counts)} summing to {sum(counts)})")
    out, at = [], 0
    for c in counts:
        out.append(range(at, at + c))
        at += c
    return out
