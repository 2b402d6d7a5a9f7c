/*
 * reduce.c -- dst[i] = op over sources of src[k][i], in source order.
 *
 * Sums of bf16/fp16 accumulate in fp32 and round once to nearest-even, so
 * every rank that reduces the same inputs gets the same bits, and the AVX2
 * path gives the same bits as the plain C one (tests compare the two).
 * max propagates NaN, as torch does.  The scalar conversions are half.h's;
 * the AVX2 path (run where sf_cpu_has_simd()) rounds the same way.
 */
#include "reduce.h"

#include <stdint.h>
#include <string.h>

#include "cpu_features.h"
#include "half.h"

#if defined(__x86_64__) || defined(__i386__)
#define SF_X86 1
#include <immintrin.h>
#endif

size_t sf_red_size(sf_red_dtype t)
{
    switch (t) {
    case SF_RED_F32: case SF_RED_I32: return 4;
    case SF_RED_F16: case SF_RED_BF16: return 2;
    case SF_RED_F64: case SF_RED_I64: return 8;
    default: return 0;
    }
}

static inline float maxf_nan(float acc, float x)
{
    if (x != x) return x;
    if (acc != acc) return acc;
    return x > acc ? x : acc;
}

static inline double maxd_nan(double acc, double x)
{
    if (x != x) return x;
    if (acc != acc) return acc;
    return x > acc ? x : acc;
}

/* ---- plain C ------------------------------------------------------------ */

#define SCALAR_LOOP(T, LOAD, STORE, ACC_T, COMBINE)                           \
    do {                                                                      \
        T *d = (T *)dst;                                                      \
        for (size_t i = start; i < n; i++) {                                  \
            ACC_T acc = LOAD(((const T *)src[0])[i]);                         \
            for (int k = 1; k < nsrc; k++) {                                  \
                ACC_T x = LOAD(((const T *)src[k])[i]);                       \
                acc = COMBINE(acc, x);                                        \
            }                                                                 \
            d[i] = STORE(acc);                                                \
        }                                                                     \
    } while (0)

#define IDENT(x) (x)
#define ADD(a, b) ((a) + (b))
#define MAXI(a, b) ((b) > (a) ? (b) : (a))

static void reduce_scalar(sf_red_dtype t, sf_red_op op, void *dst, const void *const *src,
                          int nsrc, size_t start, size_t n)
{
    switch (t) {
    case SF_RED_F32:
        if (op == SF_RED_SUM) SCALAR_LOOP(float, IDENT, IDENT, float, ADD);
        else SCALAR_LOOP(float, IDENT, IDENT, float, maxf_nan);
        break;
    case SF_RED_BF16:
        if (op == SF_RED_SUM) SCALAR_LOOP(uint16_t, sf_bf16_to_f32, sf_f32_to_bf16, float, ADD);
        else SCALAR_LOOP(uint16_t, sf_bf16_to_f32, sf_f32_to_bf16, float, maxf_nan);
        break;
    case SF_RED_F16:
        if (op == SF_RED_SUM) SCALAR_LOOP(uint16_t, sf_f16_to_f32, sf_f32_to_f16, float, ADD);
        else SCALAR_LOOP(uint16_t, sf_f16_to_f32, sf_f32_to_f16, float, maxf_nan);
        break;
    case SF_RED_F64:
        if (op == SF_RED_SUM) SCALAR_LOOP(double, IDENT, IDENT, double, ADD);
        else SCALAR_LOOP(double, IDENT, IDENT, double, maxd_nan);
        break;
    case SF_RED_I32:
        /* wrap-around sums, as torch's int tensors do: add as unsigned */
        if (op == SF_RED_SUM) SCALAR_LOOP(uint32_t, IDENT, IDENT, uint32_t, ADD);
        else SCALAR_LOOP(int32_t, IDENT, IDENT, int32_t, MAXI);
        break;
    case SF_RED_I64:
        if (op == SF_RED_SUM) SCALAR_LOOP(uint64_t, IDENT, IDENT, uint64_t, ADD);
        else SCALAR_LOOP(int64_t, IDENT, IDENT, int64_t, MAXI);
        break;
    default:
        break;
    }
}

/* ---- AVX2 + F16C ----------------------------------------------------------- */

#ifdef SF_X86
#define AVX2 __attribute__((target("avx2,f16c")))

AVX2 static inline __m256 ld_bf16(const uint16_t *p)
{
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

AVX2 static inline void st_bf16(uint16_t *p, __m256 v)
{
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    __m256i q = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));
    __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(q), nan));
    r = _mm256_srli_epi32(r, 16);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128((__m128i *)p, packed);
}

