/* A decode step's small per-row ops on the CPU, each one call where torch runs 5-25 operators on rows of a few
   hundred floats (their dispatch, not their arithmetic, was the cost): the per-head q/k RMSNorm with the rotary
   embedding, and SwiGLU's middle. Rows are independent: a row's result does not
   depend on the rows beside it (a verify step's tokens get what one-token steps get). float32 throughout. */

/* 1 / sqrt(mean(x^2) + eps) over D floats as ggml's CPU RMSNorm computes it: the squares summed in double, in
   order, the mean rounded to float, then the float root (llama.cpp's own figures are this op's oracle: a scale
   one rounding off tips an int8 rounding of the activations downstream) */
static inline float norm_scale(const float *restrict x, int D, float eps) {
    double sum = 0.0;
    for (int d = 0; d < D; d++) sum += (double)x[d] * (double)x[d];
    const float mean = (float)(sum / D);
    return 1.0f / sqrtf(mean + eps);
}

/* One head row x [D] (norm weight nw or NULL) -> o: the RMSNorm, then the rotary over its first `dim` at the
   tables' row (cs, sn: dim/2 floats each): neox rotates the halves, else adjacent pairs; the rest copied. */
static inline void norm_rope_row(const float *restrict x, float *restrict o, int D, int dim, int neox,
                                 const float *nw, float eps, const float *cs, const float *sn) {
    if (nw) {
        const float r = norm_scale(x, D, eps);
        for (int d = 0; d < D; d++) o[d] = x[d] * r * nw[d];
    } else {
        for (int d = 0; d < D; d++) o[d] = x[d];
    }
    const int h = dim / 2;
    float tmp[256];  /* dim <= 512 (the caller checks) */
    for (int i = 0; i < h; i++) {
        const float x1 = neox ? o[i] : o[2 * i], x2 = neox ? o[i + h] : o[2 * i + 1];
        tmp[2 * i] = x1 * cs[i] - x2 * sn[i];
        tmp[2 * i + 1] = neox ? x2 * cs[i] + x1 * sn[i] : x1 * sn[i] + x2 * cs[i];
    }
    for (int i = 0; i < h; i++) {
        if (neox) { o[i] = tmp[2 * i]; o[i + h] = tmp[2 * i + 1]; }
        else { o[2 * i] = tmp[2 * i]; o[2 * i + 1] = tmp[2 * i + 1]; }
    }
}

/* q [N, Hq, D] (token rows qs floats apart, heads D apart) and k [N, Hk, D] (ks; k NULL: none) -> qo, ko
   contiguous; token t at position pos[t] of the tables [positions, dim / 2]. */
void strata_qk_norm_rope(int N, int Hq, int Hk, int D, int dim, int neox, const float *q, long qs, const float *k,
                         long ks, const long *pos, const float *cos_t, const float *sin_t, const float *qn,
                         const float *kn, float eps, float *qo, float *ko) {
    const int h = dim / 2;
    for (int t = 0; t < N; t++) {
        const float *cs = cos_t + pos[t] * h, *sn = sin_t + pos[t] * h;
        for (int i = 0; i < Hq; i++)
            norm_rope_row(q + t * qs + (long)i * D, qo + ((long)t * Hq + i) * D, D, dim, neox, qn, eps, cs, sn);
        if (k)
            for (int i = 0; i < Hk; i++)
                norm_rope_row(k + t * ks + (long)i * D, ko + ((long)t * Hk + i) * D, D, dim, neox, kn, eps, cs, sn);
    }
}

/* SwiGLU's middle, out = silu(g) * u = g / (1 + e^-g) * u, for N rows of F (g, u rows gs, us floats apart: views
   of one gate|up output; out [N, F] contiguous). Element by element with the C library's expf: torch's vectorized
   silu computes the elements past a multiple of its vector width with another exp, so an element's bits depended
   on the width of the tensor it sat in (a verify step's rows against a one-token step's) */
void strata_silu_mul(int N, int F, const float *g, long gs, const float *u, long us, float *out) {
    for (int t = 0; t < N; t++) {
        const float *gr = g + t * gs, *ur = u + t * us;
        float *o = out + (long)t * F;
        for (int i = 0; i < F; i++) o[i] = gr[i] / (1.0f + expf(-gr[i])) * ur[i];
    }
}
