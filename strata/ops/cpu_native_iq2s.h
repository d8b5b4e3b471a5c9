/* The IQ2_S dot product of cpu_native.c, which includes this header after cpu_native_iq.h (one compilation unit:
   f16, hsum8, PREFETCH_AHEAD, u32le, tab4x64 and the IQ2_S tables come from there); iq2s_signed serves
   cpu_native_iqx.h too. */

/* IQ2_S (82 bytes / 256): f16 d, qs[32] (the low 8 bits of each group of 8 weights' grid index), signs[32] (byte g:
   bit k set -> weight k of group g negative), qh[8] (sub-block j of 32 weights: bits 2l, 2l+1 the index's high 2
   bits of its group l), scales[8] (sub-block j: low nibble s0 for its first 16 weights, high nibble s1 for the
   last 16); w = d * (2s + 1) / 8 * grid * sign, with IQ2_S's own 1024-entry grid. */
static inline uint32_t iq2s_idx(const uint8_t *qs, uint32_t qh, int l) {
    return qs[l] | ((qh << (8 - 2 * l)) & 0x300);
}

#if defined(__AVX2__) && defined(__FMA__)
/* one sub-block's 32 signed activations: negated where the sign bit is set (its 4 sign bytes as a 32-bit mask) */
static inline __m256i iq2s_signed(__m256i x, uint32_t sg) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)  /* a masked negation (4% faster than the AVX2 way) */
    return _mm256_mask_sub_epi8(x, (__mmask32)sg, _mm256_setzero_si256(), x);
#else
    /* byte k of the mask from sign byte k / 8, bit k % 8: a byte shuffle, an and with the bit, a compare */
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bits = _mm256_set1_epi64x(0x8040201008040201LL);
    __m256i m = _mm256_shuffle_epi8(_mm256_set1_epi32((int)sg), spread);
    m = _mm256_cmpeq_epi8(_mm256_and_si256(m, bits), bits);  /* 0xFF: negative */
    return _mm256_sub_epi8(_mm256_xor_si256(x, m), m);  /* (as fast as _mm256_sign_epi8 by m | 1 here) */
#endif
}

/* a super-block's 32 grid indices (qs | the 2 bits of qh) as uint16, and the scales 2s + 1 of its 16 halves as
   int16 pairs in two vectors of 8 int32 (sub-blocks 0-3, 4-7) */
static inline void iq2s_prep(const uint8_t *blk, uint16_t *idx, __m256i *sc) {
    const __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
    const __m256i hi = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
    const __m256i qh = _mm256_broadcastsi128_si256(_mm_loadl_epi64((const __m128i *)(blk + 66)));
    /* epi16 lane g: qh[g / 4] (then qh[4 + g / 4]), times 2^(8 - 2 (g % 4)): its 2 bits at bits 8, 9 */
    const __m256i sa = _mm256_setr_epi8(0, -1, 0, -1, 0, -1, 0, -1, 1, -1, 1, -1, 1, -1, 1, -1,
                                        2, -1, 2, -1, 2, -1, 2, -1, 3, -1, 3, -1, 3, -1, 3, -1);
    const __m256i sb = _mm256_add_epi8(sa, _mm256_set1_epi16(4));
    const __m256i pw = _mm256_setr_epi16(256, 64, 16, 4, 256, 64, 16, 4, 256, 64, 16, 4, 256, 64, 16, 4);
    const __m256i m = _mm256_set1_epi16(0x300);
    _mm256_store_si256((__m256i *)idx, _mm256_or_si256(lo, _mm256_and_si256(_mm256_mullo_epi16(
        _mm256_shuffle_epi8(qh, sa), pw), m)));
    _mm256_store_si256((__m256i *)(idx + 16), _mm256_or_si256(hi, _mm256_and_si256(_mm256_mullo_epi16(
        _mm256_shuffle_epi8(qh, sb), pw), m)));
    __m128i s = _mm_loadl_epi64((const __m128i *)(blk + 74)), f = _mm_set1_epi8(15);
    s = _mm_unpacklo_epi8(_mm_and_si128(s, f), _mm_and_si128(_mm_srli_epi16(s, 4), f));  /* half 2j + {0, 1} */
    for (int k = 0; k < 2; k++) {
        __m256i v = _mm256_cvtepu8_epi32(k ? _mm_srli_si128(s, 8) : s);
        v = _mm256_or_si256(_mm256_slli_epi32(v, 1), _mm256_set1_epi32(1));
        sc[k] = _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
    }
}

