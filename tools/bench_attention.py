"""GPU micro-benchmark of one query's attention over a slot's KV window, the decode step's attention (CUDA only).

    python tools/bench_attention.py                      # B1's shapes, windows 40,960 and 131,328, bf16 / q8_0
    python tools/bench_attention.py --kv q8_0 --windows 131328 --positions 1024,32768,131071 --programs 256,1024

For each KV type, window (the context a slot is allocated for), position (the keys attended: 0..pos), split
layout (fixed by the window, or dynamic: each split's keys from the position on the device,
`strata.ops.decode_attention.DYNAMIC_SPLITS_GPU_TESTED`; then also with the lean tiles, its `LEAN_GPU_TESTED`)
and target program count (`TARGET_PROGRAMS`), times the op a
decode step calls (`decode_attention` for bf16, `decode_attention_blocks` for q8_0 / q4_0) over `--layers` distinct
layers' windows, as one CUDA graph replayed `--reps` times (CUDA events; the median replay divided by the layers),
so the keys come from HBM and Python launch time stays out. Prints us a layer, the KV bytes read (values and
block scales of keys 0..pos, K and V), GB/s and % of `--peak-tbs`, and checks each layout against the op's
reference twin on one layer.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

sys.path.insert(0, ".")

from strata.kv.quant import QuantRows  # noqa: E402
from strata.ops import decode_attention as da  # noqa: E402
from strata.ops.decode_attention_kv import decode_attention_blocks  # noqa: E402
from strata.ops.reference import one_query_blocks  # noqa: E402

BYTES_PER_VALUE = {"bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
# (dynamic splits, lean tiles): the window-sized grid as before; splits sharing the keys up to the position; and with
# the lean tiles (16-bit dot operands; q8_0 / q4_0 block scales once a block)
LAYOUTS = ((False, False), (True, False), (True, True))


def windows(kind: str, layers: int, L: int, hkv: int, D: int, g: torch.Generator):
    """`layers` (K, V) windows of L tokens in `kind`, filled with random rows."""
    out = []
    for _ in range(layers):
        pair = []
        for _kv in range(2):
            x = torch.randn(L, hkv, D, generator=g, device="cuda")
            if kind == "bf16":
                pair.append(x.bfloat16())
            else:
                rows = QuantRows(1, L, (hkv, D), kind, torch.device("cuda"))
                rows.write(0, 0, L, x)
                pair.append(rows.window(0, L))
            del x
        out.append(tuple(pair))
    return out


def call(kind, q, ks, vs, pos_t, scale):
    if kind == "bf16":
        return da.decode_attention(q, ks, vs, pos_t, scale)
    return decode_attention_blocks(q, ks, vs, pos_t, scale)


def time_layout(kind, q, layers, pos_t, scale, reps: int) -> float:
    """Median us a layer: a graph of one call per layer, replayed."""
    for ks, vs in layers[:2]:
        call(kind, q, ks, vs, pos_t, scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for ks, vs in layers:
            call(kind, q, ks, vs, pos_t, scale)
    graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / len(layers))
    return statistics.median(times)


def time_position(a, kind, q, layers, L: int, pos: int, hkv: int, D: int, scale: float) -> bool:
    """Print one row per (programs, layout) for q [n, H, D] at positions pos-n+1..pos; False on a wrong result."""
    nq = q.shape[0]
    pos_t = torch.arange(pos - nq + 1, pos + 1, device="cuda")
    mb = (pos + 1) * hkv * D * 2 * BYTES_PER_VALUE[kind] / 1e6
    refs = [one_query_blocks(q[j:j + 1].float(), *layers[0], pos_t[j:j + 1], scale) for j in range(nq)]
    ok = True
    for programs in (int(x) for x in a.programs.split(",")):
        da.TARGET_PROGRAMS = programs
        for dyn, lean in LAYOUTS:
            da.DYNAMIC_SPLITS_GPU_TESTED, da.LEAN_GPU_TESTED = dyn, lean
            out = call(kind, q, *layers[0], pos_t, scale)
            err = max(((out[j:j + 1].float() - r).abs().max() / r.abs().max()).item() for j, r in enumerate(refs))
            ok &= err < 2e-2
            us = time_layout(kind, q, layers, pos_t, scale, a.reps)
            gbs = mb * 1e6 / (us * 1e-6) / 1e9
            S, _ = da.splits_for(L, hkv)
            layout = ("dynamic" if dyn else "fixed") + ("+lean" if lean else "")
            print(f"{kind:>5} {L:>7} {pos:>7} {nq:>2} {layout:>13} {programs:>5} {S:>6} "
                  f"{us:>9.1f} {mb:>9.2f} {gbs:>7.0f} {100 * gbs / (a.peak_tbs * 1000):>5.1f}% "
                  f"{err:>8.1e}", flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv", default="bf16,q8_0", help="KV types: bf16, q8_0, q4_0")
    ap.add_argument("--windows", default="40960,131328", help="allocated context lengths (tokens)")
    ap.add_argument("--positions", default="1024,32768,131071", help="keys attended (those past a window skipped)")
    ap.add_argument("--programs", default="256", help="TARGET_PROGRAMS values to try")
    ap.add_argument("--queries", default="1", help="queries per call (a verify step's: at positions pos-n+1..pos, "
                    "bf16 only, each key read once for all)")
    ap.add_argument("--heads", default="32,4,128", help="query heads, KV heads, head dim (B1's)")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--peak-tbs", type=float, default=4.8)
    a = ap.parse_args()
    if not torch.cuda.is_available() or not da.available():
        print("bench_attention: needs a CUDA GPU and Triton", file=sys.stderr)
        return 1
    H, hkv, D = (int(x) for x in a.heads.split(","))
    scale = D ** -0.5
    g = torch.Generator(device="cuda").manual_seed(0)
    nqs = [int(x) for x in a.queries.split(",")]
    qs = {n: torch.randn(n, H, D, generator=g, device="cuda").bfloat16() for n in nqs}
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  heads {H}/{hkv} x {D}, {a.layers} layers")
    print(f"{'kv':>5} {'window':>7} {'pos':>7} {'n':>2} {'layout':>13} {'progs':>5} {'splits':>6} {'us/layer':>9} "
          f"{'MB/layer':>9} {'GB/s':>7} {'%peak':>6} {'err':>8}")
    ok = True
    for kind in a.kv.split(","):
        for L in (int(x) for x in a.windows.split(",")):
            layers = windows(kind, a.layers, L, hkv, D, g)
            for pos in (int(x) for x in a.positions.split(",")):
                for nq in nqs:
                    if pos >= L or pos + 1 < nq or (nq > 1 and kind != "bf16"):
                        continue
                    ok &= time_position(a, kind, qs[nq], layers, L, pos, hkv, D, scale)
            del layers
            torch.cuda.empty_cache()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
