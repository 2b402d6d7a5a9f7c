/*
 * common.h -- what every kernel in csrc/kernels/ shares: the element types
 * (fp32, fp16, bf16; arithmetic always in fp32), row conversion to and from
 * fp32 (the scalar conversions are half.h's), a vectorized exp, argument
 * checks with messages, and a row-splitting thread helper.
 *
 * Kernels are plain C over pointers and sizes; they never touch Python.
 * Every kernel returns an sf_status (status.h) and, on failure, says why in
 * its sf_error: the kernel, the argument and the numbers.
 */
#ifndef SHARDFORMER_KERNELS_COMMON_H
#define SHARDFORMER_KERNELS_COMMON_H

#include <stdint.h>
#include <string.h>

#include "cpu_features.h"
#include "half.h"
#include "status.h"

#include "checks.h"          /* sfk_dtype and the argument checks */

/* a * b for non-negative a, b, saturated at INT64_MAX (work estimates). */
static inline int64_t sfk_sat_mul(int64_t a, int64_t b)
{
    int64_t r;
    return sf_mul_overflows(a, b, &r) ? INT64_MAX : r;
}
/* ceil(a / b) for a >= 0, b > 0, without forming a + b - 1. */
static inline int64_t sfk_ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }

/* dst[0:n] (type `to`) = src[0:n] (type `from`), through fp32: the
 * conversions of sfk_load / sfk_store (for tests). */
sf_status sfk_convert(sfk_dtype from, const void *src, sfk_dtype to, void *dst, int64_t n,
                      sf_error *err);

#include "dropout_hash.h"   /* the dropout draws (shared with csrc/cuda/) */

/* dst[0:n] = src[0:n] as fp32. */
void sfk_load(sfk_dtype t, const void *src, int64_t n, float *dst);
/* dst[0:n] = src[0:n] rounded to t (nearest even). */
void sfk_store(sfk_dtype t, const float *src, int64_t n, void *dst);
/* Row `row` of a [rows, n] array of type t as fp32: the row itself for fp32,
 * else converted into `scratch` (n floats). */
const float *sfk_row(sfk_dtype t, const void *base, int64_t row, int64_t n, float *scratch);
static inline int sfk_size(sfk_dtype t) { return t == SFK_F32 ? 4 : 2; }

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
/* The vector exp under sfk_exp, for kernels that fuse it into their own
 * AVX2 loops (call only where sf_cpu_has_simd()). */
/* exp(x) 2^s = 2^(k + s) e^r, k = round(x / ln2), |r| <= ln2/2; e^r by its
 * Taylor polynomial to degree 6 (relative error < 2e-7 on that interval).
 * Lanes below x_min give 0 (covers -inf); the caller keeps
 * x_min >= -(126 + s) ln2 so that 2^(k + s) is a normal float.  s > 0 lets
 * a kernel carry a result that would be subnormal at scale 2^s and round it
 * once at the end (bias-GeLU's left tail). */
__attribute__((target("avx2,fma"))) static inline __m256 sfk_exp8_pow2(__m256 x, int s, float x_min)
{
    const __m256 hi = _mm256_set1_ps(88.37f), lo = _mm256_set1_ps(x_min);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    /* clamp to [lo, hi]; max_ps / min_ps return their second operand when
     * either is NaN, so x goes second: a NaN stays NaN (exp(NaN) = NaN), not lo */
    x = _mm256_min_ps(hi, _mm256_max_ps(lo, x));
    __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127 + s)), 23);
    __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(under, y);
}

/* exp(x); below -87.3 (where exp(x) leaves the normal floats) it flushes to 0. */
__attribute__((target("avx2,fma"))) static inline __m256 sfk_exp8(__m256 x) { return sfk_exp8_pow2(x, 0, -87.33f); }

/* sfk_exp8_pow2's reduction and polynomial at AVX-512 width (call only
 * where sf_cpu_has_avx512()): exp(x) 2^s, lanes below x_min give 0. */
__attribute__((target("avx512f"))) static inline __m512 sfk_exp16_pow2(__m512 x, int s, float x_min)
{
    const __m512 hi = _mm512_set1_ps(88.37f), lo = _mm512_set1_ps(x_min);
    const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(hi, _mm512_max_ps(lo, x));     /* NaN stays NaN (as in sfk_exp8_pow2) */
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127 + s)), 23);
    return _mm512_maskz_mul_ps((__mmask16)~under, p, _mm512_castsi512_ps(e));
}

/* exp(x) at AVX-512 width; lanes below -87.3 flush to 0. */
__attribute__((target("avx512f"))) static inline __m512 sfk_exp16(__m512 x) { return sfk_exp16_pow2(x, 0, -87.33f); }
#endif

/* dst[i] = exp(src[i]); exp(-inf) = 0.  AVX2 where the CPU has it. */
void sfk_exp(const float *src, float *dst, int64_t n);
/* sum_i exp(x[i] - shift), without storing the exponentials. */
/* dst = scale * exp(src - shift) - off, in one pass (dst may be src). */
void sfk_scaled_exp(const float *src, float *dst, int64_t n, float shift, float scale, float off);
float sfk_sum_exp(const float *x, int64_t n, float shift);
float sfk_max(const float *x, int64_t n);    /* -inf for n == 0, NaN where any x is NaN */

/* Row-parallel driver: fn(ctx, r0, r1, tid) over [0, rows) split in
 * contiguous chunks, one per thread.  Threads are used only when
 * rows * cost >= SFK_PAR_MIN (cost: elements touched per row); tid < the
 * returned thread count, which callers use to size per-thread buffers via
 * sfk_threads_for(). */
#define SFK_PAR_MIN (1 << 17)
typedef void (*sfk_rows_fn)(void *ctx, int64_t r0, int64_t r1, int tid);
int sfk_threads_for(int64_t rows, int64_t cost);
void sfk_parallel_rows(int64_t rows, int nthreads, sfk_rows_fn fn, void *ctx);
void sfk_set_num_threads(int n);
int sfk_get_num_threads(void);
/* The driver's persistent worker pool (common.c): sfk_pool_shutdown stops and
 * joins its workers (at interpreter exit; a later call makes new ones);
 * sfk_pool_stats: threads ever created, workers now, calls the pool ran, and
 * calls that found it busy and ran inline. */
void sfk_pool_shutdown(void);
void sfk_pool_stats(int64_t *created, int64_t *workers, int64_t *calls, int64_t *inline_busy);

#endif
