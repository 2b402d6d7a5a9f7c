/*
 * linear.h -- the linear map on few rows ("skinny"), as in decoding.
 *
 *   y[m, n] = x[m, k] W[n, k]^T (+ b[n])       y_ij = sum_l x_il W_jl + b_j
 *
 * x, W and y share one element type t (fp32, fp16 or bf16); b is fp32 or
 * NULL; the sums are fp32.  W is nn.Linear's layout: row j, the k weights of
 * output j, contiguous; consecutive rows ldw >= k elements apart (ldw = k: W
 * is contiguous; ldw > k: W is a column slice W_full[:, c0:c0+k] of a wider
 * row-major tensor, as a memory-mapped row-parallel shard is, read in place).
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
 *
 * Paths (sfk_linear_path), chosen at run time by the CPU probe
 * (cpu_features.h) or forced by the caller (tests, benchmarks):
 *   PORTABLE     plain C, element by element;
 *   AVX2         AVX2 + FMA + F16C: weights widened to fp32 in registers,
 *                fp32 products and sums (every dtype);
 *   AVX512_BF16  bf16 only, AVX-512F/BW + AVX512-BF16: vdpbf16ps on x and
 *                W as they are.  The contract: x and W are bf16 already,
 *                so each product x_il W_jl is exact in fp32 (8-bit
 *                significands: a 16-bit product), and the products are
 *                summed in fp32, rounded to nearest even at each add (pairs
 *                of products into 16 fp32 lanes, then one tree sum); the
 *                instruction treats bf16 / fp32 subnormals (|v| < 1.2e-38)
 *                as zero, which changes no sum by more than that.  Only the
 *                order of the fp32 additions differs from the AVX2 path.
 * AUTO takes AVX512_BF16 for bf16 where the CPU has it, else AVX2 where the
 * CPU has it, else PORTABLE.  A forced path the CPU (or SHARDFORMER_SIMD)
 * lacks, or AVX512_BF16 for another dtype, is refused (EINVAL).
 */
#ifndef SHARDFORMER_KERNELS_LINEAR_H
#define SHARDFORMER_KERNELS_LINEAR_H

#include "common.h"

typedef enum {
    SFK_LIN_AUTO = 0,
    SFK_LIN_PORTABLE = 1,
    SFK_LIN_AVX2 = 2,
    SFK_LIN_AVX512_BF16 = 3,
} sfk_linear_path;

/* The path AUTO takes for dtype t on this CPU. */
sfk_linear_path sfk_skinny_linear_auto(sfk_dtype t);

/* x [m, k] and y [m, n] contiguous; W [n, k] with rows ldw elements apart. */
sf_status sfk_skinny_linear(sfk_dtype t, const void *x, const void *w, int64_t ldw, const float *b,
                            int64_t m, int64_t n, int64_t k, void *y, sfk_linear_path path,
                            sf_error *err);

#endif
