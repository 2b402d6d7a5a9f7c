/*
 * cpu_features.h -- the one run-time CPU probe of the C core.
 *
 * The SIMD paths of the kernels (csrc/kernels/) and of the reductions
 * (csrc/comm/reduce.c) are compiled with target("avx2,fma,f16c") or a subset
 * and run only when sf_cpu_has_simd() says the CPU has all three; the AVX-512
 * product of attention also needs sf_cpu_has_avx512(), the bf16 skinny linear
 * sf_cpu_has_avx512_bf16().  The probe runs once
 * and is cached (thread-safe).  The environment variable SHARDFORMER_SIMD
 * caps it: "avx512" (AVX-512 without AVX512-BF16), "avx2" (no AVX-512) or
 * "none" (the portable C paths only), read
 * at the first probe.  Plain C, no Python.
 */
#ifndef SHARDFORMER_CPU_FEATURES_H
#define SHARDFORMER_CPU_FEATURES_H

enum {
    SF_CPU_AVX2 = 1u << 0,
    SF_CPU_FMA = 1u << 1,
    SF_CPU_F16C = 1u << 2,
    SF_CPU_AVX512F = 1u << 3,
    SF_CPU_AVX512BW = 1u << 4,
    SF_CPU_AVX512BF16 = 1u << 5,
};

/* SF_CPU_* bits of this CPU (0 on other architectures). */
unsigned sf_cpu_features(void);

/* 1 when AVX2, FMA and F16C are all there: the SIMD kernels run. */
int sf_cpu_has_simd(void);

/* 1 when the SIMD kernels run and AVX-512F is there too. */
int sf_cpu_has_avx512(void);

/* 1 when AVX-512F, AVX-512BW and AVX512-BF16 (vdpbf16ps) are all there too:
 * the skinny linear kernel's bf16 path (csrc/kernels/linear.c). */
int sf_cpu_has_avx512_bf16(void);

#endif /* SHARDFORMER_CPU_FEATURES_H */
