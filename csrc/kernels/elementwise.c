/*
 * elementwise.c -- bias+GeLU, SwiGLU and bias+dropout+residual-add, forward
 * and backward (see elementwise.h).  Each works on one row (or, for SwiGLU,
 * one chunk of the flat arrays) at a time in fp32 buffers; the
 * exponentials go through the vectorized sfk_exp.
 */
#include "elementwise.h"

#include <math.h>
#include <stdlib.h>

#define CLONES __attribute__((target_clones("avx2", "default")))
#define CHUNK 4096
#define SQRT1_2 0.70710678118654752f
#define INV_SQRT_2PI 0.39894228040143268f
#define K_TANH 0.79788456080286536f   /* sqrt(2 / pi) */
#define C_TANH 0.044715f

typedef struct {
    sfk_dtype t;
    const void *a, *b2, *c3;       /* inputs (meaning per op) */
    void *o1, *o2;                 /* outputs */
    const float *bias;
    float *part;                   /* per-thread [n] partial bias gradients */
    size_t scratch;                /* bytes of each thread's fp32 row buffers */
    int64_t n, numel;
    int flag;
    float p;
    uint64_t seed;
    int err;
} ew_ctx;

/* A thread's row buffers (c->scratch bytes, sized by run_with_db). */
static float *bufs(ew_ctx *c)
{
    float *b = malloc(c->scratch);
    if (!b) c->err = SF_ENOMEM;
    return b;
}

static void *at(const ew_ctx *c, const void *base, int64_t r)
{
    return (char *)base + (size_t)(r * c->n) * (size_t)sfk_size(c->t);
}

/* fp32 arrays are used in place; 16-bit ones go through fp32 buffers. */
static const float *in_row(const ew_ctx *c, const void *base, int64_t r, int64_t len, float *buf)
{
    if (c->t == SFK_F32) return (const float *)at(c, base, r);
    sfk_load(c->t, at(c, base, r), len, buf);
    return buf;
}

static float *out_row(const ew_ctx *c, void *base, int64_t r, float *buf)
{
    return c->t == SFK_F32 ? (float *)at(c, base, r) : buf;
}

/* ---- bias + GeLU -------------------------------------------------------- */

/* From e = exp(-2a): s = sigmoid(2a) = 1 / (1 + e) = (1 + tanh a) / 2 and
 * 1 - s = e / (1 + e) = 1 / (1 + 1 / e) = (1 - tanh a) / 2, both without
 * cancellation in either tail, and branch-free (IEEE division takes e = 0 and
 * e = inf to the limits 0 and 1), so the loops over them vectorize. */
static inline float sig_from(float e) { return 1.0f / (1.0f + e); }
static inline float one_minus_sig_from(float e) { return 1.0f / (1.0f + 1.0f / e); }

/* Phi(u) = (1 + erf(u / sqrt 2)) / 2 from e = exp(-fl(u^2) / 2), by the same
 * erfc form as the SIMD path (gelu_erf8, below): z = |u| / sqrt 2,
 * t = 2 / (2 + z), erfc(z) = t exp(-z^2) Q(t) with the same fitted degree-8
 * Q (relative accuracy over the whole left tail), and e corrected for the
 * rounding of u^2 (*gauss = exp(-u^2 / 2), for the gradient).  Reflected by
 * the sign bit of u.  Branch-free, so the loops calling it vectorize. */
static inline float phi_gauss(float u, float e, float *gauss)
{
    const float z = fabsf(u) * SQRT1_2, t = 2.0f / (2.0f + z);
    float q = -5.938686803e-02f;
    q = q * t + 2.861254513e-01f;
    q = q * t - 4.904082716e-01f;
    q = q * t + 2.817339897e-01f;
    q = q * t - 2.914794162e-02f;
    q = q * t + 2.037517875e-01f;
    q = q * t + 2.428354323e-01f;
    q = q * t + 2.824120522e-01f;
    q = q * t + 2.820843458e-01f;
    const float lo = fmaf(u, u, -(u * u)) * 0.5f;
    e = e - e * lo;
    *gauss = e;
    const float tail = 0.5f * t * (q * e);
    return signbit(u) ? tail : 1.0f - tail;
}

