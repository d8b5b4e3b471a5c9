/* The IQ2_XXS / IQ3_XXS dot products of cpu_native.c, which includes this header where they are used (one
   compilation unit: f16, hsum8 and PREFETCH_AHEAD come from there), and the grid tables of these and IQ2_S
   (whose dot product is in cpu_native_iq2s.h). */

/* IQ2_XXS (66 bytes / 256) and IQ3_XXS (98 bytes / 256) spell each group of 8 (IQ2) or 4 (IQ3) weights as an index
   into a grid of unsigned magnitudes, with the signs of 8 weights as a 7-bit index into a sign table (the 8th sign
   makes the count of minus signs even). The grids and the sign table are gguf-py's (strata_native_tables, called
   once after loading): magnitudes times the sign-applied int8 activations go through maddubs as for Q4_K.
   IQ2_XXS sub-block j: u32 a = 4 grid bytes, u32 b = 4 sign indices (7 bits each) and the scale s = b >> 28;
   w = d * (2s + 1) / 8 * grid * sign. IQ3_XXS: 64 bytes of grid indices (8 a sub-block), then a u32 per
   sub-block with the 4 sign indices and s; w = d * (2s + 1) / 4 * grid * sign. */
static uint64_t IQ2XXS_GRID[256];  /* byte i: the magnitude of the entry's weight i */
static uint32_t IQ3XXS_GRID[256];
static uint64_t SIGNS64[128];      /* a sign index's 8 signs as bytes +1 (0x01) or -1 (0xFF) */
static uint64_t IQ2S_GRID[1024];   /* IQ2_S's own grid (magnitudes 8, 25, 43), byte i: the entry's weight i */
/* IQ2_XXS's grid has three magnitudes (8, 25, 43): IQ2_CODES[h][i] packs entry i's bytes 4h..4h+3 as 2-bit codes
   (byte 4h+k in bits 2k, 2k+1), and IQ2_MAG[v] is the magnitude of code v & 3 (a 64-entry byte permute) */
static uint8_t IQ2_CODES[2][256] __attribute__((aligned(64)));
static uint8_t IQ2_MAG[64] __attribute__((aligned(64)));
/* IQ2_S's grid (the same three magnitudes) likewise: IQ2S_LUT.codes[h][i] the codes of entry i's bytes 4h..4h+3, in
   eight 128-entry chunks (a two-register byte permute each). IQ2S_PAIR (IQ2_XXS's and IQ2_S's): byte permute of the
   two code lookups of two super-blocks' 64 entries (lane e: entry e) into words (entry e's low, high codes), entry
   8m + q of the first in word 4q + m (+32: of the second): a multishift of word m of every qword then cuts the
   codes of entries 8m..8m+7, in order */
struct iq2s_lut {
    uint8_t codes[2][1024];
    uint8_t keys[4][64];  /* chunk c's bits 7, 8 (c & 1, c >> 1) at bits 7, 5 of a byte, as dot_iq2s keys them */
};
static struct iq2s_lut IQ2S_LUT __attribute__((aligned(64)));
static uint8_t IQ2S_PAIR[64] __attribute__((aligned(64)));
/* IQ3_XXS's grid as 4-bit codes, c = (m - 4) / 8 for the magnitudes 4..52 and 15 for 62, so that
   m = 4 ^ 8 c0 ^ 16 c1 ^ 32 c2 ^ 2 c3 (an affine map of the code's bits): IQ3_CODES[h][i] = the codes of entry i's
   bytes 2h, 2h+1; IQ3_CPAIR pairs them into words, entries 16i + 2q + {0, 1} in words 4q + 2i + {0, 1} (i = 0, 1;
   +32 for the second half) */
static uint8_t IQ3_CODES[2][256] __attribute__((aligned(64)));
static uint8_t IQ3_CPAIR[64] __attribute__((aligned(64)));
static uint8_t IQ3_MAG[64] __attribute__((aligned(64)));  /* the magnitude of code v & 15 (a byte permute) */

