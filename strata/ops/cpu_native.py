"""A native CPU kernel for the CPU lane: Q4_K / Q6_K / Q8_0 experts read in place, int8 dot products (AVX2).

The C source is `cpu_native.c` beside this file, with the IQ2_XXS / IQ3_XXS dot products in `cpu_native_iq.h`, IQ2_S's
in `cpu_native_iq2s.h`, IQ2_XS / IQ3_S / IQ1_S / IQ1_M in `cpu_native_iqx.h`, Q2_K / Q3_K in `cpu_native_kq.h`, the Q5_K / MXFP4 ones in
`cpu_native_fmt.h`, Q4_0 / Q4_1 / Q5_0 / Q5_1 in `cpu_native_q32.h`, Q8_0's and several rows of x against Q4_K / Q6_K / Q8_0 in
`cpu_native_rows.h` (included: one compilation unit). torch's fused `_weight_int4pack_mm_for_cpu` reads its repacked
copy well below what the cores can read (one token's GEMV: fork/join and wake-up per call dominate; the measured
rates are in docs/BENCHMARKS.md), and it needs a second, repacked copy of every expert in RAM. This kernel
reads the GGUF blocks where they lie (the store's pinned or mapped bytes: no copy), the way llama.cpp's CPU path
does: the token's activations are quantized to int8 per 256 (one float scale per block, sums per 32), each Q4_K
row is a sum over its super-blocks of d·Σ sc_j·(q_j·x8_j) − dmin·Σ m_j·(Σ x8_j), with the 4-bit × 8-bit products
done by `maddubs`/`madd` on 32 bytes at a time; Q6_K (the down projections of Q4_K_M files) likewise per 16
weights, and Q8_0 per 32 (signed × signed through the sign trick). All the experts a token-layer sends to the CPU go in one call
with one OpenMP region: gate and up rows of every expert in parallel, SiLU·up, the intermediate quantized, then
the down rows — two barriers, no per-expert fork/join. Experts with biases (gate and up before the activation,
down after) and gpt-oss's clamped SwiGLU (`act="swiglu_oai"`) take the same call; so do rows whose length is a
multiple of 32 but not of 256 (gpt-oss's 2880) in the 32-wide formats (Q8_0, MXFP4): the activations' last
block is then partial, with its own scale.

Exactness: the weights are used exactly (the Q4_K formula); the activations are rounded to int8 per 256
(relative error ~1/254 of the block's largest value), as llama.cpp does. The reference twin is
`strata.ops.reference.expert_ffn` (tests hold the two within bf16-like tolerance).

The build is one declared step, `build()`: the system C compiler (`cc -O3 -march=native -fopenmp`) compiles the
source into the user's cache directory, atomically, keyed by the source, the flags and the compiler (a cached
build is reused). It runs on first use (`load()`), or ahead of time with `python -m strata.ops.cpu_native`.
Without a compiler the lane keeps torch's kernels; `unavailable()` says why in one line.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading

import numpy as np
import torch

from strata.config import c_compiler

log = logging.getLogger("strata")

SOURCE_FILE = pathlib.Path(__file__).with_name("cpu_native.c")  # shipped as package data (pyproject.toml)
# the headers it includes, likewise
HEADER_FILES = tuple(SOURCE_FILE.with_name(h) for h in (
    "cpu_native_iq4.h", "cpu_native_iq.h", "cpu_native_iq2s.h", "cpu_native_iqx.h", "cpu_native_fmt.h",
    "cpu_native_rows.h", "cpu_native_kq.h", "cpu_native_q32.h", "cpu_native_attn.h",
    "cpu_native_norm.h"))

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_lib = None
_tried = False
_why = ""  # why the kernel is unavailable (one line), "" while it is or before the first load
_lock = threading.Lock()


def source() -> str:
    """The kernel's C source."""
    return SOURCE_FILE.read_text(encoding="utf-8")


def headers() -> dict[str, str]:
    """The headers the source includes, by file name: the build writes them beside the source it compiles."""
    return {h.name: h.read_text(encoding="utf-8") for h in HEADER_FILES}


def _cache_dir() -> pathlib.Path:
    from strata.config import cache_dir

    return cache_dir() / "native"


