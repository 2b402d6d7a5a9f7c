/*
 * norm.c -- LayerNorm / RMSNorm forward and backward, one row at a time
 * (see norm.h).  Statistics are two passes over a row already in cache; the
 * weight gradients accumulate in per-thread fp32 buffers summed at the end.
 */
#include "norm.h"

#include <math.h>
#include <stdlib.h>

#define CLONES __attribute__((target_clones("avx2", "default")))

typedef struct {
    int rms;
    sfk_dtype t;
    const void *x, *dy;
    void *y, *dx;
    int64_t n;
    const float *w, *b;
    float eps;
    float *mean, *rstd;
    const float *cmean, *crstd;
    float *part;            /* per-thread [2, n] partial dw, db */
    size_t scratch;         /* bytes of each thread's row buffers (16-bit types) */
    int err;
} norm_ctx;

/* Row sums as SIMD reductions: lane-wise partial sums combined at the end
 * (vectorized without -ffast-math, and more accurate than one running sum). */
CLONES static float row_sum(const float *x, int64_t n)
{
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += x[i];
    return s;
}

CLONES static float row_sqdev(const float *x, int64_t n, float mu)
{
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) { float d = x[i] - mu; s += d * d; }
    return s;
}

CLONES static void row_affine(float *restrict out, const float *restrict x, int64_t n, float mu,
                              float rs, const float *restrict w, const float *restrict b)
{
    if (w && b) for (int64_t i = 0; i < n; i++) out[i] = (x[i] - mu) * rs * w[i] + b[i];
    else if (w) for (int64_t i = 0; i < n; i++) out[i] = (x[i] - mu) * rs * w[i];
    else if (b) for (int64_t i = 0; i < n; i++) out[i] = (x[i] - mu) * rs + b[i];
    else for (int64_t i = 0; i < n; i++) out[i] = (x[i] - mu) * rs;
}

static void forward_rows(void *arg, int64_t r0, int64_t r1, int tid)
{
    (void)tid;
    norm_ctx *c = arg;
    const int64_t n = c->n;
    float *buf = c->t == SFK_F32 ? NULL : malloc(c->scratch);
    if (c->t != SFK_F32 && !buf) { c->err = SF_ENOMEM; return; }
    for (int64_t r = r0; r < r1; r++) {
        const float *x = sfk_row(c->t, c->x, r, n, buf);
        float mu = 0.0f, var;
        if (c->rms) var = row_sqdev(x, n, 0.0f) / (float)n;
        else {
            mu = row_sum(x, n) / (float)n;
            var = row_sqdev(x, n, mu) / (float)n;
        }
        float rs = 1.0f / sqrtf(var + c->eps);
        float *out = buf ? buf + n : (float *)c->y + r * n;
        row_affine(out, x, n, mu, rs, c->w, c->rms ? NULL : c->b);
        if (buf) sfk_store(c->t, out, n, (char *)c->y + (size_t)(r * n) * 2);
        if (c->mean) c->mean[r] = mu;
        c->rstd[r] = rs;
    }
    free(buf);
}

/* dx row and the row's contribution to dw / db (w, dw, db all present).
 * The two row sums are SIMD reductions (lane-wise partial sums, combined at
 * the end), so the loop is one vectorized pass over x, dy and w. */
CLONES static void row_backward(int rms, const float *restrict dy, const float *restrict x,
                                int64_t n, const float *restrict w, float mu, float rs,
                                float *restrict dx, float *restrict dw, float *restrict db)
{
    float sg = 0.0f, sgx = 0.0f;
#pragma omp simd reduction(+ : sg, sgx)
    for (int64_t i = 0; i < n; i++) {
        float xh = (x[i] - mu) * rs, d = dy[i], g = d * w[i];
        sg += g;
        sgx += g * xh;
        dw[i] += d * xh;
        db[i] += d;
    }
    const float mg = rms ? 0.0f : sg / (float)n, mgx = sgx / (float)n;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        float xh = (x[i] - mu) * rs;
        dx[i] = rs * (dy[i] * w[i] - mg - xh * mgx);
    }
}

