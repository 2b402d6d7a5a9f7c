/*
 * cross_entropy.c -- vocabulary-shard cross-entropy, forward statistics and
 * backward softmax-minus-target, row by row (see cross_entropy.h).
 *
 * The forward reads each row once: blocks of SFK_XB columns are brought into
 * L1 (converted to fp32 for 16-bit types), their max merged into the running
 * max (rescaling the running sum when it grows), then summed as exp(z - max).
 */
#include "cross_entropy.h"

#include <math.h>
#include <stdlib.h>

#define SFK_XB 2048

typedef struct {
    sfk_dtype t;
    const void *logits;
    void *grad;
    int64_t n, real, vocab_start, ignore_index, vocab;
    const int64_t *labels;
    float *max, *sumexp, *target, *sumz;
    const float *lse, *scale;
    float eps;
    int err;
} xent_ctx;

/* Label r as a column of this shard, -1 when ignored or another shard's
 * (vocab_start >= 0, so y - vocab_start cannot overflow once y >= it). */
static int64_t local_label(const xent_ctx *c, int64_t r)
{
    const int64_t y = c->labels[r];
    if (y == c->ignore_index || y < c->vocab_start) return -1;
    return y - c->vocab_start < c->real ? y - c->vocab_start : -1;
}

/* Every label in [0, vocab) or ignore_index: one pass, before any work.
 * ERANGE (IndexError) naming the first label outside, as torch refuses it. */
static sf_status check_labels(const char *fn, const int64_t *labels, int64_t rows,
                              int64_t ignore_index, int64_t vocab, sf_error *err)
{
    for (int64_t r = 0; r < rows; r++) {
        const int64_t y = labels[r];
        if ((y < 0 || y >= vocab) && y != ignore_index)
            return sf_fail(err, SF_ERANGE, "%s: label %lld (row %lld) is out of range for the "
                           "vocabulary of %lld (labels must be in [0, %lld) or ignore_index=%lld)",
                           fn, (long long)y, (long long)r, (long long)vocab, (long long)vocab,
                           (long long)ignore_index);
    }
    return SF_OK;
}

static void forward_rows(void *arg, int64_t r0, int64_t r1, int tid)
{
    (void)tid;
    xent_ctx *c = arg;
    const size_t es = (size_t)sfk_size(c->t);
    float *buf = c->t == SFK_F32 ? NULL : malloc(SFK_XB * sizeof(float));
    if (c->t != SFK_F32 && !buf) { c->err = SF_ENOMEM; return; }
    for (int64_t r = r0; r < r1; r++) {
        const char *row = (const char *)c->logits + (size_t)(r * c->n) * es;
        float m = -INFINITY, s = 0.0f, sz = 0.0f;
        for (int64_t j0 = 0; j0 < c->real; j0 += SFK_XB) {
            int64_t len = c->real - j0 < SFK_XB ? c->real - j0 : SFK_XB;
            const float *z;
            if (buf) { sfk_load(c->t, row + (size_t)j0 * es, len, buf); z = buf; }
            else z = (const float *)row + j0;
            float bm = sfk_max(z, len);
            if (bm > m || bm != bm) {           /* a NaN logit makes the row's statistics NaN */
                if (s != 0.0f) s *= expf(m - bm);
                m = bm;
            }
            if (m != -INFINITY) s += sfk_sum_exp(z, len, m);
            if (c->sumz)
                for (int64_t j = 0; j < len; j++) sz += z[j];
        }
        c->max[r] = m;
        c->sumexp[r] = s;
        if (c->sumz) c->sumz[r] = sz;
        int64_t y = local_label(c, r);
        float zy = 0.0f;
        if (y >= 0) {
            const char *p = row + (size_t)y * es;
            zy = c->t == SFK_F32 ? *(const float *)p
               : c->t == SFK_BF16 ? sf_bf16_to_f32(*(const uint16_t *)p)
                                   : sf_f16_to_f32(*(const uint16_t *)p);
        }
        c->target[r] = zy;
    }
    free(buf);
}

