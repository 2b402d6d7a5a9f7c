/*
 * common.c -- argument checks, dtype conversion of rows, exp / max / sum-exp
 * over fp32 rows (AVX2+FMA where sf_cpu_has_simd(), plain C otherwise), and
 * the row-parallel thread driver.
 */
#define _GNU_SOURCE
#include "common.h"

#include <math.h>
#include <pthread.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SFK_X86 1
#endif

/* ---- argument checks ------------------------------------------------------ */

sf_status sfk_check_dtype(const char *fn, sfk_dtype t, sf_error *err)
{
    if (t != SFK_F32 && t != SFK_F16 && t != SFK_BF16)
        return sf_fail(err, SF_ETYPE, "%s: element type %d is not float32 (%d), float16 (%d) or "
                       "bfloat16 (%d)", fn, (int)t, SFK_F32, SFK_F16, SFK_BF16);
    return SF_OK;
}

sf_status sfk_check_size(const char *fn, const char *name, int64_t value, sf_error *err)
{
    if (value < 0)
        return sf_fail(err, SF_EINVAL, "%s: %s=%lld must be >= 0", fn, name, (long long)value);
    return SF_OK;
}

sf_status sfk_check_ptr(const char *fn, const char *name, const void *p, int64_t count,
                        sf_error *err)
{
    if (count > 0 && p == NULL)
        return sf_fail(err, SF_EINVAL, "%s: %s is NULL but %lld elements are to be touched", fn,
                       name, (long long)count);
    return SF_OK;
}

sf_status sfk_no_memory(const char *fn, double bytes, sf_error *err)
{
    return sf_fail(err, SF_ENOMEM, "%s: out of memory (could not allocate %.0f bytes of scratch)",
                   fn, bytes);
}

sf_status sfk_float_bytes(const char *fn, const char *what, int64_t count, int64_t per,
                          size_t *bytes, sf_error *err)
{
    int64_t n;
    if (count < 0 || per < 0 || sf_mul_overflows(count, per, &n) ||
        sf_mul_overflows(n, (int64_t)sizeof(float), &n) || (uint64_t)n > (uint64_t)SIZE_MAX)
        return sf_fail(err, SF_EOVERFLOW, "%s: the %s scratch (%lld x %lld floats) overflows "
                       "int64", fn, what, (long long)count, (long long)per);
    *bytes = (size_t)n;
    return SF_OK;
}

sf_status sfk_convert(sfk_dtype from, const void *src, sfk_dtype to, void *dst, int64_t n,
                      sf_error *err)
{
    sf_status rc;
    if ((rc = sfk_check_dtype("convert", from, err)) || (rc = sfk_check_dtype("convert", to, err)) ||
        (rc = sfk_check_size("convert", "n", n, err)) ||
        (rc = sfk_check_ptr("convert", "src", src, n, err)) ||
        (rc = sfk_check_ptr("convert", "dst", dst, n, err)))
        return rc;
    float buf[1024];
    for (int64_t i = 0; i < n; i += 1024) {
        const int64_t len = n - i < 1024 ? n - i : 1024;
        sfk_load(from, (const char *)src + (size_t)i * (size_t)sfk_size(from), len, buf);
        sfk_store(to, buf, len, (char *)dst + (size_t)i * (size_t)sfk_size(to));
    }
    return SF_OK;
}

/* ---- rows ----------------------------------------------------------------- */

void sfk_load(sfk_dtype t, const void *src, int64_t n, float *dst)
{
    if (t == SFK_F32) {
        memcpy(dst, src, (size_t)n * 4);
    } else if (t == SFK_BF16) {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = sf_bf16_to_f32(s[i]);
    } else {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = sf_f16_to_f32(s[i]);
    }
}

void sfk_store(sfk_dtype t, const float *src, int64_t n, void *dst)
{
    if (t == SFK_F32) {
        if ((const void *)src != dst) memmove(dst, src, (size_t)n * 4);
    } else if (t == SFK_BF16) {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = sf_f32_to_bf16(src[i]);
    } else {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = sf_f32_to_f16(src[i]);
    }
}

const float *sfk_row(sfk_dtype t, const void *base, int64_t row, int64_t n, float *scratch)
{
    const char *p = (const char *)base + (size_t)(row * n) * (size_t)sfk_size(t);
    if (t == SFK_F32) return (const float *)p;
    sfk_load(t, p, n, scratch);
    return scratch;
}

/* ---- exp ---------------------------------------------------------------- */

#ifdef SFK_X86
#define AVX2 __attribute__((target("avx2,fma")))

/* exp(x) = 2^k e^r, k = round(x / ln2), |r| <= ln2/2; e^r by its Taylor
 * polynomial to degree 6 (relative error < 2e-7 on that interval).  Below
 * -87.3 the result flushes to 0 (covers -inf). */
