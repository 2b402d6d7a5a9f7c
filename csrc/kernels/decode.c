/*
 * decode.c -- the decode step's layer loop (see decode.h): per layer one
 * RMSNorm, the q, k, v matmuls (on the modules' own shards), rope, the
 * cache append, attention over the cache, o_proj and its reduce, one
 * RMSNorm, the gate and up matmuls, SiLU x up, down and its reduce; in
 * fp32, or for bf16 / fp16 weights with HF's roundings to that type.  The matmuls and norms are the kernels of
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

/* v rounded to t and back (the identity for fp32). */
static inline float r16(sfk_dtype t, float v)
{
    if (t == SFK_F32) return v;
    return t == SFK_BF16 ? sf_bf16_to_f32(sf_f32_to_bf16(v)) : sf_f16_to_f32(sf_f32_to_f16(v));
}

/* Element i of an array of t as fp32. */
static inline float ld(sfk_dtype t, const void *p, int64_t i)
{
    if (t == SFK_F32) return ((const float *)p)[i];
    const uint16_t h = ((const uint16_t *)p)[i];
    return t == SFK_BF16 ? sf_bf16_to_f32(h) : sf_f16_to_f32(h);
}

static void round_all(sfk_dtype t, float *v, int64_t n)
{
    if (t != SFK_F32)
        for (int64_t i = 0; i < n; i++) v[i] = r16(t, v[i]);
}

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

/* u <- u cos + rot(u) sin over each of `heads` vectors of d (HF's rope),
 * each product and the sum rounded to t. */
static void rope(sfk_dtype t, float *u, int64_t heads, int64_t d, const float *cos, const float *sin)
{
    const int64_t half = d / 2;
    for (int64_t hh = 0; hh < heads; hh++) {
        float *v = u + hh * d;
        for (int64_t i = 0; i < half; i++) {
            const float a = v[i], b = v[i + half];
            v[i] = r16(t, r16(t, a * cos[i]) + r16(t, (-b) * sin[i]));
            v[i + half] = r16(t, r16(t, b * cos[i + half]) + r16(t, a * sin[i + half]));
        }
    }
}

/* y [rows, n] = rms(x) w (decode.h): fp32 through the norm kernel; for t =
 * bf16 / fp16 LlamaRMSNorm's r(r(v rstd) w). */
static sf_status rms(sfk_dtype t, const float *x, int64_t rows, int64_t n, const void *w, float eps,
                     float *y, float *rstd, sf_error *err)
{
    if (t == SFK_F32) return sfk_norm_forward(1, SFK_F32, x, rows, n, (const float *)w, NULL, eps, y, NULL, rstd, err);
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * n;
        float ss = 0.0f;
        for (int64_t i = 0; i < n; i++) ss += v[i] * v[i];
        const float s = 1.0f / sqrtf(ss / (float)n + eps);
        for (int64_t i = 0; i < n; i++) y[r * n + i] = r16(t, r16(t, v[i] * s) * ld(t, w, i));
    }
    return SF_OK;
}

/* Per step: the layer's scratch (fp32 except xh, yh: the linear's input
 * and output as t; K, V rows widened for attention). */
typedef struct {
    float *a, *q, *k, *v, *o, *y, *g, *u, *act, *rstd, *scores, *kv;
    void *xh, *yh;
} scratch;

typedef struct {
    const sfk_decode_step *s;
    const sfk_decode_layer *l;
    const float *q;         /* [B, Hq d] after rope */
    float *o;               /* [B, Hq d] */
    float *scores;          /* per thread [L] */
    float *kv;              /* per thread [2 L d]: the cached K, V rows as fp32 (16-bit t) */
} attn_ctx;

