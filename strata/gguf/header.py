"""The GGUF header: metadata and tensor infos, read without touching tensor data.

One parser serves every reader in strata: the model loader (`strata.gguf.reader`, which wants every value,
vocabularies included), the tokenizer, and `strata pull` / `strata check` (which want only scalars and short
arrays, quickly, and a structural check of a file that may be truncated). gguf-py's GGUFReader decodes every
vocabulary string into numpy views (~15 s for a 150K-token vocabulary) and reports a truncated file as an
anonymous reshape error; this reads only the header, little- or big-endian, numeric arrays in one numpy call,
and names what is wrong. Tests check it against GGUFReader.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from strata import StrataError

@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the contiguous dimension
    ggml_type: int
    n_bytes: int
    offset: int  # absolute offset of the tensor's data in the file


@dataclass
class GGUFHeader:
    path: Path
    file_size: int
    data_offset: int
    alignment: int
    metadata: dict[str, Any] = field(default_factory=dict)  # scalars and short arrays (long arrays skipped)
    tensors: list[TensorInfo] = field(default_factory=list)

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def arch_value(self, key: str, default: Any = None) -> Any:
        """`{architecture}.{key}` from the metadata."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


SHORT_ARRAYS = 4096  # with full=False, metadata arrays longer than this (vocabularies) are skipped
# GGUF value types -> struct format (GGUF spec; the same numbering as gguf-py's GGUFValueType)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Reads GGUF header values from a memory map; running off the end means the file is truncated."""

    def __init__(self, buf, order: str, max_array: int | None):
        self.buf, self.order, self.pos, self.max_array = buf, order, 0, max_array

    def take(self, fmt: str):
        st = struct.Struct(self.order + fmt)
        if self.pos + st.size > len(self.buf):
            raise EOFError(f"header ends past the end of the file (at byte {self.pos})")
        (v,) = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return v

    def string(self, keep: bool = True) -> str | None:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise EOFError(f"header ends past the end of the file (at byte {self.pos})")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace") if keep else None
        self.pos += n
        return s

    def value(self, vtype: int, keep: bool = True) -> Any:
        if vtype in _SCALAR:
            return self.take(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string(keep)
        if vtype == _ARRAY:
            itype, n = self.take("I"), self.take("Q")
            keep = keep and (self.max_array is None or n <= self.max_array)
            if itype in _SCALAR:  # numeric arrays in one step: skipped, or read with numpy
                size = n * struct.calcsize(_SCALAR[itype])
                if self.pos + size > len(self.buf):
                    raise EOFError("header ends past the end of the file")
                arr = None
                if keep:
                    dt = np.dtype(self.order + _SCALAR[itype].replace("?", "b1"))
                    arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos).tolist()
                self.pos += size
                return arr
            items = [self.value(itype, keep) for _ in range(n)]
            return items if keep else None
        raise ValueError(f"unknown GGUF value type {vtype} at byte {self.pos}")


# the first bytes of what is passed for a GGUF by mistake, and what to do instead
_CONVERT = "strata runs GGUF files: convert the checkpoint's directory with `strata convert HF_DIR out.gguf`"
_OLD_GGML = (b"lmgg", b"fmgg", b"tjgg", b"algg")  # 'ggml', 'ggmf', 'ggjt', 'ggla' as uint32 little-endian


def not_gguf(head: bytes, size: int) -> str:
    """What a file that does not start with GGUF's magic is, from its first bytes, and what to run instead."""
    if len(head) >= 9 and head[8:9] == b"{" and 0 < struct.unpack_from("<Q", head)[0] < size:
        return f"a safetensors file, not GGUF; {_CONVERT}"
    if head[:4] == b"PK\x03\x04" or (head[:1] == b"\x80" and head[1:2] in b"\x02\x03\x04\x05"):
        return f"a PyTorch checkpoint (pickle), not GGUF; {_CONVERT} (from its safetensors files)"
    if head[:4] in _OLD_GGML:
        return ("a GGML file of the format before GGUF (2023), which llama.cpp no longer reads either: get the "
                "model's GGUF")
    if head.startswith(b"version https://git-lfs"):
        return ("a Git LFS pointer, not the model's data: fetch the file itself (`git lfs pull`, or `strata pull "
                "REPO:FILE`)")
    if head.lstrip()[:1] == b"<":
        return "a web page (HTML or XML), not GGUF: a download that saved an error page? download it again"
    return f"not a GGUF file (it does not start with GGUF's magic; {size} bytes)"


