"""GPU micro-benchmark of the decode kernels that read quantized weights in place (CUDA only, < 60 s).

    python tools/bench_kernels.py [--reps 50] [--peak-tbs 4.8]
    python tools/bench_kernels.py --sweep        # every launch shape (BN, KW, warps) of each decode kernel
    python tools/bench_kernels.py --expert-formats Q4_K,IQ2_XXS,IQ2_S,IQ3_XXS,IQ4_XS,MXFP4
                                                 # the expert kernel per weight format, bytes/s against Q4_K's
    python tools/bench_kernels.py --expert-formats Q4_K,IQ2_XXS,IQ2_S,IQ3_XXS --iq-tiles packed
                                                 # the 2- and 3-bit formats' packed tiles (one setting a process)
    python tools/bench_kernels.py --expert-formats Q4_K,IQ2_XXS,IQ2_S,IQ3_XXS --iq-tiles dp4a    # their dp4a tiles
    python tools/bench_kernels.py --kq-tiles dp4a    # the default set with Q8_0's and Q4_K's dp4a tiles
    python tools/bench_kernels.py --rows 1,2,3,4,8   # the dense GEMV at T rows of x: one-row kernel vs kquant_rows
    python tools/bench_kernels.py --expert-formats Q4_K,IQ2_XXS --expert-shape 4096,1408,8   # GLM-4.5-Air's experts
    python tools/bench_kernels.py --sweep --expert-formats IQ2_XXS,IQ2_S --iq-tiles dp4a
                                                 # every launch shape of those formats' expert GLU and down


Times `strata.ops.qgemv._gemv` (the CUDA qmatmul for Q8_0 / Q4_K / Q6_K) at T = 1 for the Qwen3-30B-A3B decode
shapes, and `strata.ops.expert_triton.triton_expert_ffn` for P = 8 Q4_K experts (768 x 2048) gathered from a
pool of 64 slots. Each figure is the median over `--reps` replays of a CUDA graph of back-to-back calls
(CUDA events around each replay, divided by the calls in it), after a warm-up. The calls of a graph cycle
through copies of the weight totalling > 2x the L2 cache (and the expert calls through different slots), so
weights come from HBM as in a real decode step, and graph replay keeps Python launch time out of the figure.
Prints us per call, GB/s of bytes moved (weights + activations), % of the peak, the launch plan, and checks
every result against the dequantize-then-matmul reference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from strata.ops import expert_triton, qgemv  # noqa: E402
from strata.ops.expert_gather import _torch_gather_ffn  # noqa: E402
from strata.ops.dp4a_triton import int8_rows, parted  # noqa: E402
from strata.ops.dp4a_triton import rounds_activations as int8_rounds  # noqa: E402
from strata.quant import random_qtensor  # noqa: E402
from strata.quant.formats import block_geometry  # noqa: E402
from strata.quant.matmul import reference_qmatmul  # noqa: E402
from strata.quant.qtensor import QTensor  # noqa: E402

GEMV_SHAPES = [(4096, 2048), (512, 2048), (2048, 4096), (128, 2048), (151936, 2048)]  # (N, K)
COLD_BYTES = 128 << 20  # weight copies cycled per graph: > 2x the 50-60 MB L2 of an H100/H200
MIN_CALLS = 8  # calls per graph replay, so a replay's own overhead is small next to the kernels


def time_graph(calls, reps: int) -> float:
    """Median seconds per call of `calls` (a list of no-argument callables), replayed as one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles, allocator) outside the capture
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in calls:
            f()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(calls))
    return statistics.median(times)


def report(name: str, seconds: float, nbytes: int, plan, err: float, tol: float, peak: float) -> bool:
    gbs = nbytes / seconds / 1e9
    ok = err < tol
    print(f"{name:<34} {seconds * 1e6:9.1f} us {gbs:8.0f} GB/s {100 * gbs / (peak * 1e3):5.1f}%  "
          f"plan(BN, KW, even, warps)={plan}  rel.err {err:.1e} {'ok' if ok else 'FAIL'}", flush=True)
    return ok