void strata_native_tables(const uint8_t *iq2xxs_grid, const uint8_t *iq3xxs_grid, const uint8_t *ksigns,
                          const uint8_t *iq2s_grid) {
    for (int i = 0; i < 1024; i++) {
        uint64_t g = 0;
        for (int k = 0; k < 8; k++) g |= (uint64_t)iq2s_grid[8 * i + k] << (8 * k);
        IQ2S_GRID[i] = g;
        for (int h = 0; h < 2; h++) {
            uint8_t c = 0;
            for (int k = 0; k < 4; k++) {
                uint8_t m = iq2s_grid[8 * i + 4 * h + k];
                c |= (uint8_t)((m == 8 ? 0 : m == 25 ? 1 : 2) << (2 * k));
            }
            IQ2S_LUT.codes[h][i] = c;
        }
    }
    for (int c = 0; c < 4; c++)
        for (int b = 0; b < 64; b++) IQ2S_LUT.keys[c][b] = (uint8_t)(0x80 * (c & 1) + 0x20 * (c >> 1));
    for (int b = 0; b < 64; b++) IQ2S_PAIR[b] = (uint8_t)(8 * (b / 2 % 4) + b / 8 + 64 * (b % 2));
    for (int i = 0; i < 256; i++) {
        uint64_t g = 0; uint32_t h = 0;
        for (int k = 0; k < 8; k++) g |= (uint64_t)iq2xxs_grid[8 * i + k] << (8 * k);
        for (int k = 0; k < 4; k++) h |= (uint32_t)iq3xxs_grid[4 * i + k] << (8 * k);
        IQ2XXS_GRID[i] = g; IQ3XXS_GRID[i] = h;
    }
    for (int i = 0; i < 128; i++) {
        uint64_t s = 0;
        for (int k = 0; k < 8; k++) s |= (uint64_t)((ksigns[i] >> k) & 1 ? 0xFF : 0x01) << (8 * k);
        SIGNS64[i] = s;
    }
    for (int v = 0; v < 64; v++) IQ3_MAG[v] = (v & 15) == 15 ? 62 : (v & 15) < 7 ? 4 + 8 * (v & 15) : 0;
    const uint8_t mags[3] = {8, 25, 43};
    for (int v = 0; v < 64; v++) IQ2_MAG[v] = (v & 3) < 3 ? mags[v & 3] : 0;
    for (int i = 0; i < 256; i++)
        for (int h = 0; h < 2; h++) {
            uint8_t c = 0;
            for (int k = 0; k < 2; k++) {
                uint8_t m = iq3xxs_grid[4 * i + 2 * h + k];
                c |= (uint8_t)((m == 62 ? 15 : (m - 4) / 8) << (4 * k));
            }
            IQ3_CODES[h][i] = c;
        }
    for (int b = 0; b < 64; b++) {
        int w = b / 2, q = w / 4, e = 16 * (w % 4 / 2) + 2 * q + w % 2;
        IQ3_CPAIR[b] = (uint8_t)(e + 64 * (b % 2));
    }
    for (int i = 0; i < 256; i++)
        for (int h = 0; h < 2; h++) {
            uint8_t c = 0;
            for (int k = 0; k < 4; k++) {
                uint8_t m = iq2xxs_grid[8 * i + 4 * h + k];
                c |= (uint8_t)((m == 8 ? 0 : m == 25 ? 1 : 2) << (2 * k));
            }
            IQ2_CODES[h][i] = c;
        }
}

static inline uint32_t u32le(const uint8_t *p) { uint32_t v; __builtin_memcpy(&v, p, 4); return v; }

