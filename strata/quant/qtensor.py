"""QTensor: a weight kept in its stored GGML format (raw blocks), dequantized only on demand."""

from __future__ import annotations

import operator
import warnings

import numpy as np
import torch
from gguf import GGMLQuantizationType

from strata import StrataError
from strata.quant.dequant import dequantize_flat
from strata.quant.formats import FLOAT_TYPES, as_qtype, block_geometry, bytes_for, check_supported
from strata.quant.iquants import FORMAT_TABLES, prepare

Q = GGMLQuantizationType

# Formats gguf-py can quantize to (its numpy code is the reference the bytes must match).
QUANTIZABLE_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1})


def _as_uint8_tensor(raw) -> torch.Tensor:
    """A uint8 torch view of raw bytes (torch tensor or numpy array, memory-mapped ones included); no copy."""
    if isinstance(raw, np.ndarray):
        if raw.dtype != np.uint8:
            raw = raw.view(np.uint8)
        with warnings.catch_warnings():
            # gguf's memory maps are read-only; torch warns it cannot enforce that. strata never writes raw.
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(raw)
    if not isinstance(raw, torch.Tensor):
        raise TypeError(f"raw weight bytes must be a torch tensor or numpy array, got {type(raw).__name__}")
    if raw.dtype != torch.uint8:
        raw = raw.view(torch.uint8)
    return raw


class QTensor:
    """A weight in its stored format.

    raw:   uint8 tensor [*lead, rows, row_bytes] (the logical shape with its last dim in bytes); may be a view
           of a memory-mapped file and is never copied at construction.
    qtype: gguf.GGMLQuantizationType.
    shape: logical shape in torch order, e.g. (n_expert, out, in) or (out, in); shape[-1] is the row length
           (gguf's ne[0]).
    """

    __slots__ = ("raw", "qtype", "shape")

    def __init__(self, raw: torch.Tensor, qtype, shape):
        qt = check_supported(qtype)
        shape = tuple(int(s) for s in shape)
        if not shape:
            raise StrataError("a QTensor needs at least one dimension")
        block, _ = block_geometry(qt)
        if shape[-1] % block:
            raise StrataError(f"row length {shape[-1]} is not a multiple of the {qt.name} block size {block}")
        want = (*shape[:-1], bytes_for(qt, shape[-1]))
        if raw.dtype != torch.uint8:
            raise TypeError(f"QTensor.raw must be uint8, got {raw.dtype}")
        if tuple(raw.shape) != want:
            if raw.numel() != _prod(want):
                raise StrataError(f"{raw.numel()} bytes do not hold a {qt.name} tensor of shape {shape} "
                                  f"({_prod(want)} bytes)")
            raw = raw.view(want)     # a view: callers pass contiguous (e.g. memory-mapped) buffers
        self.raw = raw
        self.qtype = qt
        self.shape = shape
        if raw.is_cuda and qt in FORMAT_TABLES:
            prepare(qt, raw.device)             # codebooks on the GPU before any graph capture reads them

    # construction -----------------------------------------------------------------------------------------
    @classmethod
    def from_raw(cls, raw, qtype, shape) -> "QTensor":
        """Wrap raw GGML bytes (torch or numpy; uint8, or a float array for F32/F16/BF16) without copying."""
        return cls(_as_uint8_tensor(raw), qtype, shape)

    @classmethod
    def from_float(cls, tensor: torch.Tensor, qtype) -> "QTensor":
        """Quantize a float tensor with gguf-py's reference quantizer (F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1)."""
        import gguf.quants

        qt = as_qtype(qtype)
        if qt not in QUANTIZABLE_TYPES:
            names = ", ".join(t.name for t in sorted(QUANTIZABLE_TYPES, key=int))
            raise StrataError(f"quantizing to {qt.name} is not supported (supported: {names})")
        block, _ = block_geometry(qt)
        shape = tuple(tensor.shape)
        if not shape or shape[-1] % block:
            raise StrataError(f"cannot quantize shape {shape} to {qt.name}: the last dim must be a multiple "
                              f"of {block}")
        data = tensor.detach().to("cpu", torch.float32).contiguous().numpy()
        q = gguf.quants.quantize(data, qt)
        raw = torch.from_numpy(np.ascontiguousarray(q).view(np.uint8))
        return cls(raw, qt, shape).to(tensor.device)

    # properties --------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def row_bytes(self) -> int:
        return self.raw.shape[-1]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return _prod(self.shape)

    @property
    def is_float(self) -> bool:
        """True for F32/F16/BF16, which are plain float arrays rather than quantized blocks."""
        return self.qtype in FLOAT_TYPES

    # conversion --------------------------------------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A new tensor of the logical shape on this QTensor's device (never aliases raw)."""
        return dequantize_flat(self.raw, self.qtype, dtype).view(self.shape)

    def to(self, device, non_blocking: bool = False) -> "QTensor":
        raw = self.raw.to(device, non_blocking=non_blocking)
        return self if raw is self.raw else QTensor(raw, self.qtype, self.shape)

    def pin_memory(self) -> "QTensor":
        """A copy in page-locked host memory (for async copies to the GPU); unchanged when there is no GPU."""
        if not torch.cuda.is_available() or self.raw.is_pinned():
            return self
        return QTensor(self.raw.pin_memory(), self.qtype, self.shape)

    def __getitem__(self, index) -> "QTensor":
        """Index (int or slice) the first dim, as a view: e.g. one expert of an [n_expert, out, in] stack."""
        if len(self.shape) < 2:
            raise IndexError("indexing a QTensor needs at least 2 dims (rows are the smallest unit)")
        if isinstance(index, slice):
            raw = self.raw[index]
            return QTensor(raw, self.qtype, (raw.shape[0], *self.shape[1:]))
        try:
            index = operator.index(index)        # ints, numpy ints, 0-d integer tensors
        except TypeError:
            raise TypeError(f"QTensor indices must be int or slice, got {type(index).__name__}") from None
        return QTensor(self.raw[index], self.qtype, self.shape[1:])

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"QTensor({self.qtype.name}, shape={self.shape}, device={self.device}, nbytes={self.nbytes})"


def _prod(shape) -> int:
    p = 1
    for s in shape:
        p *= s
    return p
