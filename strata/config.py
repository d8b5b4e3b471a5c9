"""Configuration as validated dataclasses. CLI flags are derived from these; environment variables are read here only."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from strata import StrataError

DTYPES = {"float32": torch.float32, "f32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "f16": torch.float16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class ExpertConfig:
    """Where experts live and how misses are served (the tiered backend)."""

    mode: str = "auto"  # auto | resident | tiered
    vram_gb: float | None = None  # the whole process's VRAM budget
    vram_reserve_mib: int = 700
    cpu_threads: int = 0  # 0 = physical cores
    cpu_kernel: str = "auto"  # the CPU lane's kernel: auto | native | int4 | ref
    cpu_plan: str = "auto"
    plan_tune: bool = True  # with --cpu-plan auto: the first decode steps time candidate plans, keep the fastest
    cache_policy: str = "lfu-decay"
    cache_layout: str = "uniform"  # slots per layer: uniform | profile (from --expert-profile's routing)
    promote_min: float = 0.0
    swap_budget: int = 4
    low_ram: bool = False
    expert_profile: str | None = None
    expert_profile_save: str | None = None
    profile: bool = False
    slots: int | None = None  # explicit slot count per layer (overrides the budget; tests and sweeps)
    prefetch_next: bool = False  # decode: start copying the next MoE layer's predicted misses during this layer

    def tiered(self) -> bool:
        """The one rule for --experts: tiered when asked for (tiered, or an explicit slot count) or, with auto, when
        a VRAM budget is given; otherwise every expert is resident on the compute device."""
        return self.mode == "tiered" or self.slots is not None or (self.mode == "auto" and self.vram_gb is not None)

    def validate(self) -> None:
        if self.mode not in ("auto", "resident", "tiered"):
            raise StrataError(f"--experts must be auto, resident or tiered (got {self.mode!r})")
        if self.cpu_kernel not in ("auto", "native", "int4", "ref"):
            raise StrataError(f"--cpu-kernel must be auto, native, int4 or ref (got {self.cpu_kernel!r})")
        if self.cache_layout not in ("uniform", "profile"):
            raise StrataError(f"--cache-layout must be uniform or profile (got {self.cache_layout!r})")
        if self.cache_policy not in ("lfu-decay", "lru"):
            raise StrataError(f"--cache-policy must be lfu-decay or lru (got {self.cache_policy!r})")
        if self.vram_gb is not None and self.vram_gb <= 0:
            raise StrataError("--vram-gb must be positive")


@dataclass
class EngineConfig:
    model: str | None = None
    device: str = field(default_factory=default_device)
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on CUDA
    kv_dtype: str = "auto"  # auto = the compute dtype (bf16/f16 on GPU)
    ctx_size: int = 0  # 0 = min(model's context, 8192)
    n_slots: int = 1
    prefill_chunk: int = 0  # 0 = sized from memory
    seed: int | None = None
    cuda_graphs: bool | None = None  # replay single-sequence decode steps as CUDA graphs (None: on with CUDA)
    # speculative decoding with n-gram drafts (strata.engine.spec): at most draft_max guessed tokens verified per
    # step (0: off), found by matching the context's last draft_ngram_max .. draft_ngram_min tokens earlier in it
    draft_max: int = 0
    draft_ngram_min: int = 2
    draft_ngram_max: int = 4
    experts: ExpertConfig = field(default_factory=ExpertConfig)

    def validate(self) -> None:
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise StrataError(f"device {self.device} requested but no CUDA GPU is available")
        for name in ("dtype", "kv_dtype"):
            v = getattr(self, name)
            if v != "auto" and v not in DTYPES:
                raise StrataError(f"--{name.replace('_', '-')} must be one of auto, {', '.join(DTYPES)} (got {v!r})")
        if self.ctx_size < 0 or self.prefill_chunk < 0 or self.n_slots < 1:
            raise StrataError("context size and prefill chunk must be >= 0 and slots >= 1")
        if self.draft_max < 0 or not 1 <= self.draft_ngram_min <= self.draft_ngram_max:
            raise StrataError("--draft-max must be >= 0 and 1 <= --draft-ngram-min <= --draft-ngram-max "
                              f"(got {self.draft_max}, {self.draft_ngram_min}, {self.draft_ngram_max})")
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
        return self.torch_dtype if self.kv_dtype == "auto" else DTYPES[self.kv_dtype]


def env(name: str, default: str | None = None) -> str | None:
    """The one place strata reads environment variables (STRATA_*)."""
    return os.environ.get(name, default)


def cache_dir() -> Path:
    """strata's per-user cache (measured costs, calibrations, the native CPU kernel): $STRATA_CACHE_DIR, else
    $XDG_CACHE_HOME/strata, else ~/.cache/strata."""
    base = env("STRATA_CACHE_DIR") or os.path.join(env("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "strata")
    return Path(base)
