/* The Q2_K and Q3_K dot products of cpu_native.c (one compilation unit: f16, hsum8 and PREFETCH_AHEAD come from
   there). These are the expert formats of llama.cpp's Q2_K / Q3_K_S / Q3_K_M / Q3_K_L files and of Unsloth's
   low-bit UD mixes; both have 16 groups of 16 weights a super-block, so their sums go per 16 like Q6_K's.

   Both lay a half block's 128 weights out the same way: byte l (0..31) of the half's 32 bytes of 2-bit values feeds
   weights l, l+32, l+64, l+96 through bits 0-1, 2-3, 4-5, 6-7, and group g covers weights 16g..16g+15. One 32-byte
   step (a shift of the 32 bytes) is therefore the two groups 2i and 2i+1 (i = 4 * half + shift): maddubs gives
   16 sums of pairs, the low 128 bits group 2i's and the high ones group 2i+1's, so one madd against a vector of
   the two groups' scales (low lane s[2i], high lane s[2i+1]) weighs them. */

#if defined(__AVX2__) && defined(__FMA__)
/* the 8 int16 scales of a half block in both 128-bit lanes (h8) -> for its shift j: low lane s[2j] x 8, high lane
   s[2j+1] x 8 (one in-lane byte shuffle) */
static inline __m256i kq_pair_scales(__m256i h8, int j) {
    const char a = (char)(4 * j), b = (char)(4 * j + 1), c = (char)(4 * j + 2), e = (char)(4 * j + 3);
    return _mm256_shuffle_epi8(h8, _mm256_set_epi8(e, c, e, c, e, c, e, c, e, c, e, c, e, c, e, c,
                                                   b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, a));
}
#endif

/* Q2_K (84 bytes / 256 weights): scales[16] (low nibble: the group's scale, high nibble: its min), qs[64] of 2-bit
   values, f16 d, f16 dmin. w = d * (sc & 15) * q - dmin * (sc >> 4), q in 0..3: per group, d * sc * (q . x8)
   minus dmin * m * (sum of the group's x8), the second from the activations' sums per 16. maddubs cannot
   saturate (2 * 3 * 127). */
static float dot_q2k(const uint8_t *row, int nb, const int8_t *xq, const float *xd, const int32_t *x16) {
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    __m256 fsum = _mm256_setzero_ps(), fmin = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 84;
        PREFETCH_AHEAD(blk, nb * 84, 84);
        const __m128i s8 = _mm_loadu_si128((const __m128i *)blk);
        const __m128i sl = _mm_and_si128(s8, m4), mn = _mm_and_si128(_mm_srli_epi16(s8, 4), m4);
        const int8_t *x = xq + b * 256;
        __m256i acc = _mm256_setzero_si256();
        for (int n = 0; n < 2; n++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * n));
            const __m256i h8 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(n ? _mm_srli_si128(sl, 8) : sl));
            for (int j = 0; j < 4; j++) {
                __m256i p = _mm256_maddubs_epi16(_mm256_and_si256(q, m3),
                                                 _mm256_loadu_si256((const __m256i *)(x + 128 * n + 32 * j)));
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, kq_pair_scales(h8, j)));
                q = _mm256_srli_epi16(q, 2);  /* next 2 bits of each byte (bits from the byte above are masked) */
            }
        }
        /* mins . sums of the activations per 16: two sets of eight lanes */
        const int32_t *s16 = x16 + b * 16;
        __m256i mprod = _mm256_add_epi32(
            _mm256_mullo_epi32(_mm256_cvtepu8_epi32(mn), _mm256_loadu_si256((const __m256i *)s16)),
            _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(mn, 8)),
                               _mm256_loadu_si256((const __m256i *)(s16 + 8))));
        const float dx = f16(blk + 80) * xd[b], mx = f16(blk + 82) * xd[b];
        fsum = _mm256_fmadd_ps(_mm256_set1_ps(dx), _mm256_cvtepi32_ps(acc), fsum);
        fmin = _mm256_fmadd_ps(_mm256_set1_ps(mx), _mm256_cvtepi32_ps(mprod), fmin);
    }
    return hsum8(_mm256_sub_ps(fsum, fmin));
