"""`strata convert` (transformers checkpoint -> GGUF) and `strata synth` (synthetic benchmark models)."""

from __future__ import annotations

import sys
from pathlib import Path

from strata import StrataError

# The synth presets (strata.gguf.synth.PRESETS), listed here so that `strata --help` imports nothing heavy.
PRESET_NAMES = ("qwen3-30b-a3b", "glm-4.5-air", "qwen3-next-80b-a3b", "tiny-glm4moe", "tiny-qwen3next",
                "qwen3-235b-a22b", "deepseek-v3", "mixtral-8x7b", "tiny-qwen3moe", "tiny-deepseek", "tiny-mixtral")
CONVERT_TYPES = ("auto", "f32", "f16", "bf16", "q8_0")


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def cmd_convert(args) -> int:
    from strata.gguf.convert import convert

    src = Path(args.hf_dir)
    if not src.is_dir():
        raise StrataError(f"{src} is not a directory (strata convert reads a transformers checkpoint directory)")
    out = convert(src, args.out, args.type)
    from gguf import GGMLQuantizationType

    from strata.gguf.convert import FILE_TYPES, Q8_0_BLOCK
    from strata.gguf.header import read_gguf_header

    h = read_gguf_header(out)
    ftype = h.metadata.get("general.file_type")  # what --type auto chose
    name = next((k for k, v in FILE_TYPES.items() if v == ftype), args.type)
    if name == "q8_0":  # say which tensors are not Q8_0 (convert writes those of rows not whole blocks as f16)
        n16 = sum(t.ggml_type == GGMLQuantizationType.F16 for t in h.tensors)
        if n16:
            name += f", {n16} tensor{'s' if n16 > 1 else ''} f16: rows not a multiple of {Q8_0_BLOCK}"
    print(f"strata: wrote {out} ({_gb(out.stat().st_size)}, {name})", file=sys.stderr)
    return 0


def cmd_synth(args) -> int:
    import torch

    from strata.gguf.synth import (REPORT_CPU_MAX_BYTES, check_seed, format_report, get_preset, routing_report,
                                   synth, type_names)
    from strata.gguf.writer import check_output
    from strata.quant.formats import as_qtype, check_supported

    get_preset(args.preset, args.layers)  # fail on a bad preset, seed or OUT before anything is written
    check_seed(args.seed)
    check_output(args.out)
    for flag in ("experts_type", "dense_type", "head_type", "experts_down_type", "shared_type"):
        if getattr(args, flag) is None:
            continue
        try:
            check_supported(as_qtype(getattr(args, flag)))
        except StrataError:
            raise StrataError(f"--{flag.replace('_', '-')} {getattr(args, flag)} is not a weight format strata "
                              f"runs ({type_names()})") from None
    r = synth(args.preset, args.out, args.experts_type, args.dense_type, args.head_type, seed=args.seed,
              layers=args.layers, progress=not args.quiet, experts_down_type=args.experts_down_type,
              shared_type=args.shared_type)
    p = r["preset"]
    print(f"strata: wrote {args.out}: {p.about or p.name}{f' cut to {p.n_layers} layers' if args.layers else ''}, "
          f"{_gb(r['bytes'])} in {r['seconds']:.1f} s ({r['gbps']:.2f} GB/s)", file=sys.stderr)
    for line in r["fallbacks"]:  # (as llama-quantize falls back, and says so)
        print(f"strata: {line}", file=sys.stderr)
    if args.no_report:
        return 0
    size = Path(args.out).stat().st_size
    if not torch.cuda.is_available() and size > REPORT_CPU_MAX_BYTES:
        print(f"strata: routing report skipped: running a {_gb(size)} model on the CPU would take too long "
              "(it runs on a GPU, or on a CPU for models up to "
              f"{_gb(REPORT_CPU_MAX_BYTES)}: try --layers 2); --no-report silences this", file=sys.stderr)
        return 0
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        if size > 0.9 * free:
            print(f"strata: routing report skipped: the {_gb(size)} model does not fit in the GPU's "
                  f"{_gb(free)} free memory", file=sys.stderr)
            return 0
    print(format_report(routing_report(args.out)))
    return 0


def register(sub) -> None:
    p = sub.add_parser("convert", help="convert a transformers checkpoint (safetensors) to GGUF",
                       description="Convert a transformers checkpoint directory (config.json, *.safetensors, "
                                   "tokenizer.json) to one GGUF file, named and laid out as llama.cpp does.")
    p.add_argument("hf_dir", metavar="HF_DIR", help="checkpoint directory")
    p.add_argument("out", metavar="OUT.gguf", help="output file, or an existing directory to write "
                   "<HF_DIR name>-<TYPE>.gguf in (as llama.cpp's converter does); its directory must exist")
    p.add_argument("--type", default="auto", choices=CONVERT_TYPES, help="weight format (default auto, as "
                   "llama.cpp's --outtype auto: bf16 when the checkpoint's weights are bf16, else f16; norms and "
                   "routers stay f32; with q8_0, tensors whose rows are not whole 32-value blocks are f16, as "
                   "llama.cpp writes them). Weights beyond f16's range (65504) are an error for f16 and q8_0, whose "
                   "block scales are f16: use bf16 or f32 for those")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("synth", help="write a synthetic model with a real model's shapes and tokenizer",
                       description="Write an architecture-faithful GGUF with deterministic pseudo-random weights "
                                   "and the real tokenizer, for benchmarks (it is not a trained model). Then "
                                   "report how the model routes a sample text (expert popularity, distinct "
                                   "experts per 512-token batch) by running it with strata.")
    p.add_argument("preset", metavar="PRESET", help=", ".join(PRESET_NAMES))
    p.add_argument("out", metavar="OUT.gguf", help="output file (written as OUT.gguf.PID.tmp, renamed when done)")
    p.add_argument("--experts-type", default="Q4_K", help="routed experts' format (default Q4_K)")
    p.add_argument("--dense-type", default="Q8_0", help="attention, dense FFN and shared experts (default Q8_0; "
                   "token embeddings are Q8_0 unless this is a float type)")
    p.add_argument("--head-type", default="Q6_K", help="output head (default Q6_K)")
    p.add_argument("--experts-down-type", default=None, help="the routed experts' down projection (default: "
                   "--experts-type; e.g. IQ3_XXS under IQ2_XXS gate/up, as 2-bit mixes store it)")
    p.add_argument("--shared-type", default=None, help="shared experts (default: --dense-type)")
    p.add_argument("--seed", type=int, default=0, help="weights seed (same seed, same bytes)")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers (smaller files; at most "
                   "the preset's own count)")
    p.add_argument("--no-report", action="store_true", help="skip the routing report")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_synth)