AVX2 static inline __m256 exp8(__m256 x)
{
    const __m256 hi = _mm256_set1_ps(88.37f), lo = _mm256_set1_ps(-87.33f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
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
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(under, y);
}

AVX2 static void exp_avx2(const float *src, float *dst, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, exp8(_mm256_loadu_ps(src + i)));
    for (; i < n; i++) dst[i] = expf(src[i]);
}

AVX2 static void scaled_exp_avx2(const float *src, float *dst, int64_t n, float shift, float scale,
                                  float off)
{
    const __m256 sh = _mm256_set1_ps(shift), sc = _mm256_set1_ps(scale), of = _mm256_set1_ps(off);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(src + i), sh));
        _mm256_storeu_ps(dst + i, _mm256_fmsub_ps(sc, e, of));
    }
    for (; i < n; i++) dst[i] = scale * expf(src[i] - shift) - off;
}

AVX2 static float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

AVX2 static float sum_exp_avx2(const float *x, int64_t n, float shift)
{
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    __m256 sh = _mm256_set1_ps(shift);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_add_ps(acc0, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), sh)));
        acc1 = _mm256_add_ps(acc1, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), sh)));
    }
    float s = hsum8(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++) s += expf(x[i] - shift);
    return s;
}

AVX2 static float max_avx2(const float *x, int64_t n)
{
    __m256 m = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    float b[8];
    _mm256_storeu_ps(b, m);
    float r = -INFINITY;
    for (int j = 0; j < 8; j++) r = b[j] > r ? b[j] : r;
    for (; i < n; i++) r = x[i] > r ? x[i] : r;
    return r;
}
#endif

void sfk_exp(const float *src, float *dst, int64_t n)
{
#ifdef SFK_X86
    if (sf_cpu_has_simd()) { exp_avx2(src, dst, n); return; }
#endif
    for (int64_t i = 0; i < n; i++) dst[i] = expf(src[i]);
}

void sfk_scaled_exp(const float *src, float *dst, int64_t n, float shift, float scale, float off)
{
#ifdef SFK_X86
    if (sf_cpu_has_simd()) { scaled_exp_avx2(src, dst, n, shift, scale, off); return; }
#endif
    for (int64_t i = 0; i < n; i++) dst[i] = scale * expf(src[i] - shift) - off;
}

float sfk_sum_exp(const float *x, int64_t n, float shift)
{
#ifdef SFK_X86
    if (sf_cpu_has_simd()) return sum_exp_avx2(x, n, shift);
#endif
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += expf(x[i] - shift);
    return s;
}

float sfk_max(const float *x, int64_t n)
{
#ifdef SFK_X86
    if (sf_cpu_has_simd()) return max_avx2(x, n);
#endif
    float r = -INFINITY;
    for (int64_t i = 0; i < n; i++) r = x[i] > r ? x[i] : r;
    return r;
}

/* ---- threads ------------------------------------------------------------ */

#define SFK_MAX_THREADS 64
static int g_threads = 1;

void sfk_set_num_threads(int n)
{
    g_threads = n < 1 ? 1 : n > SFK_MAX_THREADS ? SFK_MAX_THREADS : n;
}

int sfk_get_num_threads(void) { return g_threads; }

int sfk_threads_for(int64_t rows, int64_t cost)
{
    int t = g_threads;
    if (rows < t) t = (int)(rows > 0 ? rows : 1);
    if (sfk_sat_mul(rows, cost > 0 ? cost : 1) < SFK_PAR_MIN) t = 1;
    return t;
}

typedef struct {
    sfk_rows_fn fn;
    void *ctx;
    int64_t r0, r1;
    int tid;
} job;

static void *run_job(void *arg)
{
    job *j = arg;
    j->fn(j->ctx, j->r0, j->r1, j->tid);
    return NULL;
}

/* rows * t / n without overflow: base * t + (extra * t) / n with rows =
 * base * n + extra (both products fit: base * t <= rows, extra * t < n * n). */
static int64_t split_point(int64_t rows, int t, int n)
{
    const int64_t base = rows / n, extra = rows % n;
    return base * t + extra * t / n;
}

void sfk_parallel_rows(int64_t rows, int nthreads, sfk_rows_fn fn, void *ctx)
{
    if (rows <= 0) return;
    if (nthreads <= 1) { fn(ctx, 0, rows, 0); return; }
    job jobs[SFK_MAX_THREADS];
    pthread_t th[SFK_MAX_THREADS];
    int started[SFK_MAX_THREADS] = {0};
    for (int t = 0; t < nthreads; t++) {
        jobs[t] = (job){fn, ctx, split_point(rows, t, nthreads), split_point(rows, t + 1, nthreads), t};
        /* thread 0's share runs here; a thread that fails to start runs here too */
        if (t > 0) started[t] = pthread_create(&th[t], NULL, run_job, &jobs[t]) == 0;
    }
    run_job(&jobs[0]);
    for (int t = 1; t < nthreads; t++) {
        if (started[t]) pthread_join(th[t], NULL);
        else run_job(&jobs[t]);
    }
}
