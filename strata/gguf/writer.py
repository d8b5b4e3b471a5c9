"""Streaming GGUF writing for multi-GB synthetic models, and fast deterministic pseudo-random GGML bytes.

`write_streamed` declares every tensor first (gguf's `GGUFWriter` writes the header, the metadata and the tensor
infos), then makes each tensor's bytes just before they are written, a few MB at a time, while a second thread
writes the previous chunk: memory stays flat and the disk never waits for the generator.

`RandomBlocks` makes valid GGML blocks at memory speed. A true PRNG runs at well under 1 GB/s per core; instead a
pool of random valid blocks (made once per file, by `strata.quant.random_raw_bytes`) is XOR'd, per chunk, with a
fresh random key over a random offset into the pool. The key never touches a block's f16 scale fields (which
fix the weights' std), so every chunk is valid and different from every other; for float formats the key only
flips sign bits, so every value stays finite.
"""

from __future__ import annotations

import math
import os
import queue
import shutil
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType

from strata import StrataError
from strata.quant.formats import FLOAT_TYPES, block_geometry, bytes_for, check_supported
from strata.quant.random import _set_scales, _unit_std, make_valid, random_raw_bytes, scale_mask

Q = GGMLQuantizationType

CHUNK_BYTES = 4 << 20  # bytes made and written per step
POOL_BYTES = 16 << 20  # random blocks each chunk is drawn from (4x a chunk: chunks rarely overlap in the pool)
OFFSET_TYPES = frozenset({Q.Q8_0, Q.F32, Q.F16, Q.BF16})
_SIGN = {Q.F32: np.uint32(0x80000000), Q.F16: np.uint16(0x8000), Q.BF16: np.uint16(0x8000)}


