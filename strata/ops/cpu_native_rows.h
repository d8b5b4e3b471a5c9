/* The one-row Q8_0 dot product and the several-row dot products of cpu_native.c, which includes this header after
   dot_q4k and dot_q6k (one compilation unit: f16, hsum8, q4k_scales, NB256 and PREFETCH_AHEAD come from there). A
   verify step's or a batch's few rows of x against one weight row: each block is loaded and unpacked once for
   every row, and each row's sums run in its one-row function's order, so every result is bit for bit that
   function's. */

/* the int32 lanes of madd(maddubs(|w|, x with w's sign), 1): each the sum of four byte products. With VNNI one
   instruction gives the same lanes (maddubs' int16 pairs never saturate: |x| <= 127 after quantize_block, |w| <=
   128), so the sums and every result keep their bits. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q8_LANES(aw, sx, ones) _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, sx)
#else
#define Q8_LANES(aw, sx, ones) _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones)
#endif

/* one Q8_0 row (K/32 blocks of 34 bytes: d f16, 32 int8): w = d * q */
static float dot_q8_0(const uint8_t *row, int K, const int8_t *xq, const float *xd) {
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 fsum = _mm256_setzero_ps();
    int i = 0;
#if defined(__F16C__)
    for (; i + 8 <= K / 32; i += 8) {  /* eight blocks a step: one scale conversion and multiply-add for them */
        const uint8_t *b0 = row + (long)i * 34;
        PREFETCH_AHEAD(b0, K / 32 * 34, 272);
        __m256i p[8];
        for (int k = 0; k < 8; k++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(b0 + 34 * k + 2));
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 32 * (i + k)));
            p[k] = Q8_LANES(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w), ones);
        }
        fsum = _mm256_fmadd_ps(_mm256_mul_ps(f16x8(b0, 34, 0), _mm256_set1_ps(xd[i / 8])),
                               _mm256_cvtepi32_ps(sum8x8(p)), fsum);
    }
#endif
    for (; i < K / 32; i++) {
        const uint8_t *blk = row + i * 34;
        if ((i & 1) == 0) PREFETCH_AHEAD(blk, K / 32 * 34, 68);
        __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 2));
        __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 32 * i));
        /* signed x signed: |w| (unsigned) times x with w's sign */
        __m256i p = Q8_LANES(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w), ones);
        fsum = _mm256_fmadd_ps(_mm256_set1_ps(f16(blk) * xd[i / 8]), _mm256_cvtepi32_ps(p), fsum);
    }
    return hsum8(fsum);
#else
    float sum = 0.f;
    for (int i = 0; i < K / 32; i++) {
        const uint8_t *blk = row + i * 34;
        const int8_t *w = (const int8_t *)(blk + 2);
        int32_t s = 0;
        for (int l = 0; l < 32; l++) s += w[l] * xq[32 * i + l];
        sum += f16(blk) * xd[i / 8] * (float)s;
    }
    return sum;
#endif
}

/* dot_q4k of one weight row against T rows of activations laid out as the scratch is (row t's int8 at
   xq + t * stride bytes, its scales right after its K int8, its sums per 32 right after the scales), into
   out[t * N]: each super-block's scales are unpacked and its nibbles split once for every row, and each row's sums
   run in dot_q4k's order, so every result is bit for bit its own call's. */
