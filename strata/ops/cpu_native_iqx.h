/* The IQ2_XS, IQ3_S, IQ1_S and IQ1_M dot products of cpu_native.c, which includes this header after
   cpu_native_iq.h and cpu_native_iq2s.h (one compilation unit: f16, hsum8, PREFETCH_AHEAD, u32le, tab4x64, SIGNS64
   and iq2s_signed come from there). These are the i-quants of llama.cpp's IQ2_XS / IQ3_S / IQ3_M / IQ1_S / IQ1_M files and of Unsloth's
   lowest UD mixes. Each spells a group of weights as an index into a grid of magnitudes (gguf-py's grids, copied
   once by strata_native_tables_x), so a 32-weight sub-block is four (IQ2_XS, IQ1_*) or eight (IQ3_S) scalar table
   loads, one maddubs of the magnitudes by the sign-applied int8 activations, and one madd by the odd scales.

   IQ2_XS  74 bytes / 256: f16 d, 32 u16 (a 9-bit grid index and a 7-bit sign index for 8 weights each), 8 scale
           bytes (low nibble: the sub-block's first 16 weights, high: the last 16); w = d (2s + 1) / 8 grid sign
   IQ3_S  110 bytes / 256: f16 d, 64 index bytes (4 weights each) whose 9th bits are the 8 qh bytes (bit l of qh[j]:
           index 8j + l), 32 sign bytes (bit k of byte i: weight 8i + k), 4 scale bytes (two nibbles: sub-blocks 2i,
           2i + 1); w = d (2s + 1) grid sign
   IQ1_S   50 bytes / 256: f16 d, 32 index bytes, 8 u16 qh (a sub-block's four 3-bit index tops at bits 3l, its
           3-bit scale at bits 12-14, the sign of its delta at bit 15); w = d (2s + 1) (grid + delta), grid in
           {-1, 0, 1}, delta = +-1/8
   IQ1_M   56 bytes / 256: 32 index bytes, 16 qh bytes (a nibble per group of 8: 3 index bits, the delta's sign),
           4 u16 of four 3-bit scales each (one per 16 weights) whose top nibbles make up the f16 d
   For the IQ1 formats 8 (grid + delta) = 8 grid +- 1 is an odd integer in -9..9: the table holds 8 grid as int8, the
   delta is added as +-1 bytes, and the products go through maddubs as |w| times x signed by w, all in integers;
   d / 8 is applied once a super-block. */

static uint64_t IQ2XS_GRID[512];   /* byte i: the entry's weight i (magnitudes 8, 25, 43) */
static uint32_t IQ3S_GRID[512];    /* byte i: the entry's weight i (odd magnitudes 1..15) */
static uint64_t IQ1_GRID8[2048];   /* byte i: 8 x the entry's weight i as int8 (-8, 0, 8) */

void strata_native_tables_x(const uint8_t *iq2xs_grid, const uint8_t *iq3s_grid, const int8_t *iq1_grid) {
    for (int i = 0; i < 512; i++) {
        uint64_t g = 0; uint32_t h = 0;
        for (int k = 0; k < 8; k++) g |= (uint64_t)iq2xs_grid[8 * i + k] << (8 * k);
        for (int k = 0; k < 4; k++) h |= (uint32_t)iq3s_grid[4 * i + k] << (8 * k);
        IQ2XS_GRID[i] = g; IQ3S_GRID[i] = h;
    }
    for (int i = 0; i < 2048; i++) {
        uint64_t g = 0;
        for (int k = 0; k < 8; k++) g |= (uint64_t)(uint8_t)(int8_t)(8 * iq1_grid[8 * i + k]) << (8 * k);
        IQ1_GRID8[i] = g;
    }
}

static inline uint32_t u16le(const uint8_t *p) { return (uint32_t)p[0] | ((uint32_t)p[1] << 8); }

/* IQ3_S grid index l (0..7) of sub-block j: its index byte and the 9th bit from qh[j] */
static inline uint32_t iq3s_idx(const uint8_t *blk, int j, int l) {
    return blk[2 + 8 * j + l] | (((uint32_t)blk[66 + j] << (8 - l)) & 256);
}

