"""Where a traced run's GPU time goes: kernels, host-to-device copies, their overlap and the idle gaps.

    python tools/trace_timeline.py trace.json.gz      # from tools/bench_decode.py --trace-prefill --trace-out

Reads a Chrome trace written by torch.profiler and prints, over the span from the first to the last GPU event:
time with kernels running, with copies running, with both (copies hidden under compute), with copies only
(compute waiting for the link), with neither (the GPU idle: the host is behind); the copies' bytes and link rate;
the host's blocking syncs; the top kernels. These are the numbers that say whether a prefill is bound by the
link, by the GPU or by the host.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(iv) -> float:
    return sum(e - s for s, e in iv)


def _intersect(a, b) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def load(path: str) -> list[dict]:
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarize(events: list[dict]) -> dict:
    kern, copy, syncs = [], [], defaultdict(float)
    names: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    copied = n_kernels = n_copies = 0
    for ev in events:
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        cat, s, d = ev.get("cat", ""), float(ev["ts"]), float(ev["dur"])
        if cat == "kernel":
            kern.append((s, s + d))
            names[ev["name"]] += d
            counts[ev["name"]] += 1
            n_kernels += 1
        elif cat == "gpu_memcpy":
            if "HtoD" in ev["name"]:
                copy.append((s, s + d))
                n_copies += 1
                copied += int((ev.get("args") or {}).get("bytes", 0))
            else:
                kern.append((s, s + d))  # device-side copies occupy the GPU like kernels
        elif cat == "cuda_runtime" and "Synchronize" in ev["name"]:
            syncs[ev["name"]] += d
    if not kern:
        raise SystemExit("no GPU kernels in this trace (was it recorded with CUDA activity?)")
    k, c = _union(kern), _union(copy)
    both = _intersect(k, c)
    span0 = min(x[0] for x in k + c)
    span1 = max(x[1] for x in k + c)
    busy = _union(k + c)
    gaps = [b[0] - a[1] for a, b in zip(busy, busy[1:])]
    big = [g for g in gaps if g > 200]  # > 0.2 ms: the GPU waited for the host, not for a launch
    ms = 1e-3
    return {
        "span_ms": round((span1 - span0) * ms, 2),
        "kernel_count": n_kernels,
        "h2d_copy_count": n_copies,
        "kernels_ms": round(_length(k) * ms, 2),
        "copies_ms": round(_length(c) * ms, 2),
        "copies_hidden_ms": round(_length(both) * ms, 2),
        "copies_only_ms": round((_length(c) - _length(both)) * ms, 2),
        "idle_ms": round(((span1 - span0) - _length(busy)) * ms, 2),
        "idle_gaps_over_0.2ms": {"count": len(big), "ms": round(sum(big) * ms, 2),
                                 "largest_ms": sorted(round(g * ms, 2) for g in big)[-5:]},
        "copied_gb": round(copied / 1e9, 3),
        "link_gb_s": round(copied / 1e9 / (_length(c) * 1e-6), 1) if c else None,
        "host_sync_ms": {n: round(v * ms, 2) for n, v in syncs.items()},
        "top_kernels_ms": {n[:70]: round(v * ms, 2) for n, v in sorted(names.items(), key=lambda x: -x[1])[:12]},
        # every kernel name: (launches, total ms), most time first -- with a known step and layer count this is
        # the per-layer kernel list
        "kernels": {n[:90]: [counts[n], round(v * ms, 3)] for n, v in sorted(names.items(), key=lambda x: -x[1])},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="+")
    a = ap.parse_args()
    for path in a.trace:
        print(json.dumps({"trace": path, **summarize(load(path))}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
