"""`strata pull` and `strata check`."""

from __future__ import annotations

import argparse
import json
import sys
import threading
from dataclasses import asdict
from pathlib import Path

from strata.hub.http import Task
from strata.hub.pull import PullOptions, Reporter


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "pull",
        help="download a model (resumable, verified)",
        description="Download a GGUF model from Hugging Face (REPO[:QUANT_OR_FILE], all shards of a split set) "
        "or a plain URL, resuming partial files and verifying the full sha256 before a file counts as done.",
    )
    p.add_argument("spec", metavar="REPO[:QUANT_OR_FILE] | URL", help="e.g. unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M")
    p.add_argument(
        "--models-dir", type=Path, help="where models go (default: $STRATA_MODELS_DIR or ~/.cache/strata/models)"
    )
    p.add_argument("--revision", default="main", help="hub branch, tag or commit (default: main)")
    p.add_argument("--endpoint", help="hub endpoint (default: $HF_ENDPOINT or https://huggingface.co)")
    p.add_argument("--token", help="hub token (default: the saved one / $HF_TOKEN)")
    p.add_argument(
        "--sha256", action="append", metavar="HEX", help="URL only: expected sha256 (once per shard, in order)"
    )
    p.add_argument("--size", type=int, metavar="BYTES", help="URL only: expected size in bytes")
    p.add_argument("--manifest", type=Path, help="URL only: sha256sum-style or JSON file of expected hashes")
    p.add_argument("-o", "--output", type=Path, help="URL only: destination file or directory")
    p.add_argument("-j", "--jobs", type=int, default=4, help="files downloaded in parallel (default: 4)")
    p.add_argument("--retries", type=int, default=8, help="retries per file without progress (default: 8)")
    p.add_argument("--verify", action="store_true", help="re-hash files already marked done")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_pull)

    c = subparsers.add_parser(
        "check",
        help="report the machine and whether a model fits",
        description="Report GPUs (VRAM, PCIe link), RAM, CPU and disk; with -m, what the model needs and the verdict "
        "(exit status 1 when it cannot run).",
    )
    c.add_argument("-m", "--model", help="a GGUF path or REPO[:QUANT] in the models directory")
    c.add_argument("--models-dir", type=Path, help="models directory (default: as for pull)")
    c.add_argument("--vram-gb", type=float, help="VRAM budget in GiB (default: the first GPU's free VRAM)")
    c.add_argument("-c", "--ctx-size", type=int, default=0, help="context to plan for (default: min(model's, 8192))")
    from strata.experts.sizing import KV_TYPE_BLOCKS  # torch-free, as check is

    for short, flag, what in (("-ctk", "--cache-type-k", "K (MLA: the latent)"), ("-ctv", "--cache-type-v", "V")):
        c.add_argument(short, flag, default=None, choices=tuple(KV_TYPE_BLOCKS),
                       help=f"KV cache type of {what} to plan for, as the engine's flag (default: the engine's, f16's "
                            "size on a GPU, f32 on a CPU alone)")
    c.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1,
                   help="judge the model split over N pipeline stages (each stage's layers, VRAM and slots; stage r "
                        "on GPU r, each with --vram-gb)")
    c.add_argument("--layer-split", default="auto", help="layers per stage: auto or comma-separated counts")
    c.add_argument("--kv-vram-tokens", type=int, default=None, metavar="N",
                   help="plan for a KV window: the whole KV in host RAM, N tokens a layer of it in VRAM")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(func=cmd_check)


# --- pull ------------------------------------------------------------------------------------------------


class _RichTask:
    def __init__(self, progress, task_id) -> None:
        self.progress, self.id = progress, task_id

    def update(self, completed: int, total: int | None = None) -> None:
        if total is not None:
            self.progress.update(self.id, completed=completed, total=total)
        else:
            self.progress.update(self.id, completed=completed)

    def advance(self, n: int) -> None:
        self.progress.advance(self.id, n)