#if defined(__AVX2__) && defined(__FMA__)
/* four 8-byte table entries as one vector, entry k at bytes 8k..8k+7 (scalar loads: gathers are slower on Zen) */
static inline __m256i tab4x64(const uint64_t *t, uint32_t i0, uint32_t i1, uint32_t i2, uint32_t i3) {
    __m128i lo = _mm_insert_epi64(_mm_loadl_epi64((const __m128i *)(t + i0)), (long long)t[i1], 1);
    __m128i hi = _mm_insert_epi64(_mm_loadl_epi64((const __m128i *)(t + i2)), (long long)t[i3], 1);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

static inline __m256i iq3_grid(const uint8_t *i8) {
    __m128i lo = _mm_cvtsi32_si128((int)IQ3XXS_GRID[i8[0]]), hi = _mm_cvtsi32_si128((int)IQ3XXS_GRID[i8[4]]);
    lo = _mm_insert_epi32(lo, (int)IQ3XXS_GRID[i8[1]], 1); hi = _mm_insert_epi32(hi, (int)IQ3XXS_GRID[i8[5]], 1);
    lo = _mm_insert_epi32(lo, (int)IQ3XXS_GRID[i8[2]], 2); hi = _mm_insert_epi32(hi, (int)IQ3XXS_GRID[i8[6]], 2);
    lo = _mm_insert_epi32(lo, (int)IQ3XXS_GRID[i8[3]], 3); hi = _mm_insert_epi32(hi, (int)IQ3XXS_GRID[i8[7]], 3);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

/* The sub-blocks' integer sums, each times its odd scale 2s + 1 (madd by the scale instead of by 1): one
   conversion and one multiply by d a super-block; |sum| <= 8 * 31 * 16 * 2 * 62 * 127 fits an int32. Two
   sub-blocks a step into two accumulators, so the two chains of table loads and products overlap. */
#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__) && defined(__AVX512BITALG__)
/* With AVX-512 the signs and scales of a super-block's 8 sub-blocks come from its 8 sign words at once: a
   multishift cuts each word's four 7-bit sign indices into bytes, the 8th sign is the byte's parity (popcount),
   and each sub-block then negates its activations under a 32-bit mask (two instructions instead of four table
   loads, their inserts and a sign). The scales 2s + 1, as int16 pairs, are read back as broadcasts. */
static inline void iq_signs_scales(__m256i aux, uint32_t *sg, uint32_t *ls) {
    const __m256i ctrl = _mm256_set1_epi64x(0x352E2720150E0700LL);  /* bit offsets 0,7,14,21, 32,39,46,53 */
    __m256i m = _mm256_and_si256(_mm256_multishift_epi64_epi8(ctrl, aux), _mm256_set1_epi8(0x7F));
    __m256i par = _mm256_slli_epi16(_mm256_popcnt_epi8(m), 7);
    _mm256_store_si256((__m256i *)sg, _mm256_ternarylogic_epi32(m, par, _mm256_set1_epi8((char)0x80), 0xF8));
    __m256i l = _mm256_or_si256(_mm256_slli_epi32(_mm256_srli_epi32(aux, 28), 1), _mm256_set1_epi32(1));
    _mm256_store_si256((__m256i *)ls, _mm256_or_si256(l, _mm256_slli_epi32(l, 16)));
}

/* s + the pairwise products of the int16 p and sc, summed into int32 (one instruction with VNNI) */
static inline __m512i iq_madd_add(__m512i s, __m512i p, __m512i sc) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(s, p, sc);
#else
    return _mm512_add_epi32(s, _mm512_madd_epi16(p, sc));
#endif
}

#if defined(__AVX512VNNI__)
/* IQ_PAIR16: int16 lane 2L the low half of dword L of the first operand, 2L + 1 that of the second's. IQ_SC16: the
   word of ls (int32 lane q: sub-block q's 2s + 1 in its low word) for int16 lane 2L, 2L + 1 of steps m, m + 2
   (m = 0: sub-blocks L / 8 and 4 + L / 8; a step pair m adds 4m, super-block u of the pair 16u) */
static const int16_t IQ_PAIR16[32] __attribute__((aligned(64))) = {
    0, 32, 2, 34, 4, 36, 6, 38, 8, 40, 10, 42, 12, 44, 14, 46, 16, 48, 18, 50, 20, 52, 22, 54, 24, 56, 26, 58,
    28, 60, 30, 62};
static const int16_t IQ_SC16[32] __attribute__((aligned(64))) = {
    0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 2, 10, 2, 10, 2, 10, 2, 10, 2, 10, 2, 10, 2, 10, 2, 10};
#endif

/* IQ2_XXS two super-blocks at a time in 512-bit registers: their 64 grid indices (the even u32s of each) look up
   their entries' 2-bit codes (byte permutes of the two code tables), paired into words so that a multishift of word
   m of each qword cuts entries 8m..8m+7 into one code per byte, and an affine map (or a byte permute) turns codes
   into magnitudes; the sign words (the odd u32s) of both give their 512 signs at once, transposed so that one
   bit shuffle makes each step's 64-bit mask (no trip through general registers); then two sub-blocks a step.
   Super-block u of the pair (at bu, against activations xu with scale du) adds into *fu, first u = 0, then u = 1
   unless `one` (f0 and f1 may be the same accumulator: a row's super-blocks in order). The pair may come from two
   rows (their last super-blocks, against the same activations) or be one super-block with itself. */
static inline __attribute__((always_inline)) void iq2xxs_pair(const uint8_t *b0, const uint8_t *b1,
                                                               const int8_t *x0, const int8_t *x1, float d0,
                                                               float d1, int one, __m256 *f0, __m256 *f1) {
    const __m512i mag = _mm512_load_si512(IQ2_MAG);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const __m512i pair0 = _mm512_load_si512(IQ2S_PAIR), pair1 = _mm512_add_epi8(pair0, _mm512_set1_epi8(32));
    /* byte r of qword q: sign byte 8r + q (step r = 4t + m of the pair: super-block t, its weights 64m..64m+63) */
    const __m512i transpose = _mm512_add_epi8(_mm512_set1_epi64(0x3830282018100800LL),
        _mm512_setr_epi64(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL,
                          0x0404040404040404LL, 0x0505050505050505LL, 0x0606060606060606LL, 0x0707070707070707LL));
    const __m512i half = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    (void)mag; (void)half;
    const __m512i q0 = _mm512_loadu_si512(b0 + 2), q1 = _mm512_loadu_si512(b1 + 2);
    /* sub-block j: 4 grid indices (the even u32s), then its u32 of signs and scale (the odd ones) */
    const __m512i idx = _mm512_permutex2var_epi32(q0, even, q1), aux = _mm512_permutex2var_epi32(q0, odd, q1);
    const __mmask64 top = _mm512_movepi8_mask(idx);
    /* the code tables feed the permutes from L1 (an empty asm keeps the compiler from copying them to the stack on
       every call) */
    const uint8_t *t = IQ2_CODES[0];
    __asm__("" : "+r"(t));
    __m512i tb[2][4];
    for (int h = 0; h < 2; h++)
        for (int c = 0; c < 4; c++) tb[h][c] = _mm512_load_si512(t + 256 * h + 64 * c);
    __m512i lo = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(tb[0][0], idx, tb[0][1]),
                                        _mm512_permutex2var_epi8(tb[0][2], idx, tb[0][3]));
    __m512i hi = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(tb[1][0], idx, tb[1][1]),
                                        _mm512_permutex2var_epi8(tb[1][2], idx, tb[1][3]));
    const __m512i codes[2] = {_mm512_permutex2var_epi8(lo, pair0, hi), _mm512_permutex2var_epi8(lo, pair1, hi)};
    /* signs as in iq_signs_scales, 16 sign words at once, then transposed, but without masking the cut bytes' bit 7
       (the next index's bit 0): the parity of all 8 bits xored with that bit is the 7 bits' parity, so the ternary
       logic m ^ (popcnt << 7 & 0x80) keeps bits 0-6 and sets bit 7 (one instruction fewer on the masks' path) */
    const __m512i sm = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x352E2720150E0700LL), aux);
    const __m512i sg = _mm512_permutexvar_epi8(transpose, _mm512_ternarylogic_epi32(
        sm, _mm512_slli_epi16(_mm512_popcnt_epi8(sm), 7), _mm512_set1_epi8((char)0x80), 0x78));
