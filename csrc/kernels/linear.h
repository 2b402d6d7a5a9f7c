/*
 * linear.h -- the linear map on few rows ("skinny"), as in decoding.
 *
 *   y[m, n] = x[m, k] W[n, k]^T (+ b[n])       y_ij = sum_l x_il W_jl + b_j
 *
 * x, W and y share one element type t (fp32, fp16 or bf16); b is fp32 or
 * NULL; the sums are fp32.  W is nn.Linear's layout: row j, the k weights of
 * output j, contiguous.
 *
 * Made for m of one to a few rows (a decode step: one token per sequence),
 * where the product is bound by reading W: every weight is used m times, so
 * the time is the bytes of W over the memory's read rate.  The kernel
 * streams W once, four rows at a time, and dots each block of rows with the
 * rows of x (held as fp32 in the cache) two at a time, in fp32 FMA lanes.
 * 16-bit weights are widened in registers (bf16: a 16-bit shift; fp16:
 * F16C), never copied.  Rows of W are split over the kernels' threads
 * (sfk_parallel_rows).  Any m is computed correctly; past a few rows a
 * blocked GEMM (torch's) is faster, so callers choose.
 */
#ifndef SHARDFORMER_KERNELS_LINEAR_H
#define SHARDFORMER_KERNELS_LINEAR_H

#include "common.h"

sf_status sfk_skinny_linear(sfk_dtype t, const void *x, const void *w, const float *b, int64_t m,
                            int64_t n, int64_t k, void *y, sf_error *err);

#endif