class RichReporter(Reporter):
    """Progress bars (bytes, rate, ETA) on stderr; warnings and notes printed above them."""

    def __init__(self, bars: bool = True) -> None:
        super().__init__()
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.console = Console(stderr=True)
        self.bars = bars and self.console.is_terminal
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=True,
            disable=not self.bars,
        )
        self._ids_lock = threading.Lock()

    def __enter__(self) -> "RichReporter":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def task(self, description: str, total: int | None) -> Task:
        with self._ids_lock:
            return _RichTask(self.progress, self.progress.add_task(description, total=total))

    def done(self, task: Task) -> None:
        if isinstance(task, _RichTask):
            self.progress.remove_task(task.id)

    def warn(self, msg: str) -> None:
        super().warn(msg)
        style = "bold red" if msg.startswith("NO KNOWN SHA256") else "yellow"
        self.console.print(f"warning: {msg}", style=style, markup=False, highlight=False)

    def info(self, msg: str) -> None:
        super().info(msg)
        self.console.print(msg, markup=False, highlight=False)


def cmd_pull(args: argparse.Namespace) -> int:
    from strata.hub.pull import pull

    from strata import StrataError

    if args.jobs < 1 or args.retries < 0:
        raise StrataError(f"--jobs must be >= 1 and --retries >= 0, got {args.jobs} and {args.retries}")
    opts = PullOptions(jobs=args.jobs, retries=args.retries, verify=args.verify)
    try:
        with RichReporter(bars=not args.quiet) as rep:
            files = pull(
                args.spec,
                models_dir=args.models_dir,
                revision=args.revision,
                endpoint=args.endpoint,
                token=args.token,
                sha256=args.sha256,
                size=args.size,
                output=args.output,
                manifest=args.manifest,
                opts=opts,
                reporter=rep,
            )
    except KeyboardInterrupt:
        print("strata: interrupted; what was downloaded is kept: run the same command again to resume",
              file=sys.stderr)
        return 130
    for f in files:
        print(f)
    return 0


# --- check -----------------------------------------------------------------------------------------------


def cmd_check(args: argparse.Namespace) -> int:
    from strata.hub.check import GiB, fit, model_footprint
    from strata.hub.local import default_models_dir, resolve_model
    from strata.hub.machine import probe
    from strata.gguf.header import require_model
    from strata.hub.verify import check_gguf_file

    _check_flags(args)
    models_dir = args.models_dir or default_models_dir()
    machine = probe(models_dir)
    # the engine's KV when no type is asked: bf16 on a GPU (f16's size), the float32 activations' on a CPU alone
    default_kv = "f16" if machine.gpus or args.vram_gb is not None else "f32"
    args.cache_type_k, args.cache_type_v = args.cache_type_k or default_kv, args.cache_type_v or default_kv
    fp = verdict = None
    if args.model:
        paths = resolve_model(args.model, models_dir)
        # a cut-off file, a vocabulary, a part of a split set alone load nowhere: the loader's checks, before any
        # verdict (a size alone would say "it runs")
        headers = [check_gguf_file(p) for p in paths]
        require_model(headers[0].metadata, len(paths), sum(len(h.tensors) for h in headers), paths[0].name)
        fp = model_footprint(paths, args.cache_type_k, args.cache_type_v)
        _check_architecture(paths[0], fp.architecture)
        budget = int(args.vram_gb * GiB) if args.vram_gb is not None else None
        verdict = fit(fp, machine, args.ctx_size, budget, args.kv_vram_tokens)
    if fp is not None and args.pipeline_parallel_size > 1:
        return _check_split(args, paths, machine)
    if args.json:
        out = {"machine": asdict(machine), "warnings": machine.warnings()}
        if fp is not None:
            out["model"] = asdict(fp)
            out["fit"] = asdict(verdict)
            # in GiB, as the engine's startup log and the server's /props give it
            out["fit"]["vram_split"] = verdict.vram_split.as_dict() if verdict.vram_split is not None else None
        print(json.dumps(out, indent=2))
    else:
        _print_report(machine, fp, verdict)
    return 0 if verdict is None or verdict.ok else 1