#if defined(__AVX512VNNI__)
    /* 2s + 1 in the low word of int32 lane q (aux >> 27 brings s to bits 1-4; the or replaces bit 0) */
    const __m512i ls = _mm512_or_si512(_mm512_srli_epi32(aux, 27), _mm512_set1_epi32(1));
#else
    const __m512i l = _mm512_or_si512(_mm512_slli_epi32(_mm512_srli_epi32(aux, 28), 1), _mm512_set1_epi32(1));
    const __m512i ls = _mm512_or_si512(l, _mm512_slli_epi32(l, 16));
#endif
    for (int u = 0; u < 2 - one; u++) {
        const int8_t *x = u ? x1 : x0;
        __m512i s = _mm512_setzero_si512(), p[4];
        for (int m = 0; m < 4; m++) {  /* sub-blocks 2m, 2m+1: entries 8m..8m+7 */
            const __mmask64 k = _mm512_bitshuffle_epi64_mask(
                sg, _mm512_set1_epi64(0x0706050403020100LL + 0x0808080808080808LL * (4 * u + m)));
            __m512i xv = _mm512_loadu_si512(x + 64 * m);
            __m512i xs = _mm512_mask_sub_epi8(xv, k, _mm512_setzero_si512(), xv);
            __m512i cut = _mm512_multishift_epi64_epi8(
                _mm512_set1_epi64(0x0E0C0A0806040200LL + 0x1010101010101010LL * m), codes[u]);
#if defined(__GFNI__)
            /* magnitude = 8 ^ 17 c0 ^ 35 c1 of the code's bits c0, c1 (the byte's other bits ignored) */
            __m512i g = _mm512_gf2p8affine_epi64_epi8(cut, _mm512_set1_epi64(0x0302000001020000LL), 8);
#else
            __m512i g = _mm512_permutexvar_epi8(cut, mag);
#endif
#if defined(__AVX512VNNI__)
            p[m] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), g, xs);