def build(flags: list[str] | None = None) -> ctypes.CDLL | None:
    """Compile the kernel with `flags` (default FLAGS) into the cache, or reuse the cached build; None (and one
    warning line) when there is no compiler or the build fails. A cache that cannot be written (read-only, full)
    gets a build for this process alone, in a temporary directory."""
    global _why
    flags = FLAGS if flags is None else flags
    cc = shutil.which(c_compiler()) or shutil.which("gcc")
    if cc is None:
        _why = "no C compiler found (install cc or gcc, or set CC)"
        log.warning("strata: %s; the CPU lane uses torch's kernels", _why)
        return None
    code, hdrs = source(), headers()
    # a changed header changes the build as much as a changed source
    tag = hashlib.sha256((code + "".join(hdrs.values()) + " ".join(flags) + cc).encode()).hexdigest()[:16]
    path = _cache_dir() / f"experts-{tag}.so"
    try:
        try:
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                _compile(cc, flags, code, hdrs, path)
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            if path.exists():  # (a build that does not load: no other build would)
                raise
            lib = _build_for_this_run(cc, flags, code, hdrs)
            log.warning("strata: cannot keep the native CPU kernel's build in %s (%s): built for this run only "
                        "(STRATA_CACHE_DIR names a writable cache)", path.parent, e.strerror or e)
    except _BuildFailed as e:
        _why = f"building {SOURCE_FILE.name} with {cc} failed ({e})"
        log.warning("strata: %s; the CPU lane uses torch's kernels", _why)
        return None
    except (OSError, subprocess.SubprocessError) as e:
        _why = f"the native CPU kernel is unavailable ({e})"
        log.warning("strata: %s; the CPU lane uses torch's kernels", _why)
        return None
    f = lib.strata_native_experts
    P, I = ctypes.c_void_p, ctypes.c_int
    f.argtypes = [I, P, P, P, P, P, I, I, I, I, I, I, P, P, P, P, I, ctypes.c_float, ctypes.c_float]
    f.restype = I
    lib.strata_native_scratch.argtypes = [I, I, I]
    lib.strata_native_scratch.restype = ctypes.c_long
    lib.strata_native_gemv.argtypes = [I, P, I, I, I, P, P, I, P]
    lib.strata_native_gemv.restype = I
    lib.strata_native_gemv_scratch.argtypes = [I, I]
    lib.strata_native_gemv_scratch.restype = ctypes.c_long
    lib.strata_native_tables.argtypes = [P, P, P, P]
    lib.strata_native_tables.restype = None
    lib.strata_native_tables_x.argtypes = [P, P, P]
    lib.strata_native_tables_x.restype = None
    _set_tables(lib)  # every build (the portable one of the tests too) gets the i-quant tables
    return lib


class _BuildFailed(Exception):
    """The compiler ran and refused the source (its last line of errors)."""