/* One row in three passes: u = x + b with the exponent e of its form
 * (erf: -u^2 / 2; tanh: -2 k (u + c u^3)), then e = exp(e) (vectorized), then
 * the output from u and e alone. */
CLONES static void gelu_prep(float *restrict u, float *restrict e, const float *restrict x,
                             const float *restrict b, int64_t n, int tanh_form)
{
    if (tanh_form) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            float v = b ? x[i] + b[i] : x[i];
            u[i] = v;
            e[i] = -2.0f * K_TANH * (v + C_TANH * v * v * v);
        }
    } else {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            float v = b ? x[i] + b[i] : x[i];
            u[i] = v;
            e[i] = -0.5f * v * v;
        }
    }
}

/* y = u Phi(u) (erf) or u sigmoid(2a) (tanh). */
CLONES static void gelu_out(float *restrict y, const float *restrict u, const float *restrict e,
                            int64_t n, int tanh_form)
{
    if (tanh_form) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) y[i] = u[i] * sig_from(e[i]);
    } else {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            float gauss;
            y[i] = u[i] * phi_gauss(u[i], e[i], &gauss);
        }
    }
}

/* g = dy * gelu'(u), and db += g when db is given.
 * erf: gelu' = Phi(u) + u phi(u), phi(u) = exp(-u^2 / 2) / sqrt(2 pi);
 * tanh: 0.5 (1 + th) + 0.5 u (1 - th^2) k (1 + 3 c u^2), th = 2 s - 1. */
CLONES static void gelu_grad(float *restrict g, const float *restrict dy, const float *restrict u,
                             const float *restrict e, float *restrict db, int64_t n, int tanh_form)
{
    if (tanh_form) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            float s = sig_from(e[i]), x = u[i];
            g[i] = dy[i] * (s + 2.0f * x * s * one_minus_sig_from(e[i]) * K_TANH
                                    * (1.0f + 3.0f * C_TANH * x * x));
        }
    } else {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            float gauss;
            const float p = phi_gauss(u[i], e[i], &gauss);
            g[i] = dy[i] * (p + u[i] * gauss * INV_SQRT_2PI);
        }
    }
    if (db) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) db[i] += g[i];
    }
}

#if defined(__x86_64__) || defined(__i386__)
#define EW_AVX2 __attribute__((target("avx2,fma")))
/* The erf form in one AVX2 pass per row.  With z = |u| / sqrt 2 and
 * t = 2 / (2 + z), erfc(z) = t exp(-z^2) Q(t) for all z >= 0, Q a degree-8
 * polynomial fitted here (weighted least squares on the relative error of
 * erfc over z in [0, 14], float64; 8e-8 relative with the fp32-rounded
 * coefficients), so Phi(u) = erfc(z) / 2 for u < 0 and 1 - erfc(z) / 2 for
 * u >= 0: relative accuracy in the left tail too (no 1 + erf(..) to cancel).
 * exp(-u^2 / 2) is taken at the rounded hi = fl(u^2) / 2 and corrected by
 * (1 - lo), lo = (u^2 - fl(u^2)) / 2 exact by FMA, so that the rounding of
 * u^2 (up to 8e-6 relative at |u| = 13) does not reach the tail.  Both the
 * output and the gradient come from the one exponential:
 * phi(u) = exp(-u^2 / 2) / sqrt(2 pi).  Left tail: exp(-u^2 / 2) leaves the
 * normal floats at |u| = 13.2 while Phi(u) and gelu'(u) = Phi(u) + u phi(u)
 * stay normal to |u| = 13.3, so the exponential and the tail terms are
 * carried at scale 2^GELU_TAIL_SCALE and each result rounded once when
 * scaled back (subnormal results correctly rounded, not flushed).  Max error
 * against float64 over u in [-14, 14] and the tails: see
 * tests/test_kernels.py::test_gelu_erf_accuracy. */
