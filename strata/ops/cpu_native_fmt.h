/* The Q5_K and MXFP4 dot products of cpu_native.c, which includes this header after dot_q4k (one compilation
   unit: f16, hsum8, q4k_scales and PREFETCH_AHEAD come from there). */

/* Q5_K (176 bytes / 256 weights): Q4_K's d, dmin and 12 bytes of 6-bit scales and mins, then qh[32] (the fifth
   bits) and the 128 nibble bytes. For j = 0..3, byte l of qs + 32j holds weight l of sub-block 2j (low nibble)
   and of 2j+1 (high nibble); their fifth bits are bits 2j and 2j+1 of qh[l]. w = d * sc * q - dmin * m with q in
   0..31: Q4_K's sums with q widened by 16 * bit (maddubs still cannot saturate: 2 * 31 * 127 < 32767). */
static float dot_q5k(const uint8_t *row, int nb, const int8_t *xq, const float *xd, const int32_t *xs) {
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i m4 = _mm256_set1_epi8(0x0F), m16 = _mm256_set1_epi8(0x10);
    __m256 fsum = _mm256_setzero_ps(), fmin = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 176;
        PREFETCH_AHEAD(blk, nb * 176, 176);
        uint8_t sc[8], mn[8];
        q4k_scales(blk + 4, sc, mn);
        const uint8_t *qs = blk + 48;
        const int8_t *q8 = xq + b * 256;
        __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 16));
        __m256i acc = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            /* h holds qh >> 2j: its bit 0 goes to bit 4 of the low nibble's value, bit 1 to the high one's (the
               16-bit shifts move bits across bytes, but the 0x10 mask keeps only each byte's own) */
            __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_or_si256(_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m16));
            __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                                         _mm256_and_si256(_mm256_slli_epi16(h, 3), m16));
            h = _mm256_srli_epi16(h, 2);
            __m256i plo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(q8 + 64 * j)));
            __m256i phi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(q8 + 64 * j + 32)));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(plo, _mm256_set1_epi16(sc[2 * j])));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(phi, _mm256_set1_epi16(sc[2 * j + 1])));
        }
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
        const uint8_t *blk = row + b * 176;
        uint8_t sc[8], mn[8];
        q4k_scales(blk + 4, sc, mn);
        const uint8_t *qh = blk + 16, *qs = blk + 48;
        const int8_t *q8 = xq + b * 256;
        int32_t isum = 0, msum = 0;
        for (int j = 0; j < 4; j++) {
            int32_t dlo = 0, dhi = 0;
            for (int i = 0; i < 32; i++) {
                dlo += ((qs[32 * j + i] & 0xF) | ((qh[i] >> (2 * j) & 1) << 4)) * q8[64 * j + i];
                dhi += ((qs[32 * j + i] >> 4) | ((qh[i] >> (2 * j + 1) & 1) << 4)) * q8[64 * j + 32 + i];
            }
            isum += sc[2 * j] * dlo + sc[2 * j + 1] * dhi;
        }
        for (int j = 0; j < 8; j++) msum += mn[j] * xs[b * 8 + j];
        sum += xd[b] * (f16(blk) * (float)isum - f16(blk + 2) * (float)msum);
    }
    return sum;
#endif
}

/* MXFP4 (17 bytes / 32 weights): an E8M0 exponent byte e, then 16 bytes of 4-bit codes (low nibbles weights
   0-15, high nibbles 16-31); w = 2^(e-128) * kvalues[code] with the E2M1 values doubled (int8, as llama.cpp and
   gguf-py store them). The scale is gguf-py's e8m0_to_fp32_half bit for bit: e < 2 gives the subnormals 2^-128 and
   2^-127, every e a power of two (so a product with it is exact unless it underflows). */
static const int8_t KVALUES_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline float e8m0_half(uint8_t e) {
    uint32_t u = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f; __builtin_memcpy(&f, &u, 4); return f;
}

#if defined(__AVX2__) && defined(__FMA__)
/* the scales as a table: a broadcast from memory per block instead of the branch and shifts (24 -> 21 cycles a
   super-block in L1 on Zen 4) */
static float E8M0_HALF[256];
__attribute__((constructor)) static void e8m0_table(void) {
    for (int e = 0; e < 256; e++) E8M0_HALF[e] = e8m0_half((uint8_t)e);
}
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
/* With VNNI the codes look up kvalues + 12 (unsigned 0..24) and one dpbusd multiplies them by the signed
   activations and sums each 4; the block's -12 * (sum of its activations) seeds lane 0. Same integer sum as the
   sign trick, 3 instructions fewer a block: 21 -> 17.5 cycles a super-block in L1, 7-12% more GB/s from RAM at
   one thread on Zen 4. (512-bit steps of two blocks measured slower: 20.7.) */