def _compile(cc: str, flags: list[str], code: str, hdrs: dict[str, str], out: pathlib.Path) -> None:
    """The kernel compiled into `out`, atomically (a concurrent build leaves one complete file)."""
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = pathlib.Path(tmp) / "experts.c"
        src.write_text(code)
        for name, text in hdrs.items():  # #include "..." resolves beside the source
            (pathlib.Path(tmp) / name).write_text(text)
        so = pathlib.Path(tmp) / "experts.so"
        r = subprocess.run([cc, *flags, str(src), "-o", str(so), "-lm"], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise _BuildFailed(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode)
        os.replace(so, out)


def _build_for_this_run(cc: str, flags: list[str], code: str, hdrs: dict[str, str]) -> ctypes.CDLL:
    """A build in a temporary directory, removed once loaded (the loaded library stays mapped)."""
    with tempfile.TemporaryDirectory(prefix="strata-native-") as tmp:
        out = pathlib.Path(tmp) / "experts.so"
        _compile(cc, flags, code, hdrs, out)
        return ctypes.CDLL(str(out))


def unavailable() -> str:
    """Why `load()` gave None, in one line ('' when the kernel loaded)."""
    load()
    return _why


def load() -> ctypes.CDLL | None:
    """The kernel library for this machine (built on first use, cached per source and flags), None without a
    compiler."""
    global _lib, _tried
    with _lock:
        if not _tried:
            _tried = True
            _lib = build()
        return _lib


_TABLES: list = []  # the arrays the kernel's tables were filled from (kept for the process's life)


def _set_tables(lib: ctypes.CDLL) -> None:
    """The i-quant grids and sign table, from gguf-py (the reference dequantizer's own): the kernel copies them."""
    import numpy as np
    from gguf.quants import IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS

    for cls in (IQ2_XXS, IQ3_XXS, IQ2_S, IQ2_XS, IQ3_S, IQ1_S):
        cls.init_grid()
    g2 = np.ascontiguousarray(IQ2_XXS.grid.reshape(256, 8), dtype=np.uint8)
    g3 = np.ascontiguousarray(IQ3_XXS.grid.reshape(256, 4), dtype=np.uint8)
    signs = np.frombuffer(IQ2_XXS.ksigns, dtype=np.uint8).copy()
    g2s = np.ascontiguousarray(IQ2_S.grid.reshape(1024, 8), dtype=np.uint8)
    g2x = np.ascontiguousarray(IQ2_XS.grid.reshape(512, 8), dtype=np.uint8)
    g3s = np.ascontiguousarray(IQ3_S.grid.reshape(512, 4), dtype=np.uint8)
    g1 = np.ascontiguousarray(IQ1_S.grid.reshape(2048, 8), dtype=np.int8)  # (IQ1_M's grid is the same)
    _TABLES[:] = [g2, g3, signs, g2s, g2x, g3s, g1]
    ptr = [ctypes.c_void_p(a.ctypes.data) for a in _TABLES]
    lib.strata_native_tables(*ptr[:4])
    lib.strata_native_tables_x(*ptr[4:])


# the kernel's format codes (FMT_Q4K, ..., FMT_MXFP4, FMT_IQ2S, FMT_IQ4NL, FMT_Q2K, FMT_Q3K, FMT_IQ2XS, ...)
FORMATS = {"Q4_K": 0, "Q6_K": 1, "Q8_0": 2, "IQ4_XS": 3, "IQ2_XXS": 4, "IQ3_XXS": 5, "Q5_K": 6, "MXFP4": 7, "IQ2_S": 8,
           "IQ4_NL": 9, "Q2_K": 10, "Q3_K": 11, "IQ2_XS": 12, "IQ3_S": 13, "IQ1_S": 14, "IQ1_M": 15, "Q4_0": 16,
           "Q4_1": 17, "Q5_0": 18, "Q5_1": 19, "TQ2_0": 20, "TQ1_0": 21}
# the weights a block spans (the kernel's fmt_width): a row's length must be a multiple of it. The activations are
# quantized per 256 with a partial last block, which only the 32-wide formats' dot products can read.
WIDTHS = {f: 32 if f in ("Q8_0", "MXFP4", "IQ4_NL", "Q4_0", "Q4_1", "Q5_0", "Q5_1") else 256 for f in FORMATS}
# the gated activations (ACT_SWIGLU, ACT_OAI): plain SwiGLU, and gpt-oss's clamped one with its alpha and limit
ACTS = {"swiglu": 0, "swiglu_oai": 1}


class NativeExperts:
    """Calls of the native kernel for one layer's experts: gate/up raw blocks [E, ff, ...] and down [E, d, ...],
    each projection in one of FORMATS (`fmt_gate_up`, `fmt_down`: its names; `fmt_up` where up's differs from gate's).
    `act` one of ACTS (with `alpha` and
    `limit` for swiglu_oai); `gate_b`, `up_b` [E, ff] and `down_b` [E, d]: per-expert biases, or None."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, threads: int | None = None, *,
                 fmt_gate_up: str = "Q4_K", fmt_down: str = "Q4_K", lib: ctypes.CDLL | None = None,
                 act: str = "swiglu", alpha: float = 1.702, limit: float = 7.0, gate_b: torch.Tensor | None = None,
                 up_b: torch.Tensor | None = None, down_b: torch.Tensor | None = None, fmt_up: str | None = None):
        lib = lib or load()
        if lib is None:
            raise RuntimeError("the native CPU kernel is unavailable")
        for t in (gate, up, down):
            if t.dtype != torch.uint8 or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("the native kernel reads contiguous uint8 host blocks")
        self._f, self._scratch = lib.strata_native_experts, lib.strata_native_scratch
        self.gate, self.up, self.down = gate, up, down  # kept alive: the kernel reads their memory
        self.E, self.ff = gate.shape[0], gate.shape[1]
        self.d = down.shape[1]
        fmt_up = fmt_up or fmt_gate_up
        self.fg, self.fu, self.fdn = FORMATS[fmt_gate_up], FORMATS[fmt_up], FORMATS[fmt_down]
        wgu, wdn = max(WIDTHS[fmt_gate_up], WIDTHS[fmt_up]), WIDTHS[fmt_down]
        if self.d % wgu or self.ff % wdn:
            raise ValueError(f"the native kernel needs rows whose lengths are multiples of their format's block "
                             f"({fmt_gate_up}: {wgu}, {fmt_down}: {wdn}), got d {self.d}, ff {self.ff}")
        if act not in ACTS:
            raise ValueError(f"the native kernel's activations are {', '.join(ACTS)}, got {act!r}")
        self.act, self.alpha, self.limit = ACTS[act], float(alpha), float(limit)
        self.threads = threads  # None: torch's intra-op thread count at each call (--cpu-threads sets it)
        self._ws: dict[int, torch.Tensor] = {}
        # each expert's gate, up and down addresses as Python ints: a decode call has a few experts, and filling
        # its address table from lists costs a microsecond where numpy's indexing and checks cost tens
        self._ga, self._ua, self._da = ([t.data_ptr() + e * t.stride(0) for e in range(self.E)] for t in (gate, up, down))
        # the biases as float32 host rows (kept alive: the kernel reads them), each expert's row address, or None
        self._bias, self._ba = [], []
        for b, width in ((gate_b, self.ff), (up_b, self.ff), (down_b, self.d)):
            if b is not None:
                b = b.detach().to("cpu", torch.float32).contiguous()
                if tuple(b.shape) != (self.E, width):
                    raise ValueError(f"a bias must be [{self.E}, {width}], got {list(b.shape)}")
                self._bias.append(b)
            self._ba.append(None if b is None else [b.data_ptr() + e * width * 4 for e in range(self.E)])
        self._tabs: dict[int, tuple[np.ndarray, int]] = {}  # n -> (int64 address table [7n], its address)

    def _work(self, n: int) -> int:
        """Address of the kernel's scratch for n rows (kept per n: decode reuses a few sizes)."""
        ws = self._ws.get(n)
        if ws is None:
            ws = self._ws[n] = torch.empty(int(self._scratch(n, self.d, self.ff)) + 64, dtype=torch.uint8)
        return ws.data_ptr()

    def __call__(self, experts, x: torch.Tensor, rows=None) -> torch.Tensor:
        """experts [n]; x [m, d]; rows [n] (default 0..n-1): output row i is x[rows[i]] through experts[i] ->
        [n, d] float32. (One token through several experts: m = 1, rows all 0 — the row is not copied.)
        Plain Python on the ids: this runs per token-layer in decode, where the call's own cost counts."""
        ex = experts.tolist() if hasattr(experts, "tolist") else list(experts)
        ex = ex if isinstance(ex, list) else [ex]
        n = len(ex)
        if x.dtype != torch.float32:
            x = x.float()
        if not x.is_contiguous():
            x = x.contiguous()
        if rows is None:
            r = list(range(n))
        else:
            r = rows.tolist() if hasattr(rows, "tolist") else list(rows)
            r = r if isinstance(r, list) else [r]
        if x.dim() != 2 or x.shape[1] != self.d or len(r) != n or (n and (min(r) < 0 or max(r) >= x.shape[0])):
            raise ValueError(f"x must be [m, {self.d}] with a row for each of the {n} experts, got {list(x.shape)}")
        if n and (min(ex) < 0 or max(ex) >= self.E):
            raise ValueError(f"expert ids out of range 0..{self.E - 1}: {ex}")
        out = torch.empty(n, self.d)
        if n == 0:
            return out
        got = self._tabs.get(n)
        if got is None:
            arr = np.zeros(7 * n, dtype=np.int64)
            got = self._tabs[n] = (arr, arr.ctypes.data)
        tab, base = got
        # one int64 table of addresses: gate, up, down rows of each expert, each output row's input row, then the
        # experts' gate, up and down bias rows (those the layer has)
        xp, xs = x.data_ptr(), self.d * 4
        ga, ua, da = self._ga, self._ua, self._da
        tab[:4 * n] = [ga[e] for e in ex] + [ua[e] for e in ex] + [da[e] for e in ex] + [xp + i * xs for i in r]
        step = n * 8
        bias = [None, None, None]
        for j, ba in enumerate(self._ba):
            if ba is not None:
                tab[(4 + j) * n:(5 + j) * n] = [ba[e] for e in ex]
                bias[j] = base + (4 + j) * step
        threads = max(1, self.threads or torch.get_num_threads())
        rc = self._f(n, base, base + step, base + 2 * step, base + 3 * step, out.data_ptr(), self.d, self.ff,
                     self.fg, self.fu, self.fdn, threads, self._work(n), *bias, self.act, self.alpha, self.limit)
        if rc:
            raise ValueError(f"the native kernel refused d {self.d}, ff {self.ff} for formats "
                             f"{self.fg}/{self.fu}/{self.fdn}")
        return out


if __name__ == "__main__":  # the build step, ahead of first use: python -m strata.ops.cpu_native
    import sys

    sys.exit(0 if load() is not None else f"strata: {unavailable()}")
