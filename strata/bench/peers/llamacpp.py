"""llama.cpp as the peer: `--n-cpu-moe` fitted to a VRAM budget, `llama-bench` runs parsed into the sweep's
shape, and llama.cpp's HTTP server started so that the bench's own suites run against it unchanged.

Binaries: `peers/llama.cpp/build/bin/{llama-bench,llama-server}` as `bench/peers/llamacpp.sh build` makes
them on the GPU machine (or any path given). Without a `llama-server` binary the server is the `xllamacpp`
package (llama.cpp's CPU build, in a child process): the same HTTP API, for CPU-only comparisons.

Fitting: llama.cpp with `-ngl 99` keeps every non-expert tensor on the GPU except the input embeddings (its
input layer lives in host memory); `--n-cpu-moe N` keeps the experts of the first N layers in host memory.
VRAM(N) = dense on GPU + experts of layers >= N + KV (f16, for the context) + a fixed overhead (CUDA context
and compute buffers). The smallest N whose VRAM(N) fits the budget wins. The overhead is an estimate, so
the peak VRAM of every run is measured and reported next to the budget.

`python -m strata.bench.peers.llamacpp fit MODEL --budget-gib 8` prints N; `... bench MODEL --budget-gib 8`
runs llama-bench and writes its JSON (what bench/peers/llamacpp.sh calls).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from strata import StrataError
from strata.bench.client import ServerProcess, free_port
from strata.bench.record import VramPeak
from strata.bench.stats import Summary

ROOT = Path(__file__).resolve().parents[3]
BUILD_BIN = ROOT / "peers" / "llama.cpp" / "build" / "bin"
GiB = 1 << 30
DEFAULT_OVERHEAD_GIB = 1.5  # CUDA context + compute buffers at the default ubatch (BENCH.md: 2.7 GiB peak with
# all 48 experts layers on the CPU, 1.26 GiB of it weights)
_LAYER = re.compile(r"^blk\.(\d+)\.")


@dataclass
class LayerSizes:
    n_layers: int
    dense_gpu_bytes: int  # non-expert tensors llama.cpp puts on the GPU with -ngl 99
    host_only_bytes: int  # the input embeddings (always in host memory)
    expert_bytes: dict[int, int] = field(default_factory=dict)  # layer -> routed-expert bytes
    kv_bytes_per_token: int = 0

    def vram(self, n_cpu_moe: int, ctx: int, overhead: int) -> int:
        on_gpu = sum(b for layer, b in self.expert_bytes.items() if layer >= n_cpu_moe)
        return self.dense_gpu_bytes + on_gpu + self.kv_bytes_per_token * ctx + overhead


def layer_sizes(model: str | Path, cache_types: tuple[str, str] = ("f16", "f16")) -> LayerSizes:
    """The model's bytes as llama.cpp places them; the KV per token in `cache_types` (its -ctk, -ctv)."""
    from strata.hub.check import kv_bytes_per_token
    from strata.hub.local import resolve_model
    from strata.hub.verify import read_gguf_header

    headers = [read_gguf_header(p) for p in resolve_model(str(model))]
    first = headers[0]
    n_layers = int(first.arch_value("block_count", 0) or 0)
    dense = host = 0
    experts: dict[int, int] = {}
    for h in headers:
        for t in h.tensors:
            m = _LAYER.match(t.name)
            if "_exps" in t.name and m:
                experts[int(m.group(1))] = experts.get(int(m.group(1)), 0) + t.n_bytes
            elif t.name == "token_embd.weight":
                host += t.n_bytes
            else:
                dense += t.n_bytes
    if not experts:
        raise StrataError(f"{model}: no expert tensors (*_exps): not a MoE model, --n-cpu-moe does not apply")
    return LayerSizes(n_layers, dense, host, experts, kv_bytes_per_token(first, *cache_types))


def fit_n_cpu_moe(sizes: LayerSizes, budget_bytes: int, ctx: int,
                  overhead_bytes: int = int(DEFAULT_OVERHEAD_GIB * GiB)) -> tuple[int, int]:
    """(smallest N with VRAM(N) <= budget, that VRAM). N = n_layers: every expert on the CPU."""
    for n in range(sizes.n_layers + 1):
        v = sizes.vram(n, ctx, overhead_bytes)
        if v <= budget_bytes:
            return n, v
    need = sizes.vram(sizes.n_layers, ctx, overhead_bytes)
    raise StrataError(f"llama.cpp needs {need / GiB:.2f} GiB with every expert on the CPU (dense weights, KV for "
                      f"{ctx} tokens, overhead): more than the budget of {budget_bytes / GiB:.2f} GiB")


