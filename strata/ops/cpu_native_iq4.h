/* The IQ4_XS and IQ4_NL dot products of cpu_native.c, which includes this header after dot_q8_0 (one compilation
   unit: f16, hsum8 and PREFETCH_AHEAD come from there). */

/* IQ4_XS (136 bytes / 256 weights): f16 d, u16 scales_h, 4 bytes scales_l, 128 bytes of 4-bit indices into the
   IQ4_NL codebook. Sub-block j (32 weights: the low nibbles of its 16 bytes, then the high ones) has the 6-bit
   scale ls = (scales_l[j/2] >> 4*(j%2) & 15) | (scales_h >> 2j & 3) << 4, and w = d * (ls - 32) * kvalues[q]. The
   codebook's values are int8, none 0: a byte shuffle looks them up, and the sign trick of Q8_0 multiplies them. */
static const int8_t KVALUES_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline int iq4xs_scale(const uint8_t *blk, int j) {
    uint16_t sh = (uint16_t)(blk[2] | (blk[3] << 8));
    return (((blk[4 + j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)) - 32;
}

static float dot_iq4xs(const uint8_t *row, int nb, const int8_t *xq, const float *xd) {
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KVALUES_IQ4NL));
    __m256 fsum = _mm256_setzero_ps();
    const __m256i sl_shift = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i sh_shift = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 136;
        PREFETCH_AHEAD(blk, nb * 136, 136);
        const float dd = f16(blk) * xd[b];
        const int8_t *x = xq + 256 * b;
        /* the 8 sub-block scales (iq4xs_scale) in one vector: low 4 bits from the scales_l word, high 2 from
           scales_h, times d * xd */
        uint32_t slw;
        __builtin_memcpy(&slw, blk + 4, 4);
        const __m256i lsv = _mm256_sub_epi32(_mm256_or_si256(
            _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)slw), sl_shift), _mm256_set1_epi32(15)),
            _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(blk[2] | (blk[3] << 8)), sh_shift),
                                               _mm256_set1_epi32(3)), 4)), _mm256_set1_epi32(32));
        const __m256 scf = _mm256_mul_ps(_mm256_cvtepi32_ps(lsv), _mm256_set1_ps(dd));
        for (int j = 0; j < 8; j += 2) {  /* two sub-blocks: their 32 bytes in the two 128-bit lanes */
            __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 8 + 16 * j));
            __m256i wl = _mm256_shuffle_epi8(lut, _mm256_and_si256(q, m4));                       /* j lo | j+1 lo */
            __m256i wh = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(q, 4), m4)); /* j hi | j+1 hi */
            __m256i x0 = _mm256_loadu_si256((const __m256i *)(x + 32 * j));
            __m256i x1 = _mm256_loadu_si256((const __m256i *)(x + 32 * j + 32));
            __m256i xl = _mm256_permute2x128_si256(x0, x1, 0x20), xh = _mm256_permute2x128_si256(x0, x1, 0x31);
            __m256i p = _mm256_add_epi32(
                _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wl, wl), _mm256_sign_epi8(xl, wl)), ones),
                _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wh, wh), _mm256_sign_epi8(xh, wh)), ones));
            const __m256 s01 = _mm256_permutevar8x32_ps(scf, _mm256_setr_epi32(j, j, j, j, j + 1, j + 1, j + 1, j + 1));
            fsum = _mm256_fmadd_ps(s01, _mm256_cvtepi32_ps(p), fsum);
        }
    }
    return hsum8(fsum);
#else
    float sum = 0.f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 136;
        for (int j = 0; j < 8; j++) {
            const uint8_t *q = blk + 8 + 16 * j;
            const int8_t *x = xq + 256 * b + 32 * j;
            int32_t s = 0;
            for (int l = 0; l < 16; l++) s += KVALUES_IQ4NL[q[l] & 15] * x[l] + KVALUES_IQ4NL[q[l] >> 4] * x[l + 16];
            sum += f16(blk) * xd[b] * (float)iq4xs_scale(blk, j) * (float)s;
        }
    }
    return sum;
#endif
}

/* IQ4_NL (18 bytes / 32 weights): f16 d, 16 bytes of 4-bit indices into the same codebook (low nibbles: weights
   0-15, high: 16-31); w = d * kvalues[q]: IQ4_XS's lookup without sub-block scales, Q8_0's block walk. An i-quant
   mix writes it for rows that are not whole 256-blocks (GLM-4.5-Air's 1,408-wide expert down projections). */
static float dot_iq4nl(const uint8_t *row, int K, const int8_t *xq, const float *xd) {
#if defined(__AVX2__) && defined(__FMA__)
    const __m128i m4 = _mm_set1_epi8(0x0F), lut = _mm_loadu_si128((const __m128i *)KVALUES_IQ4NL);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 fsum = _mm256_setzero_ps();
    int i = 0;
#if defined(__F16C__)
    for (; i + 8 <= K / 32; i += 8) {  /* eight blocks a step: one scale conversion and multiply-add for them */
        const uint8_t *b0 = row + (long)i * 18;
        PREFETCH_AHEAD(b0, K / 32 * 18, 144);
        __m256i p[8];
        for (int k = 0; k < 8; k++) {
            __m128i q = _mm_loadu_si128((const __m128i *)(b0 + 18 * k + 2));
            __m256i w = _mm256_set_m128i(_mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(q, 4), m4)),
                                         _mm_shuffle_epi8(lut, _mm_and_si128(q, m4)));
            __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 32 * (i + k)));
            p[k] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), ones);
        }
        fsum = _mm256_fmadd_ps(_mm256_mul_ps(f16x8(b0, 18, 0), _mm256_set1_ps(xd[i / 8])),
                               _mm256_cvtepi32_ps(sum8x8(p)), fsum);
    }
#endif
    for (; i < K / 32; i++) {
        const uint8_t *blk = row + i * 18;
        if ((i & 3) == 0) PREFETCH_AHEAD(blk, K / 32 * 18, 72);
        __m128i q = _mm_loadu_si128((const __m128i *)(blk + 2));
        __m256i w = _mm256_set_m128i(_mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(q, 4), m4)),
                                     _mm_shuffle_epi8(lut, _mm_and_si128(q, m4)));  /* weights 0-15 | 16-31 */
        __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 32 * i));
        __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), ones);
        fsum = _mm256_fmadd_ps(_mm256_set1_ps(f16(blk) * xd[i / 8]), _mm256_cvtepi32_ps(p), fsum);
    }
    return hsum8(fsum);
#else
    float sum = 0.f;
    for (int i = 0; i < K / 32; i++) {
        const uint8_t *blk = row + i * 18;
        const int8_t *x = xq + 32 * i;
        int32_t s = 0;
        for (int l = 0; l < 16; l++) s += KVALUES_IQ4NL[blk[2 + l] & 15] * x[l] + KVALUES_IQ4NL[blk[2 + l] >> 4] * x[l + 16];
        sum += f16(blk) * xd[i / 8] * (float)s;
    }
    return sum;
#endif
}
