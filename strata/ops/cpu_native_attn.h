/* Attention of a few queries of one sequence over its cached keys (a decode or speculative verify step on the CPU):
   query r of n sees keys 0 .. L0 + r. Each key and value row is read once for all n queries (SDPA called per query
   reads them n times), and a query's result does not depend on n or on the thread count: the keys are cut into
   chunks of ATTN_CHUNK at fixed positions, each chunk's softmax partial (max, sum, weighted values) is computed by
   the same code for any n, and the partials are merged in chunk order. So a verify step gives each token exactly
   what a one-token step gives it, and greedy text with drafts equals plain decoding's.

   Layouts: q [n, H, D] and out [n, H, Dv] contiguous float32; key j of KV head h at k + j * kps + h * khs (floats),
   value likewise with vps / vhs; query head i reads KV head i / (H / Hkv) (GQA). */

#define ATTN_CHUNK 256

/* e^x for x <= 0 (a score minus its row's maximum): Cephes' expf (range reduction by ln 2 in two parts, a degree-6
   polynomial, the exponent put in by bits), written so that the compiler vectorizes it; within 2 ulp of expf. */
static inline float attn_exp(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } s;
    s.u = (uint32_t)((int)n + 127) << 23;
    return y * s.f;
}

/* q . k over D floats in eight running sums (a vector register; fmaf explicit, so every path rounds alike), added
   pairwise at the end. attn_dot4: the same for four keys kps floats apart, four independent chains (one chain's
   latency bound a key at a time). A key's dot is the same bits by either. */