static void dot_q4k_rows(const uint8_t *row, int nb, int K, int T, const uint8_t *xs0, long stride, float *out,
                         long N) {
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int t0 = 0; t0 < T; t0 += 4) {
        const int nt = T - t0 < 4 ? T - t0 : 4;
        const int8_t *q8r[4];
        const float *xdr[4];
        const int32_t *xsr[4];
        for (int t = 0; t < nt; t++) {
            const uint8_t *base = xs0 + (long)(t0 + t) * stride;
            q8r[t] = (const int8_t *)base;
            xdr[t] = (const float *)(base + K);
            xsr[t] = (const int32_t *)(xdr[t] + NB256(K));
        }
        __m256 fsum[4], fmin[4];
        for (int t = 0; t < 4; t++) fsum[t] = fmin[t] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * 144;
            PREFETCH_AHEAD(blk, nb * 144, 144);
            uint8_t sc[8], mn[8];
            q4k_scales(blk + 4, sc, mn);
            const uint8_t *qs = blk + 16;
            __m256i lo[4], hi[4];
            for (int j = 0; j < 4; j++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
                lo[j] = _mm256_and_si256(v, m4);
                hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            }
            const __m256i mn32 = _mm256_cvtepu8_epi32(q4k_mins_v(blk + 4));
            const float d = f16(blk), dm = f16(blk + 2);
            for (int t = 0; t < nt; t++) {
                const int8_t *q8 = q8r[t] + b * 256;
                __m256i acc = _mm256_setzero_si256();
                for (int j = 0; j < 4; j++) {
                    __m256i plo = _mm256_maddubs_epi16(lo[j], _mm256_loadu_si256((const __m256i *)(q8 + 64 * j)));
                    __m256i phi = _mm256_maddubs_epi16(hi[j], _mm256_loadu_si256((const __m256i *)(q8 + 64 * j + 32)));
                    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(plo, _mm256_set1_epi16(sc[2 * j])));
                    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(phi, _mm256_set1_epi16(sc[2 * j + 1])));
                }
                __m256i mprod = _mm256_mullo_epi32(mn32, _mm256_loadu_si256((const __m256i *)(xsr[t] + b * 8)));
                const float dx = d * xdr[t][b], mx = dm * xdr[t][b];
                fsum[t] = _mm256_fmadd_ps(_mm256_set1_ps(dx), _mm256_cvtepi32_ps(acc), fsum[t]);
                fmin[t] = _mm256_fmadd_ps(_mm256_set1_ps(mx), _mm256_cvtepi32_ps(mprod), fmin[t]);
            }
        }
        for (int t = 0; t < nt; t++) out[(long)(t0 + t) * N] = hsum8(_mm256_sub_ps(fsum[t], fmin[t]));
    }
#else
    for (int t = 0; t < T; t++) {
        const uint8_t *base = xs0 + (long)t * stride;
        const float *xd = (const float *)(base + K);
        out[(long)t * N] = dot_q4k(row, nb, (const int8_t *)base, xd, (const int32_t *)(xd + NB256(K)));
    }
#endif
}

/* dot_q6k of one weight row against T rows of activations laid out as the scratch is (row t's int8 at
   xq + t * stride bytes, its scales right after its K int8, its sums per 32 and then per 16 after those), into
   out[t * N]: each half super-block's 6-bit values and scales are unpacked once for every row, and each row's sums
   run in dot_q6k's order (its float steps are the same; its integer ones are exact), bit for bit its own call's. */
static void dot_q6k_rows(const uint8_t *row, int nb, int K, int T, const uint8_t *xs0, long stride, float *out,
                         long N) {
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
    for (int t0 = 0; t0 < T; t0 += 4) {
        const int nt = T - t0 < 4 ? T - t0 : 4;
        const int8_t *q8r[4];
        const float *xdr[4];
        const int32_t *x16r[4];
        for (int t = 0; t < nt; t++) {
            const uint8_t *base = xs0 + (long)(t0 + t) * stride;
            q8r[t] = (const int8_t *)base;
            xdr[t] = (const float *)(base + K);
            x16r[t] = (const int32_t *)(xdr[t] + NB256(K)) + K / 32;
        }
        __m256 fsum[4];
        for (int t = 0; t < 4; t++) fsum[t] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * 210;
            PREFETCH_AHEAD(blk, nb * 210, 210);
            const int8_t *sc = (const int8_t *)(blk + 192);
            __m256i acc[4];
            for (int t = 0; t < 4; t++) acc[t] = _mm256_setzero_si256();
            for (int n = 0; n < 2; n++) {
                const uint8_t *ql = blk + 64 * n, *qhp = blk + 128 + 32 * n;
                const int8_t *s8 = sc + 8 * n;
                __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
                __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
                __m256i qh = _mm256_loadu_si256((const __m256i *)qhp);
                __m256i q[4], scv[4];
                q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4));
                q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4));
                q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4));
                q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4));
                for (int k = 0; k < 4; k++)
                    scv[k] = _mm256_set_m128i(_mm_set1_epi16(s8[2 * k + 1]), _mm_set1_epi16(s8[2 * k]));
                for (int t = 0; t < nt; t++) {
                    const int8_t *x = q8r[t] + b * 256 + 128 * n;
                    for (int k = 0; k < 4; k++) {
                        __m256i p = _mm256_maddubs_epi16(q[k], _mm256_loadu_si256((const __m256i *)(x + 32 * k)));
                        acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(p, scv[k]));
                    }
                }
            }
            const __m256i sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc));
            const __m256i sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8)));
            const float d = f16(blk + 208);
            for (int t = 0; t < nt; t++) {
                __m256i off0 = _mm256_mullo_epi32(sc0, _mm256_loadu_si256((const __m256i *)(x16r[t] + b * 16)));
                __m256i off1 = _mm256_mullo_epi32(sc1, _mm256_loadu_si256((const __m256i *)(x16r[t] + b * 16 + 8)));
                __m256i a = _mm256_sub_epi32(acc[t], _mm256_slli_epi32(_mm256_add_epi32(off0, off1), 5));
                fsum[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * xdr[t][b]), _mm256_cvtepi32_ps(a), fsum[t]);
            }
        }
        for (int t = 0; t < nt; t++) out[(long)(t0 + t) * N] = hsum8(fsum[t]);
    }
