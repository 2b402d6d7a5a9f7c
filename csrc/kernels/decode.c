/*
 * decode.c -- the decode step's layer loop (see decode.h): per layer one
 * RMSNorm, one packed q/k/v matmul, rope, the cache append, attention over
 * the cache, o_proj and its reduce, one RMSNorm, one packed gate/up matmul,
 * SiLU x up, down and its reduce.  The matmuls and norms are the kernels of
 * linear.c and norm.c; what is here is the glue between them and the
 * attention over the cache (one (sequence, head) pair per row, split over
 * the kernels' threads).
 */
#include "decode.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>

#include "linear.h"
#include "norm.h"

#define CLONES __attribute__((target_clones("avx2", "default")))

CLONES static float dot(const float *restrict a, const float *restrict b, int64_t n)
{
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* acc += w v */
CLONES static void axpy(float *restrict acc, float w, const float *restrict v, int64_t n)
{
    for (int64_t i = 0; i < n; i++) acc[i] += w * v[i];
}

/* u <- u cos + rot(u) sin over each of `heads` vectors of d (HF's rope). */
static void rope(float *u, int64_t heads, int64_t d, const float *cos, const float *sin)
{
    const int64_t half = d / 2;
    for (int64_t hh = 0; hh < heads; hh++) {
        float *v = u + hh * d;
        for (int64_t i = 0; i < half; i++) {
            const float a = v[i], b = v[i + half];
            v[i] = a * cos[i] + (-b) * sin[i];
            v[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

typedef struct {
    const sfk_decode_step *s;
    const sfk_decode_layer *l;
    const float *q;         /* [B, Hq d] after rope */
    float *o;               /* [B, Hq d] */
    float *scores;          /* per thread [L] */
} attn_ctx;

/* Rows r = b Hq + hh: o[b, hh] = softmax(q K^T scale + bias) V over the L cached positions. */
static void attend_rows(void *arg, int64_t r0, int64_t r1, int tid)
{
    const attn_ctx *c = arg;
    const sfk_decode_step *s = c->s;
    const int64_t d = s->head_dim, L = s->past + 1, groups = s->heads / s->kv_heads;
    float *sc = c->scores + tid * L;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t b = r / s->heads, hh = r % s->heads, j = hh / groups;
        const float *q = c->q + r * d;
        const int64_t base = (b * s->kv_heads + j) * s->cap * d;
        const float *K = c->l->k_cache + base, *V = c->l->v_cache + base;
        const int64_t *mask = s->mask ? s->mask + b * L : NULL;
        for (int64_t t = 0; t < L; t++) {
            sc[t] = dot(q, K + t * d, d) * c->l->scale;
            if (mask && mask[t] == 0) sc[t] += -FLT_MAX;
        }
        const float mx = sfk_max(sc, L);
        sfk_scaled_exp(sc, sc, L, mx, 1.0f, 0.0f);
        float sum = 0.0f;
        for (int64_t t = 0; t < L; t++) sum += sc[t];
        float *o = c->o + r * d;
        memset(o, 0, (size_t)d * sizeof(float));
        for (int64_t t = 0; t < L; t++) axpy(o, sc[t] / sum, V + t * d, d);
    }
}

/* Sizes every layer shares, checked once. */
static sf_status check_step(const sfk_decode_step *s, sf_error *err)
{
    if (s->batch <= 0 || s->hidden <= 0 || s->heads <= 0 || s->kv_heads <= 0 || s->head_dim <= 0 ||
        s->ffn <= 0)
        return sf_fail(err, SF_EINVAL, "decode_step: sizes batch=%lld hidden=%lld heads=%lld kv_heads=%lld "
                       "head_dim=%lld ffn=%lld must be positive", (long long)s->batch, (long long)s->hidden,
                       (long long)s->heads, (long long)s->kv_heads, (long long)s->head_dim, (long long)s->ffn);
    if (s->heads % s->kv_heads || s->head_dim % 2)
        return sf_fail(err, SF_EINVAL, "decode_step: %lld query heads are not a multiple of %lld KV heads, "
                       "or head_dim %lld is odd", (long long)s->heads, (long long)s->kv_heads,
                       (long long)s->head_dim);
    if (s->past < 0 || s->past >= s->cap)
        return sf_fail(err, SF_EINVAL, "decode_step: position %lld outside the cache's %lld positions",
                       (long long)s->past, (long long)s->cap);
    if (s->rope_rows != 1 && s->rope_rows != s->batch)
        return sf_fail(err, SF_EINVAL, "decode_step: %lld rows of cos / sin for a batch of %lld",
                       (long long)s->rope_rows, (long long)s->batch);
    if (!s->reduce)
        return sf_fail(err, SF_EINVAL, "decode_step: no reduce");
    return SF_OK;
}

/* y [B, n] = x [B, k] W^T (+ b), W contiguous. */
static sf_status linear(const float *x, const float *w, const float *b, int64_t B, int64_t n, int64_t k,
                        float *y, sf_error *err)
{
    return sfk_skinny_linear(SFK_F32, x, w, k, b, B, n, k, y, SFK_LIN_AUTO, err);
}

/* x += reduce(y) (+ bias) */
static sf_status reduce_add(const sfk_decode_step *s, float *x, float *y, const float *bias, sf_error *err)
{
    const int64_t B = s->batch, h = s->hidden;
    sf_status rc = s->reduce(s->reduce_ctx, y, B * h, err);
    if (rc != SF_OK) return rc;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < h; i++)
            x[b * h + i] += bias ? y[b * h + i] + bias[i] : y[b * h + i];
    return SF_OK;
}

typedef struct {
    float *a, *qkv, *qn, *o, *y, *gu, *act, *rstd, *scores;
} scratch;

static sf_status layer_step(const sfk_decode_step *s, const sfk_decode_layer *l, float *x, scratch *w,
                            int nthreads, sf_error *err)
{
    const int64_t B = s->batch, h = s->hidden, d = s->head_dim, F = s->ffn;
    const int64_t hq = s->heads * d, hk = s->kv_heads * d, nqkv = hq + 2 * hk;
    sf_status rc;
    /* attention */
    if ((rc = sfk_norm_forward(1, SFK_F32, x, B, h, l->ln1, NULL, l->eps1, w->a, NULL, w->rstd, err)))
        return rc;
    if ((rc = linear(w->a, l->wqkv, l->bqkv, B, nqkv, h, w->qkv, err))) return rc;
    for (int64_t b = 0; b < B; b++) {
        float *row = w->qkv + b * nqkv, *q = w->qn + b * hq, *k = row + hq, *v = row + hq + hk;
        if (l->q_norm) {
            if ((rc = sfk_norm_forward(1, SFK_F32, row, s->heads, d, l->q_norm, NULL, l->qk_eps, q, NULL,
                                       w->rstd, err)) ||
                (rc = sfk_norm_forward(1, SFK_F32, k, s->kv_heads, d, l->k_norm, NULL, l->qk_eps, w->y,
                                       NULL, w->rstd, err)))
                return rc;
            memcpy(k, w->y, (size_t)hk * sizeof(float));
        } else {
            memcpy(q, row, (size_t)hq * sizeof(float));
        }
        const int64_t rr = s->rope_rows == 1 ? 0 : b;
        rope(q, s->heads, d, s->cos + rr * d, s->sin + rr * d);
        rope(k, s->kv_heads, d, s->cos + rr * d, s->sin + rr * d);
        for (int64_t j = 0; j < s->kv_heads; j++) {
            const int64_t at = ((b * s->kv_heads + j) * s->cap + s->past) * d;
            memcpy(l->k_cache + at, k + j * d, (size_t)d * sizeof(float));
            memcpy(l->v_cache + at, v + j * d, (size_t)d * sizeof(float));
        }
    }
    attn_ctx ac = {.s = s, .l = l, .q = w->qn, .o = w->o, .scores = w->scores};
    sfk_parallel_rows(B * s->heads, nthreads, attend_rows, &ac);
    if ((rc = linear(w->o, l->wo, NULL, B, h, hq, w->y, err))) return rc;
    if ((rc = reduce_add(s, x, w->y, l->bo, err))) return rc;
    /* MLP */
    if ((rc = sfk_norm_forward(1, SFK_F32, x, B, h, l->ln2, NULL, l->eps2, w->a, NULL, w->rstd, err)))
        return rc;
    if ((rc = linear(w->a, l->wgu, l->bgu, B, 2 * F, h, w->gu, err))) return rc;
    for (int64_t b = 0; b < B; b++) {
        const float *g = w->gu + b * 2 * F, *u = g + F;
        float *a = w->act + b * F;
        for (int64_t i = 0; i < F; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
    if ((rc = linear(w->act, l->wd, NULL, B, h, F, w->y, err))) return rc;
    return reduce_add(s, x, w->y, l->bd, err);
}

sf_status sfk_decode_layers(const sfk_decode_step *s, const sfk_decode_layer *layers, int64_t nlayers,
                            float *x, sf_error *err)
{
    sf_status rc = check_step(s, err);
    if (rc != SF_OK) return rc;
    const int64_t B = s->batch, h = s->hidden, d = s->head_dim, F = s->ffn, L = s->past + 1;
    const int64_t hq = s->heads * d, hk = s->kv_heads * d;
    const int nthreads = sfk_threads_for(B * s->heads, sfk_sat_mul(2 * L, d));
    /* sizes in floats; every product below is bounded by tensors that exist
     * (the caller's weights and caches), the thread count by the pool's */
    const int64_t rows = B * s->heads > B ? B * s->heads : B;
    const int64_t y_len = B * (h > hk ? h : hk);
    const int64_t sizes[] = {B * h, B * (hq + 2 * hk), B * hq, B * hq, y_len, B * 2 * F, B * F, rows,
                             (int64_t)nthreads * L};
    int64_t total = 0;
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) total += sizes[i];
    float *mem = malloc((size_t)total * sizeof(float));
    if (!mem) return sf_fail(err, SF_ENOMEM, "decode_step: %lld floats of scratch", (long long)total);
    float *p = mem;
    float **slots[] = {NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    scratch w;
    slots[0] = &w.a, slots[1] = &w.qkv, slots[2] = &w.qn, slots[3] = &w.o, slots[4] = &w.y;
    slots[5] = &w.gu, slots[6] = &w.act, slots[7] = &w.rstd, slots[8] = &w.scores;
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        *slots[i] = p;
        p += sizes[i];
    }
    for (int64_t n = 0; n < nlayers && rc == SF_OK; n++) {
        if (!layers[n].wqkv || !layers[n].wo || !layers[n].wgu || !layers[n].wd || !layers[n].ln1 ||
            !layers[n].ln2 || !layers[n].k_cache || !layers[n].v_cache ||
            (!layers[n].q_norm) != (!layers[n].k_norm))
            rc = sf_fail(err, SF_EINVAL, "decode_step: layer %lld lacks a weight or its cache", (long long)n);
        else
            rc = layer_step(s, &layers[n], x, &w, nthreads, err);
    }
    free(mem);
    return rc;
}
