
#include <stdint.h>
#include <math.h>
#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* Software prefetch of the block STRATA_PF rows ahead (rows of a projection are contiguous; a thread walks its
   rows in order): the hardware prefetcher alone left one core reading a Q4_K expert at 6.5 GB/s of the 11-14 it
   can; two rows ahead gave +10-15% on a development machine. Prefetches never fault past the end. */
#ifndef STRATA_PF
#define STRATA_PF 2
#endif
#define PREFETCH_AHEAD(blk, row_bytes, blk_bytes) do { \
        const uint8_t *pf_ = (blk) + (long)STRATA_PF * (row_bytes); \
        for (int o_ = 0; o_ < (blk_bytes); o_ += 64) __builtin_prefetch(pf_ + o_, 0, 0); \
    } while (0)

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

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum8(__m256 v) {  /* the sum of 8 floats */
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* for formats of 32-weight blocks, eight blocks (one 256-block of activations) at a time: lane k of the result is
   the sum of p[k]'s 8 int32 lanes (two rounds of pairwise adds within 128-bit halves, then the halves) */
static inline __m256i sum8x8(const __m256i *p) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    const __m256i c = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, c, 0x20), _mm256_permute2x128_si256(a, c, 0x31));
}

static inline short h16at(const uint8_t *p) { short v; __builtin_memcpy(&v, p, 2); return v; }

/* the f16 at byte off of eight consecutive blocks of `size` bytes, as floats (put together in a register: a vector
   load of values stored one by one would wait on those stores) */
static inline __m256 f16x8(const uint8_t *b0, int size, int off) {
    return _mm256_cvtph_ps(_mm_setr_epi16(h16at(b0 + off), h16at(b0 + size + off), h16at(b0 + 2 * size + off),
                                          h16at(b0 + 3 * size + off), h16at(b0 + 4 * size + off),
                                          h16at(b0 + 5 * size + off), h16at(b0 + 6 * size + off),
                                          h16at(b0 + 7 * size + off)));
}
#endif

/* x[K] -> int8 per 256 (scale xd[NB256(K)]), sums per 32 (xs[K/32]) and per 16 (x16[K/16]). K is a multiple of 32:
   where it is not one of 256 the last block is partial (len < 256, its own scale), which only the formats of
   32-wide blocks read (their dot products walk K/32 blocks); a format of 256-wide blocks needs whole ones. */
#define NB256(K) (((K) + 255) / 256)
static inline __attribute__((always_inline)) void quantize_block(const float *x, int len, int8_t *xq, float *xd,
                                                                 int32_t *xs, int32_t *x16) {
#if defined(__AVX2__)
    /* the loop below's values exactly, 32 at a time (its lrintf a value was a visible share of a small expert's
       call): the max |x| (a NaN skipped), x * id rounded to nearest even (the default rounding, lrintf's), a NaN
       product as 0 (as lrintf's result cast), clamped */
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < len; i += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), abs), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    *xd = amax / 127.f;
    for (int j = 0; j < len / 32; j++) {
        __m256i v[4];
        for (int k = 0; k < 4; k++) {
            __m256 y = _mm256_mul_ps(_mm256_loadu_ps(x + 32 * j + 8 * k), _mm256_set1_ps(id));
            y = _mm256_and_ps(y, _mm256_cmp_ps(y, y, _CMP_ORD_Q));
            v[k] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(y), _mm256_set1_epi32(127)),
                                    _mm256_set1_epi32(-127));
        }
        /* the packs interleave 128-bit halves (4-byte units v0 lo, v1 lo, .., v3 hi); the permute restores order */
        const __m256i q = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256((__m256i *)(xq + 32 * j),
                            _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        for (int k = 0; k < 2; k++) {
            const __m256i s = _mm256_add_epi32(v[2 * k], v[2 * k + 1]);
            __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            t = _mm_hadd_epi32(t, t);
            x16[2 * j + k] = _mm_cvtsi128_si32(_mm_hadd_epi32(t, t));
        }
        xs[j] = x16[2 * j] + x16[2 * j + 1];
    }