#else
    for (int t = 0; t < T; t++) {
        const uint8_t *base = xs0 + (long)t * stride;
        const float *xd = (const float *)(base + K);
        out[(long)t * N] = dot_q6k(row, nb, (const int8_t *)base, xd, (const int32_t *)(xd + NB256(K)) + K / 32);
    }
#endif
}

/* dot_q8_0 of one weight row against T rows of activations (row t's int8 at xq + t * stride, its scales at
   xd + t * stride / 4 floats: the scratch layout), into out[t * N]: each block is loaded and its signs taken once
   for every row, and each row's sums run in dot_q8_0's order, so every result is bit for bit its own call's. A
   verify step's or a batch's few rows then cost less than as many calls (the second row ~half the first). */
static void dot_q8_0_rows(const uint8_t *row, int K, int T, const int8_t *xq, const float *xd, long stride,
                          float *out, long N) {
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i ones = _mm256_set1_epi16(1);
    for (int t0 = 0; t0 < T; t0 += 4) {
        const int nt = T - t0 < 4 ? T - t0 : 4;
        __m256 fsum[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        int i = 0;
#if defined(__F16C__)
        for (; i + 8 <= K / 32; i += 8) {  /* dot_q8_0's eight-block steps, row after row (the blocks stay in L1) */
            const uint8_t *b0 = row + (long)i * 34;
            PREFETCH_AHEAD(b0, K / 32 * 34, 272);
            const __m256 d8 = f16x8(b0, 34, 0);
            __m256i w8[8], a8[8];  /* the blocks and their magnitudes, once for every row */
            for (int k = 0; k < 8; k++) {
                w8[k] = _mm256_loadu_si256((const __m256i *)(b0 + 34 * k + 2));
                a8[k] = _mm256_sign_epi8(w8[k], w8[k]);
            }
            for (int t = 0; t < nt; t++) {
                const int8_t *x8 = xq + (long)(t0 + t) * stride;
                const float *xs = (const float *)((const uint8_t *)xd + (long)(t0 + t) * stride);
                __m256i p[8];
                for (int k = 0; k < 8; k++) {
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(x8 + 32 * (i + k)));
                    p[k] = Q8_LANES(a8[k], _mm256_sign_epi8(x, w8[k]), ones);
                }
                fsum[t] = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(xs[i / 8])),
                                          _mm256_cvtepi32_ps(sum8x8(p)), fsum[t]);
            }
        }
#endif
        for (; i < K / 32; i++) {
            const uint8_t *blk = row + i * 34;
            if ((i & 1) == 0) PREFETCH_AHEAD(blk, K / 32 * 34, 68);
            const __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 2));
            const __m256i aw = _mm256_sign_epi8(w, w);
            const float d = f16(blk);
            for (int t = 0; t < nt; t++) {
                const int8_t *x8 = xq + (long)(t0 + t) * stride;
                const float *xs = (const float *)((const uint8_t *)xd + (long)(t0 + t) * stride);
                const __m256i x = _mm256_loadu_si256((const __m256i *)(x8 + 32 * i));
                const __m256i p = Q8_LANES(aw, _mm256_sign_epi8(x, w), ones);
                fsum[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * xs[i / 8]), _mm256_cvtepi32_ps(p), fsum[t]);
            }
        }
        for (int t = 0; t < nt; t++) out[(long)(t0 + t) * N] = hsum8(fsum[t]);
    }
#else
    for (int t = 0; t < T; t++)
        out[(long)t * N] = dot_q8_0(row, K, xq + (long)t * stride,
                                    (const float *)((const uint8_t *)xd + (long)t * stride));
#endif
}