#define MXFP4_VNNI 1
static const int8_t KVALUES_MXFP4_U[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
#endif
#endif

/* nblk (8 but in a row's partial tail) blocks of 32 weights from blk . the activations x (xs: their sums per 32),
   each block's integer sum times its scale, in 8 float lanes */
#if defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) __m256 mxfp4_blocks(const uint8_t *blk, const int8_t *x,
                                                                 const int32_t *xs, int nblk) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
#if defined(MXFP4_VNNI)
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KVALUES_MXFP4_U));
#else
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KVALUES_MXFP4));
    (void)xs;
#endif
    const __m256i nib = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);  /* low nibbles in lane 0, high in lane 1 */
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < nblk; i++) {
        const uint8_t *q = blk + 17 * i;
        /* the 16 code bytes in both lanes, shifted by 0 and 4: the block's 32 codes in weight order */
        __m256i c = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(q + 1)));
        __m256i w = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srlv_epi32(c, nib), m4));
        __m256i xv = _mm256_loadu_si256((const __m256i *)(x + 32 * i));
#if defined(MXFP4_VNNI)
        __m256i p = _mm256_dpbusd_epi32(_mm256_zextsi128_si256(_mm_cvtsi32_si128(-12 * xs[i])), w, xv);
#else
        __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w)), ones);
#endif
        acc = _mm256_fmadd_ps(_mm256_broadcast_ss(E8M0_HALF + q[0]), _mm256_cvtepi32_ps(p), acc);
    }
    return acc;
}
#else
static inline float mxfp4_blocks(const uint8_t *blk, const int8_t *x, int nblk) {
    float acc = 0.f;
    for (int i = 0; i < nblk; i++) {
        const uint8_t *q = blk + 17 * i;
        const int8_t *xi = x + 32 * i;
        int32_t s = 0;
        for (int l = 0; l < 16; l++)
            s += KVALUES_MXFP4[q[1 + l] & 15] * xi[l] + KVALUES_MXFP4[q[1 + l] >> 4] * xi[l + 16];
        acc += e8m0_half(q[0]) * (float)s;
    }
    return acc;
}
#endif

/* a row of K weights (K / 32 blocks, K a multiple of 32): per 256 activations (one scale xd[b]) 8 blocks, and
   where K is not a multiple of 256 a last, partial group of tail = (K % 256) / 32 blocks under its own scale; xs:
   the activations' sums per 32. Two copies (tail 0 a constant in one): rows of whole super-blocks keep the loop
   without the tail's set-up (one token through a 2048 x 768 expert: 1-2% faster than one copy on Zen 4). */
static inline __attribute__((always_inline)) float mxfp4_row(const uint8_t *row, int K, int tail, const int8_t *xq,
                                                             const float *xd, const int32_t *xs) {
    const int nb = K / 256;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 fsum = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 136;  /* 8 blocks of 17 bytes per 256 activations */
        PREFETCH_AHEAD(blk, K / 32 * 17, 136);
        fsum = _mm256_fmadd_ps(_mm256_set1_ps(xd[b]), mxfp4_blocks(blk, xq + 256 * b, xs + 8 * b, 8), fsum);
    }
    if (tail) {
        const uint8_t *blk = row + nb * 136;
        PREFETCH_AHEAD(blk, K / 32 * 17, tail * 17);
        fsum = _mm256_fmadd_ps(_mm256_set1_ps(xd[nb]), mxfp4_blocks(blk, xq + 256 * nb, xs + 8 * nb, tail), fsum);
    }
    return hsum8(fsum);
#else
    (void)xs;
    float sum = 0.f;
    for (int b = 0; b < nb; b++) sum += xd[b] * mxfp4_blocks(row + b * 136, xq + 256 * b, 8);
    if (tail) sum += xd[nb] * mxfp4_blocks(row + nb * 136, xq + 256 * nb, tail);
    return sum;
#endif
}

static float dot_mxfp4(const uint8_t *row, int K, const int8_t *xq, const float *xd, const int32_t *xs) {
    return mxfp4_row(row, K, 0, xq, xd, xs);  /* K a multiple of 256 */
}

static float dot_mxfp4_tail(const uint8_t *row, int K, const int8_t *xq, const float *xd, const int32_t *xs) {
    return mxfp4_row(row, K, K % 256 / 32, xq, xd, xs);
}