/* IQ1_S sub-block j's index l (0..3), and IQ1_M group k's index (its qh nibble's low 3 bits) */
static inline uint32_t iq1s_idx(const uint8_t *blk, uint32_t qh, int j, int l) {
    return blk[2 + 4 * j + l] | (((qh >> (3 * l)) & 7) << 8);
}
static inline uint32_t iq1m_nib(const uint8_t *blk, int k) { return (blk[32 + k / 2] >> (4 * (k % 2))) & 15; }

/* IQ1_M's f16 d from the top nibbles of its four scale words, as float */
static inline float iq1m_d(const uint8_t *blk) {
    const uint32_t s0 = u16le(blk + 48), s1 = u16le(blk + 50), s2 = u16le(blk + 52), s3 = u16le(blk + 54);
    const uint32_t bits = (s0 >> 12) | ((s1 >> 8) & 0xF0) | ((s2 >> 4) & 0xF00) | (s3 & 0xF000);
    const uint8_t h[2] = {(uint8_t)bits, (uint8_t)(bits >> 8)};
    return f16(h);
}

/* IQ1_M's 3-bit scale of sub-block j's half h */
static inline int iq1m_scale(const uint8_t *blk, int j, int h) {
    return (int)((u16le(blk + 48 + 2 * (j / 2)) >> (6 * (j % 2) + 3 * h)) & 7);
}

#if defined(__AVX2__) && defined(__FMA__)
/* int16 lanes 0-7 a, lanes 8-15 b: the scales of a sub-block's two halves of 16 weights */
static inline __m256i halves16(int a, int b) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16((short)a)), _mm_set1_epi16((short)b), 1);
}

static float dot_iq2xs(const uint8_t *row, int nb, const int8_t *xq, const float *xd) {
    __m256 fsum = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (long)b * 74;
        PREFETCH_AHEAD(blk, nb * 74, 74);
        const int8_t *x = xq + 256 * b;
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const uint8_t *q = blk + 2 + 8 * j;
            const uint32_t a = u16le(q), c = u16le(q + 2), e = u16le(q + 4), f = u16le(q + 6), sc = blk[66 + j];
            const __m256i g = tab4x64(IQ2XS_GRID, a & 511, c & 511, e & 511, f & 511);
            const __m256i xs = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(x + 32 * j)),
                                                tab4x64(SIGNS64, a >> 9, c >> 9, e >> 9, f >> 9));
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(g, xs),
                                                halves16(2 * (int)(sc & 15) + 1, 2 * (int)(sc >> 4) + 1));
            if (j % 2) s1 = _mm256_add_epi32(s1, p); else s0 = _mm256_add_epi32(s0, p);
        }
        fsum = _mm256_fmadd_ps(_mm256_set1_ps(f16(blk) * xd[b] * 0.125f),
                               _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), fsum);
    }
    return hsum8(fsum);
}

/* a super-block's 64 IQ3_S grid indices (index byte | the 9th bit from qh) as uint16, in vectors: lane i of the
   16-lane step c takes qh[2c + i / 8], times 2^(8 - i % 8), its bit i % 8 then at bit 8 */
static inline void iq3s_prep(const uint8_t *blk, uint16_t *idx) {
    const __m256i qh = _mm256_broadcastsi128_si256(_mm_loadl_epi64((const __m128i *)(blk + 66)));
    const __m256i pw = _mm256_setr_epi16(256, 128, 64, 32, 16, 8, 4, 2, 256, 128, 64, 32, 16, 8, 4, 2);
    for (int c = 0; c < 4; c++) {
        const __m256i sel = _mm256_setr_epi8(2 * c, -1, 2 * c, -1, 2 * c, -1, 2 * c, -1, 2 * c, -1, 2 * c, -1,
                                             2 * c, -1, 2 * c, -1, 2 * c + 1, -1, 2 * c + 1, -1, 2 * c + 1, -1,
                                             2 * c + 1, -1, 2 * c + 1, -1, 2 * c + 1, -1, 2 * c + 1, -1, 2 * c + 1, -1);
        const __m256i hb = _mm256_and_si256(_mm256_mullo_epi16(_mm256_shuffle_epi8(qh, sel), pw),
                                            _mm256_set1_epi16(256));
        const __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2 + 16 * c)));
        _mm256_store_si256((__m256i *)(idx + 16 * c), _mm256_or_si256(lo, hb));
    }
}

