"""CPU kernels of ops `qk_norm_rope` and `silu_mul` (the native library's, source cpu_native_norm.h): the CPU twins
of strata.ops.fused's Triton kernels. A decode or verify step on the CPU ran 5-25 torch operators for each of
these on rows of a few hundred floats, their dispatch the whole cost (the q/k norm with the rotary took about as
long as the step's attention over a 1K-token prefix); each is one call here. (RMSNorm stays torch's: a native one
saved 2 us a call, and its last-bit differences from ggml's, where torch's match them, tipped int8 roundings of the
activations in the llama.cpp oracle's emulation, tests/oracle/test_llamacpp.py.) `silu_mul` is here for its bits more than its speed:
torch's silu is batch-variant on the CPU (the elements past a multiple of its vector width take another exp), so
an expert of an odd width gave a token other bits in a verify step than in its own.
Taken for float32 rows on the CPU however many (a prompt chunk's too: a short prompt sharing a chunk with a long
one must get the bits it gets alone, so a row's path cannot depend on the chunk's size); rows are independent, so
a row's result does not depend on the rows beside it."""

from __future__ import annotations

import ctypes

import torch

from strata.ops import cpu_native, registry

MAX_ROTARY = 512  # the rotated width the kernel's row buffer holds
_ready = False


def _lib() -> ctypes.CDLL | None:
    global _ready
    lib = cpu_native.load()
    if lib is None or _ready:
        return lib
    P, I, L, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
    lib.strata_qk_norm_rope.argtypes = [I, I, I, I, I, I, P, L, P, L, P, P, P, P, P, F, P, P]
    lib.strata_qk_norm_rope.restype = None
    lib.strata_silu_mul.argtypes = [I, I, P, L, P, L, P]
    lib.strata_silu_mul.restype = None
    _ready = True
    return lib


def _f32(*ts) -> bool:
    return all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu") for t in ts)


def _heads(t: torch.Tensor) -> bool:
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def _qk_takes(q, k, pos, cos_t, sin_t, dim, neox, q_norm=None, k_norm=None, eps=0.0) -> bool:
    return (_f32(q, k, cos_t, sin_t, q_norm, k_norm) and _heads(q) and (k is None or (_heads(k) and
            k.shape[0] == q.shape[0] and k.shape[2] == q.shape[2]))
            and (q_norm is None or k is None or k_norm is not None) and dim % 2 == 0
            and 0 < dim <= min(q.shape[2], MAX_ROTARY)
            and pos.dtype == torch.int64 and pos.device.type == "cpu" and pos.dim() == 1 and pos.numel() == q.shape[0]
            and cos_t.is_contiguous() and sin_t.is_contiguous() and cos_t.shape[-1] == dim // 2
            and all(w is None or (w.is_contiguous() and w.numel() == q.shape[2]) for w in (q_norm, k_norm))
            and _lib() is not None)


def qk_norm_rope(q, k, pos, cos_t, sin_t, dim, neox, q_norm=None, k_norm=None, eps=0.0):
    n, hq, D = q.shape
    hk = k.shape[1] if k is not None else 0
    qo = torch.empty(n, hq, D)
    ko = torch.empty(n, hk, D) if k is not None else None
    pos = pos.contiguous()
    if n and (int(pos.min()) < 0 or int(pos.max()) >= cos_t.shape[0]):
        raise IndexError(f"rotary position out of the table's {cos_t.shape[0]} rows")
    _lib().strata_qk_norm_rope(n, hq, hk, D, int(dim), int(bool(neox)), q.data_ptr(), q.stride(0),
                               k.data_ptr() if k is not None else None, k.stride(0) if k is not None else 0,
                               pos.data_ptr(), cos_t.data_ptr(), sin_t.data_ptr(),
                               q_norm.data_ptr() if q_norm is not None else None,
                               k_norm.data_ptr() if q_norm is not None and k is not None else None, float(eps),
                               qo.data_ptr(), ko.data_ptr() if ko is not None else None)
    return qo, ko


def _silu_takes(g, u) -> bool:
    return (g.dtype == torch.float32 and u.dtype == torch.float32 and g.device.type == "cpu" and g.dim() == 2
            and g.shape == u.shape and g.stride(-1) == 1 and u.stride(-1) == 1 and _lib() is not None)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    out = torch.empty(g.shape)
    _lib().strata_silu_mul(g.shape[0], g.shape[1], g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0),
                           out.data_ptr())
    return out


registry.op("silu_mul").register("cpu_native", silu_mul, _silu_takes)
registry.op("qk_norm_rope").register("cpu_native", qk_norm_rope, _qk_takes)