/* sub-block j of a super-block: grid magnitudes times the signed activations, times the scales 2s + 1 of its two
   halves (int16 lanes 0-7: its first 16 weights, 8-15: the last 16; sh: sc with the halves 0 of its 4 sub-blocks in
   the low 128-bit lane, the halves 1 in the high one, so that an in-lane dword broadcast by an immediate routes
   them, no index vectors to keep in registers) */
static inline __m256i iq2s_sub(const uint8_t *blk, const uint16_t *idx, const __m256i *sh, int j, const int8_t *x) {
    /* scalar loads (a gather measured 12% slower) */
    __m256i g = tab4x64(IQ2S_GRID, idx[4 * j], idx[4 * j + 1], idx[4 * j + 2], idx[4 * j + 3]);
    __m256i xs = iq2s_signed(_mm256_loadu_si256((const __m256i *)x), u32le(blk + 34 + 4 * j));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(g, xs), _mm256_shuffle_epi32(sh[j / 4], 0x55 * (j % 4)));
}

#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__) && defined(__AVX512BITALG__)
/* byte r of qword Q (Q = 0..3) of the high-bit control: the bit offset 2 (8Q + r) - 5 (mod 64) of index 8Q + r's two
   high bits in its super-block's qh, so that a multishift puts them at bits 5, 6 of the index's byte */
static inline long long iq2s_hctl(int Q) {
    uint64_t v = 0;
    for (int r = 0; r < 8; r++) v |= (uint64_t)((16 * Q + 2 * r - 5) & 63) << (8 * r);
    return (long long)v;
}

/* 64 weights (a step m of super-block t of the pair): the codes of its 8 entries cut into one a byte, magnitudes,
   and the activations negated under the 64 sign bits; their products summed in pairs (int16, maddubs) or, with
   VNNI, in fours (int32, dpbusd) */
static inline __m512i iq2s_prod(__m512i codes, int m, const uint8_t *sg, const int8_t *x) {
    const __m512i cut = _mm512_multishift_epi64_epi8(
        _mm512_set1_epi64(0x0E0C0A0806040200LL + 0x1010101010101010LL * m), codes);
#if defined(__GFNI__)
    const __m512i g = _mm512_gf2p8affine_epi64_epi8(cut, _mm512_set1_epi64(0x0302000001020000LL), 8);
#else
    const __m512i g = _mm512_permutexvar_epi8(cut, _mm512_load_si512(IQ2_MAG));
#endif
    uint64_t k;
    __builtin_memcpy(&k, sg + 8 * m, 8);
    __m512i xv = _mm512_loadu_si512((const void *)(x + 64 * m));
    xv = _mm512_mask_sub_epi8(xv, _cvtu64_mask64(k), _mm512_setzero_si512(), xv);
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), g, xv);
#else
    return _mm512_maddubs_epi16(g, xv);
#endif
}

/* super-block t of the pair (codes, its sign bytes sg, activations x): the products times the scales 2s + 1 of
   its 16 halves (n2's bytes 16t..16t+15), summed into 16 int32 lanes (lane L: weights 4 (L % 8)..+3 of each
   sub-block 2m + L / 8, as the 256-bit path's lanes before their fold) */