def find_binary(name: str, given: str | None = None) -> Path | None:
    if given:
        p = Path(given)
        if p.is_dir():
            p = p / name
        if not p.is_file():
            raise StrataError(f"--{name} {given}: no such file (the {name} binary, or its directory)")
        return p
    p = BUILD_BIN / name
    return p if p.is_file() else None


def cpu_build_available() -> bool:
    """Whether the `xllamacpp` package (llama.cpp's CPU build, the peer without a llama-server binary) imports."""
    try:
        import xllamacpp  # noqa: F401
    except ImportError:
        return False
    return True


def check_peer(server_given: str | None, bench_given: str | None) -> tuple[Path | None, Path | None]:
    """(llama-server, llama-bench) for `--vs llamacpp`, checked before any server starts: a wrong path or no
    llama.cpp at all is said at once, not after strata's whole run. None: the CPU build / no llama-bench."""
    server = find_binary("llama-server", server_given)
    bench = None if bench_given == "none" else find_binary("llama-bench", bench_given)
    if server is None and not cpu_build_available():
        raise StrataError(f"--vs llamacpp needs llama.cpp's server: build it (bench/peers/llamacpp.sh build, into "
                          f"{BUILD_BIN}), pass --llama-server PATH, or pip install xllamacpp (its CPU build)")
    return server, bench


# ---------------------------------------------------------------------------------------------------------------
# llama-bench


def llama_bench_argv(binary: Path, model: str, *, n_cpu_moe: int | None, threads: int, prompts: list[int] | None = None,
                     gen: int = 0, depths: list[int] | None = None, reps: int = 3, ubatch: int = 512,
                     batch: int = 2048, cache_types: tuple[str, str] | None = None) -> list[str]:
    """One llama-bench call: prefill tests (-p LIST -n 0) or decode tests (-p 0 -n GEN -d LIST).

    As BENCH.md's tuned setting: every layer on the GPU (-ngl 99), flash attention, experts in host memory
    loaded without mmap (-lm none), JSON output; cache_types: the KV's -ctk / -ctv (None: its default, f16)."""
    argv = [str(binary), "-m", str(model), "-ngl", "99", "-fa", "1", "-lm", "none", "-t", str(threads),
            "-r", str(reps), "-b", str(batch), "-ub", str(ubatch), "-o", "json"]
    if n_cpu_moe:
        argv += ["-ncmoe", str(n_cpu_moe)]
    if cache_types:
        argv += ["-ctk", cache_types[0], "-ctv", cache_types[1]]
    if prompts:
        argv += ["-p", ",".join(map(str, prompts)), "-n", "0"]
    else:
        argv += ["-p", "0", "-n", str(gen), "-d", ",".join(map(str, depths or [0]))]
    return argv


def parse_llama_bench(records: list[dict], lengths: list[int], gen: int) -> dict:
    """llama-bench JSON records -> a sweep-shaped suite: row L = prefill of an L-token prompt (pp L) and decode
    of `gen` tokens after L tokens of context (tg gen @ d L)."""
    pp = {int(r["n_prompt"]): r for r in records if int(r.get("n_gen", 0)) == 0 and int(r.get("n_prompt", 0)) > 0}
    tg = {int(r.get("n_depth", 0)): r for r in records if int(r.get("n_gen", 0)) > 0 and int(r.get("n_prompt", 0)) == 0}
    rows = []
    for n in lengths:
        row = {"length": n, "prompt_tokens": [n], "runs": [], "experts": {}}
        for key, src in (("prefill_tok_s", pp.get(n)), ("decode_tok_s", tg.get(n))):
            row[key] = Summary.of(src.get("samples_ts") or [src["avg_ts"]]).as_dict() if src else Summary.of([]).as_dict()
        row["ttft_s"] = Summary.of([]).as_dict()
        rows.append(row)
    return {"config": {"lengths": lengths, "runs": len((records[0].get("samples_ts") or [1])) if records else 0,
                       "warmup": 1, "gen": gen, "tolerance": 0.0, "cache_prompt": False, "tool": "llama-bench"},
            "rows": rows, "skipped": []}


