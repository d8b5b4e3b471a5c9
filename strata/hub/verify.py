"""What makes a downloaded file count as finished: the full hash, the `.done` marker, the GGUF structure.

A file is finished when, and only when, `<file>.done` exists and records the file's current size and
modification time (and the sha256 the source's metadata promised, when one is known). The marker is written
last, after the full hash of the file on disk matched; a marker whose size or mtime disagrees with its file is
ignored and the file re-verified (rewriting a file in place, same size, changes its mtime: checking it costs
one stat, where re-hashing would cost reading every byte).

Markers written before the mtime was recorded have none: `marker_valid` still accepts them (so models pulled
then keep loading without a re-hash at every start), and `strata pull` re-hashes such a file once and rewrites
its marker (allow_legacy=False), since only a hash can tell whether the bytes changed since.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from strata.hub.http import NullTask, Task

HASH_BUF = 8 << 20  # bytes per read while hashing


@dataclass
class Digest:
    size: int
    sha256: str
    git_sha1: str | None = None  # git's blob id (sha1 of "blob <size>\0" + bytes), for non-LFS hub files
    mtime_ns: int | None = None  # the file's mtime when hashing began: a write during the hash then shows


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
        mtime_ns = os.fstat(f.fileno()).st_mtime_ns
        while n := f.readinto(buf):
            h.update(view[:n])
            if g is not None:
                g.update(view[:n])
            task.advance(n)
    return Digest(size, h.hexdigest(), g.hexdigest() if g is not None else None, mtime_ns)


@dataclass
class Marker:
    size: int
    sha256: str
    source: str
    time: str
    verified_against: str  # "sha256" | "git-sha1" | "size" | "none": what the source's metadata let us check
    mtime_ns: int | None = None  # the file's mtime when it was hashed (None: a marker from before it was kept)


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
            mtime_ns=int(data["mtime_ns"]) if data.get("mtime_ns") is not None else None,
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
        mtime_ns=digest.mtime_ns if digest.mtime_ns is not None else final.stat().st_mtime_ns,
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


def marker_valid(
    final: Path, expected_size: int | None = None, expected_sha256: str | None = None, allow_legacy: bool = True
) -> bool:
    """True when `final` exists and its marker records its current size and mtime and the expected size/sha256.

    allow_legacy: accept a marker without an mtime (written before it was recorded) on its size alone."""
    m = read_marker(final)
    if m is None:
        return False
    try:
        st = final.stat()
    except FileNotFoundError:
        return False
    if m.size != st.st_size:
        return False
    if m.mtime_ns is None and not allow_legacy:
        return False
    if m.mtime_ns is not None and m.mtime_ns != st.st_mtime_ns:
        return False
    if expected_size is not None and m.size != expected_size:
        return False
    if expected_sha256 is not None and m.sha256.lower() != expected_sha256.lower():
        return False
    return True


def marker_mismatch(m: Marker, final: Path) -> str:
    """Why marker `m` does not vouch for `final` as it is now (for a warning)."""
    st = final.stat()
    if m.size != st.st_size:
        return f"marker does not match the file (marker {m.size} bytes, file {st.st_size})"
    if m.mtime_ns is None:
        return "its marker predates recorded modification times"
    if m.mtime_ns != st.st_mtime_ns:
        return "modified since it was verified (its mtime is not the marker's)"
    return "marker does not match the source's size or sha256"


def remove_marker(final: Path) -> None:
    marker_path(final).unlink(missing_ok=True)


# --- GGUF structure: strata.gguf.header (the one GGUF header parser), re-exported for pull and check
from strata.gguf.header import GGUFHeader, TensorInfo, check_gguf_file, read_gguf_header  # noqa: E402,F401