static float dot_iq3s(const uint8_t *row, int nb, const int8_t *xq, const float *xd) {
    __m256 fsum = _mm256_setzero_ps();
    uint16_t idx[64] __attribute__((aligned(32)));
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (long)b * 110;
        PREFETCH_AHEAD(blk, nb * 110, 110);
        const int8_t *x = xq + 256 * b;
        iq3s_prep(blk, idx);
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const uint16_t *ix = idx + 8 * j;
            __m128i lo = _mm_cvtsi32_si128((int)IQ3S_GRID[ix[0]]), hi = _mm_cvtsi32_si128((int)IQ3S_GRID[ix[4]]);
            lo = _mm_insert_epi32(lo, (int)IQ3S_GRID[ix[1]], 1); hi = _mm_insert_epi32(hi, (int)IQ3S_GRID[ix[5]], 1);
            lo = _mm_insert_epi32(lo, (int)IQ3S_GRID[ix[2]], 2); hi = _mm_insert_epi32(hi, (int)IQ3S_GRID[ix[6]], 2);
            lo = _mm_insert_epi32(lo, (int)IQ3S_GRID[ix[3]], 3); hi = _mm_insert_epi32(hi, (int)IQ3S_GRID[ix[7]], 3);
            const __m256i g = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
            const __m256i xs = iq2s_signed(_mm256_loadu_si256((const __m256i *)(x + 32 * j)), u32le(blk + 74 + 4 * j));
            const int s = 2 * ((blk[106 + j / 2] >> (4 * (j % 2))) & 15) + 1;
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(g, xs), _mm256_set1_epi16((short)s));
            if (j % 2) s1 = _mm256_add_epi32(s1, p); else s0 = _mm256_add_epi32(s0, p);
        }
        fsum = _mm256_fmadd_ps(_mm256_set1_ps(f16(blk) * xd[b]), _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), fsum);
    }
    return hsum8(fsum);
}

/* 32 weights w (odd int8, -9..9) times the activations: |w| . (x signed by w) */
static inline __m256i iq1_prod(__m256i w, const int8_t *x) {
    return _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x), w));
}

/* a super-block's 32 IQ1_S grid indices as uint32, in vectors: index 8v + t (sub-block j = 2v + t / 4, group
   l = t % 4) = its byte | (bits 3l.. of qh[j]) << 8, the two qh words of a vector shifted lane by lane (128
   scalar operations a super-block otherwise) */
static inline void iq1s_prep(const uint8_t *blk, uint32_t *idx) {
    const __m256i sh = _mm256_setr_epi32(0, 3, 6, 9, 16, 19, 22, 25), seven = _mm256_set1_epi32(7);
    for (int v = 0; v < 4; v++) {
        const __m256i hw = _mm256_set1_epi32((int)u32le(blk + 34 + 4 * v));  /* qh[2v] | qh[2v + 1] << 16 */
        const __m256i top = _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(hw, sh), seven), 8);
        const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * v)));
        _mm256_store_si256((__m256i *)(idx + 8 * v), _mm256_or_si256(lo, top));
    }
}

