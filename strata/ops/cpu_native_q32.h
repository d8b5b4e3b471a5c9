/* The dot products of the older 32-weight block formats Q4_0, Q4_1, Q5_0 and Q5_1 (cpu_native.c includes this
   header: f16, hsum8 and PREFETCH_AHEAD come from there). llama.cpp's quantizer writes them where a K-quant's
   256-weight blocks do not fit a row: GLM-4.5-Air's 1,408-wide expert down projections become Q5_0 in a Q4_K_M
   file, Q5_1 in a Q5_K_M one, Q4_0 in Q2_K / Q3_K files. Layouts (gguf-py's):

   Q4_0  18 bytes: f16 d, 16 bytes of nibbles (low: weights 0-15, high: 16-31); w = d (q - 8)
   Q4_1  20 bytes: f16 d, f16 m, the nibbles; w = d q + m
   Q5_0  22 bytes: f16 d, u32 qh (bit i: weight i's fifth bit), the nibbles; w = d (q - 16)
   Q5_1  24 bytes: f16 d, f16 m, u32 qh, the nibbles; w = d q + m

   Per block: d times the unsigned values . x8 (maddubs: 2 * 31 * 127 cannot saturate) plus, from the activations'
   sum over the block, -8 d, -16 d or m times it. Like Q8_0's, a block lies within one 256-block of activations
   (scale xd[i / 8]); rows are multiples of 32. */

#if defined(__AVX2__) && defined(__FMA__)
/* a block's 32 values: the 16 nibble bytes at q (low nibbles weights 0-15, high 16-31), with qh's bit i OR-ed in
   as 16 for weight i when FIVE */
static inline __m256i q32_values(const uint8_t *q, uint32_t qh, int five) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i b = _mm_loadu_si128((const __m128i *)q);
    __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m4), _mm_and_si128(b, m4));
    if (five) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
        v = _mm256_or_si256(v, _mm256_maskz_mov_epi8((__mmask32)qh, _mm256_set1_epi8(0x10)));
#else
        const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
        const __m256i bits = _mm256_set1_epi64x(0x8040201008040201LL);
        __m256i m = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), spread);
        m = _mm256_cmpeq_epi8(_mm256_and_si256(m, bits), bits);
        v = _mm256_or_si256(v, _mm256_and_si256(m, _mm256_set1_epi8(0x10)));
#endif
    }
    return v;
}
#endif

static inline uint32_t q32_qh(const uint8_t *p) { uint32_t v; __builtin_memcpy(&v, p, 4); return v; }

/* fmt: 0 Q4_0, 1 Q4_1, 2 Q5_0, 3 Q5_1 (bytes 18, 20, 22, 24); xs: the activations' sums per 32 */
static inline __attribute__((always_inline)) float dot_q32(int fmt, const uint8_t *row, int K, const int8_t *xq,
                                                             const float *xd, const int32_t *xs) {
    const int size = 18 + 2 * fmt, has_m = fmt == 1 || fmt == 3, five = fmt >= 2;
    const int qoff = 2 + 2 * has_m + 4 * five;  /* the nibbles' offset */
    const int32_t bias = fmt == 0 ? 8 : fmt == 2 ? 16 : 0;
    float extra = 0.f;  /* the m terms (Q4_1, Q5_1) */
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 fsum = _mm256_setzero_ps();
    int i = 0;
#if defined(__F16C__)
    /* eight blocks (one 256-block of activations) at a time: their integer sums reduced into one vector, so the
       scales, the offsets and the m terms take one conversion and one multiply-add for all eight */
    for (; i + 8 <= K / 32; i += 8) {
        const uint8_t *b0 = row + (long)i * size;
        PREFETCH_AHEAD(b0, K / 32 * size, 8 * size);
        __m256i p[8];
        for (int k = 0; k < 8; k++) {
            const uint8_t *blk = b0 + k * size;
            const __m256i v = q32_values(blk + qoff, five ? q32_qh(blk + 2 + 2 * has_m) : 0, five);
            p[k] = _mm256_madd_epi16(_mm256_maddubs_epi16(v, _mm256_loadu_si256((const __m256i *)(xq + 32 * (i + k)))),
                                     ones);
        }
        __m256i sums = sum8x8(p);
        const __m256i xs8 = _mm256_loadu_si256((const __m256i *)(xs + i));
        if (bias) sums = _mm256_sub_epi32(sums, _mm256_mullo_epi32(xs8, _mm256_set1_epi32(bias)));
        const __m256 x8 = _mm256_set1_ps(xd[i / 8]);
        fsum = _mm256_fmadd_ps(_mm256_mul_ps(f16x8(b0, size, 0), x8), _mm256_cvtepi32_ps(sums), fsum);
        if (has_m) fsum = _mm256_fmadd_ps(_mm256_mul_ps(f16x8(b0, size, 2), x8), _mm256_cvtepi32_ps(xs8), fsum);
    }
#endif
    for (; i < K / 32; i++) {
        const uint8_t *blk = row + (long)i * size;
        if ((i & 3) == 0) PREFETCH_AHEAD(blk, K / 32 * size, 4 * size);
        const __m256i v = q32_values(blk + qoff, five ? q32_qh(blk + 2 + 2 * has_m) : 0, five);
        __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(v, _mm256_loadu_si256((const __m256i *)(xq + 32 * i))),
                                      ones);
        if (bias) p = _mm256_sub_epi32(p, _mm256_setr_epi32(bias * xs[i], 0, 0, 0, 0, 0, 0, 0));
        fsum = _mm256_fmadd_ps(_mm256_set1_ps(f16(blk) * xd[i / 8]), _mm256_cvtepi32_ps(p), fsum);
        if (has_m) extra += f16(blk + 2) * xd[i / 8] * (float)xs[i];
    }
    return hsum8(fsum) + extra;
#else
    float sum = 0.f;
    for (int i = 0; i < K / 32; i++) {
        const uint8_t *blk = row + (long)i * size, *q = blk + qoff;
        const uint32_t qh = five ? q32_qh(blk + 2 + 2 * has_m) : 0;
        const int8_t *x = xq + 32 * i;
        int32_t s = 0;
        for (int l = 0; l < 16; l++)
            s += (int32_t)((q[l] & 15) | (((qh >> l) & 1) << 4)) * x[l]
               + (int32_t)((q[l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) * x[l + 16];
        sum += f16(blk) * xd[i / 8] * (float)(s - bias * xs[i]);
        if (has_m) extra += f16(blk + 2) * xd[i / 8] * (float)xs[i];
    }
    return sum + extra;
#endif
}