#else
            __m512i sc = _mm512_permutexvar_epi32(_mm512_add_epi32(half, _mm512_set1_epi32(8 * u + 2 * m)), ls);
            s = iq_madd_add(s, _mm512_maddubs_epi16(g, xs), sc);
            (void)p;
#endif
        }
#if defined(__AVX512VNNI__)
        /* Each step's 4-weight sums fit an int16 (4 * 43 * 127): steps m and m + 2 share a vector, int16 lanes 2L
           and 2L + 1 holding their lane L, and one multiply-add applies both steps' scales (routed from ls by a
           word permute). The int32 lanes keep their weights, so the sums are the other paths' bit for bit;
           2 instructions fewer a super-block. */
        for (int m = 0; m < 2; m++) {
            const __m512i w = _mm512_permutex2var_epi16(p[m], _mm512_load_si512(IQ_PAIR16), p[m + 2]);
            const __m512i sc = _mm512_permutexvar_epi16(
                _mm512_add_epi16(_mm512_load_si512(IQ_SC16), _mm512_set1_epi16((short)(16 * u + 4 * m))), ls);
            s = _mm512_dpwssd_epi32(s, w, sc);
        }
#endif
        __m256i sumi = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
        __m256 *f = u ? f1 : f0;
        *f = _mm256_fmadd_ps(_mm256_set1_ps(u ? d1 : d0), _mm256_cvtepi32_ps(sumi), *f);
    }
}

/* the float scale of super-block b of a row (its d times the activations' scale, the codes' 1/8) */
#define IQ2XXS_D(blk, b) (f16(blk) * xd[b] * 0.125f)

static float dot_iq2xxs(const uint8_t *row, int nb, const int8_t *xq, const float *xd) {
    __m256 fsum = _mm256_setzero_ps();
    for (int b = 0; b < nb; b += 2) {
        const int one = b + 1 >= nb;
        const uint8_t *b0 = row + (long)b * 66, *b1 = one ? b0 : b0 + 66;
        PREFETCH_AHEAD(b0, nb * 66, 132);
        iq2xxs_pair(b0, b1, xq + 256 * b, xq + 256 * (b + 1), IQ2XXS_D(b0, b), one ? 0.f : IQ2XXS_D(b1, b + 1),
                    one, &fsum, &fsum);
    }
    return hsum8(fsum);
}

/* dot_iq2xxs of n pairs of rows (ra + r * step and rb + r * step: row r of two matrices, or rows 2r and 2r + 1 of
   one) into oa[r * os], ob[r * os], bit for bit: where nb is odd a pair's last super-blocks (against the same
   activations) make one step instead of two half-wasted ones (a down projection of 3 super-blocks a row: a quarter
   of its table lookups saved); and many rows a call keep the constants in registers across rows */