def bench_gemv(qt, N: int, K: int, reps: int, peak: float) -> bool:
    dev = torch.device("cuda")
    w = random_qtensor(qt, (N, K), rng=int(qt) * 7 + N, scale=0.02, device=dev)
    wbytes = w.raw.numel()
    copies = [w] + [QTensor(w.raw.clone(), qt, w.shape) for _ in range(min(1023, COLD_BYTES // wbytes))]
    x = torch.randn(1, K, device=dev).bfloat16()  # [T, K] decode activations
    y = qgemv._gemv(x, w)
    ref = reference_qmatmul(x.float(), w)  # [T, N] float32
    err = ((y.float() - ref).norm() / ref.norm()).item()
    calls = [(lambda c=c: qgemv._gemv(x, c)) for c in copies]
    calls = calls * -(-MIN_CALLS // len(calls))
    t = time_graph(calls, reps)
    plan = expert_triton.plan((qt,), N, K, 1, dev)
    del copies
    # bf16 output: one rounding of a float32 sum (2^-9 relative rms)
    return report(f"gemv {qt.name:<5} N={N:<6} K={K}", t, wbytes + 2 * K + 2 * N, plan, err, 1e-2, peak)


def bench_rows(qt, N: int, K: int, T: int, reps: int, peak: float) -> bool:
    """T rows of x through the one-row kernel (a program per row) and kquant_rows (each block decoded once)."""
    dev = torch.device("cuda")
    w = random_qtensor(qt, (N, K), rng=int(qt) * 7 + N, scale=0.02, device=dev)
    wbytes = w.raw.numel()
    copies = [w] + [QTensor(w.raw.clone(), qt, w.shape) for _ in range(min(1023, COLD_BYTES // wbytes))]
    x = torch.randn(T, K, device=dev).bfloat16()
    ref = reference_qmatmul(x.float(), w)
    ok, base = True, None
    for rows in (False, True) if T > 1 else (False,):
        y = qgemv._gemv(x, w, rows=rows)
        err = ((y.float() - ref).norm() / ref.norm()).item()
        calls = [(lambda c=c: qgemv._gemv(x, c, rows=rows)) for c in copies]
        t = time_graph(calls * -(-MIN_CALLS // len(calls)), reps)
        base = base or t
        ok &= report(f"gemv {qt.name:<5} N={N:<6} K={K} T={T} {'rows' if rows else 'one-row'}", t,
                     wbytes + 2 * T * (K + N), None, err, 1e-2, peak)
        if rows:
            print(f"   rows kernel: {base / t:.2f}x the one-row kernel", flush=True)
    del copies
    return ok


B1_EXPERTS = (2048, 768, 8)  # (d, ff, P): Qwen3-30B-A3B's experts and top-k


def bench_experts(reps: int, peak: float, qt=Q.Q4_K, shape=B1_EXPERTS, hot: bool = False) -> tuple[bool, float]:
    """The fused expert FFN over P experts of format qt; (checked, GB/s of weights and activations). A graph's calls
    read different experts of a pool of 8 P (at least 64), more bytes than L2 holds in every format, as a decode step
    reads its experts from HBM; `hot`: the same P experts every call, from L2 after the first (as llama.cpp's
    test-backend-ops times its kernels)."""
    dev = torch.device("cuda")
    d, ff, P = shape
    S = P if hot else max(64, 8 * P)
    gate, up = (random_qtensor(qt, (S, ff, d), rng=s, device=dev) for s in (1, 2))
    down = random_qtensor(qt, (S, d, ff), rng=3, device=dev)
    x = torch.randn(P, d, device=dev).bfloat16()  # [P, d]
    gen = torch.Generator().manual_seed(0)
    slot_sets = [torch.randperm(S, generator=gen)[:P].to(dev) for _ in range(MIN_CALLS)]  # different experts
    if not hot:  # (each call its own P of the pool: no expert read twice in a replay)
        order = torch.randperm(S, generator=gen)
        slot_sets = [order[(i * P) % S:(i * P) % S + P].to(dev) for i in range(MIN_CALLS)]
    y = expert_triton.triton_expert_ffn(x, gate, up, down, slot_sets[0])
    ref = _torch_gather_ffn(x.float(), gate, up, down, slot_sets[0])
    err = ((y - ref).norm() / ref.norm()).item()
    t = time_graph([(lambda s=s: expert_triton.triton_expert_ffn(x, gate, up, down, s)) for s in slot_sets], reps)
    per_expert = sum(q.raw[0].numel() for q in (gate, up, down))
    nbytes = P * per_expert + x.numel() * 2 + P * ff * 4 * 2 + P * d * 4  # weights, x, a (written, read), y
    plan = (expert_triton.plan((qt, qt), ff, d, P, dev), expert_triton.plan((qt,), d, ff, P, dev))
    tol = 3e-2 if int8_rounds(qt) else 1e-5  # (the dp4a tiles round x and the GLU's output to int8)
    ok = report(f"expert ffn {qt.name} P={P} {ff}x{d} /{S}{' hot' if hot else ''}", t, nbytes, plan, err, tol, peak)
    return ok, nbytes / t / 1e9


def _launch_gemv(x, w, out, bn, kw, warps, slots=None):
    N, K = (w.shape[-2], w.shape[-1])
    raw = w.raw
    P = x.shape[0]
    gather = slots is not None
    tab = expert_triton.codebooks_for((w.qtype,), out)
    xq = int8_rows(x, (w.qtype,), torch.bfloat16)
    expert_triton._gemv_kernel[(P * expert_triton.triton.cdiv(N, bn),)](
        x, xq, raw, slots if gather else raw, raw, out, tab, out, P, N, K, raw[0].numel() if gather else raw.numel(),
        raw.shape[-1], QT=int(w.qtype), BN=bn, KW=kw, EVEN=K % kw == 0, GATHER=gather, HOST=False,
        num_warps=warps, PARTS=parted((w.qtype,), xq))


def _launch_glu(x, gate, up, a, slots, bn, kw, warps):
    P, d = x.shape
    ff = gate.shape[1]
    g, u = gate.raw, up.raw
    tab = expert_triton.codebooks_for((gate.qtype, up.qtype), a)
    xq = int8_rows(x, (gate.qtype, up.qtype))
    expert_triton._glu_kernel[(P * expert_triton.triton.cdiv(ff, bn),)](
        x, xq, g, u, slots, g, u, slots, tab, a, P, ff, d, 1, g[0].numel(), u[0].numel(), g.shape[-1], u.shape[-1],
        QG=int(gate.qtype), QU=int(up.qtype), BN=bn, KW=kw, EVEN=d % kw == 0, HOST=False, num_warps=warps,
        PARTS=parted((gate.qtype, up.qtype), xq))


def sweep(reps: int, peak: float, formats=None, shape=B1_EXPERTS) -> None:
    """Every (BN, KW, warps) of each B1 decode kernel, fastest first, beside the plan's own choice; with
    `formats`, of those formats' expert GLU and down launches at `shape` only."""
    dev = torch.device("cuda")
    d, ff, P = shape
    S = 64
    cases = []
    for qt, N, K in [] if formats else [(Q.Q8_0, 4096, 2048), (Q.Q8_0, 512, 2048), (Q.Q8_0, 2048, 4096),
                                        (Q.Q6_K, 151936, 2048), (Q.Q4_K, 4096, 2048)]:
        w = random_qtensor(qt, (N, K), rng=N, scale=0.02, device=dev)
        copies = [w] + [QTensor(w.raw.clone(), qt, w.shape) for _ in range(min(63, COLD_BYTES // w.raw.numel()))]
        x = torch.randn(1, K, device=dev).bfloat16()
        out = torch.empty(1, N, device=dev, dtype=torch.bfloat16)
        nbytes = w.raw.numel()
        cases.append((f"gemv {qt.name} {N}x{K}", K, nbytes, expert_triton.plan((qt,), N, K, 1, dev),
                      lambda bn, kw, wp, copies=copies, x=x, out=out: [
                          (lambda c=c: _launch_gemv(x, c, out, bn, kw, wp)) for c in copies]))
    xe = torch.randn(P, d, device=dev).bfloat16()
    a = torch.randn(P, ff, device=dev)  # (float32, as triton_expert_ffn's GLU output)
    y = torch.empty(P, d, device=dev)
    gen = torch.Generator().manual_seed(0)
    S = max(S, 8 * P)  # (each call its own P experts of the pool, as bench_experts reads them)
    order = torch.randperm(S, generator=gen)
    slot_sets = [order[(i * P) % S:(i * P) % S + P].to(dev) for i in range(MIN_CALLS)]
    for qt in formats or (Q.Q4_K,):
        gate, up = (random_qtensor(qt, (S, ff, d), rng=s, device=dev) for s in (1, 2))
        down = random_qtensor(qt, (S, d, ff), rng=3, device=dev)
        per = gate.raw[0].numel()
        cases.append((f"glu {qt.name} P={P} {ff}x{d}", d, 2 * P * per, expert_triton.plan((qt, qt), ff, d, P, dev),
                      lambda bn, kw, wp, gate=gate, up=up: [
                          (lambda s=s: _launch_glu(xe, gate, up, a, s, bn, kw, wp)) for s in slot_sets]))
        cases.append((f"down {qt.name} P={P} {d}x{ff}", ff, P * down.raw[0].numel(),
                       expert_triton.plan((qt,), d, ff, P, dev),
                       lambda bn, kw, wp, down=down: [
                           (lambda s=s: _launch_gemv(a, down, y, bn, kw, wp, s)) for s in slot_sets]))
    for name, K, nbytes, plan, make in cases:
        rows = []
        # (per format: a smaller grid, every point of which compiles anew)
        for bn in (1, 2, 4, 8) if formats else (1, 2, 4, 8, 16):
            for kw in (256, 512, 1024, 2048):
                if kw > max(256, triton_next_pow2(K)):
                    continue
                for wp in (1, 2, 4) if formats else (1, 2, 4, 8):
                    try:
                        t = time_graph(make(bn, kw, wp), reps)
                    except Exception as e:  # noqa: BLE001 - a shape the compiler refuses is a row, not a stop
                        print(f"  {name} BN={bn} KW={kw} warps={wp}: {type(e).__name__}", flush=True)
                        continue
                    rows.append((t, bn, kw, wp))
        rows.sort()
        mine = next((r for r in rows if (r[1], r[2], r[3]) == (plan[0], plan[1], plan[3])), None)
        print(f"{name}: plan {plan} " + (f"{mine[0] * 1e6:.1f} us" if mine else "(not swept)"), flush=True)
        for t, bn, kw, wp in rows[:6]:
            gbs = nbytes / t / 1e9
            print(f"   BN={bn:<2} KW={kw:<4} warps={wp}  {t * 1e6:7.1f} us  {gbs:6.0f} GB/s {100 * gbs / (peak * 1e3):5.1f}%",
                  flush=True)
        torch.cuda.empty_cache()


def triton_next_pow2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--peak-tbs", type=float, default=4.8, help="HBM peak the percentages refer to (TB/s)")
    ap.add_argument("--sweep", action="store_true", help="time every launch shape of each kernel instead")
    ap.add_argument("--expert-formats", default=None,
                    help="comma-separated weight formats: the expert kernel in each (B1's expert shapes), its bytes/s "
                         "against Q4_K's, instead of the default set")
    ap.add_argument("--iq-tiles", choices=("auto", "lookup", "packed", "dp4a", "dp4a-wide", "dp4a-signs",
                                                "dp4a-sel"), default="auto",
                    help="the IQ2_XXS / IQ2_S / IQ3_XXS tiles: as strata takes them (auto), or one kind (dp4a: "
                         "four weights a step against int8 activations, strata.ops.dp4a_triton; dp4a-wide: the same "
                         "with its table word pairs read as 64-bit words; dp4a-signs: and IQ2_XXS's / IQ3_XXS's signs "
                         "computed from their index; dp4a-sel: and IQ2_XXS's weights by byte permutes)")
    ap.add_argument("--kq-tiles", choices=("auto", "float", "dp4a"), default="auto",
                    help="the Q8_0 / Q4_K tiles: as strata takes them (auto), the float ones, or the dp4a ones (int8 "
                         "activations, strata.ops.dp4a_triton)")
    ap.add_argument("--parts", choices=("auto", "on", "off"), default="auto",
                    help="Q8_0's and the i-quants' dp4a tiles summed over their sub-blocks once after the loop (on) or "
                         "in every iteration (off); auto: as strata takes them (dp4a_triton.PARTS_GPU_TESTED)")
    ap.add_argument("--rows", default=None, help="comma-separated row counts of x (e.g. 1,2,3,4,8): the dense GEMV "
                    "shapes at each, the one-row kernel against kquant_rows (2-8 rows), instead of the default set")
    ap.add_argument("--expert-shape", default=",".join(map(str, B1_EXPERTS)),
                    help="d,ff,P of --expert-formats and of the sweep's expert launches (default B1's; GLM-4.5-Air: "
                         "4096,1408,8; Qwen3-Next-80B-A3B: 2048,512,10)")
    ap.add_argument("--hot", action="store_true",
                    help="--expert-formats: the same experts every call (L2-resident), as test-backend-ops times")
    a = ap.parse_args()
    if a.kq_tiles != "auto":  # before any kernel compiles: a compiled kernel keeps what it read
        import triton.language as tl

        from strata.ops import dp4a_triton

        dp4a_triton.C_KQ = tl.constexpr(a.kq_tiles == "dp4a")
    if a.parts != "auto":
        import triton.language as tl

        from strata.ops import dp4a_triton

        dp4a_triton.C_PARTS = tl.constexpr(a.parts == "on")
    if a.iq_tiles != "auto":
        import triton.language as tl

        from strata.ops import dp4a_triton, iquant_triton

        iquant_triton.C_PACKED = tl.constexpr(a.iq_tiles == "packed")
        dp4a_triton.C_DP4A = tl.constexpr(a.iq_tiles.startswith("dp4a"))
        dp4a_triton.C_WIDE = tl.constexpr(a.iq_tiles in ("dp4a-wide", "dp4a-signs", "dp4a-sel"))
        dp4a_triton.C_ASIGN = tl.constexpr(a.iq_tiles in ("dp4a-signs", "dp4a-sel"))
        dp4a_triton.C_SEL = tl.constexpr(a.iq_tiles == "dp4a-sel")
    if not torch.cuda.is_available() or not expert_triton.available():
        print("bench_kernels: needs a CUDA GPU and Triton", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {expert_triton.triton.__version__}")
    shape = tuple(int(v) for v in a.expert_shape.split(","))
    if a.sweep:
        fmts = [Q[n.strip().upper()] for n in a.expert_formats.split(",")] if a.expert_formats else None
        sweep(min(a.reps, 20), a.peak_tbs, fmts, shape)
        print(f"total {time.perf_counter() - t0:.1f} s")
        return 0
    ok = True
    if a.rows:
        for qt in (Q.Q8_0, Q.Q4_K, Q.Q6_K):
            for N, K in GEMV_SHAPES[:4] + [(8192, 384)]:
                if K % block_geometry(qt)[0]:  # (a row of 384 is whole blocks of Q8_0's 32 only)
                    continue
                for T in (int(v) for v in a.rows.split(",")):
                    ok &= bench_rows(qt, N, K, T, a.reps, a.peak_tbs)
                torch.cuda.empty_cache()
        print(f"total {time.perf_counter() - t0:.1f} s")
        return 0 if ok else 1
    if a.expert_formats:  # the expert kernel per format; bytes/s of each against the first (Q4_K: put it first)
        base = None
        for name in a.expert_formats.split(","):
            good, gbs = bench_experts(a.reps, a.peak_tbs, Q[name.strip().upper()], shape, a.hot)
            base = base or gbs
            print(f"   {name.strip()}: {gbs / base:.2f} of {a.expert_formats.split(',')[0].strip()}'s bytes/s",
                  flush=True)
            ok &= good
            torch.cuda.empty_cache()
        print(f"total {time.perf_counter() - t0:.1f} s")
        return 0 if ok else 1
    for qt in (Q.Q8_0, Q.Q4_K, Q.Q6_K):
        for N, K in GEMV_SHAPES:
            ok &= bench_gemv(qt, N, K, a.reps, a.peak_tbs)
            torch.cuda.empty_cache()
    ok &= bench_experts(a.reps, a.peak_tbs)[0]
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
