"""Reading GGUF files: metadata as plain Python values, tensors as memory-mapped raw bytes.

Built on gguf-py's `GGUFReader` (which memory-maps the file); strata adds what a user needs when a file is bad:
split sets (`name-00001-of-00003.gguf`) opened as one model, every tensor's data checked to lie inside its file,
and one clear `StrataError` naming the file and the tensor or type at fault. Nothing is copied at load: a
tensor's bytes stay a view of the page cache until something reads them.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from strata import StrataError

SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<idx>\d{5})-of-(?P<n>\d{5})\.gguf$")


@dataclass
class TensorInfo:
    name: str
    qtype: int  # gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # torch order (outermost first): a weight of out x in is (out, in)
    n_bytes: int
    file: Path
    offset: int  # absolute byte offset in `file`
    _mm: np.ndarray  # the file's memory map (uint8)

    def raw(self) -> torch.Tensor:
        """The tensor's stored bytes as a uint8 tensor `[*shape[:-1], row_bytes]`, a view of the mapped file."""
        buf = self._mm[self.offset : self.offset + self.n_bytes]
        lead = self.shape[:-1]
        rows = int(np.prod(lead)) if lead else 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # copy-on-write maps are writable; torch warns for read-only ones
            t = torch.from_numpy(buf)
        return t.view(*lead, self.n_bytes // rows) if lead else t.view(1, self.n_bytes)


def split_paths(path: str | os.PathLike) -> list[Path]:
    """All files of a split GGUF set given any of them (or the single file itself), first shard first."""
    p = Path(path)
    m = SPLIT_RE.match(p.name)
    if not m:
        return [p]
    n = int(m.group("n"))
    paths = [p.with_name(f"{m.group('stem')}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [str(q) for q in paths if not q.exists()]
    if missing:
        raise StrataError(f"split GGUF set {p.name} is incomplete: missing {', '.join(missing)}")
    return paths


class _Truncated(Exception):
    def __init__(self, tensor: str, end: int, size: int):
        super().__init__(tensor)
        self.tensor, self.end, self.size = tensor, end, size


def _reader_class():
    import gguf
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    class CheckedReader(gguf.GGUFReader):
        """gguf-py's reader, checking each tensor's extent before gguf-py maps it (so a truncated file is reported
        with the tensor's name instead of a numpy reshape error)."""

        def _build_tensors(self, start_offs, fields):
            for field in fields:
                _n, name_data, _d, dims, raw_dtype, offset_tensor = field.parts
                try:
                    qt = GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise  # reported as an unsupported type by the caller
                bs, ts = GGML_QUANT_SIZES[qt]
                n_bytes = int(np.prod(dims)) * ts // bs
                end = int(start_offs + offset_tensor[0]) + n_bytes
                if end > len(self.data):
                    raise _Truncated(str(bytes(name_data), encoding="utf-8"), end, len(self.data))
            return super()._build_tensors(start_offs, fields)

    return CheckedReader


def _field_value(field) -> Any:
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 - contents() of exotic nested arrays; keep the raw parts
        return None


class GGUFModel:
    """One model: the metadata of the first shard and the tensors of all shards."""

    def __init__(self, path: str | os.PathLike):
        import gguf

        self.paths = split_paths(path)
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        for i, p in enumerate(self.paths):
            if not p.exists():
                raise StrataError(f"model file not found: {p}")
            size = p.stat().st_size
            try:
                r = _reader_class()(p, "c")
            except _Truncated as e:
                raise StrataError(
                    f"{p.name}: tensor {e.tensor} runs past the end of the file (needs bytes up to {e.end:,}, "
                    f"file has {e.size:,}): the file is truncated"
                ) from None
            except ValueError as e:
                msg = str(e)
                if "is not a valid GGMLQuantizationType" in msg:
                    raise StrataError(f"{p.name}: unsupported tensor type ({msg})") from None
                raise StrataError(f"{p.name}: not a readable GGUF file ({msg})") from None
            except Exception as e:  # noqa: BLE001 - struct/mmap errors on truncated headers
                raise StrataError(f"{p.name}: not a readable GGUF file, truncated or corrupt ({e})") from None
            if i == 0:
                for name, field in r.fields.items():
                    if name.startswith("GGUF."):
                        continue
                    self.metadata[name] = _field_value(field)
            for t in r.tensors:
                shape = tuple(int(d) for d in reversed(t.shape.tolist()))
                end = t.data_offset + t.n_bytes
                if end > size:
                    raise StrataError(
                        f"{p.name}: tensor {t.name} runs past the end of the file "
                        f"(needs bytes up to {end:,}, file has {size:,}): the file is truncated"
                    )
                if t.name in self.tensors:
                    raise StrataError(f"{p.name}: tensor {t.name} appears twice in the split set")
                self.tensors[t.name] = TensorInfo(
                    t.name, int(t.tensor_type), shape, int(t.n_bytes), p, int(t.data_offset), r.data
                )
        self.arch: str = str(self.metadata.get("general.architecture", ""))
        if not self.arch:
            raise StrataError(f"{self.paths[0].name}: no general.architecture in the metadata")

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_get(self, key: str, default: Any = None) -> Any:
        """`{arch}.{key}` from the metadata."""
        return self.metadata.get(f"{self.arch}.{key}", default)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())

    @property
    def file_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.paths)


def open_gguf(path: str | os.PathLike) -> GGUFModel:
    return GGUFModel(path)


def check_gguf_file(path: str | os.PathLike) -> GGUFModel:
    """Structural check: the header parses, every type is known, every tensor's data lies inside its file."""
    return GGUFModel(path)