#define GELU_TAIL_SCALE 64
#define GELU_EXP_MIN (-131.0f)          /* >= -(126 + 64) ln2; exp(-131) 2^-64 underflows anyway */
#define GELU_UNSCALE 5.42101086242752217e-20f   /* 2^-64 */

/* y = u Phi(u) and, where d is given, d = gelu'(u) = Phi(u) + u phi(u). */
EW_AVX2 static inline __m256 gelu_erf8(__m256 u, __m256 *d)
{
    const __m256 sign = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f);
    const __m256 unscale = _mm256_set1_ps(GELU_UNSCALE);
    const __m256 z = _mm256_mul_ps(_mm256_andnot_ps(sign, u), _mm256_set1_ps(SQRT1_2));
    const __m256 t = _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(_mm256_set1_ps(2.0f), z));
    __m256 q = _mm256_set1_ps(-5.938686803e-02f);
    q = _mm256_fmadd_ps(q, t, _mm256_set1_ps(2.861254513e-01f));
    q = _mm256_fmadd_ps(q, t, _mm256_set1_ps(-4.904082716e-01f));
    q = _mm256_fmadd_ps(q, t, _mm256_set1_ps(2.817339897e-01f));
    q = _mm256_fmadd_ps(q, t, _mm256_set1_ps(-2.914794162e-02f));
    q = _mm256_fmadd_ps(q, t, _mm256_set1_ps(2.037517875e-01f));
    q = _mm256_fmadd_ps(q, t, _mm256_set1_ps(2.428354323e-01f));
    q = _mm256_fmadd_ps(q, t, _mm256_set1_ps(2.824120522e-01f));
    q = _mm256_fmadd_ps(q, t, _mm256_set1_ps(2.820843458e-01f));
    const __m256 uu = _mm256_mul_ps(u, u);
    const __m256 lo = _mm256_mul_ps(_mm256_fmsub_ps(u, u, uu), half);
    __m256 es = sfk_exp8_pow2(_mm256_mul_ps(uu, _mm256_set1_ps(-0.5f)), GELU_TAIL_SCALE, GELU_EXP_MIN);
    es = _mm256_fnmadd_ps(es, lo, es);                            /* exp(-u^2 / 2) 2^64 */
    const __m256 tails = _mm256_mul_ps(_mm256_mul_ps(half, t), _mm256_mul_ps(q, es));  /* erfc(z) / 2 2^64 */
    const __m256 tail = _mm256_mul_ps(tails, unscale);
    /* the sign bit of u picks the left tail */
    const __m256 y = _mm256_blendv_ps(_mm256_mul_ps(u, _mm256_sub_ps(_mm256_set1_ps(1.0f), tail)),
                                      _mm256_mul_ps(_mm256_mul_ps(u, tails), unscale), u);
    if (d) {
        const __m256 ues = _mm256_mul_ps(u, es);                  /* u phi(u) sqrt(2 pi) 2^64 */
        const __m256 right = _mm256_fmadd_ps(ues, _mm256_set1_ps(INV_SQRT_2PI * GELU_UNSCALE),
                                             _mm256_sub_ps(_mm256_set1_ps(1.0f), tail));
        const __m256 left = _mm256_mul_ps(_mm256_fmadd_ps(ues, _mm256_set1_ps(INV_SQRT_2PI), tails), unscale);
        *d = _mm256_blendv_ps(right, left, u);
    }
    return y;
}