/* Rows r = b Hq + hh: o[b, hh] = softmax(q K^T scale + bias) V over the L cached positions. */
static void attend_rows(void *arg, int64_t r0, int64_t r1, int tid)
{
    const attn_ctx *c = arg;
    const sfk_decode_step *s = c->s;
    const sfk_dtype t = s->dtype;
    const int64_t d = s->head_dim, L = s->past + 1, groups = s->heads / s->kv_heads;
    float *sc = c->scores + tid * L;
    float *kw = c->kv + (size_t)tid * (size_t)(2 * L * d), *vw = kw + L * d;
    int64_t widened = -1;   /* the (b, j) whose rows kw, vw hold */
    for (int64_t r = r0; r < r1; r++) {
        const int64_t b = r / s->heads, hh = r % s->heads, j = hh / groups;
        const float *q = c->q + r * d;
        const int64_t base = (b * s->kv_heads + j) * s->cap * d;
        const float *K, *V;
        if (t == SFK_F32) {
            K = (const float *)c->l->k_cache + base, V = (const float *)c->l->v_cache + base;
        } else {
            if (widened != b * s->kv_heads + j) {
                sfk_load(t, (const char *)c->l->k_cache + (size_t)base * 2, L * d, kw);
                sfk_load(t, (const char *)c->l->v_cache + (size_t)base * 2, L * d, vw);
                widened = b * s->kv_heads + j;
            }
            K = kw, V = vw;
        }
        const int64_t *mask = s->mask ? s->mask + b * L : NULL;
        for (int64_t p = 0; p < L; p++) {
            sc[p] = r16(t, r16(t, dot(q, K + p * d, d)) * c->l->scale);
            if (mask && mask[p] == 0) sc[p] += -FLT_MAX;
        }
        const float mx = sfk_max(sc, L);
        sfk_scaled_exp(sc, sc, L, mx, 1.0f, 0.0f);
        float sum = 0.0f;
        for (int64_t p = 0; p < L; p++) sum += sc[p];
        float *o = c->o + r * d;
        memset(o, 0, (size_t)d * sizeof(float));
        for (int64_t p = 0; p < L; p++) axpy(o, r16(t, sc[p] / sum), V + p * d, d);
        round_all(t, o, d);
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

/* y [B, n] = x [B, k] W^T (+ b), W contiguous of t; x, y fp32 (values of
 * t for 16-bit t: x is passed to the kernel as t, exactly). */
static sf_status linear(const sfk_decode_step *s, scratch *w, const float *x, const void *wt, const float *b,
                        int64_t n, int64_t k, float *y, sf_error *err)
{
    const sfk_dtype t = s->dtype;
    const int64_t B = s->batch;
    if (t == SFK_F32) return sfk_skinny_linear(SFK_F32, x, wt, k, b, B, n, k, y, SFK_LIN_AUTO, err);
    sfk_store(t, x, B * k, w->xh);
    sf_status rc = sfk_skinny_linear(t, w->xh, wt, k, b, B, n, k, w->yh, SFK_LIN_AUTO, err);
    if (rc == SF_OK) sfk_load(t, w->yh, B * n, y);
    return rc;
}

/* x = r(x + r(reduce(y) (+ bias))) */
static sf_status reduce_add(const sfk_decode_step *s, float *x, float *y, const float *bias, sf_error *err)
{
    const sfk_dtype t = s->dtype;
    const int64_t B = s->batch, h = s->hidden;
    sf_status rc = s->reduce(s->reduce_ctx, y, B * h, err);
    if (rc != SF_OK) return rc;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < h; i++) {
            const float sum = r16(t, y[b * h + i]);
            x[b * h + i] = r16(t, x[b * h + i] + (bias ? r16(t, sum + bias[i]) : sum));
        }
    return SF_OK;
}

/* K[b, j, past] = k, V[b, j, past] = v (the new position, stored as t). */
static void cache_append(const sfk_decode_step *s, const sfk_decode_layer *l, int64_t b, const float *k,
                         const float *v)
{
    const int64_t d = s->head_dim;
    const int sz = sfk_size(s->dtype);
    for (int64_t j = 0; j < s->kv_heads; j++) {
        const size_t at = (size_t)(((b * s->kv_heads + j) * s->cap + s->past) * d) * (size_t)sz;
        sfk_store(s->dtype, k + j * d, d, (char *)l->k_cache + at);
        sfk_store(s->dtype, v + j * d, d, (char *)l->v_cache + at);
    }
}

static sf_status layer_step(const sfk_decode_step *s, const sfk_decode_layer *l, float *x, scratch *w,
                            int nthreads, sf_error *err)
{
    const sfk_dtype t = s->dtype;
    const int64_t B = s->batch, h = s->hidden, d = s->head_dim, F = s->ffn;
    const int64_t hq = s->heads * d, hk = s->kv_heads * d;
    sf_status rc;
    /* attention */
    if ((rc = rms(t, x, B, h, l->ln1, l->eps1, w->a, w->rstd, err)) ||
        (rc = linear(s, w, w->a, l->wq, l->bq, hq, h, w->q, err)) ||
        (rc = linear(s, w, w->a, l->wk, l->bk, hk, h, w->k, err)) ||
        (rc = linear(s, w, w->a, l->wv, l->bv, hk, h, w->v, err)))
        return rc;
    if (l->q_norm) {
        if ((rc = rms(t, w->q, B * s->heads, d, l->q_norm, l->qk_eps, w->o, w->rstd, err)) ||
            (rc = rms(t, w->k, B * s->kv_heads, d, l->k_norm, l->qk_eps, w->y, w->rstd, err)))
            return rc;
        memcpy(w->q, w->o, (size_t)(B * hq) * sizeof(float));
        memcpy(w->k, w->y, (size_t)(B * hk) * sizeof(float));
    }
    for (int64_t b = 0; b < B; b++) {
        const int64_t rr = s->rope_rows == 1 ? 0 : b;
        rope(t, w->q + b * hq, s->heads, d, s->cos + rr * d, s->sin + rr * d);
        rope(t, w->k + b * hk, s->kv_heads, d, s->cos + rr * d, s->sin + rr * d);
        cache_append(s, l, b, w->k + b * hk, w->v + b * hk);
    }
    attn_ctx ac = {.s = s, .l = l, .q = w->q, .o = w->o, .scores = w->scores, .kv = w->kv};
    sfk_parallel_rows(B * s->heads, nthreads, attend_rows, &ac);
    if ((rc = linear(s, w, w->o, l->wo, NULL, h, hq, w->y, err)) || (rc = reduce_add(s, x, w->y, l->bo, err)))
        return rc;
    /* MLP */
    if ((rc = rms(t, x, B, h, l->ln2, l->eps2, w->a, w->rstd, err)) ||
        (rc = linear(s, w, w->a, l->wg, l->bg, F, h, w->g, err)) ||
        (rc = linear(s, w, w->a, l->wu, l->bu, F, h, w->u, err)))
        return rc;
    for (int64_t i = 0; i < B * F; i++)
        w->act[i] = r16(t, r16(t, w->g[i] / (1.0f + expf(-w->g[i]))) * w->u[i]);
    if ((rc = linear(s, w, w->act, l->wd, NULL, h, F, w->y, err))) return rc;
    return reduce_add(s, x, w->y, l->bd, err);
}

sf_status sfk_decode_layers(const sfk_decode_step *s, const sfk_decode_layer *layers, int64_t nlayers,
                            float *x, sf_error *err)
{
    sf_status rc = check_step(s, err);
    if (rc != SF_OK) return rc;
    const int64_t B = s->batch, h = s->hidden, d = s->head_dim, F = s->ffn, L = s->past + 1;
    const int64_t hq = s->heads * d, hk = s->kv_heads * d;
    const int wide = s->dtype != SFK_F32;
    const int nthreads = sfk_threads_for(B * s->heads, sfk_sat_mul(2 * L, d));
    /* sizes in floats; every product below is bounded by tensors that exist
     * (the caller's weights and caches), the thread count by the pool's;
     * xh / yh hold t (at most a float each) */
    const int64_t rows = B * s->heads > B ? B * s->heads : B;
    const int64_t y_len = B * (h > hk ? h : hk);
    int64_t widest = h > hq ? h : hq;
    widest = widest > F ? widest : F;
    const int64_t sizes[] = {B * h, B * hq, B * hk, B * hk, B * hq, y_len, B * F, B * F, B * F, rows,
                             (int64_t)nthreads * L, wide ? (int64_t)nthreads * 2 * L * d : 0,
                             wide ? B * widest : 0, wide ? B * widest : 0};
    int64_t total = 0;
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) total += sizes[i];
    float *mem = malloc((size_t)total * sizeof(float));
    if (!mem) return sf_fail(err, SF_ENOMEM, "decode_step: %lld floats of scratch", (long long)total);
    scratch w;
    float **slots[] = {&w.a, &w.q, &w.k, &w.v, &w.o, &w.y, &w.g, &w.u, &w.act, &w.rstd, &w.scores, &w.kv,
                       (float **)&w.xh, (float **)&w.yh};
    float *p = mem;
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        *slots[i] = p;
        p += sizes[i];
    }
    for (int64_t n = 0; n < nlayers && rc == SF_OK; n++) {
        const sfk_decode_layer *l = &layers[n];
        if (!l->wq || !l->wk || !l->wv || !l->wo || !l->wg || !l->wu || !l->wd || !l->ln1 || !l->ln2 ||
            !l->k_cache || !l->v_cache || (!l->q_norm) != (!l->k_norm))
            rc = sf_fail(err, SF_EINVAL, "decode_step: layer %lld lacks a weight or its cache", (long long)n);
        else
            rc = layer_step(s, l, x, &w, nthreads, err);
    }
    free(mem);
    return rc;
}