def run_llama_bench(binary: Path, model: str, *, budget_gib: float | None, lengths: list[int], gen: int,
                    threads: int, reps: int = 3, ubatch: int = 512, n_cpu_moe: int | None = None,
                    overhead_gib: float = DEFAULT_OVERHEAD_GIB, cache_types: tuple[str, str] | None = None,
                    log=print) -> dict:
    """Prefill at every length and decode after every length, fitted to the budget; peak VRAM measured. When
    N was fitted (not given) and the measured peak went past the budget — the fit's overhead is an estimate, and
    a large -ub takes more compute buffer (`-ub 4096`, B1: 8.42 GiB at a fitted 8) — the runs are repeated with
    one more expert layer in host memory until the peak fits, so the peer is held to the budget strata is."""
    fit = None
    if n_cpu_moe is None and budget_gib is not None:
        sizes = layer_sizes(model, cache_types or ("f16", "f16"))
        n_cpu_moe, est = fit_n_cpu_moe(sizes, int(budget_gib * GiB), max(lengths) + gen, int(overhead_gib * GiB))
        fit = {"n_cpu_moe": n_cpu_moe, "estimated_vram_bytes": est, "overhead_gib": overhead_gib, "tried": []}
    while True:
        records, calls = [], []
        with VramPeak() as peak:
            argvs = [llama_bench_argv(binary, model, n_cpu_moe=n_cpu_moe, threads=threads, prompts=lengths, reps=reps,
                                      ubatch=ubatch, cache_types=cache_types)]
            if gen > 0:  # --gen 0: prefill only
                argvs.append(llama_bench_argv(binary, model, n_cpu_moe=n_cpu_moe, threads=threads, gen=gen,
                                              depths=lengths, reps=reps, ubatch=ubatch, cache_types=cache_types))
            for argv in argvs:
                log("llama-bench: " + " ".join(argv))
                cp = subprocess.run(argv, capture_output=True, text=True)
                if cp.returncode != 0:
                    raise StrataError(f"llama-bench failed (exit {cp.returncode}): {cp.stderr.strip()[-600:]}")
                records += json.loads(cp.stdout)
                calls.append(argv)
        over = bool(budget_gib and peak.peak and peak.peak > budget_gib * GiB)
        if fit is None or not over or n_cpu_moe >= sizes.n_layers:
            break
        fit["tried"].append({"n_cpu_moe": n_cpu_moe, "vram_peak_bytes": peak.peak})
        log(f"llama-bench peaked at {peak.peak / GiB:.2f} GiB with -ncmoe {n_cpu_moe}, over the {budget_gib:g} GiB "
            f"budget: again with -ncmoe {n_cpu_moe + 1}")
        n_cpu_moe += 1
    suite = parse_llama_bench(records, lengths, gen)
    kv = f" -ctk {cache_types[0]} -ctv {cache_types[1]}" if cache_types else ""
    return {"how": f"llama-bench (`-ngl 99 -fa 1 -lm none -ncmoe {n_cpu_moe}{kv}`, {threads} threads, -r {reps}); "
                   f"prefill = pp L, decode = tg{gen} @ depth L",
            "n_cpu_moe": n_cpu_moe, "fit": fit, "budget_gib": budget_gib, "vram_peak_bytes": peak.peak,
            "over_budget": over,
            "commands": calls, "records": records, "suites": {"sweep": suite}}


# ---------------------------------------------------------------------------------------------------------------
# llama.cpp's server


def context_override(model: str | Path, ctx: int) -> list[str]:
    """llama-server caps each slot's context at the model's trained one (with one warning line, then refuses the
    longer prompts): a slot context past it (the bench's -c, as strata's server takes it) gets the GGUF's
    context_length raised to it, which is how llama.cpp runs past the trained context (speed only)."""
    from strata.hub.local import resolve_model
    from strata.hub.verify import read_gguf_header

    header = read_gguf_header(resolve_model(str(model))[0])
    trained = int(header.arch_value("context_length", 0) or 0)
    if not trained or ctx <= trained:
        return []
    return ["--override-kv", f"{header.architecture}.context_length=int:{int(ctx)}"]


