/*
 * linear.c -- y = x W^T + b on few rows (see linear.h).
 *
 * Work is cut in blocks of ROWS_PER_BLOCK rows of W (outputs j..j+3).  A
 * block is read from memory once: its rows are dotted with rows i, i+1 of x
 * together (8 fp32 accumulators, 8 lanes each), and the next pairs of x rows
 * find the block in the cache.  Threads take contiguous runs of blocks.
 * Rows of W are ldw elements apart (a column slice of a wider tensor is read
 * in place).  The bf16 path on AVX512-BF16 dots the block with up to four x
 * rows at once, straight from bf16 (no widened copy of x): see linear.h for
 * its accuracy contract.  fp16 weights on the SIMD path are widened 16 at a
 * time (AVX-512F's vcvtph2ps on zmm) where the CPU has AVX-512, else 8.
 */
#include "linear.h"

#include <stdlib.h>

#if defined(__x86_64__) || defined(__i386__)
#define LIN_X86 1
#include <immintrin.h>
#endif

#define ROWS_PER_BLOCK 4

typedef struct {
    sfk_dtype t;
    sfk_linear_path path; /* resolved: never AUTO */
    const float *x;      /* [m, k] fp32 (x itself, or its widened copy); NULL on AVX512_BF16 */
    const uint16_t *xh;  /* [m, k] x as given, bf16 (the AVX512_BF16 path) */
    const void *w;       /* [n, k] of t */
    const float *b;      /* [n] or NULL */
    void *y;             /* [m, n] of t */
    float *sums;         /* per thread [m, ROWS_PER_BLOCK]: one block's dot products */
    int64_t m, n, k, ldw;
    int wide16;          /* fp16 on the SIMD path with AVX-512F: 16-lane widening (block_f16x) */
} lin_ctx;

static const void *w_row(const lin_ctx *c, int64_t j)
{
    return (const char *)c->w + (size_t)(j * c->ldw) * (size_t)sfk_size(c->t);
}

static float widen(sfk_dtype t, const void *row, int64_t l)
{
    if (t == SFK_F32) return ((const float *)row)[l];
    const uint16_t h = ((const uint16_t *)row)[l];
    return t == SFK_BF16 ? sf_bf16_to_f32(h) : sf_f16_to_f32(h);
}

/* out[i * rows + r] = x_i . W_{j0 + r} for the block's rows, element by element. */
static void block_scalar(const lin_ctx *c, int64_t j0, int rows, float *out)
{
    for (int r = 0; r < rows; r++) {
        const void *wr = w_row(c, j0 + r);
        for (int64_t i = 0; i < c->m; i++) {
            const float *xi = c->x + i * c->k;
            float s = 0.0f;
            for (int64_t l = 0; l < c->k; l++) s += xi[l] * widen(c->t, wr, l);
            out[i * ROWS_PER_BLOCK + r] = s;
        }
    }
}

#ifdef LIN_X86
#define LIN_AVX2 __attribute__((target("avx2,fma,f16c")))