sf_status sfk_decode_embed(const sfk_decode_step *s, const sfk_decode_ends *e, const int64_t *ids, float *x,
                           sf_error *err)
{
    const int64_t B = s->batch, h = s->hidden;
    if (!e->embed || !s->reduce) return sf_fail(err, SF_EINVAL, "decode_step: no embedding or no reduce");
    for (int64_t b = 0; b < B; b++) {
        const int64_t row = ids[b] - e->embed_start;
        if (row >= 0 && row < e->embed_real)
            sfk_load(s->dtype, (const char *)e->embed + (size_t)(row * h) * (size_t)sfk_size(s->dtype), h,
                     x + b * h);
        else
            memset(x + b * h, 0, (size_t)h * sizeof(float));
    }
    return s->reduce(s->reduce_ctx, x, B * h, err);
}

/* Rank r's [B, chunk] block of the gathered buffer: its real columns to
 * their offsets of the logits (the ranges), its padding dropped. */
static void assemble(const sfk_decode_step *s, const sfk_decode_ends *e, const char *gathered, char *logits)
{
    const int64_t B = s->batch, V = e->vocab, C = e->chunk;
    const size_t sz = (size_t)sfk_size(s->dtype);
    int64_t rank = -1, pos = 0;
    for (int64_t i = 0; i < e->nranges; i++) {
        const int64_t r = e->ranges[3 * i], off = e->ranges[3 * i + 1], n = e->ranges[3 * i + 2];
        if (r != rank) rank = r, pos = 0;
        for (int64_t b = 0; b < B; b++)
            memcpy(logits + (size_t)(b * V + off) * sz, gathered + (size_t)((r * B + b) * C + pos) * sz,
                   (size_t)n * sz);
        pos += n;
    }
}