#else
    float sum = 0.f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 84, *qs = blk + 16;
        const int8_t *x = xq + b * 256;
        int32_t isum = 0, msum = 0;
        for (int g = 0; g < 16; g++) {
            const int n = g / 8, shift = 2 * ((g % 8) / 2), l0 = 16 * (g % 2);
            int32_t dot = 0;
            for (int l = 0; l < 16; l++) dot += ((qs[32 * n + l0 + l] >> shift) & 3) * x[16 * g + l];
            isum += (blk[g] & 15) * dot;
            msum += (blk[g] >> 4) * x16[b * 16 + g];
        }
        sum += xd[b] * (f16(blk + 80) * (float)isum - f16(blk + 82) * (float)msum);
    }
    return sum;
#endif
}

/* the 16 six-bit scales of a Q3_K super-block (12 bytes), as stored minus 32: scale j's low 4 bits are the low
   (j < 8) or high (j >= 8) nibble of byte j % 8, its high 2 bits bits 2 (j / 4) .. of byte 8 + j % 4 */
static inline void q3k_scales(const uint8_t *s, int8_t *out) {
    uint32_t a0, a1, a2, o[4];
    __builtin_memcpy(&a0, s, 4); __builtin_memcpy(&a1, s + 4, 4); __builtin_memcpy(&a2, s + 8, 4);
    o[0] = (a0 & 0x0F0F0F0Fu) | ((a2 & 0x03030303u) << 4);
    o[1] = (a1 & 0x0F0F0F0Fu) | (((a2 >> 2) & 0x03030303u) << 4);
    o[2] = ((a0 >> 4) & 0x0F0F0F0Fu) | (((a2 >> 4) & 0x03030303u) << 4);
    o[3] = ((a1 >> 4) & 0x0F0F0F0Fu) | (((a2 >> 6) & 0x03030303u) << 4);
    const uint8_t *u = (const uint8_t *)o;
    for (int j = 0; j < 16; j++) out[j] = (int8_t)(u[j] - 32);
}

#if defined(__AVX2__) && defined(__FMA__)
/* q3k_scales' 16 values in a vector (built from the four words in registers: byte stores then a vector load would
   stall on store forwarding) */
static inline __m128i q3k_scales_v(const uint8_t *s) {
    uint32_t a0, a1, a2;
    __builtin_memcpy(&a0, s, 4); __builtin_memcpy(&a1, s + 4, 4); __builtin_memcpy(&a2, s + 8, 4);
    const __m128i v = _mm_setr_epi32((int)((a0 & 0x0F0F0F0Fu) | ((a2 & 0x03030303u) << 4)),
                                     (int)((a1 & 0x0F0F0F0Fu) | (((a2 >> 2) & 0x03030303u) << 4)),
                                     (int)(((a0 >> 4) & 0x0F0F0F0Fu) | (((a2 >> 4) & 0x03030303u) << 4)),
                                     (int)(((a1 >> 4) & 0x0F0F0F0Fu) | (((a2 >> 6) & 0x03030303u) << 4)));
    return _mm_sub_epi8(v, _mm_set1_epi8(32));
}
#endif

/* Q3_K (110 bytes / 256 weights): hmask[32], qs[64] of 2-bit values, 12 bytes of 6-bit scales, f16 d.
   w = d * (s - 32) * (q + 4 h - 4), q in 0..3 and h the weight's bit of hmask (weight 32k + l: bit k of hmask[l]).
   Per group: (s - 32) * ((q + 4h) . x8 - 4 * sum of the group's x8), the unsigned 0..7 values through maddubs
   (2 * 7 * 127 cannot saturate) and the 4s from the activations' sums per 16. */
