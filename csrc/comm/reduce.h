/*
 * reduce.h -- element-wise reductions over several buffers, the arithmetic of
 * the shared-memory collectives: an AVX2 (+F16C) path chosen at run time and a
 * plain C fallback that gives the same bits.  Plain C, no Python.
 */
#ifndef SHARDFORMER_COMM_REDUCE_H
#define SHARDFORMER_COMM_REDUCE_H

#include <stddef.h>

#include "status.h"

/* Element types the reductions understand. */
typedef enum {
    SF_RED_F32, SF_RED_F16, SF_RED_BF16, SF_RED_F64, SF_RED_I32, SF_RED_I64, SF_RED_NTYPES
} sf_red_dtype;

typedef enum { SF_RED_SUM, SF_RED_MAX } sf_red_op;

size_t sf_red_size(sf_red_dtype t);

/* dst[i] = op(src[0][i], ..., src[nsrc-1][i]) for i < n, summed in rank order
 * (bf16/fp16 accumulate in fp32 and round once).  dst may alias a source.
 * use_simd: 1 for the AVX2 path where sf_cpu_has_simd() (cpu_features.h),
 * 0 for plain C.  ETYPE / EINVAL for a bad type, op, count or pointer. */
sf_status sf_reduce(sf_red_dtype t, sf_red_op op, void *dst, const void *const *src, int nsrc,
                    size_t n, int use_simd, sf_error *err);

#endif
