"""What `strata convert` reads: config.json and the safetensors shards, every failure to read them one StrataError
naming the file and the problem (a user's broken download or hand-edited config is not a bug to trace back)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from strata import StrataError


class Config(dict):
    """config.json's object; a required key it lacks (`cfg[key]`) is a StrataError naming the file and the key,
    raised where the key is first needed (optional keys are read with .get and their defaults)."""

    def __init__(self, data: dict, path: Path, family: str = ""):
        super().__init__(data)
        self.path, self.family = path, family

    def __missing__(self, key: str):
        need = f" (a {self.family} config needs it)" if self.family else ""
        raise StrataError(f"{self.path} has no {key}{need}")


# How each model_type is named in messages (the families' own names, as their model cards spell them).
FAMILY_NAMES = {"qwen3_moe": "Qwen3-MoE", "qwen3": "Qwen3", "mixtral": "Mixtral", "llama": "Llama",
                "deepseek_v3": "DeepSeek-V3", "deepseek_v2": "DeepSeek-V2", "glm4_moe": "GLM-4.5",
                "gpt_oss": "gpt-oss", "qwen3_next": "Qwen3-Next"}


def read_config(d: Path) -> Config:
    path = d / "config.json"
    if not path.exists():
        raise StrataError(f"{d}: no config.json (not a transformers checkpoint directory)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise StrataError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except UnicodeDecodeError:
        raise StrataError(f"{path} is not valid JSON: not UTF-8 text") from None
    except OSError as e:
        raise StrataError(f"cannot read {path}: {e.strerror or e}") from None
    if not isinstance(data, dict):
        raise StrataError(f"{path} is not a JSON object (a transformers config is one)")
    mt = data.get("model_type", "")
    return Config(data, path, FAMILY_NAMES.get(mt, mt) if isinstance(mt, str) else "")


def _unreadable(f: Path, e: Exception) -> StrataError:
    # safetensors' messages ("Error while deserializing header: incomplete metadata, file not fully covered")
    # say what is wrong but not with which file, nor the likely cause: a download cut short
    return StrataError(f"{f} cannot be read as safetensors (truncated or damaged? re-download it): {e}")


class Checkpoint:
    def __init__(self, d: Path):
        from safetensors import SafetensorError, safe_open

        files = sorted(d.glob("*.safetensors"))
        if not files:
            raise StrataError(f"{d}: no .safetensors files (strata convert reads safetensors checkpoints)")
        self.index: dict[str, Path] = {}
        self.dtypes: list[tuple[str, int]] = []  # (safetensors dtype, ndim) per tensor, in checkpoint order
        for f in files:
            try:
                with safe_open(f, "pt") as h:
                    for k in h.keys():
                        self.index[k] = f
                        sl = h.get_slice(k)  # the header's dtype and shape; no tensor data is read
                        self.dtypes.append((sl.get_dtype(), len(sl.get_shape())))
            except (SafetensorError, OSError) as e:
                raise _unreadable(f, e) from None
        self._open: dict[Path, object] = {}
        self.used: set[str] = set()

    def auto_type(self) -> str:
        """llama.cpp's `--outtype auto`: the first tensor of 2+ dims stored as bf16 or f16 decides; else f16.
        (It reads the tensors, not config.json's torch_dtype, which some fine-tunes misstate.)"""
        for dtype, ndim in self.dtypes:
            if ndim >= 2 and dtype in ("BF16", "F16"):
                return dtype.lower()
        return "f16"

    def has(self, k: str) -> bool:
        return k in self.index

    def get(self, k: str) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open

        f = self.index.get(k)
        if f is None:
            raise StrataError(f"checkpoint tensor {k} is missing")
        try:
            if f not in self._open:
                self._open[f] = safe_open(f, "pt")
            t = self._open[f].get_tensor(k)
        except (SafetensorError, OSError) as e:  # (the file changed, or shrank, since its header was read)
            raise _unreadable(f, e) from None
        self.used.add(k)
        return t.float()

    def experts(self, prefix: str, n: int, names: tuple[str, str, str]) -> tuple[torch.Tensor, ...]:
        """Stacked (gate, up, down) [E, out, in] from per-expert tensors or a fused gate_up_proj."""
        if self.has(prefix + "gate_up_proj"):
            gu = self.get(prefix + "gate_up_proj")  # [E, 2*ff, d]
            ff = gu.shape[1] // 2
            return gu[:, :ff], gu[:, ff:], self.get(prefix + "down_proj")
        g, u, dn = names
        return tuple(torch.stack([self.get(f"{prefix}{e}.{p}.weight") for e in range(n)]) for p in (g, u, dn))
