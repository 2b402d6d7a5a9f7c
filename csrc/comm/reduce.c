/*
 * reduce.c -- dst[i] = op over sources of src[k][i], in source order.
 *
 * Sums of bf16/fp16 accumulate in fp32 and round once to nearest-even, so
 * every rank that reduces the same inputs gets the same bits, and the AVX2
 * path gives the same bits as the plain C one (tests compare the two).
 * max propagates NaN, as torch does.
 */
#include "reduce.h"

#include <stdint.h>
#include <string.h>

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

/* ---- scalar conversions ------------------------------------------------ */

static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u | 0x00400000u) >> 16);   /* quiet NaN, sign kept */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0) {
        if (man == 0)
            return bits_f32(sign);
        /* subnormal: man * 2^-24 */
        float v = (float)man * bits_f32(0x33800000u);
        return bits_f32(sign | f32_bits(v));
    }
    if (exp == 31)
        return bits_f32(sign | 0x7f800000u | (man << 13));
    return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline uint16_t f32_to_f16(float f)
{
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u >= 0x7f800000u)                       /* inf or NaN (NaN kept quiet) */
        return (uint16_t)(sign | 0x7c00u | (u > 0x7f800000u ? 0x200u | ((u >> 13) & 0x3ffu) : 0));
    if (u >= 0x477ff000u)                       /* rounds to >= 2^16: inf */
        return (uint16_t)(sign | 0x7c00u);
    if (u < 0x38800000u) {                      /* below 2^-14: subnormal half */
        /* Adding 0.5 puts the half's subnormal ulp (2^-24) at the float's
         * last mantissa bit, so the FPU rounds to nearest-even for us. */
        float v = bits_f32(u) + 0.5f;
        return (uint16_t)(sign | (f32_bits(v) - 0x3f000000u));
    }
    u += 0xc8000fffu + ((u >> 13) & 1u);        /* rebias exponent (-112 << 23), round */
    return (uint16_t)(sign | (u >> 13));
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
        if (op == SF_RED_SUM) SCALAR_LOOP(uint16_t, bf16_to_f32, f32_to_bf16, float, ADD);
        else SCALAR_LOOP(uint16_t, bf16_to_f32, f32_to_bf16, float, maxf_nan);
        break;
    case SF_RED_F16:
        if (op == SF_RED_SUM) SCALAR_LOOP(uint16_t, f16_to_f32, f32_to_f16, float, ADD);
        else SCALAR_LOOP(uint16_t, f16_to_f32, f32_to_f16, float, maxf_nan);
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

int sf_cpu_has_avx2(void)
{
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    }
    return cached;
}
#else
int sf_cpu_has_avx2(void) { return 0; }
#endif

int sf_reduce(sf_red_dtype t, sf_red_op op, void *dst, const void *const *src, int nsrc,
              size_t n, int use_simd)
{
    if (!dst || !src || nsrc < 1 || (unsigned)t >= SF_RED_NTYPES ||
        (op != SF_RED_SUM && op != SF_RED_MAX))
        return 1;
    for (int k = 0; k < nsrc; k++)
        if (!src[k])
            return 1;
    size_t done = 0;
#ifdef SF_X86
    if (use_simd && sf_cpu_has_avx2())
        done = reduce_avx2(t, op, dst, src, nsrc, n);
#else
    (void)use_simd;
#endif
    reduce_scalar(t, op, dst, src, nsrc, done, n);
    return 0;
}