static void backward_rows(void *arg, int64_t r0, int64_t r1, int tid)
{
    (void)tid;
    xent_ctx *c = arg;
    const size_t es = (size_t)sfk_size(c->t);
    float *buf = c->t == SFK_F32 ? NULL : malloc(SFK_XB * sizeof(float));
    if (c->t != SFK_F32 && !buf) { c->err = SF_ENOMEM; return; }
    const float smooth = c->vocab > 0 ? c->eps / (float)c->vocab : 0.0f;
    for (int64_t r = r0; r < r1; r++) {
        const char *row = (const char *)c->logits + (size_t)(r * c->n) * es;
        char *grow = (char *)c->grad + (size_t)(r * c->n) * es;
        const float g = c->scale[r];
        if (g == 0.0f) {                         /* ignored row: zero gradient */
            memset(grow, 0, (size_t)c->n * es);
            continue;
        }
        const float lse = c->lse[r], off = g * smooth;
        for (int64_t j0 = 0; j0 < c->real; j0 += SFK_XB) {
            int64_t len = c->real - j0 < SFK_XB ? c->real - j0 : SFK_XB;
            /* g * softmax - g * eps / V, straight from the logits (fp32) or via buf */
            if (buf) {
                sfk_load(c->t, row + (size_t)j0 * es, len, buf);
                sfk_scaled_exp(buf, buf, len, lse, g, off);
                sfk_store(c->t, buf, len, grow + (size_t)j0 * es);
            } else {
                sfk_scaled_exp((const float *)row + j0, (float *)grow + j0, len, lse, g, off);
            }
        }
        if (c->n > c->real)
            memset(grow + (size_t)c->real * es, 0, (size_t)(c->n - c->real) * es);
        int64_t y = local_label(c, r);
        if (y >= 0) {
            char *p = grow + (size_t)y * es;
            float d = g * (1.0f - c->eps);
            if (c->t == SFK_F32) *(float *)p -= d;
            else {
                /* recompute the entry in fp32 so it is rounded once */
                const char *zp = row == grow ? NULL : row + (size_t)y * es;
                float v;
                if (zp) {
                    float z = c->t == SFK_BF16 ? sf_bf16_to_f32(*(const uint16_t *)zp)
                                               : sf_f16_to_f32(*(const uint16_t *)zp);
                    v = g * expf(z - lse) - off - d;
                } else {
                    v = (c->t == SFK_BF16 ? sf_bf16_to_f32(*(uint16_t *)p)
                                          : sf_f16_to_f32(*(uint16_t *)p)) - d;
                }
                *(uint16_t *)p = c->t == SFK_BF16 ? sf_f32_to_bf16(v) : sf_f32_to_f16(v);
            }
        }
    }
    free(buf);
}

sf_status sfk_xent_forward(sfk_dtype t, const void *logits, int64_t rows, int64_t n, int64_t real,
                           const int64_t *labels, int64_t vocab_start, int64_t ignore_index,
                           int64_t vocab, float *max, float *sumexp, float *target, float *sumz,
                           sf_error *err)
{
    static const char fn[] = "xent_forward";
    sf_status rc;
    if ((rc = sfk_check_xent_args(fn, t, rows, n, real, vocab_start, logits, labels, err)) ||
        (rc = sfk_check_ptr(fn, "max", max, rows, err)) ||
        (rc = sfk_check_ptr(fn, "sumexp", sumexp, rows, err)) ||
        (rc = sfk_check_ptr(fn, "target", target, rows, err)) ||
        (vocab >= 0 && (rc = check_labels(fn, labels, rows, ignore_index, vocab, err))))
        return rc;
    xent_ctx c = {.t = t, .logits = logits, .n = n, .real = real, .vocab_start = vocab_start,
                  .ignore_index = ignore_index, .labels = labels, .max = max, .sumexp = sumexp,
                  .target = target, .sumz = sumz};
    sfk_parallel_rows(rows, sfk_threads_for(rows, real), forward_rows, &c);
    return c.err ? sfk_no_memory(fn, SFK_XB * (double)sizeof(float), err) : SF_OK;
}

sf_status sfk_xent_backward(sfk_dtype t, const void *logits, void *grad, int64_t rows, int64_t n,
                            int64_t real, const int64_t *labels, int64_t vocab_start,
                            int64_t ignore_index, const float *lse, const float *scale,
                            float eps, int64_t vocab, sf_error *err)
{
    static const char fn[] = "xent_backward";
    sf_status rc;
    if ((rc = sfk_check_xent_args(fn, t, rows, n, real, vocab_start, logits, labels, err)) ||
        (rc = sfk_check_size(fn, "vocab", vocab, err)) ||
        (rc = sfk_check_ptr(fn, "lse", lse, rows, err)) ||
        (rc = sfk_check_ptr(fn, "scale", scale, rows, err)) ||
        (rc = sfk_check_ptr(fn, "grad", grad, n > 0 ? rows : 0, err)))
        return rc;
    if (rows == 0 || n == 0)
        return SF_OK;                          /* the gradient is empty */
    xent_ctx c = {.t = t, .logits = logits, .grad = grad, .n = n, .real = real,
                  .vocab_start = vocab_start, .ignore_index = ignore_index, .vocab = vocab,
                  .labels = labels, .lse = lse, .scale = scale, .eps = eps};
    sfk_parallel_rows(rows, sfk_threads_for(rows, n), backward_rows, &c);
    return c.err ? sfk_no_memory(fn, SFK_XB * (double)sizeof(float), err) : SF_OK;
}