/* y = gelu(x + b) (b may be NULL); the last n % 8 through a padded vector. */
EW_AVX2 static void gelu_erf_fwd_avx2(float *y, const float *x, const float *b, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 u = _mm256_loadu_ps(x + i);
        if (b) u = _mm256_add_ps(u, _mm256_loadu_ps(b + i));
        _mm256_storeu_ps(y + i, gelu_erf8(u, NULL));
    }
    if (i < n) {
        float buf[8] = {0};
        for (int64_t k = i; k < n; k++) buf[k - i] = b ? x[k] + b[k] : x[k];
        _mm256_storeu_ps(buf, gelu_erf8(_mm256_loadu_ps(buf), NULL));
        for (int64_t k = i; k < n; k++) y[k] = buf[k - i];
    }
}

/* g = dy * gelu'(u), u = x + b; db += g when given. */
EW_AVX2 static void gelu_erf_bwd_avx2(float *gout, const float *dy, const float *x, const float *b,
                                      float *db, int64_t n)
{
    __m256 d;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 u = _mm256_loadu_ps(x + i);
        if (b) u = _mm256_add_ps(u, _mm256_loadu_ps(b + i));
        (void)gelu_erf8(u, &d);
        const __m256 g = _mm256_mul_ps(_mm256_loadu_ps(dy + i), d);
        _mm256_storeu_ps(gout + i, g);
        if (db) _mm256_storeu_ps(db + i, _mm256_add_ps(_mm256_loadu_ps(db + i), g));
    }
    for (; i < n; i++) {
        float bu[8] = {0};
        bu[0] = b ? x[i] + b[i] : x[i];
        (void)gelu_erf8(_mm256_loadu_ps(bu), &d);
        _mm256_storeu_ps(bu, d);
        gout[i] = dy[i] * bu[0];
        if (db) db[i] += gout[i];
    }
}
#define EW_HAVE_AVX2 1

/* The same erf form, 16 lanes wide (AVX-512F), where the CPU has it: the
 * arithmetic of gelu_erf8 lane for lane (same polynomial, same exp and the
 * same correction of u^2's rounding), so both paths give the same results;
 * the ragged end of a row through masked loads and stores. */
#define EW_AVX512 __attribute__((target("avx512f")))

/* gelu_erf8 at 16 lanes: y = u Phi(u) and, where d is given, gelu'(u). */
EW_AVX512 static inline __m512 gelu_erf16(__m512 u, __m512 *d)
{
    const __m512 half = _mm512_set1_ps(0.5f), unscale = _mm512_set1_ps(GELU_UNSCALE);
    const __m512 z = _mm512_mul_ps(_mm512_abs_ps(u), _mm512_set1_ps(SQRT1_2));
    const __m512 t = _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(_mm512_set1_ps(2.0f), z));
    __m512 q = _mm512_set1_ps(-5.938686803e-02f);
    q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(2.861254513e-01f));
    q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(-4.904082716e-01f));
    q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(2.817339897e-01f));
    q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(-2.914794162e-02f));
    q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(2.037517875e-01f));
    q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(2.428354323e-01f));
    q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(2.824120522e-01f));
    q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(2.820843458e-01f));
    const __m512 uu = _mm512_mul_ps(u, u);
    const __m512 lo = _mm512_mul_ps(_mm512_fmsub_ps(u, u, uu), half);
    __m512 es = sfk_exp16_pow2(_mm512_mul_ps(uu, _mm512_set1_ps(-0.5f)), GELU_TAIL_SCALE, GELU_EXP_MIN);
    es = _mm512_fnmadd_ps(es, lo, es);
    const __m512 tails = _mm512_mul_ps(_mm512_mul_ps(half, t), _mm512_mul_ps(q, es));
    const __m512 tail = _mm512_mul_ps(tails, unscale);
    /* the sign bit of u picks the left tail, as blendv does in gelu_erf8 */
    const __mmask16 neg = _mm512_test_epi32_mask(_mm512_castps_si512(u), _mm512_set1_epi32((int)0x80000000u));
    const __m512 y = _mm512_mask_blend_ps(neg, _mm512_mul_ps(u, _mm512_sub_ps(_mm512_set1_ps(1.0f), tail)),
                                          _mm512_mul_ps(_mm512_mul_ps(u, tails), unscale));
    if (d) {
        const __m512 ues = _mm512_mul_ps(u, es);
        const __m512 right = _mm512_fmadd_ps(ues, _mm512_set1_ps(INV_SQRT_2PI * GELU_UNSCALE),
                                             _mm512_sub_ps(_mm512_set1_ps(1.0f), tail));
        const __m512 left = _mm512_mul_ps(_mm512_fmadd_ps(ues, _mm512_set1_ps(INV_SQRT_2PI), tails), unscale);
        *d = _mm512_mask_blend_ps(neg, right, left);
    }
    return y;
}