def _check_flags(args: argparse.Namespace) -> None:
    """The engine's own limits on the flags check plans with (strata.config's validate): a plan for a run that
    would not start is no verdict."""
    from strata import StrataError

    if args.vram_gb is not None and args.vram_gb <= 0:
        raise StrataError("--vram-gb must be positive")
    if args.ctx_size < 0:
        raise StrataError(f"--ctx-size must be >= 0, got {args.ctx_size}")
    if args.pipeline_parallel_size < 1:
        raise StrataError(f"--pipeline-parallel-size must be >= 1, got {args.pipeline_parallel_size}")
    if args.layer_split.strip().lower() != "auto" and args.pipeline_parallel_size == 1:
        raise StrataError(f"--layer-split {args.layer_split} splits a pipeline: pass -pp N (N stages) with it")
    if args.kv_vram_tokens is not None and args.kv_vram_tokens <= 0:
        raise StrataError(f"--kv-vram-tokens {args.kv_vram_tokens}: expected a positive number of tokens a layer")


def _check_architecture(path: Path, arch: str | None) -> None:
    """A model of an architecture the engine has no family for loads nowhere: the loader's own error, before
    any verdict (a size alone would say "it runs")."""
    from strata import StrataError
    from strata.models.registry import FAMILIES  # torch-free

    if arch not in FAMILIES:
        what = f"unknown model architecture '{arch}'" if arch else "no general.architecture in its metadata"
        raise StrataError(f"{path.name}: {what} (strata runs: {', '.join(sorted(FAMILIES))})")


def _check_split(args, paths, machine) -> int:
    """`strata check -pp N`: the verdict of each stage (stage r on GPU r, or the --vram-gb budget each)."""
    from strata.hub.check import GiB, fit, stage_footprints

    stages = stage_footprints(paths, args.pipeline_parallel_size, args.layer_split, args.cache_type_k,
                              args.cache_type_v)
    rows = []
    for r, (layers, sfp) in enumerate(stages):
        if args.vram_gb is not None:
            budget = int(args.vram_gb * GiB)
        elif r < len(machine.gpus):
            budget = machine.gpus[r].vram_free
        else:
            budget = None
        v = fit(sfp, machine, args.ctx_size, budget, args.kv_vram_tokens)
        rows.append((r, layers, sfp, v))
    # RAM: the stages of one machine share it (every stage pins its own layers' experts)
    ok = all(v.ok for *_, v in rows)
    if args.json:
        print(json.dumps({"stages": [{"stage": r, "layers": [layers.start, layers.stop - 1], "model": asdict(sfp),
                                      "fit": {**asdict(v), "vram_split": v.vram_split.as_dict()
                                              if v.vram_split is not None else None}}
                                     for r, layers, sfp, v in rows], "ok": ok}, indent=2))
        return 0 if ok else 1
    print(f"pipeline of {len(rows)} stages:")
    for r, layers, sfp, v in rows:
        where = f"VRAM needs {_g(v.vram_needed)} + slots of {_g(v.vram_budget)}" if v.mode == "gpu" else "CPU"
        slots = f", {v.slots} expert slots a layer ({v.slots_share:.0%})" if sfp.n_expert and v.mode == "gpu" else ""
        print(f"  stage {r}: layers {layers.start}-{layers.stop - 1}: dense {_g(sfp.dense_bytes)}, experts "
              f"{_g(sfp.expert_bytes)} in RAM, KV {_g(v.kv_bytes)}; {where}{slots}: "
              f"{'fits' if v.ok else 'does not fit'}")
        for reason in v.reasons:
            print(f"    {reason}")
    print("verdict: it runs" if ok else "verdict: a stage does not fit")
    return 0 if ok else 1


