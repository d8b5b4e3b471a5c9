"""What makes a downloaded file count as finished: the full hash, the `.done` marker, the GGUF structure.

A file is finished when, and only when, `<file>.done` exists and records the file's current size (and the
sha256 the source's metadata promised, when one is known). The marker is written last, after the full hash
of the file on disk matched; a marker whose size disagrees with its file is ignored and the file re-verified.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from strata import StrataError
from strata.hub.http import NullTask, Task

HASH_BUF = 8 << 20  # bytes per read while hashing


@dataclass
class Digest:
    size: int
    sha256: str
    git_sha1: str | None = None  # git's blob id (sha1 of "blob <size>\0" + bytes), for non-LFS hub files


def hash_file(path: Path, task: Task | None = None, git_sha1: bool = False) -> Digest:
    """sha256 (and optionally the git blob sha1) of the whole file, read from disk."""
    task = task or NullTask()
    size = path.stat().st_size
    task.update(0, size)
    h = hashlib.sha256()
    g = hashlib.sha1(b"blob %d\0" % size) if git_sha1 else None
    buf = bytearray(HASH_BUF)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            if g is not None:
                g.update(view[:n])
            task.advance(n)
    return Digest(size, h.hexdigest(), g.hexdigest() if g is not None else None)


@dataclass
class Marker:
    size: int
    sha256: str
    source: str
    time: str
    verified_against: str  # "sha256" | "git-sha1" | "size" | "none": what the source's metadata let us check


def marker_path(final: Path) -> Path:
    return final.with_name(final.name + ".done")


def read_marker(final: Path) -> Marker | None:
    """The marker beside `final`, or None when absent or unreadable (an unreadable marker proves nothing)."""
    try:
        data = json.loads(marker_path(final).read_text())
        return Marker(
            size=int(data["size"]),
            sha256=str(data["sha256"]),
            source=str(data.get("source", "")),
            time=str(data.get("time", "")),
            verified_against=str(data.get("verified_against", "")),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_marker(final: Path, digest: Digest, source: str, verified_against: str) -> Marker:
    m = Marker(
        size=digest.size,
        sha256=digest.sha256,
        source=source,
        time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        verified_against=verified_against,
    )
    path = marker_path(final)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(asdict(m), f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return m


def marker_valid(final: Path, expected_size: int | None = None, expected_sha256: str | None = None) -> bool:
    """True when `final` exists and its marker records its current size and the expected size/sha256."""
    m = read_marker(final)
    if m is None:
        return False
    try:
        size = final.stat().st_size
    except FileNotFoundError:
        return False
    if m.size != size:
        return False
    if expected_size is not None and m.size != expected_size:
        return False
    if expected_sha256 is not None and m.sha256.lower() != expected_sha256.lower():
        return False
    return True


def remove_marker(final: Path) -> None:
    marker_path(final).unlink(missing_ok=True)


# --- GGUF structure --------------------------------------------------------------------------------------


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


_MAX_ARRAY = 4096  # metadata arrays longer than this (vocabularies) are skipped, not decoded
# GGUF value types -> struct format (GGUF spec; the same numbering as gguf-py's GGUFValueType)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Reads GGUF header values from a memory map; running off the end means the file is truncated."""

    def __init__(self, buf, order: str):
        self.buf, self.order, self.pos = buf, order, 0

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
            keep = keep and n <= _MAX_ARRAY
            if itype in _SCALAR and not keep:  # skip a long numeric array in one step
                self.pos += n * struct.calcsize(_SCALAR[itype])
                if self.pos > len(self.buf):
                    raise EOFError("header ends past the end of the file")
                return None
            items = [self.value(itype, keep) for _ in range(n)]
            return items if keep else None
        raise ValueError(f"unknown GGUF value type {vtype} at byte {self.pos}")


def read_gguf_header(path: Path) -> GGUFHeader:
    """Metadata and tensor infos of one GGUF file, without touching tensor data; StrataError if unreadable.

    (gguf-py's GGUFReader decodes every vocabulary string into numpy views, which takes seconds per file, and
    fails with an anonymous reshape error on a truncated file; this reads only the header. Tests check it
    against GGUFReader.)
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    file_size = path.stat().st_size
    if file_size < 24:
        raise StrataError(f"{path.name}: not a GGUF file ({file_size} bytes)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            if bytes(buf[:4]) != b"GGUF":
                raise ValueError("no GGUF magic")
            version = struct.unpack_from("<I", buf, 4)[0]
            order = "<" if version & 0xFFFF else ">"  # a big-endian file reads as version << 16 here
            c = _Cursor(buf, order)
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


def check_gguf_file(path: Path, name: str | None = None) -> GGUFHeader:
    """Check that every tensor's data lies inside the file; StrataError naming the first one that does not.

    `name` is the file's name in messages (default: the path's name; `pull` checks `x.gguf.part` as `x.gguf`).
    """
    name = name or Path(path).name
    try:
        h = read_gguf_header(path)
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