#define IQ_TWO_ROWS 1
static void dot_iq2xxs2(const uint8_t *ra, const uint8_t *rb, long step, int n, int nb, const int8_t *xq,
                        const float *xd, float *oa, float *ob, long os) {
    for (int r = 0; r < n; r++) {
        const uint8_t *row0 = ra + r * step, *row1 = rb + r * step;
        __m256 f0 = _mm256_setzero_ps(), f1 = _mm256_setzero_ps();
        for (int b = 0; b + 1 < nb; b += 2) {
            const uint8_t *b0 = row0 + (long)b * 66, *c0 = row1 + (long)b * 66;
            PREFETCH_AHEAD(b0, nb * 66, 132);
            PREFETCH_AHEAD(c0, nb * 66, 132);
            iq2xxs_pair(b0, b0 + 66, xq + 256 * b, xq + 256 * (b + 1), IQ2XXS_D(b0, b), IQ2XXS_D(b0 + 66, b + 1), 0,
                        &f0, &f0);
            iq2xxs_pair(c0, c0 + 66, xq + 256 * b, xq + 256 * (b + 1), IQ2XXS_D(c0, b), IQ2XXS_D(c0 + 66, b + 1), 0,
                        &f1, &f1);
        }
        if (nb & 1) {
            const int b = nb - 1;
            const uint8_t *b0 = row0 + (long)b * 66, *c0 = row1 + (long)b * 66;
            PREFETCH_AHEAD(b0, nb * 66, 66);
            PREFETCH_AHEAD(c0, nb * 66, 66);
            iq2xxs_pair(b0, c0, xq + 256 * b, xq + 256 * b, IQ2XXS_D(b0, b), IQ2XXS_D(c0, b), 0, &f0, &f1);
        }
        oa[r * os] = hsum8(f0);
        ob[r * os] = hsum8(f1);
    }
}

/* IQ3_XXS a super-block at a time in 512-bit registers: its 64 grid indices look up their entries' 4-bit codes
   (byte permutes of the two code tables, two 128-entry permutes and a blend on the index's top bit each), paired
   into words so that a multishift cuts 16 entries' codes into one a byte, in weight order, and an affine map (or
   a byte permute) turns codes into magnitudes; then two sub-blocks a step. */
static float dot_iq3xxs(const uint8_t *row, int nb, const int8_t *xq, const float *xd) {
    __m256 fsum = _mm256_setzero_ps();
    uint32_t sg[8] __attribute__((aligned(32))), ls[8] __attribute__((aligned(32)));
    __m512i t[2][4];
    for (int h = 0; h < 2; h++)
        for (int c = 0; c < 4; c++) t[h][c] = _mm512_load_si512(IQ3_CODES[h] + 64 * c);
    const __m512i pair0 = _mm512_load_si512(IQ3_CPAIR), pair1 = _mm512_add_epi8(pair0, _mm512_set1_epi8(32));
    const __m512i shifts = _mm512_set1_epi64(0x1C1814100C080400LL);  /* + 32i: words 2i, 2i+1 */
    const __m512i mag3 = _mm512_load_si512(IQ3_MAG);
    (void)mag3;
    const __m512i half = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int b = 0; b < nb; b++) {
        const int8_t *x = xq + 256 * b;
        const uint8_t *blk = row + (long)b * 98;
        PREFETCH_AHEAD(blk, nb * 98, 98);
        const __m512i idx = _mm512_loadu_si512(blk + 2);
        const __mmask64 top = _mm512_movepi8_mask(idx);
        __m512i lo = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(t[0][0], idx, t[0][1]),
                                            _mm512_permutex2var_epi8(t[0][2], idx, t[0][3]));
        __m512i hi = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(t[1][0], idx, t[1][1]),
                                            _mm512_permutex2var_epi8(t[1][2], idx, t[1][3]));
        const __m512i codes[2] = {_mm512_permutex2var_epi8(lo, pair0, hi), _mm512_permutex2var_epi8(lo, pair1, hi)};
        __m512i g[4];
        for (int m = 0; m < 4; m++) {  /* weights 64m..64m+63: entries 16m..16m+15, 2 a qword */
            __m512i cut = _mm512_multishift_epi64_epi8(_mm512_add_epi8(shifts, _mm512_set1_epi8((char)(32 * (m % 2)))),
                                                       codes[m / 2]);
#if defined(__GFNI__)
            g[m] = _mm512_gf2p8affine_epi64_epi8(cut, _mm512_set1_epi64(0x0008000102040000LL), 4);
#else
            g[m] = _mm512_permutexvar_epi8(cut, mag3);
#endif
        }
        iq_signs_scales(_mm256_loadu_si256((const __m256i *)(blk + 66)), sg, ls);
        const __m512i l8 = _mm512_castsi256_si512(_mm256_load_si256((const __m256i *)ls));
        __m512i s = _mm512_setzero_si512();
        for (int m = 0; m < 4; m++) {  /* sub-blocks 2m, 2m+1 */
            uint64_t k; __builtin_memcpy(&k, sg + 2 * m, 8);
            __m512i xv = _mm512_loadu_si512(x + 64 * m);
            __m512i xs = _mm512_mask_sub_epi8(xv, _cvtu64_mask64(k), _mm512_setzero_si512(), xv);
            __m512i sc = _mm512_permutexvar_epi32(_mm512_add_epi32(half, _mm512_set1_epi32(2 * m)), l8);
            s = iq_madd_add(s, _mm512_maddubs_epi16(g[m], xs), sc);
        }
        __m256i sumi = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
        fsum = _mm256_fmadd_ps(_mm256_set1_ps(f16(blk) * xd[b] * 0.25f), _mm256_cvtepi32_ps(sumi), fsum);
    }
    return hsum8(fsum);
}