#else
    float amax = 0.f;
    for (int i = 0; i < len; i++) { float a = fabsf(x[i]); if (a > amax) amax = a; }
    float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    *xd = d;
    for (int j = 0; j < len / 16; j++) {
        int32_t s = 0;
        for (int i = 0; i < 16; i++) {
            int v = (int)lrintf(x[j * 16 + i] * id);
            v = v > 127 ? 127 : (v < -127 ? -127 : v);
            xq[j * 16 + i] = (int8_t)v;
            s += v;
        }
        x16[j] = s;
    }
    for (int j = 0; j < len / 32; j++) xs[j] = x16[2 * j] + x16[2 * j + 1];
#endif
}

static void quantize_row(const float *x, int K, int8_t *xq, float *xd, int32_t *xs, int32_t *x16) {
    int b = 0;
    for (; b < K / 256; b++)  /* whole blocks: the length a constant the compiler unrolls for */
        quantize_block(x + b * 256, 256, xq + b * 256, xd + b, xs + b * 8, x16 + b * 16);
    if (K % 256) quantize_block(x + b * 256, K % 256, xq + b * 256, xd + b, xs + b * 8, x16 + b * 16);
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

#if defined(__AVX2__)
/* q4k_scales' 8 mins as the low 8 bytes of a vector, built in registers (reading the mn array back as one 8-byte
   load would wait on the two 4-byte stores that wrote it: no store forwarding) */
static inline __m128i q4k_mins_v(const uint8_t *s) {
    uint32_t w1, w2;
    __builtin_memcpy(&w1, s + 4, 4); __builtin_memcpy(&w2, s + 8, 4);
    const uint64_t lo = w1 & 0x3F3F3F3Fu, hi = ((w2 >> 4) & 0x0F0F0F0Fu) | (((w1 >> 6) & 0x03030303u) << 4);
    return _mm_cvtsi64_si128((long long)(lo | (hi << 32)));
}
#endif

/* one Q4_K row (nb super-blocks of 144 bytes) . the quantized activations */
static float dot_q4k(const uint8_t *row, int nb, const int8_t *xq, const float *xd, const int32_t *xs) {
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 fsum = _mm256_setzero_ps(), fmin = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 144;
        PREFETCH_AHEAD(blk, nb * 144, 144);
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
        __m256i mprod = _mm256_mullo_epi32(_mm256_cvtepu8_epi32(q4k_mins_v(blk + 4)),
                                           _mm256_loadu_si256((const __m256i *)(xs + b * 8)));
        const float dx = f16(blk) * xd[b], mx = f16(blk + 2) * xd[b];
        fsum = _mm256_fmadd_ps(_mm256_set1_ps(dx), _mm256_cvtepi32_ps(acc), fsum);
        fmin = _mm256_fmadd_ps(_mm256_set1_ps(mx), _mm256_cvtepi32_ps(mprod), fmin);
    }
    return hsum8(_mm256_sub_ps(fsum, fmin));
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

/* one Q6_K row (nb super-blocks of 210 bytes: ql[128], qh[64], int8 scales[16], d f16):
   w = d * sc[g] * (q - 32) with q = 4 low bits from ql | 2 high bits from qh; per half of 128 weights, byte l of
   ql/qh feeds weights l, l+32, l+64, l+96 (low nibble / bits 0-1, ...), and group g covers weights 16g..16g+15 */
static float dot_q6k(const uint8_t *row, int nb, const int8_t *xq, const float *xd, const int32_t *x16) {
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
    __m256 fsum = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 210;
        PREFETCH_AHEAD(blk, nb * 210, 210);
        const int8_t *sc = (const int8_t *)(blk + 192);
        __m256i acc = _mm256_setzero_si256();
        for (int n = 0; n < 2; n++) {
            const uint8_t *ql = blk + 64 * n, *qhp = blk + 128 + 32 * n;
            const int8_t *x = xq + b * 256 + 128 * n;
            const int8_t *s8 = sc + 8 * n;
            __m256i l0 = _mm256_loadu_si256((const __m256i *)ql), l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)qhp);
            /* the four quarters' 6-bit values (weights l, l+32, l+64, l+96 of this half, l = 0..31) */
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4));
            for (int k = 0; k < 4; k++) {
                __m256i p = _mm256_maddubs_epi16(q[k], _mm256_loadu_si256((const __m256i *)(x + 32 * k)));
                /* int16 lanes 0-7 hold weights 0..15 of the quarter (group 2k), lanes 8-15 the rest (2k+1) */
                __m256i scv = _mm256_set_m128i(_mm_set1_epi16(s8[2 * k + 1]), _mm_set1_epi16(s8[2 * k]));
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, scv));
            }
        }
        /* the -32 offset: 32 * sum_g sc[g] * (sum of the group's activations) */
        __m256i off0 = _mm256_mullo_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc)),
                                          _mm256_loadu_si256((const __m256i *)(x16 + b * 16)));
        __m256i off1 = _mm256_mullo_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8))),
                                          _mm256_loadu_si256((const __m256i *)(x16 + b * 16 + 8)));
        acc = _mm256_sub_epi32(acc, _mm256_slli_epi32(_mm256_add_epi32(off0, off1), 5));
        fsum = _mm256_fmadd_ps(_mm256_set1_ps(f16(blk + 208) * xd[b]), _mm256_cvtepi32_ps(acc), fsum);
    }
    return hsum8(fsum);