LIN_AVX2 static inline float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* 8 weights from `p` (of type t) as fp32 lanes. */
LIN_AVX2 static inline __m256 load8(sfk_dtype t, const void *p)
{
    if (t == SFK_F32) return _mm256_loadu_ps(p);
    __m128i h = _mm_loadu_si128(p);
    if (t == SFK_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The block's rows (missing ones point at row 0 and are dropped) dotted
 * with x row x0: o0[r] = x0 . W_r.  Inlined per element type so the type
 * test leaves the inner loop. */
LIN_AVX2 static inline __attribute__((always_inline)) void
one_avx2(sfk_dtype t, const void *const *wr, const float *x0, int64_t k, float *o0)
{
    const int sz = t == SFK_F32 ? 4 : 2;
    const char *w0 = wr[0], *w1 = wr[1], *w2 = wr[2], *w3 = wr[3];
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t l = 0;
    for (; l + 8 <= k; l += 8) {
        const size_t off = (size_t)l * (size_t)sz;
        const __m256 p = _mm256_loadu_ps(x0 + l);
        a0 = _mm256_fmadd_ps(load8(t, w0 + off), p, a0);
        a1 = _mm256_fmadd_ps(load8(t, w1 + off), p, a1);
        a2 = _mm256_fmadd_ps(load8(t, w2 + off), p, a2);
        a3 = _mm256_fmadd_ps(load8(t, w3 + off), p, a3);
    }
    float s[4] = {hsum8(a0), hsum8(a1), hsum8(a2), hsum8(a3)};
    for (; l < k; l++)
        for (int r = 0; r < 4; r++) s[r] += x0[l] * widen(t, wr[r], l);
    for (int r = 0; r < 4; r++) o0[r] = s[r];
}

/* The same with two x rows at once: o0[r] = x0 . W_r, o1[r] = x1 . W_r, each
 * weight vector loaded once for both. */
LIN_AVX2 static inline __attribute__((always_inline)) void
pair_avx2(sfk_dtype t, const void *const *wr, const float *x0, const float *x1, int64_t k,
          float *o0, float *o1)
{
    const int sz = t == SFK_F32 ? 4 : 2;
    const char *w0 = wr[0], *w1 = wr[1], *w2 = wr[2], *w3 = wr[3];
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int64_t l = 0;
    for (; l + 8 <= k; l += 8) {
        const size_t off = (size_t)l * (size_t)sz;
        const __m256 v0 = load8(t, w0 + off), v1 = load8(t, w1 + off);
        const __m256 v2 = load8(t, w2 + off), v3 = load8(t, w3 + off);
        const __m256 p = _mm256_loadu_ps(x0 + l), q = _mm256_loadu_ps(x1 + l);
        a0 = _mm256_fmadd_ps(v0, p, a0);
        a1 = _mm256_fmadd_ps(v1, p, a1);
        a2 = _mm256_fmadd_ps(v2, p, a2);
        a3 = _mm256_fmadd_ps(v3, p, a3);
        b0 = _mm256_fmadd_ps(v0, q, b0);
        b1 = _mm256_fmadd_ps(v1, q, b1);
        b2 = _mm256_fmadd_ps(v2, q, b2);
        b3 = _mm256_fmadd_ps(v3, q, b3);
    }
    float s[8] = {hsum8(a0), hsum8(a1), hsum8(a2), hsum8(a3),
                  hsum8(b0), hsum8(b1), hsum8(b2), hsum8(b3)};
    for (; l < k; l++) {
        for (int r = 0; r < 4; r++) {
            const float wv = widen(t, wr[r], l);
            s[r] += x0[l] * wv;
            s[4 + r] += x1[l] * wv;
        }
    }
    for (int r = 0; r < 4; r++) {
        o0[r] = s[r];
        o1[r] = s[4 + r];
    }
}

/* bf16 weights, 16 at a time from one 32-byte load: a bf16 is the top half
 * of its fp32, so (v << 16) holds the even-indexed weights of the 16 as fp32
 * lanes and (v & 0xffff0000) the odd ones.  x comes de-interleaved to match
 * (linear.c's widen_x_bf16: per block of 16, the 8 even then the 8 odd). */
LIN_AVX2 static inline __attribute__((always_inline)) void
bf16_halves(const char *p, __m256 *even, __m256 *odd)
{
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

LIN_AVX2 static void bf16_rows(const lin_ctx *c, const void *const *wr, float *out)
{
    const int64_t k = c->k, k16 = k / 16 * 16;
    const char *w0 = wr[0], *w1 = wr[1], *w2 = wr[2], *w3 = wr[3];
    for (int64_t i = 0; i < c->m; i++) {
        const float *x0 = c->x + i * k;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t l = 0; l < k16; l += 16) {
            const size_t off = (size_t)l * 2;
            const __m256 pe = _mm256_loadu_ps(x0 + l), po = _mm256_loadu_ps(x0 + l + 8);
            __m256 e, o;
            bf16_halves(w0 + off, &e, &o);
            a0 = _mm256_fmadd_ps(o, po, _mm256_fmadd_ps(e, pe, a0));
            bf16_halves(w1 + off, &e, &o);
            a1 = _mm256_fmadd_ps(o, po, _mm256_fmadd_ps(e, pe, a1));
            bf16_halves(w2 + off, &e, &o);
            a2 = _mm256_fmadd_ps(o, po, _mm256_fmadd_ps(e, pe, a2));
            bf16_halves(w3 + off, &e, &o);
            a3 = _mm256_fmadd_ps(o, po, _mm256_fmadd_ps(e, pe, a3));
        }
        float s[4] = {hsum8(a0), hsum8(a1), hsum8(a2), hsum8(a3)};
        for (int64_t l = k16; l < k; l++)
            for (int r = 0; r < 4; r++) s[r] += x0[l] * widen(SFK_BF16, wr[r], l);
        for (int r = 0; r < 4; r++) out[i * ROWS_PER_BLOCK + r] = s[r];
    }
}
#endif

/* x as fp32 for the kernel: bf16 rows de-interleaved per block of 16 (the 8
 * even-indexed, then the 8 odd-indexed; the last k % 16 in place) when the
 * SIMD path reads bf16 weights, else plainly widened. */
static void widen_x(sfk_dtype t, const void *x, int64_t m, int64_t k, int deinterleave, float *dst)
{
    sfk_load(t, x, m * k, dst);
    if (!deinterleave) return;
    for (int64_t i = 0; i < m; i++) {
        float *row = dst + i * k, tmp[16];
        for (int64_t l = 0; l + 16 <= k; l += 16) {
            for (int j = 0; j < 8; j++) {
                tmp[j] = row[l + 2 * j];
                tmp[8 + j] = row[l + 2 * j + 1];
            }
            memcpy(row + l, tmp, sizeof(tmp));
        }
    }
}

#ifdef LIN_X86
#define LIN_BLOCK_FN(name, T)                                                          \
    LIN_AVX2 static void name(const lin_ctx *c, const void *const *wr, float *out)     \
    {                                                                                  \
        int64_t i = 0;                                                                 \
        for (; i + 2 <= c->m; i += 2)                                                  \
            pair_avx2(T, wr, c->x + i * c->k, c->x + (i + 1) * c->k, c->k,             \
                      out + i * ROWS_PER_BLOCK, out + (i + 1) * ROWS_PER_BLOCK);       \
        if (i < c->m) one_avx2(T, wr, c->x + i * c->k, c->k, out + i * ROWS_PER_BLOCK); \
    }
LIN_BLOCK_FN(block_f32, SFK_F32)
LIN_BLOCK_FN(block_f16, SFK_F16)

#define LIN_AVX512F __attribute__((target("avx512f,avx2,fma,f16c")))

/* fp16 weights on AVX-512F: 16 at a time (one 32-byte load widened by the
 * 16-lane vcvtph2ps), the block's 4 rows dotted with x rows i, i+1 together
 * (8 accumulators of 16 lanes); the rest of k as the scalar path. */
LIN_AVX512F static void block_f16x(const lin_ctx *c, const void *const *wr, float *out)
{
    const int64_t k = c->k;
    const uint16_t *w[ROWS_PER_BLOCK];
    for (int r = 0; r < ROWS_PER_BLOCK; r++) w[r] = wr[r];
    for (int64_t i = 0; i < c->m; i += 2) {
        const int two = i + 1 < c->m;
        const float *x0 = c->x + i * k, *x1 = two ? x0 + k : x0;
        __m512 a[ROWS_PER_BLOCK], b[ROWS_PER_BLOCK];
        for (int r = 0; r < ROWS_PER_BLOCK; r++) a[r] = b[r] = _mm512_setzero_ps();
        int64_t l = 0;
        for (; l + 16 <= k; l += 16) {
            const __m512 p = _mm512_loadu_ps(x0 + l), q = _mm512_loadu_ps(x1 + l);
            for (int r = 0; r < ROWS_PER_BLOCK; r++) {
                const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w[r] + l)));
                a[r] = _mm512_fmadd_ps(v, p, a[r]);
                b[r] = _mm512_fmadd_ps(v, q, b[r]);
            }
        }
        for (int r = 0; r < ROWS_PER_BLOCK; r++) {
            float s = _mm512_reduce_add_ps(a[r]), t = _mm512_reduce_add_ps(b[r]);
            for (int64_t j = l; j < k; j++) {
                const float v = sf_f16_to_f32(w[r][j]);
                s += x0[j] * v;
                t += x1[j] * v;
            }
            out[i * ROWS_PER_BLOCK + r] = s;
            if (two) out[(i + 1) * ROWS_PER_BLOCK + r] = t;
        }
    }
}

