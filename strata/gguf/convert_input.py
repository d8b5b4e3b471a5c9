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


INDEX = "model.safetensors.index.json"


def shard_files(d: Path) -> tuple[list[Path], dict[str, Path]]:
    """The safetensors files to read, and the tensor -> file map of the index when there is one. With an index,
    its files only (a repository may also hold a consolidated copy under other names, as Mistral's do), each of
    which must be there; without one, model*.safetensors as llama.cpp's converter reads them, else every
    *.safetensors."""
    ipath = d / INDEX
    if ipath.exists():
        try:
            wm = json.loads(ipath.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise TypeError
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise StrataError(f"{ipath} is not a safetensors index (a JSON object with a weight_map of "
                              "tensor -> file)") from None
        except OSError as e:
            raise StrataError(f"cannot read {ipath}: {e.strerror or e}") from None
        listed = {k: d / v for k, v in wm.items()}
        files = sorted(set(listed.values()))
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise StrataError(f"{d}: {missing[0]}{more} is missing ({INDEX} lists {len(files)} shard"
                              f"{'s' if len(files) > 1 else ''}: the download is incomplete)")
        return files, listed
    files = sorted(d.glob("model*.safetensors")) or sorted(d.glob("*.safetensors"))
    if not files:
        bins = sorted(f.name for f in d.glob("*.bin") if f.is_file())
        if bins:
            raise StrataError(f"{d}: holds PyTorch weights ({bins[0]}), not safetensors: strata convert reads "
                              "safetensors only (transformers' save_pretrained writes them)")
        raise StrataError(f"{d}: no .safetensors files (strata convert reads safetensors checkpoints)")
    return files, {}


class Checkpoint:
    def __init__(self, d: Path):
        from safetensors import SafetensorError, safe_open

        files, listed = shard_files(d)
        self.files = files
        self.index: dict[str, Path] = {}
        self.dtypes: list[tuple[str, int]] = []  # (safetensors dtype, ndim) per tensor, in checkpoint order
        self.shapes: dict[tuple[Path, str], list[int]] = {}
        # planning: get() returns a tensor on the meta device (the header's shape, no data read), so the output's
        # tensors can be laid out before any is converted
        self.meta = False
        held: dict[Path, set[str]] = {}
        for f in files:
            try:
                with safe_open(f, "pt") as h:
                    held[f] = set(h.keys())
                    for k in h.keys():
                        self.index[k] = f
                        sl = h.get_slice(k)  # the header's dtype and shape; no tensor data is read
                        self.dtypes.append((sl.get_dtype(), len(sl.get_shape())))
                        self.shapes[f, k] = sl.get_shape()
            except (SafetensorError, OSError) as e:
                raise _unreadable(f, e) from None
        for k, f in listed.items():  # the index says which file each tensor is read from
            if k not in held[f]:
                raise StrataError(f"{d / INDEX}: tensor {k} is listed in {f.name}, which does not hold it "
                                  "(a shard from another download? re-download it)")
            self.index[k] = f
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
        if self.meta:
            self.used.add(k)
            return torch.empty(self.shapes[f, k], dtype=torch.float32, device="meta")
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