class RandomBlocks:
    """Pseudo-random valid blocks of one GGML type, with a requested std, fast (see the module docstring)."""

    def __init__(self, qtype, seed: int, pool_bytes: int = POOL_BYTES):
        self.qtype = check_supported(qtype)
        block, self.block_bytes = block_geometry(self.qtype)
        # A "group" is the unit the key repeats over: whole blocks, whole uint64 words, about 1 KiB.
        per = 8 * math.ceil(1024 / (8 * self.block_bytes))
        self.group = per * self.block_bytes
        self.g64 = self.group // 8
        self.n_groups = max(2, pool_bytes // self.group)
        self.max_fill = self.n_groups // 2 * self.group  # bytes one fill() may make
        self.seed = seed
        self._pools: dict[float, np.ndarray] = {}
        self._fixed_cache: dict[float, np.ndarray] = {}
        if self.qtype in FLOAT_TYPES:
            mask = np.zeros(self.group // np.dtype(_SIGN[self.qtype]).itemsize, _SIGN[self.qtype].dtype)
            mask[:] = _SIGN[self.qtype]
            self._mask = mask.view(np.uint64)
        else:
            self._mask = np.tile(scale_mask(self.qtype), per).view(np.uint64)

    def _pool(self, scale: float) -> np.ndarray:
        """The pool as uint64 [n_groups, g64]; quantized pools have zeroed scale fields (the key sets them)."""
        key = scale if self.qtype in FLOAT_TYPES else 0.0
        if key not in self._pools:
            n = self.n_groups * self.group
            block, _ = block_geometry(self.qtype)
            raw = random_raw_bytes(self.qtype, 1, n // self.block_bytes * block, self.seed, scale if key else 1.0)
            pool = raw.reshape(self.n_groups, self.g64 * 8).view(np.uint64)
            if self.qtype not in FLOAT_TYPES:
                pool &= self._mask
            self._pools[key] = pool
        return self._pools[key]

    def _fixed(self, scale: float) -> np.ndarray:
        """uint64 [g64]: the scale fields' bytes for this std (zero elsewhere)."""
        if scale in self._fixed_cache:
            return self._fixed_cache[scale]
        fixed = np.zeros((self.group // self.block_bytes, self.block_bytes), np.uint8)
        if self.qtype not in FLOAT_TYPES:
            _set_scales(fixed, self.qtype, scale / _unit_std(self.qtype))
        self._fixed_cache[scale] = fixed.reshape(-1).view(np.uint64)
        return self._fixed_cache[scale]

    def fill(self, out: np.ndarray, rng: np.random.Generator, scale: float) -> None:
        """Fill `out` (uint8, a whole number of groups, at most half the pool) with blocks of std ~scale."""
        ng = out.size // self.group
        if out.size % self.group or ng > self.n_groups // 2:
            raise ValueError(f"fill needs a whole number of {self.group}-byte groups, at most {self.n_groups // 2}")
        pool = self._pool(scale)
        start = int(rng.integers(0, self.n_groups - ng + 1))
        key = rng.integers(0, np.iinfo(np.uint64).max, self.g64, dtype=np.uint64, endpoint=True)
        key &= self._mask
        key |= self._fixed(scale)
        np.bitwise_xor(pool[start:start + ng], key, out=out.view(np.uint64).reshape(ng, self.g64))
        make_valid(self.qtype, out)  # the key may set codes a format leaves unused (TQ2_0)


@dataclass
class TensorSpec:
    """One tensor to write: logical shape in torch order (outermost first), its type, and how to make it.

    make: None for pseudo-random blocks of std `scale`; otherwise a function returning the tensor's bytes (any
    numpy array of exactly `nbytes` bytes; used for small structured tensors: norms, routers, biases).
    offset: a vector [shape[-1]] added to every row of the random values (Q8_0 and float types only): a
    component every row shares, e.g. the common direction of token embeddings.
    """

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    scale: float = 0.02
    make: Callable[[], np.ndarray] | None = None
    offset: np.ndarray | None = None
    asked: GGMLQuantizationType | None = None  # the type asked for, where rows not of its blocks took another

    def __post_init__(self):
        if self.offset is not None and self.qtype not in OFFSET_TYPES:
            raise ValueError(f"{self.name}: a shared row offset needs Q8_0 or a float type, not {self.qtype.name}")

    @property
    def nbytes(self) -> int:
        rows = math.prod(self.shape[:-1])
        return rows * bytes_for(self.qtype, self.shape[-1])


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _add_offset(chunk: np.ndarray, spec: TensorSpec, first: int) -> None:
    """Add spec.offset to the row elements in `chunk` (uint8, whole blocks; `first` = its first element's
    index within the row-major tensor), in place."""
    row = spec.shape[-1]
    if spec.qtype == Q.Q8_0:
        # Q8_0 is d * q: halve the random q (now -64..63) and add the offset in units of d (clipped to +-64),
        # so the sum still fits in int8 (offsets past +-64 d, about 1.7 std, are clipped). The pool's d was made
        # for twice the std, so the std is as asked.
        blocks = chunk.reshape(-1, 34)
        d = float(blocks[:1, :2].copy().view(np.float16)[0, 0])
        q = blocks[:, 2:].view(np.int8)  # [n, 32]
        o = np.clip(np.rint(spec.offset / d), -64, 64).astype(np.int8).reshape(-1, 32)  # [row / 32, 32]
        idx = (first // 32 + np.arange(q.shape[0])) % (row // 32)
        np.right_shift(q, 1, out=q)
        q += o[idx]
        return
    n = chunk.size // {Q.F32: 4}.get(spec.qtype, 2)
    cols = (first + np.arange(n)) % row
    if spec.qtype == Q.F32:
        chunk.view(np.float32)[:] += spec.offset[cols]
    elif spec.qtype == Q.F16:
        v = chunk.view(np.float16)
        v[:] = v.astype(np.float32) + spec.offset[cols]
    else:  # BF16: the top half of a float32
        v = chunk.view(np.uint16)
        f = (v.astype(np.uint32) << 16).view(np.float32) + spec.offset[cols].astype(np.float32)
        v[:] = (f.view(np.uint32) >> 16).astype(np.uint16)


def _write_all(f, mv: memoryview) -> None:
    """An unbuffered write may take only part of the bytes (a disk filling up, a file size limit): the rest is
    written on, which then fails with the reason (an unread short count would lose the file's end silently)."""
    while mv:
        n = f.write(mv)
        if not n:
            raise OSError(28, "No space left on device")
        mv = mv[n:]


class _Writer(threading.Thread):
    """Writes queued buffers to the file, handing each buffer back once written."""

    def __init__(self, f, bar):
        super().__init__(daemon=True)
        self.f, self.bar = f, bar
        self.todo: queue.Queue = queue.Queue()
        self.free: queue.Queue = queue.Queue()
        self.error: BaseException | None = None

    def run(self) -> None:
        while True:
            item = self.todo.get()
            if item is None:
                return
            data, buf = item
            try:
                if self.error is None:
                    _write_all(self.f, memoryview(data).cast("B"))
                    self.bar.update(data.nbytes)
            except BaseException as e:  # noqa: BLE001 - surfaced in the main thread
                self.error = e
            if buf is not None:
                self.free.put(buf)


def check_output(out: str | os.PathLike) -> Path:
    """`out` as a Path, or StrataError (one line) when no file can be written there. Checked before anything is
    made: otherwise a directory given as OUT failed with a traceback only at the final rename, gigabytes later."""
    out = Path(out)
    if out.is_dir() or not out.name:  # ".", "/", an existing directory
        raise StrataError(f"{out} is a directory, not a file to write the GGUF to")
    parent = next((d for d in out.parents if d.exists()), None)  # missing directories are made, as before
    if parent is not None and not parent.is_dir():
        raise StrataError(f"cannot write {out}: {parent} is not a directory")
    return out


def claim_temp(out: Path) -> Path:
    """A new empty file beside `out` that no other writer has, to write `out` as before renaming it: two runs
    writing the same OUT each fill their own file and the last rename wins whole (with one shared name, the first
    rename would give OUT the file the other run is still writing into). OSError when none can be made."""
    for i in range(100):
        tmp = out.with_name(f"{out.name}.{os.getpid()}{f'-{i}' if i else ''}.tmp")
        try:
            with open(tmp, "xb"):
                return tmp
        except FileExistsError:  # (a stale one a killed run of the same pid left, or a directory)
            continue
    raise FileExistsError(17, f"no free temporary name beside it ({tmp.name} and 99 others exist)")


def write_streamed(out: str | os.PathLike, w, specs: list[TensorSpec], seed: int, progress: bool = True,
                   data: bool = True) -> dict:
    """Write `w` (a `gguf.GGUFWriter` holding the metadata) and `specs` to `out`, via a temporary file beside it
    (`claim_temp`) renamed at the end.

    data=False writes the header and a sparse (all-zero, unallocated) data section of the right size: the file
    opens and shows every tensor's shape and type but holds no weights (for checking a layout cheaply).
    Returns {"bytes", "seconds", "gbps"}.
    """
    from tqdm import tqdm

    out = check_output(out)
    for s in specs:
        w.add_tensor_info(s.name, s.shape, np.dtype(np.float32), s.nbytes, raw_dtype=s.qtype)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = claim_temp(out)  # a path that cannot be written (permissions) fails before any data is made
    except OSError as e:
        raise StrataError(f"cannot write {out}: {e.strerror or e}") from None
    t0 = time.perf_counter()
    try:
        w.write_header_to_file(path=tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        align = w.data_alignment
        start = _pad(tmp.stat().st_size, align)
        total = start + sum(_pad(s.nbytes, align) for s in specs)
        if not data:
            with open(tmp, "r+b") as f:
                f.truncate(total)
            os.replace(tmp, out)
            return {"bytes": total, "seconds": time.perf_counter() - t0, "gbps": 0.0}
        free = shutil.disk_usage(tmp.parent).free  # (the header is written: the weights are what is left)
        if total - start > free:
            raise StrataError(f"not enough free disk for {out.name}: it needs {_size(total)}, "
                              f"{tmp.parent} has {_size(free + start)} free")
        with open(tmp, "r+b", buffering=0) as f, tqdm(total=total, initial=start, unit="B", unit_scale=True,
                                                       unit_divisor=1024, file=sys.stderr, disable=not progress,
                                                       desc=out.name, leave=False) as bar:
            f.seek(0, os.SEEK_END)
            _write_all(f, memoryview(b"\0" * (start - f.tell())))
            _write_data(f, bar, specs, seed, align)
        if tmp.stat().st_size != total:  # (never rename a file that is not whole)
            raise OSError(5, f"{tmp.name} holds {tmp.stat().st_size} bytes, not {total}")
        os.replace(tmp, out)
    except OSError as e:  # the header's write or the rename (the data's own writes fail in _write_data): one line
        raise StrataError(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        w.close()
        if tmp.exists():
            tmp.unlink()
    dt = time.perf_counter() - t0
    return {"bytes": total, "seconds": dt, "gbps": total / dt / 1e9}


def _write_data(f, bar, specs: list[TensorSpec], seed: int, align: int) -> None:
    wr = _Writer(f, bar)
    for _ in range(3):  # three buffers: one being filled, one queued, one being written
        wr.free.put(np.empty(CHUNK_BYTES + 4096, np.uint8))
    gens: dict[GGMLQuantizationType, RandomBlocks] = {}
    biggest: dict[GGMLQuantizationType, int] = {}
    for s in specs:
        if s.make is None:
            biggest[s.qtype] = max(biggest.get(s.qtype, 0), s.nbytes)
    wr.start()
    try:
        for s in specs:
            if wr.error is not None:
                break  # the disk refused (full, gone): stop making data, report below
            if s.make is not None:
                arr = np.ascontiguousarray(s.make())
                if arr.nbytes != s.nbytes:
                    raise ValueError(f"{s.name}: made {arr.nbytes} bytes, expected {s.nbytes}")
                wr.todo.put((arr, None))
            else:
                gen = gens.get(s.qtype)
                if gen is None:
                    # small models get a small pool (making it is the slow part), big ones POOL_BYTES
                    pool = min(POOL_BYTES, max(64 << 10, 4 * biggest[s.qtype]))
                    gen = gens[s.qtype] = RandomBlocks(s.qtype, seed, pool)
                rng = np.random.default_rng([seed, zlib.crc32(s.name.encode())])
                # with an offset (Q8_0), the random q are halved: start from blocks of twice the std
                scale = s.scale * 2 if s.offset is not None and s.qtype == Q.Q8_0 else s.scale
                step = min(CHUNK_BYTES, gen.max_fill) // gen.group * gen.group
                block, bsize = block_geometry(s.qtype)
                done = 0
                while done < s.nbytes and wr.error is None:
                    buf = wr.free.get()
                    n = min(step, s.nbytes - done)
                    gen.fill(buf[:_pad(n, gen.group)], rng, scale)
                    if s.offset is not None:
                        _add_offset(buf[:n], s, done // bsize * block)
                    wr.todo.put((buf[:n], buf))
                    done += n
            pad = _pad(s.nbytes, align) - s.nbytes
            if pad:
                wr.todo.put((np.zeros(pad, np.uint8), None))
    finally:
        wr.todo.put(None)
        wr.join()
    if isinstance(wr.error, OSError):  # said by the caller as OUT's, not the temporary file's
        raise wr.error
    if wr.error is not None:
        raise StrataError(f"writing {Path(f.name).name} failed: {wr.error}") from wr.error