#define LIN_BF16X __attribute__((target("avx512f,avx512bw,avx512bf16")))

/* 32 bf16 from p (the first `left` of them when left < 32, zeros after) as
 * the pairs vdpbf16ps takes. */
LIN_BF16X static inline __m512bh load32_bf16(const uint16_t *p, int64_t left)
{
    if (left >= 32) return (__m512bh)_mm512_loadu_si512(p);
    return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1u << left) - 1u), p);
}

/* The block's 4 rows (wr) dotted with MR rows of x from x0 (k apart):
 * out[i * ROWS_PER_BLOCK + r] = x_i . W_r.  Per 32 weights of a row, one
 * vdpbf16ps per x row adds 16 pairs of products to 16 fp32 lanes; MR x 4
 * accumulators.  MR is a constant at each call (inlined, unrolled). */
LIN_BF16X static inline __attribute__((always_inline)) void
rows_bf16x(const uint16_t *const *wr, const uint16_t *x0, int64_t k, const int mr, float *out)
{
    __m512 acc[4][ROWS_PER_BLOCK];
    for (int i = 0; i < mr; i++)
        for (int r = 0; r < ROWS_PER_BLOCK; r++) acc[i][r] = _mm512_setzero_ps();
    for (int64_t l = 0; l < k; l += 32) {
        const int64_t left = k - l;
        __m512bh w[ROWS_PER_BLOCK];
        for (int r = 0; r < ROWS_PER_BLOCK; r++) w[r] = load32_bf16(wr[r] + l, left);
        for (int i = 0; i < mr; i++) {
            const __m512bh xv = load32_bf16(x0 + i * k + l, left);
            for (int r = 0; r < ROWS_PER_BLOCK; r++) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], w[r], xv);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int r = 0; r < ROWS_PER_BLOCK; r++) out[i * ROWS_PER_BLOCK + r] = _mm512_reduce_add_ps(acc[i][r]);
}