static float dot_iq1s(const uint8_t *row, int nb, const int8_t *xq, const float *xd) {
    __m256 fsum = _mm256_setzero_ps();
    uint32_t idx[32] __attribute__((aligned(32)));
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (long)b * 50;
        PREFETCH_AHEAD(blk, nb * 50, 50);
        const int8_t *x = xq + 256 * b;
        iq1s_prep(blk, idx);
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const uint32_t qh = u16le(blk + 34 + 2 * j);
            const uint32_t *ix = idx + 4 * j;
            const __m256i g = tab4x64(IQ1_GRID8, ix[0], ix[1], ix[2], ix[3]);
            const __m256i w = _mm256_add_epi8(g, _mm256_set1_epi8(qh & 0x8000 ? -1 : 1));
            const __m256i p = _mm256_madd_epi16(iq1_prod(w, x + 32 * j),
                                                _mm256_set1_epi16((short)(2 * ((qh >> 12) & 7) + 1)));
            if (j % 2) s1 = _mm256_add_epi32(s1, p); else s0 = _mm256_add_epi32(s0, p);
        }
        fsum = _mm256_fmadd_ps(_mm256_set1_ps(f16(blk) * xd[b] * 0.125f),
                               _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), fsum);
    }
    return hsum8(fsum);
}

/* a super-block's 32 IQ1_M grid indices as uint16 and its groups' delta signs (0: +, 1: -) as bytes: the 16 qh
   bytes' nibbles in group order (group 2i + t: nibble t of byte i), index = byte | (nibble & 7) << 8 */
static inline void iq1m_prep(const uint8_t *blk, uint16_t *idx, uint8_t *neg) {
    const __m128i qh = _mm_loadu_si128((const __m128i *)(blk + 32)), f = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(qh, f), hi = _mm_and_si128(_mm_srli_epi16(qh, 4), f);
    const __m256i nib = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(lo, hi)),
                                                _mm_unpackhi_epi8(lo, hi), 1);  /* byte k: group k's nibble */
    _mm256_store_si256((__m256i *)neg, _mm256_and_si256(_mm256_srli_epi16(nib, 3), _mm256_set1_epi8(1)));
    const __m256i top = _mm256_and_si256(nib, _mm256_set1_epi8(7));
    for (int c = 0; c < 2; c++) {
        const __m256i t = _mm256_cvtepu8_epi16(c ? _mm256_extracti128_si256(top, 1) : _mm256_castsi256_si128(top));
        const __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 16 * c)));
        _mm256_store_si256((__m256i *)(idx + 16 * c), _mm256_or_si256(q, _mm256_slli_epi16(t, 8)));
    }
}

static float dot_iq1m(const uint8_t *row, int nb, const int8_t *xq, const float *xd) {
    static const uint64_t delta[2] = {0x0101010101010101ULL, 0xFFFFFFFFFFFFFFFFULL};  /* +1, -1 bytes */
    __m256 fsum = _mm256_setzero_ps();
    uint16_t idx[32] __attribute__((aligned(32)));
    uint8_t neg[32] __attribute__((aligned(32)));
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (long)b * 56;
        PREFETCH_AHEAD(blk, nb * 56, 56);
        const int8_t *x = xq + 256 * b;
        iq1m_prep(blk, idx, neg);
        uint64_t sw;  /* the four scale words: scale 4u + t at bits 16u + 3t */
        __builtin_memcpy(&sw, blk + 48, 8);
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const uint16_t *ix = idx + 4 * j;
            const uint8_t *ng = neg + 4 * j;
            const __m256i g = tab4x64(IQ1_GRID8, ix[0], ix[1], ix[2], ix[3]);
            const __m256i w = _mm256_add_epi8(g, tab4x64(delta, ng[0], ng[1], ng[2], ng[3]));
            const int sh = 16 * (j / 2) + 6 * (j % 2);
            const __m256i p = _mm256_madd_epi16(iq1_prod(w, x + 32 * j),
                                                halves16(2 * (int)((sw >> sh) & 7) + 1, 2 * (int)((sw >> (sh + 3)) & 7) + 1));
            if (j % 2) s1 = _mm256_add_epi32(s1, p); else s0 = _mm256_add_epi32(s0, p);
        }
        fsum = _mm256_fmadd_ps(_mm256_set1_ps(iq1m_d(blk) * xd[b] * 0.125f),
                               _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), fsum);
    }
    return hsum8(fsum);
}
#else
/* the plain C loops: the same integer sums per super-block */
static inline int i8at(uint64_t s, int k) { return (int8_t)(uint8_t)(s >> (8 * k)); }  /* byte k as int8 */