def read_gguf_header(path: Path, full: bool = False) -> GGUFHeader:
    """Metadata and tensor infos of one GGUF file, without touching tensor data; StrataError if unreadable.
    `full`: keep every metadata array (vocabularies too); otherwise arrays past SHORT_ARRAYS are skipped."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(64)
    if head[:4] != b"GGUF":
        raise StrataError(f"{path.name}: {not_gguf(head, file_size)}")
    if file_size < 24:
        raise StrataError(f"{path.name}: not a GGUF file ({file_size} bytes)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            version = struct.unpack_from("<I", buf, 4)[0]
            order = "<" if version & 0xFFFF else ">"  # a big-endian file reads as version << 16 here
            c = _Cursor(buf, order, None if full else SHORT_ARRAYS)
            c.pos = 4
            version = c.take("I")
            if version not in (2, 3):
                raise ValueError(f"unsupported GGUF version {version}")
            n_tensors, n_kv = c.take("Q"), c.take("Q")
            metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key = c.string()
                val = c.value(c.take("I"))
                if val is not None:
                    metadata[key] = val
            raw = []
            for _ in range(n_tensors):
                name = c.string()
                dims = tuple(c.take("Q") for _ in range(c.take("I")))
                raw.append((name, dims, c.take("I"), c.take("Q")))
            header_end = c.pos
        except (EOFError, ValueError, UnicodeDecodeError, struct.error) as e:
            raise StrataError(f"{path.name}: not a readable GGUF header ({e})") from e
    alignment = int(metadata.get("general.alignment", 32))
    if alignment <= 0 or alignment & (alignment - 1):
        raise StrataError(f"{path.name}: invalid general.alignment {alignment}")
    data_offset = -(-header_end // alignment) * alignment
    tensors = []
    for name, dims, ttype, rel in raw:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        except (ValueError, KeyError) as e:
            raise StrataError(f"{path.name}: tensor {name} has unknown ggml type {ttype}") from e
        n_elems = 1
        for d in dims:
            n_elems *= d
        tensors.append(TensorInfo(name, dims, ttype, n_elems * type_size // block, data_offset + rel))
    return GGUFHeader(path, file_size, data_offset, alignment, metadata, tensors)


def check_gguf_file(path: Path, name: str | None = None, full: bool = False) -> GGUFHeader:
    """Check that every tensor's data lies inside the file; StrataError naming the first one that does not.

    `name` is the file's name in messages (default: the path's name; `pull` checks `x.gguf.part` as `x.gguf`).
    """
    name = name or Path(path).name
    try:
        h = read_gguf_header(path, full=full)
    except StrataError as e:
        raise StrataError(str(e).replace(Path(path).name, name, 1)) from e
    for t in h.tensors:
        if t.offset % h.alignment:
            raise StrataError(f"{name}: tensor {t.name} at offset {t.offset} is not {h.alignment}-byte aligned")
        end = t.offset + t.n_bytes
        if end > h.file_size:
            raise StrataError(
                f"{name}: tensor {t.name} ends at byte {end} but the file has {h.file_size} bytes (truncated)"
            )
    return h


def require_model(metadata: dict[str, Any], n_files: int, n_tensors: int, name: str) -> None:
    """A GGUF (set) that holds a model: StrataError for one part of a split set opened alone (its name lacks
    `-0000i-of-0000N`, so its parts were not found) or a file of no tensors (a vocabulary)."""
    count = int(metadata.get("split.count", 0) or 0)
    if count > n_files:
        no = int(metadata.get("split.no", 0) or 0) + 1
        raise StrataError(f"{name} is part {no} of a split GGUF set of {count} files (its split.count), opened "
                          f"alone: name the parts as llama.cpp's gguf-split does (MODEL-{no:05d}-of-{count:05d}.gguf, "
                          "each beside the others) and pass the first")
    if not n_tensors:
        raise StrataError(f"{name} holds no tensors: a vocabulary-only GGUF (as llama.cpp's ggml-vocab-*.gguf "
                          "files are), not a model to run")