static float dot_q3k(const uint8_t *row, int nb, const int8_t *xq, const float *xd, const int32_t *x16) {
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i m3 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(4);
    __m256 fsum = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 110;
        PREFETCH_AHEAD(blk, nb * 110, 110);
        const __m128i s8 = q3k_scales_v(blk + 96);
        const int8_t *x = xq + b * 256;
        const __m256i h = _mm256_loadu_si256((const __m256i *)blk);
        __m256i acc = _mm256_setzero_si256();
        for (int n = 0; n < 2; n++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * n));
            const __m256i h8 = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(n ? _mm_srli_si128(s8, 8) : s8));
            for (int j = 0; j < 4; j++) {
                /* bit k = 4n + j of each hmask byte moved to bit 2 (a 16-bit shift: the 4 mask keeps each byte's own) */
                const int k = 4 * n + j;
                __m256i hb = k >= 2 ? _mm256_srli_epi16(h, k - 2) : _mm256_slli_epi16(h, 2 - k);
                __m256i v = _mm256_or_si256(_mm256_and_si256(q, m3), _mm256_and_si256(hb, m4));
                __m256i p = _mm256_maddubs_epi16(v, _mm256_loadu_si256((const __m256i *)(x + 128 * n + 32 * j)));
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, kq_pair_scales(h8, j)));
                q = _mm256_srli_epi16(q, 2);
            }
        }
        /* minus 4 (s - 32) . sums per 16 */
        const int32_t *s16 = x16 + b * 16;
        __m256i corr = _mm256_add_epi32(
            _mm256_mullo_epi32(_mm256_cvtepi8_epi32(s8), _mm256_loadu_si256((const __m256i *)s16)),
            _mm256_mullo_epi32(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8)),
                               _mm256_loadu_si256((const __m256i *)(s16 + 8))));
        acc = _mm256_sub_epi32(acc, _mm256_slli_epi32(corr, 2));
        fsum = _mm256_fmadd_ps(_mm256_set1_ps(f16(blk + 108) * xd[b]), _mm256_cvtepi32_ps(acc), fsum);
    }
    return hsum8(fsum);
#else
    float sum = 0.f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 110, *qs = blk + 32;
        int8_t s[16];
        q3k_scales(blk + 96, s);
        const int8_t *x = xq + b * 256;
        int32_t isum = 0;
        for (int g = 0; g < 16; g++) {
            const int n = g / 8, shift = 2 * ((g % 8) / 2), l0 = 16 * (g % 2), k = 4 * n + (g % 8) / 2;
            int32_t dot = 0;
            for (int l = 0; l < 16; l++) {
                const int q = ((qs[32 * n + l0 + l] >> shift) & 3) | (((blk[l0 + l] >> k) & 1) << 2);
                dot += q * x[16 * g + l];
            }
            isum += s[g] * (dot - 4 * x16[b * 16 + g]);
        }
        sum += xd[b] * f16(blk + 108) * (float)isum;
    }
    return sum;
#endif
}

/* TQ2_0 (66 bytes / 256 weights: the ternary format of BitNet-style models): qs[64] of 2-bit values in Q2_K's
   layout, then f16 d; w = d * (q - 1). The block's sum: d * (q . x8 - the sum of its x8). */
static float dot_tq2_0(const uint8_t *row, int nb, const int8_t *xq, const float *xd, const int32_t *xs) {
    float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i m3 = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
    __m256 fsum = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 66;
        PREFETCH_AHEAD(blk, nb * 66, 66);
        const int8_t *x = xq + b * 256;
        __m256i acc = _mm256_setzero_si256();
        for (int n = 0; n < 2; n++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 32 * n));
            for (int j = 0; j < 4; j++) {
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(
                    _mm256_and_si256(q, m3), _mm256_loadu_si256((const __m256i *)(x + 128 * n + 32 * j))), ones));
                q = _mm256_srli_epi16(q, 2);
            }
        }
        int32_t sx = 0;
        for (int k = 0; k < 8; k++) sx += xs[b * 8 + k];
        acc = _mm256_sub_epi32(acc, _mm256_setr_epi32(sx, 0, 0, 0, 0, 0, 0, 0));
        fsum = _mm256_fmadd_ps(_mm256_set1_ps(f16(blk + 64) * xd[b]), _mm256_cvtepi32_ps(acc), fsum);
    }
    sum = hsum8(fsum);