static float dot_iq2xs(const uint8_t *row, int nb, const int8_t *xq, const float *xd) {
    float sum = 0.f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (long)b * 74;
        const int8_t *x = xq + 256 * b;
        int32_t isum = 0;
        for (int j = 0; j < 8; j++)
            for (int l = 0; l < 4; l++) {
                const uint32_t q = u16le(blk + 2 + 8 * j + 2 * l);
                const uint64_t g = IQ2XS_GRID[q & 511], s = SIGNS64[q >> 9];
                int32_t dot = 0;
                for (int k = 0; k < 8; k++) dot += (int)((g >> (8 * k)) & 255) * i8at(s, k) * x[32 * j + 8 * l + k];
                isum += (2 * ((blk[66 + j] >> (4 * (l / 2))) & 15) + 1) * dot;
            }
        sum += f16(blk) * xd[b] * 0.125f * (float)isum;
    }
    return sum;
}

static float dot_iq3s(const uint8_t *row, int nb, const int8_t *xq, const float *xd) {
    float sum = 0.f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (long)b * 110;
        const int8_t *x = xq + 256 * b;
        int32_t isum = 0;
        for (int j = 0; j < 8; j++) {
            int32_t dot = 0;
            for (int l = 0; l < 8; l++) {
                const uint32_t g = IQ3S_GRID[iq3s_idx(blk, j, l)];
                for (int k = 0; k < 4; k++) {
                    const int w = 4 * l + k, neg = (blk[74 + 4 * j + w / 8] >> (w % 8)) & 1;
                    dot += (int)((g >> (8 * k)) & 255) * (neg ? -1 : 1) * x[32 * j + w];
                }
            }
            isum += (2 * ((blk[106 + j / 2] >> (4 * (j % 2))) & 15) + 1) * dot;
        }
        sum += f16(blk) * xd[b] * (float)isum;
    }
    return sum;
}

static float dot_iq1s(const uint8_t *row, int nb, const int8_t *xq, const float *xd) {
    float sum = 0.f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (long)b * 50;
        const int8_t *x = xq + 256 * b;
        int32_t isum = 0;
        for (int j = 0; j < 8; j++) {
            const uint32_t qh = u16le(blk + 34 + 2 * j);
            const int dl = qh & 0x8000 ? -1 : 1;
            int32_t dot = 0;
            for (int l = 0; l < 4; l++) {
                const uint64_t g = IQ1_GRID8[iq1s_idx(blk, qh, j, l)];
                for (int k = 0; k < 8; k++) dot += (i8at(g, k) + dl) * x[32 * j + 8 * l + k];
            }
            isum += (int32_t)(2 * ((qh >> 12) & 7) + 1) * dot;
        }
        sum += f16(blk) * xd[b] * 0.125f * (float)isum;
    }
    return sum;
}

static float dot_iq1m(const uint8_t *row, int nb, const int8_t *xq, const float *xd) {
    float sum = 0.f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (long)b * 56;
        const int8_t *x = xq + 256 * b;
        int32_t isum = 0;
        for (int j = 0; j < 8; j++)
            for (int l = 0; l < 4; l++) {
                const uint32_t n = iq1m_nib(blk, 4 * j + l);
                const uint64_t g = IQ1_GRID8[blk[4 * j + l] | ((n & 7) << 8)];
                const int dl = n & 8 ? -1 : 1;
                int32_t dot = 0;
                for (int k = 0; k < 8; k++) dot += (i8at(g, k) + dl) * x[32 * j + 8 * l + k];
                isum += (2 * iq1m_scale(blk, j, l / 2) + 1) * dot;
            }
        sum += iq1m_d(blk) * xd[b] * 0.125f * (float)isum;
    }
    return sum;
}
#endif