static inline __mmask16 ew_mask(int64_t left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u); }

EW_AVX512 static void gelu_erf_fwd_avx512(float *y, const float *x, const float *b, int64_t n)
{
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = ew_mask(n - i);
        __m512 u = _mm512_maskz_loadu_ps(m, x + i);
        if (b) u = _mm512_add_ps(u, _mm512_maskz_loadu_ps(m, b + i));
        _mm512_mask_storeu_ps(y + i, m, gelu_erf16(u, NULL));
    }
}

EW_AVX512 static void gelu_erf_bwd_avx512(float *gout, const float *dy, const float *x, const float *b,
                                          float *db, int64_t n)
{
    __m512 d;
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = ew_mask(n - i);
        __m512 u = _mm512_maskz_loadu_ps(m, x + i);
        if (b) u = _mm512_add_ps(u, _mm512_maskz_loadu_ps(m, b + i));
        (void)gelu_erf16(u, &d);
        const __m512 g = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, dy + i), d);
        _mm512_mask_storeu_ps(gout + i, m, g);
        if (db) _mm512_mask_storeu_ps(db + i, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, db + i), g));
    }
}
#endif

static void gelu_fwd_rows(void *arg, int64_t r0, int64_t r1, int tid)
{
    (void)tid;
    ew_ctx *c = arg;
    const int64_t n = c->n;
    float *u = bufs(c), *e = u ? u + n : NULL;
    if (!u) return;
#ifdef EW_HAVE_AVX2
    if (!c->flag && sf_cpu_has_simd()) {
        for (int64_t r = r0; r < r1; r++) {
            float *y = out_row(c, c->o1, r, u + 2 * n);
            if (sf_cpu_has_avx512()) gelu_erf_fwd_avx512(y, in_row(c, c->a, r, n, u), c->bias, n);
            else gelu_erf_fwd_avx2(y, in_row(c, c->a, r, n, u), c->bias, n);
            if (c->t != SFK_F32) sfk_store(c->t, y, n, at(c, c->o1, r));
        }
        free(u);
        return;
    }
#endif
    for (int64_t r = r0; r < r1; r++) {
        gelu_prep(u, e, in_row(c, c->a, r, n, u + 2 * n), c->bias, n, c->flag);
        sfk_exp(e, e, n);
        float *y = out_row(c, c->o1, r, u + 2 * n);
        gelu_out(y, u, e, n, c->flag);
        if (c->t != SFK_F32) sfk_store(c->t, y, n, at(c, c->o1, r));
    }
    free(u);
}