#else
    float sum = 0.f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 210;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = f16(blk + 208);
        int32_t isum = 0;
        for (int n = 0; n < 2; n++) {
            const uint8_t *ql = blk + 64 * n, *qh = blk + 128 + 32 * n;
            const int8_t *x = xq + b * 256 + 128 * n;
            int32_t a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int h = 0; h < 2; h++) {  /* l in 16h..16h+15: group index h + 2k for the k-th quarter */
                int32_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
                for (int l = 16 * h; l < 16 * h + 16; l++) {
                    s0 += ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) * x[l];
                    s1 += ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) * x[l + 32];
                    s2 += ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) * x[l + 64];
                    s3 += ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) * x[l + 96];
                }
                a[h] = s0; a[h + 2] = s1; a[h + 4] = s2; a[h + 6] = s3;
            }
            for (int g = 0; g < 8; g++) isum += sc[8 * n + g] * (a[g] - 32 * x16[b * 16 + 8 * n + g]);
        }
        sum += xd[b] * d * (float)isum;
    }
    return sum;
#endif
}

#include "cpu_native_rows.h" /* Q8_0: dot_q8_0; Q4_K, Q6_K and Q8_0 against several rows of x: dot_*_rows */
#include "cpu_native_iq4.h"  /* IQ4_XS and IQ4_NL: dot_iq4xs, dot_iq4nl */
#include "cpu_native_iq.h"   /* IQ2_XXS / IQ3_XXS / IQ2_S tables, dot_iqxxs */
#include "cpu_native_iq2s.h" /* IQ2_S: dot_iq2s */
#include "cpu_native_iqx.h"  /* IQ2_XS / IQ3_S / IQ1_S / IQ1_M: their tables and dot products */
#include "cpu_native_fmt.h"  /* Q5_K and MXFP4: dot_q5k, dot_mxfp4(_tail) */
#include "cpu_native_kq.h"   /* Q2_K, Q3_K, TQ2_0 and TQ1_0: dot_q2k, dot_q3k, dot_tq2_0, dot_tq1_0 */
#include "cpu_native_q32.h"  /* Q4_0, Q4_1, Q5_0, Q5_1: dot_q32 */
#include "cpu_native_attn.h" /* a decode / verify step's attention over float32 KV: strata_attn_rows */
#include "cpu_native_norm.h" /* RMSNorm, residual + RMSNorm, q/k norm + rotary: strata_rms_norm, ... */

enum { FMT_Q4K = 0, FMT_Q6K = 1, FMT_Q80 = 2, FMT_IQ4XS = 3, FMT_IQ2XXS = 4, FMT_IQ3XXS = 5, FMT_Q5K = 6,
       FMT_MXFP4 = 7, FMT_IQ2S = 8, FMT_IQ4NL = 9, FMT_Q2K = 10, FMT_Q3K = 11,
       FMT_IQ2XS = 12, FMT_IQ3S = 13, FMT_IQ1S = 14, FMT_IQ1M = 15, FMT_Q40 = 16, FMT_Q41 = 17, FMT_Q50 = 18,
       FMT_Q51 = 19, FMT_TQ20 = 20, FMT_TQ10 = 21, N_FMT = 22 };

/* the weights a block of the format spans: its rows' lengths are multiples of it */
static inline int fmt_width(int fmt) {
    return fmt == FMT_Q80 || fmt == FMT_MXFP4 || fmt == FMT_IQ4NL || (fmt >= FMT_Q40 && fmt <= FMT_Q51) ? 32 : 256;
}

