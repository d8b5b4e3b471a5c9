"""Reading GGUF files: metadata as plain Python values, tensors as memory-mapped raw bytes.

The header is parsed here (numpy for arrays; gguf-py supplies the type tables and writes files); tensors are
views of a copy-on-write memory map. strata adds what a user needs when a file is bad:
split sets (`name-00001-of-00003.gguf`) opened as one model, every tensor's data checked to lie inside its file,
and one clear `StrataError` naming the file and the tensor or type at fault. Nothing is copied at load: a
tensor's bytes stay a view of the page cache until something reads them.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from strata import StrataError
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


# --------------------------------------------------------------------------------------------------------------
# The header's key/value section (numpy for arrays: fast enough for 150K-token vocabularies)

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
       12: "<f8"}
_STRING, _ARRAY = 8, 9


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Read a GGUF file's key/value metadata into a plain dict (arrays become lists)."""
    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _parse_gguf_kv_at(mm, path)[0]
    except (OSError, ValueError) as e:
        raise StrataError(f"cannot read GGUF metadata from {path}: {e}") from e


def _parse_gguf_kv_at(buf, path: Path) -> tuple[dict[str, Any], int]:
    """The key/value section: (metadata, offset of the tensor-info section)."""
    if bytes(buf[:4]) != b"GGUF":
        raise StrataError(f"{path} is not a GGUF file (bad magic {bytes(buf[:4])!r})")
    (version,) = struct.unpack_from("<I", buf, 4)
    if version not in (2, 3):
        raise StrataError(f"{path}: unsupported GGUF version {version} (big-endian files are not supported)")
    _, n_kv = struct.unpack_from("<QQ", buf, 8)
    pos = 24

    def read_str(pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, pos)
        pos += 8
        return bytes(buf[pos:pos + n]).decode("utf-8", errors="replace"), pos + n

    def read_val(vtype: int, pos: int) -> tuple[Any, int]:
        if vtype == _STRING:
            return read_str(pos)
        if vtype in _SCALAR:
            fmt = _SCALAR[vtype]
            (v,) = struct.unpack_from(fmt, buf, pos)
            return v, pos + struct.calcsize(fmt)
        if vtype == _ARRAY:
            etype, n = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if etype in _NP:
                dt = np.dtype(_NP[etype])
                arr = np.frombuffer(buf, dtype=dt, count=n, offset=pos)
                vals = arr.astype(bool).tolist() if etype == 7 else arr.tolist()
                return vals, pos + n * dt.itemsize
            out = []
            for _ in range(n):
                v, pos = read_val(etype, pos)
                out.append(v)
            return out, pos
        raise ValueError(f"unknown GGUF value type {vtype}")

    md: dict[str, Any] = {}
    for _ in range(n_kv):
        key, pos = read_str(pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        md[key], pos = read_val(vtype, pos + 4)
    return md, pos



def _parse(buf, path: Path) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]], int]:
    """Parse the header: (metadata, [(name, ggml dims, type id, relative offset)], absolute data start).

    Metadata values are parsed with numpy for arrays (a 150K-token vocabulary takes well under a second; gguf-py's
    generic reader builds one object per string and takes ~15 s on the same file)."""
    md, pos = _parse_gguf_kv_at(buf, path)
    (n_tensors, _) = struct.unpack_from("<QQ", buf, 8)
    infos = []
    for _ in range(n_tensors):
        (n,) = struct.unpack_from("<Q", buf, pos)
        name = bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", errors="replace")
        pos += 8 + n
        (nd,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{nd}Q", buf, pos + 4)
        pos += 4 + 8 * nd
        qtype, off = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        infos.append((name, tuple(int(d) for d in dims), int(qtype), int(off)))
    align = int(md.get("general.alignment", 32) or 32)
    return md, infos, pos + (-pos) % align


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
                with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as hm:
                    md, infos, data_start = _parse(hm, p)  # bytes slicing of an mmap is fast; of a memmap, not
                mm = np.memmap(p, dtype=np.uint8, mode="c")  # copy-on-write: torch can wrap it, the file stays
            except StrataError:
                raise
            except Exception as e:  # noqa: BLE001 - struct errors on a header cut short, bad UTF-8, ...
                raise StrataError(f"{p.name}: not a readable GGUF file, truncated or corrupt ({e})") from None
            if i == 0:
                self.metadata = md
            for name, dims, qt, off in infos:
                try:
                    qtype = gguf.GGMLQuantizationType(qt)
                except ValueError:
                    raise StrataError(f"{p.name}: tensor {name} has unknown type id {qt}") from None
                if qtype not in SUPPORTED_TYPES:
                    raise StrataError(
                        f"{p.name}: tensor {name} is stored as {qtype.name}, a weight format strata does not support "
                        f"(supported: {', '.join(sorted(type_name(t) for t in SUPPORTED_TYPES))})"
                    )
                bs, ts = gguf.GGML_QUANT_SIZES[qtype]
                n_el = int(np.prod(dims)) if dims else 1
                n_bytes = n_el // bs * ts
                start = data_start + off
                if start + n_bytes > size:
                    raise StrataError(
                        f"{p.name}: tensor {name} runs past the end of the file (needs bytes up to "
                        f"{start + n_bytes:,}, file has {size:,}): the file is truncated"
                    )
                if name in self.tensors:
                    raise StrataError(f"{p.name}: tensor {name} appears twice in the split set")
                shape = tuple(reversed(dims))
                self.tensors[name] = TensorInfo(name, int(qtype), shape, n_bytes, p, start, mm)
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
