"""A native CPU kernel for the CPU lane: Q4_K experts read in place, int8 dot products (AVX2 where present).

torch's fused `_weight_int4pack_mm_for_cpu` reads its repacked copy at about a third of what the cores can read
(one token's GEMV: fork/join and wake-up per call dominate; measured 31 of 98 GB/s on the GPU machine's 16 cores,
5.7 of 17.8 GB/s on a 2-core machine), and it needs a second, repacked copy of every expert in RAM. This kernel
reads the GGUF blocks where they lie (the store's pinned or mapped bytes: no copy), the way llama.cpp's CPU path
does: the token's activations are quantized to int8 per 256 (one float scale per block, sums per 32), each Q4_K
row is a sum over its super-blocks of d·Σ sc_j·(q_j·x8_j) − dmin·Σ m_j·(Σ x8_j), with the 4-bit × 8-bit products
done by `maddubs`/`madd` on 32 bytes at a time. All the experts a token-layer sends to the CPU go in one call
with one OpenMP region: gate and up rows of every expert in parallel, SiLU·up, the intermediate quantized, then
the down rows — two barriers, no per-expert fork/join.

Exactness: the weights are used exactly (the Q4_K formula); the activations are rounded to int8 per 256
(relative error ~1/254 of the block's largest value), as llama.cpp does. The reference twin is
`strata.experts.resident.expert_ffn` (tests hold the two within bf16-like tolerance).

The source is compiled once per machine with the system C compiler (`cc -O3 -march=native -fopenmp`) into the
user's cache directory, atomically; without a compiler the lane keeps torch's kernels.
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

log = logging.getLogger("strata")

SOURCE = r"""
#include <stdint.h>
#include <math.h>
#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

static inline float f16(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0) {
        if (m == 0) { u = s; } else { float f = ldexpf((float)m, -24); return s ? -f : f; }
    } else if (e == 31) { u = s | 0x7f800000 | (m << 13); }
    else { u = s | ((e + 112) << 23) | (m << 13); }
    float f; __builtin_memcpy(&f, &u, 4); return f;
#endif
}

/* x[K] -> int8 per 256 (scale xd[K/256]) and sums per 32 (xs[K/32]) */
static void quantize_row(const float *x, int K, int8_t *xq, float *xd, int32_t *xs) {
    for (int b = 0; b < K / 256; b++) {
        float amax = 0.f;
        for (int i = 0; i < 256; i++) { float a = fabsf(x[b * 256 + i]); if (a > amax) amax = a; }
        float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        xd[b] = d;
        for (int j = 0; j < 8; j++) {
            int32_t s = 0;
            for (int i = 0; i < 32; i++) {
                int v = (int)lrintf(x[b * 256 + j * 32 + i] * id);
                v = v > 127 ? 127 : (v < -127 ? -127 : v);
                xq[b * 256 + j * 32 + i] = (int8_t)v;
                s += v;
            }
            xs[b * 8 + j] = s;
        }
    }
}

/* the 8 six-bit scales and 8 six-bit mins of a Q4_K super-block (12 bytes), four at a time in 32-bit words:
   sc[j] = s[j] & 63, mn[j] = s[j+4] & 63 (j < 4); sc[j+4] = (s[j+8] & 15) | (s[j] >> 6) << 4,
   mn[j+4] = (s[j+8] >> 4) | (s[j+4] >> 6) << 4 */
static inline void q4k_scales(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    uint32_t w0, w1, w2, o[4];
    __builtin_memcpy(&w0, s, 4); __builtin_memcpy(&w1, s + 4, 4); __builtin_memcpy(&w2, s + 8, 4);
    o[0] = w0 & 0x3F3F3F3Fu;
    o[1] = (w2 & 0x0F0F0F0Fu) | (((w0 >> 6) & 0x03030303u) << 4);
    o[2] = w1 & 0x3F3F3F3Fu;
    o[3] = ((w2 >> 4) & 0x0F0F0F0Fu) | (((w1 >> 6) & 0x03030303u) << 4);
    __builtin_memcpy(sc, o, 8); __builtin_memcpy(mn, o + 2, 8);
}