#else
/* Without AVX-512 the 32 signs of a sub-block come from its u32 of sign indices by vector ops (no table loads and
   inserts): a byte shuffle of the broadcast word gives byte k of group l the word's byte holding bit 7l + k, an and
   with that bit and a compare make 0xFF masks of the 7 coded signs, and the 8th (the group's parity, byte 7 held
   at zero) is the low bit of the sum of its group's mask bytes, 255 each (a sad), moved to byte 7's top bit. The
   result, or 1, is a sign operand: -1 or 1 for the coded signs, 0x81 or 0x01 for the 8th. */
static inline __m256i iq_signs(const uint8_t *aux) {
    const __m256i sh = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, -1, 0, 1, 1, 1, 1, 1, 1, -1,
                                        1, 1, 2, 2, 2, 2, 2, -1, 2, 2, 2, 3, 3, 3, 3, -1);
    const __m256i bits = _mm256_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, -128, 1, 2, 4, 8, 16, 32, -128,
                                          64, -128, 1, 2, 4, 8, 16, -128, 32, 64, -128, 1, 2, 4, 8, -128);
    __m256i m = _mm256_shuffle_epi8(_mm256_set1_epi32((int)u32le(aux)), sh);
    m = _mm256_cmpeq_epi8(_mm256_and_si256(m, bits), bits);
    const __m256i par = _mm256_slli_epi64(_mm256_sad_epu8(m, _mm256_setzero_si256()), 63);
    return _mm256_or_si256(_mm256_or_si256(m, par), _mm256_set1_epi8(1));
}

/* the odd scales 2s + 1 (s: bits 28-31 of each u32 of v) as int16 pairs (v >> 27 brings s to bits 1-4; the or
   replaces bit 0, the last sign index's top bit) */
static inline __m256i iq_scales(__m256i v) {
    const __m256i l = _mm256_or_si256(_mm256_srli_epi32(v, 27), _mm256_set1_epi32(1));
    return _mm256_or_si256(l, _mm256_slli_epi32(l, 16));
}

/* one sub-block: grid magnitudes g times the activations signed by the word at aux, times its scale pair sc
   (in every dword) */
static inline __m256i iq_sub2(__m256i g, const uint8_t *aux, __m256i sc, const int8_t *x) {
    const __m256i xs = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x), iq_signs(aux));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(g, xs), sc);
}