static inline int row_bytes(int fmt, int K) {
    static const int per256[] = {144, 210, 0, 136, 66, 98, 176, 136, 82, 0, 84, 110, 74, 110, 50, 56};
    return fmt == FMT_Q80 ? K / 32 * 34 : fmt == FMT_MXFP4 ? K / 32 * 17 : fmt == FMT_IQ4NL ? K / 32 * 18
         : fmt == FMT_TQ20 ? K / 256 * 66 : fmt == FMT_TQ10 ? K / 256 * 54
         : fmt >= FMT_Q40 ? K / 32 * (18 + 2 * (fmt - FMT_Q40))
         : K / 256 * per256[fmt];
}

static inline float dot_row(int fmt, const uint8_t *row, int K, const int8_t *q, const float *qd,
                            const int32_t *qs, const int32_t *q16) {
    if (fmt == FMT_Q80) return dot_q8_0(row, K, q, qd);
    if (fmt == FMT_TQ20) return dot_tq2_0(row, K / 256, q, qd, qs);
    if (fmt == FMT_TQ10) return dot_tq1_0(row, K / 256, q, qd);
    if (fmt >= FMT_Q40) return dot_q32(fmt - FMT_Q40, row, K, q, qd, qs);
    if (fmt == FMT_IQ4XS) return dot_iq4xs(row, K / 256, q, qd);
    if (fmt == FMT_IQ4NL) return dot_iq4nl(row, K, q, qd);
    if (fmt == FMT_Q5K) return dot_q5k(row, K / 256, q, qd, qs);
    if (fmt == FMT_MXFP4) return K % 256 ? dot_mxfp4_tail(row, K, q, qd, qs) : dot_mxfp4(row, K, q, qd, qs);
    if (fmt == FMT_IQ2S) return dot_iq2s(row, K / 256, q, qd);
    if (fmt == FMT_Q3K) return dot_q3k(row, K / 256, q, qd, q16);
    if (fmt == FMT_IQ2XS) return dot_iq2xs(row, K / 256, q, qd);
    if (fmt == FMT_IQ3S) return dot_iq3s(row, K / 256, q, qd);
    if (fmt == FMT_IQ1S) return dot_iq1s(row, K / 256, q, qd);
    if (fmt == FMT_IQ1M) return dot_iq1m(row, K / 256, q, qd);
    if (fmt == FMT_Q2K) return dot_q2k(row, K / 256, q, qd, q16);
    if (fmt == FMT_IQ2XXS || fmt == FMT_IQ3XXS) return dot_iqxxs(fmt == FMT_IQ3XXS, row, K / 256, q, qd);
    return fmt == FMT_Q6K ? dot_q6k(row, K / 256, q, qd, q16) : dot_q4k(row, K / 256, q, qd, qs);
}

/* nr (even) consecutive rows (row + k * rb) . the activations into out[0..nr), each bit for bit its dot_row.
   IQ2_XXS and IQ2_S take a block of rows a call (their many constants then stay in registers across rows) and
   rows of an odd number of super-blocks pair two rows' last ones in one step (their dot products take
   super-blocks two at a time) */
static inline void dot_rown(int fmt, const uint8_t *row, long rb, int nr, int K, const int8_t *q, const float *qd,
                            const int32_t *qs, const int32_t *q16, float *out) {
#if defined(IQ_TWO_ROWS)
    if (fmt == FMT_IQ2XXS) { dot_iq2xxs2(row, row + rb, 2 * rb, nr / 2, K / 256, q, qd, out, out + 1, 2); return; }
#endif
#if defined(IQ2S_TWO_ROWS)
    if (fmt == FMT_IQ2S) { dot_iq2s2(row, row + rb, 2 * rb, nr / 2, K / 256, q, qd, out, out + 1, 2); return; }
#endif
    for (int k = 0; k < nr; k++) out[k] = dot_row(fmt, row + k * rb, K, q, qd, qs, q16);
}

/* gate and up rows k < nr (gate + k * rg, up + k * ru) . the activations into og[k], ou[k], each bit for bit its
   dot_row, a gate row and then its up row (the two streams read side by side); IQ2_XXS and IQ2_S take all of them
   in one call, a gate row and its up row as one pair of rows (see dot_rown) */
