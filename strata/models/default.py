"""The model strata runs when none is named (`strata generate -p hi`, `strata serve` without -m).

The default is strata-tiny, a small GLM-4-MoE-family model with an MTP block, trained by `tools/train_tiny.py`
and shipped as `strata/data/strata-tiny.gguf` (see docs/strata-tiny.md). Should the file be missing (a trimmed
install), strata makes a tiny synthetic MoE instead (`strata synth tiny-qwen3moe`) on first use and caches it; its
weights are random, its text gibberish, and strata says so whenever it is used.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

SHIPPED = Path(__file__).resolve().parents[1] / "data" / "strata-tiny.gguf"
PRESET = "tiny-qwen3moe"
SYNTH_VERSION = 1  # bump when synth's output for the preset changes, so caches are remade
NAME = "strata-tiny (SYNTHETIC: random weights, not a trained model)"


def cache_dir() -> Path:
    from strata.config import cache_dir

    return cache_dir()


def synthetic_path() -> Path:
    return cache_dir() / "models" / f"strata-tiny-synthetic-v{SYNTH_VERSION}.gguf"


def default_model_path(warn: bool = True) -> Path:
    """The default model's file: the shipped trained model if present, else the cached synthetic one."""
    if SHIPPED.is_file():
        return SHIPPED
    path = synthetic_model_path()
    if warn:
        print(f"strata: warning: no model given: using {path}, a SYNTHETIC model with random weights (its text "
              "is gibberish); pass -m MODEL.gguf or REPO:QUANT to run a real model", file=sys.stderr)
    return path


def synthetic_model_path() -> Path:
    """The tiny synthetic model, made now if missing (concurrent first runs each write their own temporary file
    and atomically rename it; the bytes are identical whoever wins)."""
    path = synthetic_path()
    if not path.is_file():
        from strata.gguf.synth import synth

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        try:
            synth(PRESET, tmp, name=NAME, seed=0, progress=False)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
    return path
