/*
 * common.h -- what every kernel in csrc/kernels/ shares: the element types
 * (fp32, fp16, bf16; arithmetic always in fp32), row conversion to and from
 * fp32, a vectorized exp, and a row-splitting thread helper.
 *
 * Kernels are plain C over pointers and sizes; they never touch Python.
 */
#ifndef SHARDFORMER_KERNELS_COMMON_H
#define SHARDFORMER_KERNELS_COMMON_H

#include <stdint.h>
#include <string.h>

typedef enum { SFK_F32 = 0, SFK_F16 = 1, SFK_BF16 = 2 } sfk_dtype;

/* Return codes of the kernels. */
enum { SFK_OK = 0, SFK_EINVAL = -1, SFK_ENOMEM = -2 };

/* Dropout draws, counter-based so backward redraws them instead of storing a
 * mask: row `row` gets a key hashed from (seed, row), and element j of the
 * row is kept when the top 24 bits of mix(key + j * golden) are >= p * 2^24.
 * Shared by bias-dropout-add and attention. */
static inline uint32_t sfk_mix32(uint32_t h)
{
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    return h ^ (h >> 16);
}

static inline uint32_t sfk_dropout_key(uint64_t seed, int64_t row)
{
    uint32_t r = sfk_mix32((uint32_t)row * 0x9e3779b9u + (uint32_t)((uint64_t)row >> 32));
    return sfk_mix32((uint32_t)seed ^ sfk_mix32((uint32_t)(seed >> 32) ^ r));
}

static inline int sfk_dropout_kept(uint32_t key, int64_t j, uint32_t thresh)
{
    return (sfk_mix32(key + (uint32_t)j * 0x9e3779b9u) >> 8) >= thresh;
}

static inline uint32_t sfk_dropout_threshold(float p) { return (uint32_t)((double)p * 16777216.0); }

static inline uint32_t sfk_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float sfk_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float sfk_bf16_to_f32(uint16_t h) { return sfk_bits_f32((uint32_t)h << 16); }

static inline uint16_t sfk_f32_to_bf16(float f)
{
    uint32_t u = sfk_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)          /* NaN: keep it quiet */
        return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);   /* nearest even */
}

static inline float sfk_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0)                                   /* zero / subnormal: m * 2^-24 */
        return sfk_bits_f32(sign | sfk_f32_bits((float)m * 5.9604644775390625e-8f));
    if (e == 31)
        return sfk_bits_f32(sign | 0x7f800000u | (m << 13));
    return sfk_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

static inline uint16_t sfk_f32_to_f16(float f)
{
    uint32_t u = sfk_f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u)                         /* inf / NaN */
        return sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u);
    if (a >= 0x477ff000u)                         /* rounds to >= 65536: inf */
        return sign | 0x7c00u;
    if (a < 0x38800000u) {                        /* below 2^-14: subnormal half */
        /* In [0.5, 1) the float's ulp is 2^-24, the half subnormal ulp, so
         * the FPU's addition rounds to nearest even for us. */
        float r = sfk_bits_f32(a) + 0.5f;
        return sign | (uint16_t)(sfk_f32_bits(r) - 0x3f000000u);
    }
    a += 0xc8000fffu + ((a >> 13) & 1u);          /* rebias 127 -> 15, round even */
    return sign | (uint16_t)(a >> 13);
}

/* dst[0:n] = src[0:n] as fp32. */
void sfk_load(sfk_dtype t, const void *src, int64_t n, float *dst);
/* dst[0:n] = src[0:n] rounded to t (nearest even). */
void sfk_store(sfk_dtype t, const float *src, int64_t n, void *dst);
/* Row `row` of a [rows, n] array of type t as fp32: the row itself for fp32,
 * else converted into `scratch` (n floats). */
const float *sfk_row(sfk_dtype t, const void *base, int64_t row, int64_t n, float *scratch);
static inline int sfk_size(sfk_dtype t) { return t == SFK_F32 ? 4 : 2; }

/* dst[i] = exp(src[i]); exp(-inf) = 0.  AVX2 where the CPU has it. */
void sfk_exp(const float *src, float *dst, int64_t n);
/* sum_i exp(x[i] - shift), without storing the exponentials. */
/* dst = scale * exp(src - shift) - off, in one pass (dst may be src). */
void sfk_scaled_exp(const float *src, float *dst, int64_t n, float shift, float scale, float off);
float sfk_sum_exp(const float *x, int64_t n, float shift);
float sfk_max(const float *x, int64_t n);    /* -inf for n == 0 */
int sfk_has_avx2(void);

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

#endif