LIN_BF16X static void block_bf16x(const lin_ctx *c, const void *const *wr, float *out)
{
    const uint16_t *w16[ROWS_PER_BLOCK];
    for (int r = 0; r < ROWS_PER_BLOCK; r++) w16[r] = wr[r];
    int64_t i = 0;
    for (; i + 4 <= c->m; i += 4) rows_bf16x(w16, c->xh + i * c->k, c->k, 4, out + i * ROWS_PER_BLOCK);
    if (i + 2 <= c->m) {
        rows_bf16x(w16, c->xh + i * c->k, c->k, 2, out + i * ROWS_PER_BLOCK);
        i += 2;
    }
    if (i < c->m) rows_bf16x(w16, c->xh + i * c->k, c->k, 1, out + i * ROWS_PER_BLOCK);
}
#endif

static void blocks(void *arg, int64_t b0, int64_t b1, int tid)
{
    const lin_ctx *c = arg;
    float *out = c->sums + (size_t)tid * (size_t)c->m * ROWS_PER_BLOCK;
    for (int64_t blk = b0; blk < b1; blk++) {
        const int64_t j0 = blk * ROWS_PER_BLOCK;
        const int rows = (int)(c->n - j0 < ROWS_PER_BLOCK ? c->n - j0 : ROWS_PER_BLOCK);
#ifdef LIN_X86
        if (c->path != SFK_LIN_PORTABLE) {
            const void *wr[ROWS_PER_BLOCK];
            for (int r = 0; r < ROWS_PER_BLOCK; r++) wr[r] = w_row(c, j0 + (r < rows ? r : 0));
            if (c->path == SFK_LIN_AVX512_BF16) block_bf16x(c, wr, out);
            else if (c->t == SFK_F32) block_f32(c, wr, out);
            else if (c->t == SFK_BF16) bf16_rows(c, wr, out);
            else if (c->wide16) block_f16x(c, wr, out);
            else block_f16(c, wr, out);
        } else
#endif
            block_scalar(c, j0, rows, out);
        for (int64_t i = 0; i < c->m; i++) {
            float v[ROWS_PER_BLOCK];
            for (int r = 0; r < rows; r++) v[r] = out[i * ROWS_PER_BLOCK + r] + (c->b ? c->b[j0 + r] : 0.0f);
            sfk_store(c->t, v, rows, (char *)c->y + (size_t)(i * c->n + j0) * (size_t)sfk_size(c->t));
        }
    }
}