#else
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 66;
        const int8_t *x = xq + b * 256;
        int32_t isum = 0;
        for (int w = 0; w < 256; w++)
            isum += ((blk[32 * (w / 128) + w % 32] >> (2 * ((w % 128) / 32))) & 3) * x[w] - x[w];
        sum += xd[b] * f16(blk + 64) * (float)isum;
    }
    (void)xs;
#endif
    return sum;
}

/* TQ1_0 (54 bytes / 256 weights): the ternary format packed five trits a byte (qs[48]: weights 0-159 from
   qs[0..32) and 160-239 from qs[32..48), trit n of byte q being the top of (q 3^n mod 256) * 3 >> 8) and four
   a byte (qh[4]: weights 240-255), then f16 d; w = d * (trit - 1). The trit minus one is [q >= 86] + [q >= 171]
   - 1 (q * 3 >> 8 crosses 1 at 86 and 2 at 171), applied to x as a sign (sign_epi8), so no offset sum is needed. */
#if defined(__AVX2__) && defined(__FMA__)
static inline __m256i tq1_times3(__m256i q) { return _mm256_add_epi8(_mm256_add_epi8(q, q), q); }

/* x8 . (trit - 1) over 32 weights whose code bytes (already times 3^n) are q, as 16 int16 pair sums */
static inline __m256i tq1_pairs(__m256i q, const int8_t *x) {
    const __m256i flip = _mm256_set1_epi8((char)0x80), one = _mm256_set1_epi8(1);
    const __m256i s = _mm256_xor_si256(q, flip);  /* q - 128: unsigned order as signed */
    const __m256i ge86 = _mm256_cmpgt_epi8(s, _mm256_set1_epi8(85 - 128));
    const __m256i ge171 = _mm256_cmpgt_epi8(s, _mm256_set1_epi8(170 - 128));
    const __m256i t = _mm256_sub_epi8(_mm256_sub_epi8(_mm256_set1_epi8(-1), ge86), ge171);
    return _mm256_maddubs_epi16(one, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x), t));
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512VL__)
/* With AVX-512 64 weights a step: the unsigned compares give the masks of trit 0 (-1) and trit 2 (+1) directly,
   and x is kept, negated or zeroed under them before one multiply-add by ones. */
static inline __m512i tq1_acc(__m512i acc, __m512i q, const int8_t *x) {
    const __m512i xv = _mm512_loadu_si512(x);
    const __mmask64 neg = _mm512_cmplt_epu8_mask(q, _mm512_set1_epi8(86));
    const __mmask64 pos = _mm512_cmpge_epu8_mask(q, _mm512_set1_epi8((char)171));
    const __m512i y = _mm512_mask_sub_epi8(_mm512_maskz_mov_epi8(pos, xv), neg, _mm512_setzero_si512(), xv);
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, _mm512_set1_epi8(1), y);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_set1_epi8(1), y),
                                                   _mm512_set1_epi16(1)));
#endif
}

static inline __m128i tq1_x3h(__m128i q) { return _mm_add_epi8(_mm_add_epi8(q, q), q); }