/* one Q4_K row (nb super-blocks of 144 bytes) . the quantized activations */
static float dot_q4k(const uint8_t *row, int nb, const int8_t *xq, const float *xd, const int32_t *xs) {
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 fsum = _mm256_setzero_ps(), fmin = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 144;
        uint8_t sc[8], mn[8];
        q4k_scales(blk + 4, sc, mn);
        const uint8_t *qs = blk + 16;
        const int8_t *q8 = xq + b * 256;
        __m256i acc = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            __m256i plo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(q8 + 64 * j)));
            __m256i phi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(q8 + 64 * j + 32)));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(plo, _mm256_set1_epi16(sc[2 * j])));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(phi, _mm256_set1_epi16(sc[2 * j + 1])));
        }
        /* mins . sums of the activations per 32, eight lanes at once */
        __m256i mprod = _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn)),
                                           _mm256_loadu_si256((const __m256i *)(xs + b * 8)));
        const float dx = f16(blk) * xd[b], mx = f16(blk + 2) * xd[b];
        fsum = _mm256_fmadd_ps(_mm256_set1_ps(dx), _mm256_cvtepi32_ps(acc), fsum);
        fmin = _mm256_fmadd_ps(_mm256_set1_ps(mx), _mm256_cvtepi32_ps(mprod), fmin);
    }
    __m256 t = _mm256_sub_ps(fsum, fmin);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
#else
    float sum = 0.f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 144;
        uint8_t sc[8], mn[8];
        q4k_scales(blk + 4, sc, mn);
        const uint8_t *qs = blk + 16;
        const int8_t *q8 = xq + b * 256;
        int32_t isum = 0, msum = 0;
        for (int j = 0; j < 4; j++) {
            int32_t dlo = 0, dhi = 0;
            for (int i = 0; i < 32; i++) {
                dlo += (qs[32 * j + i] & 0xF) * q8[64 * j + i];
                dhi += (qs[32 * j + i] >> 4) * q8[64 * j + 32 + i];
            }
            isum += sc[2 * j] * dlo + sc[2 * j + 1] * dhi;
        }
        for (int j = 0; j < 8; j++) msum += mn[j] * xs[b * 8 + j];
        sum += xd[b] * (f16(blk) * (float)isum - f16(blk + 2) * (float)msum);
    }
    return sum;
#endif
}

/* n experts, each over its own activations x[e] (d floats): out[e] (d floats) =
   down[e] . (silu(gate[e] . x) * (up[e] . x)); gate/up [ff, d/256*144], down [d, ff/256*144] bytes.
   Work space: xq n*d, xd n*d/256, xs n*d/32, h n*ff floats, hq n*ff, hd n*ff/256, hs n*ff/32. */