static void gelu_bwd_rows(void *arg, int64_t r0, int64_t r1, int tid)
{
    ew_ctx *c = arg;
    const int64_t n = c->n;
    float *u = bufs(c), *e = u ? u + n : NULL;
    if (!u) return;
    float *db = c->part ? c->part + (size_t)tid * n : NULL;
#ifdef EW_HAVE_AVX2
    if (!c->flag && sf_cpu_has_simd()) {
        for (int64_t r = r0; r < r1; r++) {
            const float *x = in_row(c, c->b2, r, n, u);
            const float *dy = in_row(c, c->a, r, n, u + n);
            float *g = out_row(c, c->o1, r, u + 2 * n);
            if (sf_cpu_has_avx512()) gelu_erf_bwd_avx512(g, dy, x, c->bias, db, n);
            else gelu_erf_bwd_avx2(g, dy, x, c->bias, db, n);
            if (c->t != SFK_F32) sfk_store(c->t, g, n, at(c, c->o1, r));
        }
        free(u);
        return;
    }
#endif
    for (int64_t r = r0; r < r1; r++) {
        gelu_prep(u, e, in_row(c, c->b2, r, n, u + 2 * n), c->bias, n, c->flag);
        sfk_exp(e, e, n);
        const float *dy = in_row(c, c->a, r, n, u + 3 * n);
        float *g = out_row(c, c->o1, r, u + 2 * n);
        gelu_grad(g, dy, u, e, db, n, c->flag);
        if (c->t != SFK_F32) sfk_store(c->t, g, n, at(c, c->o1, r));
    }
    free(u);
}

/* ---- SwiGLU ------------------------------------------------------------- */

CLONES static void swiglu_rows(void *arg, int64_t r0, int64_t r1, int tid)
{
    (void)tid;
    ew_ctx *c = arg;
    const int64_t n = c->n;
    float *buf = bufs(c);
    if (!buf) return;
    float *e = buf, *o1 = buf + n, *o2 = buf + 2 * n;
    for (int64_t r = r0; r < r1; r++) {
        int64_t len = c->numel - r * n < n ? c->numel - r * n : n;
        const float *g = in_row(c, c->b2, r, len, buf + 3 * n);
        const float *u = in_row(c, c->c3, r, len, buf + 4 * n);
        for (int64_t i = 0; i < len; i++) e[i] = -g[i];
        sfk_exp(e, e, len);                         /* e = exp(-g) */
        float *y1 = out_row(c, c->o1, r, o1);
        if (!c->a) {                                /* forward */
            for (int64_t i = 0; i < len; i++) y1[i] = g[i] / (1.0f + e[i]) * u[i];
        } else {
            const float *d = in_row(c, c->a, r, len, buf + 5 * n);   /* dy */
            float *y2 = out_row(c, c->o2, r, o2);
            for (int64_t i = 0; i < len; i++) {
                float sg = 1.0f / (1.0f + e[i]), gi = g[i], ui = u[i], di = d[i];
                y1[i] = di * ui * sg * (1.0f + gi * (1.0f - sg));
                y2[i] = di * gi * sg;
            }
            if (c->t != SFK_F32) sfk_store(c->t, y2, len, at(c, c->o2, r));
        }
        if (c->t != SFK_F32) sfk_store(c->t, y1, len, at(c, c->o1, r));
    }
    free(buf);
}

/* ---- bias + dropout + residual ------------------------------------------ */

int sfk_dropout_keep(uint64_t seed, int64_t index, int64_t n, float p)
{
    return p <= 0.0f ||
           (n > 0 && sfk_dropout_kept(sfk_dropout_key(seed, index / n), index % n, sfk_dropout_threshold(p)));
}

CLONES static void bda_rows(void *arg, int64_t r0, int64_t r1, int tid)
{
    ew_ctx *c = arg;
    const int64_t n = c->n;
    float *x = bufs(c), *rr = x ? x + n : NULL;
    if (!x) return;
    const float scale = c->p > 0.0f ? (c->p < 1.0f ? 1.0f / (1.0f - c->p) : 0.0f) : 1.0f;
    const uint32_t thresh = sfk_dropout_threshold(c->p);
    float *db = c->part ? c->part + (size_t)tid * n : NULL;
    for (int64_t r = r0; r < r1; r++) {
        sfk_load(c->t, at(c, c->a, r), n, x);       /* forward: x; backward: dy */
        if (c->c3) {                                /* forward */
            if (c->bias) for (int64_t i = 0; i < n; i++) x[i] += c->bias[i];
            sfk_load(c->t, at(c, c->c3, r), n, rr);
        }
        if (c->p > 0.0f) {
            const uint32_t key = sfk_dropout_key(c->seed, r);
            for (int64_t i = 0; i < n; i++) x[i] = sfk_dropout_kept(key, i, thresh) ? x[i] * scale : 0.0f;
        }
        if (c->c3)
            for (int64_t i = 0; i < n; i++) x[i] += rr[i];
        if (db) for (int64_t i = 0; i < n; i++) db[i] += x[i];
        sfk_store(c->t, x, n, at(c, c->o1, r));
    }
    free(x);
}