static float dot_tq1_0(const uint8_t *row, int nb, const int8_t *xq, const float *xd) {
    float sum = 0.f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 54;
        PREFETCH_AHEAD(blk, nb * 54, 54);
        const int8_t *x = xq + b * 256;
        const __m256i q = _mm256_loadu_si256((const __m256i *)blk), q3 = tq1_times3(q), q9 = tq1_times3(q3);
        const __m256i q27 = tq1_times3(q9), q81 = tq1_times3(q27);
        const __m128i a = _mm_loadu_si128((const __m128i *)(blk + 32)), a3 = tq1_x3h(a), a9 = tq1_x3h(a3);
        const __m128i a27 = tq1_x3h(a9), a81 = tq1_x3h(a27);
        int32_t h32;
        __builtin_memcpy(&h32, blk + 48, 4);
        const __m128i h = _mm_set1_epi32(h32), h3 = tq1_x3h(h), h9 = tq1_x3h(h3), h27 = tq1_x3h(h9);
        const __m128i tail = _mm_blend_epi32(_mm_blend_epi32(h, h3, 0x2), _mm_blend_epi32(h9, h27, 0x8), 0xC);
        /* weights 0-63: q, 3q; 64-127: 9q, 27q; 128-191: 81q, a, 3a; 192-255: 9a, 27a, 81a, the tail */
        __m512i acc = tq1_acc(_mm512_setzero_si512(), _mm512_inserti64x4(_mm512_castsi256_si512(q), q3, 1), x);
        acc = tq1_acc(acc, _mm512_inserti64x4(_mm512_castsi256_si512(q9), q27, 1), x + 64);
        acc = tq1_acc(acc, _mm512_inserti64x4(_mm512_castsi256_si512(q81),
                                              _mm256_inserti128_si256(_mm256_castsi128_si256(a), a3, 1), 1), x + 128);
        acc = tq1_acc(acc, _mm512_inserti64x4(
                  _mm512_castsi256_si512(_mm256_inserti128_si256(_mm256_castsi128_si256(a9), a27, 1)),
                  _mm256_inserti128_si256(_mm256_castsi128_si256(a81), tail, 1), 1), x + 192);
        sum += f16(blk + 52) * xd[b] * (float)_mm512_reduce_add_epi32(acc);
    }
    return sum;
}
#else
static float dot_tq1_0(const uint8_t *row, int nb, const int8_t *xq, const float *xd) {
    float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 fsum = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 54;
        PREFETCH_AHEAD(blk, nb * 54, 54);
        const int8_t *x = xq + b * 256;
        /* int16 lanes hold at most 8 pair sums of |x| <= 127: no overflow */
        __m256i q = _mm256_loadu_si256((const __m256i *)blk), acc = _mm256_setzero_si256();
        for (int n = 0; n < 5; n++) {
            acc = _mm256_add_epi16(acc, tq1_pairs(q, x + 32 * n));
            q = tq1_times3(q);
        }
        const __m128i a = _mm_loadu_si128((const __m128i *)(blk + 32));
        __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(a), _mm_add_epi8(_mm_add_epi8(a, a), a), 1);
        acc = _mm256_add_epi16(acc, tq1_pairs(v, x + 160));              /* a, 3a */
        v = tq1_times3(tq1_times3(v));
        acc = _mm256_add_epi16(acc, tq1_pairs(v, x + 192));              /* 9a, 27a */
        int32_t h32;
        __builtin_memcpy(&h32, blk + 48, 4);
        const __m128i h = _mm_set1_epi32(h32), h3 = _mm_add_epi8(_mm_add_epi8(h, h), h);
        const __m128i h9 = _mm_add_epi8(_mm_add_epi8(h3, h3), h3), h27 = _mm_add_epi8(_mm_add_epi8(h9, h9), h9);
        const __m128i tail = _mm_blend_epi32(_mm_blend_epi32(h, h3, 0x2), _mm_blend_epi32(h9, h27, 0x8), 0xC);
        v = tq1_times3(tq1_times3(v));                                     /* 81a, (243a: replaced by the tail) */
        acc = _mm256_add_epi16(acc, tq1_pairs(_mm256_inserti128_si256(v, tail, 1), x + 224));
        fsum = _mm256_fmadd_ps(_mm256_set1_ps(f16(blk + 52) * xd[b]),
                               _mm256_cvtepi32_ps(_mm256_madd_epi16(acc, ones)), fsum);
    }
    sum = hsum8(fsum);
#else
    static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 54;
        const int8_t *x = xq + b * 256;
        int32_t isum = 0;
        for (int w = 0; w < 256; w++) {
            const uint8_t q = w < 160 ? (uint8_t)(blk[w % 32] * pow3[w / 32])
                            : w < 240 ? (uint8_t)(blk[32 + (w - 160) % 16] * pow3[(w - 160) / 16])
                                      : (uint8_t)(blk[48 + (w - 240) % 4] * pow3[(w - 240) / 4]);
            isum += (((int)q * 3 >> 8) - 1) * x[w];
        }
        sum += xd[b] * f16(blk + 52) * (float)isum;
    }
#endif
    return sum;
}
#endif