sfk_linear_path sfk_skinny_linear_auto(sfk_dtype t)
{
#ifdef LIN_X86
    if (t == SFK_BF16 && sf_cpu_has_avx512_bf16()) return SFK_LIN_AVX512_BF16;
    if (sf_cpu_has_simd()) return SFK_LIN_AVX2;
#else
    (void)t;
#endif
    return SFK_LIN_PORTABLE;
}

static const char *path_name(sfk_linear_path p)
{
    switch (p) {
    case SFK_LIN_AUTO: return "auto";
    case SFK_LIN_PORTABLE: return "portable";
    case SFK_LIN_AVX2: return "avx2";
    case SFK_LIN_AVX512_BF16: return "avx512_bf16";
    }
    return "?";
}

/* `path` as run for dtype t: AUTO resolved; a forced path the CPU lacks, or
 * AVX512_BF16 for another dtype, refused. */
static sf_status resolve_path(const char *fn, sfk_dtype t, sfk_linear_path path, sfk_linear_path *out,
                              sf_error *err)
{
    int have;
    switch (path) {
    case SFK_LIN_AUTO: *out = sfk_skinny_linear_auto(t); return SF_OK;
    case SFK_LIN_PORTABLE: have = 1; break;
    case SFK_LIN_AVX2: have = sf_cpu_has_simd(); break;
    case SFK_LIN_AVX512_BF16:
        if (t != SFK_BF16)
            return sf_fail(err, SF_EINVAL, "%s: path avx512_bf16 takes bfloat16 only, got %s", fn,
                           t == SFK_F32 ? "float32" : "float16");
        have = sf_cpu_has_avx512_bf16();
        break;
    default:
        return sf_fail(err, SF_EINVAL, "%s: path=%d is not one of auto (0), portable (1), avx2 (2), "
                       "avx512_bf16 (3)", fn, (int)path);
    }
#ifndef LIN_X86
    have = path == SFK_LIN_PORTABLE;
#endif
    if (!have)
        return sf_fail(err, SF_EINVAL, "%s: path %s is not available: this CPU (or SHARDFORMER_SIMD) lacks "
                       "its instructions (_C.cpu_features() lists them)", fn, path_name(path));
    *out = path;
    return SF_OK;
}