/* ---- drivers ------------------------------------------------------------ */

/* Run fn over rows with per-thread bias-gradient partials summed into db;
 * `bufs` is the number of [n] fp32 row buffers each thread allocates.  With
 * no element to compute (rows or n 0) it returns at once, db zeroed: an
 * empty input with a huge other dimension costs nothing. */
static sf_status run_with_db(const char *name, ew_ctx *c, int64_t rows, int64_t cost,
                             sfk_rows_fn fn, float *db, int bufs_per_thread, sf_error *err)
{
    if (rows == 0 || c->n == 0) {
        if (db) memset(db, 0, (size_t)c->n * sizeof(float));    /* n floats: the size fits */
        return SF_OK;
    }
    int nt = sfk_threads_for(rows, cost);
    sf_status rc;
    size_t part_bytes = 0;
    if ((rc = sfk_float_bytes(name, "row", c->n, bufs_per_thread, &c->scratch, err)) ||
        (db && (rc = sfk_float_bytes(name, "bias-gradient", c->n, nt, &part_bytes, err))))
        return rc;
    if (db) {
        c->part = calloc(part_bytes, 1);
        if (!c->part) return sfk_no_memory(name, (double)part_bytes, err);
    }
    sfk_parallel_rows(rows, nt, fn, c);
    if (db) {
        for (int64_t i = 0; i < c->n; i++) {
            float s = 0.0f;
            for (int k = 0; k < nt; k++) s += c->part[(size_t)k * (size_t)c->n + i];
            db[i] = s;
        }
        free(c->part);
    }
    return c->err ? sfk_no_memory(name, (double)c->scratch, err) : SF_OK;
}

sf_status sfk_bias_gelu_forward(sfk_dtype t, const void *x, const float *b, int64_t rows, int64_t n,
                                int tanh_approx, void *y, sf_error *err)
{
    static const char fn[] = "bias_gelu_forward";
    const int64_t any = rows > 0 && n > 0;
    sf_status rc;
    if ((rc = sfk_check_elementwise_args(fn, t, rows, n, err)) || (rc = sfk_check_ptr(fn, "x", x, any, err)) ||
        (rc = sfk_check_ptr(fn, "y", y, any, err)))
        return rc;
    ew_ctx c = {.t = t, .a = x, .o1 = y, .bias = b, .n = n, .flag = tanh_approx};
    return run_with_db(fn, &c, rows, sfk_sat_mul(n, 8), gelu_fwd_rows, NULL, 3, err);
}

sf_status sfk_bias_gelu_backward(sfk_dtype t, const void *dy, const void *x, const float *b,
                                 int64_t rows, int64_t n, int tanh_approx, void *dx, float *db,
                                 sf_error *err)
{
    static const char fn[] = "bias_gelu_backward";
    const int64_t any = rows > 0 && n > 0;
    sf_status rc;
    if ((rc = sfk_check_elementwise_args(fn, t, rows, n, err)) || (rc = sfk_check_ptr(fn, "dy", dy, any, err)) ||
        (rc = sfk_check_ptr(fn, "x", x, any, err)) || (rc = sfk_check_ptr(fn, "dx", dx, any, err)))
        return rc;
    ew_ctx c = {.t = t, .a = dy, .b2 = x, .o1 = dx, .bias = b, .n = n, .flag = tanh_approx};
    return run_with_db(fn, &c, rows, sfk_sat_mul(n, 8), gelu_bwd_rows, db, 4, err);
}