static void backward_rows(void *arg, int64_t r0, int64_t r1, int tid)
{
    norm_ctx *c = arg;
    const int64_t n = c->n;
    float *buf = c->t == SFK_F32 ? NULL : malloc(c->scratch);
    if (c->t != SFK_F32 && !buf) { c->err = SF_ENOMEM; return; }
    float *dw = c->part + (size_t)tid * 2 * (size_t)n, *db = dw + n;
    for (int64_t r = r0; r < r1; r++) {
        const float *dy = sfk_row(c->t, c->dy, r, n, buf);
        const float *x = sfk_row(c->t, c->x, r, n, buf ? buf + n : NULL);
        float *dx = buf ? buf + 2 * n : (float *)c->dx + r * n;
        row_backward(c->rms, dy, x, n, c->w, c->rms ? 0.0f : c->cmean[r], c->crstd[r], dx, dw, db);
        if (buf) sfk_store(c->t, dx, n, (char *)c->dx + (size_t)(r * n) * 2);
    }
    free(buf);
}

sf_status sfk_norm_forward(int rms, sfk_dtype t, const void *x, int64_t rows, int64_t n,
                           const float *w, const float *b, float eps, void *y, float *mean,
                           float *rstd, sf_error *err)
{
    static const char fn[] = "norm_forward";
    sf_status rc;
    if ((rc = sfk_check_norm_args(fn, t, rows, n, x, rstd, err)) ||
        (rc = sfk_check_ptr(fn, "y", y, n > 0 ? rows : 0, err)))
        return rc;
    if (rows == 0)
        return SF_OK;                          /* every output is empty */
    if (n == 0) {
        /* y is empty; the statistics of an empty row are 0 / 0, as the loop would make them */
        for (int64_t r = 0; r < rows; r++) {
            if (mean) mean[r] = rms ? 0.0f : NAN;
            rstd[r] = NAN;
        }
        return SF_OK;
    }
    norm_ctx c = {.rms = rms, .t = t, .x = x, .y = y, .n = n, .w = w, .b = b, .eps = eps,
                  .mean = mean, .rstd = rstd};
    if ((rc = sfk_float_bytes(fn, "row", n, 2, &c.scratch, err)))
        return rc;
    sfk_parallel_rows(rows, sfk_threads_for(rows, n), forward_rows, &c);
    return c.err ? sfk_no_memory(fn, (double)c.scratch, err) : SF_OK;
}

sf_status sfk_norm_backward(int rms, sfk_dtype t, const void *dy, const void *x, int64_t rows,
                            int64_t n, const float *w, const float *mean, const float *rstd,
                            void *dx, float *dw, float *db, sf_error *err)
{
    static const char fn[] = "norm_backward";
    sf_status rc;
    if ((rc = sfk_check_norm_args(fn, t, rows, n, x, rstd, err)) ||
        (rc = sfk_check_ptr(fn, "dy", dy, n > 0 ? rows : 0, err)) ||
        (rc = sfk_check_ptr(fn, "dx", dx, n > 0 ? rows : 0, err)) ||
        (!rms && (rc = sfk_check_ptr(fn, "mean (LayerNorm)", mean, rows, err))))
        return rc;
    if (rows == 0 || n == 0) {
        /* dx is empty; no row contributes to the weight gradients (dw / db, when
         * given, hold n floats: their size fits) */
        if (dw) memset(dw, 0, (size_t)n * sizeof(float));
        if (db) memset(db, 0, (size_t)n * sizeof(float));
        return SF_OK;
    }
    int nt = sfk_threads_for(rows, sfk_sat_mul(3, n));
    norm_ctx c = {.rms = rms, .t = t, .x = x, .dy = dy, .dx = dx, .n = n, .w = w,
                  .cmean = mean, .crstd = rstd};
    /* per-thread [dw, db] partials; a missing weight is a weight of ones */
    size_t part_bytes;
    if ((rc = sfk_float_bytes(fn, "row", n, 3, &c.scratch, err)) ||
        (rc = sfk_float_bytes(fn, "weight-gradient", n, 2 * (int64_t)nt + (w ? 0 : 1),
                              &part_bytes, err)))
        return rc;
    c.part = calloc(part_bytes, 1);
    if (!c.part) return sfk_no_memory(fn, (double)part_bytes, err);
    if (!w) {
        float *ones = c.part + (size_t)nt * 2 * (size_t)n;
        for (int64_t i = 0; i < n; i++) ones[i] = 1.0f;
        c.w = ones;
    }
    sfk_parallel_rows(rows, nt, backward_rows, &c);
    for (int64_t i = 0; i < n; i++) {
        float sw = 0.0f, sb = 0.0f;
        for (int k = 0; k < nt; k++) {
            sw += c.part[(size_t)k * 2 * n + i];
            sb += c.part[(size_t)k * 2 * n + n + i];
        }
        if (dw) dw[i] = sw;
        if (db) db[i] = sb;
    }
    free(c.part);
    return c.err ? sfk_no_memory(fn, (double)c.scratch, err) : SF_OK;
}