static inline __m512i iq2s_super(__m512i codes, int t, const uint8_t *sg, const int8_t *x, __m512i n2) {
    __m512i acc = _mm512_setzero_si512();
#if defined(__AVX512VNNI__)
    /* Each step's 4-weight sums fit an int16 (4 * 43 * 127): steps m and m + 2 share a vector (int16 lanes 2L and
       2L + 1: their lane L, as IQ_PAIR16 routes them) and one multiply-add applies both steps' scales; the int32
       lanes keep their weights, so the sums are the other paths' bit for bit, 2 instructions fewer */
    __m512i p[4];
    for (int m = 0; m < 4; m++) p[m] = iq2s_prod(codes, m, sg, x);
    for (int m = 0; m < 2; m++) {
        /* bytes 4L, 4L + 2: the bytes of n2 of lane L's halves in steps m, m + 2; 4L + 1, 4L + 3: byte 32 (zero) */
        const __m512i sel = _mm512_add_epi32(_mm512_setr_epi32(0x00080000, 0x00080000, 0x00080000, 0x00080000,
                                                               0x00090001, 0x00090001, 0x00090001, 0x00090001,
                                                               0x000A0002, 0x000A0002, 0x000A0002, 0x000A0002,
                                                               0x000B0003, 0x000B0003, 0x000B0003, 0x000B0003),
                                             _mm512_set1_epi32(0x20002000 + 0x10001 * (16 * t + 4 * m)));
        const __m512i w = _mm512_permutex2var_epi16(p[m], _mm512_load_si512(IQ_PAIR16), p[m + 2]);
        acc = _mm512_dpwssd_epi32(acc, w, _mm512_permutexvar_epi8(sel, n2));
    }
#else
    for (int m = 0; m < 4; m++) {
        /* bytes 4L, 4L + 2: the half's byte of n2; 4L + 1, 4L + 3: byte 32 (zero) */
        const __m512i sel = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0x10001, 0x10001, 0x10001, 0x10001,
                                                               0x20002, 0x20002, 0x20002, 0x20002,
                                                               0x30003, 0x30003, 0x30003, 0x30003),
                                             _mm512_set1_epi32(0x20002000 + 0x10001 * (16 * t + 4 * m)));
        acc = iq_madd_add(acc, iq2s_prod(codes, m, sg, x), _mm512_permutexvar_epi8(sel, n2));
    }
#endif
    return acc;
}

/* Two super-blocks a step: their 64 ten-bit grid indices (the low 8 bits from qs, the high 2 by a multishift of
   qh) look up their entries' 2-bit codes in IQ2S_LUT's eight 128-entry chunks, one masked two-register byte
   permute each (the chunk: the index's top 3 bits), which replaces the indices of its lanes in place; the codes
   are then paired into words, cut and mapped to magnitudes as for IQ2_XXS. The integer sums per lane are the
   256-bit path's, and the float sums follow them a super-block at a time, in order, so the two paths agree bit
   for bit. Super-block u of the pair (at bu, against activations xu) adds into *fu, u = 0 first, then u = 1
   unless `one`: a row's two super-blocks (f0 and f1 the same accumulator), one super-block with itself (one), or
   two rows' last super-blocks against the same activations. */