def _g(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / (1 << 30):.1f} GiB" if abs(n) >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def _print_report(machine, fp, verdict) -> None:
    from rich.console import Console

    con = Console(highlight=False)
    con.print("[bold]GPU[/bold]")
    if not machine.gpus:
        con.print(f"  no GPU: {machine.gpu_note}")
    for g in machine.gpus:
        link = "PCIe ?"
        if g.pcie_gen is not None:
            link = f"PCIe gen {g.pcie_gen}/{g.pcie_gen_max} x{g.pcie_width}/x{g.pcie_width_max}"
            bw, bw_max = g.pcie_gbps(), g.pcie_gbps(current=False)
            if bw and bw_max:
                link += f" ({bw:.1f} of {bw_max:.1f} GB/s per direction)"
        con.print(f"  {g.index}: {g.name}, VRAM {_g(g.vram_free)} free of {_g(g.vram_total)}, {link} (current/max)")
    for w in machine.warnings():
        con.print(f"  [yellow]warning:[/yellow] {w}")
    con.print("[bold]CPU[/bold]")
    c = machine.cpu
    con.print(f"  {c.model}, {c.cores_physical} cores / {c.cores_logical} threads")
    con.print(f"  SIMD: {' '.join(c.flags) or 'none detected'}")
    if c.native_kernel is not None:
        con.print(f"  native kernel: {'built' if not c.native_kernel else 'unavailable'} (expert FFNs on the CPU, "
                  "a CPU run's decode matmuls)")
    con.print("[bold]Memory[/bold]")
    con.print(f"  RAM {_g(machine.ram_available)} available of {_g(machine.ram_total)}")
    con.print(f"  disk {_g(machine.disk_free)} free at {machine.disk_path}")
    if fp is None:
        return
    more = f" (+{len(fp.files) - 1} shards)" if len(fp.files) > 1 else ""
    con.print(f"[bold]Model[/bold] {Path(fp.files[0]).name}{more}")
    con.print(
        f"  {fp.architecture}: {_g(fp.total_bytes)} of weights = dense {_g(fp.dense_bytes)} "
        f"+ experts {_g(fp.expert_bytes)}"
    )
    if fp.n_expert:
        con.print(
            f"  {fp.n_moe_layers} MoE layers x {fp.n_expert} experts (top-{fp.n_expert_used}), "
            f"{fp.slot_bytes / (1 << 20):.1f} MiB per expert"
        )
    for what, found in (("expert", fp.expert_formats), ("dense", fp.dense_formats)):
        if found:
            con.print(f"  {what} formats: " + ", ".join(f"{name} {_g(n)}" for name, n in found.items()))
    kv_tok = fp.kv_bytes_per_token / 1024
    if verdict.kv_window:
        con.print(f"  KV cache: {kv_tok:.1f} KiB per token, {_g(verdict.kv_host_bytes)} for {verdict.ctx} tokens in "
                  f"host RAM; a window of {verdict.kv_window} tokens a layer in VRAM ({_g(verdict.kv_bytes)})")
    else:
        con.print(f"  KV cache: {kv_tok:.1f} KiB per token, {_g(verdict.kv_bytes)} for {verdict.ctx} tokens")
    con.print("[bold]Fit[/bold]")
    if verdict.mode == "gpu":
        con.print(f"  VRAM: needs {_g(verdict.vram_needed)} + expert slots, budget {_g(verdict.vram_budget)}")
        if verdict.prefill_chunk:
            con.print(f"  prefill: {verdict.prefill_chunk}-token chunks, {_g(verdict.prefill_bytes)} of activations "
                      "(a chunk streams each uncached expert once)")
        if verdict.vram_split is not None:
            # the engine logs the same split, the context measured, when it starts
            con.print("  VRAM split (the CUDA context estimated):")
            for line in verdict.vram_split.table("    "):
                con.print(line)
        if fp.n_expert:
            con.print(
                f"  expert cache: {verdict.slots} slots per layer = {verdict.slots_share:.1%} of the {fp.n_expert} "
                f"experts ({verdict.slots * fp.n_moe_layers} of {fp.n_expert_total} in all)"
            )
    con.print(f"  RAM: needs {_g(verdict.ram_needed)}, {_g(verdict.ram_available)} available")
    for n in verdict.notes:
        con.print(f"  note: {n}")
    if verdict.ok:
        con.print("[bold green]verdict: it runs[/bold green]")
    else:
        con.print("[bold red]verdict: it cannot run[/bold red]")
        for r in verdict.reasons:
            con.print(f"  - {r}")
        con.print("  would fit with: " + "; or ".join(verdict.fixes))
    sys.stdout.flush()