AVX2 static inline __m256 ld_f16(const uint16_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

AVX2 static inline void st_f16(uint16_t *p, __m256 v)
{
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

AVX2 static inline __m256 max_nan(__m256 acc, __m256 x)
{
    /* max_ps returns its second operand when either is NaN: keep acc's NaN,
     * then take x where x is NaN. */
    __m256 m = _mm256_max_ps(x, acc);
    return _mm256_blendv_ps(m, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

#define SIMD_LOOP(T, LOAD, STORE, COMBINE)                                    \
    do {                                                                      \
        T *d = (T *)dst;                                                      \
        for (; i + 8 <= n; i += 8) {                                          \
            __m256 acc = LOAD((const T *)src[0] + i);                         \
            for (int k = 1; k < nsrc; k++)                                    \
                acc = COMBINE(acc, LOAD((const T *)src[k] + i));              \
            STORE(d + i, acc);                                                \
        }                                                                     \
    } while (0)

#define LD_F32(p) _mm256_loadu_ps(p)
#define ST_F32(p, v) _mm256_storeu_ps((p), (v))

/* Returns how many leading elements it did; the caller finishes the tail. */
AVX2 static size_t reduce_avx2(sf_red_dtype t, sf_red_op op, void *dst, const void *const *src,
                               int nsrc, size_t n)
{
    size_t i = 0;
    switch (t) {
    case SF_RED_F32:
        if (op == SF_RED_SUM) SIMD_LOOP(float, LD_F32, ST_F32, _mm256_add_ps);
        else SIMD_LOOP(float, LD_F32, ST_F32, max_nan);
        break;
    case SF_RED_BF16:
        if (op == SF_RED_SUM) SIMD_LOOP(uint16_t, ld_bf16, st_bf16, _mm256_add_ps);
        else SIMD_LOOP(uint16_t, ld_bf16, st_bf16, max_nan);
        break;
    case SF_RED_F16:
        if (op == SF_RED_SUM) SIMD_LOOP(uint16_t, ld_f16, st_f16, _mm256_add_ps);
        else SIMD_LOOP(uint16_t, ld_f16, st_f16, max_nan);
        break;
    case SF_RED_I32: {
        int32_t *d = (int32_t *)dst;
        for (; i + 8 <= n; i += 8) {
            __m256i acc = _mm256_loadu_si256((const __m256i *)((const int32_t *)src[0] + i));
            for (int k = 1; k < nsrc; k++) {
                __m256i x = _mm256_loadu_si256((const __m256i *)((const int32_t *)src[k] + i));
                acc = op == SF_RED_SUM ? _mm256_add_epi32(acc, x) : _mm256_max_epi32(acc, x);
            }
            _mm256_storeu_si256((__m256i *)(d + i), acc);
        }
        break;
    }
    default:  /* f64, i64: the plain loop (the compiler vectorizes it) */
        break;
    }
    return i;
}

#endif

sf_status sf_reduce(sf_red_dtype t, sf_red_op op, void *dst, const void *const *src, int nsrc,
                    size_t n, int use_simd, sf_error *err)
{
    if ((unsigned)t >= SF_RED_NTYPES)
        return sf_fail(err, SF_ETYPE, "reduce: element type %d is not one of the %d reducible "
                       "types", (int)t, (int)SF_RED_NTYPES);
    if (op != SF_RED_SUM && op != SF_RED_MAX)
        return sf_fail(err, SF_EINVAL, "reduce: op=%d is neither sum (%d) nor max (%d)", (int)op,
                       (int)SF_RED_SUM, (int)SF_RED_MAX);
    if (nsrc < 1)
        return sf_fail(err, SF_EINVAL, "reduce: nsrc=%d must be >= 1", nsrc);
    if (n > 0 && (!dst || !src))
        return sf_fail(err, SF_EINVAL, "reduce: %s is NULL with n=%zu elements", dst ? "src" : "dst",
                       n);
    for (int k = 0; n > 0 && k < nsrc; k++)
        if (!src[k])
            return sf_fail(err, SF_EINVAL, "reduce: src[%d] is NULL with n=%zu elements", k, n);
    if (n == 0)
        return SF_OK;
    size_t done = 0;
#ifdef SF_X86
    if (use_simd && sf_cpu_has_simd())
        done = reduce_avx2(t, op, dst, src, nsrc, n);
#else
    (void)use_simd;
#endif
    reduce_scalar(t, op, dst, src, nsrc, done, n);
    return SF_OK;
}