static inline void dot_gate_up(int fg, int fu, const uint8_t *gate, const uint8_t *up, long rg, long ru, int nr, int K,
                               const int8_t *q, const float *qd, const int32_t *qs, const int32_t *q16, float *og,
                               float *ou) {
#if defined(IQ_TWO_ROWS)
    if (fg == FMT_IQ2XXS && fu == FMT_IQ2XXS) { dot_iq2xxs2(gate, up, rg, nr, K / 256, q, qd, og, ou, 1); return; }
#endif
#if defined(IQ2S_TWO_ROWS)
    if (fg == FMT_IQ2S && fu == FMT_IQ2S) { dot_iq2s2(gate, up, rg, nr, K / 256, q, qd, og, ou, 1); return; }
#endif
    for (int k = 0; k < nr; k++) {
        og[k] = dot_row(fg, gate + k * rg, K, q, qd, qs, q16);
        ou[k] = dot_row(fu, up + k * ru, K, q, qd, qs, q16);
    }
}

/* the gated activation of gate g and up u (biases already added): ACT_SWIGLU silu(g) * u; ACT_OAI gpt-oss's
   clamped one (transformers' GptOssExperts): g clamped above at limit, u to [-limit, limit], then
   (u + 1) * g * sigmoid(alpha * g) */
enum { ACT_SWIGLU = 0, ACT_OAI = 1 };

static inline float glu(int act, float g, float u, float alpha, float limit) {
    if (act == ACT_OAI) {
        g = fminf(g, limit);
        u = fmaxf(fminf(u, limit), -limit);
        return (u + 1.f) * (g / (1.f + expf(-alpha * g)));
    }
    return g / (1.f + expf(-g)) * u;
}

/* one weight row against the T activation rows of a run (scratch rows at xs0 + t * stride, laid out as
   quantize_row writes them), into out[t * N]: Q4_K, Q6_K and Q8_0 unpack each block once for every row
   (cpu_native_rows.h, bit for bit the one-row sums), the others take their one-row function per row (the weight
   row then comes from the cache after the first) */
static inline void dot_rows(int fmt, const uint8_t *row, int K, int T, const uint8_t *xs0, long stride, float *out,
                            long N) {
    if (T > 1 && fmt == FMT_Q4K) { dot_q4k_rows(row, K / 256, K, T, xs0, stride, out, N); return; }
    if (T > 1 && fmt == FMT_Q6K) { dot_q6k_rows(row, K / 256, K, T, xs0, stride, out, N); return; }
    if (T > 1 && fmt == FMT_Q80) {
        dot_q8_0_rows(row, K, T, (const int8_t *)xs0, (const float *)(xs0 + K), stride, out, N);
        return;
    }
    for (int t = 0; t < T; t++) {
        const uint8_t *base = xs0 + (long)t * stride;
        const float *xd = (const float *)(base + K);
        const int32_t *xs = (const int32_t *)(xd + NB256(K));
        out[(long)t * N] = dot_row(fmt, row, K, (const int8_t *)base, xd, xs, xs + K / 32);
    }
}

/* scratch per expert row set: activations d and intermediate ff, each as int8 + scales + sums per 32 and 16 */
static inline long scratch_per(int K) { return K + 4L * (NB256(K) + K / 32 + K / 16); }

/* n experts, each over its own activations x[e] (d floats): out[e] (d floats) =
   down[e] . glu(gate[e] . x + gb[e], up[e] . x + ub[e]) + db[e]; gate, up [ff, d] and down [d, ff] in formats fg, fu,
   fdn. gb, ub, db: NULL (no bias) or each row's bias vector (ff, ff, d floats); act, alpha, limit: glu's.
   ws: scratch of n * (scratch_per(d) + scratch_per(ff)) bytes plus n * ff floats (64-byte aligned).
   Returns 0, or -1 (nothing computed) where d or ff is not a multiple of its format's block width or a format
   or activation is unknown. */
long strata_native_scratch(int n, int d, int ff) { return (long)n * (scratch_per(d) + scratch_per(ff) + 4L * ff); }

