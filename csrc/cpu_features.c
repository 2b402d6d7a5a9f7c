/*
 * cpu_features.c -- see cpu_features.h.
 */
#include "cpu_features.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* -1 until probed; the bits otherwise.  Two threads probing at once store
 * the same value. */
static _Atomic int g_features = -1;

static unsigned probe(void)
{
    unsigned f = 0;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) f |= SF_CPU_AVX2;
    if (__builtin_cpu_supports("fma")) f |= SF_CPU_FMA;
    if (__builtin_cpu_supports("f16c")) f |= SF_CPU_F16C;
    if (__builtin_cpu_supports("avx512f")) f |= SF_CPU_AVX512F;
    if (__builtin_cpu_supports("avx512bw")) f |= SF_CPU_AVX512BW;
    if (__builtin_cpu_supports("avx512bf16")) f |= SF_CPU_AVX512BF16;
#endif
    /* SHARDFORMER_SIMD caps what is used (read once, at the first probe):
     * "avx512" leaves AVX512-BF16 out, "avx2" all of AVX-512, "none" every
     * SIMD path (the portable C); for tests of the narrower paths on a wider
     * CPU, and for comparing them */
    const char *cap = getenv("SHARDFORMER_SIMD");
    if (cap && strcmp(cap, "avx512") == 0) f &= ~(unsigned)SF_CPU_AVX512BF16;
    else if (cap && strcmp(cap, "avx2") == 0)
        f &= ~(unsigned)(SF_CPU_AVX512F | SF_CPU_AVX512BW | SF_CPU_AVX512BF16);
    else if (cap && strcmp(cap, "none") == 0) f = 0;
    return f;
}

unsigned sf_cpu_features(void)
{
    int f = atomic_load_explicit(&g_features, memory_order_relaxed);
    if (f < 0) {
        f = (int)probe();
        atomic_store_explicit(&g_features, f, memory_order_relaxed);
    }
    return (unsigned)f;
}

int sf_cpu_has_simd(void)
{
    const unsigned need = SF_CPU_AVX2 | SF_CPU_FMA | SF_CPU_F16C;
    return (sf_cpu_features() & need) == need;
}

int sf_cpu_has_avx512(void)
{
    return sf_cpu_has_simd() && (sf_cpu_features() & SF_CPU_AVX512F) != 0;
}

int sf_cpu_has_avx512_bf16(void)
{
    const unsigned need = SF_CPU_AVX512F | SF_CPU_AVX512BW | SF_CPU_AVX512BF16;
    return sf_cpu_has_simd() && (sf_cpu_features() & need) == need;
}