void strata_q4k_experts(int n, const uint8_t *const *gate, const uint8_t *const *up, const uint8_t *const *down,
                        const float *const *x, float *out, int d, int ff, int threads,
                        int8_t *xq, float *xd, int32_t *xs, float *h, int8_t *hq, float *hd, int32_t *hs) {
    const int rg = d / 256 * 144, rd = ff / 256 * 144;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int e = 0; e < n; e++)
            quantize_row(x[e], d, xq + (long)e * d, xd + (long)e * (d / 256), xs + (long)e * (d / 32));
        #pragma omp for schedule(static)
        for (long r = 0; r < (long)n * ff; r++) {
            int e = (int)(r / ff), i = (int)(r % ff);
            const int8_t *q = xq + (long)e * d;
            const float *qd = xd + (long)e * (d / 256);
            const int32_t *qsum = xs + (long)e * (d / 32);
            float g = dot_q4k(gate[e] + (long)i * rg, d / 256, q, qd, qsum);
            float u = dot_q4k(up[e] + (long)i * rg, d / 256, q, qd, qsum);
            h[r] = g / (1.f + expf(-g)) * u;
        }
        #pragma omp for schedule(static)
        for (int e = 0; e < n; e++)
            quantize_row(h + (long)e * ff, ff, hq + (long)e * ff, hd + (long)e * (ff / 256), hs + (long)e * (ff / 32));
        #pragma omp for schedule(static)
        for (long r = 0; r < (long)n * d; r++) {
            int e = (int)(r / d), i = (int)(r % d);
            out[r] = dot_q4k(down[e] + (long)i * rd, ff / 256, hq + (long)e * ff, hd + (long)e * (ff / 256),
                             hs + (long)e * (ff / 32));
        }
    }
}
"""

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_lib = None
_tried = False
_lock = threading.Lock()


def _cache_dir() -> pathlib.Path:
    from strata.experts.costs import cache_dir

    return cache_dir() / "native"


def load() -> ctypes.CDLL | None:
    """The compiled kernel library (built on first use, cached per source and flags), None without a compiler."""
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if cc is None:
            log.info("strata: no C compiler found; the CPU lane uses torch's kernels")
            return None
        tag = hashlib.sha256((SOURCE + " ".join(FLAGS) + cc).encode()).hexdigest()[:16]
        path = _cache_dir() / f"q4k-{tag}.so"
        try:
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                    src = pathlib.Path(tmp) / "q4k.c"
                    src.write_text(SOURCE)
                    so = pathlib.Path(tmp) / "q4k.so"
                    r = subprocess.run([cc, *FLAGS, str(src), "-o", str(so), "-lm"], capture_output=True, text=True,
                                       timeout=120)
                    if r.returncode != 0:
                        log.warning("strata: building the native CPU kernel failed (%s); the CPU lane uses torch's "
                                    "kernels", r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode)
                        return None
                    os.replace(so, path)  # atomic: a concurrent build leaves one complete file
            lib = ctypes.CDLL(str(path))
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("strata: the native CPU kernel is unavailable (%s); the CPU lane uses torch's kernels", e)
            return None
        f = lib.strata_q4k_experts
        P = ctypes.c_void_p
        f.argtypes = [ctypes.c_int, P, P, P, P, P, ctypes.c_int, ctypes.c_int, ctypes.c_int, P, P, P, P, P, P, P]
        f.restype = None
        _lib = lib
        return lib


class Q4KExperts:
    """Calls of the native kernel for one layer's Q4_K experts (gate/up [E, ff, d/256*144], down [E, d, ...])."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, threads: int | None = None):
        lib = load()
        if lib is None:
            raise RuntimeError("the native CPU kernel is unavailable")
        for t in (gate, up, down):
            if t.dtype != torch.uint8 or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("the native kernel reads contiguous uint8 host blocks")
        self._f = lib.strata_q4k_experts
        self.gate, self.up, self.down = gate, up, down  # kept alive: the kernel reads their memory
        self.E, self.ff = gate.shape[0], gate.shape[1]
        self.d = down.shape[1]
        self.threads = threads  # None: torch's intra-op thread count at each call (--cpu-threads sets it)
        self._ws: dict[int, tuple[list[torch.Tensor], list[int]]] = {}
        E = np.arange(self.E, dtype=np.int64)
        self._addr = np.stack([t.data_ptr() + E * t.stride(0) for t in (gate, up, down)])  # [3, E] expert addresses

    def _work(self, n: int) -> list[int]:
        """Addresses of the kernel's scratch buffers for n rows (kept per n: decode reuses a few sizes)."""
        ws = self._ws.get(n)
        if ws is None:
            d, ff = self.d, self.ff
            bufs = [torch.empty(n * d, dtype=torch.int8), torch.empty(n * d // 256),
                    torch.empty(n * d // 32, dtype=torch.int32), torch.empty(n * ff),
                    torch.empty(n * ff, dtype=torch.int8), torch.empty(n * ff // 256),
                    torch.empty(n * ff // 32, dtype=torch.int32)]
            ws = self._ws[n] = (bufs, [b.data_ptr() for b in bufs])
        return ws[1]

    def __call__(self, experts, x: torch.Tensor, rows=None) -> torch.Tensor:
        """experts [n]; x [m, d]; rows [n] (default 0..n-1): output row i is x[rows[i]] through experts[i] ->
        [n, d] float32. (One token through several experts: m = 1, rows all 0 — the row is not copied.)"""
        ex = np.asarray(experts, dtype=np.int64).reshape(-1)
        n = ex.size
        x = x.to(torch.float32)
        if not x.is_contiguous():
            x = x.contiguous()
        r = np.arange(n, dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64).reshape(-1)
        if x.dim() != 2 or x.shape[1] != self.d or r.size != n or (n and (r.min() < 0 or r.max() >= x.shape[0])):
            raise ValueError(f"x must be [m, {self.d}] with a row for each of the {n} experts, got {list(x.shape)}")
        if n and (ex.min() < 0 or ex.max() >= self.E):
            raise ValueError(f"expert ids out of range 0..{self.E - 1}: {ex.tolist()}")
        out = torch.empty(n, self.d)
        if n == 0:
            return out
        # one int64 table of addresses: gate, up, down rows of each expert, then each output row's input row
        tab = np.concatenate([self._addr[:, ex].reshape(-1), x.data_ptr() + r * (self.d * 4)])
        base, step = tab.ctypes.data, n * 8
        threads = max(1, self.threads or torch.get_num_threads())
        self._f(n, base, base + step, base + 2 * step, base + 3 * step, out.data_ptr(), self.d, self.ff, threads,
                *self._work(n))
        return out