sf_status sfk_skinny_linear(sfk_dtype t, const void *x, const void *w, int64_t ldw, const float *b,
                            int64_t m, int64_t n, int64_t k, void *y, sfk_linear_path path,
                            sf_error *err)
{
    static const char fn[] = "skinny_linear";
    sf_status rc;
    int64_t mk, wspan, mn;
    sfk_linear_path run;
    if ((rc = sfk_check_dtype(fn, t, err)) || (rc = sfk_check_size(fn, "m", m, err)) ||
        (rc = sfk_check_size(fn, "n", n, err)) || (rc = sfk_check_size(fn, "k", k, err)) ||
        (rc = resolve_path(fn, t, path, &run, err)))
        return rc;
    if (ldw < k)
        return sf_fail(err, SF_EINVAL, "%s: the weight's row stride ldw=%lld is below its row length k=%lld "
                       "(rows would overlap)", fn, (long long)ldw, (long long)k);
    /* W spans (n - 1) ldw + k elements */
    if (sf_mul_overflows(m, k, &mk) || sf_mul_overflows(m, n, &mn) ||
        (n > 0 && (sf_mul_overflows(n - 1, ldw, &wspan) || wspan > INT64_MAX - k)))
        return sf_fail(err, SF_EOVERFLOW, "%s: m=%lld, n=%lld, k=%lld, ldw=%lld: a product of the sizes "
                       "overflows int64", fn, (long long)m, (long long)n, (long long)k, (long long)ldw);
    wspan = n > 0 ? wspan + k : 0;
    if ((rc = sfk_check_ptr(fn, "x", x, mk, err)) || (rc = sfk_check_ptr(fn, "weight", w, wspan, err)) ||
        (rc = sfk_check_ptr(fn, "y", y, mn, err)))
        return rc;
    if (mn == 0)
        return SF_OK;
    /* x widened to fp32 once (it is read n / 4 times), except on the
     * AVX512_BF16 path, which reads it as bf16; each thread's block sums */
    const int64_t nblocks = sfk_ceil_div(n, ROWS_PER_BLOCK);
    const int nt = k == 0 ? 1 : sfk_threads_for(nblocks, sfk_sat_mul(ROWS_PER_BLOCK * m, k));
    const int widened = t != SFK_F32 && run != SFK_LIN_AVX512_BF16;
    size_t xbytes = 0, sbytes = 0;
    if ((widened && (rc = sfk_float_bytes(fn, "x", m, k, &xbytes, err))) ||
        (rc = sfk_float_bytes(fn, "block sums", m, ROWS_PER_BLOCK * (int64_t)nt, &sbytes, err)))
        return rc;
    float *wide = widened ? malloc(xbytes ? xbytes : 1) : NULL;
    float *sums = malloc(sbytes);
    if ((widened && !wide) || !sums) {
        free(wide);
        free(sums);
        return sfk_no_memory(fn, (double)(xbytes + sbytes), err);
    }
    if (wide) widen_x(t, x, m, k, t == SFK_BF16 && run == SFK_LIN_AVX2, wide);
    lin_ctx c = {.t = t, .path = run, .x = wide ? wide : (t == SFK_F32 ? x : NULL), .xh = x, .w = w,
                 .b = b, .y = y, .sums = sums, .m = m, .n = n, .k = k, .ldw = ldw,
                 .wide16 = t == SFK_F16 && run == SFK_LIN_AVX2 && sf_cpu_has_avx512()};
    if (k == 0) {                                  /* empty sums: y = b (or 0) */
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) {
                float v = b ? b[j] : 0.0f;
                sfk_store(t, &v, 1, (char *)y + (size_t)(i * n + j) * (size_t)sfk_size(t));
            }
    } else {
        sfk_parallel_rows(nblocks, nt, blocks, &c);
    }
    free(wide);
    free(sums);
    return SF_OK;
}
