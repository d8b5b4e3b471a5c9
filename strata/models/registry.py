"""GGUF architecture name -> the family module that builds it (imported lazily)."""

from __future__ import annotations

import importlib

from strata import StrataError

FAMILIES: dict[str, str] = {
    "qwen3moe": "strata.models.qwen3moe",
    "qwen3": "strata.models.qwen3moe",  # the dense member shares attention and norms
    "qwen2moe": "strata.models.qwen3moe",
    "llama": "strata.models.llama",  # Llama (dense) and Mixtral (llama + experts)
    "mixtral": "strata.models.llama",
    "deepseek2": "strata.models.deepseek2",
    "glm4moe": "strata.models.glm4moe",  # GLM-4.5 / 4.5-Air / 4.6
    "gpt-oss": "strata.models.gpt_oss",
    "qwen3next": "strata.models.qwen3next",  # hybrid: gated delta-net + gated attention, MoE
}


def family_for(arch: str):
    mod = FAMILIES.get(arch)
    if mod is None:
        raise StrataError(f"unknown model architecture '{arch}' (strata runs: {', '.join(sorted(FAMILIES))})")
    return importlib.import_module(mod)
