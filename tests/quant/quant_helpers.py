"""Helpers shared by the weight-format tests (imported by name: tests/conftest.py puts this folder on sys.path)."""

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES

from strata.quant import SUPPORTED_TYPES

ALL_TYPES = sorted(SUPPORTED_TYPES, key=int)


def block_len(qtype) -> int:
    """Elements per block; float formats count as blocks of 32 so shapes stay comparable."""
    return max(GGML_QUANT_SIZES[qtype][0], 32)


def assert_bits_equal(ours: torch.Tensor, ref: np.ndarray) -> None:
    """Bit-for-bit float32 equality, except that NaNs only need to be NaN in the same places."""
    ref_t = torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32))
    assert ours.dtype == torch.float32
    assert tuple(ours.shape) == tuple(ref_t.shape)
    ours = ours.cpu()
    nan = torch.isnan(ref_t)
    assert torch.equal(torch.isnan(ours), nan), "NaNs in different places"
    same = ours.view(torch.int32)[~nan] == ref_t.view(torch.int32)[~nan]
    if not bool(same.all()):
        bad = (~same).nonzero()[0].item()
        raise AssertionError(f"{int((~same).sum())} values differ; first: ours {ours[~nan][bad].item()!r} "
                             f"vs gguf-py {ref_t[~nan][bad].item()!r}")
