/*
 * elementwise.h -- fused elementwise ops, forward and backward.
 *
 * Arrays of type t are [rows, n] (or flat, for SwiGLU); bias and its
 * gradient are fp32 [n] and may be NULL.  Arithmetic is fp32.
 *
 *   bias_gelu:          y = gelu(x + b); erf form 0.5 u (1 + erf(u / sqrt 2)),
 *                       tanh form 0.5 u (1 + tanh(sqrt(2/pi) (u + 0.044715 u^3)))
 *                       dx = dy * gelu'(x + b), db = sum over rows of dx
 *   swiglu:             y = silu(g) * u, silu(g) = g sigmoid(g)
 *                       dg = dy u sigmoid(g) (1 + g (1 - sigmoid(g))), du = dy silu(g)
 *   bias_dropout_add:   y = r + keep * (x + b) / (1 - p), keep drawn from (seed, row,
 *                       column) by a counter-based hash, so backward redraws it:
 *                       dx = dy keep / (1 - p), db = sum over rows of dx, dr = dy
 */
#ifndef SHARDFORMER_KERNELS_ELEMENTWISE_H
#define SHARDFORMER_KERNELS_ELEMENTWISE_H

#include "common.h"

sf_status sfk_bias_gelu_forward(sfk_dtype t, const void *x, const float *b, int64_t rows, int64_t n,
                                int tanh_approx, void *y, sf_error *err);
sf_status sfk_bias_gelu_backward(sfk_dtype t, const void *dy, const void *x, const float *b,
                                 int64_t rows, int64_t n, int tanh_approx, void *dx, float *db,
                                 sf_error *err);

sf_status sfk_swiglu_forward(sfk_dtype t, const void *gate, const void *up, int64_t numel, void *y,
                             sf_error *err);
sf_status sfk_swiglu_backward(sfk_dtype t, const void *dy, const void *gate, const void *up,
                              int64_t numel, void *dgate, void *dup, sf_error *err);

/* p outside [0, 1] is EINVAL. */
sf_status sfk_bias_dropout_add_forward(sfk_dtype t, const void *x, const float *b, const void *res,
                                       int64_t rows, int64_t n, float p, uint64_t seed, void *y,
                                       sf_error *err);
sf_status sfk_bias_dropout_add_backward(sfk_dtype t, const void *dy, int64_t rows, int64_t n,
                                        float p, uint64_t seed, void *dx, float *db, sf_error *err);
/* 1 if flat element `index` of a [rows, n] array is kept under (p, seed),
 * as the kernels draw it (from (seed, row) and the column). */
int sfk_dropout_keep(uint64_t seed, int64_t index, int64_t n, float p);

#endif