static inline __attribute__((always_inline)) void iq2s_pair(const uint8_t *b0, const uint8_t *b1, const int8_t *x0,
                                                             const int8_t *x1, float d0, float d1, int one,
                                                             __m256 *f0, __m256 *f1) {
    const __m512i pair0 = _mm512_load_si512(IQ2S_PAIR), pair1 = _mm512_add_epi8(pair0, _mm512_set1_epi8(32));
    const __m512i hctl = _mm512_setr_epi64(iq2s_hctl(0), iq2s_hctl(1), iq2s_hctl(2), iq2s_hctl(3),
                                           iq2s_hctl(0), iq2s_hctl(1), iq2s_hctl(2), iq2s_hctl(3));
    const __m256i sctl = _mm256_setr_epi64x(0x1B17130F0B07033FLL, 0x3B37332F2B27231FLL, 0x1B17130F0B07033FLL,
                                            0x3B37332F2B27231FLL);  /* bit offsets 4k - 1, 4k + 31 (mod 64) */
    const __m512i qs = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                                          _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1);
    long long h0, h1;
    __builtin_memcpy(&h0, b0 + 66, 8); __builtin_memcpy(&h1, b1 + 66, 8);
    const __m512i qh = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi64x(h0)),
                                          _mm256_set1_epi64x(h1), 1);
    /* bits 5, 6 of kx: the index's high 2 bits (bits 8, 9), bit 7: its bit 7 (bits 0-4: qs', unused) */
    const __m512i kx = _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(hctl, qh), qs,
                                                 _mm512_set1_epi8(0x60), 0xE4);
    const __m512i key = _mm512_and_si512(kx, _mm512_set1_epi8((char)0xA0));  /* index bits 7, 8 */
    /* Two chains of masked permutes, chunks 0-3 (index bit 9 clear) and 4-7, half as deep as one (the permutes'
       latency, not their count, bounds one chain); a lane's chunk within its chain is index bits 7, 8 (four masks
       serve both chains: a chain's lanes of the other's chunks are dropped by the final blend). The tables stay in
       L1 and feed the permutes as memory operands: the empty asm hides their constancy (else the compiler hoists
       all 32 registers of them out of the loop and spills them to the stack). */
    const struct iq2s_lut *t = &IQ2S_LUT;
    __asm__("" : "+r"(t));
    __m512i lo[2] = {qs, qs}, hi[2] = {qs, qs};
    for (int c = 0; c < 4; c++) {
        const __mmask64 k = _mm512_cmpeq_epi8_mask(key, _mm512_load_si512(t->keys[c]));
        for (int u = 0; u < 2; u++) {
            const uint8_t *lt = t->codes[0] + 128 * (c + 4 * u), *ht = t->codes[1] + 128 * (c + 4 * u);
            lo[u] = _mm512_mask2_permutex2var_epi8(_mm512_load_si512(lt), lo[u], k, _mm512_load_si512(lt + 64));
            hi[u] = _mm512_mask2_permutex2var_epi8(_mm512_load_si512(ht), hi[u], k, _mm512_load_si512(ht + 64));
        }
    }
    const __mmask64 up = _mm512_test_epi8_mask(kx, _mm512_set1_epi8(0x40));
    const __m512i l = _mm512_mask_blend_epi8(up, lo[0], lo[1]), h = _mm512_mask_blend_epi8(up, hi[0], hi[1]);
    const __m512i codes0 = _mm512_permutex2var_epi8(l, pair0, h), codes1 = _mm512_permutex2var_epi8(l, pair1, h);
    /* the 2s + 1 of the 16 halves of each super-block, in bytes 0-15 and 16-31 (bytes 32-63 zero): a multishift
       cuts nibble k of qword [s0, s0, s1, s1] to bits 1-4 of a byte */
    long long s0, s1;
    __builtin_memcpy(&s0, b0 + 74, 8); __builtin_memcpy(&s1, b1 + 74, 8);
    const __m256i sq = _mm256_permute4x64_epi64(_mm256_castsi128_si256(_mm_set_epi64x(s1, s0)), 0x50);
    const __m512i n2 = _mm512_zextsi256_si512(_mm256_ternarylogic_epi32(
        _mm256_multishift_epi64_epi8(sctl, sq), _mm256_set1_epi8(0x1E), _mm256_set1_epi8(1), 0xEA));
    const __m512i a0 = iq2s_super(codes0, 0, b0 + 34, x0, n2);
    __m256i a = _mm256_add_epi32(_mm512_castsi512_si256(a0), _mm512_extracti64x4_epi64(a0, 1));
    *f0 = _mm256_fmadd_ps(_mm256_set1_ps(d0), _mm256_cvtepi32_ps(a), *f0);
    if (!one) {
        const __m512i a1 = iq2s_super(codes1, 1, b1 + 34, x1, n2);
        a = _mm256_add_epi32(_mm512_castsi512_si256(a1), _mm512_extracti64x4_epi64(a1, 1));
        *f1 = _mm256_fmadd_ps(_mm256_set1_ps(d1), _mm256_cvtepi32_ps(a), *f1);
    }
}

#define IQ2S_D(blk, b) (f16(blk) * xd[b] * 0.125f)  /* super-block b's float scale (the codes' 1/8 in it) */