sf_status sfk_decode_logits(const sfk_decode_step *s, const sfk_decode_ends *e, const float *x, void *logits,
                            sf_error *err)
{
    const sfk_dtype t = s->dtype;
    const int64_t B = s->batch, h = s->hidden, R = e->head_rows, C = e->chunk;
    const size_t sz = (size_t)sfk_size(t);
    if (!e->head || !e->norm || !e->gather || R > C)
        return sf_fail(err, SF_EINVAL, "decode_step: no head, norm or gather, or %lld head rows above the "
                       "gather's %lld", (long long)R, (long long)C);
    /* y [B, h] fp32, rstd [B], y as t [B, h] (16-bit t) */
    float *y = malloc((size_t)(2 * B * h + B) * sizeof(float));
    if (!y) return sf_fail(err, SF_ENOMEM, "decode_step: %lld floats of scratch", (long long)(2 * B * h + B));
    void *yt = y + B * h + B;
    sf_status rc = rms(t, x, B, h, e->norm, e->norm_eps, y, y + B * h, err);
    char *own = e->work, *gathered = own + (size_t)(B * C) * sz;
    if (rc == SF_OK) {
        if (t != SFK_F32) sfk_store(t, y, B * h, yt);     /* exact: y holds values of t */
        rc = sfk_skinny_linear(t, t == SFK_F32 ? (const void *)y : yt, e->head, h, e->head_bias, B, R, h, own,
                               SFK_LIN_AUTO, err);
    }
    free(y);
    if (rc != SF_OK) return rc;
    if (R < C)                                          /* rows of R to rows of C, from the last: padding 0 */
        for (int64_t b = B - 1; b >= 0; b--) {
            memmove(own + (size_t)(b * C) * sz, own + (size_t)(b * R) * sz, (size_t)R * sz);
            memset(own + (size_t)(b * C + R) * sz, 0, (size_t)(C - R) * sz);
        }
    if ((rc = e->gather(e->gather_ctx, gathered, own, (int64_t)((size_t)(B * C) * sz), err)) != SF_OK) return rc;
    assemble(s, e, gathered, logits);
    return SF_OK;
}