def llamacpp_server(model: str, log: Path, *, parallel: int, ctx: int, threads: int, n_cpu_moe: int | None = None,
                    binary: Path | None = None, port: int | None = None,
                    cache_types: tuple[str, str] | None = None) -> tuple[ServerProcess, str]:
    """(server process, description). `ctx` is per slot; llama.cpp splits -c among its slots, so it gets
    ctx * parallel. cache_types: its -ctk / -ctv (None: its default, f16)."""
    port = port or free_port()
    if binary is not None:
        argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-ngl", "99", "-fa", "on",
                "-lm", "none", "-c", str(ctx * parallel), "-np", str(parallel), "-t", str(threads), "--jinja",
                "--no-webui"]
        if n_cpu_moe:
            argv += ["--n-cpu-moe", str(n_cpu_moe)]
        if cache_types:
            argv += ["-ctk", cache_types[0], "-ctv", cache_types[1]]
        argv += context_override(model, ctx)
        how = f"llama-server `{' '.join(argv[3:])}`"
    else:
        argv = [sys.executable, "-m", "strata.bench.peers.xllamacpp_server", "--model", str(model), "--port", str(port),
                "--ctx", str(ctx * parallel), "--parallel", str(parallel), "--threads", str(threads)]
        how = f"llama.cpp CPU build (xllamacpp), {threads} threads, -c {ctx * parallel} -np {parallel}"
    # OpenMP threads spinning between requests starve the HTTP thread on small machines
    env = {"OMP_WAIT_POLICY": "passive"}
    return ServerProcess(argv, port, log, "llama.cpp", env=env), how


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m strata.bench.peers.llamacpp", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit", help="print --n-cpu-moe for a VRAM budget")
    b = sub.add_parser("bench", help="run llama-bench fitted to a budget and write its results as JSON")
    for q in (f, b):
        q.add_argument("model")
        q.add_argument("--budget-gib", type=float, required=True)
        q.add_argument("--overhead-gib", type=float, default=DEFAULT_OVERHEAD_GIB)
        q.add_argument("--lengths", default="512,4096", help="prompt lengths (comma-separated)")
        q.add_argument("--gen", type=int, default=128)
    b.add_argument("--bin", default=None, help="llama-bench binary (default: peers/llama.cpp/build/bin/llama-bench)")
    b.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    b.add_argument("--reps", type=int, default=3)
    b.add_argument("--ubatch", type=int, default=512)
    b.add_argument("--n-cpu-moe", type=int, default=None, help="override the fitted value")
    b.add_argument("--out", default=None, help="write the JSON here (default: stdout)")
    a = p.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",") if x]
    try:
        if a.cmd == "fit":
            sizes = layer_sizes(a.model)
            n, est = fit_n_cpu_moe(sizes, int(a.budget_gib * GiB), max(lengths) + a.gen, int(a.overhead_gib * GiB))
            print(n)
            print(f"estimated VRAM {est / GiB:.2f} GiB of {a.budget_gib} GiB ({sizes.n_layers} layers, experts "
                  f"{sum(sizes.expert_bytes.values()) / GiB:.2f} GiB)", file=sys.stderr)
            return 0
        binary = find_binary("llama-bench", a.bin)
        if binary is None:
            raise StrataError(f"no llama-bench at {BUILD_BIN} (run bench/peers/llamacpp.sh build)")
        res = run_llama_bench(binary, a.model, budget_gib=a.budget_gib, lengths=lengths, gen=a.gen, threads=a.threads,
                              reps=a.reps, ubatch=a.ubatch, n_cpu_moe=a.n_cpu_moe, overhead_gib=a.overhead_gib,
                              log=lambda m: print(m, file=sys.stderr))
    except StrataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    text = json.dumps(res, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    else:
        print(text)
    for row in res["suites"]["sweep"]["rows"]:
        print(f"L={row['length']}: prefill {Summary(**row['prefill_tok_s']).fmt()} tok/s, decode "
              f"{Summary(**row['decode_tok_s']).fmt()} tok/s", file=sys.stderr)
    if res["vram_peak_bytes"]:
        print(f"peak VRAM {res['vram_peak_bytes'] / GiB:.2f} GiB (budget {a.budget_gib} GiB)"
              + (" OVER BUDGET" if res["over_budget"] else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