static float dot_iq2s(const uint8_t *row, int nb, const int8_t *xq, const float *xd) {
    __m256 fsum = _mm256_setzero_ps();
    for (int b = 0; b < nb; b += 2) {
        const int one = b + 1 >= nb;
        const uint8_t *b0 = row + (long)b * 82, *b1 = one ? b0 : b0 + 82;
        PREFETCH_AHEAD(b0, nb * 82, 164);
        iq2s_pair(b0, b1, xq + 256 * b, xq + 256 * (b + 1), IQ2S_D(b0, b), one ? 0.f : IQ2S_D(b1, b + 1), one,
                  &fsum, &fsum);
    }
    return hsum8(fsum);
}

/* dot_iq2s of n pairs of rows (ra + r * step and rb + r * step: row r of two matrices, or rows 2r and 2r + 1 of
   one) into oa[r * os], ob[r * os], bit for bit: where nb is odd a pair's last super-blocks (against the same
   activations) make one step instead of two half-wasted ones (a down projection of 3 super-blocks a row: a quarter
   of its table lookups saved); and many rows a call keep the constants in registers across rows */
#define IQ2S_TWO_ROWS 1
static void dot_iq2s2(const uint8_t *ra, const uint8_t *rb, long step, int n, int nb, const int8_t *xq,
                      const float *xd, float *oa, float *ob, long os) {
    for (int r = 0; r < n; r++) {
        const uint8_t *row0 = ra + r * step, *row1 = rb + r * step;
        __m256 f0 = _mm256_setzero_ps(), f1 = _mm256_setzero_ps();
        for (int b = 0; b + 1 < nb; b += 2) {
            const uint8_t *b0 = row0 + (long)b * 82, *c0 = row1 + (long)b * 82;
            PREFETCH_AHEAD(b0, nb * 82, 164);
            PREFETCH_AHEAD(c0, nb * 82, 164);
            iq2s_pair(b0, b0 + 82, xq + 256 * b, xq + 256 * (b + 1), IQ2S_D(b0, b), IQ2S_D(b0 + 82, b + 1), 0,
                      &f0, &f0);
            iq2s_pair(c0, c0 + 82, xq + 256 * b, xq + 256 * (b + 1), IQ2S_D(c0, b), IQ2S_D(c0 + 82, b + 1), 0,
                      &f1, &f1);
        }
        if (nb & 1) {
            const int b = nb - 1;
            const uint8_t *b0 = row0 + (long)b * 82, *c0 = row1 + (long)b * 82;
            PREFETCH_AHEAD(b0, nb * 82, 82);
            PREFETCH_AHEAD(c0, nb * 82, 82);
            iq2s_pair(b0, c0, xq + 256 * b, xq + 256 * b, IQ2S_D(b0, b), IQ2S_D(c0, b), 0, &f0, &f1);
        }
        oa[r * os] = hsum8(f0);
        ob[r * os] = hsum8(f1);
    }
}
#elif defined(__AVX512F__) && defined(__AVX512BW__)
/* int16 lane w of a 64-weight step: its pair of weights lies in that step's half w / 8 */
static const int16_t IQ2S_HALF_W[32] __attribute__((aligned(64))) = {
    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
/* Two sub-blocks (64 weights) a step in 512-bit lanes: their 8 grid entries in one vector, their 64 signs as one
   mask (the 8 sign bytes are the sub-blocks' groups in weight order), one maddubs and one madd against the 16
   half-block scales routed to their lanes by a word permute. The same integer sums as the 256-bit path, and (its
   lanes folded to that path's at the end of each super-block) the same float sums. */
static float dot_iq2s(const uint8_t *row, int nb, const int8_t *xq, const float *xd) {
    __m256 fsum = _mm256_setzero_ps();
    uint16_t idx[32] __attribute__((aligned(32)));
    __m256i sc[2];
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (long)b * 82;
        PREFETCH_AHEAD(blk, nb * 82, 82);
        const int8_t *x = xq + 256 * b;
        iq2s_prep(blk, idx, sc);
        /* the 16 half-block scales (2s + 1) as int16 in lanes 0-15 (sc: int32 lanes v | v << 16, halves 0-7, 8-15) */
        const __m512i hs = _mm512_castsi256_si512(_mm512_cvtepi32_epi16(
            _mm512_inserti64x4(_mm512_castsi256_si512(sc[0]), sc[1], 1)));
        __m512i acc = _mm512_setzero_si512();
        const __m512i half = _mm512_load_si512((const void *)IQ2S_HALF_W);
        for (int j = 0; j < 8; j += 2) {
            /* (scalar loads: a 512-bit gather of the 8 entries measured slower) */
            const uint16_t *ix = idx + 4 * j;
            const __m512i g = _mm512_inserti64x4(
                _mm512_castsi256_si512(tab4x64(IQ2S_GRID, ix[0], ix[1], ix[2], ix[3])),
                tab4x64(IQ2S_GRID, ix[4], ix[5], ix[6], ix[7]), 1);
            __m512i xv = _mm512_loadu_si512((const void *)(x + 32 * j));
            uint64_t sg;
            __builtin_memcpy(&sg, blk + 34 + 4 * j, 8);
            xv = _mm512_mask_sub_epi8(xv, (__mmask64)sg, _mm512_setzero_si512(), xv);
            /* int16 lane w: weights 2w, 2w+1 of the 64, in half 2j + w / 8 */
            const __m512i sel = _mm512_add_epi16(_mm512_set1_epi16((short)(2 * j)), half);
            acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(g, xv),
                                                          _mm512_permutexvar_epi16(sel, hs)));
        }
        /* lane i + lane i + 8: the 256-bit path's lane i (weights 4i..4i+3 of every sub-block), so the float
           sums that follow are that path's, bit for bit */
        const __m256i a = _mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
        fsum = _mm256_fmadd_ps(_mm256_set1_ps(f16(blk) * xd[b] * 0.125f), _mm256_cvtepi32_ps(a), fsum);
    }
    return hsum8(fsum);
}
#else
static float dot_iq2s(const uint8_t *row, int nb, const int8_t *xq, const float *xd) {
    __m256 fsum = _mm256_setzero_ps();
    uint16_t idx[32] __attribute__((aligned(32)));
    __m256i sc[2];
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (long)b * 82;
        PREFETCH_AHEAD(blk, nb * 82, 82);
        const int8_t *x = xq + 256 * b;
        iq2s_prep(blk, idx, sc);  /* (vector index and scale preparation: 10-20% faster than per sub-block) */
        const __m256i halves = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
        const __m256i sh[2] = {_mm256_permutevar8x32_epi32(sc[0], halves), _mm256_permutevar8x32_epi32(sc[1], halves)};
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int j = 0; j < 8; j += 2) {  /* two sub-blocks a step into two accumulators, as for IQ2_XXS */
            s0 = _mm256_add_epi32(s0, iq2s_sub(blk, idx, sh, j, x + 32 * j));
            s1 = _mm256_add_epi32(s1, iq2s_sub(blk, idx, sh, j + 1, x + 32 * j + 32));
        }
        fsum = _mm256_fmadd_ps(_mm256_set1_ps(f16(blk) * xd[b] * 0.125f),
                               _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), fsum);
    }
    return hsum8(fsum);
}
#endif
#else
static float dot_iq2s(const uint8_t *row, int nb, const int8_t *xq, const float *xd) {
    float sum = 0.f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (long)b * 82;
        for (int j = 0; j < 8; j++) {
            const uint32_t qh = blk[66 + j], sc = blk[74 + j];
            int32_t s[2] = {0, 0};
            for (int l = 0; l < 4; l++) {  /* groups of 8 weights: one grid index and one sign byte each */
                uint64_t g = IQ2S_GRID[iq2s_idx(blk + 2 + 4 * j, qh, l)];
                uint8_t sg = blk[34 + 4 * j + l];
                for (int k = 0; k < 8; k++) {
                    int w = (int)((g >> (8 * k)) & 255) * ((sg >> k) & 1 ? -1 : 1);
                    s[l / 2] += w * xq[256 * b + 32 * j + 8 * l + k];
                }
            }
            sum += f16(blk) * xd[b] * 0.125f * (float)((int32_t)(2 * (sc & 15) + 1) * s[0] + (int32_t)(2 * (sc >> 4) + 1) * s[1]);
        }
    }
    return sum;
}
#endif