static float dot_iq2xxs(const uint8_t *row, int nb, const int8_t *xq, const float *xd) {
    __m256 fsum = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (long)b * 66, *q = blk + 2;
        PREFETCH_AHEAD(blk, nb * 66, 66);
        const int8_t *x = xq + 256 * b;
        /* qword k of sc: sub-block k's scale pair twice (its u32 is dword 2k + 1 of the 64 bytes), read back as
           broadcast loads (load ports; the empty asm keeps the compiler from routing them by shuffles instead) */
        long long sc[8] __attribute__((aligned(32)));
        _mm256_store_si256((__m256i *)sc, _mm256_shuffle_epi32(iq_scales(_mm256_loadu_si256((const __m256i *)q)),
                                                               0xF5));
        _mm256_store_si256((__m256i *)(sc + 4), _mm256_shuffle_epi32(
            iq_scales(_mm256_loadu_si256((const __m256i *)(q + 32))), 0xF5));
        __asm__("" : : "r"(sc) : "memory");
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int j = 0; j < 8; j += 2) {  /* a sub-block: 4 grid indices, then the u32 of signs and scale */
            const uint8_t *a = q + 8 * j, *c = a + 8;
            s0 = _mm256_add_epi32(s0, iq_sub2(tab4x64(IQ2XXS_GRID, a[0], a[1], a[2], a[3]), a + 4,
                                              _mm256_set1_epi64x(sc[j]), x + 32 * j));
            s1 = _mm256_add_epi32(s1, iq_sub2(tab4x64(IQ2XXS_GRID, c[0], c[1], c[2], c[3]), c + 4,
                                              _mm256_set1_epi64x(sc[j + 1]), x + 32 * j + 32));
        }
        fsum = _mm256_fmadd_ps(_mm256_set1_ps(f16(blk) * xd[b] * 0.125f),
                               _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), fsum);
    }
    return hsum8(fsum);
}

static float dot_iq3xxs(const uint8_t *row, int nb, const int8_t *xq, const float *xd) {
    __m256 fsum = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (long)b * 98, *q = blk + 2;
        PREFETCH_AHEAD(blk, nb * 98, 98);
        const int8_t *x = xq + 256 * b;
        /* qword k of sc[i]: the scale pair of sub-block 2i + k (k < 2) or 2i + k + 2 (k >= 2), twice, routed by
           qword permutes (by immediates: no index vectors to keep in registers; broadcast loads instead measured
           slower here, with the grid's 16 loads a sub-block) */
        const __m256i l = iq_scales(_mm256_loadu_si256((const __m256i *)(blk + 66)));
        const __m256i sc[2] = {_mm256_unpacklo_epi32(l, l), _mm256_unpackhi_epi32(l, l)};
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int j = 0; j < 8; j += 2) {
            const int i = j % 4 / 2, k = 2 * (j / 4);  /* sub-blocks j, j + 1: qwords k, k + 1 of sc[i] */
            s0 = _mm256_add_epi32(s0, iq_sub2(iq3_grid(q + 8 * j), blk + 66 + 4 * j,
                                              _mm256_permute4x64_epi64(sc[i], 0x55 * k), x + 32 * j));
            s1 = _mm256_add_epi32(s1, iq_sub2(iq3_grid(q + 8 * j + 8), blk + 70 + 4 * j,
                                              _mm256_permute4x64_epi64(sc[i], 0x55 * (k + 1)), x + 32 * j + 32));
        }
        fsum = _mm256_fmadd_ps(_mm256_set1_ps(f16(blk) * xd[b] * 0.25f),
                               _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), fsum);
    }
    return hsum8(fsum);
}
#endif
#endif

static float dot_iqxxs(int three, const uint8_t *row, int nb, const int8_t *xq, const float *xd) {
#if defined(__AVX2__) && defined(__FMA__)
    return three ? dot_iq3xxs(row, nb, xq, xd) : dot_iq2xxs(row, nb, xq, xd);
#else
    const int bb = three ? 98 : 66;
    float sum = 0.f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (long)b * bb, *q = blk + 2;
        for (int j = 0; j < 8; j++) {
            uint32_t aux = three ? u32le(blk + 66 + 4 * j) : u32le(q + 8 * j + 4);
            int32_t s = 0;
            for (int l = 0; l < 4; l++) {  /* groups of 8 weights, one sign index each */
                uint64_t sg = SIGNS64[(aux >> (7 * l)) & 127];
                for (int k = 0; k < 8; k++) {
                    int m = three ? (int)((IQ3XXS_GRID[q[8 * j + 2 * l + k / 4]] >> (8 * (k % 4))) & 255)
                                  : (int)((IQ2XXS_GRID[q[8 * j + l]] >> (8 * k)) & 255);
                    int sign = ((sg >> (8 * k)) & 255) == 0xFF ? -1 : 1;
                    s += sign * m * xq[256 * b + 32 * j + 8 * l + k];
                }
            }
            sum += f16(blk) * xd[b] * (three ? 0.25f : 0.125f) * (float)(2 * (aux >> 28) + 1) * (float)s;
        }
    }
    return sum;
#endif
}