sf_status sfk_swiglu_forward(sfk_dtype t, const void *gate, const void *up, int64_t numel, void *y,
                             sf_error *err)
{
    static const char fn[] = "swiglu_forward";
    sf_status rc;
    if ((rc = sfk_check_elementwise_args(fn, t, 0, numel, err)) || (rc = sfk_check_ptr(fn, "gate", gate, numel, err)) ||
        (rc = sfk_check_ptr(fn, "up", up, numel, err)) || (rc = sfk_check_ptr(fn, "y", y, numel, err)))
        return rc;
    ew_ctx c = {.t = t, .b2 = gate, .c3 = up, .o1 = y, .n = CHUNK, .numel = numel};
    return run_with_db(fn, &c, sfk_ceil_div(numel, CHUNK), CHUNK * 4, swiglu_rows, NULL, 6, err);
}

sf_status sfk_swiglu_backward(sfk_dtype t, const void *dy, const void *gate, const void *up,
                              int64_t numel, void *dgate, void *dup, sf_error *err)
{
    static const char fn[] = "swiglu_backward";
    sf_status rc;
    if ((rc = sfk_check_elementwise_args(fn, t, 0, numel, err)) || (rc = sfk_check_ptr(fn, "dy", dy, numel, err)) ||
        (rc = sfk_check_ptr(fn, "gate", gate, numel, err)) ||
        (rc = sfk_check_ptr(fn, "up", up, numel, err)) ||
        (rc = sfk_check_ptr(fn, "dgate", dgate, numel, err)) ||
        (rc = sfk_check_ptr(fn, "dup", dup, numel, err)))
        return rc;
    ew_ctx c = {.t = t, .a = dy, .b2 = gate, .c3 = up, .o1 = dgate, .o2 = dup, .n = CHUNK,
                .numel = numel};
    return run_with_db(fn, &c, sfk_ceil_div(numel, CHUNK), CHUNK * 6, swiglu_rows, NULL, 6, err);
}

sf_status sfk_bias_dropout_add_forward(sfk_dtype t, const void *x, const float *b, const void *res,
                                       int64_t rows, int64_t n, float p, uint64_t seed, void *y,
                                       sf_error *err)
{
    static const char fn[] = "bias_dropout_add_forward";
    const int64_t any = rows > 0 && n > 0;
    sf_status rc;
    if ((rc = sfk_check_elementwise_args(fn, t, rows, n, err)) || (rc = sfk_check_dropout_p(fn, p, err)) ||
        (rc = sfk_check_ptr(fn, "x", x, any, err)) ||
        (rc = sfk_check_ptr(fn, "residual", res, any, err)) ||
        (rc = sfk_check_ptr(fn, "y", y, any, err)))
        return rc;
    ew_ctx c = {.t = t, .a = x, .c3 = res, .o1 = y, .bias = b, .n = n, .p = p, .seed = seed};
    return run_with_db(fn, &c, rows, sfk_sat_mul(n, 4), bda_rows, NULL, 2, err);
}

sf_status sfk_bias_dropout_add_backward(sfk_dtype t, const void *dy, int64_t rows, int64_t n,
                                        float p, uint64_t seed, void *dx, float *db, sf_error *err)
{
    static const char fn[] = "bias_dropout_add_backward";
    const int64_t any = rows > 0 && n > 0;
    sf_status rc;
    if ((rc = sfk_check_elementwise_args(fn, t, rows, n, err)) || (rc = sfk_check_dropout_p(fn, p, err)) ||
        (rc = sfk_check_ptr(fn, "dy", dy, any, err)) || (rc = sfk_check_ptr(fn, "dx", dx, any, err)))
        return rc;
    ew_ctx c = {.t = t, .a = dy, .o1 = dx, .n = n, .p = p, .seed = seed};
    return run_with_db(fn, &c, rows, sfk_sat_mul(n, 4), bda_rows, db, 2, err);
}
