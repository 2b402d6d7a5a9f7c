/*
 * half.h -- the one scalar conversion between float32 and the 16-bit float
 * types (IEEE binary16 "float16" and bfloat16), used by every C file that
 * converts (kernels/common.h and comm/reduce.c, whose AVX2 path gives the
 * same bits with F16C and the same integer rounding).
 *
 * Narrowing rounds to nearest, ties to even, overflows to infinity and
 * produces float16 subnormals.  NaNs keep their sign and the top bits of their
 * payload and come out quiet when narrowing; widening a float16 NaN sets its
 * quiet bit too (as F16C's vcvtph2ps does), widening a bfloat16 is exact.  So
 * a round trip through float32 returns every 16-bit NaN with its payload,
 * quieted, and every other value unchanged.
 *
 * Plain C, static inline, no Python.
 */
#ifndef SHARDFORMER_HALF_H
#define SHARDFORMER_HALF_H

#include <stdint.h>
#include <string.h>

static inline uint32_t sf_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float sf_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Exact: a bfloat16 is the top half of a float32 (NaNs pass unchanged). */
static inline float sf_bf16_to_f32(uint16_t h) { return sf_bits_f32((uint32_t)h << 16); }

static inline uint16_t sf_f32_to_bf16(float f)
{
    uint32_t u = sf_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)             /* NaN: quiet, sign + top payload */
        return (uint16_t)((u | 0x00400000u) >> 16);
    u += 0x7fffu + ((u >> 16) & 1u);                 /* nearest, ties to even */
    return (uint16_t)(u >> 16);
}

static inline float sf_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0)                                      /* zero / subnormal: m * 2^-24 */
        return sf_bits_f32(sign | sf_f32_bits((float)m * 5.9604644775390625e-8f));
    if (e == 31)                                     /* inf; NaN quiet, payload kept */
        return sf_bits_f32(sign | 0x7f800000u | (m ? 0x00400000u : 0u) | (m << 13));
    return sf_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

static inline uint16_t sf_f32_to_f16(float f)
{
    uint32_t u = sf_f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)                             /* NaN: quiet, top payload bits */
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u)                            /* inf, or rounds to >= 65536 */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) {                           /* below 2^-14: subnormal half */
        /* In [0.5, 1) the float's ulp is 2^-24, the half subnormal ulp, so
         * the FPU's addition rounds to nearest even for us. */
        float r = sf_bits_f32(a) + 0.5f;
        return (uint16_t)(sign | (uint16_t)(sf_f32_bits(r) - 0x3f000000u));
    }
    a += 0xc8000fffu + ((a >> 13) & 1u);             /* rebias 127 -> 15, round even */
    return (uint16_t)(sign | (uint16_t)(a >> 13));
}

#endif /* SHARDFORMER_HALF_H */
