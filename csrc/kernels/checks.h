/*
 * checks.h -- the element types of the kernels and the argument checks
 * they share, CPU (csrc/kernels/) and CUDA (csrc/cuda/) alike, so both
 * refuse bad arguments with the same messages.  Plain C, no Python.
 */
#ifndef SHARDFORMER_KERNELS_CHECKS_H
#define SHARDFORMER_KERNELS_CHECKS_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { SFK_F32 = 0, SFK_F16 = 1, SFK_BF16 = 2 } sfk_dtype;

/* Argument checks shared by the kernels; `fn` names the kernel in messages.
 * sfk_check_dtype: t is one of the three types (ETYPE).
 * sfk_check_size:  value >= 0 (EINVAL: "fn: name=value must be >= 0").
 * sfk_check_ptr:   p != NULL when `count` > 0 elements are to be touched.
 * sfk_no_memory:   ENOMEM naming the kernel and the bytes it wanted. */
sf_status sfk_check_dtype(const char *fn, sfk_dtype t, sf_error *err);
sf_status sfk_check_size(const char *fn, const char *name, int64_t value, sf_error *err);
sf_status sfk_check_ptr(const char *fn, const char *name, const void *p, int64_t count,
                        sf_error *err);
sf_status sfk_no_memory(const char *fn, double bytes, sf_error *err);
/* count * per floats in bytes, into *bytes: EOVERFLOW naming the kernel and
 * `what` when that does not fit int64 / size_t (scratch sizes). */
sf_status sfk_float_bytes(const char *fn, const char *what, int64_t count, int64_t per,
                          size_t *bytes, sf_error *err);

/* The argument checks of each kernel family, shared by the CPU kernels and
 * their CUDA forms (so both refuse the same input with the same message):
 *   norm:        dtype, rows / n >= 0, x and rstd present
 *   xent:        dtype, rows / n / vocab_start >= 0, vocab_real in [0, n],
 *                labels and logits present
 *   embedding:   dtype, d / vocab_real / vocab_start / count >= 0, ids present
 *   elementwise: dtype, rows / n >= 0
 *   dropout_p:   p in [0, 1] */
sf_status sfk_check_norm_args(const char *fn, sfk_dtype t, int64_t rows, int64_t n, const void *x,
                       const float *rstd, sf_error *err);
sf_status sfk_check_xent_args(const char *fn, sfk_dtype t, int64_t rows, int64_t n, int64_t real,
                       int64_t vocab_start, const void *logits, const int64_t *labels,
                       sf_error *err);
sf_status sfk_check_embedding_args(const char *fn, sfk_dtype t, int64_t d, int64_t real, int64_t count,
                       int64_t vocab_start, const int64_t *ids, sf_error *err);
sf_status sfk_check_elementwise_args(const char *fn, sfk_dtype t, int64_t rows, int64_t n, sf_error *err);
sf_status sfk_check_dropout_p(const char *fn, float p, sf_error *err);

#ifdef __cplusplus
}
#endif

#endif
