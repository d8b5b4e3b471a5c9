"""The CPU kernel of op `rows_attention`: a decode or speculative verify step's few queries of one sequence, query j
over the sequence's keys 0 .. start + j, in one call of the native library (strata.ops.cpu_native's build;
the C source is cpu_native_attn.h).

SDPA called once per query (the reference twin) reads every key and value row once per query: a verify step of 4
tokens over a long prefix read its KV 4 times. The kernel reads each row once for all of them, and a query's
result is the same bits whatever the number of queries beside it (fixed key chunks merged in order), so a verify
step still gives each token what a one-token step gives it. Taken for float32 queries and caches whose rows are
contiguous, outside `strata.quant.matmul.cpu_exact()` (the tests against float oracles keep SDPA)."""

from __future__ import annotations

import ctypes
import threading

import torch

from strata.ops import cpu_native, registry
from strata.quant import matmul

MAX_ROWS = matmul.CPU_ROWS_ALONE  # the queries a call takes (a prompt chunk past it is one SDPA call)
_ready = False
_tls = threading.local()  # each thread's scratch (the engine's and the CPU lane's threads may both attend)


def _lib() -> ctypes.CDLL | None:
    global _ready
    lib = cpu_native.load()
    if lib is None or _ready:
        return lib
    P, I, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.strata_attn_rows.argtypes = [I, I, I, I, I, P, P, P, L, L, L, L, I, ctypes.c_float, P, I, P]
    lib.strata_attn_rows.restype = I
    lib.strata_attn_rows_scratch.argtypes = [I, I, I, I, I, I]
    lib.strata_attn_rows_scratch.restype = L
    _ready = True
    return lib


def _takes(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, start: int, scale: float) -> bool:
    return (q.device.type == "cpu" and q.dtype == ks.dtype == vs.dtype == torch.float32 and q.dim() == 3
            and ks.dim() == 3 and 1 <= q.shape[0] <= MAX_ROWS and q.shape[1] % ks.shape[1] == 0
            and ks.shape[0] >= start + q.shape[0] and ks.stride(-1) == 1 and vs.stride(-1) == 1
            and not matmul.cpu_exact() and _lib() is not None)


def _scratch(nbytes: int) -> torch.Tensor:
    ws = getattr(_tls, "ws", None)
    if ws is None or ws.numel() < nbytes:
        ws = _tls.ws = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
    return ws


def rows_attention(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q [n, H, D]; ks [L, Hkv, D], vs [L, Hkv, Dv] (views of a slot's cache, L >= start + n) -> [n, H, Dv]."""
    lib = _lib()
    n, H, D = q.shape
    hkv, dv = ks.shape[1], vs.shape[2]
    q = q.contiguous()
    out = torch.empty(n, H, dv)
    threads = max(1, torch.get_num_threads())
    ws = _scratch(int(lib.strata_attn_rows_scratch(n, H, hkv, dv, int(start), threads)))
    rc = lib.strata_attn_rows(n, H, hkv, D, dv, q.data_ptr(), ks.data_ptr(), vs.data_ptr(), ks.stride(0),
                              ks.stride(1), vs.stride(0), vs.stride(1), int(start), float(scale), out.data_ptr(),
                              threads, ws.data_ptr())
    if rc:
        raise ValueError(f"the native attention refused q {list(q.shape)}, keys {list(ks.shape)}")
    return out


registry.op("rows_attention").register("cpu_native", rows_attention, _takes)