int strata_native_experts(int n, const uint8_t *const *gate, const uint8_t *const *up, const uint8_t *const *down,
                          const float *const *x, float *out, int d, int ff, int fg, int fu, int fdn, int threads,
                          uint8_t *ws, const float *const *gb, const float *const *ub, const float *const *db,
                          int act, float alpha, float limit) {
    if (fg < 0 || fg >= N_FMT || fu < 0 || fu >= N_FMT || fdn < 0 || fdn >= N_FMT ||
        (act != ACT_SWIGLU && act != ACT_OAI) || d <= 0 || ff <= 0 || d % fmt_width(fg) || d % fmt_width(fu) ||
        ff % fmt_width(fdn))
        return -1;
    const int rg = row_bytes(fg, d), ru = row_bytes(fu, d), rd = row_bytes(fdn, ff);
    float *h = (float *)ws;                                   /* n * ff floats */
    uint8_t *sx = ws + 4L * n * ff, *sh = sx + (long)n * scratch_per(d);
    #define XQ(e) ((int8_t *)(sx + (long)(e) * scratch_per(d)))
    #define XD(e) ((float *)(sx + (long)(e) * scratch_per(d) + d))
    #define XS(e) ((int32_t *)(XD(e) + NB256(d)))
    #define X16(e) (XS(e) + d / 32)
    #define HQ(e) ((int8_t *)(sh + (long)(e) * scratch_per(ff)))
    #define HD(e) ((float *)(sh + (long)(e) * scratch_per(ff) + ff))
    #define HS(e) ((int32_t *)(HD(e) + NB256(ff)))
    #define H16(e) (HS(e) + ff / 32)
    /* rows a block for the gate / up and the down loops: 32 (fewer calls), halved while that leaves fewer than 4
       blocks a thread (ff and d are multiples of 32, so of each block) */
    int gblk = 32, dblk = 32;
    while (gblk > 2 && (long)n * ff / gblk < 4L * threads) gblk /= 2;
    while (dblk > 2 && (long)n * d / dblk < 4L * threads) dblk /= 2;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int e = 0; e < n; e++) quantize_row(x[e], d, XQ(e), XD(e), XS(e), X16(e));
        #pragma omp for schedule(static)
        for (long r = 0; r < (long)n * ff; r += gblk) {
            int e = (int)(r / ff), i = (int)(r % ff);
            float g[32], u[32];
            dot_gate_up(fg, fu, gate[e] + (long)i * rg, up[e] + (long)i * ru, rg, ru, gblk, d, XQ(e), XD(e), XS(e),
                        X16(e), g, u);
            for (int k = 0; k < gblk; k++)
                h[r + k] = glu(act, gb ? g[k] + gb[e][i + k] : g[k], ub ? u[k] + ub[e][i + k] : u[k], alpha, limit);
        }
        #pragma omp for schedule(static)
        for (int e = 0; e < n; e++) quantize_row(h + (long)e * ff, ff, HQ(e), HD(e), HS(e), H16(e));
        #pragma omp for schedule(static)
        for (long r = 0; r < (long)n * d; r += dblk) {
            int e = (int)(r / d), i = (int)(r % d);
            dot_rown(fdn, down[e] + (long)i * rd, rd, dblk, ff, HQ(e), HD(e), HS(e), H16(e), out + r);
            if (db)
                for (int k = 0; k < dblk; k++) out[r + k] += db[e][i + k];
        }
    }
    return 0;
}

/* out[t][r] = w[r] . x[t] for a weight of N rows of K in format fmt (rows of row_bytes(fmt, K)) and T activation
   rows x [T, K] floats: qmatmul on the CPU for decode-sized T, each weight row read once for all T (the rows split
   among threads). ws: strata_native_gemv_scratch(T, K) bytes, 64-byte aligned. Returns 0, or -1 (nothing computed)
   where K is not a multiple of the format's block width or the format is unknown. */
long strata_native_gemv_scratch(int T, int K) { return (long)T * scratch_per(K); }

int strata_native_gemv(int T, const uint8_t *w, int N, int K, int fmt, const float *x, float *out, int threads,
                       uint8_t *ws) {
    if (fmt < 0 || fmt >= N_FMT || T <= 0 || N <= 0 || K <= 0 || K % fmt_width(fmt)) return -1;
    const long rb = row_bytes(fmt, K), sp = scratch_per(K);
    #define GQ(t) ((int8_t *)(ws + (long)(t) * sp))
    #define GD(t) ((float *)(ws + (long)(t) * sp + K))
    #define GS(t) ((int32_t *)(GD(t) + NB256(K)))
    #define G16(t) (GS(t) + K / 32)
    for (int t = 0; t < T; t++) quantize_row(x + (long)t * K, K, GQ(t), GD(t), GS(t), G16(t));
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int r = 0; r < N; r++) dot_rows(fmt, w + r * rb, K, T, ws, sp, out + r, N);
    #undef GQ
    #undef GD
    #undef GS
    #undef G16
    return 0;
}