static inline float attn_hsum(const float *a) {
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

static inline float attn_dot(const float *q, const float *k, int D) {
    float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int d = 0;
    for (; d + 8 <= D; d += 8)
        for (int t = 0; t < 8; t++) a[t] = fmaf(q[d + t], k[d + t], a[t]);
    for (int t = 0; d < D; d++, t++) a[t] = fmaf(q[d], k[d], a[t]);
    return attn_hsum(a);
}

static inline void attn_dot4(const float *q, const float *k, long kps, int D, float *s) {
    float a[8] = {0, 0, 0, 0, 0, 0, 0, 0}, b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    float c[8] = {0, 0, 0, 0, 0, 0, 0, 0}, e[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const float *k1 = k + kps, *k2 = k + 2 * kps, *k3 = k + 3 * kps;
    int d = 0;
    for (; d + 8 <= D; d += 8)
        for (int t = 0; t < 8; t++) {
            a[t] = fmaf(q[d + t], k[d + t], a[t]);
            b[t] = fmaf(q[d + t], k1[d + t], b[t]);
            c[t] = fmaf(q[d + t], k2[d + t], c[t]);
            e[t] = fmaf(q[d + t], k3[d + t], e[t]);
        }
    for (int t = 0; d < D; d++, t++) {
        a[t] = fmaf(q[d], k[d], a[t]);
        b[t] = fmaf(q[d], k1[d], b[t]);
        c[t] = fmaf(q[d], k2[d], c[t]);
        e[t] = fmaf(q[d], k3[d], e[t]);
    }
    s[0] = attn_hsum(a), s[1] = attn_hsum(b), s[2] = attn_hsum(c), s[3] = attn_hsum(e);
}

/* one query head's scores over keys j0 .. je - 1 (scaled) into s, then e^(score - max) in place; returns the max
   and puts the sum of the exponentials in *l (eight running sums, as above) */
static inline float attn_softmax_part(const float *restrict q, const float *restrict k, long kps, int D, int nk,
                                      float scale, float *restrict s, float *restrict l) {
    int j = 0;
    for (; j + 4 <= nk; j += 4) attn_dot4(q, k + j * kps, kps, D, s + j);
    for (; j < nk; j++) s[j] = attn_dot(q, k + j * kps, D);
    float m = -INFINITY;
    for (j = 0; j < nk; j++) { s[j] *= scale; m = s[j] > m ? s[j] : m; }
    float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (j = 0; j + 8 <= nk; j += 8)
        for (int t = 0; t < 8; t++) { s[j + t] = attn_exp(s[j + t] - m); a[t] += s[j + t]; }
    for (int t = 0; j < nk; j++, t++) { s[j] = attn_exp(s[j] - m); a[t] += s[j]; }
    *l = attn_hsum(a);
    return m;
}

/* o[0 .. Dv) = sum over the nk keys of p[j] * v[j] (in key order, each lane its own chain) */
static inline void attn_values(const float *restrict p, const float *restrict v, long vps, int Dv, int nk,
                               float *restrict o) {
    for (int d = 0; d < Dv; d++) o[d] = 0.0f;
    for (int j = 0; j < nk; j++) {
        const float pj = p[j], *vj = v + j * vps;
        for (int d = 0; d < Dv; d++) o[d] = fmaf(pj, vj[d], o[d]);
    }
}

/* scratch bytes: the chunks' partials (Hkv x chunks x n*G rows of Dv + 2 floats) and each thread's scores */
long strata_attn_rows_scratch(int n, int H, int Hkv, int Dv, int L0, int threads) {
    const long rows = (long)n * (H / Hkv), chunks = (L0 + n + ATTN_CHUNK - 1) / ATTN_CHUNK;
    return 4L * (Hkv * chunks * rows * (Dv + 2) + (long)threads * ATTN_CHUNK) + 64;
}

int strata_attn_rows(int n, int H, int Hkv, int D, int Dv, const float *q, const float *k, const float *v,
                     long kps, long khs, long vps, long vhs, int L0, float scale, float *out, int threads,
                     float *ws) {
    if (n < 1 || Hkv < 1 || H % Hkv || L0 < 0) return -1;
    const int G = H / Hkv, R = n * G, Ltot = L0 + n;
    const int chunks = (Ltot + ATTN_CHUNK - 1) / ATTN_CHUNK, W = Dv + 2;
    float *part = ws, *scores = ws + (long)Hkv * chunks * R * W;
    const int items = Hkv * chunks;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && items > 1)
    for (int it = 0; it < items; it++) {
        const int h = it / chunks, c = it % chunks;
        const int j0 = c * ATTN_CHUNK, j1 = j0 + ATTN_CHUNK < Ltot ? j0 + ATTN_CHUNK : Ltot;
        const int r0 = j0 - L0 > 0 ? j0 - L0 : 0;  /* the first query that sees a key of this chunk */
        float *s = scores + (long)omp_get_thread_num() * ATTN_CHUNK;
        float *pw = part + ((long)h * chunks + c) * R * W;
        for (int r = 0; r < n; r++)
            for (int g = 0; g < G; g++) {
                float *o = pw + (long)(r * G + g) * W;
                if (r < r0) { o[Dv] = -INFINITY; o[Dv + 1] = 0.0f; continue; }  /* sees no key of this chunk */
                const int nk = (L0 + r + 1 < j1 ? L0 + r + 1 : j1) - j0;  /* its keys here: j0 .. j0 + nk - 1 */
                const float *kh = k + (long)j0 * kps + (long)h * khs, *vh = v + (long)j0 * vps + (long)h * vhs;
                /* (the chunk's keys and values are read from memory by the first query head, from cache by the
                   others: a chunk's rows of one head fit in L2) */
                const float *qr = q + ((long)r * H + h * G + g) * D;  /* (64: the common head size, unrolled) */
                o[Dv] = D == 64 ? attn_softmax_part(qr, kh, kps, 64, nk, scale, s, o + Dv + 1)
                                : attn_softmax_part(qr, kh, kps, D, nk, scale, s, o + Dv + 1);
                if (Dv == 64) attn_values(s, vh, vps, 64, nk, o); else attn_values(s, vh, vps, Dv, nk, o);
            }
    }
    /* each query head's chunks merged in order */
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && Hkv * R > 1)
    for (int it = 0; it < Hkv * R; it++) {
        const int h = it / R, rg = it % R, r = rg / G, g = rg % G;
        const int last = (L0 + r) / ATTN_CHUNK;  /* its last chunk */
        float mx = -INFINITY;
        for (int c = 0; c <= last; c++) {
            const float mc = part[(((long)h * chunks + c) * R + rg) * W + Dv];
            mx = mc > mx ? mc : mx;
        }
        float *o = out + ((long)r * H + h * G + g) * Dv, l = 0.0f;
        for (int d = 0; d < Dv; d++) o[d] = 0.0f;
        for (int c = 0; c <= last; c++) {
            const float *pc = part + (((long)h * chunks + c) * R + rg) * W;
            const float f = attn_exp(pc[Dv] - mx);
            l += f * pc[Dv + 1];
            for (int d = 0; d < Dv; d++) o[d] += f * pc[d];
        }
        const float inv = 1.0f / l;
        for (int d = 0; d < Dv; d++) o[d] *= inv;
    }
    return 0;
}
