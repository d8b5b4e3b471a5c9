"""Slot-pool memory whose last rows can be handed back to the device while a prompt's chunks run
(`--prefill-loan`).

A prompt chunk's activations need about a gigabyte of VRAM that sits idle while sequences decode (a 4K chunk of a
30B-A3B model: 0.9 GiB of an 8 GiB budget). With the loan, that VRAM holds expert slots between prompts: the pool
tensors get that many more rows, at their end, and a prompt's first chunk evicts the experts there and returns the
rows' physical memory to the driver, where torch's allocator (expandable segments) takes it for the chunk's
activations; the next decode step maps fresh memory at the same addresses (captured CUDA graphs keep their
pointers) and the cache refills the rows from what decoding routes.

On a GPU a pool tensor is then one reserved virtual address range backed by pieces of physical memory (the CUDA
driver's virtual memory management: cuMemAddressReserve / cuMemCreate / cuMemMap, through ctypes: torch exposes
none of it). Only whole pieces past the lent rows' first byte are released; the rows before that boundary stay
mapped. On a CPU (tests) a pool is a plain tensor and a release overwrites the rows with NaN-making bytes, so any
read of a released row shows in the output.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from strata import StrataError

log = logging.getLogger("strata")

PIECE = 4 << 20  # bytes of physical memory a handle (a multiple of the driver's granularity, 2 MiB): the lent rows'
# first and last pieces are partly other rows or past the end, so smaller pieces waste less; each is a few driver
# calls when a prompt ends
POISON = 0xFF  # a released row's bytes on the CPU: an f16 scale of 0xFFFF is a NaN


class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Flags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Loc),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _Flags)]


class _Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Loc), ("flags", ctypes.c_int)]


_PINNED, _ON_DEVICE, _READ_WRITE = 1, 1, 3
_driver = None


def _cu():
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
    return _driver


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise StrataError(f"CUDA driver {what} failed (CUresult {rc})")


class _Interface:
    """What torch.as_tensor reads a device buffer from; it keeps the buffer alive while the tensor is."""

    def __init__(self, owner: "DeviceRange"):
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (owner.nbytes,), "typestr": "|u1", "data": (owner.ptr, False),
                                         "version": 3, "strides": None, "stream": None}


class DeviceRange:
    """`nbytes` of device memory at one reserved address range, mapped in pieces of PIECE bytes; the pieces past
    a byte offset can be released and mapped again (new memory: their contents are gone)."""

    def __init__(self, nbytes: int, device: torch.device):
        cu = _cu()
        torch.cuda.synchronize(device)  # (the calling thread has the primary context current from here)
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.prop = _Prop(type=_PINNED, location=_Loc(_ON_DEVICE, self.index))
        gran = ctypes.c_size_t()
        _check(cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(self.prop), 0), "granularity")
        self.piece = max(gran.value, PIECE // gran.value * gran.value)
        self.nbytes = int(nbytes)
        self.size = -(-self.nbytes // self.piece) * self.piece
        ptr = ctypes.c_uint64()
        _check(cu.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(self.size), ctypes.c_size_t(0),
                                      ctypes.c_uint64(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        self.ptr = ptr.value
        self.handles: list[int | None] = [None] * (self.size // self.piece)
        try:
            self._map(0)
        except StrataError:
            self.close()
            raise

    def _map(self, first: int) -> None:
        cu = _cu()
        for p in range(first, len(self.handles)):
            if self.handles[p] is not None:
                continue
            h = ctypes.c_uint64()
            rc = cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(self.piece), ctypes.byref(self.prop),
                                ctypes.c_ulonglong(0))
            if rc == 2:  # CUDA_ERROR_OUT_OF_MEMORY
                raise torch.OutOfMemoryError(f"cuMemCreate: no {self.piece >> 20} MiB left on the device")
            _check(rc, "cuMemCreate")
            at = self.ptr + p * self.piece
            rc = cu.cuMemMap(ctypes.c_uint64(at), ctypes.c_size_t(self.piece), ctypes.c_size_t(0), h,
                             ctypes.c_ulonglong(0))
            if rc != 0:
                cu.cuMemRelease(h)
                _check(rc, "cuMemMap")
            self.handles[p] = h.value
            acc = _Access(location=_Loc(_ON_DEVICE, self.index), flags=_READ_WRITE)
            _check(cu.cuMemSetAccess(ctypes.c_uint64(at), ctypes.c_size_t(self.piece), ctypes.byref(acc),
                                     ctypes.c_size_t(1)), "cuMemSetAccess")

    def first_piece(self, offset: int) -> int:
        """The first piece wholly at or past byte `offset`."""
        return -(-int(offset) // self.piece)

    def release(self, offset: int) -> int:
        """Hand the pieces wholly past byte `offset` back to the device (nothing may read or write them until
        restore); returns the bytes released."""
        cu, freed = _cu(), 0
        torch.cuda.synchronize(self.device)
        for p in range(self.first_piece(offset), len(self.handles)):
            h = self.handles[p]
            if h is None:
                continue
            _check(cu.cuMemUnmap(ctypes.c_uint64(self.ptr + p * self.piece), ctypes.c_size_t(self.piece)),
                   "cuMemUnmap")
            _check(cu.cuMemRelease(ctypes.c_uint64(h)), "cuMemRelease")
            self.handles[p] = None
            freed += self.piece
        return freed

    def restore(self) -> int:
        """Map fresh memory where pieces were released; returns the bytes mapped (torch.OutOfMemoryError: the
        device had not that much free; what was mapped stays)."""
        before = sum(h is None for h in self.handles)
        self._map(0)
        return before * self.piece

    def tensor(self) -> torch.Tensor:
        return torch.as_tensor(_Interface(self), device=self.device)

    def close(self) -> None:
        cu = _cu()
        for p, h in enumerate(self.handles):
            if h is not None:
                cu.cuMemUnmap(ctypes.c_uint64(self.ptr + p * self.piece), ctypes.c_size_t(self.piece))
                cu.cuMemRelease(ctypes.c_uint64(h))
                self.handles[p] = None
        if self.ptr:
            cu.cuMemAddressFree(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size))
            self.ptr = 0

    def __del__(self):  # (the last tensor over the range is gone)
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


class Releasable:
    """A pool projection's raw blocks [n, *row] whose rows from `first_row` on can be released (the lent rows)."""

    def __init__(self, shape: tuple[int, ...], device: torch.device, first_row: int):
        self.shape, self.device, self.first_row = tuple(shape), device, int(first_row)
        self.row_bytes = 1
        for s in self.shape[1:]:
            self.row_bytes *= int(s)
        nbytes = self.shape[0] * self.row_bytes
        if device.type == "cuda":
            self.range = DeviceRange(nbytes, device)
            self.raw = self.range.tensor().view(self.shape)
            self.raw.zero_()
        else:
            self.range = None
            self.raw = torch.zeros(self.shape, dtype=torch.uint8)
        self.released = False

    def lendable(self) -> int:
        """Bytes a release hands back (on a CPU: the lent rows' bytes)."""
        off = self.first_row * self.row_bytes
        if self.range is None:
            return self.raw.numel() - off
        return max(0, len(self.range.handles) - self.range.first_piece(off)) * self.range.piece

    def release(self) -> int:
        if self.released:
            return 0
        self.released = True
        if self.range is None:
            self.raw[self.first_row:].fill_(POISON)
            return self.raw[self.first_row:].numel()
        return self.range.release(self.first_row * self.row_bytes)

    def restore(self) -> int:
        if not self.released:
            return 0
        got = self.range.restore() if self.range is not None else self.raw[self.first_row:].numel()
        self.released = False
        return got


def probe(device: torch.device) -> str | None:
    """Whether a releasable range can be made on `device` here: None, or why not (the driver's answer: some
    platforms, virtualized GPUs among them, refuse its virtual memory calls)."""
    try:
        r = Releasable((2, PIECE), device, 1)
        r.release()
        r.restore()
        r.range.close()
    except (StrataError, OSError, AttributeError, RuntimeError) as e:
        return str(e)
    return None


def available() -> bool:
    """Whether the driver's virtual memory management can be reached here (a GPU with libcuda)."""
    if not torch.cuda.is_available():
        return False
    try:
        _cu().cuMemCreate  # noqa: B018 (a missing symbol raises)
        return True
    except (OSError, AttributeError):
        return False
