"""Reading GGUF files: metadata as plain Python values, tensors as memory-mapped raw bytes.

The header is parsed by `strata.gguf.header` (gguf-py supplies the type tables and writes files); tensors are
views of a copy-on-write memory map. strata adds what a user needs when a file is bad:
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
from strata.gguf.header import check_gguf_file, read_gguf_header, require_model
from strata.quant import SUPPORTED_TYPES, type_name

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


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """A GGUF file's key/value metadata as plain Python values (arrays as lists), vocabularies included."""
    return read_gguf_header(Path(path), full=True).metadata


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
            h = check_gguf_file(p, full=i == 0)  # header parsed, every tensor's data inside the file
            mm = np.memmap(p, dtype=np.uint8, mode="c")  # copy-on-write: torch can wrap it, the file stays
            if i == 0:
                self.metadata = h.metadata
            for t in h.tensors:
                qtype = gguf.GGMLQuantizationType(t.ggml_type)
                if qtype not in SUPPORTED_TYPES:
                    raise StrataError(
                        f"{p.name}: tensor {t.name} is stored as {qtype.name}, a weight format strata does not "
                        f"support (supported: {', '.join(sorted(type_name(q) for q in SUPPORTED_TYPES))})"
                    )
                if t.name in self.tensors:
                    raise StrataError(f"{p.name}: tensor {t.name} appears twice in the split set")
                shape = tuple(reversed(t.shape))  # ggml order -> torch order
                self.tensors[t.name] = TensorInfo(t.name, int(qtype), shape, t.n_bytes, p, t.offset, mm)
        require_model(self.metadata, len(self.paths), len(self.tensors), self.paths[0].name)
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
