"""Configuration as validated dataclasses. CLI flags are derived from these; environment variables are read here only."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from strata import StrataError
from strata.experts.sizing import DEFAULT_CTX, KV_TYPE_BLOCKS, VRAM_RESERVE_MIB  # torch-free; shared with `strata check`

DTYPES = {"float32": torch.float32, "f32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "f16": torch.float16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


EXPERT_MODES = ("auto", "resident", "tiered")
CPU_KERNELS = ("auto", "native", "int4", "ref")
CACHE_POLICIES = ("lfu-decay", "lru")
CACHE_LAYOUTS = ("uniform", "profile")
EXPERT_ROUTINGS = ("model", "uniform")
DECODE_MISSES = ("auto", "handoff", "direct", "staged")
DRAFT_SOURCES = ("auto", "ngram", "mtp")
DTYPE_CHOICES = ("auto", *DTYPES)
# KV cache types, llama.cpp's -ctk/-ctv names: a float dtype, or GGML blocks quantized on write and dequantized on
# read (strata.kv.quant)
KV_QUANT_TYPES = ("q8_0", "q4_0")
KV_TYPE_CHOICES = tuple(KV_TYPE_BLOCKS)  # f32 f16 bf16 q8_0 q4_0


def opt(help: str, *, flag: str | None = None, short: str | None = None, dest: str | None = None,
        choices: tuple | None = None, metavar: str | None = None, gpu: bool = False) -> dict:
    """A field's command-line flag, written once beside its default: `field(default=..., metadata=opt(...))`.
    `flag` defaults to --the-field-name; `dest` to the field's name (the argparse attribute). `gpu`: the flag
    steers only what a CUDA GPU does (graphs, VRAM, the bus), named when a CPU run is given it (gpu_only_flags)."""
    return {"cli": {"help": help, "flag": flag, "short": short, "dest": dest, "choices": choices,
                    "metavar": metavar, "gpu": gpu}}


@dataclass
class ExpertConfig:
    """Where experts live and how misses are served (the tiered backend)."""

    mode: str = field(default="auto", metadata=opt(
        "where experts live: resident (all in VRAM), tiered (a VRAM cache, every expert in host RAM), auto "
        "(tiered when they do not fit the budget)", flag="--experts", dest="experts_mode", choices=EXPERT_MODES))
    vram_gb: float | None = field(default=None, metadata=opt(
        "the whole process's VRAM budget (GiB): the CUDA context, weights, KV, a prefill chunk and the expert "
        "cache fit in it, and torch's allocator is held to it"))
    vram_reserve_mib: int = field(default=VRAM_RESERVE_MIB, metadata=opt(
        "VRAM headroom left free for decode activations, graphs and allocator slack (the CUDA context and a "
        "prefill chunk are counted besides)"))
    cpu_threads: int = field(default=0, metadata=opt("CPU lane threads (0: the physical cores)"))
    cpu_kernel: str = field(default="auto", metadata=opt(
        "CPU lane kernel: native (Q4_K read in place, compiled once), int4 (torch, repacked copy), ref (exact "
        "float32); auto: native, else int4, for bf16/f16, ref for float32; without a GPU, the resident backend's "
        "CPU math (a miss gives what a cached expert gives)", choices=CPU_KERNELS))
    cpu_plan: str = field(default="auto", metadata=opt("misses -> CPU share, e.g. 011223344, or auto (measured)"))
    plan_tune: bool = field(default=True, metadata=opt(
        "with --cpu-plan auto, time the measured plan, all-PCIe and all-CPU over the first decode steps and keep "
        "the fastest", flag="--cpu-plan-tune", dest="cpu_plan_tune"))
    cache_policy: str = field(default="lfu-decay", metadata=opt("expert cache admission/eviction",
                                                                choices=CACHE_POLICIES))
    cache_layout: str = field(default="uniform", metadata=opt(
        "cache slots per layer: uniform, or spread as --expert-profile's routing predicts most hits",
        choices=CACHE_LAYOUTS))
    cache_decay: str = field(default="auto", metadata=opt(
        "lfu-decay's memory: each step scales the experts' use counts by this (0 < d <= 1; 1: plain counts); auto: "
        "1 - k / (5 E), about five uses of an evenly routed expert remembered (0.996 for 512 experts top-10, "
        "0.9875 for 128 top-8)",
        metavar="D|auto"))
    promote_min: float = field(default=0.0, metadata=opt("decayed uses needed before an expert is cached"))
    swap_budget: int = field(default=4, metadata=opt(
        "cached experts replaced per layer per step (empty slots fill past it; 0 freezes the cache)"))
    low_ram: bool = field(default=False, metadata=opt("read experts from the memory-mapped file (no pinned copy)"))
    expert_profile: str | None = field(default=None, metadata=opt("routing profile to fill the cache from"))
    expert_profile_save: str | None = field(default=None, metadata=opt(
        "write the learned routing profile here on exit"))
    profile: bool = field(default=False, metadata=opt(
        "print the per-token time breakdown and what a decode step launches (kernels per step and per layer)"))
    # explicit slot count per layer (overrides the budget; tests and sweeps)
    slots: int | None = field(default=None, metadata=opt("expert cache slots per layer (overrides the budget)",
                                                         flag="--expert-slots", dest="expert_slots"))
    prefetch_next: bool | None = field(default=None, metadata=opt(
        "decode: predict the next MoE layer's experts with its router on this layer's input and start copying "
        "the uncached ones during this layer; on the staged path a side stream inside the step copies them (no "
        "host work), on the hand-off path the host does (there it cost more host time than it hid). Default: on "
        "for the staged path's one-token steps while it pays (off from the next request on when under a quarter "
        "of its experts are used), off for the hand-off; given, it stays on and steps of several sequences "
        "prefetch too", flag="--expert-prefetch", dest="expert_prefetch", gpu=True))
    prefetch_programs: int | None = field(default=None, metadata=opt(
        "with the prefetch on the staged path: programs the side stream's copy kernel runs (each looping over its "
        "share of the copies), so the layer's own kernels keep the other SMs; 0: one program per copy part; "
        "default: a quarter of the GPU's SMs (measured fastest of the counts tried)",
        flag="--expert-prefetch-programs", dest="expert_prefetch_programs", gpu=True))
    chunk_loan: str = field(default="auto", metadata=opt(
        "the prefill chunk buffers lent to the expert cache as extra slots between prompts (a prompt borrows them "
        "back, their experts forgotten; decode refills them): on, off, or auto (on for a GPU where tested)",
        flag="--chunk-buffer-loan", dest="chunk_buffer_loan", choices=("auto", "on", "off")))
    prefill_loan: str = field(default="auto", metadata=opt(
        "the VRAM a prompt chunk's activations take lent to the expert cache as extra slots between prompts (a "
        "prompt evicts them and hands their memory back to the device for its activations; decode refills them): "
        "on, off, or auto (on for a GPU where tested; needs the chunk buffers' loan; a decode step out of VRAM "
        "beside it ends it, with a warning)",
        flag="--prefill-loan", dest="prefill_loan", choices=("auto", "on", "off"), gpu=True))
    decode_misses: str = field(default="auto", metadata=opt(
        "how a graphed decode step serves missed experts. handoff: each MoE layer's routing goes to the host, "
        "which splits the misses between the CPU lane and PCIe copies into staging slots (--cpu-plan); direct: "
        "the expert kernel reads a missed expert's weights from pinned host RAM over the bus (no copy, no host "
        "hand-off: the step is one graph) and the cache learns between steps; staged: as direct, but a kernel first copies each distinct missed expert of a layer into a VRAM staging slot (an expert several sequences share crosses the bus once; a copy kernel also moves more bytes per second than the fused kernel's reads); auto: staged on a CUDA GPU when "
        "the expert formats have the fused kernel, unless the measured costs (strata calibrate) say this "
        "machine's CPU lane beats its link (then handoff, with the CPU taking a share); else handoff",
        choices=DECODE_MISSES, gpu=True))
    # a benchmark switch, not a user setting: it changes what the model says (strata.layers.moe.uniform_route)
    routing: str = field(default="model", metadata=opt(
        "BENCHMARKS ONLY: model (the router's choice), or uniform: every MoE layer sends each token to k distinct "
        "experts drawn at random with equal weights, ignoring the router, so an expert cache of S slots hits about "
        "S/experts of the time (its worst case); the output is then not the model's",
        flag="--expert-routing", dest="expert_routing", choices=EXPERT_ROUTINGS))

    def tiered(self) -> bool:
        """The one rule for --experts: tiered when asked for (tiered, or an explicit slot count) or, with auto, when
        a VRAM budget is given; otherwise every expert is resident on the compute device."""
        return self.mode == "tiered" or self.slots is not None or (self.mode == "auto" and self.vram_gb is not None)

    def validate(self) -> None:
        check_choices(self)
        if self.vram_gb is not None and self.vram_gb <= 0:
            raise StrataError("--vram-gb must be positive")
        check_at_least(0, ("--expert-prefetch-programs", self.prefetch_programs), ("--cpu-threads", self.cpu_threads),
                       ("--swap-budget", self.swap_budget), ("--vram-reserve-mib", self.vram_reserve_mib),
                       ("--promote-min", self.promote_min), ("--expert-slots", self.slots))
        self.decay_value(1, 1)  # (a bad --cache-decay fails here, before the model loads)

    def decay_value(self, n_experts: int, k: int) -> float:
        """--cache-decay as a number for a model of n_experts routed top-k."""
        from strata.experts.policy import auto_decay

        text = str(self.cache_decay).strip().lower()
        if text == "auto":
            return auto_decay(n_experts, k)
        try:
            d = float(text)
        except ValueError:
            d = float("nan")
        if not 0.0 < d <= 1.0:
            raise StrataError(f"--cache-decay must be a number in (0, 1] or auto, got {self.cache_decay!r}")
        return d


@dataclass
class EngineConfig:
    model: str | None = field(default=None, metadata=opt(
        "GGUF file (first shard of a split set) or REPO:QUANT; default: the embedded strata-tiny model",
        short="-m"))
    device: str = field(default_factory=default_device, metadata=opt("cpu or cuda[:N]"))
    dtype: str = field(default="auto", metadata=opt(
        "compute dtype: auto (f32 on CPU, bf16 on GPU), f32, bf16, f16", choices=DTYPE_CHOICES))
    kv_dtype: str = field(default="auto", metadata=opt(
        "KV cache type of K and V unless -ctk/-ctv say otherwise: auto (= the compute dtype), bf16, f16, f32, "
        "q8_0, q4_0", choices=(*DTYPE_CHOICES, *KV_QUANT_TYPES)))
    cache_type_k: str | None = field(default=None, metadata=opt(
        "KV cache type of K (MLA: of the latent cache): f32, f16, bf16, q8_0 (blocks of 32 values and an f16 "
        "scale, quantized as written), q4_0 (default: --kv-dtype)", short="-ctk", choices=KV_TYPE_CHOICES))
    cache_type_v: str | None = field(default=None, metadata=opt(
        "KV cache type of V: as -ctk (default: --kv-dtype)", short="-ctv", choices=KV_TYPE_CHOICES))
    kv_vram_tokens: str | None = field(default=None, metadata=opt(
        "the KV window: every slot's whole KV in host RAM and N tokens a layer of it in VRAM (a slot's first and "
        "latest pages always, the rest least recently used); attention reads the other pages over PCIe, and the "
        "output is exactly the full cache's. The expert cache gets the VRAM it frees. auto: what the VRAM budget "
        "leaves after the weights and a minimal expert cache (no window on a CPU, or when the whole KV fits). "
        "Unset: the whole KV in VRAM. With a window, decode steps run without CUDA graphs", metavar="N|auto",
        gpu=True))
    kv_page_tokens: int = field(default=256, metadata=opt("tokens a page of the KV window (--kv-vram-tokens)"))
    ctx_size: int = field(default=0, metadata=opt(f"context length (0: min(model, {DEFAULT_CTX}))", short="-c"))
    n_slots: int = 1  # from `strata serve --parallel`
    prefill_chunk: int = field(default=0, metadata=opt(
        "prompt tokens per forward (0: on a GPU with tiered experts 4096, fewer on a small budget, whose "
        "activations the expert cache leaves room for; else sized from memory; halved on its own if the device "
        "runs out during a prompt). On a CPU, pieces of up to 64 tokens take the int8 decode path and longer ones "
        "the float one, so the chunk size can change a near tie in greedy text"))
    seed: int | None = None  # from the sampling flags
    cuda_graphs: bool | None = field(default=None, metadata=opt(
        "replay decode steps as CUDA graphs (default: on with a CUDA device; with --parallel N a step decodes "
        "the generating sequences together)", gpu=True))
    decode_ahead: bool = field(default=True, metadata=opt(
        "with CUDA graphs, launch each decode step before the host reads the previous step's tokens (the GPU "
        "takes the sampled tokens from its own memory): the host's work between steps overlaps the GPU's. Taken "
        "when every decoding sequence samples without penalties, log-probabilities, grammars or drafts",
        gpu=True))
    host_embed: bool | None = field(default=None, metadata=opt(
        "keep the input embedding table in host RAM (a decode step gathers its rows there and copies one row per "
        "token; the table's VRAM goes to the expert cache). Default: on with tiered experts on a GPU under "
        "--vram-gb, unless the table is also the output head", gpu=True))
    # speculative decoding with n-gram drafts (strata.engine.spec): at most draft_max guessed tokens verified per
    # step (0: off), found by matching the context's last draft_ngram_max .. draft_ngram_min tokens earlier in it
    draft_max: int = field(default=0, metadata=opt(
        "speculative decoding with n-gram drafts: at most N tokens guessed from earlier in the context and "
        "verified in one forward per step (0: off; exact for any sampler; pays where text repeats its context, "
        "as code edits do)"))
    draft_source: str = field(default="auto", metadata=opt(
        "where drafts come from: ngram (earlier in the context), mtp (the model's own multi-token-prediction block: "
        "GLM-4.5/4.6's, DeepSeek-V3's, Qwen3-Next's), auto (mtp when the model has the block, else ngram)",
        choices=DRAFT_SOURCES))
    draft_p_min: float = field(default=0.0, metadata=opt(
        "MTP drafts: stop the chain at a draft the block gives less than this probability (0: never)"))
    draft_ngram_min: int = field(default=2, metadata=opt("shortest n-gram a draft is looked up by"))
    draft_ngram_max: int = field(default=4, metadata=opt("longest n-gram a draft is looked up by, tried first"))
    pipeline_parallel_size: int = field(default=1, metadata=opt(
        "split the model's layers over N processes (pipeline stages; on CUDA one GPU each, NCCL between them, "
        "gloo on CPUs): each holds its layers' weights, KV cache and expert cache; started here, or one process "
        "per stage by torchrun across machines", short="-pp"))
    layer_split: str = field(default="auto", metadata=opt(
        "layers per pipeline stage: auto (as equal as possible) or comma-separated counts, one per stage"))
    experts: ExpertConfig = field(default_factory=ExpertConfig)

    def validate(self) -> None:
        check_device(self.device)
        check_choices(self)
        check_at_least(0, ("--ctx-size", self.ctx_size), ("--prefill-chunk", self.prefill_chunk),
                       ("--draft-p-min", self.draft_p_min))
        if self.n_slots < 1:
            raise StrataError(f"--parallel must be >= 1, got {self.n_slots}")
        if self.draft_p_min > 1:
            raise StrataError(f"--draft-p-min is a probability, 0..1, got {self.draft_p_min}")
        if self.draft_max < 0 or not 1 <= self.draft_ngram_min <= self.draft_ngram_max:
            raise StrataError("--draft-max must be >= 0 and 1 <= --draft-ngram-min <= --draft-ngram-max "
                              f"(got {self.draft_max}, {self.draft_ngram_min}, {self.draft_ngram_max})")
        if self.pipeline_parallel_size < 1:
            raise StrataError(f"--pipeline-parallel-size must be >= 1, got {self.pipeline_parallel_size}")
        if self.layer_split.strip().lower() != "auto" and self.pipeline_parallel_size == 1 and not launcher_ranks():
            raise StrataError(f"--layer-split {self.layer_split} splits a pipeline: pass -pp N (N stages) with it")
        from strata.kv.window import parse_tokens

        if parse_tokens(self.kv_vram_tokens) is not None and self.pipeline_parallel_size > 1:
            raise StrataError("--kv-vram-tokens: the KV window does not run across pipeline stages yet "
                              "(--pipeline-parallel-size > 1)")
        if self.kv_page_tokens < 1:
            raise StrataError(f"--kv-page-tokens must be >= 1, got {self.kv_page_tokens}")
        if self.pipeline_parallel_size > 1 and self.draft_max:
            raise StrataError("--draft-max: speculative decoding does not run across pipeline stages yet "
                              "(--pipeline-parallel-size > 1)")
        self.experts.validate()

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if self.torch_device.type == "cpu" else torch.bfloat16
        return DTYPES[self.dtype]

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        """The dtype KV reads come back in (and a float cache's storage)."""
        k, v = self.cache_type_k, self.cache_type_v
        if k is not None and k == v and k not in KV_QUANT_TYPES:
            return DTYPES[k]  # -ctk f16 -ctv f16 is --kv-dtype f16: the plain cache of that dtype
        if self.kv_dtype == "auto" or self.kv_dtype in KV_QUANT_TYPES:
            return self.torch_dtype
        return DTYPES[self.kv_dtype]

    @property
    def kv_cache_types(self) -> tuple[torch.dtype | str, torch.dtype | str]:
        """How K and V are stored (strata.kv.cache.KVCache's k_type, v_type): a torch dtype, or a quantized
        type's name. Neither flag given, both are torch_kv_dtype: the plain cache."""
        base = self.kv_dtype if self.kv_dtype in KV_QUANT_TYPES else self.torch_kv_dtype

        def one(name):
            if name is None:
                return base
            return name if name in KV_QUANT_TYPES else DTYPES[name]

        return one(self.cache_type_k), one(self.cache_type_v)


# what --device takes: the devices strata's kernels run on (torch.device would accept others, mps, xla, meta, and
# fail later, deep in a load, with torch's words)
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def check_device(device: str) -> None:
    """--device is cpu or cuda[:N], of a GPU this machine has; else one StrataError naming the value."""
    if not _DEVICE.fullmatch(device):
        raise StrataError(f"--device {device!r}: want cpu or cuda[:N]")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise StrataError(f"device {device} requested but no CUDA GPU is available")
    n = torch.cuda.device_count() if device.startswith("cuda:") else 0
    if n and int(device[5:]) >= n:
        raise StrataError(f"device {device} requested but this machine has {n} CUDA GPU(s), cuda:0..cuda:{n - 1}")


def check_at_least(lo, *flags: tuple[str, float | None]) -> None:
    """Each (flag, value) is unset (None) or >= lo; else one StrataError naming the first flag that is not."""
    for flag, value in flags:
        if value is not None and value < lo:
            raise StrataError(f"{flag} must be >= {lo}, got {value}")


# --- the environment: read here only -------------------------------------------------------------------------
# User settings: STRATA_CACHE_DIR (the cache's root: calibrations, a synthetic default model, and models unless
# STRATA_MODELS_DIR says otherwise), STRATA_MODELS_DIR, STRATA_API_KEY, HF_HUB_OFFLINE, XDG_CACHE_HOME, CC (the C
# compiler of the CPU lane's kernel). Benchmark switches (A/B comparisons on the GPU machine; not for users): STRATA_CHUNK_STAGE_MIB,
# STRATA_CHUNK_RING, STRATA_ALLOC_CAP=0, STRATA_FIXED_SEGMENTS=1, STRATA_DECODE_ATTN=sdpa. Read at each call (cheap),
# so a test's monkeypatch.setenv applies.


def env(name: str, default: str | None = None) -> str | None:
    """The one place strata reads environment variables; prefer the named accessors below."""
    return os.environ.get(name, default)


def launcher_ranks() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) set by torchrun (or another torch.distributed launcher) for a process that is
    one of several, else None."""
    size = env_number("WORLD_SIZE", int)
    if size is None or size <= 1:
        return None
    rank = env_number("RANK", int) or 0
    local = env_number("LOCAL_RANK", int)
    return rank, size, rank if local is None else local


def triton_interpreting() -> bool:
    """Triton runs its kernels in its interpreter on the CPU (TRITON_INTERPRET=1: the kernel tests' oracle mode)."""
    return env("TRITON_INTERPRET") == "1"


def env_number(name: str, kind=float):
    """A numeric variable, None when unset; a bad value is one clear error naming the variable."""
    v = env(name)
    if v is None or v.strip() == "":
        return None
    try:
        return kind(v)
    except ValueError:
        raise StrataError(f"environment variable {name}={v!r} is not a {kind.__name__}") from None


def cache_dir():
    """strata's cache root: $STRATA_CACHE_DIR, else $XDG_CACHE_HOME/strata, else ~/.cache/strata."""
    root = env("STRATA_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    return Path(env("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "strata"


def models_dir():
    """Where `strata pull` puts models: $STRATA_MODELS_DIR, else <cache_dir()>/models."""
    models = env("STRATA_MODELS_DIR")
    return Path(models).expanduser() if models else cache_dir() / "models"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE, as huggingface_hub reads it: `strata pull` uses what is downloaded and fetches nothing."""
    return (env("HF_HUB_OFFLINE") or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def api_key_from_env() -> str | None:
    return env("STRATA_API_KEY") or None


def c_compiler() -> str:
    return env("CC", "cc")


# --- command-line flags from the dataclasses' field metadata ------------------------------------------------


def _flag_name(f) -> str:
    return f.metadata["cli"]["flag"] or "--" + f.name.replace("_", "-")


def check_choices(obj) -> None:
    """Every field with declared choices holds one of them (the same tuple the flag offers)."""
    from dataclasses import fields

    for f in fields(obj):
        cli = f.metadata.get("cli")
        value = getattr(obj, f.name)
        if cli and cli["choices"] and value is not None and value not in cli["choices"]:  # None: not set
            raise StrataError(f"{_flag_name(f)} must be one of {', '.join(cli['choices'])} "
                              f"(got {getattr(obj, f.name)!r})")


def gpu_only_flags(cfg: EngineConfig) -> list[str]:
    """The GPU-only flags (opt(gpu=True)) `cfg` moves from their defaults, as typed: `--cuda-graphs`,
    `--decode-misses staged`. A default cannot be told from the same value typed, and auto leaves the choice to
    strata, which on a CPU is the CPU's: neither is named."""
    from dataclasses import MISSING, fields

    out = []
    for obj in (cfg, cfg.experts):
        for f in fields(obj):
            if not f.metadata.get("cli", {}).get("gpu"):
                continue
            value = getattr(obj, f.name)
            if value == (f.default if f.default is not MISSING else f.default_factory()) or value == "auto":
                continue
            name = _flag_name(f)
            out.append(name if value is True else f"--no-{name[2:]}" if value is False else f"{name} {value}")
    return out


def add_flags(parser, cls) -> None:
    """Add one argparse flag per field of `cls` that declares `opt(...)` metadata: type, default, choices and
    help come from the field, so they are written once. Booleans get --x/--no-x; a default of None means
    'not set' (the engine decides)."""
    import argparse
    import typing
    from dataclasses import MISSING, fields

    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        cli = f.metadata.get("cli")
        if not cli:
            continue
        default = f.default if f.default is not MISSING else f.default_factory()
        base = [t for t in typing.get_args(hints[f.name]) if t is not type(None)] or [hints[f.name]]
        kind = base[0]
        names = [n for n in (cli["short"], _flag_name(f)) if n]
        kw: dict = {"dest": cli["dest"] or f.name, "default": default}
        shown = "" if default is None or kind is bool else f" (default {default})"
        kw["help"] = cli["help"] + shown
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = kind
            if cli["choices"]:
                kw["choices"] = cli["choices"]
            if cli["metavar"]:
                kw["metavar"] = cli["metavar"]
        parser.add_argument(*names, **kw)


def from_flags(cls, args, **overrides):
    """An instance of `cls` from parsed flags (fields without a flag, or absent from `args`, keep their
    defaults), then `overrides`."""
    from dataclasses import fields

    kw = {}
    for f in fields(cls):
        cli = f.metadata.get("cli")
        if cli and hasattr(args, cli["dest"] or f.name):
            kw[f.name] = getattr(args, cli["dest"] or f.name)
    kw.update(overrides)
    return cls(**kw)


# --- benchmark switches (A/B comparisons on the GPU machine) ---------------------------------------------


def chunk_stage_mib() -> float | None:
    """STRATA_CHUNK_STAGE_MIB: a prefill chunk buffer's size set by hand, past the share rule."""
    return env_number("STRATA_CHUNK_STAGE_MIB", float)


def chunk_ring_size() -> int | None:
    """STRATA_CHUNK_RING: chunk buffers in the ring (default: strata.experts.sizing.CHUNK_RING)."""
    return env_number("STRATA_CHUNK_RING", int)


def alloc_cap_enabled() -> bool:
    """STRATA_ALLOC_CAP=0 lifts the cap on torch's allocator under --vram-gb (to measure what the cap costs)."""
    return env("STRATA_ALLOC_CAP", "1") != "0"


def fixed_segments() -> bool:
    """Keep torch's default fixed allocator segments: the user configured the allocator, or asked by
    STRATA_FIXED_SEGMENTS=1."""
    return bool(env("PYTORCH_CUDA_ALLOC_CONF") or env("PYTORCH_ALLOC_CONF") or env("STRATA_FIXED_SEGMENTS"))


def decode_attention_backend() -> str:
    """STRATA_DECODE_ATTN=sdpa: torch's attention for decode instead of the split-key kernel (the A/B baseline)."""
    return env("STRATA_DECODE_ATTN", "triton")


def fault_after_tokens_for_tests() -> int | None:
    """STRATA_TEST_FAULT_AFTER_TOKENS=K, for tests only: the engine worker fails its step (as a real engine failure
    would: an exception out of `engine.step()`) whenever a running sequence has generated K tokens. Unset or
    empty: no fault, the production default."""
    raw = env("STRATA_TEST_FAULT_AFTER_TOKENS")
    if not raw:
        return None
    try:
        k = int(raw)
    except ValueError:
        k = 0
    if k < 1:
        raise StrataError(f"STRATA_TEST_FAULT_AFTER_TOKENS must be a positive integer (got {raw!r})")
    return k
